//! Running the operator: the controller over every `DpuKvCluster` (and the objects it owns, so a
//! changed or deleted child is put back), its metrics — reconciles, failures, durations, whether
//! this replica leads — and `/metrics`, `/healthz` and `/readyz` (ready once the process runs,
//! leading or standing by: a follower is a healthy replica, and a rollout must not wait for it
//! to win the Lease).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Context, Error};
use crate::crd::DpuKvCluster;
use crate::render::OperatorPods;

/// The operator's metrics (names prefixed `dpukv_operator_`).
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
}

impl Metrics {
    /// Registers them.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("dpukv_operator");
        let (reconciles, failures) = (Counter::default(), Counter::default());
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register("reconciles", "Reconciles run", reconciles.clone());
        registry.register("reconcile_failures", "Reconciles that failed", failures.clone());
        registry.register("reconcile_duration_seconds", "Seconds per reconcile", duration.clone());
        let leader = Gauge::default();
        registry.register("leader", "1 while this replica leads (runs the controller)", leader.clone());
        Arc::new(Metrics { registry, reconciles, failures, duration, leader, running: AtomicBool::new(false) })
    }

    /// Prometheus text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until `stop`.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    m: Arc<Metrics>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], m.encode())
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.running.load(Ordering::Acquire) {
                    (StatusCode::OK, "ready\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
                }
            }),
        )
        .with_state(m);
    axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await
}

/// Binds the HTTP endpoint's address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Runs `work` until it ends, or drops it — every reconcile in flight with it, mid-request — the
/// moment `lost` fires while `stop` has not (leadership lost: another replica may lead within
/// the lease's margin, and a reconcile that went on — one admin call can take seconds — would
/// act beside it). A `stop` (the process asked to end) leaves `work` to its graceful shutdown.
/// Whether `work` ran to its end.
pub async fn unless_lost(
    work: impl std::future::Future<Output = ()>,
    lost: CancellationToken,
    stop: CancellationToken,
) -> bool {
    let lost_alone = async {
        lost.cancelled().await;
        if stop.is_cancelled() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        biased;
        _ = lost_alone => false,
        _ = work => true,
    }
}

/// Runs the controller until `stop`, as if the operator ran where the chart puts it by default.
pub async fn run(client: Client, m: Arc<Metrics>, stop: CancellationToken) {
    run_as(client, m, stop, OperatorPods::default()).await
}

/// Runs the controller until `stop`; the operator's pods are `pods` (the clusters'
/// NetworkPolicies let them reach the nodes' control port).
pub async fn run_as(client: Client, m: Arc<Metrics>, stop: CancellationToken, pods: OperatorPods) {
    let ctx =
        Context::full(client.clone(), Box::new(controller::first_pod_admin), crate::etcd_keys::etcd_cleaner(), pods);
    let clusters: Api<DpuKvCluster> = Api::all(client.clone());
    let cfg = watcher::Config::default();
    let reconcile = {
        let m = m.clone();
        move |c: Arc<DpuKvCluster>, ctx: Arc<Context>| {
            let m = m.clone();
            async move {
                let started = Instant::now();
                m.reconciles.inc();
                let r = controller::reconcile(c, ctx).await;
                m.duration.observe(started.elapsed().as_secs_f64());
                if r.as_ref().is_err_and(Error::is_failure) {
                    m.failures.inc();
                }
                r
            }
        }
    };
    m.running.store(true, Ordering::Release);
    m.leader.set(1);
    Controller::new(clusters, cfg.clone())
        .owns(Api::<StatefulSet>::all(client.clone()), cfg.clone())
        .owns(Api::<Deployment>::all(client.clone()), cfg.clone())
        .owns(Api::<Service>::all(client.clone()), cfg.clone())
        .owns(Api::<PodDisruptionBudget>::all(client.clone()), cfg.clone())
        .owns(Api::<NetworkPolicy>::all(client.clone()), cfg.clone())
        // Only the operator's ConfigMaps: a cluster holds many others, often large.
        .owns(Api::<ConfigMap>::all(client), cfg.labels("app.kubernetes.io/managed-by=dpukv-operator"))
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(
            reconcile,
            |c: Arc<DpuKvCluster>, e: &Error, ctx: Arc<Context>| -> Action { controller::error_policy(c, e, ctx) },
            ctx,
        )
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "controller event");
            }
        })
        .await;
    m.leader.set(0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    /// Leadership lost: a reconcile halfway through is dropped at once, not finished; a stop lets
    /// the work end by itself.
    #[tokio::test]
    async fn work_is_dropped_at_once_when_leadership_is_lost_and_ends_by_itself_on_stop() {
        let (stop, lost) = (CancellationToken::new(), CancellationToken::new());
        let finished = Arc::new(AtomicBool::new(false));
        let work = {
            let finished = finished.clone();
            async move {
                tokio::time::sleep(std::time::Duration::from_secs(9)).await;
                finished.store(true, Ordering::Release);
            }
        };
        let l = lost.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            l.cancel();
        });
        let began = Instant::now();
        assert!(!unless_lost(work, lost, stop).await, "dropped");
        assert!(began.elapsed() < std::time::Duration::from_secs(2) && !finished.load(Ordering::Acquire));
        // A stop (its child token `lost` fires too): the work finishes.
        let stop = CancellationToken::new();
        let lost = stop.child_token();
        stop.cancel();
        let work = async { tokio::time::sleep(std::time::Duration::from_millis(100)).await };
        assert!(unless_lost(work, lost, stop).await, "graceful");
    }

    #[tokio::test]
    async fn health_readiness_and_metrics_are_served() {
        let m = Metrics::new();
        let l = bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let stop = CancellationToken::new();
        tokio::spawn(serve_http(l, m.clone(), stop.clone()));
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"), "not ready before the controller runs");
        m.running.store(true, Ordering::Release);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        m.reconciles.inc();
        m.duration.observe(0.01);
        let metrics = get(addr, "/metrics").await;
        assert!(metrics.contains("dpukv_operator_reconciles_total 1"), "{metrics}");
        assert!(metrics.contains("dpukv_operator_reconcile_duration_seconds_count 1"), "{metrics}");
        stop.cancel();
    }
}
