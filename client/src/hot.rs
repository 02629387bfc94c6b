//! The client's **lookup table of replicated keys** (hKVS §4.2: the client learns from the
//! `replicated` flag which keys it may read from replicas) and the counts of reads by where they
//! were served. Bounded: at most `capacity` keys, the oldest entry forgotten first (a forgotten
//! key is learnt again from its next read at the primary).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The keys with the stamp they were learnt at, and the learning order (stale stamps are
/// skipped: a key forgotten and learnt again has a new one).
#[derive(Debug, Default)]
struct Keys {
    stamps: HashMap<Vec<u8>, u64>,
    order: VecDeque<(Vec<u8>, u64)>,
    next: u64,
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct HotKeyTable {
    capacity: usize,
    inner: Mutex<Keys>,
    /// Keys known (set under the lock): a table with none answers `contains` without locking
    /// or hashing (a read that misses a key being learnt goes to the primary, as it may).
    known: AtomicUsize,
}

impl HotKeyTable {
    pub(crate) fn new(capacity: usize) -> HotKeyTable {
        HotKeyTable { capacity, inner: Mutex::new(Keys::default()), known: AtomicUsize::new(0) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn contains(&self, key: &[u8]) -> bool {
        self.capacity > 0 && self.known.load(Ordering::Relaxed) > 0 && self.lock().stamps.contains_key(key)
    }

    /// Learns whether `key` is replicated (a primary's answer said so).
    pub(crate) fn learn(&self, key: &[u8], replicated: bool) {
        if self.capacity == 0 {
            return;
        }
        let mut t = self.lock();
        if !replicated {
            t.stamps.remove(key);
            self.known.store(t.stamps.len(), Ordering::Relaxed);
            return;
        }
        if t.stamps.contains_key(key) {
            return;
        }
        while t.stamps.len() >= self.capacity {
            let Some((old, stamp)) = t.order.pop_front() else { break };
            if t.stamps.get(&old) == Some(&stamp) {
                t.stamps.remove(&old);
            }
        }
        let stamp = t.next;
        t.next += 1;
        t.stamps.insert(key.to_vec(), stamp);
        self.known.store(t.stamps.len(), Ordering::Relaxed);
        t.order.push_back((key.to_vec(), stamp));
        // Entries of forgotten keys still sit in `order`: compact it when it doubled.
        if t.order.len() > 2 * self.capacity {
            let Keys { stamps, order, .. } = &mut *t;
            order.retain(|(k, s)| stamps.get(k) == Some(s));
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().stamps.len()
    }
}

/// Gets served by a primary and by a replica.
#[derive(Debug, Default)]
pub struct ReadCounts {
    /// Gets answered by the key's primary.
    pub primary: AtomicU64,
    /// Gets answered by a replica (a backup's device, from its replica table).
    pub replica: AtomicU64,
    /// Gets sent, by the consistency they asked: linearizable, bounded, extended, interleaved.
    pub by_mode: [AtomicU64; 4],
}

impl ReadCounts {
    /// (primary, replica) now.
    pub fn get(&self) -> (u64, u64) {
        (self.primary.load(Ordering::Relaxed), self.replica.load(Ordering::Relaxed))
    }

    /// The names of the consistency modes, in [`ReadCounts::by_mode`]'s order.
    pub const MODES: [&'static str; 4] = ["linearizable", "bounded", "extended", "interleaved"];

    /// Counts a get asking `c`.
    pub fn asked(&self, c: dpukv_proto::Consistency) {
        use dpukv_proto::Consistency::*;
        let i = match c {
            Linearizable => 0,
            Bounded { .. } => 1,
            Extended => 2,
            Interleaved => 3,
        };
        self.by_mode[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Gets sent by mode now, in [`ReadCounts::MODES`]' order.
    pub fn modes(&self) -> [u64; 4] {
        std::array::from_fn(|i| self.by_mode[i].load(Ordering::Relaxed))
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
        assert!(t.lock().order.len() <= 7, "the order list is compacted past twice the capacity");
        assert!(t.contains(&[9]) && t.contains(&[7]) && t.len() == 2);
        assert!(!HotKeyTable::new(0).contains(&[1]));
    }
}
