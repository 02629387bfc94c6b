//! Writes a level bottom-up from a sorted stream: leaves in key order (each linked to its
//! neighbours), then each interior layer, into fresh segment files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::format::{
    NODE_HDR, NODE_INTERIOR, NODE_LEAF, SEG_MAGIC, interior_entry_len, leaf_entry_len, ptr, put_leaf_entry,
};
use super::{LevelMeta, segment_path};
use crate::btree::Entry;
use crate::error::{Error, Result};
use crate::fs::{Fs, FsFile};

/// Builds one level.
pub struct LevelBuilder {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    node_size: usize,
    nodes_per_segment: u32,
    next_segment: u64,
    segments: Vec<u64>,
    /// The open segment: id, file, nodes written, running CRC.
    open: Option<(u64, Arc<dyn FsFile>, u32, u32)>,
    /// Entries of the leaf being filled (encoded) and their offsets.
    leaf: Vec<u8>,
    leaf_offs: Vec<u16>,
    leaf_first: Option<Vec<u8>>,
    /// The previous leaf, held back until we know whether another follows.
    pending: Option<(Vec<u8>, Vec<u16>, Vec<u8>)>,
    prev_leaf: u64,
    /// (first key, pointer) of every node of the layer being built.
    layer: Vec<(Vec<u8>, u64)>,
    last_key: Option<Vec<u8>>,
    entries: u64,
    max_version: u64,
    bytes_written: u64,
    /// Log segment -> bytes of the records this level's value pointers name.
    log_refs: std::collections::BTreeMap<u64, u64>,
}

impl LevelBuilder {
    /// A builder writing segments numbered from `first_segment` into `dir`, through `fs`.
    pub fn new(
        fs: Arc<dyn Fs>,
        dir: impl AsRef<Path>,
        first_segment: u64,
        node_size: u32,
        segment_size: u32,
    ) -> Result<LevelBuilder> {
        if !node_size.is_power_of_two() || !(512..=65536).contains(&node_size) || segment_size < 4 * node_size {
            return Err(Error::Config(
                "level node size must be a power of two in 512..=65536, segments >= 4 nodes".into(),
            ));
        }
        Ok(LevelBuilder {
            fs,
            dir: dir.as_ref().to_path_buf(),
            node_size: node_size as usize,
            nodes_per_segment: segment_size / node_size - 1,
            next_segment: first_segment,
            segments: Vec::new(),
            open: None,
            leaf: Vec::new(),
            leaf_offs: Vec::new(),
            leaf_first: None,
            pending: None,
            prev_leaf: 0,
            layer: Vec::new(),
            last_key: None,
            entries: 0,
            max_version: 0,
            bytes_written: 0,
            log_refs: std::collections::BTreeMap::new(),
        })
    }

    /// Largest entry a node can hold.
    pub fn max_entry(&self) -> usize {
        (self.node_size - NODE_HDR) / 2 - 2
    }

    /// Adds the next entry; keys must be strictly ascending.
    pub fn add(&mut self, key: &[u8], version: u64, e: &Entry<'_>) -> Result<()> {
        if self.last_key.as_deref().is_some_and(|l| l >= key) {
            return Err(Error::Config("level entries must be added in strictly ascending key order".into()));
        }
        let len = leaf_entry_len(key, e);
        if len + 2 > self.max_entry() {
            return Err(Error::ValueTooLarge { len, max: self.max_entry() });
        }
        if NODE_HDR + 2 * (self.leaf_offs.len() + 1) + self.leaf.len() + len > self.node_size {
            self.close_leaf()?;
        }
        if self.leaf_first.is_none() {
            self.leaf_first = Some(key.to_vec());
        }
        self.leaf_offs.push(self.leaf.len() as u16);
        put_leaf_entry(&mut self.leaf, key, version, e);
        if let Entry::Pointer { ptr, len } = e {
            *self.log_refs.entry(ptr >> 32).or_default() +=
                (crate::vlog::RECORD_HEADER + key.len()) as u64 + *len as u64;
        }
        self.last_key = Some(key.to_vec());
        self.entries += 1;
        self.max_version = self.max_version.max(version);
        Ok(())
    }

    /// The position the next node will be written at.
    fn next_slot(&self) -> u64 {
        match &self.open {
            Some((id, _, n, _)) if *n < self.nodes_per_segment => ptr(*id, ((n + 1) as usize * self.node_size) as u32),
            _ => ptr(self.next_segment, self.node_size as u32),
        }
    }

    fn close_leaf(&mut self) -> Result<()> {
        if self.leaf_offs.is_empty() {
            return Ok(());
        }
        let done = (
            std::mem::take(&mut self.leaf),
            std::mem::take(&mut self.leaf_offs),
            self.leaf_first.take().expect("a non-empty leaf has a first key"),
        );
        if let Some(prev) = self.pending.replace(done) {
            // Another leaf follows the pending one: it goes right after it.
            self.write_leaf(prev, true)?;
        }
        Ok(())
    }

    fn write_leaf(&mut self, (body, offs, first): (Vec<u8>, Vec<u16>, Vec<u8>), more: bool) -> Result<()> {
        let at = self.next_slot();
        let next = if more { self.slot_after(at) } else { 0 };
        let node = encode_node(self.node_size, NODE_LEAF, next, self.prev_leaf, &offs, &body);
        let p = self.write_node(&node)?;
        debug_assert_eq!(p, at);
        self.prev_leaf = p;
        self.layer.push((first, p));
        Ok(())
    }

