//! Durable levels (Tebis/Kreon, docs/architecture.md): immutable B+tree indexes in segment files,
//! built by compaction, named by the manifest, memory-mapped read-only (also by the device).
//!
//! # Layout
//! - `format`: segment and node byte layout, entry encoding, checked node decoding.
//! - `build`: [`LevelBuilder`], which writes a level bottom-up from a sorted stream.
//! - `manifest`: the [`Manifest`] and its atomic replacement.
//! - `import`: Send Index on the backup: rewriting shipped segments through segment maps.
//! - this module: [`Level`], a mapped, verified level with get, scan and floor.

mod build;
mod format;
mod import;
mod manifest;

use std::fs::File;
use std::path::{Path, PathBuf};

pub use build::LevelBuilder;
use format::{LNode, NODE_LEAF, SEG_MAGIC, le32, le64, ptr_parts};
pub use import::rewrite_segment;
pub use manifest::{MANIFEST, Manifest};
use memmap2::Mmap;

use crate::btree::Entry;
use crate::error::{Error, Result};

/// What the manifest records about one level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelMeta {
    /// Level number (1 = the level L0 compacts into).
    pub level: u32,
    /// Pointer of the root node (0 for an empty level).
    pub root: u64,
    /// Node layers (0 for an empty level, 1 for a single leaf).
    pub height: u32,
    /// Entries (tombstones included).
    pub entries: u64,
    /// Largest entry version.
    pub max_version: u64,
    /// Node size.
    pub node_size: u32,
    /// Segment ids, in allocation order.
    pub segments: Vec<u64>,
    /// Bytes of all segments.
    pub bytes: u64,
    /// Value-log bytes its value pointers keep alive: (log segment, bytes of the records they
    /// point at), by segment. Garbage collection ranks log segments by what no level needs.
    pub log_refs: Vec<(u64, u64)>,
}

/// Path of level segment `id` in `dir`.
pub fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016}.seg"))
}

/// A mapped, verified level.
pub struct Level {
    meta: LevelMeta,
    dir: PathBuf,
    /// The segments' mappings by id, sorted (found by binary search on every node visit).
    maps: Vec<(u64, Mmap)>,
}

impl std::fmt::Debug for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Level").field("meta", &self.meta).finish()
    }
}

impl Level {
    /// Maps the level's segments read-only and verifies their headers and checksums.
    pub fn open(dir: impl AsRef<Path>, meta: LevelMeta) -> Result<Level> {
        Level::open_checked(dir.as_ref(), meta, true)
    }

    /// Like [`Level::open`], checking each segment's header but not the checksum of its nodes:
    /// for a reader of levels its host built and verified (the device on every table-set switch,
    /// which must not read gigabytes to switch). Nodes are still parsed with bounds checks.
    pub fn open_trusted(dir: impl AsRef<Path>, meta: LevelMeta) -> Result<Level> {
        Level::open_checked(dir.as_ref(), meta, false)
    }

    fn open_checked(dir: &Path, meta: LevelMeta, full: bool) -> Result<Level> {
        let dir = dir.to_path_buf();
        let mut maps = Vec::with_capacity(meta.segments.len());
        for &id in &meta.segments {
            let p = segment_path(&dir, id);
            let f = File::open(&p).map_err(|e| Error::io(&p, e))?;
            let m = crate::arena::map_immutable(&f, &p)?;
            verify_segment(&p, &m, id, meta.node_size, full)?;
            maps.push((id, m));
        }
        maps.sort_by_key(|(id, _)| *id);
        maps.dedup_by_key(|(id, _)| *id);
        Ok(Level { meta, dir, maps })
    }

    /// The level's metadata.
    pub fn meta(&self) -> &LevelMeta {
        &self.meta
    }

    fn err(&self, seg: u64) -> impl Fn(u64, &'static str) -> Error + '_ {
        move |off, what| Error::corrupt_file(&segment_path(&self.dir, seg), off, what)
    }

    fn node(&self, p: u64) -> Result<LNode<'_>> {
        let (seg, off) = ptr_parts(p);
        let ns = self.meta.node_size as usize;
        let map = match self.maps.binary_search_by_key(&seg, |(id, _)| *id) {
            Ok(i) => &self.maps[i].1,
            Err(_) => return Err(Error::corrupt_file(&self.dir, p, "node pointer names a segment outside the level")),
        };
        let bytes = map.get(off as usize..off as usize + ns).filter(|_| (off as usize).is_multiple_of(ns) && off > 0);
        let bytes = bytes.ok_or_else(|| {
            Error::corrupt_file(&segment_path(&self.dir, seg), off as u64, "node pointer out of bounds")
        })?;
        LNode::parse(bytes, off as u64, self.err(seg))
    }

    /// Descends to the leaf for `key`.
    fn leaf_for(&self, key: &[u8], strict: bool) -> Result<Option<(LNode<'_>, u64)>> {
        if self.meta.root == 0 {
            return Ok(None);
        }
        let mut p = self.meta.root;
        for _ in 0..self.meta.height.max(1) {
            let n = self.node(p)?;
            if n.kind == NODE_LEAF {
                return Ok(Some((n, p)));
            }
            let e = self.err(ptr_parts(p).0);
            p = match n.last_at_or_before(key, strict, &e)? {
                Some(i) => n.child(i, &e)?,
                None => n.link,
            };
        }
        Err(Error::corrupt_file(&self.dir, p, "level deeper than its recorded height"))
    }

