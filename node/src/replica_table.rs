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

#[derive(Debug, Default, Clone, Copy)]
struct RegionState {
    epoch: u64,
    watermark_ms: u64,
}

#[derive(Debug, Default)]
struct Inner {
    copies: HashMap<Vec<u8>, Copy>,
    regions: HashMap<u32, RegionState>,
    bytes: usize,
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
    ) -> Result<(), SyncError> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut t = self.lock();
        let state = t.regions.get(&region).copied().unwrap_or_default();
        if epoch < state.epoch {
            return Err(SyncError::StaleEpoch);
        }
        if reset || epoch > state.epoch {
            t.drop_region(region);
            t.regions.insert(region, RegionState { epoch, watermark_ms: 0 });
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
        if let Some(s) = t.regions.get_mut(&region) {
            s.watermark_ms = s.watermark_ms.max(watermark_ms);
        }
        Ok(())
    }

    /// The copy of `key` in `region` and its version, if it may answer a read with `consistency`
    /// at `now_ms` (this node's clock) from a reader that routes by `epoch` of the region: a
    /// reader that knows a newer epoch than the copies' is not served by them (their primary
    /// may have been deposed; its successor's writes may be missing).
    pub fn read(
        &self,
        region: u32,
        epoch: u64,
        key: &[u8],
        consistency: Consistency,
        now_ms: u64,
    ) -> Result<(Vec<u8>, u64), Miss> {
        use std::sync::atomic::Ordering::Relaxed;
        let out = self.lookup(region, epoch, key, consistency, now_ms);
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
        now_ms: u64,
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
        let w = state.watermark_ms;
        // Age of the newest watermark, as seen with the worst clock skew.
        let age = now_ms.saturating_sub(w).saturating_add(self.cfg.max_clock_skew_ms);
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

    #[test]
    fn a_copy_is_served_only_within_its_bound_after_a_watermark() {
        let t = table();
        t.apply(1, 1, 0, false, vec![put("a", 3, "x")]).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, 1_000), Err(Miss::TooStale), "no watermark yet: nothing is vouched for");
        t.apply(1, 1, 1_000, false, vec![]).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, 1_040), Ok((b"x".to_vec(), 3)));
        assert_eq!(t.read(1, 0, b"a", B, 1_046), Err(Miss::TooStale), "45 ms + 5 ms skew is the bound");
        assert_eq!(t.read(1, 0, b"a", Consistency::Extended, 1_190), Ok((b"x".to_vec(), 3)));
        assert_eq!(t.read(1, 0, b"a", Consistency::Interleaved, 1_196), Err(Miss::TooStale), "max lag");
        assert_eq!(t.read(1, 0, b"a", Consistency::Bounded { max_staleness_ms: 10_000 }, 1_196), Err(Miss::TooStale));
        assert_eq!(t.read(1, 0, b"a", Consistency::Linearizable, 1_000), Err(Miss::Linearizable));
        assert_eq!(t.read(2, 0, b"a", B, 1_010), Err(Miss::Absent), "another region's copy");
    }

    #[test]
    fn newer_versions_win_and_invalidations_drop() {
        let t = table();
        t.apply(1, 1, 100, false, vec![put("a", 5, "new")]).expect("test step");
        t.apply(1, 1, 110, false, vec![put("a", 4, "old")]).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, 110).expect("test step").0, b"new");
        t.apply(1, 1, 120, false, vec![SyncEntry { key: "a".into(), version: 6, value: None }]).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, 120), Err(Miss::Absent));
        assert_eq!(t.size(), (0, 0));
    }

    /// A reader that routes by a newer epoch than the copies came from (a new primary leads
    /// the region, and may have taken writes the old one never synced) was served them anyway:
    /// the table ignored the request's epoch.
    #[test]
    fn a_reader_that_knows_a_newer_epoch_is_not_served_an_older_primary_s_copies() {
        let t = table();
        t.apply(1, 4, 1_000, true, vec![put("a", 3, "x")]).expect("sync");
        assert_eq!(t.read(1, 4, b"a", B, 1_010), Ok((b"x".to_vec(), 3)), "the same epoch is served");
        assert_eq!(t.read(1, 3, b"a", B, 1_010), Ok((b"x".to_vec(), 3)), "a reader behind the copies is too");
        assert_eq!(t.read(1, 5, b"a", B, 1_010), Err(Miss::OlderEpoch), "a newer epoch is not");
    }

    #[test]
    fn epochs_fence_old_primaries_and_reset_drops_a_region() {
        let t = table();
        t.apply(1, 2, 100, false, vec![put("a", 1, "x"), put("b", 1, "y")]).expect("test step");
        t.apply(7, 1, 100, false, vec![put("c", 1, "z")]).expect("test step");
        assert_eq!(t.apply(1, 1, 200, false, vec![put("a", 9, "stale primary")]), Err(SyncError::StaleEpoch));
        assert_eq!(t.read(1, 0, b"a", B, 110).expect("test step").0, b"x");
        // A new primary (epoch 3) starts from nothing, and vouches for nothing until it says so.
        t.apply(1, 3, 0, false, vec![put("a", 10, "x3")]).expect("test step");
        assert_eq!(t.read(1, 0, b"b", B, 110), Err(Miss::Absent));
        assert_eq!(t.read(1, 0, b"a", B, 110), Err(Miss::TooStale));
        t.apply(1, 3, 0, true, vec![]).expect("test step");
        assert_eq!(t.read(1, 0, b"a", B, 110), Err(Miss::Absent));
        assert_eq!(t.read(7, 0, b"c", B, 110).expect("test step").0, b"z", "other regions untouched");
        t.forget_regions([7].into_iter());
        assert_eq!(t.read(7, 0, b"c", B, 110), Err(Miss::Absent));
        assert_eq!(t.size(), (0, 0));
    }

    #[test]
    fn the_table_never_holds_more_than_its_bounds() {
        let t = table();
        let many: Vec<SyncEntry> = (0..10).map(|i| put(&format!("k{i}"), 1, "v")).collect();
        t.apply(1, 1, 100, false, many).expect("test step");
        assert_eq!(t.size().0, 3);
        let big = SyncEntry { key: "k0".into(), version: 2, value: Some(vec![0; 2000]) };
        t.apply(1, 1, 100, false, vec![big]).expect("test step");
        assert_eq!(t.read(1, 0, b"k0", B, 100), Err(Miss::Absent), "an update that does not fit drops the old copy");
        assert!(t.size().1 <= 1000);
        assert!(t.counters.dropped.load(std::sync::atomic::Ordering::Relaxed) >= 8);
    }
}
