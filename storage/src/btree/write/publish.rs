//! Making the writer's changes visible: a node's new buffer through its page-table entry and the
//! command ring (the device's copy of the table), a batch through the global read version (at
//! commit, or later by the owner through a [`ReadPublisher`]), and the figures and
//! table-set state readers find in the superblock.

use std::sync::atomic::Ordering;

use super::Writer;
use crate::arena::{SB_ALLOCATED_PAGES, SB_GARBAGE_PAGES, SB_READ_VERSION, SB_STATE, SB_TABLES_GEN, STATE_FROZEN};
use crate::btree::ReadPublisher;
use crate::error::Result;

impl Writer {
    /// Points `lid` at `off` in the page table and tells the device through the command ring.
    pub(super) fn map_lid(&mut self, lid: u64, off: u64) -> Result<()> {
        self.arena.page_entry_word(lid)?.store(off, Ordering::Release);
        self.arena.ring_push(self.ring_seq, lid, off)?;
        self.ring_seq += 1;
        Ok(())
    }

    /// Ends a batch: its version becomes the writer's and (unless deferred) the readers'. Cannot
    /// fail: the batch is applied, whatever reclamation finds.
    pub(super) fn commit(&mut self, w: u64) {
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

    /// Publishes read versions from outside the writer (see [`Writer::set_deferred_publish`]).
    pub(crate) fn publisher(&self) -> ReadPublisher {
        ReadPublisher(self.arena.clone())
    }

    /// With `deferred`, commits stop publishing the read version: readers keep seeing the last
    /// published state until the owner publishes newer versions through [`Writer::publisher`]
    /// (a region does once the batches are durable). The writer's own reads see everything.
    pub(crate) fn set_deferred_publish(&mut self, deferred: bool) {
        self.deferred_publish = deferred;
    }

    /// Marks the arena frozen (it takes no more writes; readers should move to the next one) and
    /// records the generation of the region's table set in its superblock.
    pub fn set_tables_generation(&self, generation: u64, frozen: bool) {
        self.arena.sb(SB_TABLES_GEN).store(generation, Ordering::Release);
        if frozen {
            self.arena.sb(SB_STATE).store(STATE_FROZEN, Ordering::Release);
        }
    }

    /// Publishes the heap figures readers see in the superblock ([`crate::SharedStats`]).
    pub(super) fn publish_stats(&self) {
        self.arena.sb(SB_ALLOCATED_PAGES).store(self.pages.used(), Ordering::Relaxed);
        self.arena.sb(SB_GARBAGE_PAGES).store(self.garbage_pages, Ordering::Relaxed);
    }
}
