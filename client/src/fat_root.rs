//! The **fat root** (Fat-B+Tree, paper 003 §III-B/C; docs/hot-keys.md §9): per region, the top
//! of the region's tree the client caches — nodes with their ids, versions and fences — chosen
//! greedily by how often its gets fall in them, under a node budget. Each get carries a **start
//! hint**: the deepest cached node covering its key; the device starts there if the hint is
//! still valid, else at the root (a stale hint costs a visit, never a wrong answer).
//!
//! Building (in the background, one region at a time): from the root, a priority queue of
//! cached nodes by the number of recently sampled keys inside their fences; the most frequent
//! interior nodes are expanded (`tree_nodes`, 32 per request), their children cached and
//! queued, until the budget is spent; once no sampled key falls in an unexpanded interior node,
//! what is left of the budget goes layer by layer (shallowest first).
//! Rebuilt every `REBUILD_EVERY` (the tree changes under writes) and when the region's epoch
//! changes. Bounded: `budget` nodes and `SAMPLE` keys per region, at most `MAX_REGIONS` regions.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use dpukv_proto::limits::MAX_EXPAND;
use dpukv_proto::{StartHint, TreeNode};

/// Nodes expanded per `tree_nodes` request (their children must fit one reply).
const EXPAND_BATCH: usize = if MAX_EXPAND < 32 { MAX_EXPAND } else { 32 };

