//! Corrupt or truncated arenas given to a reader: an error, never a panic or an out-of-bounds
//! read.

use std::panic::AssertUnwindSafe;

use dpukv_storage::{ArenaConfig, Error, Reader};

use crate::common::{Rng, must_writer};

fn must_populated_arena() -> (tempfile::TempDir, Vec<u8>, ArenaConfig) {
    let cfg = ArenaConfig { capacity: 4 << 20, ..ArenaConfig::small_nodes(512) };
    let (dir, path, mut w) = must_writer(&cfg);
    let mut rng = Rng(3);
    for i in 0..1500u32 {
        let v = rng.bytes_upto(if i % 10 == 0 { 120 } else { 30 });
        w.put(format!("key{:05}", rng.below(3000)).as_bytes(), &v).expect("put");
    }
    let bytes = std::fs::read(&path).expect("read arena");
    drop(w);
    (dir, bytes, cfg)
}

/// Opens `bytes` as an arena and reads everything every way; returns whether any read failed.
fn read_all(dir: &std::path::Path, bytes: &[u8]) -> Result<bool, Error> {
    let p = dir.join("c.arena");
    std::fs::write(&p, bytes).expect("write");
    let mut r = Reader::open(&p)?;
    let s = r.snapshot()?;
    let mut failed = false;
    failed |= s.scan(b"", b"\xff", usize::MAX).is_err();
    for i in (0..3000).step_by(17) {
        let k = format!("key{i:05}");
        failed |= s.get(k.as_bytes()).is_err();
        failed |= s.floor_scan(k.as_bytes(), b"key9", 20).is_err();
    }
    Ok(failed)
}

#[test]
fn truncated_arena_is_an_error() {
    let (dir, bytes, _) = must_populated_arena();
    for len in [0, 10, 100, 4095, 4096, 8192, bytes.len() / 2, bytes.len() - 1] {
        match read_all(dir.path(), &bytes[..len]) {
            Err(Error::Corrupt { .. }) => {}
            other => panic!("truncated to {len}: {other:?}"),
        }
    }
    assert!(!read_all(dir.path(), &bytes).expect("intact arena opens"), "intact arena reads cleanly");
}

#[test]
fn corrupt_superblock_is_an_error() {
    let (dir, bytes, _) = must_populated_arena();
    let mut rng = Rng(5);
    for _ in 0..200 {
        let mut b = bytes.clone();
        let at = rng.below(116) as usize;
        b[at] ^= 1 << rng.below(8);
        assert!(matches!(read_all(dir.path(), &b), Err(Error::Corrupt { .. })), "flip at {at} accepted");
    }
}

#[test]
fn random_corruption_never_panics() {
    let (dir, bytes, cfg) = must_populated_arena();
    let mut rng = Rng(17);
    let heap_start = 4096usize; // everything after the superblock: slots, page table, nodes, blobs
    let used = bytes.iter().rposition(|&b| b != 0).unwrap_or(bytes.len() - 1) + 1;
    let mut errors = 0;
    let runs = std::env::var("DPUKV_CORRUPT_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    for run in 0..runs {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(20) {
            let at = heap_start + rng.below((used - heap_start) as u64) as usize;
            b[at] = if rng.below(3) == 0 { 0xff } else { rng.next() as u8 };
        }
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| read_all(dir.path(), &b)));
        match r {
            Ok(Ok(true)) | Ok(Err(_)) => errors += 1,
            Ok(Ok(false)) => {}
            Err(_) => panic!("reader panicked on corrupt arena (run {run}, node size {})", cfg.node_size),
        }
    }
    assert!(errors > runs / 10, "corruption was detected only {errors} times of {runs}");
}
