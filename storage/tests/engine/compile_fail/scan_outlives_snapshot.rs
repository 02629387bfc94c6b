// Items of a scan borrow the snapshot too.
fn main() -> dpukv_storage::Result<()> {
    let mut r = dpukv_storage::Reader::open("unused.arena")?;
    let items = r.snapshot()?.scan(b"a", b"z", 10)?;
    println!("{items:?}");
    Ok(())
}