/// Keys sampled per region (one get in `SAMPLE_EVERY`).
const SAMPLE: usize = 4096;
const SAMPLE_EVERY: u64 = 4;
/// A fat root older than this is rebuilt.
pub(crate) const REBUILD_EVERY: Duration = Duration::from_secs(2);
/// Regions with a fat root at most.
const MAX_REGIONS: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first 8 bytes of `k`, big-endian, zero-padded: ordered as the keys are (a shorter key that
/// is a prefix of a longer one ties with it, and ties are decided on the whole keys).
fn prefix(k: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = k.len().min(8);
    b[..n].copy_from_slice(&k[..n]);
    u64::from_be_bytes(b)
}

/// A level's search index: the prefix the level's fences share (sorted: the second's and the
/// last's), the next 8 bytes of each fence (0 for a fence without the prefix), and per node
/// whether its upper fence is known without reading it: unbounded, or the next node's lower
/// fence (a level whose nodes are all cached is contiguous).
#[derive(Debug, Default)]
struct Index {
    common: Vec<u8>,
    prefixes: Vec<u64>,
    closed: Vec<bool>,
}

/// One region's cached top.
#[derive(Debug, Default)]
struct Built {
    arena: u64,
    epoch: u64,
    /// Per level (index: level), the cached nodes sorted by lower fence (once built), each as
    /// the start hint a get covered by it carries (shared with the requests, not copied).
    levels: Vec<Vec<Arc<StartHint>>>,
    /// Per level, the search index (built by `seal`).
    index: Vec<Index>,
    nodes: usize,
}

impl Built {
    /// The hint of the deepest cached node covering `key`.
    fn covering(&self, key: &[u8]) -> Option<&Arc<StartHint>> {
        self.levels.iter().zip(&self.index).find_map(|(level, ix)| {
            // The node with the largest lower fence <= key. Fences of a level share a prefix
            // (`ix.common`); the binary search runs over the next 8 bytes of each, a contiguous
            // array (not over fences behind pointers: cache misses), and only fences whose 8
            // bytes equal the key's are compared whole. Then every node before `i` starts at or
            // below the key and every node from `i` on above it (a larger 8-byte prefix means a
            // larger fence), so a node whose upper fence is the next one's lower fence needs no
            // look at it.
            let (from, to, sorted) = match key.strip_prefix(ix.common.as_slice()) {
                Some(rest) => {
                    let p = prefix(rest);
                    let from = ix.prefixes.partition_point(|x| *x < p);
                    (from, from + ix.prefixes[from..].partition_point(|x| *x == p), true)
                }
                None => (0, level.len(), false),
            };
            let i = from + level[from..to].partition_point(|h| h.node.lo.as_slice() <= key);
            let j = i.checked_sub(1)?;
            let h = level.get(j)?;
            (sorted && ix.closed[j] || h.node.hi.as_deref().is_none_or(|hi| key < hi)).then_some(h)
        })
    }

    fn insert(&mut self, n: TreeNode) {
        let l = n.level as usize;
        if self.levels.len() <= l {
            self.levels.resize_with(l + 1, Vec::new);
        }
        self.levels[l].push(Arc::new(StartHint { arena: self.arena, node: n }));
        self.nodes += 1;
    }

    /// Sorts each level by lower fence (nodes of one level have disjoint fences).
    fn seal(mut self) -> Built {
        for level in &mut self.levels {
            level.sort_unstable_by(|a, b| a.node.lo.cmp(&b.node.lo));
            level.dedup_by(|a, b| a.node.lo == b.node.lo);
        }
        self.index = self
            .levels
            .iter()
            .map(|l| {
                // The leftmost node's fence is often the empty key: the shared prefix is taken
                // from the second node on; fences without it sort before every key with it
                // (prefix 0, decided whole).
                let from = l.len().min(1);
                let fence = |i: usize| l.get(i).map_or(&[][..], |h| h.node.lo.as_slice());
                let (first, last) = (fence(from), fence(l.len().saturating_sub(1)));
                let common: Vec<u8> = first.iter().zip(last).take_while(|(a, b)| a == b).map(|(a, _)| *a).collect();
                let prefixes = l.iter().map(|h| h.node.lo.strip_prefix(common.as_slice()).map_or(0, prefix)).collect();
                let closed = (0..l.len())
                    .map(|i| match &l[i].node.hi {
                        None => true,
                        Some(hi) => l.get(i + 1).is_some_and(|n| n.node.lo == *hi),
                    })
                    .collect();
                Index { common, prefixes, closed }
            })
            .collect();
        self
    }
}

/// A region's fat root and what it is built from.
#[derive(Debug, Default)]
struct Region {
    built: RwLock<Option<(Arc<Built>, Instant)>>,
    sample: Mutex<VecDeque<Vec<u8>>>,
    building: AtomicBool,
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct FatRoots {
    budget: usize,
    regions: RwLock<HashMap<u32, Arc<Region>>>,
}

/// What a get's region wants done: nothing, or a (re)build started by the caller.
pub(crate) enum Wanted {
    Nothing,
    Build,
}

impl FatRoots {
    pub(crate) fn new(budget: usize) -> FatRoots {
        FatRoots { budget, regions: RwLock::new(HashMap::new()) }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.budget > 0
    }

    fn region(&self, id: u32) -> Arc<Region> {
        if let Some(r) = self.regions.read().unwrap_or_else(|e| e.into_inner()).get(&id) {
            return r.clone();
        }
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        if regions.len() >= MAX_REGIONS && !regions.contains_key(&id) {
            regions.clear();
        }
        regions.entry(id).or_default().clone()
    }

    /// The start hint for a get of `key` in region `id` at `epoch`, and whether the region's
    /// fat root should be (re)built now (the caller spawns [`FatRoots::build`]).
    ///
    /// Every get of every task of a client passes here, on whichever core runs it: the common
    /// path takes two read locks and clones one `Arc` (the hint), and touches no counter shared
    /// between cores — sampling counts per thread, and the fat root's age is looked at only
    /// when a key is sampled.
    pub(crate) fn hint(&self, id: u32, epoch: u64, key: &[u8]) -> (Option<Arc<StartHint>>, Wanted) {
        if !self.enabled() {
            return (None, Wanted::Nothing);
        }
        thread_local! {
            static GETS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
        }
        let sampled = GETS.with(|g| {
            g.set(g.get().wrapping_add(1));
            g.get().is_multiple_of(SAMPLE_EVERY)
        });
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let Some(r) = regions.get(&id) else {
            drop(regions);
            let r = self.region(id);
            lock(&r.sample).push_back(key.to_vec());
            let wanted = if r.building.swap(true, Ordering::AcqRel) { Wanted::Nothing } else { Wanted::Build };
            return (None, wanted);
        };
        if sampled {
            let mut s = lock(&r.sample);
            if s.len() == SAMPLE {
                s.pop_front();
            }
            s.push_back(key.to_vec());
        }
        let built = r.built.read().unwrap_or_else(|e| e.into_inner());
        let stale = built.as_ref().is_none_or(|(b, at)| b.epoch != epoch || sampled && at.elapsed() > REBUILD_EVERY);
        let wanted = if stale && !r.building.swap(true, Ordering::AcqRel) { Wanted::Build } else { Wanted::Nothing };
        let hint = built.as_ref().filter(|(b, _)| b.epoch == epoch).and_then(|(b, _)| b.covering(key).cloned());
        (hint, wanted)
    }

    /// Builds region `id`'s fat root with `expand` (a `tree_nodes` call: the arena's nonce and
    /// the children of the nodes given, each with its parent's index; the root for none).
    pub(crate) async fn build<F, Fut>(&self, id: u32, epoch: u64, expand: F)
    where
        F: Fn(Vec<TreeNode>) -> Fut,
        Fut: std::future::Future<Output = Option<(u64, Vec<(u16, TreeNode)>)>>,
    {
        let r = self.region(id);
        let sample: Vec<Vec<u8>> = lock(&r.sample).iter().cloned().collect();
        // A build that failed (a device that does not know `tree_nodes`, a moved region) leaves
        // an empty fat root: no hints, and no new try before `REBUILD_EVERY`.
        let b = self.greedy(epoch, &sample, expand).await.unwrap_or(Built { epoch, ..Built::default() });
        *r.built.write().unwrap_or_else(|e| e.into_inner()) = Some((Arc::new(b), Instant::now()));
        r.building.store(false, Ordering::Release);
    }

    async fn greedy<F, Fut>(&self, epoch: u64, sample: &[Vec<u8>], expand: F) -> Option<Built>
    where
        F: Fn(Vec<TreeNode>) -> Fut,
        Fut: std::future::Future<Output = Option<(u64, Vec<(u16, TreeNode)>)>>,
    {
        // Sampled keys in a node's fences: two binary searches in the sorted sample.
        let mut sorted: Vec<&[u8]> = sample.iter().map(Vec::as_slice).collect();
        sorted.sort_unstable();
        let freq = |n: &TreeNode| {
            let from = sorted.partition_point(|k| *k < n.lo.as_slice());
            let to = match n.hi.as_deref() {
                Some(hi) => sorted.partition_point(|k| *k < hi),
                None => sorted.len(),
            };
            to.saturating_sub(from)
        };
        let (arena, roots) = expand(Vec::new()).await?;
        let root = roots.into_iter().next()?.1;
        let mut b = Built { arena, epoch, ..Built::default() };
        // The queue: interior nodes not yet expanded, most frequent first; among nodes no sampled
        // key falls in, the shallowest first (what is left of the budget goes layer by layer).
        let mut queue: BinaryHeap<(usize, u8, u64, TreeNodeOrd)> = BinaryHeap::new();
        let mut seq = 0u64;
        let mut push = |queue: &mut BinaryHeap<_>, n: &TreeNode| {
            if n.level > 0 {
                seq += 1;
                queue.push((freq(n), n.level, u64::MAX - seq, TreeNodeOrd(n.clone())));
            }
        };
        push(&mut queue, &root);
        b.insert(root);
        while b.nodes < self.budget {
            let mut batch = Vec::new();
            while batch.len() < EXPAND_BATCH {
                match queue.pop() {
                    Some((_, _, _, TreeNodeOrd(n))) => batch.push(n),
                    None => break,
                }
            }
            if batch.is_empty() {
                break;
            }
            let (a, children) = expand(batch.clone()).await?;
            if a != arena {
                return None; // the arena changed while building: next time
            }
            // Parents a full reply left out (expanded whole or not at all) are asked again,
            // unless nothing at all came back (then they cannot be expanded).
            let last = children.last().map(|(p, _)| *p as usize);
            if let Some(last) = last {
                for n in &batch[last + 1..] {
                    push(&mut queue, n);
                }
            }
            for (_, c) in children {
                if b.nodes >= self.budget {
                    break;
                }
                push(&mut queue, &c);
                b.insert(c);
            }
        }
        Some(b.seal())
    }
}

/// A tree node ordered by nothing in particular (the queue orders by frequency, then age).
#[derive(Debug)]
struct TreeNodeOrd(TreeNode);

impl PartialEq for TreeNodeOrd {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for TreeNodeOrd {}
impl PartialOrd for TreeNodeOrd {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TreeNodeOrd {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(lid: u64, level: u8, lo: &str, hi: Option<&str>) -> TreeNode {
        TreeNode { lid, version: lid * 10, level, lo: lo.into(), hi: hi.map(Into::into) }
    }

    /// A three-level tree: root 1 over interior 2 [..m) and 3 [m..), each over two leaves.
    async fn expand(nodes: Vec<TreeNode>) -> Option<(u64, Vec<(u16, TreeNode)>)> {
        if nodes.is_empty() {
            return Some((7, vec![(0, node(1, 2, "", None))]));
        }
        let mut out = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            let kids = match n.lid {
                1 => vec![node(2, 1, "", Some("m")), node(3, 1, "m", None)],
                2 => vec![node(4, 0, "", Some("f")), node(5, 0, "f", Some("m"))],
                3 => vec![node(6, 0, "m", Some("t")), node(7, 0, "t", None)],
                _ => vec![],
            };
            out.extend(kids.into_iter().map(|k| (i as u16, k)));
        }
        Some((7, out))
    }

    #[tokio::test]
    async fn the_budget_goes_to_where_the_gets_fall_and_hints_are_the_deepest_covering_node() {
        let f = FatRoots::new(5);
        // Gets fall only in [m, ..): node 3 is expanded, node 2 is not.
        for i in 0..400 {
            let _ = f.hint(9, 1, format!("x{i}").as_bytes());
        }
        f.build(9, 1, expand).await;
        let (h, _) = f.hint(9, 1, b"x5");
        let h = h.expect("a hint");
        assert_eq!((h.arena, h.node.lid), (7, 7), "the leaf covering x5");
        let (h, _) = f.hint(9, 1, b"b");
        assert_eq!(h.expect("a hint").node.lid, 2, "no leaf of the cold half is cached: its interior node");
        // With room for everything, the cold half is cached too (layer by layer).
        let g = FatRoots::new(100);
        let _ = g.hint(9, 1, b"x1");
        g.build(9, 1, expand).await;
        assert_eq!(g.hint(9, 1, b"b").0.expect("a hint").node.lid, 4);
        let (h, _) = f.hint(9, 2, b"b");
        assert!(h.is_none(), "a new epoch of the region: no hint until rebuilt");
        let built = f.region(9).built.read().expect("lock").clone().expect("built").0;
        assert!(built.nodes <= 5);
        assert!(FatRoots::new(0).hint(9, 1, b"x").0.is_none());
    }

    /// The covering node is found from the fences' 8-byte prefixes, reading a node's upper fence
    /// only where the next cached node does not start there: a gap between cached nodes of a
    /// level is never taken as covered, and keys past the common prefix, before the first fence
    /// or equal to a fence land right. Checked against a scan of every node.
    #[test]
    fn the_covering_node_is_the_deepest_whose_fences_hold_the_key_with_or_without_gaps() {
        let fences = ["", "user00", "user02", "user05", "user050", "user07", "user09"];
        let leaf = |i: usize, lid: u64| node(lid, 0, fences[i], fences.get(i + 1).copied());
        // Level 1: one node over everything; level 0: leaves 0, 1, 3, 4, 6 (gaps at 2 and 5).
        let mut b = Built { arena: 1, epoch: 1, ..Built::default() };
        b.insert(node(100, 1, "", None));
        for (i, lid) in [(0, 10), (1, 11), (3, 13), (4, 14), (6, 16)] {
            b.insert(leaf(i, lid));
        }
        let b = b.seal();
        let keys = [
            "", "a", "user", "user0", "user00", "user000", "user01", "user02", "user03", "user05", "user050",
            "user0500", "user051", "user06", "user07", "user08", "user09", "user099", "user1", "z", "\u{7f}",
        ];
        for k in keys {
            let k = k.as_bytes();
            let want = b
                .levels
                .iter()
                .flatten()
                .filter(|h| h.node.lo.as_slice() <= k && h.node.hi.as_deref().is_none_or(|hi| k < hi))
                .min_by_key(|h| h.node.level)
                .map(|h| h.node.lid);
            assert_eq!(b.covering(k).map(|h| h.node.lid), want, "key {:?}", String::from_utf8_lossy(k));
        }
        assert_eq!(b.covering(b"user03").map(|h| h.node.lid), Some(100), "in the gap: the parent");
        assert_eq!(b.covering(b"user051").map(|h| h.node.lid), Some(14));
    }
}
