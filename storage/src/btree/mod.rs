//! The Honeycomb B+tree: node format, wait-free MVCC readers, and the single writer.
//!
//! # Layout
//! - this module: [`Reader`] (a reader slot, and in device mode its page-table copy) and
//!   [`Snapshot`] (one pinned read version), the public [`Entry`], and the figures.
//! - `node`: the node format: header, shortcut block, sorted block, log block; checked decoding
//!   and the writer's encoding.
//! - `read`: `Tree`, wait-free reads of one version, and the one implementation of the
//!   read API that [`Snapshot`] and [`Writer`] both wrap.
//! - `cache`: a device reader's cache of interior nodes.
//! - `write`: the single [`Writer`], split by concern: `batch` (the write path), `apply` (one
//!   operation on its leaf), `restructure` (splits, merges, root changes), `space` (allocation),
//!   `publish` (page table, command ring, read version) and `reclaim` (retired memory).

mod cache;
mod node;
mod read;
mod write;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub use write::{BatchOp, Writer};

use crate::arena::{
    Arena, Layout, SB_ALLOCATED_PAGES, SB_GARBAGE_PAGES, SB_ROOT, SB_WRITE_VERSION, Slot, split_root_word,
};
use crate::error::Result;
use read::Tree;

/// Where a get may start instead of the root (Fat-B+Tree's start hint): node `lid` of the arena
/// whose nonce is `arena`, as it was at `version`, covering the keys in `[lo, hi)` (`hi` None:
/// unbounded). A reader uses it only if it is still valid for the key (`Tree::hinted`), else it
/// starts at the root: a stale hint costs a visit, never a wrong answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartHint<'h> {
    /// The arena's nonce.
    pub arena: u64,
    /// The node.
    pub lid: u64,
    /// The node's version the hint expects.
    pub version: u64,
    /// The node's lower fence (inclusive).
    pub lo: &'h [u8],
    /// The node's upper fence (exclusive; None: unbounded).
    pub hi: Option<&'h [u8]>,
}

/// A node of the top of a tree, as a fat root caches it: its id, version, level (0 = leaf) and
/// fences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopNode {
    /// The node.
    pub lid: u64,
    /// Its version.
    pub version: u64,
    /// Its level (0: a leaf).
    pub level: u8,
    /// Lower fence (inclusive).
    pub lo: Vec<u8>,
    /// Upper fence (exclusive; None: unbounded).
    pub hi: Option<Vec<u8>>,
}

/// A reader of one arena, usable from any process. Each reader owns a reader slot; use one per
/// thread (it is `Send` but not `Sync`). Every operation is wait-free.
///
/// In *device mode* ([`Reader::open_device`]) the reader keeps its own copy of the page table,
/// as Honeycomb's device does: it copies the table once and then applies the page-table changes
/// the writer publishes in the arena's command ring, draining the ring after pinning each read
/// version (so the copy covers everything the snapshot can see); if it falls a whole ring
/// behind, it copies the table again.
pub struct Reader {
    arena: Arc<Arena>,
    slot: Slot,
    /// The slot was revoked (the reclaimer judged us dead): claim a new one before the next pin.
    revoked: std::cell::Cell<bool>,
    pages: Option<PageCopy>,
    visits: std::cell::Cell<u64>,
    hints: std::cell::Cell<[u64; 2]>,
    snapshots: u64,
}

/// A device's copy of the page table, kept current through the command ring, and its
/// interior-node cache (invalidated by the same commands).
struct PageCopy {
    table: Vec<u64>,
    next: u64,
    resyncs: u64,
    applied: u64,
    cache: cache::NodeCache,
}

/// Bytes of interior-node copies a device reader keeps.
const NODE_CACHE_BYTES: usize = 32 << 20;

impl PageCopy {
    fn new(arena: &Arena) -> Result<PageCopy> {
        let mut p = PageCopy {
            table: Vec::new(),
            next: 0,
            resyncs: 0,
            applied: 0,
            cache: cache::NodeCache::new(NODE_CACHE_BYTES),
        };
        p.copy(arena)?;
        Ok(p)
    }

