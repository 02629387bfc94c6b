//! A device's **replica table** (hKVS §4.3: the secondary service's store): copies of other
//! nodes' popular keys, pushed by their primaries (`replica_sync`), read by gets aimed at this
//! device as a replica (docs/hot-keys.md).
//!
//! Each region the table holds copies of has the primary's **epoch** (a sync of an older epoch
//! is refused; a newer one drops the older primary's copies) and a **watermark**: every write to
//! the region acknowledged before that time (the primary's clock) is reflected in the copies
//! (the primary sends it after the copies, on one ordered connection). A copy is served only
//! while the watermark is recent enough for the read's consistency:
//! `now - watermark + max_clock_skew <= bound`, where the bound is the read's own
//! (`bounded:MS`) capped by `max_lag_ms`, or `max_lag_ms` alone (`extended`, `interleaved`).
//! So a bounded read never returns a value older than its bound (given clocks within the
//! skew), and a primary that died or stopped syncing stops being served within `max_lag_ms`.
//!
//! Memory is bounded: at most `max_keys` copies and `max_bytes` bytes of keys and values; a copy
//! that does not fit is dropped (its reads go to the primary), never an older copy kept.

use std::collections::HashMap;
use std::sync::Mutex;

use dpukv_proto::{Consistency, SyncEntry};

/// The table's bounds and freshness rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaTableConfig {
    /// Most copies.
    pub max_keys: usize,
    /// Most bytes of keys and values.
    pub max_bytes: usize,
    /// A copy whose watermark is older than this is never served.
    pub max_lag_ms: u64,
    /// How far apart the nodes' clocks may be (added to a copy's age).
    pub max_clock_skew_ms: u64,
}

impl Default for ReplicaTableConfig {
    /// 100,000 copies, 64 MiB, 1 s, 5 ms.
    fn default() -> Self {
        ReplicaTableConfig { max_keys: 100_000, max_bytes: 64 << 20, max_lag_ms: 1000, max_clock_skew_ms: 5 }
    }
}

/// Why a sync was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    /// The sender's epoch of the region is older than one already seen: it leads it no more.
    #[error("a replica sync from an older epoch of the region")]
    StaleEpoch,
}

/// Why a read found no copy to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// No copy of the key for that region.
    Absent,
    /// A copy, but its watermark is too old for the read's consistency.
    TooStale,
    /// A linearizable read is never served by a replica.
    Linearizable,
    /// The reader knows a newer epoch of the region than the copies came from: another
    /// primary leads it now, whose writes they may not reflect.
    OlderEpoch,
}

#[derive(Debug)]
struct Copy {
    region: u32,
    version: u64,
    value: Vec<u8>,
}

/// Least change of a node's wall clock against its monotonic clock between two sync rounds
/// that counts as a jump (the skew bound, if larger): below it, scheduling noise.
pub const CLOCK_JUMP_FLOOR_MS: u64 = 50;

#[derive(Debug, Default, Clone, Copy)]
struct RegionState {
    epoch: u64,
    /// The newest watermark, as a time on this node's monotonic clock (ms): when it arrived,
    /// less how old it was then by the wall clocks (0: none). Its age afterwards is counted by
    /// the monotonic clock, so a jump of this node's wall clock after it arrived changes nothing.
    fresh_mono_ms: u64,
}

/// This node's clocks at one moment: the wall clock (comparable with other nodes' within the
/// skew bound) and the monotonic clock (real time elapsed, immune to jumps and steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clocks {
    /// Wall clock, ms since the Unix epoch.
    pub wall_ms: u64,
    /// Monotonic clock, ms.
    pub mono_ms: u64,
}

impl Clocks {
    /// Now.
    pub fn now() -> Clocks {
        Clocks { wall_ms: crate::dpu::hot_keys::now_ms(), mono_ms: dpukv_storage::announce::monotonic_ns() / 1_000_000 }
    }

    /// A steady clock at `ms` (both clocks agree): for tests.
    pub fn steady(ms: u64) -> Clocks {
        Clocks { wall_ms: ms, mono_ms: ms }
    }
}

#[derive(Debug, Default)]
struct Inner {
    copies: HashMap<Vec<u8>, Copy>,
    regions: HashMap<u32, RegionState>,
    bytes: usize,
    /// Wall clock less monotonic clock at the last sync (ms): a change past the skew bound is
    /// a jump of this node's wall clock.
    clock_offset: Option<i128>,
}

impl Inner {
    fn remove(&mut self, key: &[u8]) {
        if let Some(c) = self.copies.remove(key) {
            self.bytes -= key.len() + c.value.len();
        }
    }

