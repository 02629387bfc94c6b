// A value read through a snapshot must not outlive it: once the snapshot is dropped its pin is
// gone and the writer may reuse the memory under the value.
fn main() -> dpukv_storage::Result<()> {
    let mut r = dpukv_storage::Reader::open("unused.arena")?;
    let v = {
        let s = r.snapshot()?;
        s.get(b"k")?.expect("present")
    };
    println!("{v:?}");
    Ok(())
}
