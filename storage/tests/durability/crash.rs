//! Crash tests of the whole region: a child process writes batches with fsync=always under tiny
//! budgets (so it is often mid-flush or mid-compaction) and prints each acknowledged batch; it is
//! killed with SIGKILL at random moments. After each kill the region reopens, every acknowledged
//! write is there with its value, every acknowledged delete holds, and the store is consistent.

use std::process::Command;

use dpukv_storage::region::{Region, RegionConfig};
use dpukv_storage::vlog::FsyncPolicy;

use crate::sigkill::Killer;

const TOOL: &str = env!("CARGO_BIN_EXE_dpukv-store");

fn crash_value(i: u64) -> Vec<u8> {
    let len = (i * 37 % 300) as usize;
    (0..len).map(|j| (i as usize + j) as u8).collect()
}

fn must_check(data: &std::path::Path, shm: &std::path::Path, acked: i64, it: u32) {
    let (r, rec) = Region::open(RegionConfig::tiny(data, shm, FsyncPolicy::Always))
        .unwrap_or_else(|e| panic!("iteration {it}: reopen failed: {e}"));
    for j in 0..=acked.max(-1) {
        let j = j as u64;
        let got = r.get(format!("k{j:08}").as_bytes()).expect("get");
        let deleter = j + 3;
        if deleter.is_multiple_of(5) && deleter as i64 <= acked {
            assert_eq!(got, None, "iteration {it}: key {j} was deleted by acknowledged batch {deleter}");
        } else if !(deleter.is_multiple_of(5) && deleter as i64 > acked) {
            assert_eq!(
                got.as_deref(),
                Some(crash_value(j).as_slice()),
                "iteration {it}: acknowledged key {j} lost (acked {acked}, recovery {rec:?})"
            );
        }
    }
    // Whatever else survived is a value that was written, in order.
    let all = r.scan(b"k", b"l", usize::MAX).expect("scan");
    for w in all.windows(2) {
        assert!(w[0].0 < w[1].0, "iteration {it}: scan out of order");
    }
    for (k, v) in &all {
        let i: u64 = std::str::from_utf8(&k[1..]).expect("utf8").parse().expect("number");
        assert_eq!(v, &crash_value(i), "iteration {it}: key {i} has a value that was never written");
    }
}

#[test]
fn sigkill_loses_no_acknowledged_write() {
    let iterations: u32 = std::env::var("DPUKV_CRASH_ITERATIONS").ok().and_then(|s| s.parse().ok()).unwrap_or(25);
    let dir = tempfile::tempdir().expect("tempdir");
    let (data, shm) = (dir.path().join("data"), dir.path().join("shm"));
    let mut acked: i64 = -1;
    let mut killer = Killer::new(99);
    // At least `iterations` kills, and on until enough was acknowledged to have something to lose.
    let mut it = 0;
    while it < iterations || (acked <= 100 && it < iterations * 4) {
        let mut cmd = Command::new(TOOL);
        cmd.arg("region-writer").args([&data, &shm]).args(["--start", &(acked + 1).to_string()]);
        let last = killer.run(&mut cmd, 40, 200, |line| line.strip_prefix("ack ").and_then(|s| s.parse().ok()));
        acked = acked.max(last);
        must_check(&data, &shm, acked, it);
        it += 1;
    }
    eprintln!("{it} kills, {acked} batches acknowledged");
    assert!(acked > 100, "the writer acknowledged only {acked} batches");
}

/// Recovery streams the log tail through a bounded buffer: a process that opens a region with
/// 48 MiB of log to replay (values kept in the log, pointers in L0) peaks far below that.
#[test]
fn replay_memory_is_bounded_by_its_buffer_not_by_the_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (data, shm) = (dir.path().join("data"), dir.path().join("shm"));
    let mut r = Region::open(RegionConfig::new(&data, &shm)).expect("open").0;
    let value = vec![0x5au8; 4096];
    let writes = 12 * 1024u64;
    for i in 0..writes {
        r.put(format!("key{i:08}").as_bytes(), &value).expect("put");
    }
    drop(r);
    let out = Command::new(TOOL).arg("region-open").arg(&data).arg(&shm).output().expect("run dpukv-store");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    let field = |name: &str| -> u64 {
        let mut it = line.split_whitespace();
        while let Some(w) = it.next() {
            if w == name {
                return it.next().and_then(|v| v.parse().ok()).expect("a number");
            }
        }
        panic!("no {name} in {line:?}")
    };
    assert_eq!(field("replayed"), writes, "the whole tail is replayed");
    let peak_mib = field("peak_kib") >> 10;
    eprintln!("replay of {writes} writes of 4 KiB peaked at {peak_mib} MiB");
    assert!(peak_mib < 32, "recovery of 48 MiB of log peaked at {peak_mib} MiB");
}
