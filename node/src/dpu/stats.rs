//! The device's counters: its `/metrics` and its answer to a `stats` request (docs/protocol.md
//! §5) — counters by name, and per region it leads the gets served and the most read popular
//! keys — which the gateway's console gathers from every device (docs/console.md).
//!
//! Gets are counted per region in a fixed table of [`REGION_SLOTS`] slots (a region's id picks
//! its home slot, and it takes the first free one of the next 8; a region that finds none is
//! counted in `gets_unattributed`), lock-free on the read path; slots of regions the device no
//! longer leads are freed when statistics are taken.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use dpukv_proto::stats::{DeviceStats, MAX_REGIONS, MAX_TOP};

use super::hot_keys::HotKeys;
use crate::admin;
use crate::reads::ReadCounters;
use crate::replica_table::ReplicaTable;

/// Slots of the per-region get counts.
pub const REGION_SLOTS: usize = 256;

/// Gets served per region (see the module documentation).
pub(crate) struct RegionCounts {
    slots: Box<[(AtomicU32, AtomicU64)]>,
    /// Gets of regions whose slot was taken.
    pub(crate) unattributed: AtomicU64,
}

impl Default for RegionCounts {
    fn default() -> Self {
        RegionCounts {
            slots: (0..REGION_SLOTS).map(|_| (AtomicU32::new(0), AtomicU64::new(0))).collect(),
            unattributed: AtomicU64::new(0),
        }
    }
}

/// How many slots a region's id may look at, from its own on.
const PROBE: usize = 8;
/// A slot being freed (no region has this id).
const FREEING: u32 = u32::MAX;

impl RegionCounts {
    /// Counts a get of region `id` (never 0): in its slot, or the first free one of the
    /// [`PROBE`] after it; else in `unattributed`.
    pub(crate) fn add(&self, id: u32) {
        let home = id as usize % REGION_SLOTS;
        for k in 0..PROBE {
            let (tag, n) = &self.slots[(home + k) % REGION_SLOTS];
            let mut t = tag.load(Ordering::Relaxed);
            if t == 0 {
                t = match tag.compare_exchange(0, id, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => id,
                    Err(now) => now,
                };
            }
            if t == id {
                n.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        self.unattributed.fetch_add(1, Ordering::Relaxed);
    }

    /// (region, gets) for each region `live` says is served (a region holding two slots — one
    /// freed before it, then taken again — is summed); frees the slots of the others.
    pub(crate) fn take_stock(&self, live: impl Fn(u32) -> bool) -> Vec<(u32, u64)> {
        let mut out: std::collections::BTreeMap<u32, u64> = Default::default();
        for (tag, n) in self.slots.iter() {
            let id = tag.load(Ordering::Relaxed);
            if id == 0 || id == FREEING {
                continue;
            }
            if live(id) {
                *out.entry(id).or_default() += n.load(Ordering::Relaxed);
            } else if tag.compare_exchange(id, FREEING, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                // No get can count here while it is being freed.
                n.store(0, Ordering::Relaxed);
                tag.store(0, Ordering::Release);
            }
        }
        out.into_iter().collect()
    }
}

/// Whether the gets counted for region `id` are still this node's to report, by `map` (the
/// sync thread's, which may trail the readers' by a round): not when the map gives the region
/// to another node, nor when the region is gone from it (merged away: region ids only grow, so
/// an id at or below the map's largest is one the map has seen); yes otherwise — before the
/// first map, and for a region newer than the map (a split the readers saw first), the counts
/// are kept (freeing them would lose gets the device did serve as the region's primary).
pub(crate) fn still_led(map: Option<&crate::regions::RegionMap>, id: u32) -> bool {
    let Some(map) = map else { return true };
    match map.regions().iter().find(|r| r.id == id) {
        Some(r) => r.primary == map.node(),
        None => map.regions().iter().all(|r| r.id < id),
    }
}

impl DeviceCounters {
    /// The answer to a `stats` request.
    pub(crate) fn snapshot(&self) -> DeviceStats {
        let r = &self.reads;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (cpu_ms, rss) = crate::process::usage();
        let mut counters = vec![
            ("uptime_ms".to_string(), self.started.elapsed().as_millis() as u64),
            ("reads_on_host".to_string(), self.on_host as u64),
            ("reads_served".to_string(), load(&r.served)),
            ("replica_reads".to_string(), load(&self.table.counters.reads)),
            ("replica_misses".to_string(), load(&self.table.counters.misses)),
            ("forwarded".to_string(), load(&self.forwarded)),
            ("unavailable".to_string(), load(&self.unavailable)),
            ("refused".to_string(), load(&self.refused)),
            ("node_visits".to_string(), load(&r.node_visits)),
            ("snapshots".to_string(), load(&r.snapshots)),
            ("hinted_reads".to_string(), load(&r.hinted)),
            ("popular_keys".to_string(), self.hot.counters.popular.load(Ordering::Relaxed)),
            ("gets_unattributed".to_string(), load(&self.hot.gets.unattributed)),
        ];
        counters.extend(cpu_ms.map(|v| ("cpu_ms".to_string(), v)));
        counters.extend(rss.map(|v| ("rss_bytes".to_string(), v)));
        let mut regions = self.hot.region_stats(MAX_TOP);
        regions.truncate(MAX_REGIONS);
        DeviceStats { counters, regions }
    }
}

/// The device's counters: what `/metrics` shows and what [`DeviceCounters::snapshot`] answers.
pub(crate) struct DeviceCounters {
    pub(crate) started: Instant,
    pub(crate) refused: Arc<AtomicU64>,
    pub(crate) reads: Arc<ReadCounters>,
    pub(crate) forwarded: Arc<AtomicU64>,
    pub(crate) unavailable: Arc<AtomicU64>,
    pub(crate) hot: Arc<HotKeys>,
    pub(crate) table: Arc<ReplicaTable>,
    /// Reads are served by the host's CPU (`--serve-reads-on-host`), not the device.
    pub(crate) on_host: bool,
}

impl std::fmt::Debug for DeviceCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceCounters")
    }
}

