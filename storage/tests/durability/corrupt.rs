//! Torn writes and corruption in the region's files: truncating files and flipping bytes in the
//! log, the level segments and the manifest. Reopening either recovers or reports the corruption
//! (naming a file); it never panics and never returns a value that was not written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dpukv_storage::Error;
use dpukv_storage::region::{Region, RegionConfig};
use dpukv_storage::vlog::FsyncPolicy;

fn value(i: u64, round: u64) -> Vec<u8> {
    let len = ((i * 31 + round * 7) % 160) as usize;
    (0..len).map(|j| (i ^ round ^ j as u64) as u8).collect()
}

/// Every value ever written for each key (a recovered store may hold any acknowledged one... but
/// only ones that were written).
fn must_populate(dir: &Path) -> BTreeMap<Vec<u8>, Vec<Vec<u8>>> {
    let cfg = RegionConfig::tiny(dir.join("data"), dir.join("shm"), FsyncPolicy::Never);
    let mut r = Region::open(cfg).expect("open").0;
    let mut written: BTreeMap<Vec<u8>, Vec<Vec<u8>>> = BTreeMap::new();
    for round in 0..3u64 {
        for i in 0..400u64 {
            let k = format!("key{:04}", (i * 7 + round) % 500).into_bytes();
            let v = value(i, round);
            r.put(&k, &v).expect("put");
            written.entry(k).or_default().push(v);
        }
    }
    assert!(!r.manifest().levels.is_empty() && r.stats().flushes > 5, "{:?}", r.stats());
    written
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in ["data", "data/vlog", "data/levels"] {
        for e in std::fs::read_dir(dir.join(sub)).expect("dir") {
            let p = e.expect("entry").path();
            if p.is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn copy_tree(from: &Path, to: &Path) {
    for sub in ["data", "data/vlog", "data/levels"] {
        std::fs::create_dir_all(to.join(sub)).expect("mkdir");
        for e in std::fs::read_dir(from.join(sub)).expect("dir") {
            let e = e.expect("entry");
            if e.path().is_file() {
                std::fs::copy(e.path(), to.join(sub).join(e.file_name())).expect("copy");
            }
        }
    }
}

/// Opens the damaged copy and reads everything: Ok(true) if it opened and every value read back
/// was written; Ok(false) if it reported corruption; panics on a wrong value.
fn must_not_lie(dir: &Path, written: &BTreeMap<Vec<u8>, Vec<Vec<u8>>>, what: &str) -> bool {
    let cfg = RegionConfig::tiny(dir.join("data"), dir.join("shm"), FsyncPolicy::Never);
    let r = match Region::open(cfg) {
        Ok((r, _)) => r,
        Err(Error::CorruptFile { .. } | Error::Corrupt { .. }) => return false,
        Err(e) => panic!("{what}: unexpected error kind: {e}"),
    };
    for (k, vs) in written {
        match r.get(k) {
            Ok(Some(v)) => {
                assert!(vs.contains(&v), "{what}: key {:?} returned a value never written", String::from_utf8_lossy(k))
            }
            Ok(None) | Err(Error::CorruptFile { .. } | Error::Corrupt { .. } | Error::Io { .. }) => {}
            Err(e) => panic!("{what}: unexpected error {e}"),
        }
    }
    if let Ok(all) = r.scan(b"", b"\xff", usize::MAX) {
        for (k, v) in all {
            assert!(written.get(&k).is_some_and(|vs| vs.contains(&v)), "{what}: scan returned a value never written");
        }
    }
    true
}

#[test]
fn damaged_files_are_reported_or_recovered_never_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let written = must_populate(dir.path());
    let all = files(dir.path());
    let mut seed = 0x1234_5678u64;
    let (mut reported, mut recovered) = (0, 0);
    let runs: u32 = std::env::var("DPUKV_CORRUPT_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(120);
    for run in 0..runs {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let scratch = tempfile::tempdir().expect("tempdir");
        copy_tree(dir.path(), scratch.path());
        let victim_rel = all[(seed >> 33) as usize % all.len()].strip_prefix(dir.path()).expect("prefix").to_path_buf();
        let victim = scratch.path().join(&victim_rel);
        let mut b = std::fs::read(&victim).expect("read");
        if b.is_empty() {
            continue;
        }
        let what = if run % 4 == 0 {
            let cut = (seed >> 20) as usize % b.len();
            b.truncate(cut);
            format!("run {run}: {} truncated to {cut}", victim_rel.display())
        } else {
            let at = (seed >> 20) as usize % b.len();
            b[at] ^= 1 << (seed % 8);
            format!("run {run}: {} flipped at {at}", victim_rel.display())
        };
        std::fs::write(&victim, &b).expect("write");
        let outcome = std::panic::catch_unwind(|| must_not_lie(scratch.path(), &written, &what));
        match outcome {
            Ok(true) => recovered += 1,
            Ok(false) => reported += 1,
            Err(_) => panic!("{what}: panicked"),
        }
    }
    assert!(reported > runs / 4, "corruption should mostly be reported: {reported} reported, {recovered} recovered");
}