    /// The slot after `at` in allocation order.
    fn slot_after(&self, at: u64) -> u64 {
        let (seg, off) = super::format::ptr_parts(at);
        let n = off as usize / self.node_size; // 1-based slot index
        if (n as u32) < self.nodes_per_segment {
            ptr(seg, ((n + 1) * self.node_size) as u32)
        } else {
            ptr(seg + 1, self.node_size as u32)
        }
    }

    fn write_node(&mut self, node: &[u8]) -> Result<u64> {
        if self.open.as_ref().is_some_and(|o| o.2 >= self.nodes_per_segment) {
            self.close_segment()?;
        }
        if self.open.is_none() {
            let id = self.next_segment;
            self.next_segment += 1;
            let p = segment_path(&self.dir, id);
            let f = self.fs.create(&p).map_err(|e| Error::io(&p, e))?;
            self.segments.push(id);
            self.open = Some((id, f, 0, 0));
        }
        let (id, f, n, crc) = self.open.as_mut().expect("opened above");
        let off = (*n as usize + 1) * self.node_size;
        f.write_all_at(node, off as u64).map_err(|e| Error::io(&segment_path(&self.dir, *id), e))?;
        *crc = crc32c::crc32c_append(*crc, node);
        *n += 1;
        self.bytes_written += node.len() as u64;
        Ok(ptr(*id, off as u32))
    }

    fn close_segment(&mut self) -> Result<()> {
        if let Some((id, f, n, crc)) = self.open.take() {
            let p = segment_path(&self.dir, id);
            let mut h = vec![0u8; self.node_size];
            h[..8].copy_from_slice(SEG_MAGIC);
            h[8..16].copy_from_slice(&id.to_le_bytes());
            h[16..20].copy_from_slice(&(self.node_size as u32).to_le_bytes());
            h[20..24].copy_from_slice(&n.to_le_bytes());
            h[24..28].copy_from_slice(&crc.to_le_bytes());
            let hc = crc32c::crc32c(&h[..28]);
            h[28..32].copy_from_slice(&hc.to_le_bytes());
            f.write_all_at(&h, 0).map_err(|e| Error::io(&p, e))?;
            f.sync_data().map_err(|e| Error::io(&p, e))?;
            self.bytes_written += h.len() as u64;
        }
        Ok(())
    }

    /// Writes the interior layers and closes the segments. Returns the level's metadata (not yet
    /// installed: the caller records it in the manifest).
    pub fn finish(mut self, level: u32) -> Result<LevelMeta> {
        self.close_leaf()?;
        if let Some(last) = self.pending.take() {
            self.write_leaf(last, false)?;
        }
        let mut height = if self.layer.is_empty() { 0 } else { 1 };
        while self.layer.len() > 1 {
            let children = std::mem::take(&mut self.layer);
            let mut i = 0;
            while i < children.len() {
                // leftmost child + as many (separator, child) entries as fit.
                let (first, leftmost) = (&children[i].0, children[i].1);
                let mut body = Vec::new();
                let mut offs = Vec::new();
                let mut j = i + 1;
                while j < children.len()
                    && NODE_HDR + 2 * (offs.len() + 1) + body.len() + interior_entry_len(&children[j].0)
                        <= self.node_size
                {
                    offs.push(body.len() as u16);
                    body.extend_from_slice(&(children[j].0.len() as u16).to_le_bytes());
                    body.extend_from_slice(&children[j].0);
                    body.extend_from_slice(&children[j].1.to_le_bytes());
                    j += 1;
                }
                let node = encode_node(self.node_size, NODE_INTERIOR, leftmost, 0, &offs, &body);
                let p = self.write_node(&node)?;
                self.layer.push((first.clone(), p));
                i = j;
            }
            height += 1;
        }
        let root = self.layer.first().map_or(0, |x| x.1);
        self.close_segment()?;
        if !self.segments.is_empty() {
            self.fs.sync_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        }
        Ok(LevelMeta {
            level,
            root,
            height,
            entries: self.entries,
            max_version: self.max_version,
            node_size: self.node_size as u32,
            segments: self.segments,
            bytes: self.bytes_written,
            log_refs: self.log_refs.into_iter().collect(),
        })
    }
}

/// A node image: header, offset array (entry offsets made node-relative), entries.
fn encode_node(node_size: usize, kind: u8, link: u64, prev: u64, offs: &[u16], body: &[u8]) -> Vec<u8> {
    let base = NODE_HDR + 2 * offs.len();
    let used = base + body.len();
    let mut n = vec![0u8; node_size];
    n[0] = kind;
    n[2..4].copy_from_slice(&(offs.len() as u16).to_le_bytes());
    n[4..8].copy_from_slice(&(used as u32).to_le_bytes());
    n[8..16].copy_from_slice(&link.to_le_bytes());
    n[16..24].copy_from_slice(&prev.to_le_bytes());
    for (i, o) in offs.iter().enumerate() {
        n[NODE_HDR + 2 * i..NODE_HDR + 2 * i + 2].copy_from_slice(&((base + *o as usize) as u16).to_le_bytes());
    }
    n[base..used].copy_from_slice(body);
    n
}