    /// Copies the whole table (entries read after the caller pinned its version are at least as
    /// new as the snapshot needs); commands published before the copy started are skipped.
    fn copy(&mut self, arena: &Arena) -> Result<()> {
        let head = arena.ring_head()?;
        let high = arena.load(crate::arena::SB_LID_HIGH, Ordering::Acquire).min(arena.layout.pt_entries);
        self.table.clear();
        self.table.resize(high.max(1) as usize, 0);
        for lid in 1..high {
            self.table[lid as usize] = arena.page_entry(lid, Ordering::Acquire)?;
        }
        self.next = head;
        self.resyncs += 1;
        self.cache.clear();
        Ok(())
    }

    /// Applies every published command (or copies the table again after an overrun). Called
    /// only while the reader holds a pin.
    #[allow(unsafe_code)]
    fn sync(&mut self, arena: &Arena) -> Result<()> {
        let limit = arena.layout.pt_entries as usize;
        let (table, applied, cache) = (&mut self.table, &mut self.applied, &mut self.cache);
        let (next, outcome) = arena.ring_drain(self.next, |lid, off| {
            let i = lid as usize;
            if i < limit {
                if i >= table.len() {
                    table.resize(i + 1, 0);
                }
                table[i] = off;
                cache.invalidate(lid);
                *applied += 1;
            }
        })?;
        self.next = next;
        if outcome == crate::arena::Drain::Overrun {
            self.copy(arena)?;
        }
        // SAFETY: `sync` runs right after the caller pinned a read version (see
        // `Reader::snapshot`), and the pin holds until the snapshot drops.
        unsafe { self.cache.fill(arena, &self.table) }
    }
}

/// Counters of a reader.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Snapshots taken (operations).
    pub snapshots: u64,
    /// Node buffers visited (page-table lookups and old-version steps).
    pub node_visits: u64,
    /// Device mode: page-table copies taken (the first, and one per ring overrun).
    pub resyncs: u64,
    /// Device mode: page-table changes applied from the command ring.
    pub commands: u64,
    /// Device mode: interior nodes found in the node cache.
    pub cache_hits: u64,
    /// Device mode: interior nodes read from host memory.
    pub cache_misses: u64,
    /// Descents that started where their start hint said.
    pub hinted: u64,
    /// Descents whose start hint was stale (they started at the root).
    pub hint_misses: u64,
}

impl Reader {
    /// Maps the arena at `path` read-only (its reader slots read-write) and claims a slot.
    /// A corrupt or truncated arena gives [`crate::Error::Corrupt`].
    pub fn open(path: impl AsRef<Path>) -> Result<Reader> {
        Reader::from_arena(Arc::new(Arena::open(path.as_ref())?))
    }

    /// Like [`Reader::open`], in device mode (its own page-table copy, fed by the command ring).
    pub fn open_device(path: impl AsRef<Path>) -> Result<Reader> {
        let mut r = Reader::open(path)?;
        r.pages = Some(PageCopy::new(&r.arena)?);
        Ok(r)
    }

    pub(crate) fn from_arena(arena: Arc<Arena>) -> Result<Reader> {
        let slot = arena.slots().claim()?;
        Ok(Reader {
            arena,
            slot,
            revoked: std::cell::Cell::new(false),
            pages: None,
            visits: std::cell::Cell::new(0),
            hints: std::cell::Cell::new([0; 2]),
            snapshots: 0,
        })
    }

    /// Another reader on the same mapping, with its own slot (for another thread), in the same
    /// mode.
    pub fn try_clone(&self) -> Result<Reader> {
        let mut r = Reader::from_arena(self.arena.clone())?;
        if self.pages.is_some() {
            r.pages = Some(PageCopy::new(&r.arena)?);
        }
        Ok(r)
    }

