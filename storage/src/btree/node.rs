//! Node format: header, shortcut block, sorted block and (leaves) log block. Checked decoding for
//! readers, encoding of whole node images for the writer. Byte diagrams: docs/storage-format.md.

use std::sync::atomic::Ordering;

use crate::arena::Arena;
use crate::config::{NODE_HEADER, shortcut_capacity};
use crate::error::{Error, Result};

pub(crate) const KIND_LEAF: u8 = 1;
pub(crate) const KIND_INTERIOR: u8 = 2;
/// Offset of the atomic size word (log end in the low 32 bits, log entry count above).
pub(crate) const H_SIZE: u64 = 8;

/// Log entry flag: a put (otherwise a delete marker).
pub(crate) const LOG_PUT: u8 = 1;
/// Log entry flag: the value is a blob pointer.
pub(crate) const LOG_BLOB: u8 = 2;
/// Log entry flag: the back pointer names a sorted item with the same key.
pub(crate) const LOG_EQUAL: u8 = 4;
/// Log entry flag: the value is an external pointer (a value-log record).
pub(crate) const LOG_EXT: u8 = 8;
/// Sorted-item value kinds (low two bits of the tag; the length is above them).
const KIND_INLINE: u32 = 0;
const KIND_BLOB: u32 = 1;
const KIND_EXT: u32 = 2;
const KIND_TOMBSTONE: u32 = 3;
/// Fixed bytes before a log entry's lengths.
pub(crate) const LOG_HDR: usize = 8;
/// Order hints are one byte, so a log block holds at most this many entries.
pub(crate) const MAX_LOG_ENTRIES: u32 = 255;
/// Bytes of a blob header (the value length).
pub(crate) const BLOB_HDR: u64 = 8;

const HDR: usize = NODE_HEADER;
/// Bytes of a shortcut entry before its key: the item position (u16) and the key length (u16).
const SHORTCUT_ENTRY_HDR: usize = 4;
/// Bytes one shortcut takes in the shortcut block besides its key: its entry offset (u16) in the
/// offset array, and its entry's header ([`SHORTCUT_ENTRY_HDR`]) (docs/storage-format.md §2.2).
const SHORTCUT_OVERHEAD: usize = 2 + SHORTCUT_ENTRY_HDR;

/// Compares two keys like `<[u8]>::cmp`, eight bytes at a time (short keys dominate, and a
/// call into libc's memcmp costs more than the comparison itself).
#[inline]
pub(crate) fn cmp_keys(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n {
        let x = u64::from_be_bytes(a[i..i + 8].try_into().expect("8 bytes"));
        let y = u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if x != y {
            return x.cmp(&y);
        }
        i += 8;
    }
    while i < n {
        if a[i] != b[i] {
            return a[i].cmp(&b[i]);
        }
        i += 1;
    }
    a.len().cmp(&b.len())
}

/// Key equality with the same word-at-a-time loop.
#[inline]
pub(crate) fn eq_keys(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && cmp_keys(a, b) == std::cmp::Ordering::Equal
}

/// Packs the size word.
pub(crate) fn size_word(log_end: u32, log_count: u32) -> u64 {
    log_end as u64 | (log_count as u64) << 32
}

/// A validated node header. Positions are node-relative byte offsets.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Header {
    pub(crate) off: u64,
    pub(crate) kind: u8,
    pub(crate) level: u8,
    pub(crate) sc_count: u16,
    pub(crate) sorted_start: u32,
    pub(crate) sorted_end: u32,
    pub(crate) sorted_count: u32,
    pub(crate) log_end: u32,
    pub(crate) log_count: u32,
    pub(crate) version: u64,
    pub(crate) prev: u64,
    pub(crate) lid: u64,
    pub(crate) leftmost: u64,
    pub(crate) right: u64,
}

