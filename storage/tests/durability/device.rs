//! Device-side reader processes read L0, the levels and the log while this process writes, the
//! region flushes and compacts constantly, and garbage collection rewrites values and deletes
//! log segments (fsync `always`: readers see only durable writes): every scan sees all accounts
//! and exactly the total, and no reader ever finds a file of its table set gone.

use std::process::Command;
use std::time::{Duration, Instant};

use dpukv_storage::BatchOp;
use dpukv_storage::region::{Region, RegionConfig};
use dpukv_storage::vlog::FsyncPolicy;
use dpukv_storage::workload::Bank;

const TOOL: &str = env!("CARGO_BIN_EXE_dpukv-store");

struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn device_reader_sees_consistent_region_during_compactions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (data, shm) = (dir.path().join("data"), dir.path().join("shm"));
    let mut region = Region::open(RegionConfig::tiny(&data, &shm, FsyncPolicy::Always)).expect("open").0;
    let bank = Bank { accounts: 150, initial: 1000, pad: 0 };
    let keys: Vec<Vec<u8>> = (0..bank.accounts).map(Bank::account_key).collect();
    let init = bank.initial.to_le_bytes();
    let ops: Vec<BatchOp> = keys.iter().map(|k| BatchOp::Put(k, &init)).collect();
    let ack = region.write_batch(&ops).expect("init");
    region.wait_durable(ack.end).expect("durable");
    // The readers check until the writer has done its work (however long that takes on this
    // machine), then are told to stop.
    let stop = dir.path().join("stop");
    let mut readers: Vec<Reaped> = (0..2)
        .map(|_| {
            let mut c = Command::new(TOOL);
            c.args(["region-bank"]).arg(&shm).args(["--accounts", "150", "--initial", "1000", "--seconds", "120"]);
            c.arg("--stop-file").arg(&stop);
            Reaped(c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("spawn"))
        })
        .collect();
    let mut x = 7u64;
    let start = Instant::now();
    let mut n = 0u64;
    let (mut collected, mut deleted) = (0, 0);
    loop {
        let s = region.stats();
        let done = s.flushes > 10 && s.compactions > 1 && collected > 0 && deleted > 0;
        // A reader that stops early has found a fault: its output is checked below.
        let a_reader_stopped = readers.iter_mut().any(|r| r.0.try_wait().expect("try_wait").is_some());
        if (done && start.elapsed() > Duration::from_secs(2)) || a_reader_stopped {
            break;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let (a, b) = ((x % 150) as u32, ((x >> 20) % 150) as u32);
        let (ka, kb) = (Bank::account_key(a), Bank::account_key(b));
        let ba = u64::from_le_bytes(region.get(&ka).expect("get").expect("account").try_into().expect("8 bytes"));
        let bb = u64::from_le_bytes(region.get(&kb).expect("get").expect("account").try_into().expect("8 bytes"));
        let amt = if a == b { 0 } else { (x >> 40) % (ba + 1) };
        let (va, vb) = ((ba - amt).to_le_bytes(), (bb + amt).to_le_bytes());
        let filler = Bank::filler_key(a, (n % 7) as u32);
        let fv = vec![n as u8; (x % 90) as usize];
        let mut ops = vec![BatchOp::Put(&ka, &va), BatchOp::Put(&kb, &vb)];
        ops.push(if n.is_multiple_of(3) { BatchOp::Delete(&filler) } else { BatchOp::Put(&filler, &fv) });
        region.write_batch(&ops).expect("transfer");
        n += 1;
        if n.is_multiple_of(10) {
            let m = region.maintain().expect("maintain");
            collected += m.gc.deleted;
            deleted += m.deleted_files;
        }
        assert!(start.elapsed() < Duration::from_secs(100), "the region did not flush, compact and collect: {s:?}");
    }
    std::fs::write(&stop, b"").expect("stop file");
    let s = region.stats();
    assert!(s.flushes > 10 && s.compactions > 1, "the region should have flushed and compacted: {s:?}");
    assert!(collected > 0 && deleted > 0, "garbage collection ran: {collected} segments, {deleted} files deleted");
    for r in readers.iter_mut() {
        let child = std::mem::replace(&mut r.0, Command::new("true").spawn().expect("true"));
        let out = child.wait_with_output().expect("output");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "reader failed: {text} {}", String::from_utf8_lossy(&out.stderr));
        let field = |name: &str| -> u64 {
            text.split_whitespace().find_map(|w| w.strip_prefix(name)).and_then(|v| v.parse().ok()).unwrap_or(0)
        };
        assert!(field("checks=") > 10, "{text}");
        assert!(field("reloads=") > 2, "the reader should have followed table-set changes: {text}");
    }
}
