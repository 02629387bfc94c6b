//! Replication primitives of a region (Tebis §2.2–2.3), without the network: the primary's
//! compaction outputs captured for shipping ([`IndexExport`]), and the [`Backup`] that keeps a
//! copy of the primary's value log under its own segment ids (the *log segment map*) and builds
//! its index either by **Send Index** (rewrite the shipped segments through the segment maps) or
//! by **Build Index** (replay its log copy and compact, the baseline). A backup keeps no L0;
//! promoting it is opening its directory as a [`Region`](super::Region), which replays the log
//! tail its levels do not cover.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{levels_dir, vlog_dir};
use crate::error::{Error, Result};
use crate::fs::{Fs, FsFile};
use crate::levels::{LevelMeta, Manifest, rewrite_segment, segment_path};
use crate::vlog::{LogChunk, Lsn};

/// The backup's persisted log segment map: `<primary id> <local id> <sealed 0|1>` per line.
const LOG_MAP: &str = "LOGMAP";
/// The primary's metadata of the installed levels, in the local manifest's order; one file per
/// local manifest generation (`PRIMARY-LEVELS-<generation>`), written before that manifest.
fn primary_levels_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("PRIMARY-LEVELS-{generation}"))
}

/// Level files pinned for shipping: hard links in `<region>/ship/<n>/`, so that a later
/// compaction retiring a level does not pull its files from under a sender still shipping it
/// (level files never change). Removed when the last holder drops it; a region removes the
/// whole `ship/` directory when it opens (pins never outlive their process).
#[derive(Debug)]
pub(crate) struct Pinned(PathBuf);

