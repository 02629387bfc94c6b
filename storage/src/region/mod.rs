//! A region store (Tebis over Honeycomb, docs/architecture.md): every write goes to the value log
//! first, then to the in-memory tree (L0). Values above the inline threshold stay in the log and
//! L0 holds a pointer to them. A full L0 is frozen and compacted into L1; each level Li compacts
//! into Li+1 when it outgrows `l0_budget * growth^i` (leveled). The manifest, replaced atomically,
//! names the live levels and the log position recovery replays from.
//!
//! # Layout
//! - `write`: the write path (group commit, versions, L0), freezing, installing compactions.
//! - `publish`: read versions published once durable (fsync `always`).
//! - `gc`: value-log garbage collection.
//! - `control`: the region control block (which table set is current; which ones readers still
//!   use) and the retirement of files readers may still reach.
//! - `merge`: reads across tables (newest first), merged scans, floor searches.
//! - `compact`: the compaction thread: L0 into L1, cascades, the new manifest.
//! - `tables`: the table set shared with readers in other processes, and [`RegionReader`].
//! - `replica`: Send Index and Build Index: [`IndexExport`] from the primary, [`Backup`].
//! - `sessions`: exactly-once sessions: what a retried write finds.
//! - this module: [`Region`], its configuration, opening and recovery, reads.
//!
//! # Invariants
//! - A batch is in the log before it is in L0, and in L0 under the version its log records carry;
//!   versions only grow, with gaps where a log write failed (a version is never reused).
//! - Readers see a batch once it may be acknowledged (module `publish`).
//! - The log a level covers is durable before the manifest naming the level is stored, and
//!   recovery refuses a manifest that covers more log than the log holds.
//! - A frozen L0 covers exactly the log up to the end of the last batch it holds.

mod compact;
mod control;
mod gc;
mod merge;
mod publish;
mod replica;
mod sessions;
mod snapshot;
mod tables;
mod write;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use control::{HostControl, Retired};
pub use gc::GcStep;
use merge::{Src, Stored};
use publish::Publications;
pub use publish::ReadGate;
pub use replica::{
    Backup, ExportParts, IndexExport, IndexInstall, MAX_SHIPPED_SEGMENT, ShippedIndex, adopt_built_index, build_dir,
    build_index,
};

pub use sessions::{Lookup, SessionEntry, SessionLimits, Sessions};
pub use snapshot::{LogFile, RegionSnapshot, RestoreDir};
pub use tables::RegionReader;
use tables::TableSet;
pub use write::Tagged;
use write::{Frozen, Pending};

use crate::btree::Writer;
use crate::config::ArenaConfig;
use crate::error::{Error, Result};
use crate::fs::Fs;
use crate::levels::{Level, Manifest};
use crate::vlog::{FsyncPolicy, Lsn, RecoveryReport, ValueLog, VlogConfig, VlogReader};

