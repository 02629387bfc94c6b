//! Which keys are popular (hKVS §4.5): a **moving-window admission** — a key becomes popular only
//! after it was read at least `K` times in the last `N` reads — in front of an **LRU-bounded
//! popular set** of at most `capacity` keys. A read of a popular key refreshes its recency; a
//! read that admits a key may evict the least recently read one. Each admission and eviction is
//! reported as an [`Event`] (what becomes a sync request or an invalidation for the keys'
//! replicas, issue 11).
//!
//! **The frequency gate** (on by default, [`PopularityConfig::gate`]): when the set is full, a key
//! that qualifies is admitted only if it was read more often in the window than the key it would
//! evict (TinyLFU's admission rule in front of the paper's LRU). Without it, every key read K times
//! in the window — at zipf 0.99 with a window of 800,000 gets, four times more keys than the
//! set holds — pushes out the least recently read popular key, so the set churns (a sync and an
//! invalidation per admission, copies that are dirty while in flight) and holds a recent sample
//! of the qualifying keys instead of the most read ones. hKVS §4.5 invites such a policy ("plug
//! in their custom policies"); `docs/hot-keys.md` has the measurements.
//!
//! Memory is bounded: the window holds `N` 64-bit key hashes and a count per distinct hash in it
//! (at most `N`), the set at most `capacity` keys. Counting by hash can only make a key popular
//! early when two keys' 64-bit hashes collide in one window — harmless (a replica of a key read
//! less often than `K`), and vanishingly rare.
//!
//! Each read hashes its key once (SipHash with a random key, so clients cannot aim collisions);
//! the window's counts and the set's index are keyed by that hash and hash it no further. The set
//! keeps each key beside its hash and compares them, so a colliding key is never taken for a
//! popular one — it is simply not admitted while the other is popular.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

/// A hasher for keys that are already 64-bit hashes: passes them through.
#[derive(Debug, Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64s are hashed here; fold anything else rather than lose it.
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, h: u64) {
        self.0 = h;
    }
}

/// A map keyed by a key's hash.
type ByHash<V> = HashMap<u64, V, BuildHasherDefault<Prehashed>>;

/// The admission rule and the set's bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PopularityConfig {
    /// Reads of a key within the window that make it popular (the paper's K = 4).
    pub k: u32,
    /// Reads the window spans (N).
    pub window: usize,
    /// Most popular keys.
    pub capacity: usize,
    /// When the set is full, admit a key only if the window saw it more often than the victim.
    /// (Without a window — `window` 0 — there are no counts, and the gate never refuses.)
    pub gate: bool,
}

impl Default for PopularityConfig {
    /// K = 4 as in the paper; a window of 100,000 reads (800 KiB of hashes; the paper's 800,000
    /// served 8M keys on one host) and 10,000 popular keys per region, gated by frequency.
    fn default() -> Self {
        PopularityConfig { k: 4, window: 100_000, capacity: 10_000, gate: true }
    }
}

/// A change of the popular set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The key became popular (replicate it).
    Admitted(Vec<u8>),
    /// The key stopped being popular (invalidate its replicas).
    Evicted(Vec<u8>),
}

/// The last `N` reads, as hashes, and how often each hash occurs among them.
#[derive(Debug)]
struct Window {
    ring: VecDeque<u64>,
    counts: ByHash<u32>,
    span: usize,
}

impl Window {
    /// Records a read of `h`; answers how often `h` occurs in the window now (this read too).
    fn push(&mut self, h: u64) -> u32 {
        if self.span == 0 {
            return 1;
        }
        if self.ring.len() == self.span
            && let Some(old) = self.ring.pop_front()
            && let Some(c) = self.counts.get_mut(&old)
        {
            *c -= 1;
            if *c == 0 {
                self.counts.remove(&old);
            }
        }
        self.ring.push_back(h);
        let c = self.counts.entry(h).or_insert(0);
        *c += 1;
        *c
    }

    /// How often `h` occurs in the window.
    fn count(&self, h: u64) -> u32 {
        self.counts.get(&h).copied().unwrap_or(0)
    }
}

/// A slot of the LRU list.
#[derive(Debug)]
struct Slot {
    key: Vec<u8>,
    hash: u64,
    prev: usize,
    next: usize,
}

/// No slot.
const NIL: usize = usize::MAX;

/// Keys by recency: a doubly linked list in a slab, indexed by the keys' hashes.
#[derive(Debug, Default)]
struct Lru {
    slots: Vec<Slot>,
    free: Vec<usize>,
    index: ByHash<usize>,
    /// Most recently read.
    head: Option<usize>,
    /// Least recently read.
    tail: Option<usize>,
}

