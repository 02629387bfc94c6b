//! A region under a simulated power loss — the scenario the durability tests run for many seeds
//! and the `region_powerloss` fuzz target runs for arbitrary inputs.
//!
//! A region writes random batches through a [`FaultFs`] under a chosen fsync policy, with tiny
//! budgets so it is always mid-flush or mid-compaction, with syncs that fail and a disk that fills
//! up; at a chosen file operation the power goes out. The files are rewritten to one state the
//! disk could hold (synced bytes, a random subset of the rest torn at page boundaries, a random
//! prefix of unsynced directory operations), shared memory is lost, and the region reopens. The
//! scenario then checks:
//! - recovery succeeds (nothing here damages synced data, so an error would be a bug);
//! - the state is exactly the history's batches up to the recovered version, applied in order —
//!   no batch half-visible, nothing that was never written;
//! - every write the policy promised is there: under `always` every acknowledged write, under the
//!   others every write the log had synced when the power went out;
//! - a reader of the shared memory (what the device runs) sees the same state;
//! - the exactly-once sessions agree with the data: every recovered batch's `(client, seq)` finds
//!   its version, and no batch that was lost is found.
//!
//! `kill -9` never loses the page cache, so only this kind of test exercises an fsync policy.

use std::collections::BTreeMap;
use std::path::Path;

use crate::btree::BatchOp;
use crate::error::Error;
use crate::fs::FaultFs;
use crate::region::{Lookup, Region, RegionConfig, RegionReader, SessionEntry};
use crate::vlog::{FsyncPolicy, Lsn};

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

/// Where the scenario's choices come from.
pub trait Choices {
    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64;
}

/// Choices from a seed (xorshift64).
#[derive(Debug, Clone)]
pub struct Seeded(u64);