/// The whole durable index of the region in `dir` as one export — its manifest, sessions
/// snapshot and every level, pinned — for a backup that starts from nothing or missed exports
/// (None: nothing compacted yet; the log alone holds everything). Callable from any thread while
/// the region runs: its level files never change; if a newer compaction retires one before it
/// is pinned, this tries the newer manifest (a few times, then says so).
pub fn export_dir(dir: &Path) -> Result<Option<IndexExport>> {
    let mut tries = 0;
    loop {
        let Some(manifest) = Manifest::load(dir)? else { return Ok(None) };
        if manifest.generation == 0 {
            return Ok(None);
        }
        let sp = sessions_path(dir, manifest.generation);
        let pinned = std::fs::read(&sp)
            .map_err(|e| Error::io(&sp, e))
            .and_then(|sessions| IndexExport::pin(dir, manifest.clone(), sessions, manifest.levels.clone()));
        match pinned {
            Ok(e) => return Ok(Some(e)),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound && tries < 8 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

/// Region configuration.
#[derive(Debug, Clone)]
pub struct RegionConfig {
    /// Durable directory: `vlog/`, `levels/`, `MANIFEST`.
    pub dir: PathBuf,
    /// Directory for the L0 arenas and the table set (a tmpfs shared with the device).
    pub shm_dir: PathBuf,
    /// L0 arena geometry (`keep_tombstones` is forced on).
    pub arena: ArenaConfig,
    /// Value-log settings; its file layer (`vlog.fs`) is the one levels and the manifest use too.
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
    /// L0 is also frozen once the log it covers (since the manifest's log start) passes this many
    /// bytes, so a small set of hot keys (an L0 of pointers that never fills) cannot keep the log
    /// from being compacted and collected; it also bounds recovery's replay. 0 = 4 x `l0_budget`.
    pub max_log_tail: u64,
    /// Garbage collection takes a log segment once at least this fraction of it is garbage
    /// (0.5 by default: rewriting its live half costs at most what it frees).
    pub gc_min_garbage: f64,
    /// Bounds of the exactly-once session table.
    pub session_limits: SessionLimits,
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
            max_log_tail: 0,
            gc_min_garbage: 0.5,
            session_limits: SessionLimits::default(),
        }
    }

    /// A deliberately tiny geometry (512 B nodes, 8 KiB L0, 16 KiB log segments) under which every
    /// few writes flush L0 and compactions cascade: for tests and crash drills.
    pub fn tiny(dir: impl AsRef<Path>, shm_dir: impl AsRef<Path>, fsync: FsyncPolicy) -> RegionConfig {
        let mut cfg = RegionConfig::new(dir, shm_dir);
        cfg.arena = ArenaConfig { capacity: 8 << 20, ..ArenaConfig::small_nodes(512) };
        cfg.vlog.segment_size = 16 << 10;
        cfg.vlog.fsync = fsync;
        cfg.l0_budget = 8 << 10;
        cfg.growth_factor = 3;
        cfg.level_node_size = 512;
        cfg.level_segment_size = 4096;
        cfg
    }

    /// This configuration with its durable files written through `fs`.
    pub fn with_fs(mut self, fs: Arc<dyn Fs>) -> RegionConfig {
        self.vlog.fs = fs;
        self
    }

    fn fs(&self) -> &dyn Fs {
        self.vlog.fs.as_ref()
    }

    fn log_tail_budget(&self) -> u64 {
        if self.max_log_tail > 0 { self.max_log_tail } else { self.l0_budget.saturating_mul(4) }
    }
}

/// What a write returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteAck {
    /// The batch's version.
    pub version: u64,
    /// The log position after the batch: the batch may be acknowledged once
    /// [`Region::wait_durable`] returns for it.
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
    /// Compactions that failed (and were retried).
    pub compaction_failures: u64,
    /// Bytes written to level segments.
    pub level_bytes_written: u64,
    /// Bytes of level segments read by compactions (the older level of every merge).
    pub level_bytes_read: u64,
}

/// Where the level segments of the region (or backup) in `dir` live.
pub(crate) fn levels_dir(dir: &Path) -> PathBuf {
    dir.join("levels")
}

/// Where the value-log segments of the region (or backup) in `dir` live.
pub(crate) fn vlog_dir(dir: &Path) -> PathBuf {
    dir.join("vlog")
}

/// The exactly-once sessions snapshot stored with manifest `generation`.
pub(crate) fn sessions_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("SESSIONS-{generation:016}"))
}

/// What [`Region::middle_key`] found in a range: its live data and a key near its middle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Middle {
    /// Keys plus stored value lengths of the live entries (dead versions and tombstones excluded).
    pub live_bytes: u64,
    /// Live keys.
    pub live_keys: u64,
    /// A key near the middle by bytes, never the first (None with fewer than two live keys).
    pub key: Option<Vec<u8>>,
}