impl Pinned {
    /// A new pin directory under the region's `ship/` (removed when dropped).
    pub(crate) fn new(region_dir: &Path) -> Result<Pinned> {
        let n = PINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = ship_dir(region_dir).join(format!("{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(Pinned(dir))
    }

    /// Its directory.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Where a region pins the level files it ships.
pub(crate) fn ship_dir(region_dir: &Path) -> PathBuf {
    region_dir.join("ship")
}

/// One index shipment as the primary ships it (Send Index): the manifest after a compaction —
/// or the current one, for the whole index — and the metadata of the levels to ship (those the
/// backup does not have yet). Their segments stay on disk, pinned ([`IndexExport::read_segment`]):
/// memory holds only metadata, whatever the region's size.
#[derive(Debug, Clone)]
pub struct IndexExport {
    /// The primary's manifest after the compaction.
    pub manifest: Manifest,
    /// The exactly-once sessions snapshot stored with that manifest (its file's bytes).
    pub sessions: Vec<u8>,
    /// Levels to ship, in allocation order.
    pub levels: Vec<LevelMeta>,
    pinned: Arc<Pinned>,
}

/// An [`IndexExport`]'s metadata as bytes: the manifest, the sessions snapshot, and each
/// level's metadata (what the replication protocol's `IndexBegin` carries).
pub type ExportParts = (Vec<u8>, Vec<u8>, Vec<Vec<u8>>);

/// Pin directories made by this process (names are unique within it; `ship/` is emptied when a
/// region opens).
static PINS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl IndexExport {
    /// Pins `levels` of the region in `region_dir` (hard links to their segments) for shipping
    /// with `manifest`. Fails if a segment is gone already (a newer compaction retired it): the
    /// caller takes the newer manifest.
    pub(crate) fn pin(
        region_dir: &Path,
        manifest: Manifest,
        sessions: Vec<u8>,
        levels: Vec<LevelMeta>,
    ) -> Result<IndexExport> {
        let pinned = Arc::new(Pinned::new(region_dir)?);
        let from = levels_dir(region_dir);
        for id in levels.iter().flat_map(|l| &l.segments) {
            let (src, dst) = (segment_path(&from, *id), segment_path(&pinned.0, *id));
            std::fs::hard_link(&src, &dst).map_err(|e| Error::io(&src, e))?;
        }
        Ok(IndexExport { manifest, sessions, levels, pinned })
    }

    /// Bytes shipped (every level's segments).
    pub fn bytes(&self) -> u64 {
        self.levels.iter().map(|l| l.bytes).sum()
    }

    /// The pinned file of segment `id` of one of the levels (to read in chunks).
    pub fn segment_path(&self, id: u64) -> PathBuf {
        segment_path(&self.pinned.0, id)
    }

    /// The bytes of segment `id` of one of the levels.
    pub fn read_segment(&self, id: u64) -> Result<Vec<u8>> {
        let p = self.segment_path(id);
        std::fs::read(&p).map_err(|e| Error::io(&p, e))
    }

    /// Its metadata for the wire (a level's metadata as a manifest of that one level).
    pub fn parts(&self) -> ExportParts {
        let levels = self
            .levels
            .iter()
            .map(|meta| Manifest { levels: vec![meta.clone()], ..Manifest::default() }.encode())
            .collect();
        (self.manifest.encode(), self.sessions.clone(), levels)
    }
}

/// A shipment's metadata as a backup receives it ([`ExportParts`] decoded and checked: input
/// from another machine).
#[derive(Debug, Clone)]
pub struct ShippedIndex {
    /// The primary's manifest.
    pub manifest: Manifest,
    /// Its sessions snapshot.
    pub sessions: Vec<u8>,
    /// The levels shipped.
    pub levels: Vec<LevelMeta>,
}

impl ShippedIndex {
    /// Decodes what [`IndexExport::parts`] made.
    pub fn from_parts(parts: ExportParts) -> Result<ShippedIndex> {
        let (manifest, sessions, levels) = parts;
        let name = Path::new("shipped manifest");
        let manifest = Manifest::decode(&manifest, name)?;
        let levels = levels
            .into_iter()
            .map(|meta| {
                let mut m = Manifest::decode(&meta, name)?;
                if m.levels.len() != 1 {
                    return Err(Error::corrupt_file(name, 0, "a shipped level's metadata holds no single level"));
                }
                Ok(m.levels.remove(0))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ShippedIndex { manifest, sessions, levels })
    }
}

impl From<&IndexExport> for ShippedIndex {
    fn from(e: &IndexExport) -> ShippedIndex {
        ShippedIndex { manifest: e.manifest.clone(), sessions: e.sessions.clone(), levels: e.levels.clone() }
    }
}

/// Largest level segment a backup takes (a region's `level_segment_size` is at most this): what
/// it holds of a shipment in memory.
pub const MAX_SHIPPED_SEGMENT: u64 = 64 << 20;

/// A Send Index shipment being installed, one segment at a time ([`Backup::begin_index`]).
#[derive(Debug)]
pub struct IndexInstall {
    shipped: ShippedIndex,
    /// Per level: primary segment id -> local id.
    maps: Vec<HashMap<u64, u64>>,
    /// Segments not installed yet.
    missing: BTreeSet<u64>,
    /// The backup's install this is (a newer begin supersedes it).
    token: u64,
    /// Local ids taken (the backup's next level segment once installed).
    next: u64,
}

impl IndexInstall {
    /// Whether `segment` is one this shipment still lacks.
    pub fn lacks(&self, segment: u64) -> bool {
        self.missing.contains(&segment)
    }
}

/// The backup side of one region.
pub struct Backup {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    /// Primary log segment -> local log segment.
    log_map: HashMap<u64, u64>,
    next_level_segment: u64,
    /// Installed levels: primary metadata -> local metadata.
    installed: Vec<(LevelMeta, LevelMeta)>,
    /// Primary log segments whose copy is complete and synced.
    sealed: BTreeSet<u64>,
    /// The node whose log the copies follow since the last [`Backup::follow`] (0: none yet),
    /// and its life as the region's leader (0: not said).
    source: (u64, u64),
    /// Copies being streamed: primary segment -> (local file, bytes received).
    open_logs: HashMap<u64, (Arc<dyn FsFile>, u32)>,
    /// Copies written since their last sync ([`Backup::sync_log`]).
    unsynced: BTreeSet<u64>,
    manifest: Manifest,
    /// Bytes written to disk here (log copies, level segments, manifests).
    pub bytes_written: u64,
    /// The newest [`IndexInstall`] begun (an older one may no longer install).
    install_token: u64,
}

impl Backup {
    /// A fresh backup in `dir` (its `vlog/`, `levels/` and `MANIFEST`, like a region's).
    pub fn create(dir: impl AsRef<Path>) -> Result<Backup> {
        Backup::create_with(dir, crate::fs::real())
    }

    /// Like [`Backup::create`], writing through `fs`.
    pub fn create_with(dir: impl AsRef<Path>, fs: Arc<dyn Fs>) -> Result<Backup> {
        let dir = dir.as_ref().to_path_buf();
        for d in [vlog_dir(&dir), levels_dir(&dir)] {
            fs.create_dir_all(&d).map_err(|e| Error::io(&d, e))?;
        }
        Ok(Backup {
            fs,
            dir,
            log_map: HashMap::new(),
            next_level_segment: 1,
            installed: Vec::new(),
            sealed: BTreeSet::new(),
            source: (0, 0),
            open_logs: HashMap::new(),
            unsynced: BTreeSet::new(),
            manifest: Manifest { next_segment: 1, ..Manifest::default() },
            bytes_written: 0,
            install_token: 0,
        })
    }

    /// Reopens a backup after a restart: its log segment map, manifest and installed levels.
    /// A log copy that was still streaming keeps the chain of valid records it holds (what was
    /// synced survives a power loss; a torn tail after it is zeroed) and is received on from
    /// its end ([`Backup::resume_from`]) — never cut back to its start, which would throw away
    /// acknowledged writes this copy may be the only one to hold on disk. A copy whose file a
    /// power loss took (created, its directory not yet synced) is forgotten.
    pub fn open_with(dir: impl AsRef<Path>, fs: Arc<dyn Fs>) -> Result<Backup> {
        let mut b = Backup::create_with(dir, fs)?;
        let p = b.dir.join(LOG_MAP);
        match std::fs::read_to_string(&p) {
            Ok(text) => {
                for (i, line) in text.lines().enumerate() {
                    if let Some(n) = line.strip_prefix("source ") {
                        // `source <node>` or `source <node> <life>`.
                        let bad = || Error::corrupt_file(&p, i as u64, "a bad source line");
                        let mut f = n.split(' ').map(|x| x.parse::<u64>().map_err(|_| bad()));
                        let node = f.next().ok_or_else(bad)??;
                        let life = f.next().transpose()?.unwrap_or(0);
                        b.source = (node, life);
                        continue;
                    }
                    let f: Vec<u64> = line.split(' ').filter_map(|x| x.parse().ok()).collect();
                    let [primary, local, sealed] = f[..] else {
                        return Err(Error::corrupt_file(&p, i as u64, "a log map line is not three numbers"));
                    };
                    b.log_map.insert(primary, local);
                    if sealed == 1 {
                        b.sealed.insert(primary);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&p, e)),
        }
        b.reopen_streaming_copies()?;
        if let Some(m) = Manifest::load(&b.dir)? {
            let pp = primary_levels_path(&b.dir, m.generation);
            let primary = match std::fs::read(&pp) {
                Ok(bytes) => Manifest::decode(&bytes, &pp)?.levels,
                Err(e) => return Err(Error::io(&pp, e)),
            };
            if primary.len() != m.levels.len() {
                return Err(Error::corrupt_file(&pp, 0, "the primary's levels do not match the manifest's"));
            }
            b.installed = primary.into_iter().zip(m.levels.iter().cloned()).collect();
            b.next_level_segment = m.next_segment;
            b.manifest = m;
        }
        Ok(b)
    }

    /// The copies the log map names that are not complete, reopened at the end of the valid
    /// records they hold (see [`Backup::open_with`]).
    fn reopen_streaming_copies(&mut self) -> Result<()> {
        let vdir = vlog_dir(&self.dir);
        let streaming: Vec<(u64, u64)> =
            self.log_map.iter().filter(|(p, _)| !self.sealed.contains(p)).map(|(&p, &l)| (p, l)).collect();
        let mut forgotten = false;
        for (primary, local) in streaming {
            let path = crate::vlog::segment_path(&vdir, local);
            let bytes = match std::fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.log_map.remove(&primary);
                    forgotten = true;
                    continue;
                }
                Err(e) => return Err(Error::io(&path, e)),
            };
            let (end, dirty_end) = match crate::vlog::valid_end(&path, &bytes) {
                Ok(x) => x,
                // Its header never reached the disk: nothing of it was held durably.
                Err(_) => {
                    let _ = self.fs.remove(&path);
                    self.log_map.remove(&primary);
                    forgotten = true;
                    continue;
                }
            };
            let file = self.fs.open(&path).map_err(|e| Error::io(&path, e))?;
            if dirty_end > end {
                file.write_all_at(&vec![0u8; (dirty_end - end) as usize], u64::from(end))
                    .map_err(|e| Error::io(&path, e))?;
            }
            file.sync_data().map_err(|e| Error::io(&path, e))?;
            self.open_logs.insert(primary, (file, end));
        }
        if forgotten {
            self.store_log_map()?;
        }
        Ok(())
    }

    /// Makes every byte of the log copies received so far durable (`fdatasync` of each copy
    /// written since the last call). A backup under `--fsync always` calls it before it says
    /// it holds them: a write is acknowledged only once it is on the disk of every replica in
    /// the write set.
    pub fn sync_log(&mut self) -> Result<()> {
        let vdir = vlog_dir(&self.dir);
        for seg in std::mem::take(&mut self.unsynced) {
            if let Some((file, _)) = self.open_logs.get(&seg) {
                let p = crate::vlog::segment_path(&vdir, self.log_map[&seg]);
                if let Err(e) = file.sync_data() {
                    self.unsynced.insert(seg);
                    return Err(Error::io(&p, e));
                }
            }
        }
        Ok(())
    }

    /// Whether copies were written since the last [`Backup::sync_log`].
    pub fn has_unsynced(&self) -> bool {
        !self.unsynced.is_empty()
    }

    /// Where the primary should stream from: the first copy not complete, from the end of what
    /// it holds, or the segment after the last complete one; None for a backup that has nothing
    /// yet.
    pub fn resume_from(&self) -> Option<Lsn> {
        let first_open = self.log_map.keys().filter(|p| !self.sealed.contains(p)).min();
        match first_open {
            Some(&p) => Some(Lsn::new(p, self.open_logs.get(&p).map_or(0, |(_, end)| *end))),
            None => self.sealed.iter().max().map(|&p| Lsn::new(p + 1, 0)),
        }
    }

    /// How far the copies reach: the end of the furthest copy being streamed, or the start of
    /// the segment after the last complete one (None: nothing yet). A copy that was streaming
    /// when the backup restarted counts to the end of the valid records it kept. The master
    /// promotes the backup whose copies reach furthest (docs/cluster.md §3a).
    pub fn held_end(&self) -> Option<Lsn> {
        let open = self.open_logs.iter().map(|(&p, (_, end))| Lsn::new(p, *end)).max();
        let sealed = self.sealed.iter().max().map(|&p| Lsn::new(p + 1, 0));
        open.max(sealed)
    }

    /// Follows the log of primary `node` in its life `life` as the region's leader, whose log
    /// ended at `base` when that life began. If the copies followed another node — or another
    /// life of this one: a primary that lost power may have lost the end of its log that this
    /// copy received — whatever they hold from `base` on may be records nobody acknowledged
    /// that the primary does not have: cut there, so its bytes are received in their place.
    /// Copies that followed this very life already are its own bytes and are kept.
    pub fn follow(&mut self, node: u64, life: u64, base: Lsn) -> Result<()> {
        if self.source == (node, life) {
            return Ok(());
        }
        let vdir = vlog_dir(&self.dir);
        let ids: Vec<u64> = self.log_map.keys().copied().collect();
        for id in ids {
            let local = self.log_map[&id];
            let path = crate::vlog::segment_path(&vdir, local);
            if id > base.segment() || (id == base.segment() && base.offset() == 0) {
                self.open_logs.remove(&id);
                self.unsynced.remove(&id);
                self.sealed.remove(&id);
                self.log_map.remove(&id);
                let _ = self.fs.remove(&path);
            } else if id == base.segment() {
                // Keep what the copy holds up to the base — never more than it holds: a copy
                // behind the base is continued from its own end (a gap of zeros would count as
                // held). A complete copy holds everything; one that was streaming when this
                // backup restarted holds an unknown prefix and starts again.
                let (file, held) = match self.open_logs.remove(&id) {
                    Some((f, end)) => (f, end),
                    None => {
                        let f = self.fs.open(&path).map_err(|e| Error::io(&path, e))?;
                        (f, if self.sealed.contains(&id) { u32::MAX } else { 0 })
                    }
                };
                let keep = held.min(base.offset());
                let size = file.size().map_err(|e| Error::io(&path, e))?;
                file.set_len(u64::from(keep)).map_err(|e| Error::io(&path, e))?;
                file.set_len(size).map_err(|e| Error::io(&path, e))?;
                // Durable before the map names the new source: after a power loss the copy must
                // not hold the old source's bytes past the base under the new source's name.
                file.sync_data().map_err(|e| Error::io(&path, e))?;
                self.unsynced.remove(&id);
                self.sealed.remove(&id);
                self.open_logs.insert(id, (file, keep));
            }
        }
        self.source = (node, life);
        self.store_log_map()
    }

    fn store_log_map(&self) -> Result<()> {
        let mut text = format!("source {} {}\n", self.source.0, self.source.1);
        let mut entries: Vec<(&u64, &u64)> = self.log_map.iter().collect();
        entries.sort();
        for (p, l) in entries {
            text.push_str(&format!("{p} {l} {}\n", u8::from(self.sealed.contains(p))));
        }
        let path = self.dir.join(LOG_MAP);
        crate::fs::write_atomic(self.fs.as_ref(), &path, text.as_bytes()).map_err(|e| Error::io(&path, e))
    }

    /// Receives a piece of the primary's log stream (see [`crate::vlog::LogTail::chunk`]):
    /// writes its bytes at the same offsets in the local copy of the segment (a new segment gets
    /// a local id, recorded in the persisted log segment map, and its header rewritten to it);
    /// bytes already held are skipped (a stream resumed after a reconnect); a chunk that would
    /// leave a gap is refused. A chunk that ends a segment syncs the copy and records it
    /// complete. Returns where the next chunk starts.
    pub fn append_log(&mut self, c: &LogChunk) -> Result<Lsn> {
        let shipped = PathBuf::from(format!("streamed log segment {}", c.segment));
        if self.sealed.contains(&c.segment) {
            return Ok(c.next());
        }
        if !self.open_logs.contains_key(&c.segment) {
            if c.offset != 0 {
                return Err(Error::Config(format!(
                    "log segment {} streamed from offset {} but the backup has none of it",
                    c.segment, c.offset
                )));
            }
            let (id, salt) = crate::vlog::segment_header(&shipped, &c.bytes)?;
            if id != c.segment {
                return Err(Error::corrupt_file(&shipped, 8, "streamed log segment carries another id"));
            }
            // Copies keep the primary's segment ids: every replica of a region numbers its log
            // alike, so a backup promoted to primary streams positions the others understand.
            let local = c.segment;
            let p = crate::vlog::segment_path(&vlog_dir(&self.dir), local);
            // A copy received again from its start (after a restart) starts from zeros: nothing
            // of an earlier stream may stay behind what this one writes.
            let file = match self.fs.create(&p) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let f = self.fs.open(&p).map_err(|e| Error::io(&p, e))?;
                    f.set_len(0).map_err(|e| Error::io(&p, e))?;
                    f
                }
                r => r.map_err(|e| Error::io(&p, e))?,
            };
            file.set_len(u64::from(c.segment_size)).map_err(|e| Error::io(&p, e))?;
            let h = crate::vlog::encode_segment_header(local, salt);
            file.write_all_at(&h, 0).map_err(|e| Error::io(&p, e))?;
            // The copy's name survives a power loss before the map names it.
            let vdir = vlog_dir(&self.dir);
            self.fs.sync_dir(&vdir).map_err(|e| Error::io(&vdir, e))?;
            self.log_map.insert(c.segment, local);
            self.store_log_map()?;
            self.open_logs.insert(c.segment, (file, h.len() as u32));
            // The header is written (rewritten to the local id); the rest follows.
            let rest =
                LogChunk { offset: h.len() as u32, bytes: c.bytes[h.len().min(c.bytes.len())..].to_vec(), ..c.clone() };
            return self.append_log(&rest);
        }
        let (file, end) = self.open_logs.get_mut(&c.segment).expect("checked");
        if c.offset > *end {
            return Err(Error::Config(format!(
                "log segment {} streamed from offset {} but the backup holds {} bytes: a gap",
                c.segment, c.offset, end
            )));
        }
        let skip = ((*end - c.offset) as usize).min(c.bytes.len());
        let local = self.log_map[&c.segment];
        let p = crate::vlog::segment_path(&vlog_dir(&self.dir), local);
        if skip < c.bytes.len() {
            file.write_all_at(&c.bytes[skip..], u64::from(*end)).map_err(|e| Error::io(&p, e))?;
            self.bytes_written += (c.bytes.len() - skip) as u64;
            *end = c.offset + c.bytes.len() as u32;
            self.unsynced.insert(c.segment);
        }
        if c.sealed {
            file.sync_data().map_err(|e| Error::io(&p, e))?;
            self.unsynced.remove(&c.segment);
            self.open_logs.remove(&c.segment);
            self.sealed.insert(c.segment);
            self.store_log_map()?;
        }
        Ok(c.next())
    }

    /// Follows the primary's garbage collection: drops the copy of every segment below the
    /// last of `live` (the primary's segments, ascending) that `live` does not name — the
    /// primary collected it — provided it lies before this backup's own manifest's log start
    /// (its installed index no longer needs it; a newer export first). The log map is stored
    /// before files go (a crash leaves at most an unnamed old file). Returns the segments
    /// dropped.
    pub fn retain_log_segments(&mut self, live: &[u64]) -> Result<Vec<u64>> {
        let (Some(&last), start) = (live.last(), Lsn(self.manifest.log_start).segment()) else {
            return Ok(Vec::new());
        };
        let mut gone: Vec<u64> =
            self.sealed.iter().copied().filter(|&s| s < last && s < start && live.binary_search(&s).is_err()).collect();
        gone.sort_unstable();
        if gone.is_empty() {
            return Ok(gone);
        }
        let locals: Vec<u64> = gone.iter().filter_map(|s| self.log_map.remove(s)).collect();
        for s in &gone {
            self.sealed.remove(s);
        }
        self.store_log_map()?;
        let vdir = vlog_dir(&self.dir);
        for local in locals {
            let p = crate::vlog::segment_path(&vdir, local);
            match self.fs.remove(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&p, e)),
            }
        }
        Ok(gone)
    }

    /// Primary log segments whose copy is complete and synced, ascending.
    pub fn sealed_segments(&self) -> Vec<u64> {
        self.sealed.iter().copied().collect()
    }

    /// The backup's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The log segment map.
    pub fn log_map(&self) -> &HashMap<u64, u64> {
        &self.log_map
    }

    /// Stores (or replaces) the copy of primary log segment `primary_id`. Its header is
    /// rewritten to the local id (the salt stays, so every record's checksum still holds);
    /// records are byte-identical, so offsets keep their meaning.
    pub fn receive_log_segment(&mut self, primary_id: u64, bytes: &[u8]) -> Result<()> {
        let shipped = PathBuf::from(format!("shipped log segment {primary_id}"));
        let (id, salt) = crate::vlog::segment_header(&shipped, bytes)?;
        if id != primary_id {
            return Err(Error::corrupt_file(&shipped, 8, "shipped log segment carries another id"));
        }
        let local = *self.log_map.entry(primary_id).or_insert(primary_id);
        let vdir = vlog_dir(&self.dir);
        let p = crate::vlog::segment_path(&vdir, local);
        let mut out = bytes.to_vec();
        let h = crate::vlog::encode_segment_header(local, salt);
        out[..h.len()].copy_from_slice(&h);
        crate::fs::write_atomic(self.fs.as_ref(), &p, &out).map_err(|e| Error::io(&p, e))?;
        self.bytes_written += bytes.len() as u64;
        self.open_logs.remove(&primary_id);
        self.store_log_map()?;
        Ok(())
    }

    /// **Send Index**: installs the levels of one shipped compaction (or the whole index) read
    /// from the primary's pinned files — [`Backup::begin_index`], each segment, then
    /// [`Backup::finish_index`] (what a replication connection does as the parts arrive).
    pub fn apply_send_index(&mut self, export: &IndexExport) -> Result<()> {
        let mut inst = self.begin_index(ShippedIndex::from(export))?;
        for id in export.levels.iter().flat_map(|l| l.segments.clone()) {
            self.install_segment(&mut inst, id, &export.read_segment(id)?)?;
        }
        self.finish_index(inst)
    }

    /// Begins installing a shipment: each new level's segments get local ids (the index segment
    /// map). Supersedes any install begun before (its segments are written again).
    pub fn begin_index(&mut self, shipped: ShippedIndex) -> Result<IndexInstall> {
        let mut next = self.next_level_segment;
        let mut maps = Vec::new();
        let mut missing = BTreeSet::new();
        for meta in &shipped.levels {
            let map: HashMap<u64, u64> = meta.segments.iter().enumerate().map(|(i, &s)| (s, next + i as u64)).collect();
            if map.len() != meta.segments.len() {
                return Err(Error::Config("a shipped level names a segment twice".into()));
            }
            for &s in &meta.segments {
                if !missing.insert(s) {
                    return Err(Error::Config(format!("shipped segment {s} is in two levels")));
                }
            }
            next += meta.segments.len() as u64;
            maps.push(map);
        }
        self.install_token += 1;
        Ok(IndexInstall { shipped, maps, missing, token: self.install_token, next })
    }

    /// Installs one segment of the shipment begun: rewritten through the segment maps and
    /// written under its local id.
    pub fn install_segment(&mut self, inst: &mut IndexInstall, primary_id: u64, bytes: &[u8]) -> Result<()> {
        if inst.token != self.install_token {
            return Err(Error::Config("a newer index shipment began".into()));
        }
        if !inst.missing.contains(&primary_id) {
            return Err(Error::Config(format!("shipped segment {primary_id} is not one the shipment lacks")));
        }
        let (i, meta) = inst
            .shipped
            .levels
            .iter()
            .enumerate()
            .find(|(_, l)| l.segments.contains(&primary_id))
            .ok_or_else(|| Error::Config(format!("shipped segment {primary_id} is not in its level")))?;
        let index_map = &inst.maps[i];
        let local = index_map[&primary_id];
        let shipped = PathBuf::from(format!("shipped segment {primary_id}"));
        let out = rewrite_segment(bytes, meta.node_size, primary_id, local, index_map, &self.log_map, &shipped)?;
        let p = segment_path(&levels_dir(&self.dir), local);
        crate::fs::write_atomic(self.fs.as_ref(), &p, &out).map_err(|e| Error::io(&p, e))?;
        self.bytes_written += out.len() as u64;
        inst.missing.remove(&primary_id);
        Ok(())
    }

    /// Installs the shipment once every segment is: the local manifest (levels translated, log
    /// start translated through the log map) replaces the old one, and segments of levels that
    /// are gone are deleted.
    pub fn finish_index(&mut self, inst: IndexInstall) -> Result<()> {
        if inst.token != self.install_token {
            return Err(Error::Config("a newer index shipment began".into()));
        }
        if let Some(s) = inst.missing.first() {
            return Err(Error::Config(format!("shipped level is missing segments (segment {s})")));
        }
        let seg_dir = levels_dir(&self.dir);
        for (meta, index_map) in inst.shipped.levels.iter().zip(&inst.maps) {
            let root = if meta.root == 0 {
                0
            } else {
                index_map
                    .get(&(meta.root >> 32))
                    .map(|l| l << 32 | (meta.root & 0xffff_ffff))
                    .ok_or_else(|| Error::Config("level root outside its segments".into()))?
            };
            let log_refs = meta
                .log_refs
                .iter()
                .map(|(seg, bytes)| (self.log_map.get(seg).copied().unwrap_or(*seg), *bytes))
                .collect();
            let local = LevelMeta {
                root,
                segments: meta.segments.iter().map(|s| index_map[s]).collect(),
                log_refs,
                ..meta.clone()
            };
            self.installed.push((meta.clone(), local));
        }
        self.next_level_segment = inst.next;
        let export = &inst.shipped;
        let mut levels = Vec::new();
        for m in &export.manifest.levels {
            let local = self.installed.iter().find(|(p, _)| p == m).map(|(_, l)| l.clone());
            levels.push(local.ok_or_else(|| Error::Config("manifest names a level that was never shipped".into()))?);
        }
        let start = Lsn(export.manifest.log_start);
        let log_start = if start.0 == 0 {
            0
        } else {
            let local = self
                .log_map
                .get(&start.segment())
                .ok_or_else(|| Error::Config("log start in a segment the backup does not have".into()))?;
            Lsn::new(*local, start.offset()).0
        };
        let manifest = Manifest {
            generation: self.manifest.generation + 1,
            levels,
            log_start,
            next_segment: self.next_level_segment,
            max_version: export.manifest.max_version,
        };
        let sp = super::sessions_path(&self.dir, manifest.generation);
        crate::fs::write_atomic(self.fs.as_ref(), &sp, &export.sessions).map_err(|e| Error::io(&sp, e))?;
        // The primary's view of the levels first: a manifest is only ever next to a complete one.
        let primary_levels = Manifest { levels: export.manifest.levels.clone(), ..Manifest::default() };
        let pp = primary_levels_path(&self.dir, manifest.generation);
        crate::fs::write_atomic(self.fs.as_ref(), &pp, &primary_levels.encode()).map_err(|e| Error::io(&pp, e))?;
        manifest.store(self.fs.as_ref(), &self.dir)?;
        if self.manifest.generation > 0 {
            let _ = self.fs.remove(&primary_levels_path(&self.dir, self.manifest.generation));
        }
        if self.manifest.generation > 0 {
            let _ = self.fs.remove(&super::sessions_path(&self.dir, self.manifest.generation));
        }
        self.bytes_written += manifest.encode().len() as u64;
        // Drop levels the primary replaced.
        let live: Vec<u64> = manifest.levels.iter().flat_map(|l| l.segments.iter().copied()).collect();
        self.installed.retain(|(_, l)| {
            let keep = manifest.levels.contains(l);
            if !keep {
                for s in &l.segments {
                    if !live.contains(s) {
                        let _ = self.fs.remove(&segment_path(&seg_dir, *s));
                    }
                }
            }
            keep
        });
        self.manifest = manifest;
        Ok(())
    }

    /// The manifest the backup has installed.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}

