//! Running the operator: the controller over every `DpuKvCluster` (and the objects it owns, so a
//! changed or deleted child is put back), its metrics — reconciles, failures, durations, whether
//! this replica leads — and `/metrics`, `/healthz` and `/readyz` (ready once the process runs,
//! leading or standing by: a follower is a healthy replica, and a rollout must not wait for it
//! to win the Lease).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher::{self, watcher};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::backups::{self, DpuKvBackup, DpuKvBackupSchedule, DpuKvRestore};
use crate::controller::{self, Context, Error};
use crate::crd::DpuKvCluster;
pub use crate::metrics::Metrics;
use crate::operation::{self, DpuKvOperation};
use crate::render::OperatorPods;

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

/// Keeps what `f` makes of the objects a watch of `api` holds, in `into`, after every event
/// (not just for the objects it touched: the store takes a list's objects only at its end,
/// `InitDone`, which touches none), until `stop`; a watch error is retried by the watcher's
/// backoff.
async fn keep_from_watch<K, T>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    into: Arc<std::sync::RwLock<T>>,
    f: impl Fn(&[Arc<K>]) -> T,
    stop: CancellationToken,
) where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    use kube::runtime::{WatchStreamExt, reflector};
    let (store, writer) = reflector::store();
    let stream = reflector(writer, watcher(api, config)).default_backoff();
    futures::pin_mut!(stream);
    loop {
        let next = tokio::select! {
            n = stream.next() => n,
            _ = stop.cancelled() => return,
        };
        match next {
            None => return,
            Some(Err(e)) => tracing::debug!(error = %e, "watching {what}"),
            Some(Ok(_)) => *into.write().unwrap_or_else(|e| e.into_inner()) = f(&store.state()),
        }
    }
}

/// Keeps `zones` what the Kubernetes nodes' `topology.kubernetes.io/zone` labels say (a watch of
/// their metadata only), until `stop`.
pub async fn watch_zones(
    nodes: Api<kube::core::PartialObjectMeta<Node>>,
    zones: Arc<std::sync::RwLock<std::collections::BTreeMap<String, String>>>,
    stop: CancellationToken,
) {
    let zones_of = |nodes: &[Arc<kube::core::PartialObjectMeta<Node>>]| {
        nodes
            .iter()
            .filter_map(|n| {
                let zone = n.metadata.labels.as_ref()?.get(crate::render::ZONE_LABEL)?.clone();
                Some((n.metadata.name.clone()?, zone))
            })
            .collect()
    };
    keep_from_watch(nodes, watcher::Config::default(), "the nodes' zones", zones, zones_of, stop).await;
}

/// Keeps `unscheduled` what the operator's pods (its label) say the scheduler could not place,
/// until `stop`.
pub async fn watch_unscheduled(pods: Api<Pod>, unscheduled: controller::Unscheduled, stop: CancellationToken) {
    let config = watcher::Config::default().labels(MANAGED);
    keep_from_watch(
        pods,
        config,
        "the operator's pods",
        unscheduled,
        |p: &[Arc<Pod>]| controller::unscheduled_of(p),
        stop,
    )
    .await;
}

/// Keeps `held` what the `DpuKvOperation`s (every namespace) hold, until `stop`.
pub async fn watch_operations(ops: Api<DpuKvOperation>, held: operation::Held, stop: CancellationToken) {
    keep_from_watch(
        ops,
        watcher::Config::default(),
        "the operations",
        held,
        |o: &[Arc<DpuKvOperation>]| operation::held_of(o),
        stop,
    )
    .await;
}

/// The label of what the operator made.
const MANAGED: &str = "app.kubernetes.io/managed-by=dpukv-operator";

/// Runs the controller until `stop`, as if the operator ran where the chart puts it by default.
pub async fn run(client: Client, m: Arc<Metrics>, stop: CancellationToken) {
    run_as(client, m, stop, OperatorPods::default()).await
}

