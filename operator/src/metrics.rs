//! The operator's metrics (names prefixed `dpukv_operator_`): over all clusters — reconciles,
//! failures, durations, whether this replica leads — and per cluster (labels `dpukv_namespace`,
//! `dpukv_cluster`; `namespace` is the scrape target's own): its reconciles, failures and
//! durations, its phase, nodes wanted and ready, the pods a rollout has still to restart, the
//! regions the nodes being drained still lead or hold, and whether it is `Stalled` — what an
//! alert needs to say which cluster is stuck (charts/dpukv `DpuKvClusterStalled`). A deleted
//! cluster's series go with it (a bounded set: one per live cluster).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kube::ResourceExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::crd::{DpuKvCluster, DpuKvClusterStatus};

/// The phases a cluster's status can have (`dpukv_operator_cluster_phase` has one series each).
pub const PHASES: &[&str] =
    &["Pending", "Creating", "Running", "Degraded", "Scaling", "Draining", "Upgrading", "Deleting"];

/// Which cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ClusterLabels {
    /// Its namespace.
    pub dpukv_namespace: String,
    /// Its name.
    pub dpukv_cluster: String,
}

impl ClusterLabels {
    /// The labels of `c`.
    pub fn of(c: &DpuKvCluster) -> ClusterLabels {
        ClusterLabels { dpukv_namespace: c.namespace().unwrap_or_default(), dpukv_cluster: c.name_any() }
    }
}

/// A cluster and one of its phases.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PhaseLabels {
    /// Its namespace.
    pub dpukv_namespace: String,
    /// Its name.
    pub dpukv_cluster: String,
    /// One of [`PHASES`].
    pub phase: String,
}

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// How far a cluster's day-2 work is, as the reconcile saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Node pods a rollout has still to restart (0: none under way).
    pub rollout_pods_left: i64,
    /// Regions the nodes being drained still lead or hold (0: no drain).
    pub drain_regions_left: i64,
}

/// The per-cluster families (cheap to clone: they share their series).
#[derive(Debug, Clone)]
pub struct ClusterMetrics {
    reconciles: Family<ClusterLabels, Counter>,
    failures: Family<ClusterLabels, Counter>,
    duration: Family<ClusterLabels, Histogram, fn() -> Histogram>,
    phase: Family<PhaseLabels, Gauge>,
    nodes_desired: Family<ClusterLabels, Gauge>,
    nodes_ready: Family<ClusterLabels, Gauge>,
    rollout_pods_left: Family<ClusterLabels, Gauge>,
    drain_regions_left: Family<ClusterLabels, Gauge>,
    stalled: Family<ClusterLabels, Gauge>,
}

impl Default for ClusterMetrics {
    fn default() -> ClusterMetrics {
        ClusterMetrics {
            reconciles: Family::default(),
            failures: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            phase: Family::default(),
            nodes_desired: Family::default(),
            nodes_ready: Family::default(),
            rollout_pods_left: Family::default(),
            drain_regions_left: Family::default(),
            stalled: Family::default(),
        }
    }
}

impl ClusterMetrics {
    fn register(&self, r: &mut Registry) {
        r.register("cluster_reconciles", "Reconciles run, per cluster", self.reconciles.clone());
        r.register("cluster_reconcile_failures", "Reconciles that failed, per cluster", self.failures.clone());
        r.register("cluster_reconcile_duration_seconds", "Seconds per reconcile, per cluster", self.duration.clone());
        r.register("cluster_phase", "1 for the phase the cluster's status says, 0 for the others", self.phase.clone());
        r.register("cluster_nodes_desired", "Node pods the spec asks for", self.nodes_desired.clone());
        r.register("cluster_nodes_ready", "Node pods ready", self.nodes_ready.clone());
        r.register(
            "cluster_rollout_pods_left",
            "Node pods a rollout has still to restart (0: no rollout under way)",
            self.rollout_pods_left.clone(),
        );
        r.register(
            "cluster_drain_regions_left",
            "Regions the nodes being drained still lead or hold (0: no drain)",
            self.drain_regions_left.clone(),
        );
        r.register(
            "cluster_stalled",
            "1 while the cluster's Stalled condition is True (a rollout or drain made no progress for 15 minutes)",
            self.stalled.clone(),
        );
    }

    /// One reconcile of `c` ended after `took`.
    pub fn reconciled(&self, c: &DpuKvCluster, took: Duration, failed: bool) {
        let l = ClusterLabels::of(c);
        self.reconciles.get_or_create(&l).inc();
        self.duration.get_or_create(&l).observe(took.as_secs_f64());
        if failed {
            self.failures.get_or_create(&l).inc();
        }
    }

    /// What `c`'s status (just written) says, and how far its day-2 work is.
    pub fn observe(&self, c: &DpuKvCluster, status: &DpuKvClusterStatus, progress: Progress) {
        let l = ClusterLabels::of(c);
        let now = status.phase.as_deref().unwrap_or("");
        for p in PHASES {
            let pl = PhaseLabels {
                dpukv_namespace: l.dpukv_namespace.clone(),
                dpukv_cluster: l.dpukv_cluster.clone(),
                phase: (*p).into(),
            };
            self.phase.get_or_create(&pl).set(i64::from(*p == now));
        }
        self.nodes_desired.get_or_create(&l).set(i64::from(c.spec.nodes));
        self.nodes_ready.get_or_create(&l).set(i64::from(status.ready_nodes));
        self.rollout_pods_left.get_or_create(&l).set(progress.rollout_pods_left);
        self.drain_regions_left.get_or_create(&l).set(progress.drain_regions_left);
        let stalled = status.conditions.iter().any(|x| x.type_ == "Stalled" && x.status == "True");
        self.stalled.get_or_create(&l).set(i64::from(stalled));
    }