/// Asks the CPU to bring `bytes` into its caches (a hint: no effect on what any read returns).
#[inline]
#[allow(unsafe_code)]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64).map(<[u8]>::as_ptr).chain(bytes.last().map(std::ptr::from_ref)) {
        // SAFETY: a prefetch reads nothing the program sees and cannot fault; `line` points into
        // `bytes` (SSE, which the instruction needs, is part of x86_64).
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

impl Header {
    /// Reads and validates the header of the buffer at `off`.
    ///
    /// # Safety
    /// The buffer at `off` must be published and stay immutable while the header is used: the
    /// caller reached it under a pin, or is the writer (`arena::shm`, contract rule 1).
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn read(arena: &Arena, off: u64) -> Result<Header> {
        if !arena.layout.is_page(off) {
            return Err(Error::corrupt(off, "node offset is not a heap page"));
        }
        // SAFETY: the caller's contract; the two ranges skip the size word at `H_SIZE`.
        let a = unsafe { arena.map.bytes(off, 8) }?;
        let size = arena.map.load(off + H_SIZE, Ordering::Acquire)?;
        // SAFETY: as above.
        let b = unsafe { arena.map.bytes(off + 16, HDR - 16) }?;
        Header::parse(a, size, b, off, arena.layout.node_size)
    }

    /// Parses a header from a copy of a node's first bytes (the device's node cache).
    pub(crate) fn from_copy(image: &[u8], off: u64, node_size: u32) -> Result<Header> {
        if image.len() < HDR {
            return Err(Error::corrupt(off, "node copy shorter than a header"));
        }
        Header::parse(&image[..8], le64(image, 8), &image[16..HDR], off, node_size)
    }

    /// Builds and validates a header from its bytes `[0, 8)`, the size word, and `[16, 64)`.
    fn parse(a: &[u8], size: u64, b: &[u8], off: u64, ns: u32) -> Result<Header> {
        let h = Header {
            off,
            kind: a[0],
            level: a[1],
            sc_count: le16(a, 2),
            sorted_start: le32(a, 4),
            log_end: size as u32,
            log_count: (size >> 32) as u32,
            version: le64(b, 0),
            prev: le64(b, 8),
            lid: le64(b, 16),
            leftmost: le64(b, 24),
            right: le64(b, 32),
            sorted_end: le32(b, 40),
            sorted_count: le32(b, 44),
        };
        let ok = match h.kind {
            KIND_LEAF => h.level == 0,
            KIND_INTERIOR => h.level > 0 && h.log_end == h.sorted_end && h.log_count == 0,
            _ => false,
        };
        if !ok
            || h.sorted_start < HDR as u32
            || h.sorted_start > h.sorted_end
            || h.sorted_end > h.log_end
            || h.log_end > ns
            || h.log_count > MAX_LOG_ENTRIES
            || (h.sc_count as u32) * 2 > h.sorted_start - HDR as u32
        {
            return Err(Error::corrupt(off, "malformed node header"));
        }
        Ok(h)
    }

    pub(crate) fn is_leaf(&self) -> bool {
        self.kind == KIND_LEAF
    }
}

/// A reader's view of one node: its header and its published bytes.
pub(crate) struct Node<'a> {
    pub(crate) h: Header,
    /// Bytes `[HDR, log_end)` of the node.
    body: &'a [u8],
}

/// A value as stored: inline bytes, a pointer to an arena blob, an external pointer (a value-log
/// record, resolved by the caller), or a tombstone (a delete kept to hide older levels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ValRef<'a> {
    Inline(&'a [u8]),
    Blob { off: u64, len: u32 },
    Ext { ptr: u64, len: u32 },
    Tombstone,
}

