//! Node rewrites that change the tree's shape: a node over capacity is split in two (a new root
//! when the root splits), a node under a quarter full is merged with a sibling when the two fit
//! in three quarters of a node, a root left with one child hands over to it, and every change of
//! separators is propagated up the path.

use std::sync::atomic::Ordering;

use super::reclaim::Garbage;
use super::{PathElem, Writer, own_node};
use crate::arena::{SB_ROOT, root_word};
use crate::btree::node::{NodeData, Val, ValRef, interior_item_len, leaf_item_len};
use crate::btree::read::LeafCursor;
use crate::error::{Error, Result};

impl Writer {
    /// Decodes the newest state of the node buffer at `off`.
    fn decode(&self, off: u64) -> Result<NodeData> {
        let node = own_node(&self.arena, off)?;
        if node.h.is_leaf() {
            let right = node.h.right;
            let mut items = Vec::with_capacity(node.h.sorted_count as usize + node.h.log_count as usize);
            let mut cur = LeafCursor::new(node, None, u64::MAX)?;
            while let Some((k, v)) = cur.next()? {
                if v != ValRef::Tombstone || self.keep_tombstones {
                    items.push((k.to_vec(), Val::from_ref(v)));
                }
            }
            Ok(NodeData::Leaf { items, right })
        } else {
            let mut items = Vec::with_capacity(node.h.sorted_count as usize);
            let mut pos = node.h.sorted_start;
            while pos < node.h.sorted_end {
                let (k, c, next) = node.interior_item(pos)?;
                items.push((k.to_vec(), c));
                pos = next;
            }
            Ok(NodeData::Interior { level: node.h.level, leftmost: node.h.leftmost, items })
        }
    }

    /// The most sorted-block bytes a node like `data` may hold (a leaf keeps room for its log).
    fn cap(&self, data: &NodeData) -> usize {
        match data {
            NodeData::Leaf { .. } => self.leaf_cap,
            NodeData::Interior { .. } => self.interior_cap,
        }
    }

    /// Writes `data` as the new state of `path[depth]`, splitting, merging or collapsing the root
    /// as needed, and propagating separator changes up the path.
    pub(super) fn store(
        &mut self,
        path: &[PathElem],
        depth: usize,
        data: NodeData,
        w: u64,
        append: bool,
    ) -> Result<()> {
        let el = path[depth];
        let cap = self.cap(&data);
        let size = data.sorted_bytes();
        if size > cap {
            let (left, sep, right) = split(data, cap, append);
            if depth == 0 {
                return self.grow_root(el, left, sep, right, w);
            }
            let nl = self.alloc_lid()?;
            let left = set_right(left, nl);
            let off_r = self.write_node(nl, &right, w, el.off)?;
            self.map_lid(nl, off_r)?;
            self.replace(el, &left, w)?;
            let pel = path[depth - 1];
            let NodeData::Interior { level, leftmost, mut items } = self.decode(pel.off)? else {
                return Err(Error::corrupt(pel.off, "parent is not an interior node"));
            };
            let at = items.partition_point(|(k, _)| k.as_slice() < sep.as_slice());
            items.insert(at, (sep, nl));
            return self.store(path, depth - 1, NodeData::Interior { level, leftmost, items }, w, false);
        }
        if depth > 0 && size < cap / 4 {
            match self.try_merge(path, depth, data, w)? {
                None => return Ok(()),
                Some(data) => return self.replace(el, &data, w),
            }
        }
        if depth == 0
            && let NodeData::Interior { leftmost, ref items, .. } = data
            && items.is_empty()
        {
            return self.collapse_root(el, leftmost, w);
        }
        self.replace(el, &data, w)
    }

    /// Writes `data` into a new buffer for `el.lid` and swaps the page-table entry.
    fn replace(&mut self, el: PathElem, data: &NodeData, w: u64) -> Result<()> {
        let off = self.write_node(el.lid, data, w, el.off)?;
        self.map_lid(el.lid, off)?;
        self.retire(w, Garbage::Buffer(el.off));
        Ok(())
    }

    fn grow_root(&mut self, el: PathElem, left: NodeData, sep: Vec<u8>, right: NodeData, w: u64) -> Result<()> {
        let level = match &left {
            NodeData::Leaf { .. } => 1,
            NodeData::Interior { level, .. } => level + 1,
        };
        let (a, b) = (self.alloc_lid()?, self.alloc_lid()?);
        let left = set_right(left, b);
        let off_a = self.write_node(a, &left, w, el.off)?;
        let off_b = self.write_node(b, &right, w, el.off)?;
        self.map_lid(a, off_a)?;
        self.map_lid(b, off_b)?;
        self.replace(el, &NodeData::Interior { level, leftmost: a, items: vec![(sep, b)] }, w)?;
        self.height += 1;
        self.arena.sb(SB_ROOT).store(root_word(el.lid, self.height), Ordering::Release);
        Ok(())
    }

    fn collapse_root(&mut self, el: PathElem, mut child: u64, w: u64) -> Result<()> {
        // The root LID stays; it takes over its only child's contents.
        loop {
            let coff = self.arena.page_entry(child, Ordering::Relaxed)? & !crate::arena::PT_RETIRED;
            let data = self.decode(coff)?;
            self.retire(w, Garbage::Buffer(coff));
            self.retire(w, Garbage::Lid(child));
            self.height -= 1;
            match data {
                NodeData::Interior { leftmost, ref items, .. } if items.is_empty() => child = leftmost,
                data => {
                    self.replace(el, &data, w)?;
                    self.arena.sb(SB_ROOT).store(root_word(el.lid, self.height), Ordering::Release);
                    return Ok(());
                }
            }
        }
    }

