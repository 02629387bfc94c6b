//! Arena configuration: node size, capacity, thresholds, and their validation.

use crate::error::{Error, Result};

/// Largest key the engine accepts, whatever the node size.
pub const MAX_KEY_LEN: usize = 1024;
/// Largest value the engine accepts.
pub const MAX_VALUE_LEN: usize = 1 << 20;
/// Bytes of a node header.
pub const NODE_HEADER: usize = 64;
/// The most bytes one leaf item or log entry takes besides its key and its value (the inline
/// bytes, or an 8-byte blob or value-log pointer): a log entry's fixed header (8 bytes) and its
/// two length varints, the key length (at most 3 bytes) and the value length (at most 4). A
/// sorted leaf item has the two varints and no header, so it takes less (docs/storage-format.md
/// §2.3, §2.4).
pub(crate) const MAX_ITEM_OVERHEAD: usize = 8 + 3 + 4;

/// How an arena is laid out. Fixed when the arena is created and recorded in its superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaConfig {
    /// Size of every tree node, a power of two in 512..=32768 (8 KiB default).
    pub node_size: u32,
    /// Size of the arena file in bytes. The file is sparse: pages cost memory only once used.
    pub capacity: u64,
    /// Number of reader slots (each reader thread, in any process, takes one).
    pub reader_slots: u32,
    /// A leaf's log block is merged into a new sorted block once it exceeds this many bytes.
    pub log_threshold: u32,
    /// Values longer than this are stored outside the node, behind a value pointer.
    pub inline_threshold: u32,
    /// Longest key accepted (at most [`MAX_KEY_LEN`]).
    pub max_key_len: u32,
    /// Deletes leave tombstones that survive log merges (an L0 over older levels needs them to
    /// hide deleted keys); without it, deletes remove the key.
    pub keep_tombstones: bool,
}

impl Default for ArenaConfig {
    fn default() -> Self {
        ArenaConfig {
            node_size: 8192,
            capacity: 1 << 30,
            reader_slots: 128,
            log_threshold: 512,
            inline_threshold: 256,
            max_key_len: MAX_KEY_LEN as u32,
            keep_tombstones: false,
        }
    }
}

impl ArenaConfig {
    /// A configuration with small nodes, for tests that want splits and merges constantly.
    pub fn small_nodes(node_size: u32) -> Self {
        let payload = node_size as usize - NODE_HEADER - shortcut_capacity(node_size);
        let log_threshold = (node_size / 8).min(512);
        let item = (payload - 2 * log_threshold as usize) / 3;
        let half = ((item - MAX_ITEM_OVERHEAD) / 2) as u32;
        ArenaConfig {
            node_size,
            capacity: 64 << 20,
            reader_slots: 64,
            log_threshold,
            inline_threshold: half,
            max_key_len: half,
            keep_tombstones: false,
        }
    }

    /// Checks the configuration is consistent: nodes can always be split so every item fits.
    pub fn validate(&self) -> Result<()> {
        let ns = self.node_size;
        if !ns.is_power_of_two() || !(512..=32768).contains(&ns) {
            return Err(Error::Config(format!("node_size {ns} must be a power of two in 512..=32768")));
        }
        if self.max_key_len == 0 || self.max_key_len as usize > MAX_KEY_LEN {
            return Err(Error::Config(format!("max_key_len must be in 1..={MAX_KEY_LEN}")));
        }
        if self.reader_slots == 0 || self.reader_slots > 4096 {
            return Err(Error::Config("reader_slots must be in 1..=4096".into()));
        }
        let payload = ns as usize - NODE_HEADER - shortcut_capacity(ns);
        if self.log_threshold < 32 || self.log_threshold as usize > payload / 4 {
            return Err(Error::Config(format!("log_threshold must be in 32..={}", payload / 4)));
        }
        // A leaf keeps `log_threshold` bytes free for its log. An overfull leaf holds at most
        // (payload - threshold) + threshold + one item; it can be split into two halves that
        // each fit when payload >= 2 * threshold + 3 * item.
        let room = (payload - 2 * self.log_threshold as usize) / 3;
        if self.max_item_bytes() > room {
            return Err(Error::Config(format!(
                "max_key_len {} + inline_threshold {} too large for {ns} B nodes (items must fit {room} B)",
                self.max_key_len, self.inline_threshold
            )));
        }
        if self.capacity < 1 << 20 || self.capacity > 1 << 44 {
            return Err(Error::Config("capacity must be in 1 MiB..=16 TiB".into()));
        }
        Ok(())
    }

    /// Largest encoded size of one leaf item or log entry.
    pub(crate) fn max_item_bytes(&self) -> usize {
        // Overhead + key + max(inline value, value pointer).
        MAX_ITEM_OVERHEAD + self.max_key_len as usize + (self.inline_threshold as usize).max(8)
    }
}

/// Bytes reserved after the header for the shortcut block.
pub(crate) fn shortcut_capacity(node_size: u32) -> usize {
    (node_size as usize / 16).max(32)
}