impl<'a> ValRef<'a> {
    /// Decodes a value from its kind, its length and the bytes after the key.
    #[inline]
    fn from_kind(kind: u32, len: u32, v: &'a [u8]) -> ValRef<'a> {
        match kind {
            KIND_INLINE => ValRef::Inline(v),
            KIND_BLOB => ValRef::Blob { off: le64(v, 0), len },
            KIND_EXT => ValRef::Ext { ptr: le64(v, 0), len },
            _ => ValRef::Tombstone,
        }
    }
}

/// Bytes a value of `kind` and length `len` occupies after the key.
#[inline]
fn kind_bytes(kind: u32, len: u32) -> usize {
    match kind {
        KIND_INLINE => len as usize,
        KIND_BLOB | KIND_EXT => 8,
        _ => 0,
    }
}

/// One decoded log entry.
pub(crate) struct LogEntry<'a> {
    pub(crate) flags: u8,
    pub(crate) hint: u8,
    pub(crate) bp: u32,
    pub(crate) delta: u32,
    pub(crate) key: &'a [u8],
    /// The value; a delete marker decodes as [`ValRef::Tombstone`].
    pub(crate) val: ValRef<'a>,
    pub(crate) next: u32,
}

#[inline]
fn varint(b: &[u8], pos: usize) -> Option<(u32, usize)> {
    let mut v: u32 = 0;
    for i in 0..5 {
        let byte = *b.get(pos + i)?;
        v |= ((byte & 0x7f) as u32) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, pos + i + 1));
        }
    }
    None
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u32) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn varint_len(v: u32) -> usize {
    match v {
        0..0x80 => 1,
        0x80..0x4000 => 2,
        0x4000..0x20_0000 => 3,
        0x20_0000..0x1000_0000 => 4,
        _ => 5,
    }
}

