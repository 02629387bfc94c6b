//! The plugin's Prometheus metrics and its HTTP endpoint: `/metrics` (text format) and
//! `/healthz` (200 while registered with the kubelet, 503 otherwise).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// See the module documentation.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Devices offered and healthy.
    pub healthy: Gauge,
    /// Devices offered and unhealthy.
    pub unhealthy: Gauge,
    /// Successful registrations with the kubelet.
    pub registrations: Counter,
    /// Containers given devices.
    pub allocations: Counter,
    /// Allocations refused (unknown or unhealthy devices).
    pub allocation_errors: Counter,
    /// Open `ListAndWatch` streams.
    pub streams: Gauge,
    /// Registered with the kubelet now.
    pub registered: AtomicBool,
}

impl Metrics {
    /// Registers every metric (names prefixed `dpukv_device_plugin_`).
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("dpukv_device_plugin");
        let (healthy, unhealthy, streams) = (Gauge::default(), Gauge::default(), Gauge::default());
        let (registrations, allocations, allocation_errors) =
            (Counter::default(), Counter::default(), Counter::default());
        registry.register("healthy_devices", "Devices offered and healthy", healthy.clone());
        registry.register("unhealthy_devices", "Devices offered and unhealthy", unhealthy.clone());
        registry.register("registrations", "Registrations with the kubelet", registrations.clone());
        registry.register("allocations", "Containers given devices", allocations.clone());
        registry.register("allocation_errors", "Allocations refused", allocation_errors.clone());
        registry.register("list_and_watch_streams", "Open ListAndWatch streams", streams.clone());
        Arc::new(Metrics {
            registry,
            healthy,
            unhealthy,
            registrations,
            allocations,
            allocation_errors,
            streams,
            registered: AtomicBool::new(false),
        })
    }

    /// The metrics in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `/metrics` and `/healthz` on `listener` until `stop`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], m.encode())
            }),
        )
        .route(
            "/healthz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.registered.load(Ordering::Acquire) {
                    (StatusCode::OK, "registered\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not registered with the kubelet\n")
                }
            }),
        )
        .with_state(metrics);
    axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await
}

/// Binds `addr` for [`serve`].
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
