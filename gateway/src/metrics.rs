//! The gateway's metrics (their names are an interface: docs/operations.md): request latency per
//! front end and operation (a histogram, seconds), errors per front end and stable error code,
//! connections open per front end, the scans' sub-range reads, and the memory budget's use.

use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A front end and an operation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OpLabels {
    /// `binary`, `http` or `resp`.
    pub frontend: &'static str,
    /// The operation's stable name (the protocol's op names; RESP and HTTP map onto them).
    pub op: &'static str,
}

/// A front end and an error code.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ErrorLabels {
    /// `binary`, `http` or `resp`.
    pub frontend: &'static str,
    /// The stable error code (docs/protocol.md §8, plus `unauthorized` and `forbidden`).
    pub code: &'static str,
}

/// A front end.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct FrontendLabels {
    /// `binary`, `http` or `resp`.
    pub frontend: &'static str,
}

type LatencyFamily = Family<OpLabels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 20 µs to about 21 s.
    Histogram::new(exponential_buckets(0.000_02, 2.0, 21))
}

/// The gateway's metrics and the registry that exposes them.
pub struct Metrics {
    /// Every metric, for `/metrics`.
    pub registry: Registry,
    latency: LatencyFamily,
    /// `latency`'s series for RESP gets, held so that a get answered at once records without a
    /// look-up by labels (hashing them) per request.
    resp_get: Histogram,
    errors: Family<ErrorLabels, Counter>,
    connections: Family<FrontendLabels, Gauge<i64, AtomicI64>>,
    /// Sub-range reads started by scans.
    pub scan_parts: Counter,
    /// Gets by who served them (the upstream clients' counts, once connected: one per gateway
    /// sharing these metrics — a device's front door threads — summed).
    reads: Arc<std::sync::Mutex<Vec<Arc<dpukv_client::ReadCounts>>>>,
    /// The memory budgets (one per gateway sharing these metrics), summed.
    budget: Arc<std::sync::Mutex<Vec<dpukv_net::conn::Budget>>>,
}

/// `dpukv_gateway_memory_budget_bytes{state="used"|"total"}`, read at scrape time.
struct BudgetCollector(Arc<std::sync::Mutex<Vec<dpukv_net::conn::Budget>>>);

impl std::fmt::Debug for BudgetCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BudgetCollector")
    }
}

impl prometheus_client::collector::Collector for BudgetCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
        let (used, total) = {
            let budgets = self.0.lock().unwrap_or_else(|e| e.into_inner());
            if budgets.is_empty() {
                return Ok(());
            }
            budgets.iter().fold((0, 0), |(u, t), b| (u + b.used(), t + b.total()))
        };
        let g = prometheus_client::metrics::gauge::ConstGauge::new(0i64);
        let mut me = enc.encode_descriptor(
            "dpukv_gateway_memory_budget_bytes",
            "The memory budget: bytes held by requests and connections (used), and its size (total)",
            None,
            g.metric_type(),
        )?;
        for (state, n) in [("used", used), ("total", total)] {
            let labels = [("state", state)];
            let m: MetricEncoder<'_> = me.encode_family(&labels)?;
            prometheus_client::metrics::gauge::ConstGauge::new(n as i64).encode(m)?;
        }
        Ok(())
    }
}

/// `dpukv_gateway_reads_total{served_by="primary"|"replica"}`, read at scrape time.
#[derive(Debug)]
struct ReadsCollector(Arc<std::sync::Mutex<Vec<Arc<dpukv_client::ReadCounts>>>>);

impl prometheus_client::collector::Collector for ReadsCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
        let (p, r) = self.0.lock().unwrap_or_else(|e| e.into_inner()).iter().fold((0, 0), |(p, r), c| {
            let (cp, cr) = c.get();
            (p + cp, r + cr)
        });
        let c = prometheus_client::metrics::counter::ConstCounter::new(0u64);
        let mut me = enc.encode_descriptor("dpukv_gateway_reads", "Gets by who served them", None, c.metric_type())?;
        for (by, n) in [("primary", p), ("replica", r)] {
            let labels = [("served_by", by)];
            let m: MetricEncoder<'_> = me.encode_family(&labels)?;
            prometheus_client::metrics::counter::ConstCounter::new(n).encode(m)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Registered, all at zero.
    pub fn new() -> Arc<Metrics> {
        let latency: LatencyFamily = Family::new_with_constructor(latency_histogram);
        let errors = Family::<ErrorLabels, Counter>::default();
        let connections = Family::<FrontendLabels, Gauge<i64, AtomicI64>>::default();
        let scan_parts = Counter::default();
        let resp_get = latency.get_or_create(&OpLabels { frontend: "resp", op: "get" }).clone();
        let mut m = Metrics {
            registry: Registry::default(), // (filled below)
            latency,
            resp_get,
            errors,
            connections,
            scan_parts,
            reads: Default::default(),
            budget: Default::default(),
        };
        let mut registry = Registry::default();
        m.register_into(&mut registry);
        m.registry = registry;
        Arc::new(m)
    }

    /// Registers these metrics (the same series, not copies) in `registry` too: a device's
    /// `/metrics` shows its front door's (docs/gateway.md, "The front door in each device").
    pub fn register_into(&self, registry: &mut Registry) {
        registry.register(
            "dpukv_gateway_request_duration_seconds",
            "Time from a request's arrival to its answer, by front end and operation",
            self.latency.clone(),
        );
        registry.register(
            "dpukv_gateway_errors",
            "Requests answered with an error, by front end and code",
            self.errors.clone(),
        );
        registry.register("dpukv_gateway_connections", "Connections open, by front end", self.connections.clone());
        registry.register("dpukv_gateway_scan_parts", "Sub-range reads started by scans", self.scan_parts.clone());
        registry.register_collector(Box::new(ReadsCollector(self.reads.clone())));
        registry.register_collector(Box::new(BudgetCollector(self.budget.clone())));
    }

    /// Reports a memory budget's use (summed with the others of gateways sharing these metrics).
    pub fn watch_budget(&self, budget: dpukv_net::conn::Budget) {
        self.budget.lock().unwrap_or_else(|e| e.into_inner()).push(budget);
    }

    /// Counts gets from an upstream client's counts (summed as [`Metrics::watch_budget`]'s).
    pub fn count_reads(&self, counts: Arc<dpukv_client::ReadCounts>) {
        self.reads.lock().unwrap_or_else(|e| e.into_inner()).push(counts);
    }

    /// Records one request's latency since `started`.
    pub fn observe(&self, frontend: &'static str, op: &'static str, started: Instant) {
        self.latency.get_or_create(&OpLabels { frontend, op }).observe(started.elapsed().as_secs_f64());
    }

    /// Records a RESP get's latency, `seconds` (the `resp`/`get` series of [`Metrics::observe`]).
    pub fn observe_resp_get(&self, seconds: f64) {
        self.resp_get.observe(seconds);
    }

    /// Counts an error answer.
    pub fn error(&self, frontend: &'static str, code: &'static str) {
        self.errors.get_or_create(&ErrorLabels { frontend, code }).inc();
    }

    /// Counts a connection until the guard is dropped.
    pub fn connection(self: &Arc<Self>, frontend: &'static str) -> ConnectionGuard {
        self.connections.get_or_create(&FrontendLabels { frontend }).inc();
        ConnectionGuard { metrics: self.clone(), frontend }
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// An open connection (counted while it lives).
pub struct ConnectionGuard {
    metrics: Arc<Metrics>,
    frontend: &'static str,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.metrics.connections.get_or_create(&FrontendLabels { frontend: self.frontend }).dec();
    }
}