    fn drop_region(&mut self, region: u32) {
        let mut freed = 0;
        self.copies.retain(|k, c| {
            let keep = c.region != region;
            if !keep {
                freed += k.len() + c.value.len();
            }
            keep
        });
        self.bytes -= freed;
    }
}

/// Counters of the table.
#[derive(Debug, Default)]
pub struct ReplicaCounters {
    /// Reads served from copies.
    pub reads: std::sync::atomic::AtomicU64,
    /// Replica reads not served (no copy, or too stale).
    pub misses: std::sync::atomic::AtomicU64,
    /// Copies dropped because the table was full.
    pub dropped: std::sync::atomic::AtomicU64,
    /// Syncs whose watermark was not taken: this node's wall clock had jumped.
    pub clock_jumps: std::sync::atomic::AtomicU64,
}

/// See the module documentation.
#[derive(Debug)]
pub struct ReplicaTable {
    cfg: ReplicaTableConfig,
    inner: Mutex<Inner>,
    /// What it did.
    pub counters: ReplicaCounters,
}

impl ReplicaTable {
    /// An empty table.
    pub fn new(cfg: ReplicaTableConfig) -> ReplicaTable {
        ReplicaTable { cfg, inner: Mutex::new(Inner::default()), counters: ReplicaCounters::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies a sync from the primary of `region` at `epoch` (see the module documentation).
    pub fn apply(
        &self,
        region: u32,
        epoch: u64,
        watermark_ms: u64,
        reset: bool,
        entries: Vec<SyncEntry>,
        now: Clocks,
    ) -> Result<(), SyncError> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut t = self.lock();
        let state = t.regions.get(&region).copied().unwrap_or_default();
        if epoch < state.epoch {
            return Err(SyncError::StaleEpoch);
        }
        if reset || epoch > state.epoch {
            t.drop_region(region);
            t.regions.insert(region, RegionState { epoch, fresh_mono_ms: 0 });
        }
        for e in entries {
            match t.copies.get(&e.key) {
                // An older sync that arrived late (the connection is ordered, so only across
                // reconnections): the copy already holds a newer version.
                // (An invalidation always drops the copy.)
                Some(c) if c.region == region && e.value.is_some() && c.version > e.version => continue,
                _ => t.remove(&e.key),
            }
            let Some(value) = e.value else { continue };
            let size = e.key.len() + value.len();
            if t.copies.len() >= self.cfg.max_keys || t.bytes + size > self.cfg.max_bytes {
                self.counters.dropped.fetch_add(1, Relaxed);
                continue;
            }
            t.bytes += size;
            t.copies.insert(e.key, Copy { region, version: e.version, value });
        }
        // The watermark's age now, by this node's wall clock (one in the future counts as now);
        // not taken if that clock jumped since the last sync (the age would be off by the jump).
        let offset = i128::from(now.wall_ms) - i128::from(now.mono_ms);
        let limit = u128::from(self.cfg.max_clock_skew_ms.max(CLOCK_JUMP_FLOOR_MS));
        let jumped = t.clock_offset.is_some_and(|o| (offset - o).unsigned_abs() > limit);
        t.clock_offset = Some(offset);
        if jumped {
            self.counters.clock_jumps.fetch_add(1, Relaxed);
        } else if watermark_ms > 0
            && let Some(s) = t.regions.get_mut(&region)
        {
            let fresh = now.mono_ms.saturating_sub(now.wall_ms.saturating_sub(watermark_ms)).max(1);
            s.fresh_mono_ms = s.fresh_mono_ms.max(fresh);
        }
        Ok(())
    }

    /// The copy of `key` in `region` and its version, if it may answer a read with `consistency`
    /// at `now` (this node's clocks) from a reader that routes by `epoch` of the region: a
    /// reader that knows a newer epoch than the copies' is not served by them (their primary
    /// may have been deposed; its successor's writes may be missing).
    pub fn read(
        &self,
        region: u32,
        epoch: u64,
        key: &[u8],
        consistency: Consistency,
        now: Clocks,
    ) -> Result<(Vec<u8>, u64), Miss> {
        use std::sync::atomic::Ordering::Relaxed;
        let out = self.lookup(region, epoch, key, consistency, now);
        match out {
            Ok(_) => self.counters.reads.fetch_add(1, Relaxed),
            Err(_) => self.counters.misses.fetch_add(1, Relaxed),
        };
        out
    }

    fn lookup(
        &self,
        region: u32,
        epoch: u64,
        key: &[u8],
        consistency: Consistency,
        now: Clocks,
    ) -> Result<(Vec<u8>, u64), Miss> {
        let bound = match consistency {
            Consistency::Linearizable => return Err(Miss::Linearizable),
            Consistency::Bounded { max_staleness_ms } => u64::from(max_staleness_ms).min(self.cfg.max_lag_ms),
            Consistency::Extended | Consistency::Interleaved => self.cfg.max_lag_ms,
        };
        let t = self.lock();
        let state = t.regions.get(&region).copied().unwrap_or_default();
        if epoch > state.epoch {
            return Err(Miss::OlderEpoch);
        }
        let c = t.copies.get(key).filter(|c| c.region == region).ok_or(Miss::Absent)?;
        let w = state.fresh_mono_ms;
        // Age of the newest watermark (by the monotonic clock since it arrived), as seen with
        // the worst clock skew.
        let age = now.mono_ms.saturating_sub(w).saturating_add(self.cfg.max_clock_skew_ms);
        if w == 0 || age > bound {
            return Err(Miss::TooStale);
        }
        Ok((c.value.clone(), c.version))
    }

    /// Copies held, and their bytes.
    pub fn size(&self) -> (usize, usize) {
        let t = self.lock();
        (t.copies.len(), t.bytes)
    }

    /// Drops the copies of regions this node now leads itself (it serves them from its tree).
    pub fn forget_regions(&self, led: impl Iterator<Item = u32>) {
        let mut t = self.lock();
        for r in led {
            if t.regions.remove(&r).is_some() {
                t.drop_region(r);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &str, v: u64, val: &str) -> SyncEntry {
        SyncEntry { key: k.into(), version: v, value: Some(val.into()) }
    }

    const B: Consistency = Consistency::Bounded { max_staleness_ms: 50 };

    fn table() -> ReplicaTable {
        ReplicaTable::new(ReplicaTableConfig { max_keys: 3, max_bytes: 1000, max_lag_ms: 200, max_clock_skew_ms: 5 })
    }

    /// A replica's wall clock that jumps back once made a watermark look younger by the jump:
    /// reads were served past their bound. Ages now run on the monotonic clock from the sync's
    /// arrival, and a sync that arrives across a jump of this node's wall clock vouches for
    /// nothing.
    #[test]
    fn a_jump_of_the_replica_s_wall_clock_never_stretches_a_bound() {
        let t = table();
        let at = |wall_ms, mono_ms| Clocks { wall_ms, mono_ms };
        t.apply(1, 1, 10_000, false, vec![put("a", 3, "x")], at(10_000, 500)).expect("sync");
        assert!(t.read(1, 0, b"a", B, at(10_040, 540)).is_ok());
        // The wall clock steps back 10 s, 40 ms of real time later: the copy ages all the same.
        assert_eq!(t.read(1, 0, b"a", B, at(86, 586)), Err(Miss::TooStale), "46 ms + 5 ms skew passed");
        // The next sync arrives across the jump: its watermark (fresh by the primary's clock,
        // 9.9 s "in the future" by this one's) is not taken.
        t.apply(1, 1, 10_080, false, vec![], at(90, 590)).expect("sync");
        assert_eq!(t.read(1, 0, b"a", B, at(91, 591)), Err(Miss::TooStale));
        assert_eq!(t.counters.clock_jumps.load(std::sync::atomic::Ordering::Relaxed), 1);
        // A steady clock since: the next one is (its age by this clock: none, it is ahead).
        t.apply(1, 1, 10_100, false, vec![], at(110, 610)).expect("sync");
        assert!(t.read(1, 0, b"a", B, at(150, 650)).is_ok());
        assert_eq!(t.read(1, 0, b"a", B, at(156, 656)), Err(Miss::TooStale));
        // A watermark ahead of this node's clock counts from its arrival, never from the future.
        let t = table();
        t.apply(1, 1, 20_000, false, vec![put("a", 3, "x")], at(10_000, 100)).expect("sync");
        assert!(t.read(1, 0, b"a", B, at(10_045, 145)).is_ok());
        assert_eq!(t.read(1, 0, b"a", B, at(10_046, 146)), Err(Miss::TooStale));
    }

    #[test]
    fn a_copy_is_served_only_within_its_bound_after_a_watermark() {
        let t = table();
        t.apply(1, 1, 0, false, vec![put("a", 3, "x")], Clocks::steady(0)).expect("test step");
        assert_eq!(
            t.read(1, 0, b"a", B, Clocks::steady(1_000)),
            Err(Miss::TooStale),
            "no watermark yet: nothing is vouched for"
        );
        t.apply(1, 1, 1_000, false, vec![], Clocks::steady(1_000)).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, Clocks::steady(1_040)), Ok((b"x".to_vec(), 3)));
        assert_eq!(t.read(1, 0, b"a", B, Clocks::steady(1_046)), Err(Miss::TooStale), "45 ms + 5 ms skew is the bound");
        assert_eq!(t.read(1, 0, b"a", Consistency::Extended, Clocks::steady(1_190)), Ok((b"x".to_vec(), 3)));
        assert_eq!(t.read(1, 0, b"a", Consistency::Interleaved, Clocks::steady(1_196)), Err(Miss::TooStale), "max lag");
        assert_eq!(
            t.read(1, 0, b"a", Consistency::Bounded { max_staleness_ms: 10_000 }, Clocks::steady(1_196)),
            Err(Miss::TooStale)
        );
        assert_eq!(t.read(1, 0, b"a", Consistency::Linearizable, Clocks::steady(1_000)), Err(Miss::Linearizable));
        assert_eq!(t.read(2, 0, b"a", B, Clocks::steady(1_010)), Err(Miss::Absent), "another region's copy");
    }

    #[test]
    fn newer_versions_win_and_invalidations_drop() {
        let t = table();
        t.apply(1, 1, 100, false, vec![put("a", 5, "new")], Clocks::steady(100)).expect("test step");
        t.apply(1, 1, 110, false, vec![put("a", 4, "old")], Clocks::steady(110)).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, Clocks::steady(110)).expect("test step").0, b"new");
        t.apply(1, 1, 120, false, vec![SyncEntry { key: "a".into(), version: 6, value: None }], Clocks::steady(120))
            .expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, Clocks::steady(120)), Err(Miss::Absent));
        assert_eq!(t.size(), (0, 0));
    }

    /// A reader that routes by a newer epoch than the copies came from (a new primary leads
    /// the region, and may have taken writes the old one never synced) was served them anyway:
    /// the table ignored the request's epoch.
    #[test]
    fn a_reader_that_knows_a_newer_epoch_is_not_served_an_older_primary_s_copies() {
        let t = table();
        t.apply(1, 4, 1_000, true, vec![put("a", 3, "x")], Clocks::steady(1_000)).expect("sync");
        assert_eq!(t.read(1, 4, b"a", B, Clocks::steady(1_010)), Ok((b"x".to_vec(), 3)), "the same epoch is served");
        assert_eq!(
            t.read(1, 3, b"a", B, Clocks::steady(1_010)),
            Ok((b"x".to_vec(), 3)),
            "a reader behind the copies is too"
        );
        assert_eq!(t.read(1, 5, b"a", B, Clocks::steady(1_010)), Err(Miss::OlderEpoch), "a newer epoch is not");
    }

    #[test]
    fn epochs_fence_old_primaries_and_reset_drops_a_region() {
        let t = table();
        t.apply(1, 2, 100, false, vec![put("a", 1, "x"), put("b", 1, "y")], Clocks::steady(100)).expect("test step");
        t.apply(7, 1, 100, false, vec![put("c", 1, "z")], Clocks::steady(100)).expect("test step");
        assert_eq!(
            t.apply(1, 1, 200, false, vec![put("a", 9, "stale primary")], Clocks::steady(200)),
            Err(SyncError::StaleEpoch)
        );
        assert_eq!(t.read(1, 0, b"a", B, Clocks::steady(110)).expect("test step").0, b"x");
        // A new primary (epoch 3) starts from nothing, and vouches for nothing until it says so.
        t.apply(1, 3, 0, false, vec![put("a", 10, "x3")], Clocks::steady(0)).expect("test step");
        assert_eq!(t.read(1, 0, b"b", B, Clocks::steady(110)), Err(Miss::Absent));
        assert_eq!(t.read(1, 0, b"a", B, Clocks::steady(110)), Err(Miss::TooStale));
        t.apply(1, 3, 0, true, vec![], Clocks::steady(0)).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, Clocks::steady(110)), Err(Miss::Absent));
        assert_eq!(t.read(7, 0, b"c", B, Clocks::steady(110)).expect("test step").0, b"z", "other regions untouched");
        t.forget_regions([7].into_iter());
        assert_eq!(t.read(7, 0, b"c", B, Clocks::steady(110)), Err(Miss::Absent));
        assert_eq!(t.size(), (0, 0));
    }

    #[test]
    fn the_table_never_holds_more_than_its_bounds() {
        let t = table();
        let many: Vec<SyncEntry> = (0..10).map(|i| put(&format!("k{i}"), 1, "v")).collect();
        t.apply(1, 1, 100, false, many, Clocks::steady(100)).expect("test step");
        assert_eq!(t.size().0, 3);
        let big = SyncEntry { key: "k0".into(), version: 2, value: Some(vec![0; 2000]) };
        t.apply(1, 1, 100, false, vec![big], Clocks::steady(100)).expect("test step");
        assert_eq!(
            t.read(1, 0, b"k0", B, Clocks::steady(100)),
            Err(Miss::Absent),
            "an update that does not fit drops the old copy"
        );
        assert!(t.size().1 <= 1000);
        assert!(t.counters.dropped.load(std::sync::atomic::Ordering::Relaxed) >= 8);
    }
}
