//! The table set: which L0 arenas and levels make up a region right now, published for readers
//! in other processes (the device) as a file replaced atomically in the shared directory. Every
//! L0 arena records the set's generation in its superblock, and an arena that stops taking writes
//! is marked frozen, so a reader notices a new set with one atomic load per operation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::merge::{self, Src};
use crate::btree::Reader;
use crate::error::{Error, Result};
use crate::levels::{Level, Manifest};
use crate::vlog::VlogReader;

const MAGIC: &[u8; 8] = b"DPUKVTS1";
/// How often a reader compares the TABLES file's identity.
const FILE_CHECK: std::time::Duration = std::time::Duration::from_millis(50);

fn file_id(shm_dir: &Path) -> (u64, i64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(shm_dir.join(FILE))
        .map(|m| (m.ino(), m.mtime_nsec() + m.mtime() * 1_000_000_000))
        .unwrap_or((0, 0))
}
const FILE: &str = "TABLES";

/// The tables of a region, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableSet {
    pub(crate) generation: u64,
    pub(crate) active: PathBuf,
    pub(crate) frozen: Vec<PathBuf>,
    /// The region's durable directory (value log and levels).
    pub(crate) dir: PathBuf,
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
        if b.len() < 20 || &b[..8] != MAGIC {
            return Err(bad(0));
        }
        let generation = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let n = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")) as usize;
        let mut p = 20;
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
            return Err(bad(16));
        }
        let manifest = Manifest::decode(&b[p..], path)?;
        let frozen = paths.split_off(2);
        Ok(TableSet { generation, active: paths[0].clone(), dir: paths[1].clone(), frozen, manifest })
    }

    /// Replaces `shm_dir/TABLES` atomically (tmpfs: rename is enough).
    pub(crate) fn store(&self, shm_dir: &Path) -> Result<()> {
        let tmp = shm_dir.join("TABLES.tmp");
        std::fs::write(&tmp, self.encode()).map_err(|e| Error::io(&tmp, e))?;
        let p = shm_dir.join(FILE);
        std::fs::rename(&tmp, &p).map_err(|e| Error::io(&p, e))
    }

    pub(crate) fn load(shm_dir: &Path) -> Result<TableSet> {
        let p = shm_dir.join(FILE);
        let b = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        TableSet::decode(&b, &p)
    }
}

