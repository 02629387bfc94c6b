//! The single writer: applies puts, deletes and batches under one write version each, appends to
//! leaf log blocks, rewrites nodes into new buffers (merge, split, node merge, root growth and
//! collapse), publishes through the page table and the global read version, and reclaims retired
//! buffers, blobs and LIDs once no reader can reach them.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::node::{
    BLOB_HDR, LeafRefs, MAX_LOG_ENTRIES, Node, NodeData, Val, ValRef, cmp_keys, encode_log_entry, size_word,
};
use super::read::{LeafCursor, Tree, child_for};
use super::{Reader, Stats};
use crate::arena::{
    Arena, LidAlloc, PageAlloc, SB_ALLOCATED_PAGES, SB_GARBAGE_PAGES, SB_LID_HIGH, SB_READ_VERSION, SB_ROOT, SB_STATE,
    SB_TABLES_GEN, SB_WRITE_VERSION, STATE_CLOSED, STATE_FROZEN, SlotWatch, root_word, split_root_word,
};
use crate::config::{ArenaConfig, MAX_VALUE_LEN, NODE_HEADER, shortcut_capacity};
use crate::error::{Error, Result};

/// One operation of a [`Writer::write_batch`].
#[derive(Debug, Clone, Copy)]
pub enum BatchOp<'a> {
    /// Upsert.
    Put(&'a [u8], &'a [u8]),
    /// Insert; the whole batch fails with [`Error::KeyExists`] if the key is present.
    Insert(&'a [u8], &'a [u8]),
    /// Update; the whole batch fails with [`Error::KeyNotFound`] if the key is absent.
    Update(&'a [u8], &'a [u8]),
    /// Delete (absent keys are fine). In an arena with `keep_tombstones` it always leaves a
    /// tombstone, which hides the key in older levels.
    Delete(&'a [u8]),
    /// Upsert a value that lives elsewhere (a value-log record): `len` bytes at `ptr`.
    PutPointer(&'a [u8], u64, u32),
}

impl<'a> BatchOp<'a> {
    fn key(&self) -> &'a [u8] {
        match *self {
            BatchOp::Put(k, _)
            | BatchOp::Insert(k, _)
            | BatchOp::Update(k, _)
            | BatchOp::Delete(k)
            | BatchOp::PutPointer(k, ..) => k,
        }
    }
    fn value(&self) -> Option<&'a [u8]> {
        match *self {
            BatchOp::Put(_, v) | BatchOp::Insert(_, v) | BatchOp::Update(_, v) => Some(v),
            BatchOp::Delete(_) | BatchOp::PutPointer(..) => None,
        }
    }
    /// The new stored value: inline bytes (a blob is substituted later), a pointer, a tombstone.
    fn new_value(&self) -> ValRef<'a> {
        match *self {
            BatchOp::Put(_, v) | BatchOp::Insert(_, v) | BatchOp::Update(_, v) => ValRef::Inline(v),
            BatchOp::PutPointer(_, ptr, len) => ValRef::Ext { ptr, len },
            BatchOp::Delete(_) => ValRef::Tombstone,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Garbage {
    Buffer(u64),
    Blob(u64, u64),
    Lid(u64),
}

/// What one pass over a leaf tells the writer about a key.
struct Probe<'a> {
    /// The key's newest entry in the leaf (log first, then the sorted block).
    existing: Option<ValRef<'a>>,
    /// Position of the first sorted item with key >= the key, and whether it is equal.
    bp: u32,
    equal: bool,
    /// The key's rank among the log entries (it goes before older entries of the same key).
    hint: u32,
}

/// One pass over the leaf's log and one segment of its sorted block.
fn probe<'a>(node: &Node<'a>, key: &[u8]) -> Result<Probe<'a>> {
    let h = node.h;
    let (mut hint, mut logged) = (0u32, None);
    let mut pos = h.sorted_end;
    for _ in 0..h.log_count {
        let e = node.log_entry(pos)?;
        match cmp_keys(e.key, key) {
            std::cmp::Ordering::Less => hint += 1,
            std::cmp::Ordering::Equal => logged = Some(e.val),
            std::cmp::Ordering::Greater => {}
        }
        pos = e.next;
    }
    let (mut bp, end) = node.segment(key, false)?;
    let (mut equal, mut sorted) = (false, None);
    while bp < end {
        let (k, v, next) = node.leaf_item(bp)?;
        match cmp_keys(k, key) {
            std::cmp::Ordering::Less => bp = next,
            std::cmp::Ordering::Equal => {
                (equal, sorted) = (true, Some(v));
                break;
            }
            std::cmp::Ordering::Greater => break,
        }
    }
    Ok(Probe { existing: logged.or(sorted), bp, equal, hint })
}

#[derive(Debug, Clone, Copy)]
struct PathElem {
    lid: u64,
    off: u64,
}