/// Runs the controller until `stop`; the operator's pods are `pods` (the clusters'
/// NetworkPolicies let them reach the nodes' control port).
pub async fn run_as(client: Client, m: Arc<Metrics>, stop: CancellationToken, pods: OperatorPods) {
    let ctx = Context::full(
        client.clone(),
        Box::new(controller::first_pod_admin),
        crate::etcd_keys::etcd_cleaner(),
        pods,
        m.clusters.clone(),
    );
    let clusters: Api<DpuKvCluster> = Api::all(client.clone());
    let cfg = watcher::Config::default();
    tokio::spawn(watch_zones(Api::all(client.clone()), ctx.zones.clone(), stop.clone()));
    tokio::spawn(watch_unscheduled(Api::all(client.clone()), ctx.unscheduled.clone(), stop.clone()));
    // What operations hold is unknown until their watch has listed them.
    *ctx.held.write().unwrap_or_else(|e| e.into_inner()) = None;
    tokio::spawn(watch_operations(Api::all(client.clone()), ctx.held.clone(), stop.clone()));
    let reconcile = {
        let m = m.clone();
        move |c: Arc<DpuKvCluster>, ctx: Arc<Context>| {
            let m = m.clone();
            async move {
                let started = Instant::now();
                m.reconciles.inc();
                let r = controller::reconcile(c.clone(), ctx).await;
                let took = started.elapsed();
                m.duration.observe(took.as_secs_f64());
                let failed = r.as_ref().is_err_and(Error::is_failure);
                if failed {
                    m.failures.inc();
                }
                if c.metadata.deletion_timestamp.is_some() && r.is_ok() {
                    // Deleted (its cleanup done): its series go with it.
                    m.clusters.forget(&c);
                } else {
                    m.clusters.reconciled(&c, took, failed);
                }
                r
            }
        }
    };
    m.running.store(true, Ordering::Release);
    m.leader.set(1);
    // Only what the operator made (its label): a Kubernetes cluster holds many other
    // StatefulSets, Services, ConfigMaps — often large —, which it would otherwise cache and
    // watch every change of.
    let owned = cfg.clone().labels(MANAGED);
    let operations = {
        let stop = stop.clone();
        Controller::new(Api::<DpuKvOperation>::all(client.clone()), cfg.clone())
            .graceful_shutdown_on(async move { stop.cancelled().await })
            .run(operation::reconcile, operation::error_policy, ctx.clone())
            .for_each(|r| async move {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "operation controller event");
                }
            })
    };
    // The backup resources: each its own controller, through the clusters' control APIs.
    let backup_resources = {
        let (s1, s2, s3) = (stop.clone(), stop.clone(), stop.clone());
        let one = Controller::new(Api::<DpuKvBackup>::all(client.clone()), cfg.clone())
            .graceful_shutdown_on(async move { s1.cancelled().await })
            .run(backups::reconcile_backup, backups::error_policy, ctx.clone())
            .for_each(|r| async move {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "backup controller event");
                }
            });
        let scheduled = Controller::new(Api::<DpuKvBackupSchedule>::all(client.clone()), cfg.clone())
            .graceful_shutdown_on(async move { s2.cancelled().await })
            .run(backups::reconcile_schedule, backups::error_policy, ctx.clone())
            .for_each(|r| async move {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "backup schedule controller event");
                }
            });
        let restores = Controller::new(Api::<DpuKvRestore>::all(client.clone()), cfg.clone())
            .graceful_shutdown_on(async move { s3.cancelled().await })
            .run(backups::reconcile_restore, backups::error_policy, ctx.clone())
            .for_each(|r| async move {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "restore controller event");
                }
            });
        futures::future::join3(one, scheduled, restores)
    };
    let clusters = Controller::new(clusters, cfg)
        .owns(Api::<StatefulSet>::all(client.clone()), owned.clone())
        .owns(Api::<Deployment>::all(client.clone()), owned.clone())
        .owns(Api::<Service>::all(client.clone()), owned.clone())
        .owns(Api::<PodDisruptionBudget>::all(client.clone()), owned.clone())
        .owns(Api::<NetworkPolicy>::all(client.clone()), owned.clone())
        .owns(Api::<ConfigMap>::all(client), owned)
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
        });
    futures::future::join3(clusters, operations, backup_resources).await;
    m.leader.set(0);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

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

    /// The nodes' zones are kept from a watch of their metadata: a list, then changes.
    #[tokio::test]
    async fn the_nodes_zones_are_kept_from_a_watch_of_their_metadata() {
        use http::{Request, Response};
        let (svc, mut h) = tower_test::mock::pair::<Request<kube::client::Body>, Response<kube::client::Body>>();
        let zones: Arc<std::sync::RwLock<std::collections::BTreeMap<String, String>>> = Arc::default();
        let stop = CancellationToken::new();
        let task = tokio::spawn(watch_zones(Api::all(Client::new(svc, "default")), zones.clone(), stop.clone()));
        let node = |name: &str, zone: &str| {
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "resourceVersion": "3",
                "labels": {"topology.kubernetes.io/zone": zone}}, "status": {"allocatable": {"cpu": "2"}}})
        };
        let respond = |send: tower_test::mock::SendResponse<Response<kube::client::Body>>, v: serde_json::Value| {
            send.send_response(
                Response::builder()
                    .status(200)
                    .body(kube::client::Body::from(serde_json::to_vec(&v).expect("json")))
                    .expect("response"),
            );
        };
        let (req, send) = h.next_request().await.expect("a list");
        assert_eq!(req.uri().path(), "/api/v1/nodes");
        let accept = req.headers().get("accept").and_then(|a| a.to_str().ok()).unwrap_or_default().to_string();
        assert!(accept.contains("PartialObjectMetadata"), "metadata only: {accept}");
        respond(
            send,
            serde_json::json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "3"},
            "items": [node("worker-1", "zone-a"), node("worker-2", "zone-b")]}),
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while zones.read().expect("zones").len() < 2 {
            assert!(std::time::Instant::now() < deadline, "the zones were never kept");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(zones.read().expect("zones")["worker-2"], "zone-b");
        stop.cancel();
        drop(h);
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
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
