//! Wait-free reads of one MVCC snapshot: version-chain resolution, descent, get, ordered leaf
//! iteration with order hints and back pointers, scan and floor scan. [`Tree`] also holds the one
//! implementation of the public read API: [`super::Snapshot`] and [`super::Writer`] wrap it.
//!
//! Every loop here is bounded by the arena's geometry (node bytes, heap pages, 64 levels), and no
//! step waits for or retries because of the writer: a reader that meets a buffer newer than its
//! read version follows the buffer's old-version pointer instead.

use std::cmp::Ordering as CmpOrdering;
use std::sync::atomic::Ordering;

use super::node::{Header, LOG_EQUAL, LogEntry, MAX_LOG_ENTRIES, Node, ValRef, cmp_keys, eq_keys, value_bytes};
use crate::arena::{Arena, PT_RETIRED, SB_NONCE, SB_ROOT, split_root_word};
use crate::error::{Error, Result};

/// Trees deeper than this are corrupt (a 64-level tree of 512 B nodes holds more than 2^64 keys).
const MAX_HEIGHT: usize = 64;

/// A snapshot of the tree at read version `rv`.
///
/// Invariant (why reading node memory through it is sound): a `Tree` exists only while `rv` is
/// pinned in a reader slot ([`Tree::pinned`]) or in the hands of the tree's single writer
/// ([`Tree::of_writer`]), so every buffer it reaches from the page table at `rv` stays immutable
/// while it is used (`arena::shm`, contract rule 1).
#[derive(Clone, Copy)]
pub(crate) struct Tree<'a> {
    pub(crate) arena: &'a Arena,
    pub(crate) rv: u64,
    /// The device's own copy of the page table (None: read the arena's).
    pub(crate) pages: Option<&'a [u64]>,
    /// The device's interior-node cache.
    pub(crate) cache: Option<&'a super::cache::NodeCache>,
    /// Counts node buffers visited.
    pub(crate) visits: Option<&'a std::cell::Cell<u64>>,
    /// Counts start hints used and not used (stale).
    pub(crate) hints: Option<&'a std::cell::Cell<[u64; 2]>>,
}

/// The child of interior `node` to follow for `key`: the child of the largest separator `<= key`
/// (`< key` when `strict`), or the leftmost child. Also returns that separator.
#[inline]
pub(crate) fn child_for<'a>(node: &Node<'a>, key: &[u8], strict: bool) -> Result<(u64, Option<&'a [u8]>)> {
    let (mut pos, end) = node.segment(key, strict)?;
    let mut best = None;
    while pos < end {
        let (k, c, next) = node.interior_item(pos)?;
        let o = cmp_keys(k, key);
        let before = o.is_lt() || (!strict && o.is_eq());
        if !before {
            break;
        }
        best = Some((k, c));
        pos = next;
    }
    Ok(match best {
        Some((k, c)) => (c, Some(k)),
        None => (node.h.leftmost, None),
    })
}

