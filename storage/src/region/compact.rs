//! Compaction, run on its own thread: merges a frozen L0 (read through a pinned snapshot) with
//! L1, cascades while a level outgrows its budget, writes the new segments and stores the new
//! manifest. The region thread installs the result (and deletes the replaced segments and the
//! frozen arena) when it next writes, or waits for it when L0 fills up again first.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::merge::{MergeCursor, Src, Stored};
use super::publish::Publications;
use super::replica::IndexExport;
use super::sessions::Sessions;
use super::{RegionConfig, levels_dir};
use crate::btree::{ReadPublisher, Reader};
use crate::error::{Error, Result};
use crate::fs::Fs;
use crate::levels::{Level, LevelBuilder, LevelMeta, Manifest};
use crate::vlog::{DurabilityWaiter, Lsn};

/// Everything a compaction needs, owned so it can move to another thread.
pub(crate) struct Compactor {
    pub(crate) cfg: RegionConfig,
    pub(crate) levels: Vec<Option<Arc<Level>>>,
    pub(crate) manifest: Manifest,
    pub(crate) capture: bool,
    /// The log's durability: the log a level covers is synced before its manifest is stored.
    pub(crate) durability: DurabilityWaiter,
    /// Publishes the frozen L0's last version (once durable) before it is read.
    pub(crate) publisher: ReadPublisher,
    /// A gated region's publications: the frozen L0 is shown (and becomes levels) only once
    /// the gate shows all of it.
    pub(crate) gate: Option<Arc<Publications>>,
}

/// How long a compaction waits for a gated region's bound to reach the frozen L0's end before
/// it fails (and is retried): the backups may be gone until the cluster changes the set.
const GATE_WAIT: Duration = Duration::from_secs(5);

/// A finished compaction, for the region thread to install.
pub(crate) struct Compacted {
    pub(crate) levels: Vec<Option<Arc<Level>>>,
    pub(crate) manifest: Manifest,
    /// Level segments the new manifest no longer names.
    pub(crate) obsolete: Vec<u64>,
    pub(crate) written: u64,
    pub(crate) read: u64,
    pub(crate) compactions: u64,
    pub(crate) export: Option<IndexExport>,
}

impl Compactor {
    fn level_budget(&self, level: usize) -> u64 {
        self.cfg.l0_budget.saturating_mul(self.cfg.growth_factor.saturating_pow(level as u32))
    }

    /// Compacts the frozen L0 (everything logged before `log_end`, frozen at `version`). On an
    /// error, removes the segments it wrote; nothing else changed.
    pub(crate) fn run(self, frozen: Reader, version: u64, log_end: Lsn, sessions: &Sessions) -> Result<Compacted> {
        let r = self.compact(frozen, version, log_end, sessions);
        if r.is_err() {
            // Remove what this attempt wrote, but nothing either manifest names: the failure may
            // have come after the new manifest was renamed into place (its directory sync, or the
            // export), and whether that rename is durable is unknown.
            if let Ok(on_disk) = Manifest::load(&self.cfg.dir) {
                let keep: Vec<&Manifest> = std::iter::once(&self.manifest).chain(on_disk.as_ref()).collect();
                let _ = remove_unreferenced(self.cfg.vlog.fs.as_ref(), &levels_dir(&self.cfg.dir), &keep);
            }
        }
        r
    }

