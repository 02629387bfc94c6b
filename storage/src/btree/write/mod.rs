//! The single writer of an arena's tree: the [`Writer`] type, its creation, its reads of its own
//! newest version, and its figures. What it does is split by concern:
//!
//! - `batch`: the write path: [`BatchOp`], key and value limits, preconditions, and a batch applied
//!   under one write version (all or nothing).
//! - `apply`: one operation: the path to its leaf, the log-append fast path, the leaf rewrite.
//! - `restructure`: node rewrites that change the tree's shape: split, node merge, root growth and
//!   collapse, propagated up the path.
//! - `space`: room for new bytes: a batch's worst case, memory reservation, and allocation of
//!   node ids, node buffers and blobs.
//! - `publish`: making changes visible: page-table entries and the command ring, the read version
//!   (a batch's commit, or deferred to the owner), superblock figures and table-set state.
//! - `reclaim`: retired buffers, blobs and node ids, the oldest version a reader may still use,
//!   and freeing what no reader can reach.

mod apply;
mod batch;
mod publish;
mod reclaim;
mod restructure;
mod space;

use std::cell::Cell;
use std::collections::VecDeque;
use std::fs::File;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub use batch::BatchOp;

use super::node::{Node, NodeData};
use super::read::Tree;
use super::{Entry, Reader, Stats};
use crate::arena::{
    Arena, LidAlloc, PageAlloc, SB_READ_VERSION, SB_ROOT, SB_STATE, SB_WRITE_VERSION, STATE_CLOSED, SlotWatch,
    root_word,
};
use crate::config::{ArenaConfig, NODE_HEADER, shortcut_capacity};
use crate::error::Result;
use reclaim::Garbage;

/// A node on the path from the root to a leaf: its id and the buffer it had when the operation
/// began.
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
        w.arena.sb(crate::arena::SB_NONCE).store(nonce(path), Ordering::Release);
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

    /// The path of the arena file.
    pub fn path(&self) -> &Path {
        &self.arena.path
    }

    /// A reader sharing this writer's mapping (for reader threads in this process).
    pub fn reader(&self) -> Result<Reader> {
        Reader::from_arena(self.arena.clone())
    }

    // --- reads of the newest version (the same code as a `Snapshot`'s, in `read`) --------------

    /// The tree at the writer's newest version.
    fn tree(&self) -> Tree<'_> {
        Tree::of_writer(self)
    }

    /// The current value of `key`.
    pub fn get(&self, key: &[u8]) -> Result<Option<&[u8]>> {
        self.tree().get(key)
    }

    /// The current entry of `key` as stored (value, pointer or tombstone).
    pub fn get_entry(&self, key: &[u8]) -> Result<Option<Entry<'_>>> {
        self.tree().get_entry(key)
    }

    /// The current entry of `key` with its version (see [`super::Snapshot::get_versioned`]).
    pub fn get_versioned(&self, key: &[u8]) -> Result<Option<(Entry<'_>, u64)>> {
        self.tree().get_versioned(key)
    }

    /// Calls `f` for up to `limit` current entries (tombstones included) with keys in `[lo, hi]`.
    pub fn scan_entries(&self, lo: &[u8], hi: &[u8], limit: usize, f: impl FnMut(&[u8], Entry<'_>)) -> Result<usize> {
        self.tree().scan_entries(lo, hi, limit, f)
    }

    /// The current entry with the largest key `<= key` (`< key` when `strict`), tombstones included.
    pub fn floor_entry(&self, key: &[u8], strict: bool) -> Result<Option<(&[u8], Entry<'_>)>> {
        self.tree().floor_entry(key, strict)
    }

    /// Separator keys inside `(lo, hi)` that cut it into parts of similar size (see
    /// [`crate::btree::Snapshot::pivots`]).
    pub fn pivots(&self, lo: &[u8], hi: &[u8], want: usize) -> Result<Vec<&[u8]>> {
        self.tree().pivots(lo, hi, want)
    }

    /// Items with keys in `[lo, hi]`, ascending, at most `limit`.
    pub fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&[u8], &[u8])>> {
        self.tree().scan(lo, hi, limit)
    }

    /// Like [`Writer::scan`] but starting at the largest key `<= lo`.
    pub fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&[u8], &[u8])>> {
        self.tree().floor_scan(lo, hi, limit)
    }

    // --- figures --------------------------------------------------------------------------------

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

/// A random arena nonce (not 0): the OS-seeded hasher keys, the time, the process and the path.
fn nonce(path: &Path) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.write(path.as_os_str().as_encoded_bytes());
    h.finish().max(1)
}
