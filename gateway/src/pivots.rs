//! Where a long scan inside one region is cut (Fat-B+Tree §III-C): per region, keys from the
//! region's index that cut it into gaps holding similar shares of it (the `Pivots` op over the
//! whole region, kept [`PIVOT_TTL`] and dropped when the region's epoch changes), and how many
//! items a gap holds — learned from the pieces scans read, since an index gives shares, not
//! counts. [`plan`] groups gaps into pieces of about `limit / parallelism` items from the scan's
//! first key on, so the pieces a scan reads at once hold its page and little more.
//!
//! A stale or wrong entry costs balance, never correctness: a plan's pieces cover the scan's
//! range, contiguous and in order, whatever the keys. Memory: at most [`MAX_REGIONS`] entries of
//! at most `MAX_PIVOTS` keys.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_proto::limits::MAX_PIVOTS;
use dpukv_proto::regionmap::key_before;

/// How long a region's pivots are used before they are asked for again.
pub const PIVOT_TTL: Duration = Duration::from_secs(5);

/// Regions whose pivots are kept (past it, the oldest half is dropped).
pub const MAX_REGIONS: usize = 4096;

/// A piece of a scan's range: `[lo, hi]` (`hi` empty: to the end of the key space), covering
/// `gaps` whole gaps between pivots (0: not known to be whole gaps — the first piece, which
/// starts inside one, and the last, which runs to the range's end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// First key.
    pub lo: Vec<u8>,
    /// Last key (empty: the end of the key space).
    pub hi: Vec<u8>,
    /// Whole gaps it spans (0: unknown).
    pub gaps: u32,
}

/// One region's pivots and what a gap between two of them holds.
#[derive(Debug, Clone)]
pub struct RegionPivots {
    /// The region's epoch when they were asked for.
    pub epoch: u64,
    /// Keys inside the region, ascending.
    pub keys: Arc<Vec<Vec<u8>>>,
    /// Items per gap (0: not learned yet).
    pub per_gap: f64,
    fetched: Instant,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct PivotCache {
    regions: Mutex<HashMap<u32, RegionPivots>>,
}

impl PivotCache {
    /// Region `id`'s pivots at `epoch`, if fetched less than [`PIVOT_TTL`] ago.
    pub fn get(&self, id: u32, epoch: u64) -> Option<RegionPivots> {
        let regions = self.regions.lock().expect("pivot cache lock");
        regions.get(&id).filter(|r| r.epoch == epoch && r.fetched.elapsed() < PIVOT_TTL).cloned()
    }

    /// Keeps freshly fetched pivots of region `id` (what was learned of its gaps carries over
    /// while the epoch stays).
    pub fn put(&self, id: u32, epoch: u64, keys: Vec<Vec<u8>>) -> RegionPivots {
        let mut regions = self.regions.lock().expect("pivot cache lock");
        let per_gap = regions.get(&id).filter(|r| r.epoch == epoch).map_or(0.0, |r| r.per_gap);
        if regions.len() >= MAX_REGIONS && !regions.contains_key(&id) {
            let mut ages: Vec<Instant> = regions.values().map(|r| r.fetched).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            regions.retain(|_, r| r.fetched > cut);
        }
        let entry = RegionPivots { epoch, keys: Arc::new(keys), per_gap, fetched: Instant::now() };
        regions.insert(id, entry.clone());
        entry
    }

    /// A piece of region `id` (at `epoch`) held `items` over `gaps` whole gaps; `at_least`: it
    /// was cut short, so a gap holds at least that much.
    pub fn learn(&self, id: u32, epoch: u64, items: usize, gaps: u32, at_least: bool) {
        if gaps == 0 {
            return;
        }
        let sample = items as f64 / gaps as f64;
        let mut regions = self.regions.lock().expect("pivot cache lock");
        if let Some(r) = regions.get_mut(&id).filter(|r| r.epoch == epoch) {
            r.per_gap = match r.per_gap {
                0.0 => sample,
                old if at_least => old.max(sample),
                old => (old + sample) / 2.0,
            };
        }
    }
}

/// The pieces a scan of `[lo, hi]` (inside one region; `hi` empty: to the end of the key
/// space) for `limit` items reads, at most `parallelism` at once: whole gaps grouped so a piece
/// holds about `limit / parallelism` items (at least `min_items`), as many pieces as the page
/// needs, then the rest of the range as one last piece. Gaps of unknown size: `parallelism`
/// pieces of one gap each, then the rest. Pieces are contiguous and cover `[lo, hi]` exactly.
pub fn plan(
    keys: &[Vec<u8>],
    per_gap: f64,
    lo: &[u8],
    hi: &[u8],
    limit: usize,
    parallelism: usize,
    min_items: usize,
) -> Vec<Piece> {
    let p = parallelism.max(1);
    let inside: Vec<&Vec<u8>> =
        keys.iter().filter(|k| k.as_slice() > lo && (hi.is_empty() || k.as_slice() <= hi)).collect();
    let target = (limit / p).max(min_items).max(1);
    let (per_piece, most) = if per_gap > 0.0 {
        ((target as f64 / per_gap).round().max(1.0) as usize, limit.div_ceil(target))
    } else {
        (1, p)
    };
    let mut pieces = Vec::new();
    let mut a = lo.to_vec();
    let mut crossed = 0; // pivots passed since `a`
    for k in inside {
        if pieces.len() == most {
            break;
        }
        if k.as_slice() <= a.as_slice() {
            continue;
        }
        crossed += 1;
        if crossed == per_piece {
            // The first piece begins inside a gap: not a measure of whole gaps.
            let gaps = if pieces.is_empty() { 0 } else { per_piece as u32 };
            pieces.push(Piece { lo: std::mem::replace(&mut a, k.clone()), hi: key_before(k), gaps });
            crossed = 0;
        }
    }
    pieces.push(Piece { lo: a, hi: hi.to_vec(), gaps: 0 });
    pieces
}

/// Most pivots asked of a region.
pub const ASK: u16 = MAX_PIVOTS;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(i: u32) -> Vec<u8> {
        format!("k{i:06}").into_bytes()
    }