    fn compact(&self, mut frozen: Reader, version: u64, log_end: Lsn, sessions: &Sessions) -> Result<Compacted> {
        // The levels will replace the log up to `log_end`: it must be on disk first (and then the
        // frozen L0 is visible to readers in whole, which the snapshot below relies on).
        self.durability.sync_to(log_end)?;
        if let Some(g) = &self.gate {
            // A replicated region: levels are read by everyone, so they may only hold what
            // every backup holds.
            if !g.wait_shown(log_end, GATE_WAIT) {
                return Err(Error::Unavailable(format!(
                    "the compaction waits for the backups to hold the log up to {}",
                    log_end.0
                )));
            }
        }
        self.publisher.publish(version);
        let dir = levels_dir(&self.cfg.dir);
        let mut out = Compacted {
            levels: Vec::new(),
            manifest: Manifest::default(),
            obsolete: Vec::new(),
            written: 0,
            read: 0,
            compactions: 0,
            export: None,
        };
        // A failed attempt may have left segments a manifest on disk names: never reuse their ids.
        let mut next_segment = self.manifest.next_segment.max(highest_segment(&dir)? + 1);
        let snap = frozen.snapshot()?;
        let older = self.levels.first().cloned().flatten();
        let bottom = self.levels.iter().skip(1).all(Option::is_none);
        let meta =
            self.merge(&Src::Snap(&snap), Some(version), older.as_deref(), bottom, 1, &mut next_segment, &mut out)?;
        if let Some(o) = &older {
            out.obsolete.extend(&o.meta().segments);
            out.read += o.meta().bytes;
        }
        drop(snap);
        let mut newer = Arc::new(Level::open(&dir, meta)?);
        let mut installed = self.levels.clone();
        installed.resize(installed.len().max(1), None);
        installed[0] = Some(newer.clone());
        let mut level = 1usize;
        while newer.meta().bytes > self.level_budget(level) {
            let older = installed.get(level).cloned().flatten();
            let bottom = installed.iter().skip(level + 1).all(Option::is_none);
            let meta = self.merge(
                &Src::Level(&newer),
                None,
                older.as_deref(),
                bottom,
                level as u32 + 1,
                &mut next_segment,
                &mut out,
            )?;
            out.obsolete.extend(&newer.meta().segments);
            out.read += newer.meta().bytes;
            if let Some(o) = &older {
                out.obsolete.extend(&o.meta().segments);
                out.read += o.meta().bytes;
            }
            installed.resize(installed.len().max(level + 1), None);
            installed[level - 1] = None;
            newer = Arc::new(Level::open(&dir, meta)?);
            installed[level] = Some(newer.clone());
            out.compactions += 1;
            level += 1;
        }
        let manifest = Manifest {
            generation: self.manifest.generation + 1,
            levels: installed.iter().flatten().map(|l| l.meta().clone()).collect(),
            log_start: log_end.0,
            next_segment,
            max_version: version,
        };
        // The exactly-once sessions as of `log_end` go with the manifest that replaces the log up
        // to there (written first: a manifest never names a snapshot that is not on disk).
        let sp = super::sessions_path(&self.cfg.dir, manifest.generation);
        crate::fs::write_atomic(self.cfg.vlog.fs.as_ref(), &sp, &sessions.encode()).map_err(|e| Error::io(&sp, e))?;
        manifest.store(self.cfg.vlog.fs.as_ref(), &self.cfg.dir)?;
        if self.capture {
            out.export = Some(self.export(&manifest, sessions.encode())?);
        }
        out.manifest = manifest;
        out.levels = installed;
        Ok(out)
    }

    /// Merges `newer` over `older` into a new level `level`; drops tombstones at the bottom.
    #[allow(clippy::too_many_arguments)]
    fn merge(
        &self,
        newer: &Src<'_>,
        newer_version: Option<u64>,
        older: Option<&Level>,
        bottom: bool,
        level: u32,
        next_segment: &mut u64,
        out: &mut Compacted,
    ) -> Result<LevelMeta> {
        let mut b = LevelBuilder::new(
            self.cfg.vlog.fs.clone(),
            levels_dir(&self.cfg.dir),
            *next_segment,
            self.cfg.level_node_size,
            self.cfg.level_segment_size,
        )?;
        let mut srcs = vec![match newer {
            Src::Writer(w) => Src::Writer(w),
            Src::Snap(s) => Src::Snap(s),
            Src::Level(l) => Src::Level(l),
        }];
        if let Some(o) = older {
            srcs.push(Src::Level(o));
        }
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
        out.written += meta.bytes;
        Ok(meta)
    }

    /// The levels of `manifest` that the previous manifest does not have, pinned for shipping.
    fn export(&self, manifest: &Manifest, sessions: Vec<u8>) -> Result<IndexExport> {
        let levels = manifest.levels.iter().filter(|m| !self.manifest.levels.contains(m)).cloned().collect();
        IndexExport::pin(&self.cfg.dir, manifest.clone(), sessions, levels)
    }
}

/// Segment ids of the level segment files in `dir`.
fn segment_ids(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        if let Some(id) = e.file_name().to_string_lossy().strip_suffix(".seg").and_then(|s| s.parse::<u64>().ok()) {
            out.push((id, e.path()));
        }
    }
    Ok(out)
}

/// The highest level segment id with a file in `dir` (0 if none).
fn highest_segment(dir: &Path) -> Result<u64> {
    Ok(segment_ids(dir)?.into_iter().map(|(id, _)| id).max().unwrap_or(0))
}

/// Deletes the level segment files in `dir` that none of `manifests` names (left by a crash or a
/// failed compaction).
pub(crate) fn remove_unreferenced(fs: &dyn Fs, dir: &Path, manifests: &[&Manifest]) -> Result<()> {
    let live: std::collections::HashSet<u64> =
        manifests.iter().flat_map(|m| m.levels.iter().flat_map(|l| l.segments.iter().copied())).collect();
    let mut removed = false;
    for (id, path) in segment_ids(dir)? {
        if !live.contains(&id) {
            let _ = fs.remove(&path);
            removed = true;
        }
    }
    if removed {
        fs.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}
