//! Value-log garbage collection: live values of old segments are rewritten at the head of the
//! log, made durable, and the segments deleted once no reader can be pinned before the rewrite.

use super::Region;
use super::merge::{self, Stored};
use crate::btree::BatchOp;
use crate::error::Result;
use crate::vlog::Lsn;

/// What one garbage-collection step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcStep {
    /// Records examined.
    pub examined: u64,
    /// Live values rewritten to the head of the log.
    pub relocated: u64,
    /// Segments deleted.
    pub deleted: u64,
    /// Whether there is more to do now.
    pub more: bool,
}

/// Where collection stands.
#[derive(Debug, Default)]
pub(super) struct GcState {
    /// The segment being collected and the offset to continue from.
    cursor: Option<(u64, u32)>,
    /// Collected segments, deleted once no reader is older than the version that relocated them.
    pending: Vec<(u64, u64)>,
    /// The current pass collects segments below this one (fixed when the pass starts, so the
    /// pass's own rewrites, and the flushes they cause, do not extend it).
    boundary: Option<u64>,
}

impl Region {
    /// One bounded step of value-log garbage collection: examines up to `max_records` records of
    /// the oldest segment that lies entirely before the manifest's log start (so every record in
    /// it is indexed by a level), rewrites the values still in use to the head of the log (one
    /// batch, synced before the segment can go), and deletes collected segments once no reader can
    /// be pinned before the rewrite. A pass covers the segments below the log start as it was when
    /// the pass began; `more` is false once the pass is complete (the next call starts a new pass).
    pub fn gc_step(&mut self, max_records: usize) -> Result<GcStep> {
        let mut step = GcStep::default();
        if !self.gc.pending.is_empty() {
            let oldest = self.active.oldest_reader_version()?;
            let (ready, wait): (Vec<_>, Vec<_>) = self.gc.pending.iter().partition(|(_, v)| *v <= oldest);
            self.gc.pending = wait;
            for (seg, _) in ready {
                self.vlog.remove_segment(seg)?;
                step.deleted += 1;
            }
        }
        let boundary = *self.gc.boundary.get_or_insert(Lsn(self.manifest.log_start).segment());
        if self.gc.cursor.is_none() {
            let pending: Vec<u64> = self.gc.pending.iter().map(|p| p.0).collect();
            self.gc.cursor =
                self.vlog.segments().into_iter().find(|&s| s < boundary && !pending.contains(&s)).map(|s| (s, 0));
        }
        let Some((seg, from)) = self.gc.cursor else {
            step.more = !self.gc.pending.is_empty();
            if !step.more {
                self.gc.boundary = None;
            }
            return Ok(step);
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
            // The old copies may only go once the new ones are durable.
            self.vlog.sync_to(ack.end)?;
            step.relocated = live.len() as u64;
        }
        match next {
            Some(off) => self.gc.cursor = Some((seg, off)),
            None => {
                self.gc.cursor = None;
                self.gc.pending.push((seg, self.version()));
            }
        }
        let pending: Vec<u64> = self.gc.pending.iter().map(|p| p.0).collect();
        let left = self.vlog.segments().iter().any(|&s| s < boundary && !pending.contains(&s));
        step.more = self.gc.cursor.is_some() || !self.gc.pending.is_empty() || left;
        if !step.more {
            self.gc.boundary = None;
        }
        Ok(step)
    }
}
