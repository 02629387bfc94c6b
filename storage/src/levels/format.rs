//! Level segment and node format (docs/storage-format.md §5).
//!
//! A segment file `NNNNNNNNNNNNNNNN.seg` is a header slot followed by fixed-size nodes. Node
//! pointers are `segment id << 32 | byte offset`, like value-log positions.

use crate::btree::Entry;
use crate::error::{Error, Result};

pub(crate) const SEG_MAGIC: &[u8; 8] = b"DPUKVSG1";
pub(crate) const NODE_LEAF: u8 = 1;
pub(crate) const NODE_INTERIOR: u8 = 2;
/// Bytes before a node's offset array.
pub(crate) const NODE_HDR: usize = 32;

pub(crate) const V_INLINE: u8 = 0;
pub(crate) const V_POINTER: u8 = 2;
pub(crate) const V_TOMBSTONE: u8 = 3;

pub(crate) fn ptr(segment: u64, offset: u32) -> u64 {
    segment << 32 | offset as u64
}

pub(crate) fn ptr_parts(p: u64) -> (u64, u32) {
    (p >> 32, p as u32)
}

pub(crate) fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
pub(crate) fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
pub(crate) fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Encoded size of a leaf entry.
pub(crate) fn leaf_entry_len(key: &[u8], e: &Entry<'_>) -> usize {
    2 + key.len()
        + 9
        + match e {
            Entry::Value(v) => 4 + v.len(),
            Entry::Pointer { .. } => 12,
            Entry::Tombstone => 0,
        }
}

/// Appends a leaf entry: `u16 key_len | key | u8 kind | u64 version | value`.
pub(crate) fn put_leaf_entry(out: &mut Vec<u8>, key: &[u8], version: u64, e: &Entry<'_>) {
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(key);
    let kind = match e {
        Entry::Value(_) => V_INLINE,
        Entry::Pointer { .. } => V_POINTER,
        Entry::Tombstone => V_TOMBSTONE,
    };
    out.push(kind);
    out.extend_from_slice(&version.to_le_bytes());
    match e {
        Entry::Value(v) => {
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
            out.extend_from_slice(v);
        }
        Entry::Pointer { ptr, len } => {
            out.extend_from_slice(&ptr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        Entry::Tombstone => {}
    }
}

/// Encoded size of an interior entry.
pub(crate) fn interior_entry_len(key: &[u8]) -> usize {
    2 + key.len() + 8
}

/// A decoded, bounds-checked level node.
pub(crate) struct LNode<'a> {
    pub(crate) kind: u8,
    pub(crate) count: usize,
    /// Leaf: next leaf. Interior: leftmost child.
    pub(crate) link: u64,
    /// Leaf: previous leaf.
    pub(crate) prev: u64,
    bytes: &'a [u8],
    /// Position of the node in its file, for errors.
    pub(crate) file_off: u64,
}

impl<'a> LNode<'a> {
    pub(crate) fn parse(bytes: &'a [u8], file_off: u64, err: impl Fn(u64, &'static str) -> Error) -> Result<LNode<'a>> {
        let kind = bytes[0];
        let count = le16(bytes, 2) as usize;
        let used = le32(bytes, 4) as usize;
        if (kind != NODE_LEAF && kind != NODE_INTERIOR) || used > bytes.len() || NODE_HDR + 2 * count > used {
            return Err(err(file_off, "malformed level node header"));
        }
        Ok(LNode { kind, count, link: le64(bytes, 8), prev: le64(bytes, 16), bytes: &bytes[..used], file_off })
    }

    fn entry_start(&self, i: usize, err: &impl Fn(u64, &'static str) -> Error) -> Result<usize> {
        let o = le16(self.bytes, NODE_HDR + 2 * i) as usize;
        if o < NODE_HDR + 2 * self.count || o + 2 > self.bytes.len() {
            return Err(err(self.file_off, "level entry offset out of bounds"));
        }
        Ok(o)
    }

    pub(crate) fn key(&self, i: usize, err: &impl Fn(u64, &'static str) -> Error) -> Result<&'a [u8]> {
        let o = self.entry_start(i, err)?;
        let klen = le16(self.bytes, o) as usize;
        self.bytes.get(o + 2..o + 2 + klen).ok_or_else(|| err(self.file_off, "level key out of bounds"))
    }

    /// Interior: the child pointer of entry `i`.
    pub(crate) fn child(&self, i: usize, err: &impl Fn(u64, &'static str) -> Error) -> Result<u64> {
        let o = self.entry_start(i, err)?;
        let klen = le16(self.bytes, o) as usize;
        let b = self
            .bytes
            .get(o + 2 + klen..o + 10 + klen)
            .ok_or_else(|| err(self.file_off, "child pointer out of bounds"))?;
        Ok(le64(b, 0))
    }

    /// Leaf: entry `i` as (key, version, value).
    pub(crate) fn leaf_entry(
        &self,
        i: usize,
        err: &impl Fn(u64, &'static str) -> Error,
    ) -> Result<(&'a [u8], u64, Entry<'a>)> {
        let o = self.entry_start(i, err)?;
        let klen = le16(self.bytes, o) as usize;
        let bad = || err(self.file_off, "level entry out of bounds");
        let key = self.bytes.get(o + 2..o + 2 + klen).ok_or_else(bad)?;
        let p = o + 2 + klen;
        let h = self.bytes.get(p..p + 9).ok_or_else(bad)?;
        let version = le64(h, 1);
        let p = p + 9;
        let e = match h[0] {
            V_INLINE => {
                let n = le32(self.bytes.get(p..p + 4).ok_or_else(bad)?, 0) as usize;
                Entry::Value(self.bytes.get(p + 4..p + 4 + n).ok_or_else(bad)?)
            }
            V_POINTER => {
                let b = self.bytes.get(p..p + 12).ok_or_else(bad)?;
                Entry::Pointer { ptr: le64(b, 0), len: le32(b, 8) }
            }
            V_TOMBSTONE => Entry::Tombstone,
            _ => return Err(err(self.file_off, "unknown level value kind")),
        };
        Ok((key, version, e))
    }

    /// Where entry `i`'s pointer sits in the node (bounds-checked), for rewriting it: an
    /// interior entry's child pointer, or a leaf entry's log pointer (None for a leaf entry
    /// whose value is not a pointer).
    pub(crate) fn pointer_offset(&self, i: usize, err: &impl Fn(u64, &'static str) -> Error) -> Result<Option<usize>> {
        let o = self.entry_start(i, err)?;
        let klen = le16(self.bytes, o) as usize;
        let p = o + 2 + klen;
        let bad = || err(self.file_off, "level entry out of bounds");
        if self.kind != NODE_LEAF {
            self.bytes.get(p..p + 8).ok_or_else(bad)?;
            return Ok(Some(p));
        }
        // kind byte, u64 version, then for a pointer: u64 log position, u32 length.
        match self.bytes.get(p) {
            Some(&V_POINTER) => {
                self.bytes.get(p + 9..p + 21).ok_or_else(bad)?;
                Ok(Some(p + 9))
            }
            Some(_) => Ok(None),
            None => Err(bad()),
        }
    }

    /// Index of the last entry with key `<= key` (`< key` when `strict`), by binary search.
    pub(crate) fn last_at_or_before(
        &self,
        key: &[u8],
        strict: bool,
        err: &impl Fn(u64, &'static str) -> Error,
    ) -> Result<Option<usize>> {
        let (mut lo, mut hi) = (0, self.count);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let k = self.key(mid, err)?;
            let before = if strict { k < key } else { k <= key };
            if before {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        Ok(lo.checked_sub(1))
    }
}
