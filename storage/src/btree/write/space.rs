//! Room for new bytes: the worst case a batch may take, heap pages backed by memory ahead of
//! use, and allocation of node ids, node buffers and value blobs. Nothing allocated here is
//! visible to readers until `publish` maps it.

use std::sync::atomic::Ordering;

use super::Writer;
use crate::arena::SB_LID_HIGH;
use crate::btree::node::{BLOB_HDR, NodeData, Val};
use crate::error::{Error, Result};

/// Heap pages reserved at a time (8 MiB of 8 KiB nodes).
const RESERVE_CHUNK_PAGES: u64 = 1024;

impl Writer {
    /// Whether `ops` more operations (without blobs) are sure to fit: the worst case of
    /// [`Writer::write_batch_at`], after reclaiming what can be reclaimed, with the pages backed
    /// by memory now (so a caller that logs a batch before applying it never finds the memory
    /// gone afterwards: a full tmpfs says no here).
    pub fn fits(&mut self, ops: usize) -> bool {
        let (pages, lids) = self.worst_case(ops as u64, 0);
        if self.pages.free() < pages || self.lids.free() < lids {
            self.reclaim_quietly();
            if self.pages.free() < pages || self.lids.free() < lids {
                return false;
            }
        }
        self.reserve(pages).is_ok()
    }

    /// Heap pages and node ids `ops` operations may take at worst (every op rewrites and splits
    /// every level, plus a new root), plus `blob_pages`.
    pub(super) fn worst_case(&self, ops: u64, blob_pages: u64) -> (u64, u64) {
        (ops * (2 * (self.height as u64 + 1) + 4) + blob_pages, ops * (self.height as u64 + 2))
    }

    /// Backs the heap pages a batch may take with memory (`fallocate` of the arena file), so a
    /// full tmpfs or memory limit gives [`Error::ArenaFull`] here instead of SIGBUS later.
    pub(super) fn reserve(&mut self, pages: u64) -> Result<()> {
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

    /// A fresh node id (readers learn the page table's new high-water mark).
    pub(super) fn alloc_lid(&mut self) -> Result<u64> {
        let lid = self.lids.alloc().ok_or(Error::ArenaFull { needed: 8, free: 0 })?;
        self.arena.sb(SB_LID_HIGH).store(self.lids.high_water(), Ordering::Release);
        Ok(lid)
    }

    /// Encodes `data` as node `lid` at version `w`, its previous buffer at `prev`, into a fresh page.
    pub(super) fn write_node(&mut self, lid: u64, data: &NodeData, w: u64, prev: u64) -> Result<u64> {
        let mut buf = std::mem::take(&mut self.buf);
        data.encode(self.arena.layout.node_size, lid, w, prev, &mut buf);
        let r = self.write_image(&buf);
        self.buf = buf;
        r
    }

    /// Allocates a page and writes a node image into it.
    #[allow(unsafe_code)]
    pub(super) fn write_image(&mut self, image: &[u8]) -> Result<u64> {
        let ns = self.arena.layout.node_size as u64;
        let off = self.pages.alloc(1).ok_or(Error::ArenaFull { needed: ns, free: 0 })?;
        // SAFETY: a page fresh from the allocator, which hands out only pages no pinned reader
        // can reach (never used, or reclaimed once every pin was past their retirement).
        unsafe { self.arena.map.write(off, image) }?;
        Ok(off)
    }

    /// Writes a value too long to be inline into a fresh run of pages: its blob.
    #[allow(unsafe_code)]
    pub(super) fn write_blob(&mut self, v: &[u8]) -> Result<Val> {
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

    /// Gives back the pages of a blob written for a batch that then failed (never published).
    pub(super) fn free_blob(&mut self, b: &Val) {
        if let Val::Blob { off, len } = b {
            let n = (BLOB_HDR + *len as u64).div_ceil(self.arena.layout.node_size as u64);
            self.pages.release(*off, n);
        }
    }
}