/// The one writer of an arena's tree. It is `Send` but not `Sync` and not `Clone`, and it holds an
/// exclusive lock on the arena file: one writer per tree, made explicit in the types.
pub struct Writer {
    arena: Arc<Arena>,
    file: File,
    pages: PageAlloc,
    lids: LidAlloc,
    garbage: VecDeque<(u64, Garbage)>,
    garbage_pages: u64,
    version: u64,
    /// The version the arena was created at (no entry is older).
    base_version: u64,
    height: u16,
    watch: SlotWatch,
    commits_since_reclaim: u32,
    /// Reclamation passes that failed (a corrupt reader slot).
    reclaim_errors: u64,
    buf: Vec<u8>,
    path: Vec<PathElem>,
    /// Commands pushed into the command ring so far.
    ring_seq: u64,
    leaf_cap: usize,
    interior_cap: usize,
    keep_tombstones: bool,
    /// Commits do not publish the read version; the owner does, through a [`ReadPublisher`],
    /// once the batch is durable.
    deferred_publish: bool,
    /// Heap pages `[0, reserved)` are backed by memory (`fallocate`d).
    reserved_pages: u64,
    /// Why the writer stopped: a batch failed half-applied (a corrupt arena).
    poisoned: Option<String>,
    _not_sync: PhantomData<Cell<()>>,
}

/// Heap pages reserved at a time (8 MiB of 8 KiB nodes).
const RESERVE_CHUNK_PAGES: u64 = 1024;

impl Writer {
    /// Creates a new, empty arena at `path` (atomically replacing any file there) and returns its
    /// writer.
    pub fn create(path: impl AsRef<Path>, cfg: &ArenaConfig) -> Result<Writer> {
        Writer::create_at(path, cfg, 0)
    }

    /// Like [`Writer::create`], with versions continuing after `version` (a new L0 over older
    /// data keeps the region's versions monotonic).
    pub fn create_at(path: impl AsRef<Path>, cfg: &ArenaConfig, version: u64) -> Result<Writer> {
        let path = path.as_ref();
        let (arena, file, tmp) = Arena::create(path, cfg)?;
        let l = arena.layout;
        let payload = l.node_size as usize - NODE_HEADER - shortcut_capacity(l.node_size);
        let mut w = Writer {
            pages: PageAlloc::new(l.heap_off, l.node_size as u64, l.heap_pages),
            lids: LidAlloc::new(1, l.pt_entries),
            arena: Arc::new(arena),
            file,
            garbage: VecDeque::new(),
            garbage_pages: 0,
            version: 0,
            base_version: version,
            height: 1,
            watch: SlotWatch::new(),
            commits_since_reclaim: 0,
            reclaim_errors: 0,
            buf: Vec::with_capacity(l.node_size as usize),
            path: Vec::with_capacity(8),
            ring_seq: 0,
            leaf_cap: payload - l.log_threshold as usize,
            interior_cap: payload,
            keep_tombstones: cfg.keep_tombstones,
            deferred_publish: false,
            reserved_pages: 0,
            poisoned: None,
            _not_sync: PhantomData,
        };
        w.reserve(1)?;
        let root = w.alloc_lid()?;
        let off = w.write_node(root, &NodeData::Leaf { items: Vec::new(), right: 0 }, version, 0)?;
        w.map_lid(root, off)?;
        w.version = version;
        w.arena.sb(SB_WRITE_VERSION).store(version, Ordering::Relaxed);
        w.arena.sb(SB_READ_VERSION).store(version, Ordering::Release);
        w.arena.sb(SB_ROOT).store(root_word(root, 1), Ordering::Release);
        w.publish_stats();
        w.arena.publish(&tmp)?;
        Ok(w)
    }

    pub(super) fn arena_ref(&self) -> &Arena {
        &self.arena
    }

    /// The arena's geometry.
    pub fn layout(&self) -> crate::arena::Layout {
        self.arena.layout
    }

    /// The newest released write version.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The version the arena was created at.
    pub fn base_version(&self) -> u64 {
        self.base_version
    }

    /// Whether `ops` more operations (without blobs) are sure to fit: the worst case of
    /// [`Writer::write_batch_at`], after reclaiming what can be reclaimed.
    pub fn fits(&mut self, ops: usize) -> bool {
        let (pages, lids) = self.worst_case(ops as u64, 0);
        if self.pages.free() >= pages && self.lids.free() >= lids {
            return true;
        }
        self.reclaim_quietly();
        self.pages.free() >= pages && self.lids.free() >= lids
    }

    /// Heap pages and node ids `ops` operations may take at worst (every op rewrites and splits
    /// every level, plus a new root), plus `blob_pages`.
    fn worst_case(&self, ops: u64, blob_pages: u64) -> (u64, u64) {
        (ops * (2 * (self.height as u64 + 1) + 4) + blob_pages, ops * (self.height as u64 + 2))
    }

    /// A reader sharing this writer's mapping (for reader threads in this process).
    pub fn reader(&self) -> Result<Reader> {
        Reader::from_arena(self.arena.clone())
    }