impl<'a> Tree<'a> {
    /// A snapshot at `rv`, reading the arena's page table, uncounted.
    ///
    /// # Safety
    /// `rv` must stay pinned in a reader slot of `arena` for as long as the tree (and anything
    /// read through it) is used.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn pinned(arena: &'a Arena, rv: u64) -> Tree<'a> {
        Tree { arena, rv, pages: None, cache: None, visits: None, hints: None }
    }

    /// The writer's view of its own tree at its newest version: nobody else writes the arena,
    /// and the writer cannot write while it is borrowed.
    pub(crate) fn of_writer(w: &'a super::Writer) -> Tree<'a> {
        Tree { arena: w.arena_ref(), rv: w.version(), pages: None, cache: None, visits: None, hints: None }
    }

    /// This tree reading through a device's page-table copy and node cache, counting visits.
    pub(crate) fn with_device(
        mut self,
        device: Option<(&'a [u64], &'a super::cache::NodeCache)>,
        visits: &'a std::cell::Cell<u64>,
        hints: &'a std::cell::Cell<[u64; 2]>,
    ) -> Tree<'a> {
        self.pages = device.map(|d| d.0);
        self.cache = device.map(|d| d.1);
        self.visits = Some(visits);
        self.hints = Some(hints);
        self
    }

    /// A stored value as a public [`super::Entry`] (reading a blob's bytes).
    #[allow(unsafe_code)]
    pub(crate) fn entry(&self, v: ValRef<'a>) -> Result<super::Entry<'a>> {
        Ok(match v {
            ValRef::Ext { ptr, len } => super::Entry::Pointer { ptr, len },
            ValRef::Tombstone => super::Entry::Tombstone,
            // SAFETY: `v` was read from a node this tree reached; its blob is published with it
            // and immutable while the tree is used (the tree's invariant).
            v => super::Entry::Value(unsafe { value_bytes(self.arena, v) }?),
        })
    }

    /// A value's bytes (reading a blob).
    #[allow(unsafe_code)]
    fn bytes_of(&self, v: ValRef<'a>) -> Result<&'a [u8]> {
        // SAFETY: as in `entry`.
        unsafe { value_bytes(self.arena, v) }
    }

    fn max_steps(&self) -> u64 {
        self.arena.layout.heap_pages + 1
    }

    /// The buffer of node `lid` as of this snapshot: the newest version `<= rv`.
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) fn resolve(&self, lid: u64) -> Result<Node<'a>> {
        let entry = self.arena.layout.pt_entry(lid)?;
        // (A retired node's entry still leads to its buffers: readers of older versions use them.)
        let mut off = self.page_entry(lid)? & !PT_RETIRED;
        if let Some(image) = self.cache.and_then(|c| c.get(lid, off)) {
            let node = Node::from_copy(image, off, self.arena.layout.node_size)?;
            // A copy newer than the snapshot: walk the old versions in host memory instead.
            if node.h.version <= self.rv {
                if let Some(v) = self.visits {
                    v.set(v.get() + 1);
                }
                if let Some(c) = self.cache {
                    c.hit();
                }
                return Ok(node);
            }
        }
        for step in 0..self.max_steps() {
            if off == 0 {
                return Err(Error::corrupt(entry, "no version of the node is old enough for the snapshot"));
            }
            // SAFETY: `off` comes from the page table or an old-version pointer read under this
            // tree's pin (the tree's invariant): its published bytes are immutable meanwhile.
            let h = unsafe { Header::read(self.arena, off) }?;
            if let Some(v) = self.visits {
                v.set(v.get() + 1);
            }
            if step == 0
                && h.kind == super::node::KIND_INTERIOR
                && let Some(c) = self.cache
            {
                c.miss(lid, off);
            }
            if step == 0 && h.lid != lid {
                return Err(Error::corrupt(off, "page table maps a LID to another node's buffer"));
            }
            if h.version <= self.rv {
                // SAFETY: as above; `h` is the header just read from that buffer.
                return unsafe { Node::from_header(self.arena, h) };
            }
            off = h.prev;
        }
        Err(Error::corrupt(entry, "old-version chain does not end"))
    }

    /// `lid`'s page-table entry as this reader sees it (its copy, on a device).
    fn page_entry(&self, lid: u64) -> Result<u64> {
        Ok(match self.pages {
            Some(table) => table.get(lid as usize).copied().unwrap_or(0),
            None => self.arena.page_entry(lid, Ordering::Acquire)?,
        })
    }

    /// The arena's nonce (what start hints name it by).
    pub(crate) fn nonce(&self) -> u64 {
        self.arena.load(SB_NONCE, Ordering::Acquire)
    }

    /// The node `hint` names, if the hint is valid for `key` at this snapshot: the same arena,
    /// `key` within the hint's fences, the node not retired and at the version the hint expects.
    /// A node keeps its key range while its version is unchanged and it is not retired (its range
    /// changes only by a split or a merge, which rewrite or retire it), so a valid hint's fences
    /// are still the node's. Any doubt (an entry that no longer resolves, a reused id) is a miss.
    fn hinted(&self, key: &[u8], hint: &super::StartHint<'_>) -> Option<Node<'a>> {
        let node = self.hint_node(key, hint);
        if let Some(c) = self.hints {
            let [used, missed] = c.get();
            c.set(if node.is_some() { [used + 1, missed] } else { [used, missed + 1] });
        }
        node
    }

    /// [`Tree::hinted`], uncounted.
    fn hint_node(&self, key: &[u8], hint: &super::StartHint<'_>) -> Option<Node<'a>> {
        let nonce = self.nonce();
        if nonce == 0 || hint.arena != nonce || cmp_keys(key, hint.lo).is_lt() {
            return None;
        }
        if hint.hi.is_some_and(|hi| !cmp_keys(key, hi).is_lt()) {
            return None;
        }
        let raw = self.page_entry(hint.lid).ok()?;
        if raw == 0 || raw & PT_RETIRED != 0 {
            return None;
        }
        let node = self.resolve(hint.lid).ok()?;
        (node.h.version == hint.version && node.h.lid == hint.lid).then_some(node)
    }

    /// Descends from `node` to the leaf for `key`.
    fn descend_from(&self, node: Node<'a>, key: &[u8], strict: bool) -> Result<Node<'a>> {
        Ok(self.descend_below(node, key, strict)?.0)
    }

    /// [`Tree::get_versioned`] starting where `hint` says if it is valid (else at the root); also
    /// answers whether the hint was used.
    pub(crate) fn get_versioned_hinted(
        &self,
        key: &[u8],
        hint: &super::StartHint<'_>,
    ) -> Result<(Option<(super::Entry<'a>, u64)>, bool)> {
        let Some(start) = self.hinted(key, hint) else {
            return Ok((self.get_versioned(key)?, false));
        };
        let leaf = self.descend_from(start, key, false)?;
        Ok((
            match self.leaf_get(&leaf, key)? {
                Some((v, version)) => Some((self.entry(v)?, version)),
                None => None,
            },
            true,
        ))
    }

    /// The children of each of `nodes` that is still current at this snapshot (as a hint to it
    /// would be valid) and interior: each child with its fences and version, and the index of its
    /// parent in `nodes`. With no `nodes`: the root itself (index 0). What a gateway builds its
    /// fat root from.
    pub(crate) fn expand(&self, nodes: &[super::TopNode]) -> Result<Vec<(usize, super::TopNode)>> {
        let mut out = Vec::new();
        if nodes.is_empty() {
            let lid = self.root_lid();
            let root = self.resolve(lid)?;
            let (version, level) = (root.h.version, root.h.level);
            out.push((0, super::TopNode { lid, version, level, lo: Vec::new(), hi: None }));
            return Ok(out);
        }
        let nonce = self.nonce();
        for (i, n) in nodes.iter().enumerate() {
            let hint =
                super::StartHint { arena: nonce, lid: n.lid, version: n.version, lo: &n.lo, hi: n.hi.as_deref() };
            if let Some(node) = self.hint_node(&n.lo, &hint) {
                self.children(i, &node, &n.lo, n.hi.as_deref(), &mut out)?;
            }
        }
        Ok(out)
    }

    /// Appends `node`'s children (if it is interior) with their fences inside `[lo, hi)`.
    fn children(
        &self,
        parent: usize,
        node: &Node<'a>,
        lo: &[u8],
        hi: Option<&[u8]>,
        out: &mut Vec<(usize, super::TopNode)>,
    ) -> Result<()> {
        if node.h.is_leaf() {
            return Ok(());
        }
        let mut from = lo.to_vec();
        let mut child = node.h.leftmost;
        let mut pos = node.h.sorted_start;
        let mut push = |lid: u64, lo: Vec<u8>, hi: Option<Vec<u8>>| -> Result<()> {
            let c = self.resolve(lid)?;
            out.push((parent, super::TopNode { lid, version: c.h.version, level: c.h.level, lo, hi }));
            Ok(())
        };
        while pos < node.h.sorted_end {
            let (k, c, next) = node.interior_item(pos)?;
            push(child, std::mem::replace(&mut from, k.to_vec()), Some(k.to_vec()))?;
            child = c;
            pos = next;
        }
        push(child, from, hi.map(<[u8]>::to_vec))
    }

    pub(crate) fn root_lid(&self) -> u64 {
        split_root_word(self.arena.load(SB_ROOT, Ordering::Acquire)).0
    }

    /// Descends to the leaf for `key`; returns it with the separator that bounds it from below.
    pub(crate) fn descend(&self, key: &[u8], strict: bool) -> Result<(Node<'a>, Option<&'a [u8]>)> {
        self.descend_below(self.resolve(self.root_lid())?, key, strict)
    }

    /// Descends from `node` to the leaf for `key`; returns it with the separator below `node`
    /// that bounds it from below (None if none was crossed).
    fn descend_below(&self, mut node: Node<'a>, key: &[u8], strict: bool) -> Result<(Node<'a>, Option<&'a [u8]>)> {
        let mut lower = None;
        for _ in 0..MAX_HEIGHT {
            if node.h.is_leaf() {
                return Ok((node, lower));
            }
            let (child, sep) = child_for(&node, key, strict)?;
            if sep.is_some() {
                lower = sep;
            }
            let next = self.resolve(child)?;
            if next.h.level as u16 + 1 != node.h.level as u16 {
                return Err(Error::corrupt(next.h.off, "child level does not follow its parent's"));
            }
            node = next;
        }
        Err(Error::corrupt(node.h.off, "tree deeper than 64 levels"))
    }

    /// Separator keys strictly inside `(lo, hi)` (`hi` empty: no upper bound), ascending, from
    /// the shallowest interior layer that holds at least `want` of them (or the deepest one):
    /// keys that cut the range into parts holding similar shares of the tree. Visits at most
    /// `want + 2` nodes per layer: only nodes whose ranges meet the range, and a layer is left
    /// as soon as it has enough keys.
    pub(crate) fn pivots(&self, lo: &[u8], hi: &[u8], want: usize) -> Result<Vec<&'a [u8]>> {
        let inside = |k: &[u8]| cmp_keys(k, lo).is_gt() && (hi.is_empty() || cmp_keys(k, hi).is_lt());
        let mut layer = vec![self.resolve(self.root_lid())?];
        for _ in 0..MAX_HEIGHT {
            if layer.iter().all(|n| n.h.is_leaf()) {
                return Ok(Vec::new());
            }
            let (mut keys, mut below) = (Vec::new(), Vec::new());
            for node in &layer {
                // The child left of the first separator covers everything below it.
                let mut child = node.h.leftmost;
                let mut pos = node.h.sorted_start;
                while pos < node.h.sorted_end {
                    let (k, c, next) = node.interior_item(pos)?;
                    // `child` covers [previous separator, k): wanted if k > lo.
                    if cmp_keys(k, lo).is_gt() {
                        below.push(child);
                    }
                    if !hi.is_empty() && !cmp_keys(k, hi).is_lt() {
                        child = 0; // past the range: nothing right of here is wanted
                        break;
                    }
                    if inside(k) {
                        keys.push(k);
                    }
                    child = c;
                    pos = next;
                }
                if child != 0 {
                    below.push(child);
                }
            }
            if keys.len() >= want || layer.iter().any(|n| n.h.level == 1) || below.len() > want + 2 {
                return Ok(keys);
            }
            layer = below.into_iter().map(|c| self.resolve(c)).collect::<Result<_>>()?;
        }
        Err(Error::corrupt(0, "tree deeper than 64 levels"))
    }

    /// The newest visible entry of `key` in `leaf`: None when absent, `Tombstone` when deleted
    /// with a kept tombstone (or a delete marker still in the log).
    #[inline]
    pub(crate) fn leaf_get(&self, leaf: &Node<'a>, key: &[u8]) -> Result<Option<(ValRef<'a>, u64)>> {
        leaf.prefetch_lookup();
        if leaf.h.log_count > 0 {
            // Entries are appended in version order: the last visible match is the newest.
            let mut found = None;
            let mut pos = leaf.h.sorted_end;
            for _ in 0..leaf.h.log_count {
                let e = leaf.log_entry(pos)?;
                let version = leaf.h.version.saturating_add(e.delta as u64);
                if eq_keys(e.key, key) && version <= self.rv {
                    found = Some((e.val, version));
                }
                pos = e.next;
            }
            if let Some(v) = found {
                return Ok(Some(v));
            }
        }
        let (mut pos, end) = leaf.segment(key, false)?;
        while pos < end {
            let (k, v, next) = leaf.leaf_item(pos)?;
            match cmp_keys(k, key) {
                // Sorted items carry their node's version (Honeycomb §3.2).
                CmpOrdering::Equal => return Ok(Some((v, leaf.h.version))),
                CmpOrdering::Greater => break,
                CmpOrdering::Less => pos = next,
            }
        }
        Ok(None)
    }

    // --- lookups over stored values (`ValRef`s: inline bytes, blob pointers, external pointers,
    // tombstones) -------------------------------------------------------------------------------

    /// The newest visible entry of `key` as stored, with its version (a log entry's own; a
    /// sorted item's node version).
    pub(crate) fn lookup(&self, key: &[u8]) -> Result<Option<(ValRef<'a>, u64)>> {
        let (leaf, _) = self.descend(key, false)?;
        self.leaf_get(&leaf, key)
    }

    /// SCAN over stored entries: visits up to `limit` visible entries with keys in `[lo, hi]` in
    /// ascending order; tombstones are passed to `f` (and counted) when `tombstones`.
    pub(crate) fn scan_stored<F>(&self, lo: &[u8], hi: &[u8], limit: usize, tombstones: bool, f: F) -> Result<usize>
    where
        F: FnMut(&'a [u8], ValRef<'a>) -> Result<()>,
    {
        self.scan_stored_from(lo, hi, limit, tombstones, None, f)
    }

    /// [`Tree::scan_stored`], its descent starting where `hint` says if it is valid for `lo`.
    pub(crate) fn scan_stored_from<F>(
        &self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        tombstones: bool,
        hint: Option<&super::StartHint<'_>>,
        mut f: F,
    ) -> Result<usize>
    where
        F: FnMut(&'a [u8], ValRef<'a>) -> Result<()>,
    {
        if limit == 0 || lo > hi {
            return Ok(0);
        }
        let leaf = match hint.and_then(|h| self.hinted(lo, h)) {
            Some(start) => self.descend_from(start, lo, false)?,
            None => self.descend(lo, false)?.0,
        };
        let (start, _) = leaf.segment(lo, false)?;
        let mut cur = LeafCursor::new(leaf, Some(start), self.rv)?;
        let mut count = 0;
        let mut past_lo = false;
        for _ in 0..self.max_steps() {
            while let Some((k, v)) = cur.next()? {
                if !past_lo {
                    if cmp_keys(k, lo).is_lt() {
                        continue;
                    }
                    past_lo = true;
                }
                if cmp_keys(k, hi).is_gt() {
                    return Ok(count);
                }
                if v == ValRef::Tombstone && !tombstones {
                    continue;
                }
                f(k, v)?;
                count += 1;
                if count == limit {
                    return Ok(count);
                }
            }
            let right = cur.node.h.right;
            if right == 0 {
                return Ok(count);
            }
            let node = self.resolve(right)?;
            if !node.h.is_leaf() {
                return Err(Error::corrupt(node.h.off, "leaf sibling is not a leaf"));
            }
            cur.reset(node)?;
        }
        Err(Error::corrupt(0, "leaf chain longer than the heap"))
    }

    /// The largest visible key `<= key` holding a value.
    pub(crate) fn floor_key(&self, key: &[u8]) -> Result<Option<&'a [u8]>> {
        Ok(self.floor_stored(key, false, false)?.map(|(k, _)| k))
    }

    /// The stored entry with the largest key `<= key` (`< key` when `strict`), tombstones
    /// included when `tombstones`.
    pub(crate) fn floor_stored(
        &self,
        key: &[u8],
        strict: bool,
        tombstones: bool,
    ) -> Result<Option<(&'a [u8], ValRef<'a>)>> {
        let (mut target, mut strict) = (key, strict);
        for _ in 0..self.max_steps() {
            let (leaf, lower) = self.descend(target, strict)?;
            let mut cur = LeafCursor::new(leaf, None, self.rv)?;
            let mut best = None;
            while let Some((k, v)) = cur.next()? {
                let o = cmp_keys(k, target);
                if !(o.is_lt() || (!strict && o.is_eq())) {
                    break;
                }
                if tombstones || v != ValRef::Tombstone {
                    best = Some((k, v));
                }
            }
            if best.is_some() {
                return Ok(best);
            }
            // Nothing here (the leaf's smaller keys were deleted): look left of this leaf.
            match lower {
                None => return Ok(None),
                Some(l) => (target, strict) = (l, true),
            }
        }
        Err(Error::corrupt(0, "floor search did not end"))
    }

    // --- the read API of `Snapshot` and `Writer` ------------------------------------------------
    // Both are thin wrappers over these (a snapshot adds its pin check): the names and results are
    // theirs, values as bytes and entries as public [`super::Entry`]s.

    /// GET: the value of `key`, if present.
    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<&'a [u8]>> {
        match self.lookup(key)? {
            None | Some((ValRef::Tombstone, _)) => Ok(None),
            Some((v, _)) => Ok(Some(self.bytes_of(v)?)),
        }
    }

    /// The entry of `key` as stored: a value, a pointer into the value log, or a tombstone.
    pub(crate) fn get_entry(&self, key: &[u8]) -> Result<Option<super::Entry<'a>>> {
        Ok(self.get_versioned(key)?.map(|(e, _)| e))
    }

    /// [`Tree::lookup`] as a public [`super::Entry`], with the entry's version.
    pub(crate) fn get_versioned(&self, key: &[u8]) -> Result<Option<(super::Entry<'a>, u64)>> {
        match self.lookup(key)? {
            Some((v, version)) => Ok(Some((self.entry(v)?, version))),
            None => Ok(None),
        }
    }

    /// Calls `f` for up to `limit` entries (tombstones included) with keys in `[lo, hi]`.
    pub(crate) fn scan_entries(
        &self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        f: impl FnMut(&'a [u8], super::Entry<'a>),
    ) -> Result<usize> {
        self.scan_entries_from(lo, hi, limit, None, f)
    }

    /// [`Tree::scan_entries`] starting where `hint` says, if it is valid for `lo`.
    pub(crate) fn scan_entries_from(
        &self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        hint: Option<&super::StartHint<'_>>,
        mut f: impl FnMut(&'a [u8], super::Entry<'a>),
    ) -> Result<usize> {
        self.scan_stored_from(lo, hi, limit, true, hint, |k, v| {
            f(k, self.entry(v)?);
            Ok(())
        })
    }

    /// The entry with the largest key `<= key` (`< key` when `strict`), tombstones included.
    pub(crate) fn floor_entry(&self, key: &[u8], strict: bool) -> Result<Option<(&'a [u8], super::Entry<'a>)>> {
        match self.floor_stored(key, strict, true)? {
            Some((k, v)) => Ok(Some((k, self.entry(v)?))),
            None => Ok(None),
        }
    }

    /// SCAN: up to `limit` values with keys in `[lo, hi]`, ascending.
    pub(crate) fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&'a [u8], &'a [u8])>> {
        let mut out = Vec::with_capacity(limit.min(1024));
        self.scan_with(lo, hi, limit, |k, v| out.push((k, v)))?;
        Ok(out)
    }

    /// SCAN, calling `f` for up to `limit` values with keys in `[lo, hi]`, ascending; returns the
    /// count.
    pub(crate) fn scan_with(
        &self,
        lo: &[u8],
        hi: &[u8],
        limit: usize,
        mut f: impl FnMut(&'a [u8], &'a [u8]),
    ) -> Result<usize> {
        self.scan_stored(lo, hi, limit, false, |k, v| {
            f(k, self.bytes_of(v)?);
            Ok(())
        })
    }

    /// Honeycomb's SCAN: like [`Tree::scan`] but starting at the largest key `<= lo` (or at `lo`
    /// when there is none).
    pub(crate) fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(&'a [u8], &'a [u8])>> {
        let start = self.floor_key(lo)?.unwrap_or(lo);
        let mut out = Vec::new();
        self.scan_with(start, hi, limit, |k, v| out.push((k, v)))?;
        Ok(out)
    }
}

