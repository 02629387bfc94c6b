//! The admin HTTP endpoint of a process: `/healthz` (alive), `/readyz` (serving), `/metrics`
//! (Prometheus text format), and on a cluster's hosts `/cluster/drain/{node}` (POST: drain the
//! node; GET: its progress; DELETE: stop draining it), `/cluster/split/{region}/{hex key}` and
//! `/cluster/merge/{region}` (POST: ask the master to split a region at a key, or to merge it
//! into its left neighbour; checked against the current map first), `/cluster/step-down/{node}`
//! (POST: move the node's primaries to backups elsewhere, keeping its copies — before a restart;
//! GET: progress; DELETE: stop) and `/cluster/summary` (GET:
//! the master, live nodes, regions, regions without a live primary or short of copies) — what
//! `dpukv cluster` and the operator call.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use dpukv_cluster::keys::Keys;
use dpukv_cluster::master::Snapshot;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// Shared state of the admin endpoint.
#[derive(Clone)]
pub struct Admin {
    /// Whether the process serves requests.
    pub ready: Arc<AtomicBool>,
    /// The metrics.
    pub registry: Arc<Registry>,
    /// The cluster's metadata store, on a cluster's host.
    pub cluster: Option<ClusterControl>,
}

/// Where cluster requests go: the cluster's etcd and key layout.
#[derive(Debug, Clone)]
pub struct ClusterControl {
    /// How to reach etcd.
    pub etcd: dpukv_cluster::EtcdOptions,
    /// The cluster's keys.
    pub keys: dpukv_cluster::keys::Keys,
}

type Answer = (StatusCode, [(&'static str, &'static str); 1], String);

fn text(code: StatusCode, body: String) -> Answer {
    (code, [("content-type", "text/plain; charset=utf-8")], body)
}

/// A node's drain: requested, and what it still holds.
fn drain_status(snap: &Snapshot, node: u32) -> String {
    let led = snap.map.regions.iter().filter(|r| r.primary == node).count();
    let held = snap.map.regions.iter().filter(|r| r.backups.contains(&node) || r.joining.contains(&node)).count();
    let draining = snap.facts.draining.contains(&node);
    let done = draining && led == 0 && held == 0;
    format!(
        "{{\"node\": {node}, \"draining\": {draining}, \"regions_led\": {led}, \"regions_held\": {held}, \"done\": {done}}}\n"
    )
}

/// A node's step-down: requested, the regions it still leads, those of them a backup elsewhere
/// could take, and whether it is done (nothing movable left, every handover released).
fn step_down_status(snap: &Snapshot, node: u32) -> String {
    let live: std::collections::HashSet<u32> = snap.map.nodes.iter().map(|n| n.id).collect();
    let f = &snap.facts;
    let takes = |b: u32| live.contains(&b) && !f.draining.contains(&b) && !f.stepping_down.contains(&b);
    let led: Vec<_> = snap.map.regions.iter().filter(|r| r.primary == node).collect();
    let movable = led.iter().filter(|r| r.backups.iter().any(|&b| takes(b))).count();
    let unreleased = snap.handovers.keys().any(|&(_, n)| n == node);
    let stepping = f.stepping_down.contains(&node);
    let done = stepping && movable == 0 && !unreleased;
    format!(
        "{{\"node\": {node}, \"stepping_down\": {stepping}, \"regions_led\": {}, \"movable\": {movable}, \"done\": {done}}}\n",
        led.len()
    )
}

/// The cluster at a glance (`master::Snapshot::health`).
fn summary_status(snap: &Snapshot) -> String {
    let h = snap.health();
    let age = h.master_round_age_ms.map_or("null".to_string(), |a| a.to_string());
    format!(
        "{{\"master\": {}, \"master_round_age_ms\": {age}, \"nodes\": {}, \"regions\": {}, \"without_primary\": {}, \"under_replicated\": {}}}\n",
        h.master, h.nodes, h.regions, h.without_primary, h.under_replicated
    )
}

/// A request key and its value (`POST` puts it, `DELETE` removes it).
type RequestKey<'a> = (&'a axum::http::Method, fn(&Keys, u32) -> Vec<u8>, u32, &'a [u8]);

/// A cluster request: with `request` first, then `status` of the cluster as etcd has it now, as
/// JSON.
async fn cluster_request(
    a: &Admin,
    request: Option<RequestKey<'_>>,
    status: impl FnOnce(&Snapshot) -> String,
) -> Answer {
    let Some(c) = a.cluster.as_ref() else {
        return text(StatusCode::NOT_FOUND, "this process is not a cluster's host\n".into());
    };
    let unavailable =
        |e: dpukv_cluster::MetaError| text(StatusCode::SERVICE_UNAVAILABLE, format!("{}: {e}\n", e.code()));
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    use dpukv_cluster::MetaStore;
    let changed = match request {
        Some((&axum::http::Method::POST, key, node, value)) => {
            store.put(&key(&c.keys, node), value, None).await.map(|_| ())
        }
        Some((&axum::http::Method::DELETE, key, node, _)) => store.delete(&key(&c.keys, node)).await.map(|_| ()),
        _ => Ok(()),
    };
    if let Err(e) = changed {
        return unavailable(e);
    }
    match dpukv_cluster::master::read(&store, &c.keys).await {
        Ok(snap) => (StatusCode::OK, [("content-type", "application/json")], status(&snap)),
        Err(e) => unavailable(e),
    }
}

