//! One operation of a batch: the path from the root to the key's leaf, one pass over the leaf
//! (`probe`), the fast path that appends a log entry in place, and the leaf rewrite that merges
//! the log into a new buffer (handing over to `restructure` when the leaf overflows or underflows).

use std::sync::atomic::Ordering;

use super::reclaim::Garbage;
use super::{PathElem, Writer, own_node};
use crate::arena::{SB_ROOT, split_root_word};
use crate::btree::node::{
    BLOB_HDR, H_SIZE, LeafRefs, MAX_LOG_ENTRIES, Node, Val, ValRef, cmp_keys, encode_log_entry, size_word,
};
use crate::btree::read::{LeafCursor, child_for};
use crate::error::{Error, Result};

/// What one pass over a leaf tells the writer about a key.
struct Probe<'a> {
    /// The key's newest entry in the leaf (log first, then the sorted block).
    existing: Option<ValRef<'a>>,
    /// Position of the first sorted item with key >= the key, and whether it is equal.
    bp: u32,
    equal: bool,
    /// The key's rank among the log entries (it goes before older entries of the same key).
    hint: u32,
}

/// One pass over the leaf's log and one segment of its sorted block.
fn probe<'a>(node: &Node<'a>, key: &[u8]) -> Result<Probe<'a>> {
    let h = node.h;
    let (mut hint, mut logged) = (0u32, None);
    let mut pos = h.sorted_end;
    for _ in 0..h.log_count {
        let e = node.log_entry(pos)?;
        match cmp_keys(e.key, key) {
            std::cmp::Ordering::Less => hint += 1,
            std::cmp::Ordering::Equal => logged = Some(e.val),
            std::cmp::Ordering::Greater => {}
        }
        pos = e.next;
    }
    let (mut bp, end) = node.segment(key, false)?;
    let (mut equal, mut sorted) = (false, None);
    while bp < end {
        let (k, v, next) = node.leaf_item(bp)?;
        match cmp_keys(k, key) {
            std::cmp::Ordering::Less => bp = next,
            std::cmp::Ordering::Equal => {
                (equal, sorted) = (true, Some(v));
                break;
            }
            std::cmp::Ordering::Greater => break,
        }
    }
    Ok(Probe { existing: logged.or(sorted), bp, equal, hint })
}

impl Writer {
    /// The path from the root to the leaf for `key`, into `path` (reused across operations).
    fn path_to(&self, key: &[u8], path: &mut Vec<PathElem>) -> Result<()> {
        path.clear();
        let mut lid = split_root_word(self.arena.sb(SB_ROOT).load(Ordering::Relaxed)).0;
        for _ in 0..64 {
            let off = self.arena.page_entry(lid, Ordering::Relaxed)? & !crate::arena::PT_RETIRED;
            let node = own_node(&self.arena, off)?;
            path.push(PathElem { lid, off });
            if node.h.is_leaf() {
                return Ok(());
            }
            lid = child_for(&node, key, false)?.0;
        }
        Err(Error::corrupt(0, "tree deeper than 64 levels"))
    }

    pub(super) fn apply(&mut self, key: &[u8], value: ValRef<'_>, w: u64) -> Result<()> {
        let mut path = std::mem::take(&mut self.path);
        let r = self.apply_on_path(key, value, w, &mut path);
        self.path = path;
        r
    }

    fn apply_on_path(&mut self, key: &[u8], value: ValRef<'_>, w: u64, path: &mut Vec<PathElem>) -> Result<()> {
        self.path_to(key, path)?;
        let leaf_el = *path.last().expect("a path always ends at a leaf");
        let arena = self.arena.clone();
        let leaf = own_node(&arena, leaf_el.off)?;
        let p = probe(&leaf, key)?;
        let old_blob = match p.existing {
            Some(ValRef::Blob { off, len }) => Some((off, len)),
            _ => None,
        };
        let existed = !matches!(p.existing, None | Some(ValRef::Tombstone));
        if value == ValRef::Tombstone && !existed && !self.keep_tombstones {
            return Ok(());
        }
        // Values over the inline threshold arrive as blobs written before the batch began.
        let new_val = Val::from_ref(value);
        if !self.try_append(&leaf, &p, key, new_val.as_ref(), w)? {
            self.rewrite_leaf(path, key, new_val, w)?;
        }
        if let Some((off, len)) = old_blob {
            self.retire(w, Garbage::Blob(off, (BLOB_HDR + len as u64).div_ceil(self.arena.layout.node_size as u64)));
        }
        Ok(())
    }