/// Where a Build Index backup builds its own index: `<backup dir>/build`, a region directory whose
/// `vlog/` holds hard links to the backup's complete log copies.
pub fn build_dir(backup_dir: &Path) -> PathBuf {
    backup_dir.join("build")
}

/// **Build Index** (the baseline Send Index is measured against): indexes the backup's complete
/// log copies `sealed` itself — links them into [`build_dir`] (complete copies never change),
/// opens that directory as a region, which replays what its own levels do not cover yet into L0,
/// and compacts it into its levels. `cfg` gives the geometry and the shared-memory directory
/// (its `dir` is replaced). Returns the records replayed. Run it on one thread per region; the
/// copies may go on streaming meanwhile.
pub fn build_index(backup_dir: &Path, sealed: &[u64], mut cfg: super::RegionConfig) -> Result<u64> {
    if sealed.is_empty() {
        // (Opened empty, the region would start a log of its own where the copies go.)
        return Ok(0);
    }
    let dir = build_dir(backup_dir);
    let (from, to) = (vlog_dir(backup_dir), vlog_dir(&dir));
    std::fs::create_dir_all(&to).map_err(|e| Error::io(&to, e))?;
    for &id in sealed {
        let (src, dst) = (crate::vlog::segment_path(&from, id), crate::vlog::segment_path(&to, id));
        match std::fs::hard_link(&src, &dst) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(&dst, e)),
        }
    }
    cfg.dir = dir;
    let (mut region, rec) = super::Region::open(cfg)?;
    region.flush_now()?;
    region.close()?;
    Ok(rec.replayed)
}

