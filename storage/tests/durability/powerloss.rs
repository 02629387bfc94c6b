//! Power-loss simulation (a `kill -9` never loses the page cache, so it cannot test an fsync
//! policy): a region writes through a `FaultFs` under every fsync policy, with tiny budgets so it
//! is always mid-flush or mid-compaction, with syncs that fail and disks that fill up; at a random
//! file operation the power goes out. The files are rewritten to one state the disk could hold
//! (synced bytes, a random subset of the rest torn at page boundaries, a random prefix of unsynced
//! directory operations), shared memory is lost, and the region reopens. Then:
//! - recovery succeeds (nothing here damages synced data, so an error would be a bug);
//! - the state is exactly the history's batches up to the recovered version, applied in order —
//!   no batch half-visible, nothing that was never written;
//! - every write the policy promised is there: under `always` every acknowledged write, under the
//!   others every write the log had synced when the power went out;
//! - a reader in another thread sees the same state.
//!
//! `DPUKV_POWERLOSS_SEEDS` sets how many seeds run per policy (default 12).

use std::collections::BTreeMap;
use std::time::Duration;

use dpukv_storage::fs::FaultFs;
use dpukv_storage::region::{Region, RegionConfig, RegionReader};
use dpukv_storage::vlog::FsyncPolicy;
use dpukv_storage::{BatchOp, Error};

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

#[derive(Debug, Clone)]
enum Op {
    Put(Vec<u8>, Vec<u8>),
    Insert(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn batch(rng: &mut Rng) -> Vec<Op> {
    (0..1 + rng.below(4))
        .map(|_| {
            let k = format!("key{:02}", rng.below(40)).into_bytes();
            let len = if rng.below(3) == 0 { 41 + rng.below(260) } else { rng.below(40) } as usize;
            let v: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            match rng.below(10) {
                0..=5 => Op::Put(k, v),
                6 => Op::Insert(k, v),
                _ => Op::Delete(k),
            }
        })
        .collect()
}

fn ops(b: &[Op]) -> Vec<BatchOp<'_>> {
    b.iter()
        .map(|o| match o {
            Op::Put(k, v) => BatchOp::Put(k, v),
            Op::Insert(k, v) => BatchOp::Insert(k, v),
            Op::Delete(k) => BatchOp::Delete(k),
        })
        .collect()
}

/// The model after `b`, or None if a precondition fails (the batch changes nothing).
fn apply(m: &Model, b: &[Op]) -> Option<Model> {
    let mut m = m.clone();
    for o in b {
        match o {
            Op::Put(k, v) => {
                m.insert(k.clone(), v.clone());
            }
            Op::Insert(k, v) => {
                if m.contains_key(k) {
                    return None;
                }
                m.insert(k.clone(), v.clone());
            }
            Op::Delete(k) => {
                m.remove(k);
            }
        }
    }
    Some(m)
}

/// One applied batch of the history.
struct Applied {
    version: u64,
    batch: Vec<Op>,
    /// The policy promised it survives a power loss.
    promised: bool,
    end: u64,
}

fn run(seed: u64, policy: FsyncPolicy) {
    let what = format!("seed {seed}, {policy:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    let (data, shm) = (dir.path().join("data"), dir.path().join("shm"));
    let fs = FaultFs::new(seed);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut cfg = RegionConfig::tiny(&data, &shm, policy).with_fs(fs.as_fs());
    cfg.background_compaction = seed.is_multiple_of(2);
    let mut region = Region::open(cfg).unwrap_or_else(|e| panic!("{what}: open: {e}")).0;
    fs.crash_after(200 + rng.below(3000));
    let mut model = Model::new();
    let mut history: Vec<Applied> = Vec::new();
    // A batch whose outcome is unknown (its log write or sync failed for good): it may be in.
    let mut unknown: Option<Vec<Op>> = None;
    for step in 0.. {
        if fs.crashed() || step > 5000 {
            break;
        }
        match rng.below(100) {
            0 => fs.fail_sync(1 + rng.below(3)),
            1 => fs.set_space_limit(Some(fs.used_bytes() + rng.below(200_000))),
            2..=4 => fs.set_space_limit(None),
            5 => {
                let _ = region.flush_now();
            }
            6 => {
                let _ = region.gc_step(32);
            }
            _ => {}
        }
        let b = batch(&mut rng);
        match region.write_batch(&ops(&b)) {
            Ok(ack) => {
                let next = apply(&model, &b).unwrap_or_else(|| panic!("{what}: a batch the model refuses was applied"));
                let promised = match region.wait_durable(ack.end) {
                    Ok(()) => policy == FsyncPolicy::Always,
                    Err(e) => {
                        assert!(e.outcome_unknown(), "{what}: {e}");
                        false
                    }
                };
                model = next;
                history.push(Applied { version: ack.version, batch: b, promised, end: ack.end.0 });
            }
            Err(Error::KeyExists) => assert!(apply(&model, &b).is_none(), "{what}: KeyExists on a batch that fits"),
            Err(e) if e.outcome_unknown() => {
                unknown = Some(b);
                break;
            }
            Err(e) => assert!(e.is_retryable(), "{what}: step {step}: unexpected error {e}"),
        }
    }
    // The power goes out (if the countdown did not already run out).
    fs.crash();
    let synced = region.vlog().synced_lsn().0;
    drop(region);
    fs.materialize().expect("materialize");
    std::fs::remove_dir_all(&shm).expect("shared memory is lost");
    let reopen = RegionConfig::tiny(&data, &shm, policy);
    let (region, rec) = Region::open(reopen).unwrap_or_else(|e| panic!("{what}: recovery failed: {e}"));
    let recovered = region.version();
    for a in &history {
        if a.promised || a.end <= synced {
            assert!(
                a.version <= recovered,
                "{what}: write at version {} was promised, recovered {recovered} ({rec:?})",
                a.version
            );
        }
    }
    let mut expect = Model::new();
    for a in history.iter().filter(|a| a.version <= recovered) {
        expect = apply(&expect, &a.batch).expect("it applied the first time");
    }
    let got: Model = region.scan(b"", b"\xff", usize::MAX).expect("scan").into_iter().collect();
    let with_unknown = unknown.as_ref().and_then(|b| apply(&expect, b));
    assert!(
        got == expect || Some(&got) == with_unknown.as_ref(),
        "{what}: recovered state (version {recovered}) is not the history's prefix\n got {got:?}\nwant {expect:?}"
    );
    if std::env::var("DPUKV_POWERLOSS_VERBOSE").is_ok() {
        let promised = history.iter().filter(|a| a.promised || a.end <= synced).count();
        eprintln!(
            "{what}: {} applied, {promised} promised, recovered version {recovered} ({} batches), unknown {}, faults {:?}",
            history.len(),
            history.iter().filter(|a| a.version <= recovered).count(),
            unknown.is_some(),
            fs.stats()
        );
    }
    let mut reader = RegionReader::open(&shm).expect("reader");
    let seen: Model = reader.scan(b"", b"\xff", usize::MAX).expect("reader scan").into_iter().collect();
    assert_eq!(seen, got, "{what}: a reader sees the recovered state");
}

#[test]
fn power_loss_keeps_every_promised_write_and_only_a_prefix() {
    let seeds: u64 = std::env::var("DPUKV_POWERLOSS_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    for policy in [FsyncPolicy::Always, FsyncPolicy::Interval(Duration::from_millis(2)), FsyncPolicy::Never] {
        for seed in 1..=seeds {
            run(seed, policy);
        }
    }
}