    /// Pieces are contiguous, in order, never empty ranges, and cover [lo, hi] exactly.
    fn covers(pieces: &[Piece], lo: &[u8], hi: &[u8]) {
        assert_eq!(pieces.first().expect("a piece").lo, lo);
        assert_eq!(pieces.last().expect("a piece").hi, hi);
        for w in pieces.windows(2) {
            assert!(w[0].lo <= w[0].hi, "{w:?}");
            assert!(w[1].hi.is_empty() || w[1].lo <= w[1].hi, "{w:?}");
            assert!(w[0].hi < w[1].lo && w[0].hi == key_before(&w[1].lo), "{w:?}");
        }
    }

    #[test]
    fn known_gaps_make_pieces_of_the_pages_share() {
        // 256 pivots, 100 items per gap: a 10,000-item page over 4 pieces is 25 gaps a piece.
        let keys: Vec<Vec<u8>> = (1..=256).map(|i| key(i * 100)).collect();
        let pieces = plan(&keys, 100.0, &key(50), &key(99_999), 10_000, 4, 256);
        covers(&pieces, &key(50), &key(99_999));
        assert_eq!(pieces.len(), 5, "{pieces:?}"); // four of the page, then the rest
        assert_eq!(pieces[0].hi, key_before(&key(2500)));
        assert_eq!(pieces[1].lo, key(2500));
        assert_eq!(pieces[1].gaps, 25);
        assert_eq!(pieces[3].hi, key_before(&key(10_000)));
        assert_eq!(pieces[4].gaps, 0);
    }

    #[test]
    fn unknown_gaps_make_one_gap_pieces_then_the_rest() {
        let keys: Vec<Vec<u8>> = (1..=256).map(|i| key(i * 100)).collect();
        let pieces = plan(&keys, 0.0, &key(150), &[], 10_000, 4, 256);
        covers(&pieces, &key(150), &[]);
        assert_eq!(pieces.len(), 5, "{pieces:?}");
        assert_eq!((pieces[0].gaps, pieces[1].gaps, pieces[3].gaps), (0, 1, 1));
        assert_eq!(pieces[1].lo, key(200));
    }

    #[test]
    fn a_cache_learns_gap_sizes_and_forgets_them_with_the_epoch() {
        let c = PivotCache::default();
        c.put(7, 1, vec![key(1)]);
        c.learn(7, 1, 1000, 10, false);
        assert_eq!(c.get(7, 1).expect("cached").per_gap, 100.0);
        c.learn(7, 1, 3000, 10, false);
        assert_eq!(c.get(7, 1).expect("cached").per_gap, 200.0);
        c.learn(7, 1, 1000, 10, true); // cut short: a lower bound below what is known
        assert_eq!(c.get(7, 1).expect("cached").per_gap, 200.0);
        assert!(c.get(7, 2).is_none(), "another epoch");
        assert_eq!(c.put(7, 1, vec![key(2)]).per_gap, 200.0, "refetched: kept");
        assert_eq!(c.put(7, 2, vec![key(2)]).per_gap, 0.0, "new epoch: forgotten");
    }

    #[test]
    fn the_cache_stays_bounded() {
        let c = PivotCache::default();
        for id in 0..(MAX_REGIONS as u32 * 3) {
            c.put(id, 1, vec![key(id)]);
        }
        assert!(c.regions.lock().expect("lock").len() <= MAX_REGIONS);
    }

    proptest! {
        #[test]
        fn plans_cover_the_range_whatever_the_pivots(
            mut raw in proptest::collection::vec(0u32..5000, 0..300),
            lo in 0u32..5000, span in 0u32..6000, open in any::<bool>(),
            per_gap in prop_oneof![Just(0.0f64), 0.5f64..5000.0],
            limit in 1usize..10_001, p in 1usize..9,
        ) {
            raw.sort_unstable();
            raw.dedup();
            let keys: Vec<Vec<u8>> = raw.into_iter().map(key).collect();
            let (lo, hi) = (key(lo), if open { Vec::new() } else { key(lo + span) });
            let pieces = plan(&keys, per_gap, &lo, &hi, limit, p, 1);
            covers(&pieces, &lo, &hi);
        }
    }
}
