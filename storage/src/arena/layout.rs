//! Superblock layout: where everything in the arena file lives, and its validation.
//!
//! Byte diagrams are in docs/storage-format.md. All integers are little-endian.

use crate::config::ArenaConfig;
use crate::error::{Error, Result};

/// Magic bytes at offset 0.
pub(crate) const MAGIC: [u8; 8] = *b"DPUKVAR\0";
/// Layout version written by this code.
pub(crate) const LAYOUT_VERSION: u32 = 2;
/// Bytes of the immutable, checksummed superblock prefix (CRC at `SB_CRC`).
pub(crate) const SB_FIXED: usize = 112;
pub(crate) const SB_CRC: u64 = 112;
/// Atomic superblock words.
pub(crate) const SB_ROOT: u64 = 128;
pub(crate) const SB_WRITE_VERSION: u64 = 136;
pub(crate) const SB_READ_VERSION: u64 = 144;
pub(crate) const SB_STATE: u64 = 152;
pub(crate) const SB_WRITER_PID: u64 = 160;
pub(crate) const SB_ALLOCATED_PAGES: u64 = 168;
pub(crate) const SB_GARBAGE_PAGES: u64 = 176;
pub(crate) const SB_TABLES_GEN: u64 = 184;
/// One past the highest LID the writer has handed out (bounds a reader's page-table copy).
pub(crate) const SB_LID_HIGH: u64 = 192;
/// A random number chosen when the arena was created (never 0): names this arena (and so its
/// LIDs and versions) in start hints, across restarts that reuse a file name.
pub(crate) const SB_NONCE: u64 = 200;
/// Page-table entry bit: the node id was retired (merged away, its tree collapsed) at a version
/// the reader may already see. The rest of the entry is still the buffer's offset (readers of
/// older versions follow it); a start hint naming a retired node is not trusted.
pub(crate) const PT_RETIRED: u64 = 1 << 63;
/// Superblock size (one page).
pub(crate) const SB_SIZE: u64 = 4096;
/// Bytes per reader slot.
pub(crate) const SLOT_SIZE: u64 = 64;
/// Bytes reserved for the host->device command ring (used by the device engine).
pub(crate) const RING_LEN: u64 = 64 << 10;

/// `SB_STATE` values.
pub(crate) const STATE_READY: u64 = 1;
pub(crate) const STATE_CLOSED: u64 = 2;
pub(crate) const STATE_FROZEN: u64 = 3;

/// Root word: LID in the low 48 bits, tree height (levels, 1 = a single leaf) in the high 16.
pub(crate) fn root_word(lid: u64, height: u16) -> u64 {
    lid | (height as u64) << 48
}

/// Splits a root word into (LID, height).
pub(crate) fn split_root_word(w: u64) -> (u64, u16) {
    (w & ((1 << 48) - 1), (w >> 48) as u16)
}

