//! The only module that touches shared memory: mapping the arena file and bounds-checked access.
//!
//! # Safety contract
//!
//! The arena is a file mapped `MAP_SHARED` by one writer (read-write) and by readers in any process
//! (read-only, plus a read-write mapping of the reader-slot pages only). The arena protocol
//! (docs/storage-format.md, "Invariants") is what makes access sound:
//!
//! 1. **Published bytes are immutable while pinned.** A node buffer or blob that a reader may
//!    reach is never written again until reclamation proves no pinned reader can reach it. New
//!    bytes are written into unpublished space and published by a release store (page-table
//!    entry, a node's size word, the global read version). This module cannot check it: handing
//!    out a `&[u8]` of shared memory ([`Mapping::bytes`]) and writing it ([`Mapping::write`]) are
//!    therefore `unsafe fn`s, and each caller states why the protocol holds there.
//! 2. **Mutable words are only accessed atomically.** Size words, page-table entries, versions and
//!    reader slots are 8-byte aligned 64-bit words; no `&[u8]` may cover them (callers slice
//!    around them).
//! 3. **Read-only memory takes only relaxed loads.** The standard library allows atomic loads on
//!    read-only memory only when they are `Relaxed` and no wider than a pointer (some targets
//!    implement stronger loads with read-modify-write instructions). Readers therefore load words
//!    with [`Mapping::load`], a relaxed load followed by a fence of the ordering asked for; only
//!    the writer's (read-write) mapping hands out the word itself ([`Mapping::word`]). Readers
//!    write only their reader slots, through the separate writable mapping of the slot pages
//!    ([`Mapping::slot_word`]).
//! 4. **Nothing is truncated under a mapping.** The writer never shrinks the file. A file shrunk by
//!    someone else raises SIGBUS; we check the length at open so an arena that is *already*
//!    truncated or corrupt yields [`Error::Corrupt`], never an out-of-bounds access. The writer
//!    reserves (`fallocate`) the pages it will touch, so a full tmpfs is an error, not SIGBUS.
//!
//! Every access is bounds-checked against the mapping length, so even a corrupt arena cannot make
//! a caller read outside the mapping.
#![allow(unsafe_code)]

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use memmap2::{Mmap, MmapMut, MmapOptions};

use crate::error::{Error, Result};

/// Maps an immutable file read-only (level segments).
///
/// Level segments are written completely, synced, and never modified afterwards; they are only
/// unlinked once no manifest names them, which keeps existing mappings valid. Readers bounds-check
/// every access against the mapping's length.
pub(crate) fn map_immutable(file: &File, path: &Path) -> Result<Mmap> {
    // SAFETY: the file is immutable for its whole life (see above); a file truncated by someone
    // else would raise SIGBUS, which the storage contract rules out (rule 3).
    unsafe { Mmap::map(file) }.map_err(|e| Error::io(path, e))
}

/// Keeps a mapping alive; `base`/`len` in [`Mapping`] point into it.
enum Backing {
    Ro(#[allow(dead_code)] Mmap),
    Rw(#[allow(dead_code)] MmapMut),
}

/// A mapped arena file with checked accessors.
pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
    writable: bool,
    _backing: Backing,
    /// Reader side: a writable mapping of the slot pages `[slots_off, slots_off + slots_len)`.
    slots: Option<(MmapMut, u64)>,
}

// SAFETY: the mapping is plain shared memory; all mutation goes through atomics or through
// `write`, which the single `Writer` alone calls, into bytes no reader can observe (contract
// rule 1). Sharing `&Mapping` across threads is therefore no different from sharing it across
// processes, which the protocol is designed for.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `file` read-write (the writer). `len` must equal the file length.
    pub(crate) fn map_rw(file: &File, len: u64, path: &Path) -> Result<Mapping> {
        let len = usize::try_from(len).map_err(|_| Error::Config("arena larger than address space".into()))?;
        // SAFETY: the writer holds an exclusive lock on the file and never truncates it while
        // mapped; readers never write outside their slot pages (contract rules 1 and 3).
        let mut map = unsafe { MmapOptions::new().len(len).map_mut(file) }.map_err(|e| Error::io(path, e))?;
        let base = map.as_mut_ptr();
        Ok(Mapping { base, len, writable: true, _backing: Backing::Rw(map), slots: None })
    }

    /// Maps `file` read-only (a reader), plus the slot pages read-write.
    pub(crate) fn map_ro(file: &File, len: u64, slots_off: u64, slots_len: u64, path: &Path) -> Result<Mapping> {
        let len = usize::try_from(len).map_err(|_| Error::corrupt(24, "arena larger than address space"))?;
        // SAFETY: read-only mapping; the file length was checked by the caller against the
        // superblock, and the protocol never truncates a live arena (contract rule 3).
        let map = unsafe { MmapOptions::new().len(len).map(file) }.map_err(|e| Error::io(path, e))?;
        let base = map.as_ptr() as *mut u8;
        let slots = if slots_len > 0 {
            if slots_off.checked_add(slots_len).is_none_or(|end| end > len as u64) || !slots_off.is_multiple_of(4096) {
                return Err(Error::corrupt(56, "reader slot region out of bounds"));
            }
            // SAFETY: the slot pages are inside the file (checked above) and are only accessed
            // through `AtomicU64`s by every party.
            let m = unsafe { MmapOptions::new().offset(slots_off).len(slots_len as usize).map_mut(file) }
                .map_err(|e| Error::io(path, e))?;
            Some((m, slots_off))
        } else {
            None
        };
        Ok(Mapping { base, len, writable: false, _backing: Backing::Ro(map), slots })
    }