/// Makes what [`build_index`] built the backup's index, for promoting it: the built manifest,
/// sessions snapshots and level segments move into the backup's directory (where a backup of
/// this mode has none), and the build directory goes. `Region::open` of the backup's directory
/// then replays only the log its built levels do not cover. Nothing built: nothing changes.
pub fn adopt_built_index(backup_dir: &Path) -> Result<()> {
    let dir = build_dir(backup_dir);
    if !dir.join("MANIFEST").exists() {
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(());
    }
    let (built_levels, levels) = (levels_dir(&dir), levels_dir(backup_dir));
    std::fs::create_dir_all(&levels).map_err(|e| Error::io(&levels, e))?;
    for e in std::fs::read_dir(&built_levels).map_err(|e| Error::io(&built_levels, e))? {
        let e = e.map_err(|e| Error::io(&built_levels, e))?;
        let to = levels.join(e.file_name());
        std::fs::rename(e.path(), &to).map_err(|err| Error::io(&to, err))?;
    }
    // Sessions snapshots first, the manifest last: a crash in between leaves the old state.
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| Error::io(&dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != "MANIFEST"))
        .collect();
    files.push(dir.join("MANIFEST"));
    for f in files {
        let to = backup_dir.join(f.file_name().expect("a file name"));
        std::fs::rename(&f, &to).map_err(|e| Error::io(&to, e))?;
    }
    crate::fs::real().sync_dir(backup_dir).map_err(|e| Error::io(backup_dir, e))?;
    std::fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))
}