impl Seeded {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Seeded {
        Seeded(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
}

impl Choices for Seeded {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Choices read from bytes (a fuzzer's input), then a seed once they run out.
#[derive(Debug, Clone)]
pub struct FromBytes<'a> {
    bytes: &'a [u8],
    rest: Seeded,
}

impl<'a> FromBytes<'a> {
    /// Choices taken from `bytes`, two at a time.
    pub fn new(bytes: &'a [u8]) -> FromBytes<'a> {
        FromBytes { bytes, rest: Seeded::new(bytes.len() as u64) }
    }
}

impl Choices for FromBytes<'_> {
    fn below(&mut self, n: u64) -> u64 {
        match self.bytes {
            [a, b, rest @ ..] => {
                self.bytes = rest;
                u16::from_le_bytes([*a, *b]) as u64 % n
            }
            _ => self.rest.below(n),
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Put(Vec<u8>, Vec<u8>),
    Insert(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
}

fn batch(c: &mut impl Choices) -> Vec<Op> {
    (0..1 + c.below(4))
        .map(|_| {
            let k = format!("key{:02}", c.below(40)).into_bytes();
            let len = if c.below(3) == 0 { 41 + c.below(260) } else { c.below(40) } as usize;
            let fill = c.below(256) as u8;
            let v: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
            match c.below(10) {
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
    /// Its exactly-once sequence number (client 1).
    seq: u64,
}

/// What one run did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    /// Batches applied before the power went out.
    pub applied: usize,
    /// Of those, the ones the policy promised would survive.
    pub promised: usize,
    /// Of those, the ones that survived.
    pub recovered: usize,
    /// Syncs that failed on purpose.
    pub failed_syncs: u64,
    /// Operations refused for lack of space.
    pub no_space: u64,
}

/// Runs the scenario in `dir` (empty; it is used for the region's files and shared memory).
/// Returns what happened, or which check failed and how.
pub fn run(dir: &Path, policy: FsyncPolicy, c: &mut impl Choices, seed: u64) -> Result<Outcome, String> {
    let (data, shm) = (dir.join("data"), dir.join("shm"));
    let fs = FaultFs::new(seed);
    let mut cfg = RegionConfig::tiny(&data, &shm, policy).with_fs(fs.as_fs());
    cfg.background_compaction = c.below(2) == 0;
    let mut region = Region::open(cfg).map_err(|e| format!("open: {e}"))?.0;
    fs.crash_after(200 + c.below(3000));
    let mut model = Model::new();
    let mut history: Vec<Applied> = Vec::new();
    // A batch whose outcome is unknown (its log write or sync failed for good): it may be in.
    let mut unknown: Option<Vec<Op>> = None;
    // Some writes are made as a node's region writer makes them while more jobs wait: under the
    // log's sync hold, one to four groups in a row, then synced on this thread or handed to the
    // flusher, and only then waited for (under a hold the flusher leaves them alone).
    let mut hold_left = 0u64;
    let mut unwaited: Vec<(usize, Lsn)> = Vec::new();
    let promise = |region: &Region, end: Lsn, step: u64| match region.wait_durable(end) {
        Ok(()) => Ok(policy == FsyncPolicy::Always),
        Err(e) if e.outcome_unknown() => Ok(false),
        Err(e) => Err(format!("step {step}: waiting for durability: {e}")),
    };
    for step in 0..5000 {
        if fs.crashed() {
            break;
        }
        if hold_left == 0 && c.below(3) == 0 {
            hold_left = 1 + c.below(4);
            region.vlog().hold_sync();
        }
        match c.below(100) {
            0 => fs.fail_sync(1 + c.below(3)),
            1 => fs.set_space_limit(Some(fs.used_bytes() + c.below(200_000))),
            2..=4 => fs.set_space_limit(None),
            5 => {
                let _ = region.flush_now();
            }
            6 => {
                let _ = region.gc_step(32);
            }
            _ => {}
        }
        let b = batch(c);
        let tag = [SessionEntry { client: 1, seq: step + 1, reply: vec![step as u8] }];
        let ops = ops(&b);
        match region.write_group_tagged(&[(&ops, &tag)]).pop().expect("one result") {
            Ok(ack) => {
                let next = apply(&model, &b).ok_or("a batch whose precondition fails was applied")?;
                let promised = if hold_left > 0 {
                    unwaited.push((history.len(), ack.end));
                    false
                } else {
                    promise(&region, ack.end, step)?
                };
                model = next;
                history.push(Applied { version: ack.version, batch: b, promised, end: ack.end.0, seq: step + 1 });
            }
            Err(Error::KeyExists) if apply(&model, &b).is_none() => {}
            Err(e) if e.outcome_unknown() => {
                unknown = Some(b);
                break;
            }
            Err(e) if e.is_retryable() => {}
            Err(e) => return Err(format!("step {step}: unexpected error {e}")),
        }
        if hold_left > 0 {
            hold_left -= 1;
            if hold_left == 0 {
                if c.below(4) > 0 {
                    region.vlog().sync_held();
                } else {
                    region.vlog().unhold_sync();
                }
                for (i, end) in unwaited.drain(..) {
                    history[i].promised = promise(&region, end, step)?;
                }
            }
        }
    }
    // (Writes still held when the loop ended were never acknowledged: nothing was promised.)
    // The power goes out (if the countdown did not already run out).
    fs.crash();
    let synced = region.vlog().synced_lsn().0;
    drop(region);
    fs.materialize().map_err(|e| format!("materialize: {e}"))?;
    std::fs::remove_dir_all(&shm).map_err(|e| format!("losing shared memory: {e}"))?;
    let (region, rec) =
        Region::open(RegionConfig::tiny(&data, &shm, policy)).map_err(|e| format!("recovery failed: {e}"))?;
    let recovered = region.version();
    let mut out = Outcome {
        applied: history.len(),
        failed_syncs: fs.stats().failed_syncs,
        no_space: fs.stats().no_space,
        ..Outcome::default()
    };
    for a in &history {
        if a.promised || a.end <= synced {
            out.promised += 1;
            if a.version > recovered {
                return Err(format!(
                    "write at version {} was promised, recovered up to {recovered} ({rec:?})",
                    a.version
                ));
            }
        }
    }
    let mut expect = Model::new();
    for a in history.iter().filter(|a| a.version <= recovered) {
        expect = apply(&expect, &a.batch).ok_or("the history does not apply again")?;
        out.recovered += 1;
    }
    let got: Model = region.scan(b"", b"\xff", usize::MAX).map_err(|e| format!("scan: {e}"))?.into_iter().collect();
    let with_unknown = unknown.as_ref().and_then(|b| apply(&expect, b));
    if got != expect && Some(&got) != with_unknown.as_ref() {
        return Err(format!(
            "the recovered state (version {recovered}) is not the history's prefix:\n got {got:?}\nwant {expect:?}"
        ));
    }
    let kept = crate::region::SessionLimits::default().per_client;
    let recent = history.iter().filter(|a| a.version <= recovered).count().saturating_sub(kept);
    for (i, a) in history.iter().enumerate() {
        let found = region.session_lookup(1, a.seq, false);
        let ok = if a.version <= recovered {
            // The newest `kept` applied batches must be found; older ones may have been dropped.
            matches!(found, Lookup::Applied { version, .. } if version == a.version)
                || (i < recent && found == Lookup::Expired)
        } else {
            found != Lookup::Applied { version: a.version, reply: vec![(a.seq - 1) as u8] }
                && !matches!(found, Lookup::Applied { .. })
        };
        if !ok {
            return Err(format!("seq {} (version {}, recovered {recovered}) finds {found:?}", a.seq, a.version));
        }
    }
    let mut reader = RegionReader::open(&shm).map_err(|e| format!("reader: {e}"))?;
    let seen: Model =
        reader.scan(b"", b"\xff", usize::MAX).map_err(|e| format!("reader scan: {e}"))?.into_iter().collect();
    if seen != got {
        return Err("a reader of the shared memory sees another state".into());
    }
    drop(reader);
    // Life goes on after recovery: more writes, a clean restart, and everything is there.
    let mut region = region;
    let mut model = got;
    for _ in 0..50 {
        let b = batch(c);
        match region.write_batch(&ops(&b)) {
            Ok(ack) => {
                region.wait_durable(ack.end).map_err(|e| format!("after recovery: {e}"))?;
                model = apply(&model, &b).ok_or("a refused batch applied after recovery")?;
            }
            Err(Error::KeyExists) if apply(&model, &b).is_none() => {}
            Err(e) => return Err(format!("writing after recovery: {e}")),
        }
    }
    drop(region);
    let (region, _) =
        Region::open(RegionConfig::tiny(&data, &shm, policy)).map_err(|e| format!("second recovery failed: {e}"))?;
    let again: Model = region.scan(b"", b"\xff", usize::MAX).map_err(|e| format!("scan: {e}"))?.into_iter().collect();
    if again != model {
        return Err("writes after recovery did not survive a clean restart".into());
    }
    Ok(out)
}
