//! A region store (Tebis over Honeycomb, ARCHITECTURE.md §4): every write goes to the value log
//! first, then to the in-memory tree (L0). Values above the inline threshold stay in the log and
//! L0 holds a pointer to them. A full L0 is frozen and compacted into L1; each level Li compacts
//! into Li+1 when it outgrows `l0_budget * growth^i` (leveled). The manifest, replaced atomically,
//! names the live levels and the log position recovery replays from.
//!
//! # Layout
//! - `merge`: reads across tables (newest first), merged scans, floor searches.
//! - `compact`: the compaction thread: L0 into L1, cascades, the new manifest.
//! - `tables`: the table set shared with readers in other processes, and [`RegionReader`].
//! - `replica`: Send Index and Build Index: [`IndexExport`] from the primary, [`Backup`].
//! - this module: [`Region`]: writes, freeze, compaction, recovery.

mod compact;
mod merge;
mod replica;
mod tables;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use merge::{Src, Stored};
pub use replica::{Backup, IndexExport, ShippedLevel};
pub use tables::RegionReader;
use tables::TableSet;

use crate::btree::{BatchOp, Writer};
use crate::config::{ArenaConfig, MAX_VALUE_LEN};
use crate::error::{Error, Result};
use crate::levels::{Level, Manifest};
use crate::vlog::{Lsn, Record, RecoveryReport, ValueLog, VlogConfig, VlogReader};

/// Region configuration.
#[derive(Debug, Clone)]
pub struct RegionConfig {
    /// Durable directory: `vlog/`, `levels/`, `MANIFEST`.
    pub dir: PathBuf,
    /// Directory for the L0 arenas and the table set (a tmpfs shared with the device).
    pub shm_dir: PathBuf,
    /// L0 arena geometry (`keep_tombstones` is forced on).
    pub arena: ArenaConfig,
    /// Value-log settings.
    pub vlog: VlogConfig,
    /// L0 is frozen and compacted once its arena holds this many bytes.
    pub l0_budget: u64,
    /// Level i holds up to `l0_budget * growth_factor^i` bytes.
    pub growth_factor: u64,
    /// Level node size.
    pub level_node_size: u32,
    /// Level segment size.
    pub level_segment_size: u32,
    /// Compact on a background thread (default). Off, compaction runs inline in the writer's
    /// thread — for measuring single-threaded work.
    pub background_compaction: bool,
}

impl RegionConfig {
    /// Defaults for a region rooted at `dir` with arenas in `shm_dir`.
    pub fn new(dir: impl AsRef<Path>, shm_dir: impl AsRef<Path>) -> RegionConfig {
        RegionConfig {
            dir: dir.as_ref().to_path_buf(),
            shm_dir: shm_dir.as_ref().to_path_buf(),
            arena: ArenaConfig { capacity: 1 << 30, keep_tombstones: true, ..ArenaConfig::default() },
            vlog: VlogConfig::default(),
            l0_budget: 64 << 20,
            growth_factor: 10,
            level_node_size: 4096,
            level_segment_size: 2 << 20,
            background_compaction: true,
        }
    }
}

impl RegionConfig {
    /// A deliberately tiny geometry (512 B nodes, 8 KiB L0, small segments) under which every few
    /// writes flush L0 and compactions cascade: for tests and crash drills.
    pub fn tiny(dir: impl AsRef<Path>, shm_dir: impl AsRef<Path>, fsync: crate::vlog::FsyncPolicy) -> RegionConfig {
        RegionConfig {
            arena: ArenaConfig { capacity: 8 << 20, ..ArenaConfig::small_nodes(512) },
            vlog: VlogConfig { segment_size: 16384, fsync },
            l0_budget: 8 << 10,
            growth_factor: 3,
            level_node_size: 512,
            level_segment_size: 4096,
            ..RegionConfig::new(dir, shm_dir)
        }
    }
}

/// What a write returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteAck {
    /// The batch's version.
    pub version: u64,
    /// The log position after the batch: the batch is durable once the log's durable position
    /// reaches it ([`Region::wait_durable`]; at once under `FsyncPolicy::Always`).
    pub end: Lsn,
}

/// What opening a region found.
#[derive(Debug, Clone, Default)]
pub struct RegionRecovery {
    /// The value log's recovery.
    pub log: RecoveryReport,
    /// Records replayed into L0.
    pub replayed: u64,
    /// Records of an incomplete trailing batch that were dropped.
    pub dropped: u64,
}

/// Counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct RegionStats {
    /// L0 freezes (each followed by a compaction into L1).
    pub flushes: u64,
    /// Level-to-level compactions.
    pub compactions: u64,
    /// Bytes written to level segments.
    pub level_bytes_written: u64,
    /// Bytes of level segments read by compactions (the older level of every merge).
    pub level_bytes_read: u64,
}

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

/// One region's store. Single writer; reads from this handle see the latest writes.
pub struct Region {
    cfg: RegionConfig,
    vlog: ValueLog,
    vreader: VlogReader,
    active: Writer,
    arena_seq: u64,
    /// `levels[i]` is level i + 1.
    levels: Vec<Option<Arc<Level>>>,
    manifest: Manifest,
    tables_gen: u64,
    stats: RegionStats,
    /// When set, every compaction's output is captured here for shipping to backups.
    exports: Option<Vec<IndexExport>>,
    /// The L0 being compacted, if any (at most one at a time).
    frozen: Option<Frozen>,
    /// The compaction in progress (or finished, waiting to be installed).
    compaction: Option<Pending>,
    /// The segment being collected and the offset to continue from.
    gc_cursor: Option<(u64, u32)>,
    /// Collected segments, deleted once no reader is older than the version that relocated them.
    gc_pending: Vec<(u64, u64)>,
    /// The current pass collects segments below this one (fixed when the pass starts, so the
    /// pass's own rewrites, and the flushes they cause, do not extend it).
    gc_boundary: Option<u64>,
}

/// Reports `e` for every batch of a group that has no result yet (the log failed under them).
fn fail_all(results: Vec<Option<Result<WriteAck>>>, e: Error) -> Vec<Result<WriteAck>> {
    let msg = e.to_string();
    let mut e = Some(e);
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| Err(e.take().unwrap_or_else(|| Error::Config(format!("group commit failed: {msg}")))))
        })
        .collect()
}

pub(crate) fn levels_dir(dir: &Path) -> PathBuf {
    dir.join("levels")
}

/// A compaction running on its thread, or one that ran inline.
enum Pending {
    Running(JoinHandle<Result<compact::Compacted>>),
    Done(Result<compact::Compacted>),
}

/// A frozen L0 and what it covers.
struct Frozen {
    writer: Writer,
    version: u64,
    log_end: Lsn,
}

impl Drop for Region {
    fn drop(&mut self) {
        // Let a running compaction finish: it writes segments and the manifest.
        if let Some(Pending::Running(h)) = self.compaction.take() {
            let _ = h.join();
        }
    }
}

impl Region {
    /// Opens or creates the region: loads the manifest, maps the levels, recovers the value log's
    /// tail, and replays the log from the manifest's position into a fresh L0.
    pub fn open(cfg: RegionConfig) -> Result<(Region, RegionRecovery)> {
        let mut cfg = cfg;
        cfg.arena.keep_tombstones = true;
        cfg.arena.validate()?;
        if cfg.growth_factor < 2 || cfg.l0_budget == 0 {
            return Err(Error::Config("growth_factor must be >= 2 and l0_budget > 0".into()));
        }
        for d in [&cfg.dir, &levels_dir(&cfg.dir), &cfg.shm_dir] {
            std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
        }
        tables::remove_stale_arenas(&cfg.shm_dir)?;
        let manifest = Manifest::load(&cfg.dir)?.unwrap_or(Manifest { next_segment: 1, ..Manifest::default() });
        let mut levels = Vec::new();
        for meta in &manifest.levels {
            let i = meta.level as usize - 1;
            levels.resize(levels.len().max(i + 1), None);
            levels[i] = Some(Arc::new(Level::open(levels_dir(&cfg.dir), meta.clone())?));
        }
        let (vlog, log_report) = ValueLog::open(cfg.dir.join("vlog"), cfg.vlog.clone())?;
        let vreader = vlog.reader();
        let active = Writer::create_at(cfg.shm_dir.join("l0-1.arena"), &cfg.arena, manifest.max_version)?;
        let mut region = Region {
            cfg,
            vlog,
            vreader,
            active,
            arena_seq: 1,
            levels,
            manifest,
            tables_gen: 0,
            stats: RegionStats::default(),
            exports: None,
            frozen: None,
            compaction: None,
            gc_cursor: None,
            gc_pending: Vec::new(),
            gc_boundary: None,
        };
        region.remove_unreferenced_segments()?;
        let mut rec = RegionRecovery { log: log_report, ..RegionRecovery::default() };
        region.replay(&mut rec)?;
        region.publish_tables()?;
        Ok((region, rec))
    }

