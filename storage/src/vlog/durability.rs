//! Durability of one value log: the state its writer, its flusher thread and every waiter share.
//!
//! Positions (log sequence numbers) move through three marks: **written** (handed to the OS),
//! **synced** (known on disk), and **acknowledged** (a write may be reported done: synced under
//! `Always`, written under `Interval` and `Never`). The flusher syncs on demand — under `Always`
//! as soon as the previous sync finished whenever something is written and not synced (so one
//! sync serves every write that arrived during the last one), under `Interval(d)` once the oldest
//! unsynced write is `d` old, and under any policy when someone asks ([`Durability::sync_to`]).
//!
//! **A sync hold** (`Always` only, [`Durability::hold`]): the writer may take over the syncing of
//! what it writes next — the flusher leaves those bytes alone — and end the hold by syncing them on
//! its own thread ([`Durability::sync_held`]) or by handing them over ([`Durability::unhold`]).
//! Syncs never overlap, whichever thread makes them (of two overlapping syncs of one file Linux
//! may report a writeback error to one and success to the other), and a success seen while a
//! failure is recorded does not count.
//!
//! **A failed sync** (or write) is never acknowledged: Linux may have dropped the dirty pages, so
//! the page cache cannot be trusted past the last good sync. The log keeps an in-memory copy of
//! every byte written since that sync (at most one segment), and the flusher *repairs* the
//! segment: it writes a new file from the synced prefix and that copy, syncs it and renames it
//! over the old one. While the log is failed it takes no writes; waiters wait for the first repair
//! attempt and fail with [`Error::LogFailed`] if it fails (their writes may still become durable
//! by a later repair: their outcome is unknown). Repairs are retried with backoff, so a log that
//! ran out of disk takes writes again by itself once space is freed.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::reader::VlogReader;
use super::segment::{self, SEGMENT_HEADER};
use super::{FsyncPolicy, Lsn};
use crate::error::{Error, Result};
use crate::fs::{Fs, FsFile};

/// Called by the flusher with every new synced position (under `Always`), before any waiter for
/// it is released.
pub type SyncHook = Arc<dyn Fn(Lsn) + Send + Sync>;

const MAX_BACKOFF: Duration = Duration::from_secs(2);
const COPY_CHUNK: usize = 256 << 10;

/// The active segment of a log being opened.
pub(crate) struct Tail {
    pub(crate) seg: u64,
    pub(crate) file: Arc<dyn FsFile>,
    /// The end of its records.
    pub(crate) end: Lsn,
    /// It ends with a seal record.
    pub(crate) sealed: bool,
}

pub(crate) struct State {
    /// The active segment and its file.
    pub(crate) seg: u64,
    pub(crate) file: Arc<dyn FsFile>,
    pub(crate) written: u64,
    pub(crate) synced: u64,
    pub(crate) ack: u64,
    requested: u64,
    /// The active segment's bytes `[unsynced_from, written)`, for a repair.
    unsynced: Vec<u8>,
    unsynced_from: u32,
    /// A write to the active segment is in progress (a repair waits for it).
    writing: bool,
    /// The active segment ends with a seal record.
    pub(crate) sealed: bool,
    failed: Option<String>,
    /// Waiters at or below this position fail (a repair attempt failed under them).
    doomed: u64,
    first_unsynced: Option<Instant>,
    next_repair: Instant,
    backoff: Duration,
    stop: bool,
    /// Repairs done so far.
    pub(crate) repairs: u64,
    /// Under `Always`: the writer syncs what it writes from this position on itself, or hands
    /// it to the flusher when it is done ([`Durability::hold`]); the flusher syncs only what was
    /// written before it.
    hold_from: Option<u64>,
    /// Syncs made by the flusher, and by the writer ending a hold.
    pub(crate) syncs: SyncCounts,
    /// A sync is in flight (the flusher's or the writer's): syncs of the log never overlap —
    /// of two overlapping syncs of one file Linux may report a writeback error to one and
    /// success to the other, and the success, seen first, would count dropped pages as synced.
    syncing: bool,
    /// The flusher waits for the writer's sync to end (to be woken when it does).
    flusher_waits: bool,
}

