//! The client's **lookup table of replicated keys** (hKVS §4.2: the client learns from the
//! `replicated` flag which keys it may read from replicas) and the counts of reads by where they
//! were served. Bounded: at most `capacity` keys, the oldest entry forgotten first (a forgotten
//! key is learnt again from its next read at the primary).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The keys, and the order they were learnt in (for eviction).
type Keys = (HashSet<Vec<u8>>, VecDeque<Vec<u8>>);

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct HotKeyTable {
    capacity: usize,
    inner: Mutex<Keys>,
}

impl HotKeyTable {
    pub(crate) fn new(capacity: usize) -> HotKeyTable {
        HotKeyTable { capacity, inner: Mutex::new((HashSet::new(), VecDeque::new())) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn contains(&self, key: &[u8]) -> bool {
        self.capacity > 0 && self.lock().0.contains(key)
    }

    /// Learns whether `key` is replicated (a primary's answer said so).
    pub(crate) fn learn(&self, key: &[u8], replicated: bool) {
        if self.capacity == 0 {
            return;
        }
        let mut t = self.lock();
        let (set, order) = &mut *t;
        if !replicated {
            set.remove(key);
            return;
        }
        if set.contains(key) {
            return;
        }
        while set.len() >= self.capacity {
            match order.pop_front() {
                Some(old) => {
                    set.remove(&old);
                }
                None => break,
            }
        }
        set.insert(key.to_vec());
        order.push_back(key.to_vec());
        // Keys removed from the set still sit in `order`: compact it when it doubled.
        if order.len() > 2 * self.capacity {
            order.retain(|k| set.contains(k));
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().0.len()
    }
}

/// Gets served by a primary and by a replica.
#[derive(Debug, Default)]
pub struct ReadCounts {
    /// Gets answered by the key's primary.
    pub primary: AtomicU64,
    /// Gets answered by a replica (a backup's device, from its replica table).
    pub replica: AtomicU64,
}

impl ReadCounts {
    /// (primary, replica) now.
    pub fn get(&self) -> (u64, u64) {
        (self.primary.load(Ordering::Relaxed), self.replica.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_learns_forgets_and_stays_bounded() {
        let t = HotKeyTable::new(3);
        for i in 0..10u8 {
            t.learn(&[i], true);
            assert!(t.len() <= 3);
        }
        assert!(t.contains(&[9]) && t.contains(&[8]) && t.contains(&[7]) && !t.contains(&[6]));
        t.learn(&[8], false);
        assert!(!t.contains(&[8]));
        for _ in 0..100 {
            t.learn(&[1], true);
            t.learn(&[1], false);
        }
        assert!(t.lock().1.len() <= 6, "the order list is compacted");
        assert!(!HotKeyTable::new(0).contains(&[1]));
    }
}
