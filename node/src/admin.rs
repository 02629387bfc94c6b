//! The admin HTTP endpoint of a process: `/healthz` (alive), `/readyz` (serving), `/metrics`
//! (Prometheus text format).

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
    use prometheus_client::encoding::EncodeMetric;
    for (name, help, v) in counters {
        let c = prometheus_client::metrics::counter::ConstCounter::new(v.load(Ordering::Relaxed));
        let me = enc.encode_descriptor(name, help, None, c.metric_type())?;
        c.encode(me)?;
    }
    Ok(())
}

/// Binds `addr` and serves the endpoint until `shutdown`; returns the bound address.
pub async fn serve(addr: SocketAddr, admin: Admin, shutdown: CancellationToken) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(admin);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
    });
    Ok(local)
}