    fn tree(&self) -> Tree<'_> {
        Tree::of_writer(self)
    }

    /// The current value of `key`.
    pub fn get(&self, key: &[u8]) -> Result<Option<&[u8]>> {
        self.tree().get(key)
    }

    /// The current entry of `key` as stored (value, pointer or tombstone).
    pub fn get_entry(&self, key: &[u8]) -> Result<Option<super::Entry<'_>>> {
        Ok(self.get_versioned(key)?.map(|(e, _)| e))
    }

    /// The current entry of `key` with its version (see [`super::Snapshot::get_versioned`]).
    pub fn get_versioned(&self, key: &[u8]) -> Result<Option<(super::Entry<'_>, u64)>> {
        self.tree().get_versioned(key)
    }

    /// Calls `f` for up to `limit` current entries (tombstones included) with keys in `[lo, hi]`.
    pub fn scan_entries(
        &self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        mut f: impl FnMut(&[u8], super::Entry<'_>),
    ) -> Result<usize> {
        let tree = self.tree();
        tree.scan_entries(lo, hi, limit, true, |k, v| {
            f(k, tree.entry(v)?);
            Ok(())
        })
    }

    /// The current entry with the largest key `<= key` (`< key` when `strict`), tombstones included.
    pub fn floor_entry(&self, key: &[u8], strict: bool) -> Result<Option<(&[u8], super::Entry<'_>)>> {
        let tree = self.tree();
        match tree.floor_entry(key, strict, true)? {
            Some((k, v)) => Ok(Some((k, tree.entry(v)?))),
            None => Ok(None),
        }
    }

    /// Marks the arena frozen (it takes no more writes; readers should move to the next one) and
    /// records the generation of the region's table set in its superblock.
    pub fn set_tables_generation(&self, generation: u64, frozen: bool) {
        self.arena.sb(SB_TABLES_GEN).store(generation, Ordering::Release);
        if frozen {
            self.arena.sb(SB_STATE).store(STATE_FROZEN, Ordering::Release);
        }
    }

    /// The path of the arena file.
    pub fn path(&self) -> &Path {
        &self.arena.path
    }

    /// Items with keys in `[lo, hi]`, ascending, at most `limit`.
    pub fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&[u8], &[u8])>> {
        let mut out = Vec::new();
        self.tree().scan(lo, hi, limit, |k, v| {
            out.push((k, v));
            Ok(())
        })?;
        Ok(out)
    }

    /// Like [`Writer::scan`] but starting at the largest key `<= lo`.
    pub fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&[u8], &[u8])>> {
        let mut out = Vec::new();
        self.tree().floor_scan(lo, hi, limit, |k, v| {
            out.push((k, v));
            Ok(())
        })?;
        Ok(out)
    }

    /// Upserts `key`; returns the write version.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write_batch(&[BatchOp::Put(key, value)])
    }

    /// Inserts `key`, failing with [`Error::KeyExists`] if present.
    pub fn insert(&mut self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write_batch(&[BatchOp::Insert(key, value)])
    }

    /// Updates `key`, failing with [`Error::KeyNotFound`] if absent.
    pub fn update(&mut self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write_batch(&[BatchOp::Update(key, value)])
    }

    /// Deletes `key`; returns the write version, or None if the key was absent and nothing was
    /// written (with `keep_tombstones` a tombstone is always written).
    pub fn delete(&mut self, key: &[u8]) -> Result<Option<u64>> {
        self.check_key(key)?;
        if !self.keep_tombstones && self.get(key)?.is_none() {
            return Ok(None);
        }
        self.write_batch(&[BatchOp::Delete(key)]).map(Some)
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        let max = self.arena.layout.max_key_len as usize;
        if key.is_empty() || key.len() > max {
            return Err(Error::KeySize { len: key.len(), max });
        }
        Ok(())
    }

    /// Applies `ops` atomically under one write version: readers see all of them or none. Either
    /// every precondition holds and everything is applied, or nothing is.
    pub fn write_batch(&mut self, ops: &[BatchOp<'_>]) -> Result<u64> {
        self.write_batch_at(self.version + 1, ops)
    }

    /// Like [`Writer::write_batch`] under a given version, which must be above every version
    /// written so far (versions may skip: a region never reuses a version its log has seen).
    ///
    /// A batch that fails changes nothing a reader can see and leaks nothing: limits,
    /// preconditions, heap pages, blob runs and node ids are all checked or taken before the first
    /// operation is applied. Only a corrupt arena can stop a batch half-way; the writer then
    /// refuses every later batch.
    pub fn write_batch_at(&mut self, w: u64, ops: &[BatchOp<'_>]) -> Result<u64> {
        if let Some(why) = &self.poisoned {
            return Err(Error::Unavailable(why.clone()));
        }
        if w <= self.version {
            return Err(Error::Config(format!("version {w} is not above the writer's {}", self.version)));
        }
        let ns = self.arena.layout.node_size as u64;
        let inline = self.arena.layout.inline_threshold as usize;
        let mut blob_pages = 0u64;
        for op in ops {
            self.check_key(op.key())?;
            if let BatchOp::PutPointer(_, _, len) = op
                && *len as usize > MAX_VALUE_LEN
            {
                return Err(Error::ValueTooLarge { len: *len as usize, max: MAX_VALUE_LEN });
            }
            if let Some(v) = op.value() {
                if v.len() > MAX_VALUE_LEN {
                    return Err(Error::ValueTooLarge { len: v.len(), max: MAX_VALUE_LEN });
                }
                if v.len() > inline {
                    blob_pages += (BLOB_HDR + v.len() as u64).div_ceil(ns);
                }
            }
        }
        self.check_preconditions(ops)?;
        let (needed, lids) = self.worst_case(ops.len() as u64, blob_pages);
        if self.pages.free() < needed || self.lids.free() < lids {
            self.reclaim_quietly();
            if self.pages.free() < needed || self.lids.free() < lids {
                return Err(Error::ArenaFull { needed: needed * ns, free: self.pages.free() * ns });
            }
        }
        self.reserve(needed)?;
        // Blobs need contiguous runs, which a fragmented heap may lack: take them all first.
        let mut blobs: Vec<Option<Val>> = Vec::with_capacity(ops.len());
        for op in ops {
            let blob = match op.value() {
                Some(v) if v.len() > inline => match self.write_blob(v) {
                    Ok(b) => Some(b),
                    Err(e) => {
                        for b in blobs.into_iter().flatten() {
                            self.free_blob(&b);
                        }
                        return Err(e);
                    }
                },
                _ => None,
            };
            blobs.push(blob);
        }
        self.arena.sb(SB_WRITE_VERSION).store(w, Ordering::Relaxed);
        for (op, blob) in ops.iter().zip(&blobs) {
            let value = match blob {
                Some(b) => b.as_ref(),
                None => op.new_value(),
            };
            if let Err(e) = self.apply(op.key(), value, w) {
                self.poisoned = Some(format!("a batch failed half-applied: {e}"));
                return Err(e);
            }
        }
        self.commit(w);
        Ok(w)
    }

    /// Backs the heap pages a batch may take with memory (`fallocate` of the arena file), so a
    /// full tmpfs or memory limit gives [`Error::ArenaFull`] here instead of SIGBUS later.
    fn reserve(&mut self, pages: u64) -> Result<()> {
        let want = (self.pages.high_water() + pages).min(self.arena.layout.heap_pages);
        if want <= self.reserved_pages {
            return Ok(());
        }
        let (ns, heap) = (self.arena.layout.node_size as u64, self.arena.layout.heap_off);
        let upto = (want + RESERVE_CHUNK_PAGES).min(self.arena.layout.heap_pages);
        // The first reservation also covers the metadata before the heap (page table, ring).
        let from = if self.reserved_pages == 0 { 0 } else { heap + self.reserved_pages * ns };
        if crate::arena::reserve_memory(&self.file, from, heap + upto * ns).is_err() {
            let room = self.reserved_pages.saturating_sub(self.pages.high_water());
            return Err(Error::ArenaFull { needed: pages * ns, free: room * ns });
        }
        self.reserved_pages = upto;
        Ok(())
    }

    fn free_blob(&mut self, b: &Val) {
        if let Val::Blob { off, len } = b {
            let n = (BLOB_HDR + *len as u64).div_ceil(self.arena.layout.node_size as u64);
            self.pages.release(*off, n);
        }
    }

    /// Publishes read versions from outside the writer (see [`Writer::set_deferred_publish`]).
    pub(crate) fn publisher(&self) -> super::ReadPublisher {
        super::ReadPublisher(self.arena.clone())
    }

    /// With `deferred`, commits stop publishing the read version: readers keep seeing the last
    /// published state until the owner publishes newer versions through [`Writer::publisher`]
    /// (a region does once the batches are durable). The writer's own reads see everything.
    pub(crate) fn set_deferred_publish(&mut self, deferred: bool) {
        self.deferred_publish = deferred;
    }

    fn check_preconditions(&self, ops: &[BatchOp<'_>]) -> Result<()> {
        let mut overlay: HashMap<&[u8], bool> = HashMap::new();
        for op in ops {
            let (need, after) = match op {
                BatchOp::Put(..) | BatchOp::PutPointer(..) => (None, true),
                BatchOp::Insert(..) => (Some(false), true),
                BatchOp::Update(..) => (Some(true), true),
                BatchOp::Delete(_) => (None, false),
            };
            if let Some(need) = need {
                let exists = match overlay.get(op.key()) {
                    Some(&e) => e,
                    None => self.get(op.key())?.is_some(),
                };
                if exists != need {
                    return Err(if need { Error::KeyNotFound } else { Error::KeyExists });
                }
            }
            if ops.len() > 1 {
                overlay.insert(op.key(), after);
            }
        }
        Ok(())
    }

    /// Ends a batch: its version becomes the writer's and (unless deferred) the readers'. Cannot
    /// fail: the batch is applied, whatever reclamation finds.
    fn commit(&mut self, w: u64) {
        // Single writer: versions are released in order by construction.
        self.version = w;
        if !self.deferred_publish {
            self.arena.sb(SB_READ_VERSION).store(w, Ordering::SeqCst);
        }
        self.commits_since_reclaim += 1;
        if self.commits_since_reclaim >= 16 || self.garbage_pages > self.pages.free() / 4 {
            self.reclaim_quietly();
        }
    }

    /// Reclaims; an error (a corrupt reader slot) only means nothing more was freed this time.
    fn reclaim_quietly(&mut self) {
        if self.reclaim().is_err() {
            self.reclaim_errors += 1;
        }
    }

    // --- one operation -------------------------------------------------------------------------

    /// The path from the root to the leaf for `key`, into `path` (reused across operations).
    fn path_to(&self, key: &[u8], path: &mut Vec<PathElem>) -> Result<()> {
        path.clear();
        let mut lid = split_root_word(self.arena.sb(SB_ROOT).load(Ordering::Relaxed)).0;
        for _ in 0..64 {
            let off = self.arena.page_entry(lid, Ordering::Relaxed)?;
            let node = own_node(&self.arena, off)?;
            path.push(PathElem { lid, off });
            if node.h.is_leaf() {
                return Ok(());
            }
            lid = child_for(&node, key, false)?.0;
        }
        Err(Error::corrupt(0, "tree deeper than 64 levels"))
    }

    fn apply(&mut self, key: &[u8], value: ValRef<'_>, w: u64) -> Result<()> {
        let mut path = std::mem::take(&mut self.path);
        let r = self.apply_on_path(key, value, w, &mut path);
        self.path = path;
        r
    }

    fn apply_on_path(&mut self, key: &[u8], value: ValRef<'_>, w: u64, path: &mut Vec<PathElem>) -> Result<()> {
        self.path_to(key, path)?;
        let leaf_el = *path.last().expect("a path always ends at a leaf");
        let arena = self.arena.clone();
        let leaf = own_node(&arena, leaf_el.off)?;
        let p = probe(&leaf, key)?;
        let old_blob = match p.existing {
            Some(ValRef::Blob { off, len }) => Some((off, len)),
            _ => None,
        };
        let existed = !matches!(p.existing, None | Some(ValRef::Tombstone));
        if value == ValRef::Tombstone && !existed && !self.keep_tombstones {
            return Ok(());
        }
        // Values over the inline threshold arrive as blobs written before the batch began.
        let new_val = Val::from_ref(value);
        if !self.try_append(&leaf, &p, key, new_val.as_ref(), w)? {
            self.rewrite_leaf(path, key, new_val, w)?;
        }
        if let Some((off, len)) = old_blob {
            self.retire(w, Garbage::Blob(off, (BLOB_HDR + len as u64).div_ceil(self.arena.layout.node_size as u64)));
        }
        Ok(())
    }

    /// The fast path: appends a log entry and publishes it with one release store of the size
    /// word. Returns false when the leaf must be rewritten instead.
    #[allow(unsafe_code)]
    fn try_append(&mut self, node: &Node<'_>, p: &Probe<'_>, key: &[u8], val: ValRef<'_>, w: u64) -> Result<bool> {
        let h = node.h;
        let off = h.off;
        let delta = w - h.version;
        if h.log_count >= MAX_LOG_ENTRIES || delta > u32::MAX as u64 {
            return Ok(false);
        }
        let mut entry = std::mem::take(&mut self.buf);
        encode_log_entry(&mut entry, p.equal, p.hint as u8, p.bp, delta as u32, key, val);
        let new_end = h.log_end as usize + entry.len();
        let fits = new_end - h.sorted_end as usize <= self.arena.layout.log_threshold as usize
            && new_end <= self.arena.layout.node_size as usize;
        if fits {
            // SAFETY: the bytes past the published size word are no reader's: readers slice a
            // node only up to the size they loaded, and this entry is published below.
            unsafe { self.arena.map.write(off + h.log_end as u64, &entry) }?;
            self.arena
                .map
                .word(off + super::node::H_SIZE)?
                .store(size_word(new_end as u32, h.log_count + 1), Ordering::Release);
        }
        self.buf = entry;
        Ok(fits)
    }

    /// Merges the leaf's log (and this op) into a new buffer. The common case — the result
    /// neither overflows nor underflows — encodes straight from borrowed slices of the old buffer
    /// (valid until reclamation, which only runs between batches); splits and merges go through
    /// owned node data.
    fn rewrite_leaf(&mut self, path: &[PathElem], key: &[u8], val: Val, w: u64) -> Result<()> {
        let el = *path.last().expect("non-empty path");
        let arena = self.arena.clone();
        let node = own_node(&arena, el.off)?;
        if !node.h.is_leaf() {
            return Err(Error::corrupt(el.off, "path does not end at a leaf"));
        }
        let right = node.h.right;
        let mut items: Vec<(&[u8], ValRef<'_>)> =
            Vec::with_capacity((node.h.sorted_count + node.h.log_count + 1) as usize);
        let mut cur = LeafCursor::new(node, None, u64::MAX)?;
        while let Some((k, v)) = cur.next()? {
            if v != ValRef::Tombstone || self.keep_tombstones {
                items.push((k, v));
            }
        }
        let append = items.last().is_none_or(|(k, _)| key > *k);
        let remove = val == Val::Tombstone && !self.keep_tombstones;
        match items.binary_search_by(|(k, _)| (*k).cmp(key)) {
            Ok(i) if remove => {
                items.remove(i);
            }
            Ok(i) => items[i].1 = val.as_ref(),
            Err(_) if remove => {}
            Err(i) => items.insert(i, (key, val.as_ref())),
        }
        let refs = LeafRefs { items, right };
        let size = refs.sorted_bytes();
        let depth = path.len() - 1;
        if size <= self.leaf_cap && (depth == 0 || size >= self.leaf_cap / 4) {
            let mut buf = std::mem::take(&mut self.buf);
            refs.encode(arena.layout.node_size, el.lid, w, el.off, &mut buf);
            let r = self.write_image(&buf);
            self.buf = buf;
            let off = r?;
            self.map_lid(el.lid, off)?;
            self.retire(w, Garbage::Buffer(el.off));
            return Ok(());
        }
        let data = refs.to_owned_data();
        self.store(path, depth, data, w, append)
    }

    /// Decodes the newest state of the node buffer at `off`.
    fn decode(&self, off: u64) -> Result<NodeData> {
        let node = own_node(&self.arena, off)?;
        if node.h.is_leaf() {
            let right = node.h.right;
            let mut items = Vec::with_capacity(node.h.sorted_count as usize + node.h.log_count as usize);
            let mut cur = LeafCursor::new(node, None, u64::MAX)?;
            while let Some((k, v)) = cur.next()? {
                if v != ValRef::Tombstone || self.keep_tombstones {
                    items.push((k.to_vec(), Val::from_ref(v)));
                }
            }
            Ok(NodeData::Leaf { items, right })
        } else {
            let mut items = Vec::with_capacity(node.h.sorted_count as usize);
            let mut pos = node.h.sorted_start;
            while pos < node.h.sorted_end {
                let (k, c, next) = node.interior_item(pos)?;
                items.push((k.to_vec(), c));
                pos = next;
            }
            Ok(NodeData::Interior { level: node.h.level, leftmost: node.h.leftmost, items })
        }
    }

    fn cap(&self, data: &NodeData) -> usize {
        match data {
            NodeData::Leaf { .. } => self.leaf_cap,
            NodeData::Interior { .. } => self.interior_cap,
        }
    }

    /// Writes `data` as the new state of `path[depth]`, splitting, merging or collapsing the root
    /// as needed, and propagating separator changes up the path.
    fn store(&mut self, path: &[PathElem], depth: usize, data: NodeData, w: u64, append: bool) -> Result<()> {
        let el = path[depth];
        let cap = self.cap(&data);
        let size = data.sorted_bytes();
        if size > cap {
            let (left, sep, right) = split(data, cap, append);
            if depth == 0 {
                return self.grow_root(el, left, sep, right, w);
            }
            let nl = self.alloc_lid()?;
            let left = set_right(left, nl);
            let off_r = self.write_node(nl, &right, w, el.off)?;
            self.map_lid(nl, off_r)?;
            self.replace(el, &left, w)?;
            let pel = path[depth - 1];
            let NodeData::Interior { level, leftmost, mut items } = self.decode(pel.off)? else {
                return Err(Error::corrupt(pel.off, "parent is not an interior node"));
            };
            let at = items.partition_point(|(k, _)| k.as_slice() < sep.as_slice());
            items.insert(at, (sep, nl));
            return self.store(path, depth - 1, NodeData::Interior { level, leftmost, items }, w, false);
        }
        if depth > 0 && size < cap / 4 {
            match self.try_merge(path, depth, data, w)? {
                None => return Ok(()),
                Some(data) => return self.replace(el, &data, w),
            }
        }
        if depth == 0
            && let NodeData::Interior { leftmost, ref items, .. } = data
            && items.is_empty()
        {
            return self.collapse_root(el, leftmost, w);
        }
        self.replace(el, &data, w)
    }

    /// Writes `data` into a new buffer for `el.lid` and swaps the page-table entry.
    fn replace(&mut self, el: PathElem, data: &NodeData, w: u64) -> Result<()> {
        let off = self.write_node(el.lid, data, w, el.off)?;
        self.map_lid(el.lid, off)?;
        self.retire(w, Garbage::Buffer(el.off));
        Ok(())
    }

    fn grow_root(&mut self, el: PathElem, left: NodeData, sep: Vec<u8>, right: NodeData, w: u64) -> Result<()> {
        let level = match &left {
            NodeData::Leaf { .. } => 1,
            NodeData::Interior { level, .. } => level + 1,
        };
        let (a, b) = (self.alloc_lid()?, self.alloc_lid()?);
        let left = set_right(left, b);
        let off_a = self.write_node(a, &left, w, el.off)?;
        let off_b = self.write_node(b, &right, w, el.off)?;
        self.map_lid(a, off_a)?;
        self.map_lid(b, off_b)?;
        self.replace(el, &NodeData::Interior { level, leftmost: a, items: vec![(sep, b)] }, w)?;
        self.height += 1;
        self.arena.sb(SB_ROOT).store(root_word(el.lid, self.height), Ordering::Release);
        Ok(())
    }

    fn collapse_root(&mut self, el: PathElem, mut child: u64, w: u64) -> Result<()> {
        // The root LID stays; it takes over its only child's contents.
        loop {
            let coff = self.arena.page_entry(child, Ordering::Relaxed)?;
            let data = self.decode(coff)?;
            self.retire(w, Garbage::Buffer(coff));
            self.retire(w, Garbage::Lid(child));
            self.height -= 1;
            match data {
                NodeData::Interior { leftmost, ref items, .. } if items.is_empty() => child = leftmost,
                data => {
                    self.replace(el, &data, w)?;
                    self.arena.sb(SB_ROOT).store(root_word(el.lid, self.height), Ordering::Release);
                    return Ok(());
                }
            }
        }
    }

    /// Merges an underfull node with a sibling under the same parent when the result fits in
    /// three quarters of a node. Returns the data back when no merge happened.
    fn try_merge(&mut self, path: &[PathElem], depth: usize, data: NodeData, w: u64) -> Result<Option<NodeData>> {
        let el = path[depth];
        let pel = path[depth - 1];
        let NodeData::Interior { level, leftmost, mut items } = self.decode(pel.off)? else {
            return Err(Error::corrupt(pel.off, "parent is not an interior node"));
        };
        if items.is_empty() {
            return Ok(Some(data));
        }
        let child = |i: usize| if i == 0 { leftmost } else { items[i - 1].1 };
        let idx = match (0..=items.len()).find(|&i| child(i) == el.lid) {
            Some(i) => i,
            None => return Err(Error::corrupt(pel.off, "child missing from its parent")),
        };
        // Pair with the smaller of the two neighbours under the same parent.
        let mut best: Option<(usize, usize, NodeData, PathElem)> = None;
        for (li, ri) in [(idx, idx + 1), (idx.wrapping_sub(1), idx)] {
            if ri > items.len() || li > items.len() {
                continue;
            }
            let sib_lid = child(if li == idx { ri } else { li });
            let sib_off = self.arena.page_entry(sib_lid, Ordering::Relaxed)?;
            let sib = self.decode(sib_off)?;
            if best.as_ref().is_none_or(|b| sib.sorted_bytes() < b.2.sorted_bytes()) {
                best = Some((li, ri, sib, PathElem { lid: sib_lid, off: sib_off }));
            }
        }
        let Some((li, ri, sib, sib_el)) = best else { return Ok(Some(data)) };
        let sep_len = match &data {
            NodeData::Leaf { .. } => 0,
            NodeData::Interior { .. } => super::node::interior_item_len(&items[ri - 1].0),
        };
        if data.sorted_bytes() + sib.sorted_bytes() + sep_len > self.cap(&data) * 3 / 4 {
            return Ok(Some(data));
        }
        let (left, left_el, right, right_el) =
            if li == idx { (data, el, sib, sib_el) } else { (sib, sib_el, data, el) };
        let sep = items.remove(ri - 1).0;
        let merged = match (left, right) {
            (NodeData::Leaf { items: mut a, .. }, NodeData::Leaf { items: b, right }) => {
                a.extend(b);
                NodeData::Leaf { items: a, right }
            }
            (
                NodeData::Interior { level, leftmost, items: mut a },
                NodeData::Interior { leftmost: rl, items: b, .. },
            ) => {
                a.push((sep, rl));
                a.extend(b);
                NodeData::Interior { level, leftmost, items: a }
            }
            _ => return Err(Error::corrupt(left_el.off, "siblings of different kinds")),
        };
        self.replace(left_el, &merged, w)?;
        self.retire(w, Garbage::Buffer(right_el.off));
        self.retire(w, Garbage::Lid(right_el.lid));
        self.store(path, depth - 1, NodeData::Interior { level, leftmost, items }, w, false).map(|()| None)
    }

    // --- allocation and publication --------------------------------------------------------------

    fn alloc_lid(&mut self) -> Result<u64> {
        let lid = self.lids.alloc().ok_or(Error::ArenaFull { needed: 8, free: 0 })?;
        self.arena.sb(SB_LID_HIGH).store(self.lids.high_water(), Ordering::Release);
        Ok(lid)
    }

    fn write_node(&mut self, lid: u64, data: &NodeData, w: u64, prev: u64) -> Result<u64> {
        let mut buf = std::mem::take(&mut self.buf);
        data.encode(self.arena.layout.node_size, lid, w, prev, &mut buf);
        let r = self.write_image(&buf);
        self.buf = buf;
        r
    }

    /// Allocates a page and writes a node image into it.
    #[allow(unsafe_code)]
    fn write_image(&mut self, image: &[u8]) -> Result<u64> {
        let ns = self.arena.layout.node_size as u64;
        let off = self.pages.alloc(1).ok_or(Error::ArenaFull { needed: ns, free: 0 })?;
        // SAFETY: a page fresh from the allocator, which hands out only pages no pinned reader
        // can reach (never used, or reclaimed once every pin was past their retirement).
        unsafe { self.arena.map.write(off, image) }?;
        Ok(off)
    }

    /// Points `lid` at `off` in the page table and tells the device through the command ring.
    fn map_lid(&mut self, lid: u64, off: u64) -> Result<()> {
        self.arena.page_entry_word(lid)?.store(off, Ordering::Release);
        self.arena.ring_push(self.ring_seq, lid, off)?;
        self.ring_seq += 1;
        Ok(())
    }

    #[allow(unsafe_code)]
    fn write_blob(&mut self, v: &[u8]) -> Result<Val> {
        let ns = self.arena.layout.node_size as u64;
        let n = (BLOB_HDR + v.len() as u64).div_ceil(ns);
        let off =
            self.pages.alloc(n).ok_or_else(|| Error::ArenaFull { needed: n * ns, free: self.pages.free() * ns })?;
        // SAFETY: pages fresh from the allocator (see `write_image`).
        unsafe {
            self.arena.map.write(off, &(v.len() as u64).to_le_bytes())?;
            self.arena.map.write(off + BLOB_HDR, v)?;
        }
        Ok(Val::Blob { off, len: v.len() as u32 })
    }

    fn retire(&mut self, w: u64, g: Garbage) {
        self.garbage_pages += match g {
            Garbage::Buffer(_) => 1,
            Garbage::Blob(_, n) => n,
            Garbage::Lid(_) => 0,
        };
        self.garbage.push_back((w, g));
    }

    /// How long a reader in another pid namespace may hold a pin without a heartbeat before it is
    /// judged dead and its slot taken (default 30 s; the reader then gets `ReaderRevoked`).
    pub fn set_reader_lease(&mut self, lease: std::time::Duration) {
        self.watch.lease = lease;
    }

    /// The oldest read version any live reader of this arena (in any process) may be using:
    /// something unreachable from versions at or after it can be discarded. Dead readers' slots
    /// are cleared on the way.
    pub fn oldest_reader_version(&mut self) -> Result<u64> {
        let current = self.arena.load(SB_READ_VERSION, Ordering::SeqCst);
        self.watch.min_pinned(&self.arena.slots(), current, self.version)
    }

    /// Frees everything retired at versions no live reader can still see. Called automatically
    /// every few commits and when space runs low.
    pub fn reclaim(&mut self) -> Result<()> {
        self.commits_since_reclaim = 0;
        if let Some(&(wanted, _)) = self.garbage.front() {
            let current = self.arena.load(SB_READ_VERSION, Ordering::SeqCst);
            let min = self.watch.min_pinned(&self.arena.slots(), current, wanted)?;
            while let Some(&(v, g)) = self.garbage.front() {
                if v > min {
                    break;
                }
                self.garbage.pop_front();
                match g {
                    Garbage::Buffer(off) => {
                        self.pages.release(off, 1);
                        self.garbage_pages -= 1;
                    }
                    Garbage::Blob(off, n) => {
                        self.pages.release(off, n);
                        self.garbage_pages -= n;
                    }
                    Garbage::Lid(lid) => {
                        self.map_lid(lid, 0)?;
                        self.lids.release(lid);
                    }
                }
            }
        }
        self.publish_stats();
        Ok(())
    }

    fn publish_stats(&self) {
        self.arena.sb(SB_ALLOCATED_PAGES).store(self.pages.used(), Ordering::Relaxed);
        self.arena.sb(SB_GARBAGE_PAGES).store(self.garbage_pages, Ordering::Relaxed);
    }

    /// Space and structure figures.
    pub fn stats(&self) -> Stats {
        let l = self.arena.layout;
        let ns = l.node_size as u64;
        Stats {
            version: self.version,
            height: self.height,
            node_size: l.node_size,
            capacity: l.capacity,
            allocated_bytes: self.pages.used() * ns,
            garbage_bytes: self.garbage_pages * ns,
            pending_garbage: self.garbage.len(),
            dead_slots_cleared: self.watch.cleared,
            footprint_bytes: self.pages.used() * ns + l.pt_off + self.lids.high_water() * 8,
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.arena.sb(SB_STATE).compare_exchange(
            crate::arena::STATE_READY,
            STATE_CLOSED,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// The writer's read of its own node at `off`.
#[allow(unsafe_code)]
fn own_node(arena: &Arena, off: u64) -> Result<Node<'_>> {
    // SAFETY: only the writer calls this, on its own arena and between its own writes: nobody
    // else writes the arena's buffers (readers write only their slots), and the writer does not
    // write published bytes.
    unsafe { Node::load(arena, off) }
}

/// Sets a leaf's right sibling.
fn set_right(data: NodeData, r: u64) -> NodeData {
    match data {
        NodeData::Leaf { items, .. } => NodeData::Leaf { items, right: r },
        d => d,
    }
}

/// Splits an overfull node in two by bytes: in half, or keeping ~90% on the left when keys are
/// appended in order (so sequential loads fill nodes). Returns (left, separator, right); a leaf's
/// right half inherits the original right sibling, and the caller links left to right.
fn split(data: NodeData, cap: usize, append: bool) -> (NodeData, Vec<u8>, NodeData) {
    let sizes: Vec<usize> = match &data {
        NodeData::Leaf { items, .. } => items.iter().map(|(k, v)| super::node::leaf_item_len(k, v)).collect(),
        NodeData::Interior { items, .. } => items.iter().map(|(k, _)| super::node::interior_item_len(k)).collect(),
    };
    let total: usize = sizes.iter().sum();
    let target = if append { total * 9 / 10 } else { total / 2 };
    let n = sizes.len();
    let mut i = 0;
    let mut acc = 0;
    while i < n && acc + sizes[i] <= target {
        acc += sizes[i];
        i += 1;
    }
    // Both halves must fit: move the boundary if one side is over capacity.
    let prefix = |i: usize| sizes[..i].iter().sum::<usize>();
    // A leaf keeps at least one item per side; an interior node moves item `i` up, so it keeps
    // at least one separator per side too (n >= 3 whenever it overflows: items are <= cap / 3).
    let (lo, hi) = match data {
        NodeData::Leaf { .. } => (1, n - 1),
        NodeData::Interior { .. } => (1, n - 2),
    };
    i = i.clamp(lo, hi);
    while i > lo && prefix(i) > cap {
        i -= 1;
    }
    while i < hi && total - prefix(i) > cap {
        i += 1;
    }
    match data {
        NodeData::Leaf { mut items, right } => {
            let r = items.split_off(i);
            let sep = r[0].0.clone();
            (NodeData::Leaf { items, right: 0 }, sep, NodeData::Leaf { items: r, right })
        }
        NodeData::Interior { level, leftmost, mut items } => {
            let mut r = items.split_off(i);
            let (sep, rl) = r.remove(0);
            (NodeData::Interior { level, leftmost, items }, sep, NodeData::Interior { level, leftmost: rl, items: r })
        }
    }
}
