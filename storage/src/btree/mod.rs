//! The Honeycomb B+tree: node format, wait-free MVCC readers, and the single writer.

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
    pages: Option<PageCopy>,
    visits: std::cell::Cell<u64>,
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
        let high = arena.sb(crate::arena::SB_LID_HIGH).load(Ordering::Acquire).min(arena.layout.pt_entries);
        self.table.clear();
        self.table.resize(high.max(1) as usize, 0);
        for lid in 1..high {
            self.table[lid as usize] = arena.page_entry(lid)?.load(Ordering::Acquire);
        }
        self.next = head;
        self.resyncs += 1;
        self.cache.clear();
        Ok(())
    }

    /// Applies every published command (or copies the table again after an overrun).
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
        self.cache.fill(arena, &self.table)
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
        let slot = arena.claim_slot()?;
        Ok(Reader { arena, slot, pages: None, visits: std::cell::Cell::new(0), snapshots: 0 })
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
    /// after that write version.
    pub fn snapshot(&mut self) -> Result<Snapshot<'_>> {
        let rv = self.arena.pin(&self.slot)?;
        if let Some(p) = &mut self.pages {
            // After the pin: the copy then covers every page-table change the snapshot can see.
            if let Err(e) = p.sync(&self.arena) {
                self.arena.unpin(&self.slot);
                return Err(e);
            }
        }
        self.snapshots += 1;
        let tree = Tree {
            arena: &self.arena,
            rv,
            pages: self.pages.as_ref().map(|p| p.table.as_slice()),
            cache: self.pages.as_ref().map(|p| &p.cache),
            visits: Some(&self.visits),
        };
        Ok(Snapshot { tree, slot: &self.slot })
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
            a.sb(crate::arena::SB_TABLES_GEN).load(Ordering::Acquire),
            a.sb(crate::arena::SB_STATE).load(Ordering::Acquire) == crate::arena::STATE_FROZEN,
        )
    }

    /// Figures the writer publishes in the superblock.
    pub fn shared_stats(&self) -> SharedStats {
        let a = &self.arena;
        let ns = a.layout.node_size as u64;
        SharedStats {
            write_version: a.sb(SB_WRITE_VERSION).load(Ordering::Relaxed),
            height: split_root_word(a.sb(SB_ROOT).load(Ordering::Relaxed)).1,
            allocated_bytes: a.sb(SB_ALLOCATED_PAGES).load(Ordering::Relaxed) * ns,
            garbage_bytes: a.sb(SB_GARBAGE_PAGES).load(Ordering::Relaxed) * ns,
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.arena.release_slot(&self.slot);
    }
}

/// One pinned read version. Values and keys borrow the arena for the snapshot's lifetime; they
/// cannot be reclaimed while it lives.
pub struct Snapshot<'r> {
    tree: Tree<'r>,
    slot: &'r Slot,
}

impl<'r> Snapshot<'r> {
    /// The read version this snapshot sees.
    pub fn version(&self) -> u64 {
        self.tree.rv
    }

    /// The value of `key`, if present. In an arena whose values live in a value log, use
    /// [`Snapshot::get_entry`].
    pub fn get(&self, key: &[u8]) -> Result<Option<&'r [u8]>> {
        self.tree.get(key)
    }

    /// The entry of `key` as stored: a value, a pointer into the value log, or a tombstone.
    pub fn get_entry(&self, key: &[u8]) -> Result<Option<Entry<'r>>> {
        Ok(self.get_versioned(key)?.map(|(e, _)| e))
    }

    /// Like [`Snapshot::get_entry`], with the entry's version: the write version of a log
    /// entry, or for an item of a sorted block the version of its node (Honeycomb's MVCC keeps
    /// one version per sorted block), so at least the version that wrote the value and at most
    /// the snapshot's.
    pub fn get_versioned(&self, key: &[u8]) -> Result<Option<(Entry<'r>, u64)>> {
        self.tree.get_versioned(key)
    }

    /// Calls `f` for up to `limit` entries (tombstones included) with keys in `[lo, hi]`.
    pub fn scan_entries(
        &self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        mut f: impl FnMut(&'r [u8], Entry<'r>),
    ) -> Result<usize> {
        let arena = self.tree.arena;
        self.tree.scan_entries(lo, hi, limit, true, |k, v| {
            f(k, Entry::from_ref(arena, v)?);
            Ok(())
        })
    }

    /// The entry with the largest key `<= key` (`< key` when `strict`), tombstones included.
    pub fn floor_entry(&self, key: &[u8], strict: bool) -> Result<Option<(&'r [u8], Entry<'r>)>> {
        match self.tree.floor_entry(key, strict, true)? {
            Some((k, v)) => Ok(Some((k, Entry::from_ref(self.tree.arena, v)?))),
            None => Ok(None),
        }
    }

    /// Up to `limit` items with keys in `[lo, hi]`, ascending.
    pub fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&'r [u8], &'r [u8])>> {
        let mut out = Vec::with_capacity(limit.min(1024));
        self.tree.scan(lo, hi, limit, |k, v| {
            out.push((k, v));
            Ok(())
        })?;
        Ok(out)
    }

    /// Calls `f` for up to `limit` items with keys in `[lo, hi]`, ascending; returns the count.
    pub fn scan_with(&self, lo: &[u8], hi: &[u8], limit: usize, f: impl FnMut(&'r [u8], &'r [u8])) -> Result<usize> {
        let mut f = f;
        self.tree.scan(lo, hi, limit, |k, v| {
            f(k, v);
            Ok(())
        })
    }

    /// Honeycomb's SCAN: like [`Snapshot::scan`] but starting at the largest key `<= lo`.
    pub fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&'r [u8], &'r [u8])>> {
        let mut out = Vec::new();
        self.tree.floor_scan(lo, hi, limit, |k, v| {
            out.push((k, v));
            Ok(())
        })?;
        Ok(out)
    }
}

impl Drop for Snapshot<'_> {
    fn drop(&mut self) {
        self.tree.arena.unpin(self.slot);
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

impl<'a> Entry<'a> {
    pub(crate) fn from_ref(arena: &'a Arena, v: node::ValRef<'a>) -> Result<Entry<'a>> {
        Ok(match v {
            node::ValRef::Ext { ptr, len } => Entry::Pointer { ptr, len },
            node::ValRef::Tombstone => Entry::Tombstone,
            v => Entry::Value(node::value_bytes(arena, v)?),
        })
    }
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