/// `POST` (ask), `GET` (progress), `DELETE` (stop) `/cluster/step-down/{node}`: the node's
/// primaries move to backups elsewhere, its copies stay (before a restart).
async fn step_down(State(a): State<Admin>, Path(node): Path<u32>, method: axum::http::Method) -> Answer {
    cluster_request(&a, Some((&method, Keys::step_down, node, b"step-down")), |s| step_down_status(s, node)).await
}

/// `POST` (ask), `GET` (progress), `DELETE` (stop) `/cluster/drain/{node}`.
async fn drain(State(a): State<Admin>, Path(node): Path<u32>, method: axum::http::Method) -> Answer {
    cluster_request(&a, Some((&method, Keys::drain, node, b"drain")), |s| drain_status(s, node)).await
}

/// `GET /cluster/summary`: the cluster at a glance, from etcd.
async fn summary(State(a): State<Admin>) -> Answer {
    cluster_request(&a, None, summary_status).await
}

/// Checks a split or merge request against the current map and records it for the master.
async fn request_handoff(a: &Admin, region: u32, split_at: Option<Vec<u8>>) -> Answer {
    let Some(c) = a.cluster.as_ref() else {
        return text(StatusCode::NOT_FOUND, "this process is not a cluster's host\n".into());
    };
    let unavailable =
        |e: dpukv_cluster::MetaError| text(StatusCode::SERVICE_UNAVAILABLE, format!("{}: {e}\n", e.code()));
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let snap = match dpukv_cluster::master::read(&store, &c.keys).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let regions = &snap.map.regions;
    let Some(i) = regions.iter().position(|r| r.id == region) else {
        return text(StatusCode::NOT_FOUND, format!("no region {region}\n"));
    };
    let r = &regions[i];
    let bad = |m: String| text(StatusCode::BAD_REQUEST, m + "\n");
    use dpukv_cluster::MetaStore;
    let put = match &split_at {
        Some(k) => {
            if !(r.start.as_slice() < k.as_slice() && r.contains(k)) {
                return bad(format!("the key is not strictly inside region {region}"));
            }
            store.put(&c.keys.split_request(region), k, None).await
        }
        None => {
            let Some(l) = i.checked_sub(1).map(|j| &regions[j]) else {
                return bad(format!("region {region} is the first: it has no left neighbour to merge into"));
            };
            let set =
                |r: &dpukv_proto::regionmap::RegionInfo| r.replicas().collect::<std::collections::BTreeSet<u32>>();
            if set(l) != set(r) {
                return bad(format!(
                    "regions {} and {region} are on different nodes ({:?} vs {:?}): only regions on the same \
                     nodes merge",
                    l.id,
                    set(l),
                    set(r)
                ));
            }
            store.put(&c.keys.merge_request(region), b"merge", None).await
        }
    };
    match put {
        Ok(_) => (
            StatusCode::OK,
            [("content-type", "application/json")],
            format!("{{\"region\": {region}, \"requested\": true}}\n"),
        ),
        Err(e) => unavailable(e),
    }
}

async fn split(
    State(a): State<Admin>,
    axum::extract::Path((region, key)): axum::extract::Path<(u32, String)>,
) -> Answer {
    let k = dpukv_cluster::keys::unhex(&key).filter(|k| k.len() <= dpukv_proto::limits::MAX_KEY);
    match k {
        Some(k) if !k.is_empty() => request_handoff(&a, region, Some(k)).await,
        _ => text(StatusCode::BAD_REQUEST, "the key must be 1 to 1024 bytes, in hex\n".into()),
    }
}

async fn merge(State(a): State<Admin>, axum::extract::Path(region): axum::extract::Path<u32>) -> Answer {
    request_handoff(&a, region, None).await
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

/// Binds `addr` and serves the endpoint until `shutdown`; returns the bound address.
pub async fn serve(addr: SocketAddr, admin: Admin, shutdown: CancellationToken) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/cluster/drain/{node}", get(drain).post(drain).delete(drain))
        .route("/cluster/summary", get(summary))
        .route("/cluster/step-down/{node}", get(step_down).post(step_down).delete(step_down))
        .route("/cluster/split/{region}/{key}", axum::routing::post(split))
        .route("/cluster/merge/{region}", axum::routing::post(merge))
        .with_state(admin);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
    });
    Ok(local)
}