    /// Pins the current read version: everything read through the snapshot is exactly the state
    /// after that write version. If the reclaimer took this reader's slot (it judged the reader
    /// dead, see `arena::slots`), a new slot is claimed first.
    #[allow(unsafe_code)]
    pub fn snapshot(&mut self) -> Result<Snapshot<'_>> {
        let (rv, pinned) = loop {
            if self.revoked.get() {
                self.slot = self.arena.slots().claim()?;
                self.revoked.set(false);
            }
            match self.arena.pin(&self.slot)? {
                Some(p) => break p,
                None => self.revoked.set(true),
            }
        };
        if let Some(p) = &mut self.pages {
            // After the pin: the copy then covers every page-table change the snapshot can see.
            if let Err(e) = p.sync(&self.arena) {
                if !self.arena.slots().unpin(&self.slot, pinned) {
                    self.revoked.set(true);
                }
                return Err(e);
            }
        }
        self.snapshots += 1;
        // SAFETY: `rv` is pinned in our slot until the snapshot drops (it unpins), so everything
        // published at or before it stays immutable while the tree is used (arena::shm rule 1).
        let tree = unsafe { Tree::pinned(&self.arena, rv) }.with_device(
            self.pages.as_ref().map(|p| (p.table.as_slice(), &p.cache)),
            &self.visits,
            &self.hints,
        );
        Ok(Snapshot { tree, slot: &self.slot, pinned, revoked: &self.revoked })
    }

    /// The reader's counters.
    pub fn stats(&self) -> ReadStats {
        ReadStats {
            snapshots: self.snapshots,
            node_visits: self.visits.get(),
            resyncs: self.pages.as_ref().map_or(0, |p| p.resyncs),
            commands: self.pages.as_ref().map_or(0, |p| p.applied),
            cache_hits: self.pages.as_ref().map_or(0, |p| p.cache.hits.get()),
            cache_misses: self.pages.as_ref().map_or(0, |p| p.cache.misses.get()),
            hinted: self.hints.get()[0],
            hint_misses: self.hints.get()[1],
        }
    }

    /// The arena's geometry (node size, generation, ...).
    pub fn layout(&self) -> Layout {
        self.arena.layout
    }

    /// The region's table-set generation recorded in this arena, and whether the arena is frozen
    /// (one atomic load each: cheap enough to check on every operation).
    pub fn tables_state(&self) -> (u64, bool) {
        let a = &self.arena;
        (
            a.load(crate::arena::SB_TABLES_GEN, Ordering::Acquire),
            a.load(crate::arena::SB_STATE, Ordering::Acquire) == crate::arena::STATE_FROZEN,
        )
    }

    /// Figures the writer publishes in the superblock.
    pub fn shared_stats(&self) -> SharedStats {
        let a = &self.arena;
        let ns = a.layout.node_size as u64;
        SharedStats {
            write_version: a.load(SB_WRITE_VERSION, Ordering::Relaxed),
            height: split_root_word(a.load(SB_ROOT, Ordering::Relaxed)).1,
            allocated_bytes: a.load(SB_ALLOCATED_PAGES, Ordering::Relaxed) * ns,
            garbage_bytes: a.load(SB_GARBAGE_PAGES, Ordering::Relaxed) * ns,
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if !self.revoked.get() {
            self.arena.slots().release(&self.slot);
        }
    }
}

/// One pinned read version. Keys and values borrow from the snapshot: they cannot outlive it
/// (after it drops, the writer may reuse their memory), which the borrow checker enforces.
///
/// Every method checks, after reading, that the pin still holds: a reader that stalled so long
/// that the reclaimer judged it dead (a foreign pid namespace past its lease) gets
/// [`crate::Error::ReaderRevoked`] instead of what it read, and its next snapshot re-pins.
pub struct Snapshot<'r> {
    tree: Tree<'r>,
    slot: &'r Slot,
    pinned: u64,
    revoked: &'r std::cell::Cell<bool>,
}

