//! The admin HTTP endpoint of a process, read-only: `/healthz` (alive), `/readyz` (serving),
//! `/metrics` (Prometheus text format), for probes and monitoring. Plain HTTP, bounded (module
//! `http`: [`LIMITS`]). What changes a cluster is on a host's control API (module `control`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// Shared state of the admin endpoint.
#[derive(Clone)]
pub struct Admin {
    /// Whether the process serves requests.
    pub ready: Arc<AtomicBool>,
    /// The metrics.
    pub registry: Arc<Registry>,
}

/// The admin endpoint's bounds: a few scrapers and probes at once, each request's header within
/// 5 s, a connection kept at most a minute.
pub const LIMITS: crate::http::Limits = crate::http::Limits {
    max_connections: 64,
    header_timeout: std::time::Duration::from_secs(5),
    max_life: std::time::Duration::from_secs(60),
    keep_alive: true,
};

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(a): State<Admin>) -> (StatusCode, &'static str) {
    if a.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(a): State<Admin>) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &a.registry) {
        Ok(()) => {
            (StatusCode::OK, [("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], out)
        }
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, [("content-type", "text/plain")], String::new()),
    }
}

/// Encodes `(name, help, value)` counters for a Prometheus collector.
pub fn encode_counters(
    enc: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    counters: &[(&str, &str, &std::sync::atomic::AtomicU64)],
) -> std::fmt::Result {
    for (name, help, v) in counters {
        encode_counter(enc, name, help, v.load(Ordering::Relaxed))?;
    }
    Ok(())
}

/// Encodes one counter read at scrape time.
pub fn encode_counter(
    enc: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    v: u64,
) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric;
    let c = prometheus_client::metrics::counter::ConstCounter::new(v);
    let me = enc.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(me)
}

/// Encodes gauges read at scrape time (name, help, value).
pub fn encode_gauges(
    enc: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    gauges: &[(&str, &str, i64)],
) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric;
    for (name, help, v) in gauges {
        let g = prometheus_client::metrics::gauge::ConstGauge::new(*v);
        let me = enc.encode_descriptor(name, help, None, g.metric_type())?;
        g.encode(me)?;
    }
    Ok(())
}

/// Binds `addr` and serves the endpoint until `shutdown` (within [`LIMITS`]); returns the bound
/// address.
pub async fn serve(addr: SocketAddr, admin: Admin, shutdown: CancellationToken) -> anyhow::Result<SocketAddr> {
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(admin);
    crate::http::serve(addr, None, app, LIMITS, shutdown).await
}