impl<'a> Node<'a> {
    /// Loads the node at `off`.
    ///
    /// # Safety
    /// As [`Header::read`], for as long as the node is used (`'a`).
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn load(arena: &'a Arena, off: u64) -> Result<Node<'a>> {
        // SAFETY: the caller's contract, passed on.
        unsafe { Node::from_header(arena, Header::read(arena, off)?) }
    }

    /// The node whose header was just read.
    ///
    /// # Safety
    /// As [`Header::read`] for the buffer at `h.off`, for as long as the node is used (`'a`).
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn from_header(arena: &'a Arena, h: Header) -> Result<Node<'a>> {
        // SAFETY: the caller's contract; the body starts after the header (and its size word) and
        // ends at the published size.
        let body = unsafe { arena.map.bytes(h.off + HDR as u64, h.log_end as usize - HDR) }?;
        Ok(Node { h, body })
    }

    /// A node from a copy of its used bytes (header included).
    pub(crate) fn from_copy(image: &'a [u8], off: u64, node_size: u32) -> Result<Node<'a>> {
        let h = Header::from_copy(image, off, node_size)?;
        let body = image
            .get(HDR..h.log_end as usize)
            .ok_or_else(|| Error::corrupt(off, "node copy shorter than its used bytes"))?;
        Ok(Node { h, body })
    }

    /// A copy of the node's used bytes, header included (the size word as loaded).
    ///
    /// # Safety
    /// As [`Header::read`] for the buffer at `h.off`, while the copy is made.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn image(arena: &Arena, h: &Header) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(h.log_end as usize);
        // SAFETY: the caller's contract; the two ranges skip the size word.
        out.extend_from_slice(unsafe { arena.map.bytes(h.off, 8) }?);
        out.extend_from_slice(&size_word(h.log_end, h.log_count).to_le_bytes());
        // SAFETY: as above.
        out.extend_from_slice(unsafe { arena.map.bytes(h.off + 16, h.log_end as usize - 16) }?);
        Ok(out)
    }

    fn corrupt(&self, what: &'static str) -> Error {
        Error::corrupt(self.h.off, what)
    }

    /// Starts loading, all at once, the parts of this leaf a point lookup reads — the shortcut
    /// block its binary search walks and the log block it scans — so that their cache misses
    /// overlap instead of following one another (a leaf of a large tree is rarely in cache: its
    /// lookup would otherwise wait for one miss per search step and per log line).
    #[inline]
    pub(crate) fn prefetch_lookup(&self) {
        let b = self.body;
        let shortcuts = (self.h.sorted_start as usize).saturating_sub(HDR).min(b.len());
        let log = (self.h.sorted_end as usize).saturating_sub(HDR).min(b.len());
        prefetch(&b[..shortcuts]);
        prefetch(&b[log..]);
    }

    /// Node-relative bytes `[pos, pos + len)` within the published part.
    #[inline]
    fn slice(&self, pos: usize, len: usize) -> Result<&'a [u8]> {
        let s = pos.checked_sub(HDR).ok_or_else(|| self.corrupt("position inside the header"))?;
        self.body.get(s..s + len).ok_or_else(|| self.corrupt("position beyond the node's used bytes"))
    }

    #[inline]
    fn var(&self, pos: usize, end: usize) -> Result<(u32, usize)> {
        match pos.checked_sub(HDR).and_then(|s| varint(&self.body[..end - HDR], s)) {
            Some((v, n)) => Ok((v, n + HDR)),
            None => Err(self.corrupt("truncated length field")),
        }
    }

    /// The `i`th shortcut: (key, position of the item it names).
    fn shortcut(&self, i: usize) -> Result<(&'a [u8], u32)> {
        let eo = le16(self.slice(HDR + 2 * i, 2)?, 0) as usize;
        let key_at = eo + SHORTCUT_ENTRY_HDR;
        if eo < HDR || key_at > self.h.sorted_start as usize {
            return Err(self.corrupt("shortcut entry outside the shortcut block"));
        }
        let e = self.slice(eo, SHORTCUT_ENTRY_HDR)?;
        let (pos, klen) = (le16(e, 0) as u32, le16(e, 2) as usize);
        if key_at + klen > self.h.sorted_start as usize || pos < self.h.sorted_start || pos >= self.h.sorted_end {
            return Err(self.corrupt("shortcut points outside the sorted block"));
        }
        Ok((self.slice(key_at, klen)?, pos))
    }

    /// The sorted-block segment that holds the largest item `<= key` (or `< key` when `strict`):
    /// `(start, end)` positions, found by binary search over the shortcut block.
    #[inline]
    pub(crate) fn segment(&self, key: &[u8], strict: bool) -> Result<(u32, u32)> {
        let n = self.h.sc_count as usize;
        // Number of shortcuts whose key is <= key (or < key).
        let (mut lo, mut hi) = (0usize, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let (k, _) = self.shortcut(mid)?;
            let c = cmp_keys(k, key);
            let before = c.is_lt() || (!strict && c.is_eq());
            if before {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let start = if lo == 0 { self.h.sorted_start } else { self.shortcut(lo - 1)?.1 };
        let end = if lo == n { self.h.sorted_end } else { self.shortcut(lo)?.1 };
        if end < start {
            return Err(self.corrupt("shortcuts out of order"));
        }
        Ok((start, end))
    }

    /// Decodes the leaf item at `pos`; returns it with the position of the next item.
    #[inline]
    pub(crate) fn leaf_item(&self, pos: u32) -> Result<(&'a [u8], ValRef<'a>, u32)> {
        let end = self.h.sorted_end as usize - HDR;
        let p = (pos as usize).wrapping_sub(HDR);
        let b = self.body;
        // Fast path: both length fields are one byte and the item lies inside the sorted block.
        if p + 2 <= end && b[p] < 0x80 && b[p + 1] < 0x80 {
            let (klen, tag) = (b[p] as usize, b[p + 1] as u32);
            let ks = p + 2;
            let next = ks + klen + kind_bytes(tag & 3, tag >> 2);
            if next <= end {
                let key = &b[ks..ks + klen];
                let val = ValRef::from_kind(tag & 3, tag >> 2, &b[ks + klen..next]);
                return Ok((key, val, (next + HDR) as u32));
            }
        }
        self.leaf_item_slow(pos)
    }

    #[cold]
    fn leaf_item_slow(&self, pos: u32) -> Result<(&'a [u8], ValRef<'a>, u32)> {
        let end = self.h.sorted_end as usize;
        let (klen, p) = self.var(pos as usize, end)?;
        let (tag, p) = self.var(p, end)?;
        let key = self.slice(p, klen as usize)?;
        let p = p + klen as usize;
        let n = kind_bytes(tag & 3, tag >> 2);
        let val = ValRef::from_kind(tag & 3, tag >> 2, self.slice(p, n)?);
        let next = p + n;
        if next > end {
            return Err(self.corrupt("leaf item crosses the sorted block's end"));
        }
        Ok((key, val, next as u32))
    }

    /// Decodes the interior item at `pos`: (separator key, child LID, next position).
    #[inline]
    pub(crate) fn interior_item(&self, pos: u32) -> Result<(&'a [u8], u64, u32)> {
        let end = self.h.sorted_end as usize;
        let (klen, p) = self.var(pos as usize, end)?;
        let key = self.slice(p, klen as usize)?;
        let p = p + klen as usize;
        let child = le64(self.slice(p, 8)?, 0);
        if p + 8 > end {
            return Err(self.corrupt("interior item crosses the sorted block's end"));
        }
        Ok((key, child, (p + 8) as u32))
    }

    /// Decodes the log entry at `pos`.
    #[inline]
    pub(crate) fn log_entry(&self, pos: u32) -> Result<LogEntry<'a>> {
        let end = self.h.log_end as usize;
        let p = pos as usize;
        let hd = self.slice(p, LOG_HDR)?;
        let (flags, hint, bp, delta) = (hd[0], hd[1], le16(hd, 2) as u32, le32(hd, 4));
        let (klen, mut p) = self.var(p + LOG_HDR, end)?;
        let mut tag = 0;
        if flags & LOG_PUT != 0 {
            (tag, p) = self.var(p, end)?;
        }
        let key = self.slice(p, klen as usize)?;
        p += klen as usize;
        let kind = if flags & LOG_PUT == 0 {
            KIND_TOMBSTONE
        } else if flags & LOG_BLOB != 0 {
            KIND_BLOB
        } else if flags & LOG_EXT != 0 {
            KIND_EXT
        } else {
            KIND_INLINE
        };
        let n = kind_bytes(kind, tag);
        let val = ValRef::from_kind(kind, tag, self.slice(p, n)?);
        p += n;
        if bp < self.h.sorted_start || bp > self.h.sorted_end {
            return Err(self.corrupt("log back pointer outside the sorted block"));
        }
        Ok(LogEntry { flags, hint, bp, delta, key, val, next: p as u32 })
    }
}

/// Resolves a value to its bytes (reading the blob for a value pointer).
///
/// # Safety
/// A blob's bytes must be published and stay immutable for `'a`: `v` was read from a node the
/// caller reached under a pin (or as the writer), and blobs are published with their node.
#[inline]
#[allow(unsafe_code)]
pub(crate) unsafe fn value_bytes<'a>(arena: &'a Arena, v: ValRef<'a>) -> Result<&'a [u8]> {
    match v {
        ValRef::Inline(b) => Ok(b),
        ValRef::Blob { off, len } => {
            if !arena.layout.is_page(off) {
                return Err(Error::corrupt(off, "value pointer is not a heap page"));
            }
            // SAFETY: the caller's contract.
            let hdr = unsafe { arena.map.bytes(off, BLOB_HDR as usize) }?;
            if le64(hdr, 0) != len as u64 {
                return Err(Error::corrupt(off, "blob length differs from its value pointer"));
            }
            // SAFETY: the caller's contract.
            unsafe { arena.map.bytes(off + BLOB_HDR, len as usize) }
        }
        ValRef::Ext { .. } | ValRef::Tombstone => {
            Err(Error::Config("the value lives in the value log (or is a tombstone); read it with get_entry".into()))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writer side: owned node contents and their encoding.

/// An owned value: inline bytes or a blob the tree owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Val {
    Inline(Vec<u8>),
    Blob { off: u64, len: u32 },
    Ext { ptr: u64, len: u32 },
    Tombstone,
}

impl Val {
    pub(crate) fn from_ref(v: ValRef<'_>) -> Val {
        match v {
            ValRef::Inline(b) => Val::Inline(b.to_vec()),
            ValRef::Blob { off, len } => Val::Blob { off, len },
            ValRef::Ext { ptr, len } => Val::Ext { ptr, len },
            ValRef::Tombstone => Val::Tombstone,
        }
    }

    pub(crate) fn as_ref(&self) -> ValRef<'_> {
        match self {
            Val::Inline(b) => ValRef::Inline(b),
            Val::Blob { off, len } => ValRef::Blob { off: *off, len: *len },
            Val::Ext { ptr, len } => ValRef::Ext { ptr: *ptr, len: *len },
            Val::Tombstone => ValRef::Tombstone,
        }
    }
}

impl<'a> ValRef<'a> {
    /// Kind, length and the bytes stored after the key (a pointer word, or inline bytes).
    fn parts(&self) -> (u32, u32, [u8; 8], &'a [u8]) {
        match *self {
            ValRef::Inline(b) => (KIND_INLINE, b.len() as u32, [0; 8], b),
            ValRef::Blob { off, len } => (KIND_BLOB, len, off.to_le_bytes(), &[]),
            ValRef::Ext { ptr, len } => (KIND_EXT, len, ptr.to_le_bytes(), &[]),
            ValRef::Tombstone => (KIND_TOMBSTONE, 0, [0; 8], &[]),
        }
    }
}

/// Owned contents of a node, as the writer rebuilds it.
#[derive(Debug)]
pub(crate) enum NodeData {
    Leaf { items: Vec<(Vec<u8>, Val)>, right: u64 },
    Interior { level: u8, leftmost: u64, items: Vec<(Vec<u8>, u64)> },
}

pub(crate) fn leaf_item_len(key: &[u8], v: &Val) -> usize {
    leaf_item_len_ref(key, &v.as_ref())
}

pub(crate) fn leaf_item_len_ref(key: &[u8], v: &ValRef<'_>) -> usize {
    let (kind, len, _, _) = v.parts();
    varint_len(key.len() as u32) + varint_len(len << 2 | kind) + key.len() + kind_bytes(kind, len)
}

fn put_leaf_item(out: &mut Vec<u8>, k: &[u8], v: &ValRef<'_>) {
    let (kind, len, word, inline) = v.parts();
    put_varint(out, k.len() as u32);
    put_varint(out, len << 2 | kind);
    out.extend_from_slice(k);
    match kind {
        KIND_INLINE => out.extend_from_slice(inline),
        KIND_BLOB | KIND_EXT => out.extend_from_slice(&word),
        _ => {}
    }
}

/// A leaf's contents borrowed from existing buffers (the writer's allocation-free rewrite).
pub(crate) struct LeafRefs<'a> {
    pub(crate) items: Vec<(&'a [u8], ValRef<'a>)>,
    pub(crate) right: u64,
}

impl LeafRefs<'_> {
    pub(crate) fn sorted_bytes(&self) -> usize {
        self.items.iter().map(|(k, v)| leaf_item_len_ref(k, v)).sum()
    }

    pub(crate) fn encode(&self, node_size: u32, lid: u64, version: u64, prev: u64, out: &mut Vec<u8>) {
        let items = &self.items;
        encode_node(
            node_size,
            HeadFields { kind: KIND_LEAF, level: 0, leftmost: 0, right: self.right, lid, version, prev },
            items.len(),
            |i| items[i].0,
            |i| leaf_item_len_ref(items[i].0, &items[i].1),
            |i, out| put_leaf_item(out, items[i].0, &items[i].1),
            out,
        );
    }

    /// An owned copy (for the rare rewrites that split or merge nodes).
    pub(crate) fn to_owned_data(&self) -> NodeData {
        NodeData::Leaf {
            items: self.items.iter().map(|(k, v)| (k.to_vec(), Val::from_ref(*v))).collect(),
            right: self.right,
        }
    }
}

pub(crate) fn interior_item_len(key: &[u8]) -> usize {
    varint_len(key.len() as u32) + key.len() + 8
}

impl NodeData {
    /// Bytes of the sorted block.
    pub(crate) fn sorted_bytes(&self) -> usize {
        match self {
            NodeData::Leaf { items, .. } => items.iter().map(|(k, v)| leaf_item_len(k, v)).sum(),
            NodeData::Interior { items, .. } => items.iter().map(|(k, _)| interior_item_len(k)).sum(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            NodeData::Leaf { items, .. } => items.len(),
            NodeData::Interior { items, .. } => items.len(),
        }
    }

    fn key(&self, i: usize) -> &[u8] {
        match self {
            NodeData::Leaf { items, .. } => &items[i].0,
            NodeData::Interior { items, .. } => &items[i].0,
        }
    }

    fn item_len(&self, i: usize) -> usize {
        match self {
            NodeData::Leaf { items, .. } => leaf_item_len(&items[i].0, &items[i].1),
            NodeData::Interior { items, .. } => interior_item_len(&items[i].0),
        }
    }

    /// Encodes the node image (header, shortcut block, sorted block, empty log block).
    pub(crate) fn encode(&self, node_size: u32, lid: u64, version: u64, prev: u64, out: &mut Vec<u8>) {
        let head = match self {
            NodeData::Leaf { right, .. } => {
                HeadFields { kind: KIND_LEAF, level: 0, leftmost: 0, right: *right, lid, version, prev }
            }
            NodeData::Interior { level, leftmost, .. } => {
                HeadFields { kind: KIND_INTERIOR, level: *level, leftmost: *leftmost, right: 0, lid, version, prev }
            }
        };
        encode_node(
            node_size,
            head,
            self.len(),
            |i| self.key(i),
            |i| self.item_len(i),
            |i, out| self.put_item(i, out),
            out,
        );
    }

    fn put_item(&self, i: usize, out: &mut Vec<u8>) {
        match self {
            NodeData::Leaf { items, .. } => put_leaf_item(out, &items[i].0, &items[i].1.as_ref()),
            NodeData::Interior { items, .. } => {
                let (k, c) = &items[i];
                put_varint(out, k.len() as u32);
                out.extend_from_slice(k);
                out.extend_from_slice(&c.to_le_bytes());
            }
        }
    }
}

/// The header fields of a node image that the encoder is given (the others describe the blocks
/// it lays out). See docs/storage-format.md §2.1.
struct HeadFields {
    /// [`KIND_LEAF`] or [`KIND_INTERIOR`].
    kind: u8,
    /// 0 for leaves; a parent's level is its children's plus one.
    level: u8,
    /// Interior: the child left of the first separator (0 for leaves).
    leftmost: u64,
    /// Leaf: the next leaf's LID (0 for the last leaf and for interior nodes).
    right: u64,
    /// The node's logical id.
    lid: u64,
    /// The write version that creates this buffer.
    version: u64,
    /// The buffer holding the node's state before this version (0: none).
    prev: u64,
}

/// Encodes a node image from `n` items given by accessors: chooses shortcuts (segments of similar
/// size, at least `clamp(node_size / 32, 32, 256)` bytes), writes the header, the shortcut block and
/// the sorted block.
fn encode_node<'k>(
    node_size: u32,
    head: HeadFields,
    n: usize,
    key: impl Fn(usize) -> &'k [u8],
    item_len: impl Fn(usize) -> usize,
    mut put_item: impl FnMut(usize, &mut Vec<u8>),
    out: &mut Vec<u8>,
) {
    let total: usize = (0..n).map(&item_len).sum();
    let cap = shortcut_capacity(node_size);
    let min_seg = (node_size as usize / 32).clamp(32, 256);
    let avg_key = (0..n).map(|i| key(i).len()).sum::<usize>().checked_div(n).unwrap_or(1);
    let max_sc = cap / (SHORTCUT_OVERHEAD + avg_key);
    let target = min_seg.max(total / (max_sc + 1));
    let mut chosen: Vec<(usize, usize)> = Vec::new(); // (item index, item position)
    let (mut acc, mut used, mut pos) = (0usize, 0usize, 0usize);
    for i in 0..n {
        let k = key(i);
        if i > 0 && acc >= target && used + SHORTCUT_OVERHEAD + k.len() <= cap {
            chosen.push((i, pos));
            used += SHORTCUT_OVERHEAD + k.len();
            acc = 0;
        }
        let l = item_len(i);
        acc += l;
        pos += l;
    }
    let sorted_start = HDR + used;
    out.clear();
    out.resize(HDR, 0);
    let mut eo = HDR + 2 * chosen.len();
    for &(i, _) in &chosen {
        out.extend_from_slice(&(eo as u16).to_le_bytes());
        eo += SHORTCUT_ENTRY_HDR + key(i).len();
    }
    for &(i, rel) in &chosen {
        out.extend_from_slice(&((sorted_start + rel) as u16).to_le_bytes());
        out.extend_from_slice(&(key(i).len() as u16).to_le_bytes());
        out.extend_from_slice(key(i));
    }
    debug_assert_eq!(out.len(), sorted_start);
    for i in 0..n {
        put_item(i, out);
    }
    let sorted_end = out.len() as u32;
    assert!(sorted_end <= node_size, "node image of {sorted_end} B exceeds the node size");
    out[0] = head.kind;
    out[1] = head.level;
    out[2..4].copy_from_slice(&(chosen.len() as u16).to_le_bytes());
    out[4..8].copy_from_slice(&(sorted_start as u32).to_le_bytes());
    out[8..16].copy_from_slice(&size_word(sorted_end, 0).to_le_bytes());
    out[16..24].copy_from_slice(&head.version.to_le_bytes());
    out[24..32].copy_from_slice(&head.prev.to_le_bytes());
    out[32..40].copy_from_slice(&head.lid.to_le_bytes());
    out[40..48].copy_from_slice(&head.leftmost.to_le_bytes());
    out[48..56].copy_from_slice(&head.right.to_le_bytes());
    out[56..60].copy_from_slice(&sorted_end.to_le_bytes());
    out[60..64].copy_from_slice(&(n as u32).to_le_bytes());
}

/// Encodes a log entry; the put/blob/external flags are derived from `val`.
pub(crate) fn encode_log_entry(
    out: &mut Vec<u8>,
    equal: bool,
    hint: u8,
    bp: u32,
    delta: u32,
    key: &[u8],
    val: ValRef<'_>,
) {
    let flags = if equal { LOG_EQUAL } else { 0 }
        | match val {
            ValRef::Inline(_) => LOG_PUT,
            ValRef::Blob { .. } => LOG_PUT | LOG_BLOB,
            ValRef::Ext { .. } => LOG_PUT | LOG_EXT,
            ValRef::Tombstone => 0,
        };
    out.clear();
    out.push(flags);
    out.push(hint);
    out.extend_from_slice(&(bp as u16).to_le_bytes());
    out.extend_from_slice(&delta.to_le_bytes());
    put_varint(out, key.len() as u32);
    match val {
        ValRef::Tombstone => out.extend_from_slice(key),
        ValRef::Inline(b) => {
            put_varint(out, b.len() as u32);
            out.extend_from_slice(key);
            out.extend_from_slice(b);
        }
        ValRef::Blob { off: word, len } | ValRef::Ext { ptr: word, len } => {
            put_varint(out, len);
            out.extend_from_slice(key);
            out.extend_from_slice(&word.to_le_bytes());
        }
    }
}