    /// The fast path: appends a log entry and publishes it with one release store of the size
    /// word. Returns false when the leaf must be rewritten instead.
    #[allow(unsafe_code)]
    fn try_append(&mut self, node: &Node<'_>, p: &Probe<'_>, key: &[u8], val: ValRef<'_>, w: u64) -> Result<bool> {
        let h = node.h;
        let off = h.off;
        let delta = w - h.version;
        if h.log_count >= MAX_LOG_ENTRIES || delta > u32::MAX as u64 {
            return Ok(false);
        }
        let mut entry = std::mem::take(&mut self.buf);
        encode_log_entry(&mut entry, p.equal, p.hint as u8, p.bp, delta as u32, key, val);
        let new_end = h.log_end as usize + entry.len();
        let fits = new_end - h.sorted_end as usize <= self.arena.layout.log_threshold as usize
            && new_end <= self.arena.layout.node_size as usize;
        if fits {
            // SAFETY: the bytes past the published size word are no reader's: readers slice a
            // node only up to the size they loaded, and this entry is published below.
            unsafe { self.arena.map.write(off + h.log_end as u64, &entry) }?;
            self.arena.map.word(off + H_SIZE)?.store(size_word(new_end as u32, h.log_count + 1), Ordering::Release);
        }
        self.buf = entry;
        Ok(fits)
    }

    /// Merges the leaf's log (and this op) into a new buffer. The common case — the result
    /// neither overflows nor underflows — encodes straight from borrowed slices of the old buffer
    /// (valid until reclamation, which only runs between batches); splits and merges go through
    /// owned node data.
    fn rewrite_leaf(&mut self, path: &[PathElem], key: &[u8], val: Val, w: u64) -> Result<()> {
        let el = *path.last().expect("non-empty path");
        let arena = self.arena.clone();
        let node = own_node(&arena, el.off)?;
        if !node.h.is_leaf() {
            return Err(Error::corrupt(el.off, "path does not end at a leaf"));
        }
        let right = node.h.right;
        let mut items: Vec<(&[u8], ValRef<'_>)> =
            Vec::with_capacity((node.h.sorted_count + node.h.log_count + 1) as usize);
        let mut cur = LeafCursor::new(node, None, u64::MAX)?;
        while let Some((k, v)) = cur.next()? {
            if v != ValRef::Tombstone || self.keep_tombstones {
                items.push((k, v));
            }
        }
        let append = items.last().is_none_or(|(k, _)| key > *k);
        let remove = val == Val::Tombstone && !self.keep_tombstones;
        match items.binary_search_by(|(k, _)| (*k).cmp(key)) {
            Ok(i) if remove => {
                items.remove(i);
            }
            Ok(i) => items[i].1 = val.as_ref(),
            Err(_) if remove => {}
            Err(i) => items.insert(i, (key, val.as_ref())),
        }
        let refs = LeafRefs { items, right };
        let size = refs.sorted_bytes();
        let depth = path.len() - 1;
        if size <= self.leaf_cap && (depth == 0 || size >= self.leaf_cap / 4) {
            let mut buf = std::mem::take(&mut self.buf);
            refs.encode(arena.layout.node_size, el.lid, w, el.off, &mut buf);
            let r = self.write_image(&buf);
            self.buf = buf;
            let off = r?;
            self.map_lid(el.lid, off)?;
            self.retire(w, Garbage::Buffer(el.off));
            return Ok(());
        }
        let data = refs.to_owned_data();
        self.store(path, depth, data, w, append)
    }
}