    /// Separator keys inside `(lo, hi)` (`hi` empty: no upper bound), ascending, from the
    /// shallowest interior layer holding at least `want` of them (or the deepest one): keys that
    /// cut the range into parts of similar size. Visits at most `want + 2` nodes per layer.
    pub fn pivots(&self, lo: &[u8], hi: &[u8], want: usize) -> Result<Vec<&[u8]>> {
        if self.meta.root == 0 {
            return Ok(Vec::new());
        }
        let mut layer = vec![self.meta.root];
        for _ in 0..self.meta.height.max(1) {
            let nodes: Vec<(LNode<'_>, u64)> =
                layer.iter().map(|&p| self.node(p).map(|n| (n, p))).collect::<Result<_>>()?;
            if nodes.iter().any(|(n, _)| n.kind == NODE_LEAF) {
                return Ok(Vec::new());
            }
            let (mut keys, mut below) = (Vec::new(), Vec::new());
            let mut deepest = false;
            for (n, p) in &nodes {
                let e = self.err(ptr_parts(*p).0);
                let mut child = n.link; // left of the first separator
                let mut past = false;
                for i in 0..n.count {
                    let k = n.key(i, &e)?;
                    if k > lo {
                        below.push(child);
                    }
                    if !hi.is_empty() && k >= hi {
                        past = true;
                        break;
                    }
                    if k > lo {
                        keys.push(k);
                    }
                    child = n.child(i, &e)?;
                }
                if !past {
                    below.push(child);
                }
                // Children of this layer are leaves when its node's first child is one.
                deepest |= self.node(n.link)?.kind == NODE_LEAF;
            }
            if keys.len() >= want || deepest || below.len() > want + 2 {
                return Ok(keys);
            }
            layer = below;
        }
        Err(Error::corrupt_file(&self.dir, self.meta.root, "level deeper than its recorded height"))
    }

    /// The entry for `key`: (version, value).
    pub fn get(&self, key: &[u8]) -> Result<Option<(u64, Entry<'_>)>> {
        let Some((leaf, p)) = self.leaf_for(key, false)? else { return Ok(None) };
        let e = self.err(ptr_parts(p).0);
        match leaf.last_at_or_before(key, false, &e)? {
            Some(i) => {
                let (k, v, entry) = leaf.leaf_entry(i, &e)?;
                Ok((k == key).then_some((v, entry)))
            }
            None => Ok(None),
        }
    }

    /// Calls `f(key, version, entry)` for entries with keys `>= lo` in order until it returns false.
    pub fn scan_from(&self, lo: &[u8], mut f: impl FnMut(&[u8], u64, Entry<'_>) -> Result<bool>) -> Result<()> {
        let Some((mut leaf, mut p)) = self.leaf_for(lo, false)? else { return Ok(()) };
        let mut i = {
            let e = self.err(ptr_parts(p).0);
            match leaf.last_at_or_before(lo, true, &e)? {
                Some(i) => i + 1,
                None => 0,
            }
        };
        let max_leaves = self.meta.bytes / self.meta.node_size as u64 + 1;
        for _ in 0..max_leaves {
            let e = self.err(ptr_parts(p).0);
            while i < leaf.count {
                let (k, v, entry) = leaf.leaf_entry(i, &e)?;
                if !f(k, v, entry)? {
                    return Ok(());
                }
                i += 1;
            }
            if leaf.link == 0 {
                return Ok(());
            }
            p = leaf.link;
            leaf = self.node(p)?;
            if leaf.kind != NODE_LEAF {
                return Err(Error::corrupt_file(&self.dir, p, "leaf link to a non-leaf"));
            }
            i = 0;
        }
        Err(Error::corrupt_file(&self.dir, p, "leaf chain does not end"))
    }

    /// The entry with the largest key `<= key` (`< key` when `strict`).
    pub fn floor(&self, key: &[u8], strict: bool) -> Result<Option<(&[u8], u64, Entry<'_>)>> {
        let Some((leaf, p)) = self.leaf_for(key, strict)? else { return Ok(None) };
        let e = self.err(ptr_parts(p).0);
        if let Some(i) = leaf.last_at_or_before(key, strict, &e)? {
            return Ok(Some(leaf.leaf_entry(i, &e)?));
        }
        // Every key of this leaf is above: the answer is the previous leaf's last entry.
        if leaf.prev == 0 {
            return Ok(None);
        }
        let prev = self.node(leaf.prev)?;
        if prev.kind != NODE_LEAF || prev.count == 0 {
            return Err(Error::corrupt_file(&self.dir, leaf.prev, "previous leaf link is not a leaf"));
        }
        Ok(Some(prev.leaf_entry(prev.count - 1, &self.err(ptr_parts(leaf.prev).0))?))
    }
}

/// Checks a segment's header and (with `full`) the checksum of its nodes.
fn verify_segment(p: &Path, m: &[u8], id: u64, node_size: u32, full: bool) -> Result<()> {
    let ns = node_size as usize;
    if m.len() < ns || &m[..8] != SEG_MAGIC {
        return Err(Error::corrupt_file(p, 0, "bad level segment header"));
    }
    if crc32c::crc32c(&m[..28]) != le32(m, 28) {
        return Err(Error::corrupt_file(p, 28, "level segment header checksum mismatch"));
    }
    if le64(m, 8) != id || le32(m, 16) != node_size {
        return Err(Error::corrupt_file(p, 8, "level segment id or node size differs from the manifest"));
    }
    let n = le32(m, 20) as usize;
    if m.len() != ns * (n + 1) {
        return Err(Error::corrupt_file(p, m.len() as u64, "level segment length differs from its node count"));
    }
    if full && crc32c::crc32c(&m[ns..]) != le32(m, 24) {
        return Err(Error::corrupt_file(p, ns as u64, "level segment checksum mismatch"));
    }
    Ok(())
}