/// One region's store. Single writer; reads from this handle see the latest writes (readers in
/// other threads and processes see them once acknowledged).
pub struct Region {
    /// The region directory's lock, held while the region is open.
    _lock: std::fs::File,
    cfg: RegionConfig,
    vlog: ValueLog,
    vreader: VlogReader,
    active: Writer,
    /// The log position after the last batch applied to the active L0: where a freeze cuts.
    l0_end: Lsn,
    /// The last version given to a batch; the next batch gets a larger one.
    last_version: u64,
    /// Under `FsyncPolicy::Always`: read versions waiting for their log to be synced.
    publications: Option<Arc<Publications>>,
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
    /// Bytes of the log values the active L0 points at (for size estimates).
    active_log_bytes: u64,
    /// The compaction in progress (or finished, waiting to be installed).
    compaction: Option<Pending>,
    /// The last compaction failed: why, and when to try again.
    compaction_failed: Option<(String, Instant)>,
    /// Why the region takes no writes (a batch half-applied to L0: only a restart recovers).
    poisoned: Option<String>,
    gc: gc::GcState,
    /// The region control block: table sets published, files retired until no reader needs them.
    control: HostControl,
    /// Log repairs already announced in a table set.
    repairs_published: u64,
    /// Exactly-once sessions (what retried writes find).
    sessions: Sessions,
}

/// What one [`Region::maintain`] call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Maintenance {
    /// The garbage-collection step, if one ran.
    pub gc: GcStep,
    /// Retired files deleted (no reader could reach them any more).
    pub deleted_files: usize,
    /// Retired files still waiting for readers to move on.
    pub waiting_files: usize,
}

impl Drop for Region {
    fn drop(&mut self) {
        // Let a running compaction finish: it writes segments and the manifest.
        if let Some(Pending::Running(h)) = self.compaction.take() {
            let _ = h.join();
        }
        self.vlog.set_sync_hook(None);
    }
}

