//! A region store (Tebis over Honeycomb, ARCHITECTURE.md §4): every write goes to the value log
//! first, then to the in-memory tree (L0). Values above the inline threshold stay in the log and
//! L0 holds a pointer to them. A full L0 is frozen and compacted into L1; each level Li compacts
//! into Li+1 when it outgrows `l0_budget * growth^i` (leveled). The manifest, replaced atomically,
//! names the live levels and the log position recovery replays from.
//!
//! # Layout
//! - `merge`: reads across tables (newest first), merged scans, floor searches.
//! - `tables`: the table set shared with readers in other processes, and [`RegionReader`].
//! - `replica`: Send Index and Build Index: [`IndexExport`] from the primary, [`Backup`].
//! - this module: [`Region`]: writes, freeze, compaction, recovery.

mod merge;
mod replica;
mod tables;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use merge::{MergeCursor, Src, Stored};
pub use replica::{Backup, IndexExport, ShippedLevel};
pub use tables::RegionReader;
use tables::TableSet;

use crate::btree::{BatchOp, Writer};
use crate::config::{ArenaConfig, MAX_VALUE_LEN};
use crate::error::{Error, Result};
use crate::levels::{Level, LevelBuilder, LevelMeta, Manifest};
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
    /// The segment being collected and the offset to continue from.
    gc_cursor: Option<(u64, u32)>,
    /// Collected segments, deleted once no reader is older than the version that relocated them.
    gc_pending: Vec<(u64, u64)>,
    /// The current pass collects segments below this one (fixed when the pass starts, so the
    /// pass's own rewrites, and the flushes they cause, do not extend it).
    gc_boundary: Option<u64>,
}