/// Retires what a previous host left in the shared directory (its L0s are rebuilt from the log):
/// the table set goes first, then every old arena is marked frozen — so a reader still mapping
/// one switches (or gets a retryable error until the new set is published) on its next operation,
/// before this host takes any write — and removed.
pub(crate) fn remove_stale_arenas(shm_dir: &Path) -> Result<()> {
    let _ = std::fs::remove_file(shm_dir.join(FILE));
    for e in std::fs::read_dir(shm_dir).map_err(|e| Error::io(shm_dir, e))? {
        let e = e.map_err(|e| Error::io(shm_dir, e))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("l0-") && name.ends_with(".arena") {
            let _ = crate::arena::Arena::mark_frozen(&e.path());
        }
        if name.starts_with("l0-") || name.starts_with("TABLES.") {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

/// Reads a region from another thread or process (the device): maps the current L0 arenas and
/// levels, follows the table set as it changes, and answers get/scan/floor-scan from one
/// consistent snapshot per operation. The L0 reads are wait-free; switching to a new table set
/// (after a freeze or compaction) reopens files once.
pub struct RegionReader {
    shm_dir: PathBuf,
    set: TableSet,
    /// Identity (inode, modification time) of the TABLES file the set came from, and when it
    /// was last compared: a host that restarts publishes a new file without freezing the old
    /// arena, so the reader also looks at the file every [`FILE_CHECK`].
    file_id: (u64, i64),
    checked: std::time::Instant,
    active: Reader,
    frozen: Vec<Reader>,
    levels: Vec<Arc<Level>>,
    vlog: VlogReader,
    /// Table-set switches so far.
    pub reloads: u64,
    /// Device mode: arenas are read through page-table copies fed by their command rings.
    device: bool,
    /// Counters of readers already replaced by a table-set switch.
    retired: crate::btree::ReadStats,
}

impl RegionReader {
    /// Opens the region whose arenas live in `shm_dir` (reading the arenas' page tables, as the
    /// host's CPU would).
    pub fn open(shm_dir: impl AsRef<Path>) -> Result<RegionReader> {
        Self::open_mode(shm_dir, false)
    }

    /// Opens the region as the device does: every arena through its own page-table copy, fed by
    /// the arena's command ring.
    pub fn open_device(shm_dir: impl AsRef<Path>) -> Result<RegionReader> {
        Self::open_mode(shm_dir, true)
    }

    fn open_mode(shm_dir: impl AsRef<Path>, device: bool) -> Result<RegionReader> {
        let shm_dir = shm_dir.as_ref().to_path_buf();
        let id = file_id(&shm_dir);
        let (set, active, frozen, levels) = Self::load(&shm_dir, &[], device)?;
        let vlog = VlogReader::open(set.dir.join("vlog"));
        Ok(RegionReader {
            shm_dir,
            set,
            active,
            frozen,
            levels,
            vlog,
            reloads: 0,
            file_id: id,
            checked: std::time::Instant::now(),
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
        }
        s
    }

    #[allow(clippy::type_complexity)]
    fn load(
        shm_dir: &Path,
        have: &[Arc<Level>],
        device: bool,
    ) -> Result<(TableSet, Reader, Vec<Reader>, Vec<Arc<Level>>)> {
        // The set may change (and its files vanish) between reading it and opening them: retry.
        let mut last = None;
        for _ in 0..50 {
            let set = TableSet::load(shm_dir)?;
            let attempt = (|| -> Result<_> {
                let open = |p: &PathBuf| if device { Reader::open_device(p) } else { Reader::open(p) };
                let active = open(&set.active)?;
                let frozen = set.frozen.iter().map(open).collect::<Result<Vec<_>>>()?;
                let levels = set
                    .manifest
                    .levels
                    .iter()
                    .map(|m| match have.iter().find(|l| l.meta() == m) {
                        Some(l) => Ok(l.clone()),
                        None => Level::open(set.dir.join("levels"), m.clone()).map(Arc::new),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((active, frozen, levels))
            })();
            match attempt {
                Ok((a, f, l)) => return Ok((set, a, f, l)),
                Err(e @ (Error::Io { .. } | Error::CorruptFile { .. } | Error::Corrupt { .. })) => {
                    last = Some(e);
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("the loop ran"))
    }

    /// Switches to the current table set if the writer published a new one.
    fn refresh(&mut self) -> Result<()> {
        let (generation, frozen) = self.active.tables_state();
        let mut stale = generation != self.set.generation || frozen;
        if !stale && self.checked.elapsed() >= FILE_CHECK {
            self.checked = std::time::Instant::now();
            stale = file_id(&self.shm_dir) != self.file_id;
        }
        if !stale {
            return Ok(());
        }
        self.reload()
    }

    fn reload(&mut self) -> Result<()> {
        let id = file_id(&self.shm_dir);
        let (set, active, fz, levels) = Self::load(&self.shm_dir, &self.levels, self.device)?;
        self.retired = self.read_stats();
        if set != self.set {
            self.reloads += 1;
        }
        (self.set, self.active, self.frozen, self.levels, self.file_id) = (set, active, fz, levels, id);
        self.checked = std::time::Instant::now();
        Ok(())
    }

    /// Runs `f` on one consistent snapshot of the tables. If it fails on a missing or damaged
    /// file — a log segment collected or a level replaced after this reader last looked — it
    /// switches to the current table set and tries once more.
    fn with_srcs<T>(&mut self, f: impl Fn(&[Src<'_>], &VlogReader) -> Result<T>) -> Result<T> {
        match self.try_with_srcs(&f) {
            Err(Error::Io { .. } | Error::CorruptFile { .. }) => {
                self.reload()?;
                self.try_with_srcs(&f)
            }
            // A pin was revoked under us (we stalled past the lease): the snapshot re-pins.
            Err(Error::ReaderRevoked) => self.try_with_srcs(&f),
            r => r,
        }
    }

    fn try_with_srcs<T>(&mut self, f: &impl Fn(&[Src<'_>], &VlogReader) -> Result<T>) -> Result<T> {
        self.refresh()?;
        let snap = self.active.snapshot()?;
        let mut fsnaps = Vec::with_capacity(self.frozen.len());
        for r in &mut self.frozen {
            fsnaps.push(r.snapshot()?);
        }
        let mut srcs = vec![Src::Snap(&snap)];
        srcs.extend(fsnaps.iter().map(Src::Snap));
        srcs.extend(self.levels.iter().map(|l| Src::Level(l)));
        let out = f(&srcs, &self.vlog)?;
        // What was read is only trustworthy if every pin held until now.
        if !(snap.valid() && fsnaps.iter().all(|s| s.valid())) {
            return Err(Error::ReaderRevoked);
        }
        Ok(out)
    }

    /// The value of `key`.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.get_versioned(key)?.0)
    }

    /// The value of `key` and the version of the entry that decided it (0 when no table holds
    /// the key): see `Snapshot::get_versioned`.
    pub fn get_versioned(&mut self, key: &[u8]) -> Result<(Option<Vec<u8>>, u64)> {
        self.with_srcs(|srcs, vlog| match merge::get_versioned(srcs, key)? {
            Some((s, version)) => Ok((merge::resolve(vlog, key, s)?, version)),
            None => Ok((None, 0)),
        })
    }

    /// Up to `limit` items with keys in `[lo, hi]`, ascending, from one snapshot.
    pub fn scan(&mut self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.with_srcs(|srcs, vlog| merge::scan(srcs, vlog, lo, hi, limit))
    }

    /// Like [`RegionReader::scan`] from the largest key `<= lo`.
    pub fn floor_scan(&mut self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.with_srcs(|srcs, vlog| {
            let start = merge::floor_key(srcs, lo)?.unwrap_or_else(|| lo.to_vec());
            merge::scan(srcs, vlog, &start, hi, limit)
        })
    }

    /// The table-set generation in use.
    pub fn generation(&self) -> u64 {
        self.set.generation
    }
}
