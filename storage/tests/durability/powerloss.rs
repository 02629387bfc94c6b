//! Power-loss simulation of a region under every fsync policy (`workload::powerloss` describes
//! the scenario and what it checks). `kill -9` never loses the page cache, so only this kind of
//! test exercises an fsync policy; the `region_powerloss` fuzz target runs the same scenario on
//! arbitrary inputs.
//!
//! `DPUKV_POWERLOSS_SEEDS` sets how many seeds run per policy (default 30);
//! `DPUKV_POWERLOSS_SEED=N` runs seed N alone (to reproduce a failure).

use std::time::Duration;

use dpukv_storage::vlog::FsyncPolicy;
use dpukv_storage::workload::powerloss::{self, Seeded};

#[test]
fn power_loss_keeps_every_promised_write_and_only_a_prefix() {
    let env = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    let only = env("DPUKV_POWERLOSS_SEED");
    let seeds = match only {
        Some(s) => s..=s,
        None => 1..=env("DPUKV_POWERLOSS_SEEDS").unwrap_or(30),
    };
    for policy in [FsyncPolicy::Always, FsyncPolicy::Interval(Duration::from_millis(2)), FsyncPolicy::Never] {
        let (mut promised, mut failed_syncs) = (0, 0);
        for seed in seeds.clone() {
            let dir = tempfile::tempdir().expect("tempdir");
            let out = powerloss::run(dir.path(), policy, &mut Seeded::new(seed), seed)
                .unwrap_or_else(|e| panic!("seed {seed}, {policy:?}: {e}"));
            if std::env::var("DPUKV_POWERLOSS_VERBOSE").is_ok() {
                eprintln!("seed {seed}, {policy:?}: {out:?}");
            }
            promised += out.promised;
            failed_syncs += out.failed_syncs;
        }
        // The scenario must have had something to lose and faults to survive.
        assert!(
            only.is_some() || promised > 100 && failed_syncs > 0,
            "{policy:?}: {promised} promised, {failed_syncs} failed syncs"
        );
    }
}

/// Regression: garbage collection judged a segment's records dead because newer writes in L0
/// shadowed them, and took the segment out before those writes were durable. Under `never` (or
/// `interval`) a power loss then lost the newer writes, and the levels' pointers into the deleted
/// segment were live again: reads failed on a missing file. Every key must read as its old or its
/// new value after the power loss.
#[test]
fn collection_never_relies_on_writes_a_power_loss_can_take_back() {
    use dpukv_storage::fs::FaultFs;
    use dpukv_storage::region::{Region, RegionConfig};
    let dir = tempfile::tempdir().expect("tempdir");
    let (data, shm) = (dir.path().join("data"), dir.path().join("shm"));
    let fs = FaultFs::new(3);
    let mut cfg = RegionConfig::tiny(&data, &shm, FsyncPolicy::Never).with_fs(fs.as_fs());
    cfg.l0_budget = 4 << 20; // only flush_now freezes
    cfg.gc_min_garbage = 0.0; // every old segment is a candidate
    cfg.vlog.segment_size = 64 << 10; // the overwrites below fit in one segment: no rotation syncs them
    let key = |i: u32| format!("key{i:03}").into_bytes();
    let (old, new) = (vec![1u8; 300], vec![2u8; 300]);
    let mut r = Region::open(cfg.clone()).expect("open").0;
    for i in 0..100 {
        r.put(&key(i), &old).expect("put");
    }
    while r.vlog().segments().len() < 2 {
        r.put(b"filler", &old).expect("filler");
    }
    r.flush_now().expect("flush: the levels now point into the old segments");
    // Shadow every old value with a new one, logged but not synced (the policy is `never`).
    for i in 0..100 {
        r.put(&key(i), &new).expect("overwrite");
    }
    assert_eq!(r.vlog().segments().len(), 2, "the overwrites are in the active segment");
    let mut deleted = 0;
    for _ in 0..1000 {
        let s = r.gc_step(16).expect("gc step");
        deleted += s.deleted;
        if !s.more {
            break;
        }
    }
    assert!(deleted > 0, "collection took no segment");
    fs.crash();
    drop(r);
    fs.materialize().expect("materialize");
    std::fs::remove_dir_all(&shm).expect("losing shared memory");
    let r = Region::open(RegionConfig::tiny(&data, &shm, FsyncPolicy::Never)).expect("recovery").0;
    for i in 0..100 {
        let v = r.get(&key(i)).unwrap_or_else(|e| panic!("key {i} after the power loss: {e}"));
        assert!(v.as_deref() == Some(&old[..]) || v.as_deref() == Some(&new[..]), "key {i}: {v:?}");
    }
}
