//! The host-memory arena: a file mapped by one writer and many readers, holding the superblock,
//! reader slots, command ring, page table and the heap of node buffers and value blobs.
//!
//! # Layout
//! - `shm`: the mapping (the only module with `unsafe` code of its own; [`Mapping::bytes`] and
//!   [`Mapping::write`] are `unsafe fn`s whose few callers state why the protocol holds);
//!   `layout`: the superblock; `slots`: reader slots, generation-checked, and dead-reader
//!   detection; `ring`: the command ring; `alloc`: the writer's allocators.

mod alloc;
mod layout;
mod ring;
mod shm;
mod slots;

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering, fence};

pub(crate) use alloc::{LidAlloc, PageAlloc};
pub use layout::Layout;
pub(crate) use layout::{
    PT_RETIRED, SB_ALLOCATED_PAGES, SB_GARBAGE_PAGES, SB_LID_HIGH, SB_NONCE, SB_READ_VERSION, SB_ROOT, SB_STATE,
    SB_TABLES_GEN, SB_WRITE_VERSION, SB_WRITER_PID, STATE_CLOSED, STATE_FROZEN, STATE_READY, root_word,
    split_root_word,
};
use layout::{SB_FIXED, SLOT_SIZE};
pub(crate) use ring::Drain;
pub(crate) use shm::{Mapping, map_immutable};
pub(crate) use slots::{Slot, SlotTable, SlotWatch};

use crate::config::ArenaConfig;
use crate::error::{Error, Result};

/// Backs `[from, to)` of an arena file with memory (`fallocate`), so that touching those pages
/// later cannot fail with SIGBUS on a full tmpfs. A file system without `fallocate` keeps the file
/// sparse (nothing to reserve then).
pub(crate) fn reserve_memory(file: &File, from: u64, to: u64) -> std::io::Result<()> {
    if to <= from {
        return Ok(());
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::KEEP_SIZE, from, to - from) {
        Ok(()) | Err(rustix::io::Errno::OPNOTSUPP) | Err(rustix::io::Errno::NOSYS) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A mapped arena plus its validated layout.
pub(crate) struct Arena {
    pub(crate) map: Mapping,
    pub(crate) layout: Layout,
    pub(crate) path: PathBuf,
}

impl Arena {
    /// Creates a fresh arena beside `path` under a temporary name and returns it with the open,
    /// exclusively locked file and that name; [`Arena::publish`] renames it into place.
    #[allow(unsafe_code)]
    pub(crate) fn create(path: &Path, cfg: &ArenaConfig) -> Result<(Arena, File, PathBuf)> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64);
        let generation = nanos.unwrap_or(0) ^ (std::process::id() as u64).rotate_left(40);
        let layout = Layout::plan(cfg, generation)?;
        // One writer per tree: refuse to replace an arena whose writer is still alive.
        if let Ok(existing) = File::open(path)
            && existing.try_lock().is_err()
        {
            return Err(Error::WriterBusy(path.to_path_buf()));
        }
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| Error::io(&tmp, e))?;
        file.try_lock().map_err(|_| Error::WriterBusy(path.to_path_buf()))?;
        file.set_len(layout.capacity).map_err(|e| Error::io(&tmp, e))?;
        let map = Mapping::map_rw(&file, layout.capacity, &tmp)?;
        // SAFETY: the file is new and still under its temporary name: no one else maps it.
        unsafe { map.write(0, &layout.encode()) }?;
        map.word(SB_WRITER_PID)?.store(std::process::id() as u64, Ordering::Relaxed);
        let arena = Arena { map, layout, path: path.to_path_buf() };
        Ok((arena, file, tmp))
    }

    /// Publishes a freshly initialized arena under its final name.
    pub(crate) fn publish(&self, file_tmp: &Path) -> Result<()> {
        self.sb(SB_STATE).store(STATE_READY, Ordering::Release);
        std::fs::rename(file_tmp, &self.path).map_err(|e| Error::io(&self.path, e))
    }

    /// Opens an existing arena as a reader: validates the superblock, maps the file read-only and
    /// its reader slots read-write.
    pub(crate) fn open(path: &Path) -> Result<Arena> {
        let mut file = OpenOptions::new().read(true).write(true).open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut head = [0u8; SB_FIXED + 4];
        if len < head.len() as u64 {
            return Err(Error::corrupt(0, "arena shorter than its superblock"));
        }
        file.read_exact(&mut head).map_err(|e| Error::io(path, e))?;
        let layout = Layout::decode(&head, len)?;
        let slots_len = (layout.slots_count as u64 * SLOT_SIZE).div_ceil(4096) * 4096;
        let map = Mapping::map_ro(&file, len, layout.slots_off, slots_len, path)?;
        let arena = Arena { map, layout, path: path.to_path_buf() };
        let state = arena.load(SB_STATE, Ordering::Acquire);
        if state != STATE_READY && state != STATE_CLOSED && state != STATE_FROZEN {
            return Err(Error::corrupt(SB_STATE, "arena was not completely initialized"));
        }
        Ok(arena)
    }

    /// A superblock word to store to (the writer's mapping; its offset is a constant inside the
    /// validated superblock page).
    #[inline]
    pub(crate) fn sb(&self, off: u64) -> &AtomicU64 {
        self.map.word(off).expect("the writer's mapping holds the superblock page of every valid arena")
    }

    /// Loads a superblock word (any mapping; see [`Mapping::load`]).
    #[inline]
    pub(crate) fn load(&self, off: u64, order: Ordering) -> u64 {
        self.map.load(off, order).expect("superblock words lie in the first page, which every valid arena has")
    }

    /// Loads the page-table entry of `lid`.
    #[inline]
    pub(crate) fn page_entry(&self, lid: u64, order: Ordering) -> Result<u64> {
        self.map.load(self.layout.pt_entry(lid)?, order)
    }

    /// The page-table entry of `lid` to store to (the writer).
    #[inline]
    pub(crate) fn page_entry_word(&self, lid: u64) -> Result<&AtomicU64> {
        self.map.word(self.layout.pt_entry(lid)?)
    }

    /// The arena's reader slots.
    pub(crate) fn slots(&self) -> SlotTable<'_> {
        SlotTable { map: &self.map, off: self.layout.slots_off, count: self.layout.slots_count }
    }

    /// Pins the current read version in `slot`; returns (read version, the value the slot holds),
    /// or None if the slot was revoked. Wait-free: a compare-and-swap, a fence, two loads.
    #[inline]
    pub(crate) fn pin(&self, slot: &Slot) -> Result<Option<(u64, u64)>> {
        let guess = self.load(SB_READ_VERSION, Ordering::Relaxed);
        if !self.slots().pin(slot, guess)? {
            return Ok(None);
        }
        // Dekker-style handshake with the reclaimer (`SlotWatch::min_pinned`): either it sees our
        // pin, or we see every version it saw before scanning (so we never reach what it frees).
        fence(Ordering::SeqCst);
        Ok(Some((self.load(SB_READ_VERSION, Ordering::Acquire), guess)))
    }
}