impl Lru {
    fn unlink(&mut self, i: usize) {
        let (p, n) = (self.slots[i].prev, self.slots[i].next);
        if p == NIL {
            self.head = (n != NIL).then_some(n);
        } else {
            self.slots[p].next = n;
        }
        if n == NIL {
            self.tail = (p != NIL).then_some(p);
        } else {
            self.slots[n].prev = p;
        }
    }

    fn push_front(&mut self, i: usize) {
        self.slots[i].prev = NIL;
        self.slots[i].next = self.head.unwrap_or(NIL);
        if let Some(h) = self.head {
            self.slots[h].prev = i;
        }
        self.head = Some(i);
        if self.tail.is_none() {
            self.tail = Some(i);
        }
    }

    /// The slot of `key` (whose hash is `h`), if present.
    fn find(&self, h: u64, key: &[u8]) -> Option<usize> {
        self.index.get(&h).copied().filter(|&i| self.slots[i].key == key)
    }

    /// Moves `key` to the front if present.
    fn touch(&mut self, h: u64, key: &[u8]) -> bool {
        let Some(i) = self.find(h, key) else { return false };
        if self.head != Some(i) {
            self.unlink(i);
            self.push_front(i);
        }
        true
    }

    /// Inserts `key`, whose hash `h` no key in the set has.
    fn insert(&mut self, h: u64, key: Vec<u8>) {
        let slot = Slot { key, hash: h, prev: NIL, next: NIL };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        };
        self.index.insert(h, i);
        self.push_front(i);
    }

    fn pop_back(&mut self) -> Option<Vec<u8>> {
        let i = self.tail?;
        self.unlink(i);
        let key = std::mem::take(&mut self.slots[i].key);
        self.index.remove(&self.slots[i].hash);
        self.free.push(i);
        Some(key)
    }

    fn remove(&mut self, h: u64, key: &[u8]) -> bool {
        let Some(i) = self.find(h, key) else { return false };
        self.index.remove(&h);
        self.unlink(i);
        self.slots[i].key = Vec::new();
        self.free.push(i);
        true
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct Popularity {
    cfg: PopularityConfig,
    window: Window,
    set: Lru,
    hasher: std::collections::hash_map::RandomState,
}

impl Popularity {
    /// An empty tracker.
    pub fn new(cfg: PopularityConfig) -> Popularity {
        Popularity {
            cfg,
            window: Window { ring: VecDeque::new(), counts: ByHash::default(), span: cfg.window },
            set: Lru::default(),
            hasher: Default::default(),
        }
    }

    fn hash(&self, key: &[u8]) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write(key);
        h.finish()
    }

    /// Records a read of `key`; answers whether the key is popular after it, appending to
    /// `events` what changed (an admission, and the eviction it caused).
    pub fn read(&mut self, key: &[u8], events: &mut Vec<Event>) -> bool {
        let h = self.hash(key);
        let count = self.window.push(h);
        if self.set.touch(h, key) {
            return true;
        }
        if count < self.cfg.k || self.cfg.capacity == 0 || self.set.index.contains_key(&h) {
            return false;
        }
        if self.set.index.len() >= self.cfg.capacity {
            if self.cfg.gate
                && let Some(t) = self.set.tail
                && self.window.count(self.set.slots[t].hash) >= count
            {
                return false;
            }
            if let Some(victim) = self.set.pop_back() {
                events.push(Event::Evicted(victim));
            }
        }
        self.set.insert(h, key.to_vec());
        events.push(Event::Admitted(key.to_vec()));
        true
    }

    /// Whether `key` is popular now.
    pub fn is_popular(&self, key: &[u8]) -> bool {
        self.set.find(self.hash(key), key).is_some()
    }

    /// Takes `key` out of the popular set (it was deleted, or its region moved); true if it was
    /// in it. No event: the caller knows.
    pub fn forget(&mut self, key: &[u8]) -> bool {
        let h = self.hash(key);
        self.set.remove(h, key)
    }

    /// Popular keys now.
    pub fn len(&self) -> usize {
        self.set.index.len()
    }

    /// Whether no key is popular.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `n` popular keys read most often in the window, with those reads, most read first
    /// (O(the set's size)).
    pub fn top(&self, n: usize) -> Vec<(Vec<u8>, u32)> {
        let mut all: Vec<(u32, usize)> =
            self.set.index.values().map(|&i| (self.window.count(self.set.slots[i].hash), i)).collect();
        all.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(self.set.slots[a.1].key.cmp(&self.set.slots[b.1].key)));
        all.into_iter().take(n).map(|(c, i)| (self.set.slots[i].key.clone(), c)).collect()
    }

    /// Distinct keys (by hash) read in the window.
    pub fn distinct(&self) -> usize {
        self.window.counts.len()
    }

    /// The popular keys, most recently read first.
    pub fn keys(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(self.len());
        let mut at = self.set.head;
        while let Some(i) = at {
            out.push(self.set.slots[i].key.clone());
            at = (self.set.slots[i].next != NIL).then_some(self.set.slots[i].next);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rule, written the obvious way: the last N reads kept whole, the set as a recency list.
    struct Model {
        cfg: PopularityConfig,
        recent: VecDeque<Vec<u8>>,
        set: Vec<Vec<u8>>, // most recent first
    }

    impl Model {
        fn read(&mut self, key: &[u8], events: &mut Vec<Event>) -> bool {
            if self.cfg.window > 0 {
                if self.recent.len() == self.cfg.window {
                    self.recent.pop_front();
                }
                self.recent.push_back(key.to_vec());
            }
            let count = if self.cfg.window == 0 { 1 } else { self.recent.iter().filter(|k| *k == key).count() as u32 };
            if let Some(p) = self.set.iter().position(|k| k == key) {
                let k = self.set.remove(p);
                self.set.insert(0, k);
                return true;
            }
            if count < self.cfg.k || self.cfg.capacity == 0 {
                return false;
            }
            if self.set.len() >= self.cfg.capacity {
                if self.cfg.gate
                    && let Some(v) = self.set.last()
                    && self.recent.iter().filter(|k| *k == v).count() as u32 >= count
                {
                    return false;
                }
                if let Some(v) = self.set.pop() {
                    events.push(Event::Evicted(v));
                }
            }
            self.set.insert(0, key.to_vec());
            events.push(Event::Admitted(key.to_vec()));
            true
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Read(u8),
        Forget(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![9 => (0u8..24).prop_map(Op::Read), 1 => (0u8..24).prop_map(Op::Forget)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn admission_and_eviction_follow_the_model(
            k in 1u32..6, window in 0usize..40, capacity in 0usize..8, gate in any::<bool>(),
            ops in proptest::collection::vec(op(), 0..400),
        ) {
            let cfg = PopularityConfig { k, window, capacity, gate };
            let mut real = Popularity::new(cfg);
            let mut model = Model { cfg, recent: VecDeque::new(), set: Vec::new() };
            for op in ops {
                match op {
                    Op::Read(i) => {
                        let key = vec![b'k', i];
                        let (mut e1, mut e2) = (Vec::new(), Vec::new());
                        let a = real.read(&key, &mut e1);
                        let b = model.read(&key, &mut e2);
                        prop_assert_eq!(a, b);
                        prop_assert_eq!(e1, e2);
                    }
                    Op::Forget(i) => {
                        let key = vec![b'k', i];
                        let was = model.set.iter().position(|k| *k == key).map(|p| model.set.remove(p)).is_some();
                        prop_assert_eq!(real.forget(&key), was);
                    }
                }
                prop_assert_eq!(real.keys(), model.set.clone());
                prop_assert!(real.len() <= capacity);
                prop_assert!(real.window.ring.len() <= window && real.window.counts.len() <= window);
            }
        }
    }

    #[test]
    fn a_key_read_k_times_in_the_window_becomes_popular_and_the_least_recent_goes() {
        let mut p = Popularity::new(PopularityConfig { k: 4, window: 10, capacity: 2, gate: false });
        let mut ev = Vec::new();
        for _ in 0..3 {
            assert!(!p.read(b"a", &mut ev));
        }
        assert!(p.read(b"a", &mut ev), "fourth read admits");
        assert_eq!(ev, [Event::Admitted(b"a".to_vec())]);
        // Reads spread too thin never admit: 4 reads of "x" 10 reads apart.
        ev.clear();
        for _ in 0..4 {
            assert!(!p.read(b"x", &mut ev));
            for f in 0..9u8 {
                p.read(&[b'f', f], &mut ev);
            }
        }
        assert!(!p.is_popular(b"x") && ev.is_empty());
        for key in [b"b", b"c"] {
            for _ in 0..4 {
                p.read(key, &mut ev);
            }
        }
        // "a" was least recently read when "c" came in.
        assert_eq!(ev, [Event::Admitted(b"b".to_vec()), Event::Evicted(b"a".to_vec()), Event::Admitted(b"c".to_vec())]);
        assert_eq!(p.keys(), [b"c".to_vec(), b"b".to_vec()]);
    }

    #[test]
    fn with_the_gate_a_full_set_admits_only_keys_read_more_often_than_its_victim() {
        let mut p = Popularity::new(PopularityConfig { k: 2, window: 40, capacity: 2, gate: true });
        let mut ev = Vec::new();
        for key in [b"a", b"b"] {
            for _ in 0..5 {
                p.read(key, &mut ev);
            }
        }
        ev.clear();
        // "c" qualifies (K = 2) but "a", the victim, was read 5 times: "c" waits.
        for _ in 0..5 {
            assert!(!p.read(b"c", &mut ev));
        }
        assert!(ev.is_empty() && p.keys() == [b"b".to_vec(), b"a".to_vec()]);
        assert!(p.read(b"c", &mut ev), "the sixth read outnumbers the victim's five");
        assert_eq!(ev, [Event::Evicted(b"a".to_vec()), Event::Admitted(b"c".to_vec())]);
    }

    /// The reason for the gate: at zipf 0.99, with many more keys reaching K in the window than
    /// the set holds, plain LRU churns and holds a recent sample of them; gated, the set settles
    /// on the most read keys — more of the reads fall on popular keys, with far fewer syncs.
    #[test]
    fn at_zipf_0_99_the_gate_keeps_the_most_read_keys_with_less_churn() {
        let n = 20_000usize;
        let weights: Vec<f64> = (1..=n).map(|r| (r as f64).powf(-0.99)).collect();
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for w in &weights {
            sum += w;
            cdf.push(sum);
        }
        let run = |gate: bool| {
            let mut rng = 0x9E37_79B9_7F4A_7C15u64; // xorshift64: a fixed, repeatable stream
            let mut uniform = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 11) as f64 / (1u64 << 53) as f64
            };
            let mut p = Popularity::new(PopularityConfig { k: 4, window: 50_000, capacity: 200, gate });
            let (mut hits, mut events) = (0u64, 0usize);
            let mut ev = Vec::new();
            for i in 0..400_000 {
                let x = uniform() * sum;
                let rank = cdf.partition_point(|c| *c < x);
                let key = (rank as u32).to_be_bytes();
                // A replica can serve only a key popular (and synced) before the read.
                let popular = p.is_popular(&key);
                p.read(&key, &mut ev);
                if i >= 200_000 {
                    hits += popular as u64;
                    events += ev.len();
                }
                ev.clear();
            }
            (hits as f64 / 200_000.0, events)
        };
        let (lru_share, lru_events) = run(false);
        let (gated_share, gated_events) = run(true);
        eprintln!(
            "popular-key share of reads: LRU {lru_share:.3} ({lru_events} events), gated {gated_share:.3} ({gated_events} events)"
        );
        // The 200 most read of 20,000 keys take H(200)/H(20,000) of the reads, 54.8%.
        assert!(gated_share > 0.48, "gated: {gated_share:.3} of reads on popular keys");
        assert!(gated_share > lru_share + 0.05, "gated {gated_share:.3} vs LRU {lru_share:.3}");
        assert!(gated_events * 5 < lru_events, "gated {gated_events} events vs LRU {lru_events}");
    }

    /// The set is indexed by hash: a key whose hash collides with a popular key's is never taken
    /// for it (not found, not refreshed, not removed in its place).
    #[test]
    fn a_key_colliding_with_a_popular_key_s_hash_is_not_taken_for_it() {
        let mut set = Lru::default();
        set.insert(7, b"a".to_vec());
        assert_eq!(set.find(7, b"a"), Some(0));
        assert_eq!(set.find(7, b"b"), None);
        assert!(!set.touch(7, b"b") && !set.remove(7, b"b"));
        assert_eq!(set.pop_back(), Some(b"a".to_vec()));
        assert!(set.index.is_empty());
    }

    #[test]
    fn the_top_keys_are_the_most_read_popular_ones() {
        let mut p = Popularity::new(PopularityConfig { k: 2, window: 100, capacity: 3, gate: false });
        let mut ev = Vec::new();
        for (key, n) in [(b"a", 5), (b"b", 9), (b"c", 2), (b"d", 1)] {
            for _ in 0..n {
                p.read(key, &mut ev);
            }
        }
        assert_eq!(p.top(2), vec![(b"b".to_vec(), 9), (b"a".to_vec(), 5)]);
        assert_eq!(p.top(10).len(), 3, "only popular keys (d was read once)");
    }
}