/// How many syncs each thread made (successful or not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncCounts {
    /// By the log's flusher thread.
    pub flusher: u64,
    /// By the log's writer, ending a hold ([`super::ValueLog::sync_held`]).
    pub writer: u64,
}

/// See the module documentation.
pub(crate) struct Durability {
    st: Mutex<State>,
    /// Where waiters for a position wait.
    cv: Condvar,
    /// Where the flusher waits (apart, so that a sync done or a position reached wakes only
    /// those who wait for it: the flusher's turn per group was a context switch of its own).
    flush_cv: Condvar,
    policy: FsyncPolicy,
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    reader: VlogReader,
    hook: Mutex<Option<SyncHook>>,
}

impl Durability {
    /// The durability of a log whose active segment is `tail` (everything before its end is
    /// synced: recovery made it so).
    pub(crate) fn new(
        policy: FsyncPolicy,
        fs: Arc<dyn Fs>,
        dir: PathBuf,
        reader: VlogReader,
        tail: Tail,
    ) -> Durability {
        let Tail { seg, file, end, sealed } = tail;
        Durability {
            st: Mutex::new(State {
                seg,
                file,
                written: end.0,
                synced: end.0,
                ack: end.0,
                requested: end.0,
                unsynced: Vec::new(),
                unsynced_from: end.offset(),
                writing: false,
                sealed,
                failed: None,
                doomed: 0,
                first_unsynced: None,
                next_repair: Instant::now(),
                backoff: Duration::ZERO,
                stop: false,
                repairs: 0,
                hold_from: None,
                syncs: SyncCounts::default(),
                syncing: false,
                flusher_waits: false,
            }),
            cv: Condvar::new(),
            flush_cv: Condvar::new(),
            policy,
            fs,
            dir,
            reader,
            hook: Mutex::new(None),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A waiter's wait for the state to change.
    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// The flusher's wait for work (or its timeout).
    fn flusher_wait<'a>(&self, g: MutexGuard<'a, State>, timeout: Option<Duration>) -> MutexGuard<'a, State> {
        match timeout {
            Some(t) => self.flush_cv.wait_timeout(g, t).unwrap_or_else(|e| e.into_inner()).0,
            None => self.flush_cv.wait(g).unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Wakes the flusher: something to sync, a repair to make, a stop.
    fn wake_flusher(&self) {
        self.flush_cv.notify_one();
    }

    /// Wakes whoever waits for a position: it moved, or the log failed or stopped.
    fn wake_waiters(&self) {
        self.cv.notify_all();
    }

    pub(crate) fn set_hook(&self, hook: Option<SyncHook>) {
        *self.hook.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    fn failed_error(&self, st: &State) -> Error {
        Error::LogFailed { dir: self.dir.clone(), reason: st.failed.clone().unwrap_or_else(|| "stopped".into()) }
    }

    /// Writes `bytes` at the end of the active segment (the writer's only way to write).
    pub(crate) fn write(&self, bytes: &[u8]) -> Result<Lsn> {
        let (file, off, seg) = {
            let mut st = self.lock();
            if st.failed.is_some() || st.stop {
                return Err(self.failed_error(&st));
            }
            st.writing = true;
            (st.file.clone(), Lsn(st.written).offset(), st.seg)
        };
        let r = file.write_all_at(bytes, off as u64);
        let mut st = self.lock();
        st.writing = false;
        // Who waits for a write: the flusher under `Always` (it syncs what was written); under
        // `Interval` only for the first unsynced byte (then it sleeps until that byte is due);
        // a repair waiting for the write to end (the log failed meanwhile). Under `Interval` and
        // `Never` a write acknowledges itself, and no waiter's position is past what was
        // written (positions come from `end()`): nobody else is woken — a wake-up per write
        // cost the writer a futex call and the flusher a pointless turn.
        let wake = match self.policy {
            // (Not a write under a hold: the writer syncs it or hands it over.)
            FsyncPolicy::Always => st.hold_from.is_none(),
            FsyncPolicy::Interval(_) => st.first_unsynced.is_none(),
            FsyncPolicy::Never => false,
        } || st.failed.is_some()
            || r.is_err();
        let out = match r {
            Ok(()) => {
                st.unsynced.extend_from_slice(bytes);
                st.written = Lsn::new(seg, off + bytes.len() as u32).0;
                if self.policy != FsyncPolicy::Always {
                    st.ack = st.written;
                }
                st.first_unsynced.get_or_insert_with(Instant::now);
                Ok(Lsn(st.written))
            }
            Err(e) => {
                st.failed = Some(format!("write at {off} of segment {seg}: {e}"));
                st.backoff = Duration::ZERO;
                st.next_repair = Instant::now();
                Err(Error::LogFailed { dir: self.dir.clone(), reason: e.to_string() })
            }
        };
        if wake {
            self.wake_flusher();
        }
        if out.is_err() {
            self.wake_waiters();
        }
        out
    }

    /// Recovery only, before any write: the log ends at `at` (in the active segment); the bytes
    /// after it are zeroed and synced.
    pub(crate) fn cut(&self, at: Lsn) -> Result<()> {
        let mut st = self.lock();
        if at.segment() != st.seg || at.0 > st.written || st.written != st.synced || st.writing {
            return Err(Error::Config("cut: the position is not in the active segment's recovered tail".into()));
        }
        let len = (Lsn(st.written).offset() - at.offset()) as usize;
        let p = super::segment::path(&self.dir, st.seg);
        st.file.write_all_at(&vec![0u8; len], at.offset() as u64).map_err(|e| Error::io(&p, e))?;
        st.file.sync_data().map_err(|e| Error::io(&p, e))?;
        st.written = at.0;
        st.synced = at.0;
        st.ack = at.0;
        st.requested = st.requested.min(at.0);
        st.unsynced.clear();
        st.unsynced_from = at.offset();
        Ok(())
    }

    /// Writes the seal record of the active segment.
    pub(crate) fn seal(&self, bytes: &[u8]) -> Result<()> {
        self.write(bytes)?;
        self.lock().sealed = true;
        Ok(())
    }

    /// Switches to a new active segment whose header is durable; every earlier position is
    /// synced (the old segment was sealed and synced first).
    pub(crate) fn switch(&self, seg: u64, file: Arc<dyn FsFile>) {
        let mut st = self.lock();
        let start = Lsn::new(seg, SEGMENT_HEADER).0;
        st.seg = seg;
        st.file = file;
        st.written = start;
        st.unsynced.clear();
        st.unsynced_from = SEGMENT_HEADER;
        st.sealed = false;
        st.first_unsynced = None;
        self.advance_synced(&mut st, start);
        st.ack = st.ack.max(start);
        self.wake_waiters();
        self.wake_flusher();
    }

    fn advance_synced(&self, st: &mut State, target: u64) {
        if target <= st.synced {
            return;
        }
        st.synced = target;
        if self.policy == FsyncPolicy::Always {
            st.ack = st.ack.max(target);
        }
        let t = Lsn(target);
        if t.segment() == st.seg && t.offset() > st.unsynced_from {
            let n = ((t.offset() - st.unsynced_from) as usize).min(st.unsynced.len());
            st.unsynced.drain(..n);
            st.unsynced_from = t.offset();
        }
        st.first_unsynced = (st.written > st.synced).then(Instant::now);
        if self.policy == FsyncPolicy::Always
            && let Some(h) = self.hook.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
        {
            h(Lsn(target));
        }
    }

    /// Blocks until `lsn` may be acknowledged.
    pub(crate) fn wait_ack(&self, lsn: Lsn) -> Result<()> {
        let mut st = self.lock();
        loop {
            if st.ack >= lsn.0 {
                return Ok(());
            }
            if (st.failed.is_some() && st.doomed >= lsn.0) || st.stop {
                return Err(self.failed_error(&st));
            }
            st = self.wait(st);
        }
    }

    /// Makes everything before `lsn` durable now (whatever the policy) and waits for it.
    pub(crate) fn sync_to(&self, lsn: Lsn) -> Result<()> {
        let mut st = self.lock();
        st.requested = st.requested.max(lsn.0);
        self.wake_flusher();
        loop {
            if st.synced >= lsn.0 {
                return Ok(());
            }
            if (st.failed.is_some() && st.doomed >= lsn.0) || st.stop {
                return Err(self.failed_error(&st));
            }
            st = self.wait(st);
        }
    }

    /// Under `Always`, the writer's promise to sync what it writes from now on itself
    /// ([`Durability::sync_held`]) or to hand it to the flusher ([`Durability::unhold`]): its
    /// writes do not wake the flusher meanwhile, and the flusher leaves them alone. A writer with
    /// nothing else to do then syncs its own group and answers it on its own thread — two thread
    /// hand-offs fewer per group (to the flusher and back) — while the writes that arrive during
    /// that sync gather into its next group, as they do in a single-threaded server's turn.
    pub(crate) fn hold(&self) {
        if self.policy == FsyncPolicy::Always {
            let mut st = self.lock();
            let written = st.written;
            st.hold_from.get_or_insert(written);
        }
    }

    /// Ends a [`Durability::hold`]: the flusher syncs what was written under it.
    pub(crate) fn unhold(&self) {
        let mut st = self.lock();
        if st.hold_from.take().is_some() && st.written > st.synced {
            self.wake_flusher();
        }
    }

    /// Ends a [`Durability::hold`] by syncing, on the calling thread, everything written so far
    /// (as the flusher would: the hook and every waiter see the new position). A failed log is
    /// left to the flusher, which repairs it. Without a hold (under `Interval` and `Never`
    /// there is none), nothing.
    pub(crate) fn sync_held(&self) {
        let mut st = self.lock();
        if st.hold_from.is_none() {
            return; // no hold (another policy): nothing of the caller's to sync
        }
        // A sync of the flusher's in flight (of what was written before the hold): never two at
        // once. The hold stays meanwhile, so that the flusher does not go on to sync this too.
        while st.syncing && st.failed.is_none() && !st.stop {
            st = self.wait(st);
        }
        st.hold_from = None;
        if st.failed.is_some() || st.stop || st.written <= st.synced {
            // (The flusher repairs a failed log, or makes the last sync before it stops.)
            self.wake_flusher();
            return;
        }
        drop(self.sync_file(st, true));
    }

    /// Syncs the active segment as it stands (everything written so far) — the one way either
    /// thread syncs the log, the flusher or the writer ending a hold —, with the lock let go
    /// meanwhile and `syncing` set so that no other sync begins; records the outcome and wakes
    /// every waiter. A success counts only if no failure was recorded meanwhile (a sync that
    /// failed may have dropped pages this one then found clean: the repair makes everything
    /// durable) and the segment synced is still the active one (a replaced segment's successor
    /// is synced already).
    fn sync_file<'a>(&'a self, mut st: MutexGuard<'a, State>, by_writer: bool) -> MutexGuard<'a, State> {
        let (file, target) = (st.file.clone(), st.written);
        if by_writer {
            st.syncs.writer += 1;
        } else {
            st.syncs.flusher += 1;
        }
        st.syncing = true;
        drop(st);
        let r = file.sync_data();
        let mut st = self.lock();
        st.syncing = false;
        if std::mem::take(&mut st.flusher_waits) {
            self.wake_flusher();
        }
        let current = Arc::ptr_eq(&file, &st.file);
        match r {
            Ok(()) if st.failed.is_none() && current => self.advance_synced(&mut st, target),
            Ok(()) => {}
            Err(e) if current => {
                st.failed = Some(format!("sync of segment {}: {e}", st.seg));
                st.backoff = Duration::ZERO;
                st.next_repair = Instant::now();
                self.wake_flusher(); // (it repairs)
            }
            Err(_) => {}
        }
        self.wake_waiters();
        st
    }

    pub(crate) fn failed(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// Asks the flusher to finish: a last sync (or repair), then exit.
    pub(crate) fn stop(&self) {
        let mut st = self.lock();
        st.requested = st.written;
        st.stop = true;
        self.wake_flusher();
        self.wake_waiters();
    }

    /// The flusher thread's body.
    pub(crate) fn run_flusher(&self) {
        let mut st = self.lock();
        loop {
            if st.failed.is_some() {
                if st.writing || st.syncing {
                    st.flusher_waits |= st.syncing;
                    st = self.flusher_wait(st, None);
                    continue;
                }
                let now = Instant::now();
                if now < st.next_repair && !st.stop {
                    let t = st.next_repair - now;
                    st = self.flusher_wait(st, Some(t));
                    continue;
                }
                match self.repair(&mut st) {
                    Ok(()) => {
                        st.repairs += 1;
                        self.wake_waiters();
                    }
                    Err(e) => {
                        st.doomed = st.written;
                        st.backoff = (st.backoff * 2).clamp(Duration::from_millis(10), MAX_BACKOFF);
                        st.next_repair = Instant::now() + st.backoff;
                        st.failed = Some(format!("repair failed: {e}"));
                        self.wake_waiters();
                        if st.stop {
                            return;
                        }
                    }
                }
                continue;
            }
            let unsynced = st.written > st.synced;
            let due = match self.policy {
                // (What the writer holds it syncs itself, or hands over with a wake-up.)
                FsyncPolicy::Always => st.synced < st.hold_from.unwrap_or(st.written),
                FsyncPolicy::Interval(d) => unsynced && st.first_unsynced.is_some_and(|t| t.elapsed() >= d),
                FsyncPolicy::Never => false,
            };
            if !(due || st.requested > st.synced || (st.stop && unsynced)) {
                if st.stop {
                    return;
                }
                let timeout = match (self.policy, st.first_unsynced) {
                    (FsyncPolicy::Interval(d), Some(t)) if unsynced => Some(d.saturating_sub(t.elapsed())),
                    _ => None,
                };
                st = self.flusher_wait(st, timeout);
                continue;
            }
            if st.syncing {
                // The writer is syncing (ending a hold): it wakes us when done.
                st.flusher_waits = true;
                st = self.flusher_wait(st, None);
                continue;
            }
            st = self.sync_file(st, false);
        }
    }

    /// Rewrites the active segment from its synced prefix (read back from the file: those pages
    /// reached the disk) and the in-memory copy of the rest, syncs it and renames it into place.
    fn repair(&self, st: &mut State) -> std::io::Result<()> {
        let (seg, size) = (st.seg, st.file.size()?);
        let (path, tmp) = (segment::path(&self.dir, seg), segment::repair_path(&self.dir, seg));
        let _ = self.fs.remove(&tmp);
        let out = (|| {
            let new = self.fs.create(&tmp)?;
            new.allocate(size)?;
            let mut buf = vec![0u8; COPY_CHUNK];
            let mut at = 0u64;
            while at < st.unsynced_from as u64 {
                let n = (st.unsynced_from as u64 - at).min(COPY_CHUNK as u64) as usize;
                st.file.read_exact_at(&mut buf[..n], at)?;
                new.write_all_at(&buf[..n], at)?;
                at += n as u64;
            }
            new.write_all_at(&st.unsynced, st.unsynced_from as u64)?;
            new.sync_data()?;
            self.fs.rename(&tmp, &path)?;
            self.fs.sync_dir(&self.dir)?;
            Ok(new)
        })();
        match out {
            Ok(new) => {
                tracing::warn!(dir = %self.dir.display(), seg, "value-log segment repaired after a failed sync or write");
                st.file = new;
                self.reader.forget(seg);
                st.failed = None;
                st.backoff = Duration::ZERO;
                let written = st.written;
                self.advance_synced(st, written);
                st.ack = st.ack.max(written);
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    dir = %self.dir.display(),
                    seg,
                    error = %e,
                    "repairing a value-log segment failed; writes stay refused and it will be retried"
                );
                let _ = self.fs.remove(&tmp);
                Err(e)
            }
        }
    }
}
