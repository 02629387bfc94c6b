//! Value-log garbage collection (Tebis §2.4). A record in a segment before the manifest's log
//! start is needed only if a level's value pointer names it, and each level's manifest entry
//! records how many bytes of each log segment its pointers name — so the live bytes of every old
//! segment are known without reading it. Collection takes the segment with the least live data
//! first, in bounded steps: it rewrites the values some level still needs at the head of the log
//! (a put of the same value: the index then points at the new copy), makes those writes — and
//! the newer writes that made the other records dead — durable, takes the segment out of the log and retires its file, which is deleted once no reader of any
//! table set can reach it (module `control`). A segment no level needs is taken out unread.

use std::collections::BTreeMap;

use super::Region;
use super::control::Retired;
use super::merge::{self, Stored};
use crate::btree::BatchOp;
use crate::error::{Error, Result};
use crate::vlog::Lsn;

/// How long collecting a segment waits for a gated region's backups before it gives up (and
/// is retried at the next upkeep).
const DETACH_GATE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// What one garbage-collection step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcStep {
    /// Records examined.
    pub examined: u64,
    /// Live values rewritten to the head of the log.
    pub relocated: u64,
    /// Segments taken out of the log (their files deleted once no reader can reach them).
    pub deleted: u64,
    /// Whether there is more worth doing now.
    pub more: bool,
}

/// Where collection stands: the segment being collected and the offset to continue from.
#[derive(Debug, Default)]
pub(super) struct GcState {
    cursor: Option<(u64, u32)>,
    /// Segments from this one on are not collected: a backup behind reads them
    /// ([`Region::hold_log_from`]).
    floor: Option<u64>,
}

impl GcState {
    /// A segment is half collected.
    pub(super) fn is_busy(&self) -> bool {
        self.cursor.is_some()
    }
}

impl Region {
    /// Keeps log segments from `segment` on out of garbage collection (None: no hold): a backup
    /// that is behind — catching up, or away for a moment — resumes from its own copy only if
    /// the log it lacks is still here. The caller bounds how much it holds.
    pub fn hold_log_from(&mut self, segment: Option<u64>) {
        self.gc.floor = segment;
    }

    /// Live bytes per log segment: what the levels' value pointers name.
    fn live_log_bytes(&self) -> BTreeMap<u64, u64> {
        let mut live = BTreeMap::new();
        for l in self.levels.iter().flatten() {
            for (seg, bytes) in &l.meta().log_refs {
                *live.entry(*seg).or_default() += bytes;
            }
        }
        live
    }

    /// Log segments garbage collection may take (sealed and wholly before the log start), with
    /// their live bytes, fewest first; only those at most `(1 - min_garbage)` live.
    pub fn gc_candidates(&self) -> Vec<(u64, u64)> {
        let live = self.live_log_bytes();
        let start = Lsn(self.manifest.log_start).segment();
        let size = self.vlog.segment_size() as u64;
        let most_live = ((1.0 - self.cfg.gc_min_garbage) * size as f64) as u64;
        let mut c: Vec<(u64, u64)> = self
            .vlog
            .segments()
            .into_iter()
            .filter(|&s| s < start && s != self.vlog.active_segment() && self.gc.floor.is_none_or(|f| s < f))
            .map(|s| (s, live.get(&s).copied().unwrap_or(0)))
            .filter(|&(_, l)| l <= most_live)
            .collect();
        c.sort_by_key(|&(s, l)| (l, s));
        c
    }

    /// One bounded step of garbage collection: examines up to `max_records` records of the
    /// segment being collected (or starts on the best candidate), relocates the live ones, and
    /// takes the segment out once done. `more` says whether another step is worth it now.
    pub fn gc_step(&mut self, max_records: usize) -> Result<GcStep> {
        let mut step = GcStep::default();
        let (seg, from) = match self.gc.cursor {
            Some(c) => c,
            None => match self.gc_candidates().first() {
                None => return Ok(step),
                Some(&(seg, 0)) => {
                    self.detach(seg)?;
                    step.deleted = 1;
                    step.more = !self.gc_candidates().is_empty();
                    return Ok(step);
                }
                Some(&(seg, _)) => (seg, 0),
            },
        };
        let (records, next) = self.vlog.segment_records(seg, from, max_records)?;
        let inline = self.cfg.arena.inline_threshold as usize;
        let mut live: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for (at, rec) in records {
            step.examined += 1;
            if rec.tombstone || rec.value.len() <= inline {
                continue; // inline values and tombstones never point into the log
            }
            if merge::get(&self.srcs(), &rec.key)? == Some(Stored::Pointer { ptr: at.0, len: rec.value.len() as u32 }) {
                live.push((rec.key.into_owned(), rec.value.into_owned()));
            }
        }
        if !live.is_empty() {
            let ops: Vec<BatchOp<'_>> = live.iter().map(|(k, v)| BatchOp::Put(k, v)).collect();
            let ack = self.write_batch(&ops)?;
            // The old copies may only go once the new ones are durable (and visible).
            self.vlog.sync_to(ack.end)?;
            self.wait_durable(ack.end)?;
            step.relocated = live.len() as u64;
        }
        match next {
            Some(off) => self.gc.cursor = Some((seg, off)),
            None => {
                // Records judged dead because a newer write in L0 shadows them stay dead after a
                // power loss only if those writes survive it: make everything logged so far
                // durable before the segment goes (under `never` or `interval` they may not be).
                self.vlog.sync_to(self.vlog.end())?;
                self.gc.cursor = None;
                self.detach(seg)?;
                step.deleted = 1;
            }
        }
        step.more = self.gc.cursor.is_some() || !self.gc_candidates().is_empty();
        Ok(step)
    }

    /// Takes segment `seg` out of the log and retires its file at the next table set.
    fn detach(&mut self, seg: u64) -> Result<()> {
        // Readers must see the writes that made the segment's records dead (and the relocated
        // copies) before the segment leaves their table set: synced, and shown by a gate.
        let end = self.vlog.end();
        self.vlog.sync_to(end)?;
        if let Some(p) = self.publications.as_ref().filter(|p| p.gated())
            && !p.wait_shown(end, DETACH_GATE_WAIT)
        {
            return Err(Error::Unavailable(format!(
                "log segment {seg} stays until the backups hold the log up to {}",
                end.0
            )));
        }
        let path = self.vlog.detach_segment(seg)?;
        self.publish_tables()?;
        self.control.retire(Retired::Durable(path));
        self.reap()
    }
}