    /// `c` is gone: its series go too.
    pub fn forget(&self, c: &DpuKvCluster) {
        let l = ClusterLabels::of(c);
        for f in
            [&self.nodes_desired, &self.nodes_ready, &self.rollout_pods_left, &self.drain_regions_left, &self.stalled]
        {
            f.remove(&l);
        }
        self.reconciles.remove(&l);
        self.failures.remove(&l);
        self.duration.remove(&l);
        for p in PHASES {
            self.phase.remove(&PhaseLabels {
                dpukv_namespace: l.dpukv_namespace.clone(),
                dpukv_cluster: l.dpukv_cluster.clone(),
                phase: (*p).into(),
            });
        }
    }
}

/// Every metric of the operator.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Reconciles run.
    pub reconciles: Counter,
    /// Reconciles that failed.
    pub failures: Counter,
    /// Seconds per reconcile.
    pub duration: Histogram,
    /// 1 while this replica leads (runs the controller).
    pub leader: Gauge,
    /// The process runs, leading or standing by (ready).
    pub running: AtomicBool,
    /// Per cluster.
    pub clusters: ClusterMetrics,
}

impl Metrics {
    /// Registers them.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("dpukv_operator");
        let (reconciles, failures) = (Counter::default(), Counter::default());
        let duration = duration_histogram();
        registry.register("reconciles", "Reconciles run", reconciles.clone());
        registry.register("reconcile_failures", "Reconciles that failed", failures.clone());
        registry.register("reconcile_duration_seconds", "Seconds per reconcile", duration.clone());
        let leader = Gauge::default();
        registry.register("leader", "1 while this replica leads (runs the controller)", leader.clone());
        let clusters = ClusterMetrics::default();
        clusters.register(&mut registry);
        Arc::new(Metrics {
            registry,
            reconciles,
            failures,
            duration,
            leader,
            running: AtomicBool::new(false),
            clusters,
        })
    }

    /// Prometheus text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    use super::*;

    fn cluster(name: &str) -> DpuKvCluster {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "dpukv.io/v1alpha1", "kind": "DpuKvCluster",
            "metadata": {"name": name, "namespace": "db"},
            "spec": {"nodes": 5, "storage": {"size": "1Gi"}, "etcd": {"managed": {}}}}))
        .expect("cluster")
    }

    /// A cluster's series say its phase, nodes, progress and whether it stalled; a reconcile
    /// counts under its name; a deleted cluster's series go.
    #[test]
    fn each_cluster_has_its_series_and_loses_them_when_deleted() {
        let m = Metrics::new();
        let (a, b) = (cluster("a"), cluster("b"));
        let stalled = Condition {
            type_: "Stalled".into(),
            status: "True".into(),
            reason: "NoProgress".into(),
            message: String::new(),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
            observed_generation: None,
        };
        let status = DpuKvClusterStatus {
            phase: Some("Draining".into()),
            ready_nodes: 4,
            conditions: vec![stalled],
            ..DpuKvClusterStatus::default()
        };
        m.clusters.observe(&a, &status, Progress { rollout_pods_left: 0, drain_regions_left: 7 });
        m.clusters.reconciled(&a, Duration::from_millis(20), true);
        m.clusters.observe(
            &b,
            &DpuKvClusterStatus { phase: Some("Running".into()), ..Default::default() },
            Progress::default(),
        );
        let text = m.encode();
        for line in [
            "dpukv_operator_cluster_phase{dpukv_namespace=\"db\",dpukv_cluster=\"a\",phase=\"Draining\"} 1",
            "dpukv_operator_cluster_phase{dpukv_namespace=\"db\",dpukv_cluster=\"a\",phase=\"Running\"} 0",
            "dpukv_operator_cluster_stalled{dpukv_namespace=\"db\",dpukv_cluster=\"a\"} 1",
            "dpukv_operator_cluster_stalled{dpukv_namespace=\"db\",dpukv_cluster=\"b\"} 0",
            "dpukv_operator_cluster_drain_regions_left{dpukv_namespace=\"db\",dpukv_cluster=\"a\"} 7",
            "dpukv_operator_cluster_nodes_ready{dpukv_namespace=\"db\",dpukv_cluster=\"a\"} 4",
            "dpukv_operator_cluster_nodes_desired{dpukv_namespace=\"db\",dpukv_cluster=\"a\"} 5",
            "dpukv_operator_cluster_reconcile_failures_total{dpukv_namespace=\"db\",dpukv_cluster=\"a\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        m.clusters.forget(&a);
        let text = m.encode();
        assert!(!text.contains("dpukv_cluster=\"a\""), "{text}");
        assert!(text.contains("dpukv_cluster=\"b\""), "{text}");
    }
}