fn levels_dir(dir: &Path) -> PathBuf {
    dir.join("levels")
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
            gc_cursor: None,
            gc_pending: Vec::new(),
            gc_boundary: None,
        };
        region.remove_unreferenced_segments()?;
        let mut rec = RegionRecovery { log: log_report, ..RegionRecovery::default() };
        region.replay(&mut rec)?;
        region.publish_tables(false)?;
        Ok((region, rec))
    }

    /// Replays committed batches from the manifest's log position; drops a trailing batch that
    /// has no batch-end record (it was never acknowledged).
    fn replay(&mut self, rec: &mut RegionRecovery) -> Result<()> {
        let start = Lsn(self.manifest.log_start.max(Lsn::new(0, 0).0));
        let mut batch: Vec<(Lsn, Record<'static>)> = Vec::new();
        let mut batches: Vec<Vec<(Lsn, Record<'static>)>> = Vec::new();
        let mut last_end = start;
        self.vlog.replay(start, |at, r| {
            if r.version <= self.manifest.max_version {
                return Err(Error::corrupt(at.0, "log record older than the levels it should follow"));
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
                return Err(Error::corrupt(first_lsn.0, "records of one batch carry different versions"));
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
        std::iter::once(Src::Writer(&self.active)).chain(self.levels.iter().flatten().map(|l| Src::Level(l))).collect()
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
        if ops.is_empty() {
            return Err(Error::Config("empty batch".into()));
        }
        let max_key = self.cfg.arena.max_key_len as usize;
        let mut overlay: HashMap<&[u8], bool> = HashMap::new();
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
                let exists = match overlay.get(key) {
                    Some(&e) => e,
                    None => self.exists(key)?,
                };
                if exists != need {
                    return Err(if need { Error::KeyNotFound } else { Error::KeyExists });
                }
            }
            if ops.len() > 1 {
                overlay.insert(key, after);
            }
            bytes += crate::vlog::RECORD_HEADER + key.len() + value.map_or(0, |v| v.len());
        }
        self.vlog.ensure_room(bytes)?;
        let version = self.active.version() + 1;
        let mut ptrs = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let last = i + 1 == ops.len();
            let rec = match *op {
                BatchOp::Put(k, v) | BatchOp::Insert(k, v) | BatchOp::Update(k, v) => Record::put(version, k, v),
                BatchOp::Delete(k) => Record::delete(version, k),
                BatchOp::PutPointer(..) => unreachable!("rejected above"),
            };
            ptrs.push(self.vlog.append(&rec.in_batch(last))?);
        }
        let end = self.vlog.commit()?;
        let items = ops.iter().zip(&ptrs).map(|(op, &at)| match *op {
            BatchOp::Put(k, v) | BatchOp::Insert(k, v) | BatchOp::Update(k, v) => (k, false, v, at),
            BatchOp::Delete(k) | BatchOp::PutPointer(k, ..) => (k, true, &[][..], at),
        });
        self.apply_to_l0(version, items)?;
        self.maybe_flush(end)?;
        Ok(WriteAck { version, end })
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

    fn maybe_flush(&mut self, log_end: Lsn) -> Result<()> {
        if self.active.stats().allocated_bytes >= self.cfg.l0_budget {
            self.flush(log_end)?;
        }
        Ok(())
    }

    /// Freezes L0 (everything logged before `log_end`) and compacts it into the levels.
    pub fn flush(&mut self, log_end: Lsn) -> Result<()> {
        let version = self.active.version();
        self.arena_seq += 1;
        let next =
            Writer::create_at(self.cfg.shm_dir.join(format!("l0-{}.arena", self.arena_seq)), &self.cfg.arena, version)?;
        let frozen = std::mem::replace(&mut self.active, next);
        self.publish_tables_with(Some(&frozen))?;
        frozen.set_tables_generation(self.tables_gen, true);
        self.compact_l0(&frozen, version, log_end)?;
        self.stats.flushes += 1;
        self.publish_tables(false)?;
        let path = frozen.path().to_path_buf();
        drop(frozen);
        let _ = std::fs::remove_file(&path);
        Ok(())
    }

    /// Flushes whatever L0 holds now (tests, shutdown).
    pub fn flush_now(&mut self) -> Result<()> {
        self.flush(self.vlog.end())
    }

    fn level_budget(&self, level: usize) -> u64 {
        self.cfg.l0_budget.saturating_mul(self.cfg.growth_factor.saturating_pow(level as u32))
    }

    fn compact_l0(&mut self, frozen: &Writer, version: u64, log_end: Lsn) -> Result<()> {
        let mut next_segment = self.manifest.next_segment;
        let mut obsolete: Vec<u64> = Vec::new();
        // L0 -> L1, then cascade while a level outgrows its budget.
        let mut newer: Arc<Level> = {
            let older = self.levels.first().cloned().flatten();
            let bottom = self.levels.iter().skip(1).all(Option::is_none);
            let meta =
                self.merge_into(&Src::Writer(frozen), Some(version), older.as_deref(), bottom, 1, &mut next_segment)?;
            if let Some(o) = &older {
                obsolete.extend(&o.meta().segments);
            }
            Arc::new(Level::open(levels_dir(&self.cfg.dir), meta)?)
        };
        let mut level = 1usize;
        let mut installed: Vec<Option<Arc<Level>>> = self.levels.clone();
        installed.resize(installed.len().max(1), None);
        installed[0] = Some(newer.clone());
        while newer.meta().bytes > self.level_budget(level) {
            let older = installed.get(level).cloned().flatten();
            let bottom = installed.iter().skip(level + 1).all(Option::is_none);
            let meta = self.merge_into(
                &Src::Level(&newer),
                None,
                older.as_deref(),
                bottom,
                level as u32 + 1,
                &mut next_segment,
            )?;
            obsolete.extend(&newer.meta().segments);
            self.stats.level_bytes_read += newer.meta().bytes;
            if let Some(o) = &older {
                obsolete.extend(&o.meta().segments);
                self.stats.level_bytes_read += o.meta().bytes;
            }
            installed.resize(installed.len().max(level + 1), None);
            installed[level - 1] = None;
            newer = Arc::new(Level::open(levels_dir(&self.cfg.dir), meta)?);
            installed[level] = Some(newer.clone());
            self.stats.compactions += 1;
            level += 1;
        }
        let manifest = Manifest {
            generation: self.manifest.generation + 1,
            levels: installed.iter().flatten().map(|l| l.meta().clone()).collect(),
            log_start: log_end.0,
            next_segment,
            max_version: version,
        };
        manifest.store(&self.cfg.dir)?;
        if self.exports.is_some() {
            let export = self.export_new_levels(&manifest)?;
            if let Some(list) = &mut self.exports {
                list.push(export);
            }
        }
        self.manifest = manifest;
        self.levels = installed;
        for id in obsolete {
            let p = crate::levels::segment_path(&levels_dir(&self.cfg.dir), id);
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }

    /// Merges `newer` over `older` into a new level `level`; drops tombstones at the bottom.
    fn merge_into(
        &mut self,
        newer: &Src<'_>,
        newer_version: Option<u64>,
        older: Option<&Level>,
        bottom: bool,
        level: u32,
        next_segment: &mut u64,
    ) -> Result<LevelMeta> {
        let dir = levels_dir(&self.cfg.dir);
        let mut b = LevelBuilder::new(&dir, *next_segment, self.cfg.level_node_size, self.cfg.level_segment_size)?;
        let srcs: Vec<Src<'_>> = match older {
            Some(o) => vec![clone_src(newer), Src::Level(o)],
            None => vec![clone_src(newer)],
        };
        let mut cur = MergeCursor::new(&srcs, &[], &[0xff; crate::config::MAX_KEY_LEN + 1]);
        while let Some((k, v, s, from)) = cur.next()? {
            if bottom && s == Stored::Tombstone {
                continue;
            }
            // An L0 has no per-item versions: its entries take the version it was frozen at.
            let version = if from == 0 { newer_version.unwrap_or(v) } else { v };
            b.add(&k, version, &s.as_entry())?;
        }
        let meta = b.finish(level)?;
        *next_segment = meta.segments.last().map_or(*next_segment, |s| s + 1);
        self.stats.level_bytes_written += meta.bytes;
        Ok(meta)
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

    /// The levels of `manifest` that the current manifest does not have, with their bytes.
    fn export_new_levels(&self, manifest: &Manifest) -> Result<IndexExport> {
        let dir = levels_dir(&self.cfg.dir);
        let mut levels = Vec::new();
        for m in manifest.levels.iter().filter(|m| !self.manifest.levels.contains(m)) {
            let mut segs = Vec::new();
            for &id in &m.segments {
                let p = crate::levels::segment_path(&dir, id);
                segs.push((id, std::fs::read(&p).map_err(|e| Error::io(&p, e))?));
            }
            levels.push((m.clone(), segs));
        }
        Ok(IndexExport { manifest: manifest.clone(), levels })
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

    fn publish_tables(&mut self, _frozen: bool) -> Result<()> {
        self.publish_tables_with(None)
    }

    fn publish_tables_with(&mut self, frozen: Option<&Writer>) -> Result<()> {
        self.tables_gen += 1;
        let set = TableSet {
            generation: self.tables_gen,
            active: self.active.path().to_path_buf(),
            frozen: frozen.map(|f| f.path().to_path_buf()).into_iter().collect(),
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

fn clone_src<'a>(s: &Src<'a>) -> Src<'a> {
    match s {
        Src::Writer(w) => Src::Writer(w),
        Src::Snap(x) => Src::Snap(x),
        Src::Level(l) => Src::Level(l),
    }
}
