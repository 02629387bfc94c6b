//! The device's interior-node cache (Honeycomb §4.4: the FPGA caches interior nodes in on-board
//! memory). Device-mode readers keep copies of interior nodes' newest buffers, keyed by LID and
//! checked against the buffer offset in their page-table copy; a page-table change arriving
//! through the command ring invalidates the LID's copy. Copies are only made between operations
//! (from the misses an operation recorded, once the next operation's pin and ring drain show the
//! buffer is still current), so an operation only ever reads the cache. Bounded in bytes, FIFO.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};

use super::node::{Header, KIND_INTERIOR, Node};
use crate::arena::Arena;
use crate::error::Result;

/// Misses remembered per operation.
const MAX_PENDING: usize = 64;

pub(crate) struct NodeCache {
    map: HashMap<u64, (u64, Box<[u8]>)>,
    /// Insertion order: (LID, buffer offset). An entry whose LID was invalidated (or refilled with
    /// another buffer) is stale and skipped; the queue is compacted when stale entries dominate,
    /// so it never holds more than twice the live entries (plus a small slack).
    fifo: VecDeque<(u64, u64)>,
    bytes: usize,
    cap: usize,
    pub(crate) hits: Cell<u64>,
    pub(crate) misses: Cell<u64>,
    pending: RefCell<Vec<(u64, u64)>>,
}

impl NodeCache {
    pub(crate) fn new(cap: usize) -> NodeCache {
        NodeCache {
            map: HashMap::new(),
            fifo: VecDeque::new(),
            bytes: 0,
            cap,
            hits: Cell::new(0),
            misses: Cell::new(0),
            pending: RefCell::new(Vec::new()),
        }
    }

    /// The copy of `lid`'s buffer at `off`, if cached.
    #[inline]
    pub(crate) fn get(&self, lid: u64, off: u64) -> Option<&[u8]> {
        self.map.get(&lid).filter(|e| e.0 == off).map(|e| &*e.1)
    }

    pub(crate) fn hit(&self) {
        self.hits.set(self.hits.get() + 1);
    }

    /// An interior node read from host memory: copy it after this operation.
    pub(crate) fn miss(&self, lid: u64, off: u64) {
        self.misses.set(self.misses.get() + 1);
        let mut p = self.pending.borrow_mut();
        if p.len() < MAX_PENDING {
            p.push((lid, off));
        }
    }

    /// The LID's buffer changed (a command from the ring).
    pub(crate) fn invalidate(&mut self, lid: u64) {
        if let Some((_, image)) = self.map.remove(&lid) {
            self.bytes -= image.len();
        }
    }

    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.fifo.clear();
        self.bytes = 0;
        self.pending.borrow_mut().clear();
    }

    /// Copies the buffers the last operation missed, if the page-table copy (drained after this
    /// operation's pin) still names them: then they are current, and cannot be reclaimed under us.
    ///
    /// # Safety
    /// The caller has pinned a read version in the arena (the page-table copy covers it) and
    /// holds the pin while this runs.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn fill(&mut self, arena: &Arena, table: &[u64]) -> Result<()> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        for (lid, off) in pending {
            if table.get(lid as usize) != Some(&off) || self.map.contains_key(&lid) {
                continue;
            }
            // SAFETY: `off` is the current buffer of `lid` in the page-table copy drained under
            // the caller's pin, so it is published and cannot be reclaimed while the pin holds.
            let h = unsafe { Header::read(arena, off) }?;
            if h.kind != KIND_INTERIOR || h.lid != lid {
                continue;
            }
            // SAFETY: as above.
            let image = unsafe { Node::image(arena, &h) }?.into_boxed_slice();
            self.bytes += image.len();
            self.map.insert(lid, (off, image));
            self.fifo.push_back((lid, off));
            while self.bytes > self.cap {
                let Some((old, old_off)) = self.fifo.pop_front() else { break };
                if self.map.get(&old).is_some_and(|e| e.0 == old_off) {
                    self.invalidate(old);
                }
            }
            if self.fifo.len() > 2 * self.map.len() + 64 {
                let map = &self.map;
                self.fifo.retain(|(l, o)| map.get(l).is_some_and(|e| e.0 == *o));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
impl NodeCache {
    /// Entries in the insertion queue (live and stale), and live entries.
    pub(crate) fn queue_len(&self) -> (usize, usize) {
        (self.fifo.len(), self.map.len())
    }
}