impl Snapshot<'_> {
    /// The read version this snapshot sees.
    pub fn version(&self) -> u64 {
        self.tree.rv
    }

    /// `r`, if the pin still holds.
    fn checked<T>(&self, r: Result<T>) -> Result<T> {
        if self.tree.arena.slots().still_pinned(self.slot, self.pinned) {
            r
        } else {
            self.revoked.set(true);
            Err(crate::Error::ReaderRevoked)
        }
    }

    /// Whether the pin still holds (what was read under it is valid).
    pub fn valid(&self) -> bool {
        self.checked(Ok(())).is_ok()
    }

    /// The value of `key`, if present. In an arena whose values live in a value log, use
    /// [`Snapshot::get_entry`].
    pub fn get<'s>(&'s self, key: &[u8]) -> Result<Option<&'s [u8]>> {
        self.checked(self.tree.get(key))
    }

    /// The entry of `key` as stored: a value, a pointer into the value log, or a tombstone.
    pub fn get_entry<'s>(&'s self, key: &[u8]) -> Result<Option<Entry<'s>>> {
        self.checked(self.tree.get_entry(key))
    }

    /// Like [`Snapshot::get_entry`], with the entry's version: the write version of a log
    /// entry, or for an item of a sorted block the version of its node (Honeycomb's MVCC keeps
    /// one version per sorted block), so at least the version that wrote the value and at most
    /// the snapshot's.
    pub fn get_versioned<'s>(&'s self, key: &[u8]) -> Result<Option<(Entry<'s>, u64)>> {
        self.checked(self.tree.get_versioned(key))
    }

    /// Like [`Snapshot::get_versioned`], starting where `hint` says if it is still valid (else at
    /// the root); also answers whether it was used.
    pub fn get_versioned_hinted<'s>(
        &'s self,
        key: &[u8],
        hint: &StartHint<'_>,
    ) -> Result<(Option<(Entry<'s>, u64)>, bool)> {
        self.checked(self.tree.get_versioned_hinted(key, hint))
    }

    /// The arena's nonce (what start hints name it by).
    pub fn arena_nonce(&self) -> u64 {
        self.tree.nonce()
    }

    /// The children of `nodes` still current (the root itself when `nodes` is empty), each with
    /// its parent's index: see `Tree::expand`.
    pub fn expand(&self, nodes: &[TopNode]) -> Result<Vec<(usize, TopNode)>> {
        self.checked(self.tree.expand(nodes))
    }

    /// Calls `f` for up to `limit` entries (tombstones included) with keys in `[lo, hi]`.
    pub fn scan_entries<'s>(
        &'s self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        f: impl FnMut(&'s [u8], Entry<'s>),
    ) -> Result<usize> {
        self.checked(self.view().scan_entries(lo, hi, limit, f))
    }

    /// [`Snapshot::scan_entries`], the descent starting where `hint` says if it is valid for
    /// `lo` (else at the root).
    pub fn scan_entries_hinted<'s>(
        &'s self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        hint: &StartHint<'_>,
        f: impl FnMut(&'s [u8], Entry<'s>),
    ) -> Result<usize> {
        self.checked(self.tree.scan_entries_from(lo, hi, limit, Some(hint), f))
    }

    /// The entry with the largest key `<= key` (`< key` when `strict`), tombstones included.
    pub fn floor_entry<'s>(&'s self, key: &[u8], strict: bool) -> Result<Option<(&'s [u8], Entry<'s>)>> {
        self.checked(self.tree.floor_entry(key, strict))
    }

    /// Up to `limit` items with keys in `[lo, hi]`, ascending.
    pub fn scan<'s>(&'s self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&'s [u8], &'s [u8])>> {
        self.checked(self.tree.scan(lo, hi, limit))
    }

    /// Separator keys inside `(lo, hi)` that cut it into parts of similar size (see
    /// `Tree::pivots`): about `want` of them, or fewer in a small tree.
    pub fn pivots<'s>(&'s self, lo: &[u8], hi: &[u8], want: usize) -> Result<Vec<&'s [u8]>> {
        self.checked(self.tree.pivots(lo, hi, want))
    }

    /// Calls `f` for up to `limit` items with keys in `[lo, hi]`, ascending; returns the count.
    pub fn scan_with<'s>(
        &'s self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        f: impl FnMut(&'s [u8], &'s [u8]),
    ) -> Result<usize> {
        self.checked(self.view().scan_with(lo, hi, limit, f))
    }

    /// Honeycomb's SCAN: like [`Snapshot::scan`] but starting at the largest key `<= lo`.
    pub fn floor_scan<'s>(&'s self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&'s [u8], &'s [u8])>> {
        self.checked(self.tree.floor_scan(lo, hi, limit))
    }

    /// The tree, reading for no longer than this borrow of the snapshot (what it reads borrows
    /// the snapshot, not the reader: callbacks that take `'s` items fit).
    fn view<'s>(&'s self) -> Tree<'s> {
        self.tree
    }
}