    fn check(&self, off: u64, len: usize, what: &'static str) -> Result<usize> {
        match off.checked_add(len as u64) {
            Some(end) if end <= self.len as u64 => Ok(off as usize),
            _ => Err(Error::corrupt(off, what)),
        }
    }

    /// The bytes `[off, off + len)` (bounds-checked).
    ///
    /// # Safety
    /// The range must be published and stay immutable for as long as the returned slice lives
    /// (contract rule 1): the caller holds a pinned snapshot from which the range is reachable, or
    /// is the writer reading its own tree (no one else writes it). It must not cover a word that
    /// is written atomically (rule 2).
    #[inline]
    pub(crate) unsafe fn bytes(&self, off: u64, len: usize) -> Result<&[u8]> {
        let o = self.check(off, len, "byte range outside the arena")?;
        // SAFETY: `o + len <= self.len`, so the range lies inside the live mapping, which outlives
        // `&self`; the caller guarantees nobody writes it while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.base.add(o), len) })
    }

    fn word_ptr(&self, off: u64) -> Result<*mut u64> {
        let o = self.check(off, 8, "word outside the arena")?;
        if o % 8 != 0 {
            return Err(Error::corrupt(off, "misaligned word"));
        }
        // SAFETY: in bounds (checked above) of the live mapping.
        Ok(unsafe { self.base.add(o) }.cast::<u64>())
    }

    /// Loads the word at `off` (8-byte aligned, in bounds): a relaxed load, then a fence of
    /// `order` (`Relaxed`, `Acquire` or `SeqCst`) — legal on read-only memory (contract rule 3).
    #[inline]
    pub(crate) fn load(&self, off: u64, order: Ordering) -> Result<u64> {
        let p = self.word_ptr(off)?;
        // SAFETY: in bounds and 8-byte aligned (mmap bases are page aligned); the word is only
        // accessed atomically by every party (rule 2), and a relaxed load of a pointer-sized word
        // is allowed on read-only memory (rule 3).
        let v = unsafe { AtomicU64::from_ptr(p) }.load(Ordering::Relaxed);
        match order {
            Ordering::Relaxed => {}
            Ordering::SeqCst => fence(Ordering::SeqCst),
            _ => fence(Ordering::Acquire),
        }
        Ok(v)
    }

    /// The atomic word at `off`, for stores and read-modify-writes: the writer's mapping only
    /// (a reader's is read-only; it loads with [`Mapping::load`]).
    #[inline]
    pub(crate) fn word(&self, off: u64) -> Result<&AtomicU64> {
        if !self.writable {
            return Err(Error::Config("a read-only arena mapping has no writable words".into()));
        }
        let p = self.word_ptr(off)?;
        // SAFETY: in bounds and aligned (above) in a writable mapping that outlives `&self`; the
        // word is only ever accessed atomically by every party (rule 2).
        Ok(unsafe { AtomicU64::from_ptr(p) })
    }

    /// A reader-slot word that this process may store to: in the writer's mapping it is the plain
    /// word; in a reader's it lives in the writable slot mapping.
    #[inline]
    pub(crate) fn slot_word(&self, off: u64) -> Result<&AtomicU64> {
        match &self.slots {
            None => self.word(off),
            Some((m, start)) => {
                let rel = off.checked_sub(*start).filter(|r| r + 8 <= m.len() as u64 && r % 8 == 0);
                let rel = rel.ok_or_else(|| Error::corrupt(off, "slot word outside the slot region"))?;
                // SAFETY: in bounds and aligned inside the writable slot mapping, which lives as
                // long as `self`; slot words are only accessed atomically (rule 2).
                Ok(unsafe { AtomicU64::from_ptr(m.as_ptr().add(rel as usize) as *mut u64) })
            }
        }
    }

    /// Copies `data` to `[off, off + len)` (bounds-checked; the writer's mapping only).
    ///
    /// # Safety
    /// No reader may be able to reach the range (rule 1): a freshly allocated buffer or blob, or
    /// the unpublished tail of a log block, and no `&[u8]` of it may be alive.
    #[inline]
    pub(crate) unsafe fn write(&self, off: u64, data: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(Error::Config("write through a read-only arena mapping".into()));
        }
        let o = self.check(off, data.len(), "write outside the arena")?;
        // SAFETY: in bounds of a writable mapping; the caller guarantees nobody reads the range;
        // `data` is private memory, so it cannot overlap the mapping's range.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(o), data.len()) };
        Ok(())
    }
}
