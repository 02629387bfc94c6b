//! The figures a cluster member exposes at `/metrics` (docs/operations.md): per region it leads,
//! each backup's replication lag in log bytes and in records; the log and index (Send Index)
//! bytes it shipped and installed; promotions and finished catch-ups; the regions it leads and
//! backs. Read at scrape time from the leaders' [`Acks`] and [`Feed`]s; nothing is kept per scrape.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dpukv_storage::vlog::LogTail;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

use crate::admin::{encode_counter, encode_counters};
use crate::replication::{Acks, Feed, ReplStats};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct ClusterMetrics {
    /// Log and index bytes, shared with the node's senders and backup host.
    pub repl: Arc<ReplStats>,
    /// Regions this node began to lead from its backup copy.
    pub promotions: AtomicU64,
    /// Joining nodes this node, as primary, reported caught up.
    pub catch_ups: AtomicU64,
    /// Regions this node backs (or joins) now.
    pub regions_backed: AtomicU64,
    /// Regions this node was given that wait for their live old primary to release them.
    pub handovers_waiting: AtomicU64,
    /// This node's master loop (candidate or master).
    pub master: dpukv_cluster::master::LoopStatus,
    /// Regions with fewer in-sync copies than the cluster's target, as this node last read the
    /// map (every node reports the same figure; alert on any).
    pub under_replicated: AtomicU64,
    /// The cluster's last finished backup, as this node last read it (every node reports the
    /// same record, whichever node took the backup: docs/backup.md §7).
    pub last_backup: Mutex<Option<dpukv_cluster::schedule::LastBackup>>,
    /// This node's authority (its lease), shared with the agent that keeps it: the control API
    /// tells how long ago it was renewed.
    pub authority: dpukv_cluster::membership::Authority,
    led: Mutex<BTreeMap<u32, Led>>,
}

struct Led {
    acks: Arc<Acks>,
    feed: Arc<Feed>,
    tail: LogTail,
}

impl std::fmt::Debug for Led {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Led").field("end", &self.tail.end()).finish_non_exhaustive()
    }
}

