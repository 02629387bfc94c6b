//! A region's files at a backup's cut (docs/backup.md §1), and a region directory made again
//! from them.
//!
//! [`Region::snapshot`] takes, at the log's written end (the cut), the durable index — manifest,
//! sessions snapshot, level segments ([`IndexExport`], pinned) — and every log segment up to the
//! cut's, as hard links: no copy, no space, and neither a later compaction nor garbage collection
//! can pull a file from under an upload. Taken in the writer's thread between rounds, nothing is
//! being appended, compacted in or collected meanwhile, so the index holds nothing past the cut
//! (it was built from log records before it) and the log holds everything the index lacks.
//!
//! [`RestoreDir`] writes the same files into an empty directory — the cut's segment cut at the
//! cut and zero-filled to its size, as if nothing after it had ever been written — and the
//! manifest last. Opening it is ordinary recovery: the manifest, the levels, then the log replayed
//! to its end, which is the cut (a batch the cut split in two has no batch end: dropped, as
//! recovery drops any batch never completed).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::replica::Pinned;
use super::{IndexExport, Region, export_dir, levels_dir, sessions_path, vlog_dir};
use crate::error::{Error, Result};
use crate::levels::{Manifest, segment_path as level_segment_path};
use crate::vlog::{Lsn, segment_path as log_segment_path};

/// One log segment of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFile {
    /// Its id.
    pub id: u64,
    /// The pinned file (a hard link).
    pub path: PathBuf,
    /// The bytes of it the snapshot holds: the whole file, or, for the cut's segment, up to the
    /// cut.
    pub len: u64,
    /// The file's size (a restored segment is zero-filled to it).
    pub size: u64,
}

/// A region's files at a cut (see the module documentation). Its pins go when it is dropped.
#[derive(Debug, Clone)]
pub struct RegionSnapshot {
    /// The cut: the log's written end when it was taken.
    pub cut: Lsn,
    /// The durable index (None: nothing compacted yet — the log holds everything).
    pub index: Option<IndexExport>,
    /// Log segments up to the cut's, ascending.
    pub log: Vec<LogFile>,
    _pinned: Arc<Pinned>,
}

impl RegionSnapshot {
    /// Bytes it holds: the level segments and the log's bytes.
    pub fn bytes(&self) -> u64 {
        self.index.as_ref().map_or(0, IndexExport::bytes) + self.log.iter().map(|f| f.len).sum::<u64>()
    }
}

impl Region {
    /// The region's files at the log's written end (module documentation). Call between writes
    /// (the writer's thread does): nothing may be appended, compacted in or collected meanwhile.
    pub fn snapshot(&self) -> Result<RegionSnapshot> {
        let cut = self.vlog.end();
        let index = export_dir(&self.cfg.dir)?;
        let pinned = Arc::new(Pinned::new(&self.cfg.dir)?);
        let dir = vlog_dir(&self.cfg.dir);
        let mut ids = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let e = e.map_err(|e| Error::io(&dir, e))?;
            let name = e.file_name();
            if let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".vlog")).and_then(|n| n.parse::<u64>().ok())
                && id <= cut.segment()
            {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        let mut log = Vec::with_capacity(ids.len());
        for id in ids {
            let (src, dst) = (log_segment_path(&dir, id), log_segment_path(pinned.path(), id));
            std::fs::hard_link(&src, &dst).map_err(|e| Error::io(&src, e))?;
            let size = std::fs::metadata(&dst).map_err(|e| Error::io(&dst, e))?.len();
            let len = if id == cut.segment() { u64::from(cut.offset()).min(size) } else { size };
            log.push(LogFile { id, path: dst, len, size });
        }
        Ok(RegionSnapshot { cut, index, log, _pinned: pinned })
    }
}

/// A region directory being made from a snapshot's files, as a restore fetches them; complete
/// only once [`RestoreDir::finish`] wrote the manifest (a directory without one is not a region
/// restored: start it again).
#[derive(Debug)]
pub struct RestoreDir {
    dir: PathBuf,
}

impl RestoreDir {
    /// Starts one in `dir`, which must hold no region (absent, or empty of a manifest and log).
    pub fn create(dir: impl AsRef<Path>) -> Result<RestoreDir> {
        let dir = dir.as_ref().to_path_buf();
        for d in [&dir, &levels_dir(&dir), &vlog_dir(&dir)] {
            std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
        }
        let taken = dir.join(crate::levels::MANIFEST).exists()
            || std::fs::read_dir(vlog_dir(&dir)).map_err(|e| Error::io(&dir, e))?.next().is_some();
        if taken {
            return Err(Error::Config(format!("{} already holds a region", dir.display())));
        }
        Ok(RestoreDir { dir })
    }

    /// Writes level segment `id`.
    pub fn level_segment(&self, id: u64, bytes: &[u8]) -> Result<()> {
        write_synced(&level_segment_path(&levels_dir(&self.dir), id), bytes, bytes.len() as u64)
    }

    /// Writes log segment `id`: `bytes` (its first bytes: the whole segment, or up to the cut),
    /// zero-filled to `size`.
    pub fn log_segment(&self, id: u64, bytes: &[u8], size: u64) -> Result<()> {
        if (bytes.len() as u64) > size {
            return Err(Error::Config(format!("log segment {id}: {} bytes for a {size}-byte file", bytes.len())));
        }
        write_synced(&log_segment_path(&vlog_dir(&self.dir), id), bytes, size)
    }

    /// Writes the index's sessions snapshot and, last, its manifest (None: the snapshot had no
    /// index; the log holds everything); syncs the directories.
    pub fn finish(self, index: Option<(&Manifest, &[u8])>) -> Result<()> {
        if let Some((manifest, sessions)) = index {
            let sp = sessions_path(&self.dir, manifest.generation);
            write_synced(&sp, sessions, sessions.len() as u64)?;
            manifest.store(crate::fs::real().as_ref(), &self.dir)?;
        }
        for d in [levels_dir(&self.dir), vlog_dir(&self.dir), self.dir.clone()] {
            std::fs::File::open(&d).and_then(|f| f.sync_all()).map_err(|e| Error::io(&d, e))?;
        }
        Ok(())
    }
}

fn write_synced(path: &Path, bytes: &[u8], size: u64) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).map_err(|e| Error::io(path, e))?;
    f.set_len(size).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}