    /// Merges an underfull node with a sibling under the same parent when the result fits in
    /// three quarters of a node. Returns the data back when no merge happened.
    fn try_merge(&mut self, path: &[PathElem], depth: usize, data: NodeData, w: u64) -> Result<Option<NodeData>> {
        let el = path[depth];
        let pel = path[depth - 1];
        let NodeData::Interior { level, leftmost, mut items } = self.decode(pel.off)? else {
            return Err(Error::corrupt(pel.off, "parent is not an interior node"));
        };
        if items.is_empty() {
            return Ok(Some(data));
        }
        let child = |i: usize| if i == 0 { leftmost } else { items[i - 1].1 };
        let idx = match (0..=items.len()).find(|&i| child(i) == el.lid) {
            Some(i) => i,
            None => return Err(Error::corrupt(pel.off, "child missing from its parent")),
        };
        // Pair with the smaller of the two neighbours under the same parent.
        let mut best: Option<(usize, usize, NodeData, PathElem)> = None;
        for (li, ri) in [(idx, idx + 1), (idx.wrapping_sub(1), idx)] {
            if ri > items.len() || li > items.len() {
                continue;
            }
            let sib_lid = child(if li == idx { ri } else { li });
            let sib_off = self.arena.page_entry(sib_lid, Ordering::Relaxed)? & !crate::arena::PT_RETIRED;
            let sib = self.decode(sib_off)?;
            if best.as_ref().is_none_or(|b| sib.sorted_bytes() < b.2.sorted_bytes()) {
                best = Some((li, ri, sib, PathElem { lid: sib_lid, off: sib_off }));
            }
        }
        let Some((li, ri, sib, sib_el)) = best else { return Ok(Some(data)) };
        let sep_len = match &data {
            NodeData::Leaf { .. } => 0,
            NodeData::Interior { .. } => interior_item_len(&items[ri - 1].0),
        };
        if data.sorted_bytes() + sib.sorted_bytes() + sep_len > self.cap(&data) * 3 / 4 {
            return Ok(Some(data));
        }
        let (left, left_el, right, right_el) =
            if li == idx { (data, el, sib, sib_el) } else { (sib, sib_el, data, el) };
        let sep = items.remove(ri - 1).0;
        let merged = match (left, right) {
            (NodeData::Leaf { items: mut a, .. }, NodeData::Leaf { items: b, right }) => {
                a.extend(b);
                NodeData::Leaf { items: a, right }
            }
            (
                NodeData::Interior { level, leftmost, items: mut a },
                NodeData::Interior { leftmost: rl, items: b, .. },
            ) => {
                a.push((sep, rl));
                a.extend(b);
                NodeData::Interior { level, leftmost, items: a }
            }
            _ => return Err(Error::corrupt(left_el.off, "siblings of different kinds")),
        };
        self.replace(left_el, &merged, w)?;
        self.retire(w, Garbage::Buffer(right_el.off));
        self.retire(w, Garbage::Lid(right_el.lid));
        self.store(path, depth - 1, NodeData::Interior { level, leftmost, items }, w, false).map(|()| None)
    }
}

/// Sets a leaf's right sibling.
fn set_right(data: NodeData, r: u64) -> NodeData {
    match data {
        NodeData::Leaf { items, .. } => NodeData::Leaf { items, right: r },
        d => d,
    }
}

/// Splits an overfull node in two by bytes: in half, or keeping ~90% on the left when keys are
/// appended in order (so sequential loads fill nodes). Returns (left, separator, right); a leaf's
/// right half inherits the original right sibling, and the caller links left to right.
fn split(data: NodeData, cap: usize, append: bool) -> (NodeData, Vec<u8>, NodeData) {
    let sizes: Vec<usize> = match &data {
        NodeData::Leaf { items, .. } => items.iter().map(|(k, v)| leaf_item_len(k, v)).collect(),
        NodeData::Interior { items, .. } => items.iter().map(|(k, _)| interior_item_len(k)).collect(),
    };
    let total: usize = sizes.iter().sum();
    let target = if append { total * 9 / 10 } else { total / 2 };
    let n = sizes.len();
    let mut i = 0;
    let mut acc = 0;
    while i < n && acc + sizes[i] <= target {
        acc += sizes[i];
        i += 1;
    }
    // Both halves must fit: move the boundary if one side is over capacity.
    let prefix = |i: usize| sizes[..i].iter().sum::<usize>();
    // A leaf keeps at least one item per side; an interior node moves item `i` up, so it keeps
    // at least one separator per side too (n >= 3 whenever it overflows: items are <= cap / 3).
    let (lo, hi) = match data {
        NodeData::Leaf { .. } => (1, n - 1),
        NodeData::Interior { .. } => (1, n - 2),
    };
    i = i.clamp(lo, hi);
    while i > lo && prefix(i) > cap {
        i -= 1;
    }
    while i < hi && total - prefix(i) > cap {
        i += 1;
    }
    match data {
        NodeData::Leaf { mut items, right } => {
            let r = items.split_off(i);
            let sep = r[0].0.clone();
            (NodeData::Leaf { items, right: 0 }, sep, NodeData::Leaf { items: r, right })
        }
        NodeData::Interior { level, leftmost, mut items } => {
            let mut r = items.split_off(i);
            let (sep, rl) = r.remove(0);
            (NodeData::Interior { level, leftmost, items }, sep, NodeData::Interior { level, leftmost: rl, items: r })
        }
    }
}