impl ClusterMetrics {
    fn led(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Led>> {
        self.led.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This node leads `region` now.
    pub fn lead(&self, region: u32, acks: Arc<Acks>, feed: Arc<Feed>, tail: LogTail) {
        self.led().insert(region, Led { acks, feed, tail });
    }

    /// This node no longer leads `region`.
    pub fn unlead(&self, region: u32) {
        self.led().remove(&region);
    }

    /// (region, backup, lag in bytes, lag in records) for every backup of every led region (a
    /// backup not connected yet lags by the whole log).
    pub fn lags(&self) -> Vec<(u32, u32, u64, u64)> {
        let led = self.led();
        let mut out = Vec::new();
        for (&region, l) in led.iter() {
            let end = l.tail.end();
            for (backup, held) in l.acks.positions() {
                let held = held.unwrap_or(dpukv_storage::vlog::Lsn(0));
                out.push((region, backup, end.0.saturating_sub(held.0), l.feed.records_after(held)));
            }
        }
        out
    }
}

/// Exposes a [`ClusterMetrics`] to Prometheus.
#[derive(Debug)]
pub struct ClusterCollector(pub Arc<ClusterMetrics>);

fn gauge(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    values: &[(Vec<(&'static str, String)>, i64)],
) -> std::fmt::Result {
    let mut me = enc.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Gauge)?;
    for (labels, v) in values {
        ConstGauge::new(*v).encode(me.encode_family(labels)?)?;
    }
    Ok(())
}

fn plain_gauge(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let me = enc.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Gauge)?;
    ConstGauge::new(v).encode(me)
}

impl prometheus_client::collector::Collector for ClusterCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let m = &self.0;
        let r = &m.repl;
        encode_counters(
            &mut enc,
            &[
                ("dpukv_replication_log_bytes_shipped", "log bytes sent to backups", &r.log_bytes_shipped),
                (
                    "dpukv_replication_index_bytes_shipped",
                    "index (level segment) bytes sent to backups: Send Index",
                    &r.index_bytes_shipped,
                ),
                (
                    "dpukv_replication_whole_index_shipments",
                    "whole indexes sent (a backup joining or rejoining the stream)",
                    &r.whole_index_shipments,
                ),
                (
                    "dpukv_replication_sessions_resumed",
                    "streams to a backup that resumed from its own copy (not copied from the start)",
                    &r.sessions_resumed,
                ),
                (
                    "dpukv_replication_copies_restarted",
                    "backups told to copy a region again: the log they lacked was collected",
                    &r.copies_restarted,
                ),
                (
                    "dpukv_replication_copies_reused",
                    "copies this node kept when it stopped backing a region and resumed from when given it back",
                    &r.copies_reused,
                ),
                ("dpukv_replication_log_bytes_received", "log bytes received as a backup", &r.log_bytes_received),
                (
                    "dpukv_replication_index_bytes_installed",
                    "index (level segment) bytes installed as a backup",
                    &r.index_bytes_installed,
                ),
                (
                    "dpukv_replication_log_segments_dropped",
                    "log segment copies dropped as a backup, following the primary's garbage collection",
                    &r.log_segments_dropped,
                ),
                (
                    "dpukv_replication_records_built",
                    "records replayed into this node's own index as a Build Index backup",
                    &r.records_built,
                ),
                ("dpukv_cluster_promotions", "regions this node began to lead from its backup copy", &m.promotions),
                ("dpukv_cluster_catch_ups", "joining nodes reported caught up by this node", &m.catch_ups),
            ],
        )?;
        let lags = m.lags();
        let labels = |region: u32, backup: u32| vec![("region", region.to_string()), ("backup", backup.to_string())];
        let bytes: Vec<_> = lags.iter().map(|&(r, b, lb, _)| (labels(r, b), lb as i64)).collect();
        gauge(&mut enc, "dpukv_replication_lag_bytes", "log bytes a backup of a led region does not hold yet", &bytes)?;
        let records: Vec<_> = lags.iter().map(|&(r, b, _, lr)| (labels(r, b), lr as i64)).collect();
        gauge(
            &mut enc,
            "dpukv_replication_lag_records",
            "records a backup of a led region does not hold yet",
            &records,
        )?;
        let led = m.led().len() as i64;
        plain_gauge(&mut enc, "dpukv_cluster_regions_led", "regions this node leads", led)?;
        let backed = m.regions_backed.load(Ordering::Relaxed) as i64;
        plain_gauge(&mut enc, "dpukv_cluster_regions_backed", "regions this node backs or joins", backed)?;
        let waiting = m.handovers_waiting.load(Ordering::Relaxed) as i64;
        plain_gauge(
            &mut enc,
            "dpukv_cluster_handovers_waiting",
            "regions this node was given that wait for their old primary to release them",
            waiting,
        )?;
        plain_gauge(
            &mut enc,
            "dpukv_cluster_regions_under_replicated",
            "regions with fewer live in-sync copies than the replication factor allows (as this node last read the map)",
            m.under_replicated.load(Ordering::Relaxed) as i64,
        )?;
        let ms = &m.master;
        plain_gauge(
            &mut enc,
            "dpukv_cluster_master_loop_running",
            "1 while this node's master loop runs (campaigning or leading)",
            i64::from(ms.running()),
        )?;
        plain_gauge(
            &mut enc,
            "dpukv_cluster_master_leading",
            "1 while this node is the master",
            i64::from(ms.leading()),
        )?;
        plain_gauge(
            &mut enc,
            "dpukv_cluster_master_last_round_timestamp_seconds",
            "when this node last completed a round as master (unix seconds; 0: never)",
            (ms.last_round_ms() / 1000) as i64,
        )?;
        encode_counter(&mut enc, "dpukv_cluster_master_rounds", "rounds this node completed as master", ms.rounds())?;
        encode_counter(
            &mut enc,
            "dpukv_cluster_master_errors",
            "errors this node's master loop met and retried",
            ms.errors(),
        )?;
        let last = m.last_backup.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(b) = last {
            let backup = [
                (
                    "dpukv_backup_last_success_timestamp_seconds",
                    "when the cluster's last finished backup's cut committed (unix seconds)",
                    (b.at_ms / 1000) as i64,
                ),
                ("dpukv_backup_last_bytes", "bytes the cluster's last finished backup holds", b.bytes as i64),
                (
                    "dpukv_backup_last_uploaded_bytes",
                    "bytes the cluster's last finished backup uploaded (what the location lacked)",
                    b.uploaded as i64,
                ),
            ];
            for (name, help, v) in backup {
                plain_gauge(&mut enc, name, help, v)?;
            }
            let me = enc.encode_descriptor(
                "dpukv_backup_last_duration_seconds",
                "how long the cluster's last finished backup took, its cut to its manifest",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            ConstGauge::new(b.took_ms as f64 / 1000.0).encode(me)?;
        }
        Ok(())
    }
}
