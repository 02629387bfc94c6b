//! Writer-private allocators: heap pages (node buffers and blob extents) and logical node ids.
//!
//! Neither lives in the arena: the arena is rebuilt from the durable store when a host restarts,
//! so only the single writer ever needs this state.

use std::collections::{BTreeMap, BTreeSet};

/// Allocates runs of heap pages with best-fit and coalescing on free.
pub(crate) struct PageAlloc {
    heap_off: u64,
    page: u64,
    total: u64,
    /// Pages `[bump, total)` have never been handed out.
    bump: u64,
    by_start: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    used: u64,
}

impl PageAlloc {
    pub(crate) fn new(heap_off: u64, page: u64, total: u64) -> Self {
        PageAlloc { heap_off, page, total, bump: 0, by_start: BTreeMap::new(), by_len: BTreeSet::new(), used: 0 }
    }

    /// Pages in use.
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// One past the highest page ever handed out.
    pub(crate) fn high_water(&self) -> u64 {
        self.bump
    }

    /// Pages free (free lists plus never-used).
    pub(crate) fn free(&self) -> u64 {
        self.total - self.used
    }

    /// Allocates `n` contiguous pages; returns the byte offset of the first.
    pub(crate) fn alloc(&mut self, n: u64) -> Option<u64> {
        debug_assert!(n > 0);
        let found = self.by_len.range((n, 0)..).next().copied();
        let start = if let Some((len, start)) = found {
            self.by_len.remove(&(len, start));
            self.by_start.remove(&start);
            if len > n {
                self.insert_free(start + n, len - n);
            }
            start
        } else if self.bump + n <= self.total {
            self.bump += n;
            self.bump - n
        } else {
            return None;
        };
        self.used += n;
        Some(self.heap_off + start * self.page)
    }

    /// Returns `n` pages starting at byte offset `off`.
    pub(crate) fn release(&mut self, off: u64, n: u64) {
        let mut start = (off - self.heap_off) / self.page;
        let mut len = n;
        debug_assert!(start + len <= self.bump, "freeing pages never allocated");
        self.used -= n;
        if let Some((&ps, &pl)) = self.by_start.range(..start).next_back()
            && ps + pl == start
        {
            self.remove_free(ps, pl);
            start = ps;
            len += pl;
        }
        if let Some(&nl) = self.by_start.get(&(start + len)) {
            self.remove_free(start + len, nl);
            len += nl;
        }
        if start + len == self.bump {
            self.bump = start;
        } else {
            self.insert_free(start, len);
        }
    }

    fn insert_free(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
    }

    fn remove_free(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
    }
}

/// Hands out logical node ids (LIDs), reusing freed ones.
pub(crate) struct LidAlloc {
    next: u64,
    cap: u64,
    free: Vec<u64>,
}

impl LidAlloc {
    pub(crate) fn new(first: u64, cap: u64) -> Self {
        LidAlloc { next: first, cap, free: Vec::new() }
    }

    pub(crate) fn alloc(&mut self) -> Option<u64> {
        if let Some(l) = self.free.pop() {
            return Some(l);
        }
        if self.next < self.cap {
            self.next += 1;
            Some(self.next - 1)
        } else {
            None
        }
    }

    pub(crate) fn release(&mut self, lid: u64) {
        self.free.push(lid);
    }

    /// Ids that can still be handed out.
    pub(crate) fn free(&self) -> u64 {
        self.cap - self.next + self.free.len() as u64
    }

    /// One past the highest LID ever handed out (the page table's used prefix).
    pub(crate) fn high_water(&self) -> u64 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Allocations never overlap, stay in the heap, and freeing everything returns every page.
        #[test]
        fn pages_never_overlap(ops in proptest::collection::vec((1u64..5, any::<bool>()), 1..200)) {
            let mut a = PageAlloc::new(4096, 512, 64);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (n, free) in ops {
                if free && !live.is_empty() {
                    let (off, n) = live.swap_remove(0);
                    a.release(off, n);
                } else if let Some(off) = a.alloc(n) {
                    prop_assert!(off >= 4096 && off + n * 512 <= 4096 + 64 * 512);
                    for &(o, m) in &live {
                        prop_assert!(off + n * 512 <= o || o + m * 512 <= off, "overlap");
                    }
                    live.push((off, n));
                }
                prop_assert_eq!(a.used(), live.iter().map(|x| x.1).sum::<u64>());
            }
            for (off, n) in live.drain(..) {
                a.release(off, n);
            }
            prop_assert_eq!(a.free(), 64);
            prop_assert!(a.alloc(64).is_some(), "coalescing restores one extent");
        }
    }
}