impl Region {
    /// Opens or creates the region: loads the manifest, maps the levels, recovers the value log,
    /// checks the manifest against it, and replays the log from the manifest's position into a
    /// fresh L0.
    pub fn open(cfg: RegionConfig) -> Result<(Region, RegionRecovery)> {
        let mut cfg = cfg;
        cfg.arena.keep_tombstones = true;
        cfg.arena.validate()?;
        if cfg.growth_factor < 2 || cfg.l0_budget == 0 {
            return Err(Error::Config("growth_factor must be >= 2 and l0_budget > 0".into()));
        }
        if u64::from(cfg.level_segment_size) > MAX_SHIPPED_SEGMENT {
            return Err(Error::Config(format!(
                "level_segment_size must be at most {MAX_SHIPPED_SEGMENT} (what a backup takes)"
            )));
        }
        for d in [&cfg.dir, &levels_dir(&cfg.dir)] {
            cfg.fs().create_dir_all(d).map_err(|e| Error::io(d, e))?;
        }
        // One owner per region: a second host on the same directory would append to the same
        // log and remove the first one's arenas. The lock goes with the process (or this handle).
        let lock_path = cfg.dir.join("LOCK");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::io(&lock_path, e))?;
        lock.try_lock().map_err(|_| Error::RegionBusy(cfg.dir.clone()))?;
        // Pins of level files shipped by an earlier process (its senders are gone).
        let ship = replica::ship_dir(&cfg.dir);
        if let Err(e) = std::fs::remove_dir_all(&ship)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            return Err(Error::io(&ship, e));
        }
        std::fs::create_dir_all(&cfg.shm_dir).map_err(|e| Error::io(&cfg.shm_dir, e))?;
        let control = HostControl::create(&cfg.shm_dir)?;
        tables::remove_stale_files(&cfg.shm_dir)?;
        let manifest = Manifest::load(&cfg.dir)?.unwrap_or(Manifest { next_segment: 1, ..Manifest::default() });
        let mut levels = Vec::new();
        for meta in &manifest.levels {
            let i = meta.level as usize - 1;
            levels.resize(levels.len().max(i + 1), None);
            levels[i] = Some(Arc::new(Level::open(levels_dir(&cfg.dir), meta.clone())?));
        }
        let (vlog, log_report) = ValueLog::open(vlog_dir(&cfg.dir), cfg.vlog.clone())?;
        if manifest.log_start > vlog.end().0 {
            let p = cfg.dir.join(crate::levels::MANIFEST);
            let what = "the manifest covers log positions the value log does not hold (lost log records)";
            return Err(Error::corrupt_file(&p, 24, what));
        }
        let sessions = match std::fs::read(sessions_path(&cfg.dir, manifest.generation)) {
            Ok(b) => Sessions::decode(&b, cfg.session_limits, &sessions_path(&cfg.dir, manifest.generation))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && manifest.generation == 0 => {
                Sessions::new(cfg.session_limits)
            }
            Err(e) => return Err(Error::io(&sessions_path(&cfg.dir, manifest.generation), e)),
        };
        let vreader = vlog.reader();
        let active = Writer::create_at(cfg.shm_dir.join("l0-1.arena"), &cfg.arena, manifest.max_version)?;
        let log_start = Lsn(manifest.log_start);
        let mut region = Region {
            _lock: lock,
            cfg,
            vlog,
            vreader,
            active,
            l0_end: log_start,
            last_version: manifest.max_version,
            publications: None,
            arena_seq: 1,
            levels,
            manifest,
            tables_gen: 0,
            stats: RegionStats::default(),
            exports: None,
            frozen: None,
            active_log_bytes: 0,
            compaction: None,
            compaction_failed: None,
            poisoned: None,
            gc: gc::GcState::default(),
            control,
            repairs_published: 0,
            sessions,
        };
        region.remove_unreferenced_segments()?;
        region.remove_stale_sessions()?;
        let mut rec = RegionRecovery { log: log_report, ..RegionRecovery::default() };
        region.replay(&mut rec)?;
        region.l0_end = region.l0_end.max(region.vlog.end());
        // Versions continue above anything the log has seen, even records a torn tail cut off.
        region.last_version = region.last_version.max(region.active.version()).max(rec.log.max_version);
        if region.cfg.vlog.fsync == FsyncPolicy::Always {
            // Everything replayed is durable (recovery synced it): published already. From here
            // on the flusher publishes.
            let p = Publications::new(region.vlog.synced_lsn());
            region.vlog.set_sync_hook(Some(p.hook()));
            region.active.set_deferred_publish(true);
            region.publications = Some(p);
        }
        region.publish_tables()?;
        Ok((region, rec))
    }

    /// Replays committed batches from the manifest's log position, applying each as soon as it is
    /// complete; drops a trailing batch that has no batch-end record (it was never acknowledged).
    fn replay(&mut self, rec: &mut RegionRecovery) -> Result<()> {
        let mut cursor = self.vlog.cursor(Lsn(self.manifest.log_start));
        let mut batch: Vec<(Lsn, crate::vlog::Record<'static>)> = Vec::new();
        while let Some((at, r)) = cursor.next()? {
            let path = || self.vreader.segment_path(at);
            if r.version <= self.manifest.max_version {
                let what = "log record older than the levels it should follow";
                return Err(Error::corrupt_file(&path(), at.offset() as u64, what));
            }
            if batch.first().is_some_and(|(_, b)| b.version != r.version) {
                let what = "records of one batch carry different versions";
                return Err(Error::corrupt_file(&path(), at.offset() as u64, what));
            }
            let end = r.batch_end;
            batch.push((at, r));
            if !end {
                continue;
            }
            let b = std::mem::take(&mut batch);
            let (last_at, last) = b.last().expect("non-empty batch");
            let next = Lsn(last_at.0 + last.encoded_len() as u64);
            let version = last.version;
            if version <= self.active.version() {
                let what = "log versions go backwards";
                return Err(Error::corrupt_file(&path(), at.offset() as u64, what));
            }
            let data = b.iter().filter(|(_, r)| !r.meta);
            self.apply_to_l0(version, data.map(|(at, r)| (r.key.as_ref(), r.tombstone, r.value.as_ref(), *at)), next)?;
            for (at, r) in b.iter().filter(|(_, r)| r.meta) {
                let entries = r.annotation_data().and_then(Sessions::decode_note).ok_or_else(|| {
                    Error::corrupt_file(&self.vreader.segment_path(*at), at.offset() as u64, "malformed annotation")
                })?;
                self.sessions.record(version, &entries);
            }
            rec.replayed += b.iter().filter(|(_, r)| !r.meta).count() as u64;
            self.admit();
        }
        if let Some((first, _)) = batch.first() {
            // Only possible at the very end of the log: a torn write kept a prefix of a batch
            // that was never committed whole. Cut it out, so the next writes do not follow it.
            rec.dropped = batch.iter().filter(|(_, r)| !r.meta).count() as u64;
            self.vlog.cut_tail(*first)?;
        }
        Ok(())
    }

    /// The configuration in force.
    pub fn config(&self) -> &RegionConfig {
        &self.cfg
    }

    /// The newest version applied.
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

    /// Blocks until the batch ending at `end` may be acknowledged (and is visible to readers);
    /// an error if the log failed under it (the outcome is then unknown).
    pub fn wait_durable(&self, end: Lsn) -> Result<()> {
        self.vlog.wait_durable(end)
    }

    /// What a write `(client, seq)` finds in the exactly-once sessions (`first`: it is the write's
    /// first attempt).
    pub fn session_lookup(&self, client: u64, seq: u64, first: bool) -> Lookup {
        self.sessions.lookup(client, seq, first)
    }

    /// The client got replies for every seq below `below`: its entries go.
    pub fn session_acknowledge(&mut self, client: u64, below: u64) {
        self.sessions.acknowledge(client, below);
    }

    /// The exactly-once sessions.
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// Why the region refuses writes now, if it does.
    pub fn unavailable(&self) -> Option<String> {
        self.poisoned.clone().or_else(|| self.vlog.failure())
    }

    fn srcs(&self) -> Vec<Src<'_>> {
        std::iter::once(Src::Writer(&self.active))
            .chain(self.frozen.iter().map(|f| Src::Writer(&f.writer)))
            .chain(self.levels.iter().flatten().map(|l| Src::Level(l)))
            .collect()
    }

    /// The value of `key` (the latest write, acknowledged or not).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match merge::get(&self.srcs(), key)? {
            Some(s) => merge::resolve(&self.vreader, key, s),
            None => Ok(None),
        }
    }

    /// Up to `limit` items with keys in `[lo, hi]`, ascending.
    pub fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        merge::scan(&self.srcs(), &self.vreader, lo, hi, limit, usize::MAX, None)
    }

    /// Like [`Region::scan`], stopping once keys and values reach `max_bytes` (the item that
    /// reaches it is included).
    pub fn scan_bytes(&self, lo: &[u8], hi: &[u8], limit: usize, max_bytes: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        merge::scan(&self.srcs(), &self.vreader, lo, hi, limit, max_bytes, None)
    }

    /// Up to `limit` live keys in `[lo, hi]`, ascending, without reading values.
    pub fn scan_keys(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<Vec<u8>>> {
        self.scan_keys_counted(lo, hi, limit).map(|(keys, _)| keys)
    }

    /// [`Region::scan_keys`], and how many entries it stepped over to find them (deleted keys
    /// not yet compacted away included): what a scan that must skip tombstones costs.
    pub fn scan_keys_counted(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<(Vec<Vec<u8>>, u64)> {
        let srcs = self.srcs();
        let (mut out, mut visited) = (Vec::new(), 0);
        if lo > hi {
            return Ok((out, visited));
        }
        let mut cur = merge::MergeCursor::new(&srcs, lo, hi);
        while out.len() < limit
            && let Some((k, _, s, _)) = cur.next()?
        {
            visited += 1;
            if s != Stored::Tombstone {
                out.push(k);
            }
        }
        Ok((out, visited))
    }

    /// Estimated bytes of the region's data: its levels (their segments and the log bytes their
    /// pointers keep alive) and its L0 trees (keys, small values, nodes, and the log bytes of the
    /// values they point at). Overwritten versions count until compactions drop them.
    pub fn estimated_bytes(&self) -> u64 {
        let levels: u64 = self
            .levels
            .iter()
            .flatten()
            .map(|l| l.meta().bytes + l.meta().log_refs.iter().map(|(_, b)| b).sum::<u64>())
            .sum();
        let l0: u64 = std::iter::once(&self.active)
            .chain(self.frozen.iter().map(|f| &f.writer))
            .map(|w| w.stats().allocated_bytes)
            .sum();
        let l0_log = self.active_log_bytes + self.frozen.as_ref().map_or(0, |f| f.log_bytes);
        levels + l0 + l0_log
    }

    /// The live data of `[lo, hi]` (inclusive; an empty `hi`: to the end of the key space) by
    /// bytes (keys plus stored value lengths; dead versions and tombstones excluded), and a key
    /// near its middle, never its first key: where a split leaves two halves of about equal size
    /// (None with fewer than two live keys). Walks the keys twice without reading values from the
    /// log.
    pub fn middle_key(&self, lo: &[u8], hi: &[u8]) -> Result<Middle> {
        let srcs = self.srcs();
        let size = |s: &Stored, k: &[u8]| match s {
            Stored::Value(v) => Some(k.len() + v.len()),
            Stored::Pointer { len, .. } => Some(k.len() + *len as usize),
            Stored::Tombstone => None,
        };
        let all = [0xffu8; crate::config::MAX_KEY_LEN + 1];
        let hi = if hi.is_empty() { &all[..] } else { hi };
        let (mut total, mut keys) = (0usize, 0u64);
        let mut cur = merge::MergeCursor::new(&srcs, lo, hi);
        while let Some((k, _, s, _)) = cur.next()? {
            if let Some(n) = size(&s, &k) {
                total += n;
                keys += 1;
            }
        }
        let found = |key| Middle { live_bytes: total as u64, live_keys: keys, key };
        let (mut seen, mut first) = (0usize, true);
        let mut cur = merge::MergeCursor::new(&srcs, lo, hi);
        while let Some((k, _, s, _)) = cur.next()? {
            let Some(n) = size(&s, &k) else { continue };
            if !first && seen >= total / 2 {
                return Ok(found(Some(k)));
            }
            first = false;
            seen += n;
        }
        Ok(found(None))
    }

    /// About `want` keys cutting `(lo, hi)` into parts of similar size (see
    /// [`RegionReader::pivots`]).
    pub fn pivots(&self, lo: &[u8], hi: &[u8], want: usize) -> Result<Vec<Vec<u8>>> {
        merge::pivots(&self.srcs(), lo, hi, want)
    }

    /// Like [`Region::scan`] from the largest key `<= lo`.
    pub fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let srcs = self.srcs();
        let start = merge::floor_key(&srcs, lo)?.unwrap_or_else(|| lo.to_vec());
        merge::scan(&srcs, &self.vreader, &start, hi, limit, usize::MAX, None)
    }

    fn exists(&self, key: &[u8]) -> Result<bool> {
        Ok(!matches!(merge::get(&self.srcs(), key)?, None | Some(Stored::Tombstone)))
    }

    /// Starts capturing every compaction's output for shipping (Send Index on the primary).
    pub fn capture_exports(&mut self) {
        self.exports.get_or_insert_with(Vec::new);
    }

    /// Gates what readers see by a bound the caller moves (a cluster's primary: the log position
    /// every backup holds), besides durability: from now on a write becomes visible only once
    /// it ends at or before the bound. What the region holds now stays visible. Call before the
    /// first write.
    pub fn gate_reads(&mut self) -> ReadGate {
        let p = match &self.publications {
            Some(p) => p.clone(),
            None => {
                // Syncs do not gate under this policy: only the bound does.
                let p = Publications::new(Lsn(u64::MAX));
                self.active.set_deferred_publish(true);
                self.publications = Some(p.clone());
                p
            }
        };
        p.gate(self.vlog.end());
        ReadGate(p)
    }

    /// The compaction outputs captured since the last call, in order.
    pub fn take_exports(&mut self) -> Vec<IndexExport> {
        self.exports.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The region's whole durable index as one export (see [`export_dir`]).
    pub fn export_all(&self) -> Result<Option<IndexExport>> {
        export_dir(&self.cfg.dir)
    }

    /// Copies of the log's segments as they are now: (segment id, bytes), for a backup.
    pub fn log_segments(&self) -> Result<Vec<(u64, Vec<u8>)>> {
        self.vlog
            .segments()
            .into_iter()
            .map(|id| {
                let p = crate::vlog::segment_path(self.vlog.dir(), id);
                std::fs::read(&p).map(|b| (id, b)).map_err(|e| Error::io(&p, e))
            })
            .collect()
    }

    /// Deletes sessions snapshots of other manifests than the current one.
    fn remove_stale_sessions(&self) -> Result<()> {
        let keep = sessions_path(&self.cfg.dir, self.manifest.generation);
        for e in std::fs::read_dir(&self.cfg.dir).map_err(|e| Error::io(&self.cfg.dir, e))? {
            let e = e.map_err(|e| Error::io(&self.cfg.dir, e))?;
            if e.file_name().to_string_lossy().starts_with("SESSIONS-") && e.path() != keep {
                let _ = self.cfg.fs().remove(&e.path());
            }
        }
        Ok(())
    }

    /// Deletes level segment files no manifest names (left by a crash mid-compaction).
    fn remove_unreferenced_segments(&self) -> Result<()> {
        compact::remove_unreferenced(self.cfg.fs(), &levels_dir(&self.cfg.dir), &[&self.manifest])
    }

    /// Publishes the current tables as a new table set (generation + 1) for readers.
    fn publish_tables(&mut self) -> Result<()> {
        self.tables_gen += 1;
        self.repairs_published = self.vlog.repairs();
        let set = TableSet {
            generation: self.tables_gen,
            active: self.active.path().to_path_buf(),
            frozen: self.frozen.iter().map(|f| f.writer.path().to_path_buf()).collect(),
            dir: self.cfg.dir.clone(),
            log_epoch: self.repairs_published,
            manifest: Manifest {
                levels: self.levels.iter().flatten().map(|l| l.meta().clone()).collect(),
                ..self.manifest.clone()
            },
        };
        set.store(&self.cfg.shm_dir)?;
        self.control.publish(&self.cfg.shm_dir, self.tables_gen)?;
        self.active.set_tables_generation(self.tables_gen, false);
        Ok(())
    }

    /// Deletes the retired files no reader can reach any more.
    fn reap(&mut self) -> Result<()> {
        self.reap_counted().map(|_| ())
    }

    fn reap_counted(&mut self) -> Result<usize> {
        let done = self.control.collect()?;
        let n = done.len();
        for r in done {
            match r {
                Retired::Shared(p) => {
                    let _ = std::fs::remove_file(p);
                }
                Retired::Durable(p) => {
                    let _ = self.cfg.fs().remove(&p);
                }
            }
        }
        Ok(n)
    }

    /// Background upkeep, for the region's owner to call a few times a second: installs a
    /// finished compaction (and retries a failed one), announces a repaired log segment to
    /// readers, runs one bounded garbage-collection step when a log segment is worth collecting,
    /// and deletes retired files no reader can reach any more.
    pub fn maintain(&mut self) -> Result<Maintenance> {
        let mut m = Maintenance::default();
        self.poll_compaction(false)?;
        if self.vlog.repairs() != self.repairs_published {
            self.publish_tables()?;
        }
        if self.unavailable().is_none() && (self.gc.is_busy() || !self.gc_candidates().is_empty()) {
            m.gc = self.gc_step(256)?;
        }
        m.deleted_files = self.reap_counted()?;
        m.waiting_files = self.control.pending();
        Ok(m)
    }

    /// Dead readers' slots the region control block took back so far.
    pub fn dead_reader_slots_cleared(&self) -> u64 {
        self.control.dead_slots_cleared()
    }
}