/// The collector of `/metrics` (the registry takes a box of its own).
#[derive(Debug)]
pub(crate) struct Collector(pub(crate) Arc<DeviceCounters>);

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let me = &self.0;
        let r = &me.reads;
        admin::encode_counters(
            &mut enc,
            &[
                ("dpukv_device_reads_served", "reads executed on the device", &r.served),
                (
                    "dpukv_device_requests_refused",
                    "requests refused for the caller's role (unauthorized, forbidden: docs/security.md)",
                    &me.refused,
                ),
                ("dpukv_device_forwarded", "requests forwarded to the host", &me.forwarded),
                (
                    "dpukv_device_unavailable",
                    "forwarded requests failed: host unreachable or not answering",
                    &me.unavailable,
                ),
                ("dpukv_device_node_visits", "tree node buffers visited by reads", &r.node_visits),
                ("dpukv_device_snapshots", "arena snapshots taken by reads", &r.snapshots),
                ("dpukv_device_ring_commands", "page-table changes applied from the command rings", &r.ring_commands),
                (
                    "dpukv_device_page_table_copies",
                    "page-table copies taken (first use, ring overruns)",
                    &r.page_table_copies,
                ),
                ("dpukv_device_node_cache_hits", "interior nodes served from the device's node cache", &r.cache_hits),
                ("dpukv_device_node_cache_misses", "interior nodes read from host memory", &r.cache_misses),
                (
                    "dpukv_device_hinted_reads",
                    "reads (gets, scans' first descents) that started where their fat-root start hint said",
                    &r.hinted,
                ),
                ("dpukv_device_hint_misses", "reads whose start hint was stale (started at the root)", &r.hint_misses),
                ("dpukv_device_replica_reads", "gets answered from the replica table", &me.table.counters.reads),
                (
                    "dpukv_device_replica_misses",
                    "gets aimed at this device as a replica it could not answer (no copy, or too stale)",
                    &me.table.counters.misses,
                ),
                (
                    "dpukv_device_replica_dropped",
                    "copies not kept: the replica table was full",
                    &me.table.counters.dropped,
                ),
                ("dpukv_host_sync_requests", "replica syncs sent to backups' devices", &me.hot.counters.sync_requests),
                ("dpukv_device_popular_admitted", "keys admitted to popular sets", &me.hot.counters.admitted),
                ("dpukv_device_popular_evicted", "keys evicted from popular sets", &me.hot.counters.evicted),
                (
                    "dpukv_device_sync_overflows",
                    "sync rounds a backup's link could not take (back-pressure; it resyncs whole)",
                    &me.hot.counters.overflows,
                ),
                (
                    "dpukv_device_sync_clock_jumps",
                    "sync rounds that sent no watermark because the wall clock jumped (replicas dropped this node's copies)",
                    &me.hot.counters.clock_jumps,
                ),
                (
                    "dpukv_device_replica_clock_jumps",
                    "replica syncs whose watermark was not taken because this node's wall clock jumped",
                    &me.table.counters.clock_jumps,
                ),
            ],
        )?;
        let c = &me.hot.counters;
        let (copies, bytes) = me.table.size();
        admin::encode_gauges(
            &mut enc,
            &[
                (
                    "dpukv_host_popular_keys",
                    "popular keys of the regions this node leads",
                    c.popular.load(Ordering::Relaxed) as i64,
                ),
                (
                    "dpukv_host_sync_outstanding",
                    "replica syncs queued or unanswered",
                    c.outstanding.load(Ordering::Relaxed),
                ),
                ("dpukv_device_replica_keys", "copies in the replica table", copies as i64),
                ("dpukv_device_replica_bytes", "bytes of keys and values in the replica table", bytes as i64),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_whose_ids_share_a_home_slot_are_counted_apart_and_freed_slots_start_at_zero() {
        let c = RegionCounts::default();
        let (a, b) = (5, 5 + REGION_SLOTS as u32);
        for _ in 0..3 {
            c.add(a);
        }
        c.add(b);
        assert_eq!(c.take_stock(|_| true), vec![(a, 3), (b, 1)]);
        // a leaves: its slot is freed; a new region there starts from nothing.
        assert_eq!(c.take_stock(|id| id == b), vec![(b, 1)]);
        let d = 5 + 2 * REGION_SLOTS as u32;
        c.add(d);
        assert_eq!(c.take_stock(|_| true), vec![(b, 1), (d, 1)]);
        // Past the probe: unattributed.
        for k in 0..PROBE as u32 + 2 {
            c.add(7 + k * REGION_SLOTS as u32);
        }
        assert_eq!(c.unattributed.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn counts_are_freed_only_for_regions_the_map_says_are_not_led_here() {
        use crate::regions::RegionMap;
        // Regions 1 (<m, here) and 2 (>=m) of a standalone node; region 2 given to node 9.
        let here = RegionMap::split_at(&[b"m".to_vec()]).expect("map");
        let mut cluster = here.cluster().clone();
        cluster.regions[1].primary = 9;
        let map = RegionMap::new(cluster, here.node()).expect("map");
        let c = RegionCounts::default();
        for id in [1, 2, 3] {
            c.add(id);
        }
        // No map yet (before the sync thread's first round): nothing is freed.
        assert_eq!(c.take_stock(|id| still_led(None, id)), vec![(1, 1), (2, 1), (3, 1)]);
        // Region 3 is newer than the map: kept; region 2 is another node's: freed.
        assert_eq!(c.take_stock(|id| still_led(Some(&map), id)), vec![(1, 1), (3, 1)]);
        // A region at or below the map's largest id and absent from it was merged away.
        let mut merged = here.cluster().clone();
        merged.regions.remove(0);
        merged.regions[0].start = Vec::new();
        let merged = RegionMap::new(merged, here.node()).expect("map");
        assert!(!still_led(Some(&merged), 1) && still_led(Some(&merged), 2) && still_led(Some(&merged), 3));
    }
}
