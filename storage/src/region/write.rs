//! The region's write path: group commit of independent batches (each under its own version, one
//! log write for a chunk of them), applying them to L0, publishing them to readers, freezing a
//! full L0 at the exact log position it covers, and installing finished compactions.

use std::collections::HashMap;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::compact::{Compacted, Compactor};
use super::control::Retired;
use super::sessions::{SessionEntry, Sessions};
use super::{Region, WriteAck, levels_dir};
use crate::btree::{BatchOp, Writer};
use crate::config::MAX_VALUE_LEN;
use crate::error::{Error, Result};
use crate::vlog::{Lsn, Record};

/// How long a failed compaction waits before it is tried again (unless a write needs the room).
const COMPACTION_RETRY: Duration = Duration::from_secs(1);

/// A compaction running on its thread, or one that ran inline.
pub(super) enum Pending {
    Running(JoinHandle<Result<Compacted>>),
    Done(Box<Result<Compacted>>),
}

/// A frozen L0 and what it covers.
pub(super) struct Frozen {
    pub(super) writer: Writer,
    pub(super) version: u64,
    /// The end of the last batch it holds: every record before it is in this L0 or older tables.
    pub(super) log_end: Lsn,
    /// The exactly-once sessions as of `log_end` (stored with the compaction's manifest).
    pub(super) sessions: Sessions,
    /// Bytes of the values it points at in the log (for size estimates).
    pub(super) log_bytes: u64,
}

/// A batch of a group and its exactly-once entries (empty: none).
pub type Tagged<'a, 'k> = (&'a [BatchOp<'k>], &'a [SessionEntry]);

/// What a batch changes: key -> whether it exists afterwards.
type Effects<'k> = Vec<(&'k [u8], bool)>;

/// A batch accepted into the current chunk: its index, version and the pointers of its records.
struct Accepted {
    index: usize,
    version: u64,
    ptrs: Vec<Lsn>,
    end: Lsn,
}

