//! The command ring: how the host tells the device about page-table changes (Honeycomb §3.2:
//! "the CPU updates the table in host memory and issues a PCIe command to the FPGA"). It lives in
//! the arena at `ring_off`: a header word `head` (commands `< head` are published), then slots of
//! three words `[stamp, lid, offset]`. Command `s` goes to slot `s % capacity` with stamp `s + 1`;
//! the writer clears the stamp, writes the fields and sets the stamp (release), seqlock-style, so a
//! consumer can tell a slot it read whole from one being overwritten. A consumer that falls a whole
//! ring behind resynchronizes from the page table.

use std::sync::atomic::{Ordering, fence};

use super::Arena;
use crate::error::Result;

/// Bytes before the first slot.
const RING_HEADER: u64 = 64;
/// Bytes per slot.
const SLOT: u64 = 24;

/// A consumer's progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drain {
    /// Every published command was applied.
    Done,
    /// Commands were overwritten before they were read: resynchronize.
    Overrun,
}

impl Arena {
    fn ring_capacity(&self) -> u64 {
        (self.layout.ring_len - RING_HEADER) / SLOT
    }

    /// The number of commands published so far.
    pub(crate) fn ring_head(&self) -> Result<u64> {
        self.map.load(self.layout.ring_off, Ordering::Acquire)
    }

    /// Writer: publishes command `seq` (page-table entry `lid` is now `off`).
    pub(crate) fn ring_push(&self, seq: u64, lid: u64, off: u64) -> Result<()> {
        let base = self.layout.ring_off + RING_HEADER + (seq % self.ring_capacity()) * SLOT;
        let stamp = self.map.word(base)?;
        stamp.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        self.map.word(base + 8)?.store(lid, Ordering::Relaxed);
        self.map.word(base + 16)?.store(off, Ordering::Relaxed);
        stamp.store(seq + 1, Ordering::Release);
        self.map.word(self.layout.ring_off)?.store(seq + 1, Ordering::Release);
        Ok(())
    }

    /// Consumer: applies commands `from..head` with `apply(lid, off)`; returns the new position.
    pub(crate) fn ring_drain(&self, from: u64, mut apply: impl FnMut(u64, u64)) -> Result<(u64, Drain)> {
        let head = self.ring_head()?;
        if head.saturating_sub(from) > self.ring_capacity() || head < from {
            return Ok((from, Drain::Overrun));
        }
        for s in from..head {
            let base = self.layout.ring_off + RING_HEADER + (s % self.ring_capacity()) * SLOT;
            let first = self.map.load(base, Ordering::Acquire)?;
            let lid = self.map.load(base + 8, Ordering::Relaxed)?;
            let off = self.map.load(base + 16, Ordering::Acquire)?;
            if first != s + 1 || self.map.load(base, Ordering::Relaxed)? != s + 1 {
                return Ok((s, Drain::Overrun));
            }
            apply(lid, off);
        }
        Ok((head, Drain::Done))
    }
}