/// The immutable geometry of an arena, as recorded in its superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Node size in bytes.
    pub node_size: u32,
    /// Changes every time a writer creates the arena afresh.
    pub generation: u64,
    /// File length.
    pub capacity: u64,
    /// Offset of the reader-slot array.
    pub slots_off: u64,
    /// Number of reader slots.
    pub slots_count: u32,
    /// Offset and length of the command ring.
    pub ring_off: u64,
    /// Length of the command ring.
    pub ring_len: u64,
    /// Offset of the page table (one u64 per LID).
    pub pt_off: u64,
    /// Entries in the page table (LID 0 is never used).
    pub pt_entries: u64,
    /// Offset of the first heap page.
    pub heap_off: u64,
    /// Heap pages of `node_size` bytes.
    pub heap_pages: u64,
    /// Log-block merge threshold.
    pub log_threshold: u32,
    /// Inline value threshold.
    pub inline_threshold: u32,
    /// Longest key.
    pub max_key_len: u32,
    /// Deletes leave tombstones (flags bit 0).
    pub keep_tombstones: bool,
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl Layout {
    /// Computes the layout for a new arena.
    pub(crate) fn plan(cfg: &ArenaConfig, generation: u64) -> Result<Layout> {
        cfg.validate()?;
        let ns = cfg.node_size as u64;
        let slots_off = SB_SIZE;
        let ring_off = align_up(slots_off + cfg.reader_slots as u64 * SLOT_SIZE, 4096);
        let pt_off = ring_off + RING_LEN;
        let upper_pages = (cfg.capacity - pt_off) / ns;
        let pt_entries = upper_pages + 1;
        let heap_off = align_up(pt_off + pt_entries * 8, 4096.max(ns));
        if heap_off + 16 * ns > cfg.capacity {
            return Err(Error::Config("capacity too small for the arena metadata".into()));
        }
        let heap_pages = (cfg.capacity - heap_off) / ns;
        Ok(Layout {
            node_size: cfg.node_size,
            generation,
            capacity: cfg.capacity,
            slots_off,
            slots_count: cfg.reader_slots,
            ring_off,
            ring_len: RING_LEN,
            pt_off,
            pt_entries,
            heap_off,
            heap_pages,
            log_threshold: cfg.log_threshold,
            inline_threshold: cfg.inline_threshold,
            max_key_len: cfg.max_key_len,
            keep_tombstones: cfg.keep_tombstones,
        })
    }

    /// The configuration this layout was built from (capacity and thresholds).
    pub fn config(&self) -> ArenaConfig {
        ArenaConfig {
            node_size: self.node_size,
            capacity: self.capacity,
            reader_slots: self.slots_count,
            log_threshold: self.log_threshold,
            inline_threshold: self.inline_threshold,
            max_key_len: self.max_key_len,
            keep_tombstones: self.keep_tombstones,
        }
    }

    /// Serializes the immutable superblock prefix, with its CRC32C appended.
    pub(crate) fn encode(&self) -> [u8; SB_FIXED + 4] {
        let mut b = [0u8; SB_FIXED + 4];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.node_size.to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.capacity.to_le_bytes());
        b[32..40].copy_from_slice(&self.slots_off.to_le_bytes());
        b[40..44].copy_from_slice(&self.slots_count.to_le_bytes());
        b[44..48].copy_from_slice(&(SLOT_SIZE as u32).to_le_bytes());
        b[48..56].copy_from_slice(&self.ring_off.to_le_bytes());
        b[56..64].copy_from_slice(&self.ring_len.to_le_bytes());
        b[64..72].copy_from_slice(&self.pt_off.to_le_bytes());
        b[72..80].copy_from_slice(&self.pt_entries.to_le_bytes());
        b[80..88].copy_from_slice(&self.heap_off.to_le_bytes());
        b[88..96].copy_from_slice(&self.heap_pages.to_le_bytes());
        b[96..100].copy_from_slice(&self.log_threshold.to_le_bytes());
        b[100..104].copy_from_slice(&self.inline_threshold.to_le_bytes());
        b[104..108].copy_from_slice(&self.max_key_len.to_le_bytes());
        b[108..112].copy_from_slice(&(self.keep_tombstones as u32).to_le_bytes());
        let crc = crc32c::crc32c(&b[..SB_FIXED]);
        b[SB_FIXED..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses and validates a superblock prefix against the file length.
    pub(crate) fn decode(b: &[u8], file_len: u64) -> Result<Layout> {
        if b.len() < SB_FIXED + 4 || file_len < SB_SIZE {
            return Err(Error::corrupt(0, "arena shorter than its superblock"));
        }
        if b[0..8] != MAGIC {
            return Err(Error::corrupt(0, "bad magic (not a dpukv arena)"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4-byte slice"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8-byte slice"));
        if u32_at(8) != LAYOUT_VERSION {
            return Err(Error::corrupt(8, "unsupported layout version"));
        }
        if crc32c::crc32c(&b[..SB_FIXED]) != u32_at(SB_FIXED) {
            return Err(Error::corrupt(SB_CRC, "superblock checksum mismatch"));
        }
        let l = Layout {
            node_size: u32_at(12),
            generation: u64_at(16),
            capacity: u64_at(24),
            slots_off: u64_at(32),
            slots_count: u32_at(40),
            ring_off: u64_at(48),
            ring_len: u64_at(56),
            pt_off: u64_at(64),
            pt_entries: u64_at(72),
            heap_off: u64_at(80),
            heap_pages: u64_at(88),
            log_threshold: u32_at(96),
            inline_threshold: u32_at(100),
            max_key_len: u32_at(104),
            keep_tombstones: u32_at(108) & 1 == 1,
        };
        if u32_at(108) & !1 != 0 {
            return Err(Error::corrupt(108, "unknown superblock flags"));
        }
        if u32_at(44) as u64 != SLOT_SIZE {
            return Err(Error::corrupt(44, "unexpected reader slot size"));
        }
        if l.capacity != file_len {
            return Err(Error::corrupt(24, "arena file length differs from its superblock (truncated?)"));
        }
        l.config().validate().map_err(|_| Error::corrupt(12, "superblock geometry is inconsistent"))?;
        // The regions must be in order and inside the file.
        let ns = l.node_size as u64;
        let ordered = l.slots_off == SB_SIZE
            && l.slots_off + l.slots_count as u64 * SLOT_SIZE <= l.ring_off
            && l.ring_off.checked_add(l.ring_len).is_some_and(|e| e <= l.pt_off)
            && l.pt_entries.checked_mul(8).and_then(|n| n.checked_add(l.pt_off)).is_some_and(|e| e <= l.heap_off)
            && l.heap_off.is_multiple_of(4096)
            && l.heap_off.is_multiple_of(ns)
            && l.heap_pages < l.pt_entries
            && l.heap_pages.checked_mul(ns).and_then(|n| n.checked_add(l.heap_off)).is_some_and(|e| e <= l.capacity);
        if !ordered {
            return Err(Error::corrupt(32, "superblock regions overlap or exceed the file"));
        }
        Ok(l)
    }

    /// Offset of page-table entry `lid`.
    #[inline]
    pub(crate) fn pt_entry(&self, lid: u64) -> Result<u64> {
        if lid == 0 || lid >= self.pt_entries {
            return Err(Error::corrupt(self.pt_off, "logical node id outside the page table"));
        }
        Ok(self.pt_off + lid * 8)
    }

    /// Whether `off` is the start of a heap page.
    #[inline]
    pub(crate) fn is_page(&self, off: u64) -> bool {
        // node_size is a power of two (validated), so mask and shift instead of dividing.
        let rel = off.wrapping_sub(self.heap_off);
        off >= self.heap_off
            && rel & (self.node_size as u64 - 1) == 0
            && rel >> self.node_size.trailing_zeros() < self.heap_pages
    }
}