/// Iterates a leaf's visible items in key order at one read version, merging the sorted block and
/// the log block without comparing keys across them: log entries are ordered by their one-byte
/// order hints (an insertion sort into an indirection array, as in Honeycomb §4.3), and placed
/// among sorted items by their back pointers.
pub(crate) struct LeafCursor<'a> {
    pub(crate) node: Node<'a>,
    rv: u64,
    /// Log entry positions in key order (newest first among equal keys).
    order: [u16; MAX_LOG_ENTRIES as usize],
    /// Back pointer of each entry in `order`, with bit 15 set for `LOG_EQUAL`.
    bps: [u16; MAX_LOG_ENTRIES as usize],
    n: usize,
    li: usize,
    sp: u32,
}

const BP_EQUAL: u16 = 1 << 15;

impl<'a> LeafCursor<'a> {
    /// A cursor positioned at sorted position `start` (a segment start) or the leaf's beginning.
    pub(crate) fn new(node: Node<'a>, start: Option<u32>, rv: u64) -> Result<LeafCursor<'a>> {
        let mut cur = LeafCursor {
            node,
            rv,
            order: [0; MAX_LOG_ENTRIES as usize],
            bps: [0; MAX_LOG_ENTRIES as usize],
            n: 0,
            li: 0,
            sp: 0,
        };
        cur.position(start)?;
        Ok(cur)
    }

    /// Moves the cursor to another leaf (in place: the arrays are not copied).
    pub(crate) fn reset(&mut self, node: Node<'a>) -> Result<()> {
        self.node = node;
        self.position(None)
    }

    fn position(&mut self, start: Option<u32>) -> Result<()> {
        let node = &self.node;
        let mut n = 0usize;
        let mut pos = node.h.sorted_end;
        for _ in 0..node.h.log_count {
            let e = node.log_entry(pos)?;
            let h = e.hint as usize;
            if h > n {
                return Err(Error::corrupt(node.h.off + pos as u64, "order hint beyond the log block"));
            }
            self.order.copy_within(h..n, h + 1);
            self.bps.copy_within(h..n, h + 1);
            self.order[h] = pos as u16;
            self.bps[h] = e.bp as u16 | if e.flags & LOG_EQUAL != 0 { BP_EQUAL } else { 0 };
            n += 1;
            pos = e.next;
        }
        let sp = start.unwrap_or(node.h.sorted_start);
        self.n = n;
        self.sp = sp;
        self.li = 0;
        // Starting at a shortcut item S (<= the scan's lower bound): skip log entries that sort
        // before S — back pointer before it, or at it for a smaller key. From the first segment
        // nothing is skipped (entries pointing at the first item may still be >= the bound).
        if sp > node.h.sorted_start {
            while self.li < n {
                let (bp, equal) = ((self.bps[self.li] & !BP_EQUAL) as u32, self.bps[self.li] & BP_EQUAL != 0);
                if bp > sp || (bp == sp && equal) {
                    break;
                }
                self.li += 1;
            }
        }
        Ok(())
    }

    fn visible(&self, e: &LogEntry<'_>) -> bool {
        self.node.h.version.saturating_add(e.delta as u64) <= self.rv
    }

    /// The next visible item (tombstones included), or None at the end of the leaf.
    #[inline]
    pub(crate) fn next(&mut self) -> Result<Option<(&'a [u8], ValRef<'a>)>> {
        let sorted_end = self.node.h.sorted_end;
        loop {
            let have_sorted = self.sp < sorted_end;
            let log_first = self.li < self.n && (!have_sorted || ((self.bps[self.li] & !BP_EQUAL) as u32) <= self.sp);
            if !log_first {
                if !have_sorted {
                    return Ok(None);
                }
                let (k, v, next) = self.node.leaf_item(self.sp)?;
                self.sp = next;
                return Ok(Some((k, v)));
            }
            // A group of entries for one key, newest first: the first visible one decides.
            let e = self.node.log_entry(self.order[self.li] as u32)?;
            let key = e.key;
            let equal = e.flags & LOG_EQUAL != 0 && e.bp == self.sp && have_sorted;
            let mut decided = if self.visible(&e) { Some(e) } else { None };
            self.li += 1;
            while self.li < self.n && self.bps[self.li] == self.bps[self.li - 1] {
                let g = self.node.log_entry(self.order[self.li] as u32)?;
                if !eq_keys(g.key, key) {
                    break;
                }
                if decided.is_none() && self.visible(&g) {
                    decided = Some(g);
                }
                self.li += 1;
            }
            let Some(d) = decided else { continue };
            if equal {
                // The log entry shadows the sorted item with the same key.
                self.sp = self.node.leaf_item(self.sp)?.2;
            }
            return Ok(Some((key, d.val)));
        }
    }
}