impl Region {
    /// Upsert.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<WriteAck> {
        self.write_batch(&[BatchOp::Put(key, value)])
    }

    /// Delete (a tombstone; absent keys are fine).
    pub fn delete(&mut self, key: &[u8]) -> Result<WriteAck> {
        self.write_batch(&[BatchOp::Delete(key)])
    }

    /// Applies `ops` atomically under one version: logged first, then applied to L0.
    /// Insert/update preconditions are checked against the merged view; if one fails, nothing is
    /// written.
    pub fn write_batch(&mut self, ops: &[BatchOp<'_>]) -> Result<WriteAck> {
        self.write_group(&[ops]).pop().expect("one result per batch")
    }

    /// Why writes are refused now, as an error.
    fn refusal(&self) -> Option<Error> {
        if let Some(why) = &self.poisoned {
            return Some(Error::Unavailable(why.clone()));
        }
        // Nothing of a refused write is written: it is unavailable, not of unknown outcome.
        self.vlog.failure().map(|reason| Error::Unavailable(format!("value log failed: {reason}")))
    }

    /// Group commit: applies several independent batches, each atomically under its own version
    /// (in order), with one log write (and so one sync) per chunk of them. Each batch's
    /// preconditions see the batches before it in the group; a batch that fails them (or a
    /// limit) is skipped and the others proceed. Returns one result per batch.
    ///
    /// A result's error says whether the batch may still be applied
    /// ([`Error::outcome_unknown`]): only a failed log write leaves that open.
    pub fn write_group(&mut self, batches: &[&[BatchOp<'_>]]) -> Vec<Result<WriteAck>> {
        let tagged: Vec<Tagged<'_, '_>> = batches.iter().map(|b| (*b, &[][..])).collect();
        self.write_group_tagged(&tagged)
    }

    /// Like [`Region::write_group`], each batch with its exactly-once entries: logged with the
    /// batch and recorded when it is applied (see [`Region::session_lookup`]).
    pub fn write_group_tagged(&mut self, group: &[Tagged<'_, '_>]) -> Vec<Result<WriteAck>> {
        let batches: Vec<&[BatchOp<'_>]> = group.iter().map(|g| g.0).collect();
        let mut results: Vec<Option<Result<WriteAck>>> = batches.iter().map(|_| None).collect();
        if let Some(e) = self.refusal() {
            return batches.iter().map(|_| Err(e.duplicate())).collect();
        }
        self.admit();
        let mut overlay: HashMap<&[u8], bool> = HashMap::new();
        let mut i = 0;
        while i < batches.len() {
            let mut chunk: Vec<Accepted> = Vec::new();
            let mut chunk_ops = 0usize;
            while i < batches.len() {
                let ops = batches[i];
                let note = (!group[i].1.is_empty()).then(|| Sessions::encode_note(group[i].1));
                let note_rec = note.as_ref().map(|n| Record::annotation(0, n));
                let (bytes, effects) = match self.check_batch(ops, &overlay) {
                    Ok((b, e)) => (b + note_rec.as_ref().map_or(0, |r| r.encoded_len()), e),
                    Err(e) => {
                        results[i] = Some(Err(e));
                        i += 1;
                        continue;
                    }
                };
                if !self.active.fits(chunk_ops + ops.len()) {
                    if !chunk.is_empty() {
                        break; // apply what we have, then make room for this batch
                    }
                    if let Err(e) = self.make_room(ops.len()) {
                        results[i] = Some(Err(e));
                        i += 1;
                    }
                    continue;
                }
                // A rotation writes what is buffered: let the chunk go first, so a rotation that
                // fails never takes buffered batches with it.
                if !chunk.is_empty() && self.vlog.needs_rotation(bytes) {
                    break;
                }
                if let Err(e) = self.vlog.ensure_room(bytes) {
                    // Nothing of this batch was written, whatever failed.
                    results[i] = Some(Err(match e {
                        Error::LogFailed { reason, .. } => Error::Unavailable(format!("value log failed: {reason}")),
                        e => e,
                    }));
                    i += 1;
                    continue;
                }
                let version = self.last_version + 1;
                // The batch's annotation (its exactly-once entries) first, then its records.
                let records = note.as_deref().map(|n| (Record::annotation(version, n), false)).into_iter().chain(
                    ops.iter().enumerate().map(|(j, op)| {
                        let rec = match *op {
                            BatchOp::Put(k, v) | BatchOp::Insert(k, v) | BatchOp::Update(k, v) => {
                                Record::put(version, k, v)
                            }
                            BatchOp::Delete(k) => Record::delete(version, k),
                            BatchOp::PutPointer(..) => unreachable!("rejected by check_batch"),
                        };
                        (rec.in_batch(j + 1 == ops.len()), true)
                    }),
                );
                let mut ptrs = Vec::with_capacity(ops.len());
                for (rec, is_op) in records {
                    // Cannot rotate: ensure_room made room for every record of the batch.
                    match self.vlog.append(&rec) {
                        Ok(at) if is_op => ptrs.push(at),
                        Ok(_) => {}
                        Err(e) => {
                            self.vlog.discard();
                            let err = Error::Unavailable(format!("appending to the log: {e}"));
                            for a in chunk.drain(..) {
                                results[a.index] = Some(Err(err.duplicate()));
                            }
                            results[i] = Some(Err(e.duplicate()));
                            return failed_group(results, self.refusal().unwrap_or(e));
                        }
                    }
                }
                let last = *ptrs.last().expect("batches are not empty");
                let end = Lsn(last.0 + record_len(ops.last().expect("batches are not empty")) as u64);
                self.last_version = version;
                overlay.extend(effects);
                chunk_ops += ops.len();
                chunk.push(Accepted { index: i, version, ptrs, end });
                i += 1;
            }
            if chunk.is_empty() {
                continue;
            }
            let end = match self.vlog.commit() {
                Ok(end) => end,
                Err(e) => {
                    for a in chunk {
                        results[a.index] = Some(Err(e.duplicate()));
                    }
                    return failed_group(results, e);
                }
            };
            for a in chunk {
                let items = batches[a.index].iter().zip(&a.ptrs).map(|(op, &at)| match *op {
                    BatchOp::Put(k, v) | BatchOp::Insert(k, v) | BatchOp::Update(k, v) => (k, false, v, at),
                    BatchOp::Delete(k) | BatchOp::PutPointer(k, ..) => (k, true, &[][..], at),
                });
                results[a.index] = Some(match self.apply_to_l0(a.version, items, a.end) {
                    Ok(()) => {
                        self.sessions.record(a.version, group[a.index].1);
                        Ok(WriteAck { version: a.version, end })
                    }
                    Err(e) => {
                        // Logged but not in L0: nothing more may be applied on top of it. A
                        // restart replays it, so its outcome is unknown, not failed.
                        let why = format!("a logged batch could not be applied to L0: {e}");
                        self.poisoned = Some(why.clone());
                        Err(Error::LogFailed { dir: self.vlog.dir().to_path_buf(), reason: why })
                    }
                });
            }
            if let Some(p) = &self.publications {
                p.push(end, self.active.version(), &self.active.publisher());
            }
        }
        finish(results, None)
    }

    /// Validates a batch and checks its preconditions against the merged view plus `overlay` (the
    /// effects of the batches before it in a group). Returns the bytes its records take in the
    /// log and its effects (key -> exists afterwards), for the overlay once it is accepted.
    fn check_batch<'k>(&self, ops: &[BatchOp<'k>], overlay: &HashMap<&'k [u8], bool>) -> Result<(usize, Effects<'k>)> {
        if ops.is_empty() {
            return Err(Error::Config("empty batch".into()));
        }
        let max_key = self.cfg.arena.max_key_len as usize;
        let mut mine: Vec<(&'k [u8], bool)> = Vec::with_capacity(ops.len());
        let mut bytes = 0;
        for op in ops {
            let (key, value, need, after) = match *op {
                BatchOp::Put(k, v) => (k, Some(v), None, true),
                BatchOp::Insert(k, v) => (k, Some(v), Some(false), true),
                BatchOp::Update(k, v) => (k, Some(v), Some(true), true),
                BatchOp::Delete(k) => (k, None, None, false),
                BatchOp::PutPointer(..) => return Err(Error::Config("a region stores pointers itself".into())),
            };
            if key.is_empty() || key.len() > max_key {
                return Err(Error::KeySize { len: key.len(), max: max_key });
            }
            if let Some(v) = value
                && v.len() > MAX_VALUE_LEN
            {
                return Err(Error::ValueTooLarge { len: v.len(), max: MAX_VALUE_LEN });
            }
            if let Some(need) = need {
                let exists =
                    match mine.iter().rev().find(|(k, _)| *k == key).map(|x| x.1).or_else(|| overlay.get(key).copied())
                    {
                        Some(e) => e,
                        None => self.exists(key)?,
                    };
                if exists != need {
                    return Err(if need { Error::KeyNotFound } else { Error::KeyExists });
                }
            }
            mine.push((key, after));
            bytes += record_len(op);
        }
        if bytes > self.vlog.max_batch_bytes() {
            return Err(Error::BatchTooLarge { bytes, max: self.vlog.max_batch_bytes() });
        }
        Ok((bytes, mine))
    }

    /// Applies logged records (key, tombstone, value, position) to L0 under `version`; the batch
    /// ends at log position `end`.
    pub(super) fn apply_to_l0<'k>(
        &mut self,
        version: u64,
        items: impl Iterator<Item = (&'k [u8], bool, &'k [u8], Lsn)>,
        end: Lsn,
    ) -> Result<()> {
        let inline = self.cfg.arena.inline_threshold as usize;
        let mut log_bytes = 0u64;
        let ops: Vec<BatchOp<'k>> = items
            .map(|(k, tomb, v, at)| {
                if tomb {
                    BatchOp::Delete(k)
                } else if v.len() <= inline {
                    BatchOp::Put(k, v)
                } else {
                    log_bytes += v.len() as u64;
                    BatchOp::PutPointer(k, at.0, v.len() as u32)
                }
            })
            .collect();
        match self.active.write_batch_at(version, &ops) {
            Ok(_) => {}
            Err(Error::ArenaFull { .. }) => {
                // The batch is logged: it must go in. Freeze this L0 (everything before the
                // batch) and apply it to a fresh one.
                self.make_room(ops.len())?;
                self.active.write_batch_at(version, &ops)?;
            }
            Err(e) => return Err(e),
        }
        self.l0_end = self.l0_end.max(end);
        self.active_log_bytes += log_bytes;
        Ok(())
    }

    /// Makes the active L0 able to take `ops` more operations: freezes it (after waiting for the
    /// previous compaction if one still runs). Fails, changing nothing, if the previous compaction
    /// fails again or an empty L0 could not take them either.
    fn make_room(&mut self, ops: usize) -> Result<()> {
        if self.frozen.is_some() {
            self.poll_compaction(true)?;
        }
        if self.active.version() > self.active.base_version() {
            self.freeze()?;
        }
        if !self.active.fits(ops) {
            let ns = self.cfg.arena.node_size as u64;
            return Err(Error::ArenaFull { needed: ops as u64 * ns, free: self.active.stats().capacity });
        }
        Ok(())
    }

    /// Before a group: installs a finished compaction, and freezes L0 once it reaches its budget —
    /// waiting for the previous compaction first if it still runs (back-pressure: L0s stay near
    /// their budget). If that compaction fails, writes go on into the active L0 (its capacity
    /// beyond the budget absorbs them) until a retry succeeds or the arena is full. A gated region
    /// does not wait for a compaction its backups hold back (see `publish`).
    pub(super) fn admit(&mut self) {
        let _ = self.poll_compaction(false);
        let full = self.active.stats().allocated_bytes >= self.cfg.l0_budget;
        if !full && (self.log_tail_bytes() < self.cfg.log_tail_budget() || self.frozen.is_some()) {
            return;
        }
        if self.active.version() == self.active.base_version() {
            return; // nothing to freeze
        }
        if let (Some(f), Some(p)) = (&self.frozen, &self.publications)
            && p.gate_holds(f.log_end)
        {
            // The backups do not hold the frozen L0 yet: its compaction cannot finish, and
            // waiting for it would stall the writer. Writes go on into the active L0 (its room
            // beyond the budget absorbs them; past it they fail) until they do.
            return;
        }
        if self.frozen.is_some() && self.poll_compaction(true).is_err() {
            return;
        }
        if let Err(e) = self.freeze() {
            tracing::warn!(error = %e, "freezing a full L0 failed; will retry");
        }
    }

    /// Bytes of log the active and frozen L0s cover: from the manifest's log start to the end of
    /// what L0 holds.
    fn log_tail_bytes(&self) -> u64 {
        let (start, end) = (Lsn(self.manifest.log_start), self.l0_end);
        let seg = self.vlog.segment_size() as u64;
        (end.segment().saturating_sub(start.segment()) * seg + end.offset() as u64)
            .saturating_sub(start.offset() as u64)
    }

    /// Closes the region cleanly: everything written is made durable, whatever the fsync policy,
    /// and a running compaction finishes (an orderly shutdown loses nothing even under `never`).
    pub fn close(mut self) -> Result<()> {
        let end = self.vlog.commit()?;
        self.vlog.sync_to(end)
    }

    /// Freezes L0 and waits until it is compacted into the levels.
    pub fn flush_now(&mut self) -> Result<()> {
        if self.frozen.is_some() {
            self.poll_compaction(true)?;
        }
        if self.active.version() > self.active.base_version() {
            self.freeze()?;
        }
        self.poll_compaction(true)
    }

    /// Moves the active L0 aside, starts a new one, and starts compacting the frozen one.
    fn freeze(&mut self) -> Result<()> {
        let version = self.active.version();
        if let Some(p) = &self.publications {
            // Batches applied to this L0 since the last group ended (a freeze in the middle of a
            // group) are written; publish them with the rest once the log is synced that far.
            p.push(self.vlog.end(), version, &self.active.publisher());
        }
        let seq = self.arena_seq + 1;
        let mut next = Writer::create_at(self.cfg.shm_dir.join(format!("l0-{seq}.arena")), &self.cfg.arena, version)?;
        self.arena_seq = seq;
        if self.publications.is_some() {
            next.set_deferred_publish(true);
        }
        let frozen = std::mem::replace(&mut self.active, next);
        let sessions = self.sessions.clone();
        let log_bytes = std::mem::take(&mut self.active_log_bytes);
        self.frozen = Some(Frozen { writer: frozen, version, log_end: self.l0_end, sessions, log_bytes });
        self.publish_tables()?;
        if let Some(f) = &self.frozen {
            f.writer.set_tables_generation(self.tables_gen, true);
        }
        self.stats.flushes += 1;
        self.start_compaction()
    }

    fn start_compaction(&mut self) -> Result<()> {
        let Some(f) = &self.frozen else { return Ok(()) };
        let compactor = Compactor {
            cfg: self.cfg.clone(),
            levels: self.levels.clone(),
            manifest: self.manifest.clone(),
            capture: self.exports.is_some(),
            durability: self.vlog.durability(),
            publisher: f.writer.publisher(),
            gate: self.publications.clone().filter(|p| p.gated()),
        };
        let (reader, version, log_end) = (f.writer.reader()?, f.version, f.log_end);
        let sessions = f.sessions.clone();
        if !self.cfg.background_compaction {
            self.compaction = Some(Pending::Done(Box::new(compactor.run(reader, version, log_end, &sessions))));
            return Ok(());
        }
        let handle = std::thread::Builder::new()
            .name("dpukv-compact".into())
            .spawn(move || compactor.run(reader, version, log_end, &sessions))
            .map_err(|e| Error::io(&self.cfg.dir, e))?;
        self.compaction = Some(Pending::Running(handle));
        Ok(())
    }

    /// Installs the compaction's result if it finished (or, with `wait`, once it does); starts
    /// (again) the compaction of a frozen L0 that has none running. A failed compaction is
    /// retried after [`COMPACTION_RETRY`], or at once by a waiting caller, who gets its error if
    /// it fails again; the frozen L0 and the log keep its data meanwhile.
    pub(super) fn poll_compaction(&mut self, wait: bool) -> Result<()> {
        let outcome = match self.compaction.take() {
            None => {
                if self.frozen.is_none() {
                    return Ok(());
                }
                let due = self.compaction_failed.as_ref().is_none_or(|(_, at)| Instant::now() >= *at);
                if !(wait || due) {
                    return Ok(());
                }
                self.start_compaction()?;
                return if wait || !self.cfg.background_compaction { self.poll_compaction(wait) } else { Ok(()) };
            }
            Some(Pending::Running(h)) if !wait && !h.is_finished() => {
                self.compaction = Some(Pending::Running(h));
                return Ok(());
            }
            Some(Pending::Running(h)) => {
                h.join().unwrap_or_else(|_| Err(Error::Unavailable("the compaction thread panicked".into())))
            }
            Some(Pending::Done(r)) => *r,
        };
        let done = match outcome {
            Ok(done) => done,
            Err(e) => {
                self.stats.compaction_failures += 1;
                tracing::warn!(error = %e, dir = %self.cfg.dir.display(), "compaction failed; will retry");
                self.compaction_failed = Some((e.to_string(), Instant::now() + COMPACTION_RETRY));
                return if wait { Err(e) } else { Ok(()) };
            }
        };
        self.compaction_failed = None;
        self.stats.level_bytes_written += done.written;
        self.stats.level_bytes_read += done.read;
        self.stats.compactions += done.compactions;
        if let (Some(list), Some(e)) = (&mut self.exports, done.export) {
            list.push(e);
        }
        let old_generation = self.manifest.generation;
        self.levels = done.levels;
        self.manifest = done.manifest;
        let _ = self.cfg.fs().remove(&super::sessions_path(&self.cfg.dir, old_generation));
        let frozen = self.frozen.take();
        self.publish_tables()?;
        // Readers of older table sets may still read the frozen L0 and the replaced levels:
        // their files go once no pin can reach them.
        let dir = levels_dir(&self.cfg.dir);
        for id in done.obsolete {
            self.control.retire(Retired::Durable(crate::levels::segment_path(&dir, id)));
        }
        if let Some(f) = frozen {
            self.control.retire(Retired::Shared(f.writer.path().to_path_buf()));
        }
        self.reap()
    }
}

/// Bytes one operation's record takes in the log.
fn record_len(op: &BatchOp<'_>) -> usize {
    match *op {
        BatchOp::Put(k, v) | BatchOp::Insert(k, v) | BatchOp::Update(k, v) => {
            crate::vlog::RECORD_HEADER + k.len() + v.len()
        }
        BatchOp::Delete(k) | BatchOp::PutPointer(k, ..) => crate::vlog::RECORD_HEADER + k.len(),
    }
}

/// Fills every missing result with `e` (or an internal error).
fn finish(results: Vec<Option<Result<WriteAck>>>, e: Option<Error>) -> Vec<Result<WriteAck>> {
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(e.as_ref().map_or_else(|| Error::Unavailable("the group was not written".into()), Error::duplicate))
            })
        })
        .collect()
}

/// The results of a group whose log write failed: a batch refused for a precondition was
/// checked against the batches before it in the group — some of them never written — so its
/// answer (`KeyExists`, `KeyNotFound`) may describe state that does not exist. It is withdrawn:
/// refused as unavailable (retryable), like the writes. Every other result stands.
fn failed_group(results: Vec<Option<Result<WriteAck>>>, e: Error) -> Vec<Result<WriteAck>> {
    let results = results
        .into_iter()
        .map(|r| match r {
            Some(Err(Error::KeyExists | Error::KeyNotFound)) => Some(Err(Error::Unavailable(format!(
                "the log failed while the batch's precondition was checked against its group: {e}"
            )))),
            r => r,
        })
        .collect();
    finish(results, Some(e))
}
