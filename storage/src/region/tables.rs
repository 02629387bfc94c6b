//! The table set — which L0 arenas and levels make up a region, and where its log is — published
//! for readers in other processes (the device) as immutable files `tables-<generation>` in the
//! shared directory, announced through the region control block (module `control`); and
//! [`RegionReader`], the device's view of a region.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::control::{self, ReaderControl};
use super::merge::{self, Src};
use super::{levels_dir, vlog_dir};
use crate::btree::Reader;
use crate::error::{Error, Result};
use crate::levels::{Level, Manifest};
use crate::vlog::MappedLog;

const MAGIC: &[u8; 8] = b"DPUKVTS2";

/// Key-value pairs, ascending.
pub type Items = Vec<(Vec<u8>, Vec<u8>)>;

/// The tables of a region, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableSet {
    pub(crate) generation: u64,
    pub(crate) active: PathBuf,
    pub(crate) frozen: Vec<PathBuf>,
    /// The region's durable directory (value log and levels).
    pub(crate) dir: PathBuf,
    /// Bumped when a log segment file was replaced (a repair): readers map the log afresh.
    pub(crate) log_epoch: u64,
    /// The levels (as in the manifest).
    pub(crate) manifest: Manifest,
}

fn put_path(b: &mut Vec<u8>, p: &Path) {
    let s = p.to_string_lossy();
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

impl TableSet {
    fn encode(&self) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.log_epoch.to_le_bytes());
        b.extend_from_slice(&(self.frozen.len() as u32 + 2).to_le_bytes());
        put_path(&mut b, &self.active);
        put_path(&mut b, &self.dir);
        for f in &self.frozen {
            put_path(&mut b, f);
        }
        b.extend_from_slice(&self.manifest.encode());
        b
    }

    fn decode(b: &[u8], path: &Path) -> Result<TableSet> {
        let bad = |off: usize| Error::corrupt_file(path, off as u64, "malformed table set");
        if b.len() < 28 || &b[..8] != MAGIC {
            return Err(bad(0));
        }
        let generation = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let log_epoch = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        let n = u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")) as usize;
        let mut p = 28;
        let mut paths = Vec::new();
        for _ in 0..n.min(1 << 16) {
            let len = b
                .get(p..p + 4)
                .map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")) as usize)
                .ok_or_else(|| bad(p))?;
            let s = b.get(p + 4..p + 4 + len).ok_or_else(|| bad(p))?;
            paths.push(PathBuf::from(String::from_utf8(s.to_vec()).map_err(|_| bad(p))?));
            p += 4 + len;
        }
        if paths.len() < 2 {
            return Err(bad(24));
        }
        let manifest = Manifest::decode(&b[p..], path)?;
        let frozen = paths.split_off(2);
        Ok(TableSet { generation, active: paths[0].clone(), dir: paths[1].clone(), frozen, log_epoch, manifest })
    }

    /// Writes the set's file (immutable once renamed into place; tmpfs: rename is enough).
    pub(crate) fn store(&self, shm_dir: &Path) -> Result<()> {
        let p = control::tables_path(shm_dir, self.generation);
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, self.encode()).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &p).map_err(|e| Error::io(&p, e))
    }

    fn load(shm_dir: &Path, generation: u64) -> Result<TableSet> {
        let p = control::tables_path(shm_dir, generation);
        let b = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        TableSet::decode(&b, &p)
    }
}