    /// Replays committed batches from the manifest's log position; drops a trailing batch that
    /// has no batch-end record (it was never acknowledged).
    fn replay(&mut self, rec: &mut RegionRecovery) -> Result<()> {
        let start = Lsn(self.manifest.log_start.max(Lsn::new(0, 0).0));
        let mut batch: Vec<(Lsn, Record<'static>)> = Vec::new();
        let mut batches: Vec<Vec<(Lsn, Record<'static>)>> = Vec::new();
        let mut last_end = start;
        let vreader = self.vreader.clone();
        self.vlog.replay(start, |at, r| {
            if r.version <= self.manifest.max_version {
                let what = "log record older than the levels it should follow";
                return Err(Error::corrupt_file(&vreader.segment_path(at), at.offset() as u64, what));
            }
            let end = r.batch_end;
            batch.push((at, r.to_owned()));
            if end {
                batches.push(std::mem::take(&mut batch));
            }
            Ok(())
        })?;
        for b in batches {
            let (first_lsn, version) = (b[0].0, b[0].1.version);
            if b.iter().any(|(_, r)| r.version != version) {
                let what = "records of one batch carry different versions";
                return Err(Error::corrupt_file(
                    &self.vreader.segment_path(first_lsn),
                    first_lsn.offset() as u64,
                    what,
                ));
            }
            let next = b.last().map(|(at, r)| Lsn(at.0 + r.encoded_len() as u64)).expect("non-empty batch");
            self.apply_to_l0(version, b.iter().map(|(at, r)| (r.key.as_ref(), r.tombstone, r.value.as_ref(), *at)))?;
            rec.replayed += b.len() as u64;
            last_end = next;
            self.maybe_flush(next)?;
        }
        if !batch.is_empty() {
            rec.dropped = batch.len() as u64;
            self.vlog.truncate_tail(batch[0].0)?;
        }
        let _ = last_end;
        Ok(())
    }

    /// The configuration in force.
    pub fn config(&self) -> &RegionConfig {
        &self.cfg
    }

    /// The newest version.
    pub fn version(&self) -> u64 {
        self.active.version()
    }

    /// Counters.
    pub fn stats(&self) -> RegionStats {
        self.stats
    }

    /// The current manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The value log (for replication and Send Index).
    pub fn vlog(&self) -> &ValueLog {
        &self.vlog
    }

    /// Blocks until everything up to `end` is durable.
    pub fn wait_durable(&self, end: Lsn) {
        self.vlog.wait_durable(end)
    }

    fn srcs(&self) -> Vec<Src<'_>> {
        std::iter::once(Src::Writer(&self.active))
            .chain(self.frozen.iter().map(|f| Src::Writer(&f.writer)))
            .chain(self.levels.iter().flatten().map(|l| Src::Level(l)))
            .collect()
    }

    /// The value of `key`.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match merge::get(&self.srcs(), key)? {
            Some(s) => merge::resolve(&self.vreader, key, s),
            None => Ok(None),
        }
    }

    /// Up to `limit` items with keys in `[lo, hi]`, ascending.
    pub fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        merge::scan(&self.srcs(), &self.vreader, lo, hi, limit)
    }

    /// Like [`Region::scan`] from the largest key `<= lo`.
    pub fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let srcs = self.srcs();
        let start = merge::floor_key(&srcs, lo)?.unwrap_or_else(|| lo.to_vec());
        merge::scan(&srcs, &self.vreader, &start, hi, limit)
    }

    fn exists(&self, key: &[u8]) -> Result<bool> {
        Ok(!matches!(merge::get(&self.srcs(), key)?, None | Some(Stored::Tombstone)))
    }

    /// Upsert.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<WriteAck> {
        self.write_batch(&[BatchOp::Put(key, value)])
    }

    /// Delete (a tombstone; absent keys are fine).
    pub fn delete(&mut self, key: &[u8]) -> Result<WriteAck> {
        self.write_batch(&[BatchOp::Delete(key)])
    }

    /// Applies `ops` atomically under one version: logged first (one group commit), then applied
    /// to L0. Insert/update preconditions are checked against the merged view; if one fails,
    /// nothing is written.
    pub fn write_batch(&mut self, ops: &[BatchOp<'_>]) -> Result<WriteAck> {
        self.write_group(&[ops]).pop().expect("one result per batch")
    }

    /// Group commit: applies several independent batches, each atomically under its own version
    /// (in order), with one log write and one sync for all of them. Each batch's preconditions see
    /// the batches before it in the group; a batch that fails them (or a limit) is skipped and the
    /// others proceed. Returns one result per batch.
    pub fn write_group(&mut self, batches: &[&[BatchOp<'_>]]) -> Vec<Result<WriteAck>> {
        let mut results: Vec<Option<Result<WriteAck>>> = batches.iter().map(|_| None).collect();
        let mut overlay: HashMap<&[u8], bool> = HashMap::new();
        let mut accepted: Vec<(usize, u64, Vec<Lsn>)> = Vec::new();
        let mut version = self.active.version();
        for (i, ops) in batches.iter().enumerate() {
            let bytes = match self.check_batch(ops, &mut overlay) {
                Ok(b) => b,
                Err(e) => {
                    results[i] = Some(Err(e));
                    continue;
                }
            };
            if let Err(e) = self.vlog.ensure_room(bytes) {
                results[i] = Some(Err(e));
                continue;
            }
            version += 1;
            let mut ptrs = Vec::with_capacity(ops.len());
            for (j, op) in ops.iter().enumerate() {
                let rec = match *op {
                    BatchOp::Put(k, v) | BatchOp::Insert(k, v) | BatchOp::Update(k, v) => Record::put(version, k, v),
                    BatchOp::Delete(k) => Record::delete(version, k),
                    BatchOp::PutPointer(..) => unreachable!("rejected by check_batch"),
                };
                // Cannot fail: ensure_room made room for every record of the batch.
                match self.vlog.append(&rec.in_batch(j + 1 == ops.len())) {
                    Ok(at) => ptrs.push(at),
                    Err(e) => return fail_all(results, e),
                }
            }
            accepted.push((i, version, ptrs));
        }
        let end = match self.vlog.commit() {
            Ok(end) => end,
            Err(e) => return fail_all(results, e),
        };
        for (i, version, ptrs) in accepted {
            let items = batches[i].iter().zip(&ptrs).map(|(op, &at)| match *op {
                BatchOp::Put(k, v) | BatchOp::Insert(k, v) | BatchOp::Update(k, v) => (k, false, v, at),
                BatchOp::Delete(k) | BatchOp::PutPointer(k, ..) => (k, true, &[][..], at),
            });
            results[i] = Some(self.apply_to_l0(version, items).map(|()| WriteAck { version, end }));
        }
        if let Err(e) = self.maybe_flush(end) {
            return fail_all(results, e);
        }
        results.into_iter().map(|r| r.expect("every batch has a result")).collect()
    }

    /// Validates a batch and checks its preconditions against the merged view plus `overlay` (the
    /// effects of the batches before it in a group); on success records its effects in `overlay`
    /// and returns the bytes its records take in the log.
    fn check_batch<'k>(&self, ops: &[BatchOp<'k>], overlay: &mut HashMap<&'k [u8], bool>) -> Result<usize> {
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
            bytes += crate::vlog::RECORD_HEADER + key.len() + value.map_or(0, |v| v.len());
        }
        overlay.extend(mine);
        Ok(bytes)
    }

    /// Applies logged records (key, tombstone, value, position) to L0 under `version`.
    fn apply_to_l0<'k>(
        &mut self,
        version: u64,
        items: impl Iterator<Item = (&'k [u8], bool, &'k [u8], Lsn)>,
    ) -> Result<()> {
        let inline = self.cfg.arena.inline_threshold as usize;
        let ops: Vec<BatchOp<'k>> = items
            .map(|(k, tomb, v, at)| {
                if tomb {
                    BatchOp::Delete(k)
                } else if v.len() <= inline {
                    BatchOp::Put(k, v)
                } else {
                    BatchOp::PutPointer(k, at.0, v.len() as u32)
                }
            })
            .collect();
        if self.active.version() + 1 != version {
            return Err(Error::corrupt(version, "log versions are not consecutive"));
        }
        match self.active.write_batch(&ops) {
            Ok(_) => Ok(()),
            Err(Error::ArenaFull { .. }) => {
                // The batch is logged: make room by flushing L0, then apply it to the new one.
                self.flush(self.vlog.end())?;
                self.active.write_batch(&ops).map(|_| ())
            }
            Err(e) => Err(e),
        }
    }

    /// Installs a finished compaction; freezes L0 once it reaches its budget (waiting for the
    /// previous compaction first if it is still running: backpressure).
    fn maybe_flush(&mut self, log_end: Lsn) -> Result<()> {
        self.poll_compaction(false)?;
        if self.active.stats().allocated_bytes >= self.cfg.l0_budget {
            self.poll_compaction(true)?;
            self.freeze(log_end)?;
        }
        Ok(())
    }

    /// Freezes L0 (everything logged before `log_end`) and waits until it is compacted into the
    /// levels.
    pub fn flush(&mut self, log_end: Lsn) -> Result<()> {
        self.poll_compaction(true)?;
        self.freeze(log_end)?;
        self.poll_compaction(true)
    }

    /// Flushes whatever L0 holds now (tests, shutdown).
    pub fn flush_now(&mut self) -> Result<()> {
        self.flush(self.vlog.end())
    }

    /// Moves the active L0 aside, starts a new one, and starts compacting the frozen one.
    fn freeze(&mut self, log_end: Lsn) -> Result<()> {
        let version = self.active.version();
        self.arena_seq += 1;
        let next =
            Writer::create_at(self.cfg.shm_dir.join(format!("l0-{}.arena", self.arena_seq)), &self.cfg.arena, version)?;
        let frozen = std::mem::replace(&mut self.active, next);
        self.frozen = Some(Frozen { writer: frozen, version, log_end });
        self.publish_tables()?;
        if let Some(f) = &self.frozen {
            f.writer.set_tables_generation(self.tables_gen, true);
        }
        self.stats.flushes += 1;
        self.start_compaction()
    }

    fn start_compaction(&mut self) -> Result<()> {
        let Some(f) = &self.frozen else { return Ok(()) };
        let compactor = compact::Compactor {
            cfg: self.cfg.clone(),
            levels: self.levels.clone(),
            manifest: self.manifest.clone(),
            capture: self.exports.is_some(),
        };
        let (reader, version, log_end) = (f.writer.reader()?, f.version, f.log_end);
        if !self.cfg.background_compaction {
            self.compaction = Some(Pending::Done(compactor.run(reader, version, log_end)));
            return self.poll_compaction(true);
        }
        let handle = std::thread::Builder::new()
            .name("dpukv-compact".into())
            .spawn(move || compactor.run(reader, version, log_end))
            .map_err(|e| Error::io(&self.cfg.dir, e))?;
        self.compaction = Some(Pending::Running(handle));
        Ok(())
    }

    /// Installs the running compaction's result if it finished (or, with `wait`, once it does).
    /// A failed compaction is reported and retried at the next call; the frozen L0 and the log
    /// keep its data meanwhile.
    fn poll_compaction(&mut self, wait: bool) -> Result<()> {
        let done = match self.compaction.take() {
            None => {
                if self.frozen.is_some() && wait {
                    self.start_compaction()?;
                    return self.poll_compaction(true);
                }
                return Ok(());
            }
            Some(Pending::Running(h)) if !wait && !h.is_finished() => {
                self.compaction = Some(Pending::Running(h));
                return Ok(());
            }
            Some(Pending::Running(h)) => {
                h.join().map_err(|_| Error::Config("the compaction thread panicked".into()))??
            }
            Some(Pending::Done(r)) => r?,
        };
        self.stats.level_bytes_written += done.written;
        self.stats.level_bytes_read += done.read;
        self.stats.compactions += done.compactions;
        if let (Some(list), Some(e)) = (&mut self.exports, done.export) {
            list.push(e);
        }
        self.levels = done.levels;
        self.manifest = done.manifest;
        let frozen = self.frozen.take();
        self.publish_tables()?;
        for id in done.obsolete {
            let _ = std::fs::remove_file(crate::levels::segment_path(&levels_dir(&self.cfg.dir), id));
        }
        if let Some(f) = frozen {
            let path = f.writer.path().to_path_buf();
            drop(f);
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }

    /// One bounded step of value-log garbage collection: examines up to `max_records` records of
    /// the oldest segment that lies entirely before the manifest's log start (so every record in
    /// it is indexed by a level), rewrites the values still in use to the head of the log (one
    /// batch), and deletes collected segments once no reader can be pinned before the rewrite.
    /// A pass covers the segments below the log start as it was when the pass began; `more` is
    /// false once the pass is complete (the next call starts a new pass).
    pub fn gc_step(&mut self, max_records: usize) -> Result<GcStep> {
        let mut step = GcStep::default();
        if !self.gc_pending.is_empty() {
            let oldest = self.active.oldest_reader_version()?;
            let (ready, wait): (Vec<_>, Vec<_>) = self.gc_pending.iter().partition(|(_, v)| *v <= oldest);
            self.gc_pending = wait;
            for (seg, _) in ready {
                self.vlog.remove_segment(seg)?;
                step.deleted += 1;
            }
        }
        let boundary = *self.gc_boundary.get_or_insert(Lsn(self.manifest.log_start).segment());
        if self.gc_cursor.is_none() {
            let pending: Vec<u64> = self.gc_pending.iter().map(|p| p.0).collect();
            self.gc_cursor =
                self.vlog.segments().into_iter().find(|&s| s < boundary && !pending.contains(&s)).map(|s| (s, 0));
        }
        let Some((seg, from)) = self.gc_cursor else {
            step.more = !self.gc_pending.is_empty();
            if !step.more {
                self.gc_boundary = None;
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
            self.write_batch(&ops)?;
            step.relocated = live.len() as u64;
        }
        match next {
            Some(off) => self.gc_cursor = Some((seg, off)),
            None => {
                self.gc_cursor = None;
                self.gc_pending.push((seg, self.version()));
            }
        }
        let pending: Vec<u64> = self.gc_pending.iter().map(|p| p.0).collect();
        let left = self.vlog.segments().iter().any(|&s| s < boundary && !pending.contains(&s));
        step.more = self.gc_cursor.is_some() || !self.gc_pending.is_empty() || left;
        if !step.more {
            self.gc_boundary = None;
        }
        Ok(step)
    }

    /// Starts capturing every compaction's output for shipping (Send Index on the primary).
    pub fn capture_exports(&mut self) {
        self.exports.get_or_insert_with(Vec::new);
    }

    /// The compaction outputs captured since the last call, in order.
    pub fn take_exports(&mut self) -> Vec<IndexExport> {
        self.exports.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Copies of the log's segments as they are now: (segment id, bytes), for a backup.
    pub fn log_segments(&self) -> Result<Vec<(u64, Vec<u8>)>> {
        let dir = self.vlog.dir().to_path_buf();
        self.vlog
            .segments()
            .into_iter()
            .map(|id| {
                let p = dir.join(format!("{id:016}.vlog"));
                std::fs::read(&p).map(|b| (id, b)).map_err(|e| Error::io(&p, e))
            })
            .collect()
    }

    /// Deletes level segment files no manifest names (left by a crash mid-compaction).
    fn remove_unreferenced_segments(&self) -> Result<()> {
        let live: std::collections::HashSet<u64> =
            self.manifest.levels.iter().flat_map(|l| l.segments.iter().copied()).collect();
        let dir = levels_dir(&self.cfg.dir);
        for e in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let e = e.map_err(|e| Error::io(&dir, e))?;
            let name = e.file_name();
            if let Some(id) = name.to_string_lossy().strip_suffix(".seg").and_then(|s| s.parse::<u64>().ok())
                && !live.contains(&id)
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(())
    }

    fn publish_tables(&mut self) -> Result<()> {
        self.tables_gen += 1;
        let set = TableSet {
            generation: self.tables_gen,
            active: self.active.path().to_path_buf(),
            frozen: self.frozen.iter().map(|f| f.writer.path().to_path_buf()).collect(),
            dir: self.cfg.dir.clone(),
            manifest: Manifest {
                levels: self.levels.iter().flatten().map(|l| l.meta().clone()).collect(),
                ..self.manifest.clone()
            },
        };
        set.store(&self.cfg.shm_dir)?;
        self.active.set_tables_generation(self.tables_gen, false);
        Ok(())
    }
}