impl Drop for Snapshot<'_> {
    fn drop(&mut self) {
        if !self.tree.arena.slots().unpin(self.slot, self.pinned) {
            self.revoked.set(true);
        }
    }
}

/// A stored entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry<'a> {
    /// The value's bytes (inline, or an arena blob).
    Value(&'a [u8]),
    /// A value of `len` bytes in the value log at `ptr`.
    Pointer {
        /// The value-log position.
        ptr: u64,
        /// Value length.
        len: u32,
    },
    /// The key is deleted (kept so it hides older levels).
    Tombstone,
}

/// Publishes an arena's read version from another thread (the value log's flusher, once the
/// batches up to that version are durable). Only versions the writer has applied may be
/// published; the region guarantees it by publishing what its log has synced.
#[derive(Clone)]
pub(crate) struct ReadPublisher(pub(crate) Arc<Arena>);

impl ReadPublisher {
    /// Readers see every version up to `version` from now on (the read version never goes back).
    pub(crate) fn publish(&self, version: u64) {
        self.0.sb(crate::arena::SB_READ_VERSION).fetch_max(version, Ordering::SeqCst);
    }
}

/// Figures from the writer.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    /// Newest released write version.
    pub version: u64,
    /// Tree height in levels (1 = a single leaf).
    pub height: u16,
    /// Node size.
    pub node_size: u32,
    /// Arena file size (sparse).
    pub capacity: u64,
    /// Heap bytes allocated (nodes, old versions not yet reclaimed, blobs).
    pub allocated_bytes: u64,
    /// Of those, bytes retired and waiting for readers to move on.
    pub garbage_bytes: u64,
    /// Retired objects waiting.
    pub pending_garbage: usize,
    /// Reader slots found dead and cleared.
    pub dead_slots_cleared: u64,
    /// Bytes of the arena in use: metadata up to the page table, the used page-table prefix and
    /// the allocated heap.
    pub footprint_bytes: u64,
}

/// Figures any reader can see in the superblock.
#[derive(Debug, Clone, Copy)]
pub struct SharedStats {
    /// Newest write version taken.
    pub write_version: u64,
    /// Tree height.
    pub height: u16,
    /// Heap bytes allocated.
    pub allocated_bytes: u64,
    /// Heap bytes retired, awaiting reclamation.
    pub garbage_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ArenaConfig;

    /// Issue 8, item 2.6: invalidated node-cache entries used to stay in its insertion queue,
    /// which then grew with every invalidation. The queue stays within twice the live entries.
    #[test]
    fn the_node_cache_queue_stays_bounded_under_invalidations() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.arena");
        let mut w = Writer::create(&path, &ArenaConfig::small_nodes(512)).expect("writer");
        for i in 0..3000u32 {
            w.put(format!("key{i:06}").as_bytes(), b"value").expect("put");
        }
        let mut r = Reader::open_device(&path).expect("device reader");
        for round in 0..200u32 {
            for i in (0..3000u32).step_by(97) {
                let k = format!("key{:06}", (i + round) % 3000);
                r.snapshot().expect("snapshot").get(k.as_bytes()).expect("get");
            }
            // Splits and merges rewrite interior nodes: their cached copies are invalidated.
            for i in 0..40u32 {
                let k = format!("key{:06}x{round}", (i * 71 + round * 13) % 3000);
                w.put(k.as_bytes(), b"v").expect("put");
            }
        }
        let cache = &r.pages.as_ref().expect("device mode").cache;
        assert!(cache.misses.get() > 200, "the cache was refilled after invalidations");
        let (queue, live) = cache.queue_len();
        assert!(queue <= 2 * live + 64, "queue {queue} for {live} entries");
    }
}