/// Removes what a previous host left in the shared directory (its L0s are rebuilt from the log):
/// arenas, table-set files and staging files. Readers of the previous host's control block learn
/// from it (the new host marks it closed) that they must reopen; mappings they hold stay valid.
pub(crate) fn remove_stale_files(shm_dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(shm_dir).map_err(|e| Error::io(shm_dir, e))? {
        let e = e.map_err(|e| Error::io(shm_dir, e))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("l0-") || name.starts_with("tables-") {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

/// Reads a region from another thread or process — the device's view: it pins the current table
/// set in the region control block for each operation, maps that set's arenas, levels and log
/// segments read-only, and answers get/scan/floor-scan from one consistent snapshot per
/// operation. It never waits for the host: a new table set is one generation number away, and
/// every file a pinned set names exists until the pin is gone.
pub struct RegionReader {
    shm_dir: PathBuf,
    ctl: ReaderControl,
    set: TableSet,
    active: Reader,
    frozen: Vec<Reader>,
    levels: Vec<Arc<Level>>,
    log: MappedLog,
    /// Table-set switches so far.
    pub reloads: u64,
    /// Device mode: arenas are read through page-table copies fed by their command rings.
    device: bool,
    /// Counters of readers already replaced by a table-set switch.
    retired: crate::btree::ReadStats,
}

impl RegionReader {
    /// Opens the region whose shared memory is `shm_dir` (reading the arenas' page tables, as
    /// the host's CPU would).
    pub fn open(shm_dir: impl AsRef<Path>) -> Result<RegionReader> {
        Self::open_mode(shm_dir.as_ref(), false)
    }

    /// Opens the region as the device does: every arena through its own page-table copy, fed by
    /// the arena's command ring.
    pub fn open_device(shm_dir: impl AsRef<Path>) -> Result<RegionReader> {
        Self::open_mode(shm_dir.as_ref(), true)
    }

    fn open_mode(shm_dir: &Path, device: bool) -> Result<RegionReader> {
        let mut ctl = ReaderControl::open(shm_dir)?;
        let (generation, pinned) = ctl.pin()?;
        let opened = Self::tables(shm_dir, generation, &[], device);
        ctl.unpin(pinned);
        let (set, active, frozen, levels) = opened?;
        let log = MappedLog::open(vlog_dir(&set.dir));
        Ok(RegionReader {
            shm_dir: shm_dir.to_path_buf(),
            ctl,
            set,
            active,
            frozen,
            levels,
            log,
            reloads: 0,
            device,
            retired: crate::btree::ReadStats::default(),
        })
    }

    /// Counters of the arena readers, over the reader's life.
    pub fn read_stats(&self) -> crate::btree::ReadStats {
        let mut s = self.retired;
        for r in std::iter::once(&self.active).chain(&self.frozen) {
            let x = r.stats();
            s.snapshots += x.snapshots;
            s.node_visits += x.node_visits;
            s.resyncs += x.resyncs;
            s.commands += x.commands;
            s.cache_hits += x.cache_hits;
            s.cache_misses += x.cache_misses;
            s.hinted += x.hinted;
            s.hint_misses += x.hint_misses;
        }
        s
    }

    /// Opens the tables of set `generation` (which the caller has pinned), reusing levels it
    /// already has.
    #[allow(clippy::type_complexity)]
    fn tables(
        shm_dir: &Path,
        generation: u64,
        have: &[Arc<Level>],
        device: bool,
    ) -> Result<(TableSet, Reader, Vec<Reader>, Vec<Arc<Level>>)> {
        let set = TableSet::load(shm_dir, generation)?;
        let open = |p: &PathBuf| if device { Reader::open_device(p) } else { Reader::open(p) };
        let active = open(&set.active)?;
        let frozen = set.frozen.iter().map(open).collect::<Result<Vec<_>>>()?;
        let levels = set
            .manifest
            .levels
            .iter()
            .map(|m| match have.iter().find(|l| l.meta() == m) {
                Some(l) => Ok(l.clone()),
                None => Level::open_trusted(levels_dir(&set.dir), m.clone()).map(Arc::new),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((set, active, frozen, levels))
    }

    /// Runs `f` on one consistent view of the tables: the pinned table set, and a snapshot of
    /// each of its arenas. A host that restarted (its control block closed) is followed; a pin
    /// revoked under us (we stalled past the lease) is retried once.
    fn with_srcs<T>(&mut self, mut f: impl FnMut(&[Src<'_>], &MappedLog) -> Result<T>) -> Result<T> {
        for attempt in 0.. {
            if self.ctl.closed() {
                let stats = self.read_stats();
                *self = Self::open_mode(&self.shm_dir, self.device)?;
                self.retired = stats;
            }
            let (generation, pinned) = self.ctl.pin()?;
            let out = self.pinned(generation, &mut f);
            let out = if self.ctl.unpin(pinned) { out } else { Err(Error::ReaderRevoked) };
            return match out {
                Err(Error::ReaderRevoked) if attempt == 0 => continue,
                out => out,
            };
        }
        unreachable!("the loop returns by its second attempt")
    }

    fn pinned<T>(&mut self, generation: u64, f: &mut impl FnMut(&[Src<'_>], &MappedLog) -> Result<T>) -> Result<T> {
        if generation != self.set.generation {
            let (set, active, frozen, levels) = Self::tables(&self.shm_dir, generation, &self.levels, self.device)?;
            self.retired = self.read_stats();
            if set.log_epoch != self.set.log_epoch {
                self.log.forget_all();
            } else {
                // Segments no table of the new set can reach were (or will be) deleted.
                let tail = crate::vlog::Lsn(set.manifest.log_start).segment();
                let refs: std::collections::HashSet<u64> =
                    set.manifest.levels.iter().flat_map(|l| l.log_refs.iter().map(|(s, _)| *s)).collect();
                self.log.retain(|id| id >= tail || refs.contains(&id));
            }
            (self.set, self.active, self.frozen, self.levels) = (set, active, frozen, levels);
            self.reloads += 1;
        }
        let snap = self.active.snapshot()?;
        let mut fsnaps: smallvec::SmallVec<[_; 4]> = smallvec::SmallVec::new();
        for r in &mut self.frozen {
            fsnaps.push(r.snapshot()?);
        }
        // On the stack for the usual few tables (a get allocates nothing here).
        let mut srcs: smallvec::SmallVec<[Src<'_>; 8]> = smallvec::smallvec![Src::Snap(&snap)];
        srcs.extend(fsnaps.iter().map(Src::Snap));
        srcs.extend(self.levels.iter().map(|l| Src::Level(l)));
        let out = f(&srcs, &self.log);
        // What was read — a value, or an error such as a pointer that leads nowhere — is only
        // trustworthy if every arena pin held until now: a read torn by a revoked pin is retried,
        // not reported as corruption.
        if !(snap.valid() && fsnaps.iter().all(|s| s.valid())) {
            return Err(Error::ReaderRevoked);
        }
        out
    }

    /// Moves to the region's current tables without reading anything, letting go of retired
    /// arenas and deleted log segments (a reader idle for a while calls this).
    pub fn refresh(&mut self) -> Result<()> {
        self.with_srcs(|_, _| Ok(()))
    }

    /// The value of `key`.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.get_versioned(key)?.0)
    }

    /// The value of `key` and the version of the entry that decided it (0 when no table holds
    /// the key): see `Snapshot::get_versioned`.
    pub fn get_versioned(&mut self, key: &[u8]) -> Result<(Option<Vec<u8>>, u64)> {
        self.get_versioned_hinted(key, None)
    }

    /// Like [`RegionReader::get_versioned`], the active arena's tree read from where `hint` says
    /// if it is still valid (module `btree`'s start hints; the readers count their use); the
    /// frozen arenas and levels as usual.
    pub fn get_versioned_hinted(
        &mut self,
        key: &[u8],
        hint: Option<&crate::btree::StartHint<'_>>,
    ) -> Result<(Option<Vec<u8>>, u64)> {
        let mut value = Vec::new();
        let (found, version) = self.get_into(key, hint, &mut value)?;
        Ok((found.map(|_| value), version))
    }

    /// Appends `key`'s value to `out` — copied once, from where it is stored (the active arena's
    /// tree read from where `hint` says if it is still valid, as
    /// [`RegionReader::get_versioned_hinted`]), with no allocation but `out`'s growth — and
    /// returns its length (None: no value) and the version of the entry that decided it. On an
    /// error `out` is as it was (also what a retried attempt appended is taken back).
    pub fn get_into(
        &mut self,
        key: &[u8],
        hint: Option<&crate::btree::StartHint<'_>>,
        out: &mut Vec<u8>,
    ) -> Result<(Option<usize>, u64)> {
        let mark = out.len();
        let got = self.with_srcs(|srcs, log| {
            out.truncate(mark);
            match merge::get_entry(srcs, key, hint)? {
                Some((e, version)) => Ok((merge::resolve_into(log, key, e, out)?, version)),
                None => Ok((None, 0)),
            }
        });
        if got.is_err() {
            out.truncate(mark);
        }
        got
    }

    /// The top of the active arena's tree for a fat root: the children of `nodes` that are still
    /// current (the root itself when `nodes` is empty), each with its parent's index, and the
    /// arena's nonce (hints name it).
    pub fn expand(&mut self, nodes: &[crate::btree::TopNode]) -> Result<(u64, Vec<(usize, crate::btree::TopNode)>)> {
        self.with_srcs(|srcs, _| match srcs.first() {
            Some(Src::Snap(snap)) => Ok((snap.arena_nonce(), snap.expand(nodes)?)),
            _ => Ok((0, Vec::new())),
        })
    }

    /// Up to `limit` items with keys in `[lo, hi]`, ascending, from one snapshot.
    pub fn scan(&mut self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(self.scan_bounded(lo, hi, limit, usize::MAX)?.0)
    }

    /// Like [`RegionReader::scan`], stopping once the items' keys and values reach `max_bytes`
    /// (at least one item is returned if there is one): values are resolved from the log only
    /// within the budget. Also returns the read version the items were read at.
    pub fn scan_bounded(&mut self, lo: &[u8], hi: &[u8], limit: usize, max_bytes: usize) -> Result<(Items, u64)> {
        self.scan_bounded_hinted(lo, hi, limit, max_bytes, None)
    }

    /// [`RegionReader::scan_bounded`], the active arena's descent starting where `hint` says if it
    /// is still valid for `lo` (module `btree`'s start hints).
    pub fn scan_bounded_hinted(
        &mut self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        max_bytes: usize,
        hint: Option<&crate::btree::StartHint<'_>>,
    ) -> Result<(Items, u64)> {
        self.with_srcs(|srcs, log| {
            let version = match srcs.first() {
                Some(Src::Snap(s)) => s.version(),
                _ => 0,
            };
            Ok((merge::scan(srcs, log, lo, hi, limit, max_bytes, hint.copied())?, version))
        })
    }

    /// Like [`RegionReader::scan`] from the largest key `<= lo`.
    pub fn floor_scan(&mut self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.with_srcs(|srcs, log| {
            let start = merge::floor_key(srcs, lo)?.unwrap_or_else(|| lo.to_vec());
            merge::scan(srcs, log, &start, hi, limit, usize::MAX, None)
        })
    }

    /// About `want` keys cutting `(lo, hi)` into parts of similar size, from one snapshot (see
    /// `merge::pivots`): where a long scan can be split to run in parallel.
    pub fn pivots(&mut self, lo: &[u8], hi: &[u8], want: usize) -> Result<Vec<Vec<u8>>> {
        self.with_srcs(|srcs, _| merge::pivots(srcs, lo, hi, want))
    }

    /// The table-set generation in use.
    pub fn generation(&self) -> u64 {
        self.set.generation
    }
}
