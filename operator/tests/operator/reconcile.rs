//! The reconciler against a mock API server (`tower_test::mock::pair` behind a `kube::Client`,
//! as kube-rs' controller-rs fixtures do): each test scripts the requests the reconciler must
//! make, in order — method, path, field manager, body — answers them with realistic objects, and
//! fails on any request it did not expect. Events (`events.k8s.io`) are the exception: they are
//! answered wherever they come and recorded, and tests check which were published.

use std::sync::Arc;
use std::time::Duration;

use dpukv_cluster::{MemStore, MetaStore};
use dpukv_operator::controller::{Context, MANAGER, PREVIOUS_CONFIGS_ANNOTATION, backoff, error_policy, reconcile};
use dpukv_operator::crd::{DpuKvCluster, DpuKvClusterSpec};
use dpukv_operator::{etcd_keys, render};
use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Mutex;

type Exchange = (Request<Body>, tower_test::mock::SendResponse<Response<Body>>);

/// Where the reconciler's events go.
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/db/events";

/// An event as the mock API server received it.
#[derive(Debug, Clone)]
struct Published {
    /// POST (a new event) or PATCH (the same one again: its series).
    method: String,
    type_: String,
    reason: String,
    note: String,
    /// The related object's name.
    related: Option<String>,
}

/// The mock API server: every request is checked against the RBAC rules (`calls`); events are
/// answered at once and recorded, every other request waits for the test's [`expect`].
struct Server {
    requests: tokio::sync::mpsc::Receiver<Exchange>,
    events: Arc<Mutex<Vec<Published>>>,
    /// Events are refused (403) while set.
    refuse_events: Arc<std::sync::atomic::AtomicBool>,
}

impl Server {
    /// The reasons of the events published so far, in order (a repeat patched in, too).
    fn reasons(&self) -> Vec<String> {
        self.events.lock().expect("lock").iter().map(|e| e.reason.clone()).collect()
    }

    /// The events so far, forgotten.
    fn take_events(&self) -> Vec<Published> {
        std::mem::take(&mut *self.events.lock().expect("lock"))
    }

    /// The next request that is not an event (None once the client is gone).
    async fn next(&mut self) -> Option<Exchange> {
        self.requests.recv().await
    }
}

/// Answers events and passes the other requests on, until the client is gone.
async fn serve(
    mut h: tower_test::mock::Handle<Request<Body>, Response<Body>>,
    tx: tokio::sync::mpsc::Sender<Exchange>,
    events: Arc<Mutex<Vec<Published>>>,
    refuse: Arc<std::sync::atomic::AtomicBool>,
) {
    while let Some((req, send)) = h.next_request().await {
        crate::calls::check(&req);
        if !req.uri().path().starts_with(EVENTS) {
            if tx.send((req, send)).await.is_err() {
                return;
            }
            continue;
        }
        if refuse.load(std::sync::atomic::Ordering::Relaxed) {
            let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                                "code": 403, "message": "events are forbidden"});
            respond(send, 403, status);
            continue;
        }
        let method = req.method().to_string();
        let bytes = req.into_body().collect_bytes().await.expect("body");
        let ev: Value = serde_json::from_slice(&bytes).expect("an event");
        let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
        events.lock().expect("lock").push(Published {
            method: method.clone(),
            type_: text(&ev["type"]),
            reason: text(&ev["reason"]),
            note: text(&ev["note"]),
            related: ev["related"]["name"].as_str().map(String::from),
        });
        respond(send, if method == "POST" { 201 } else { 200 }, ev);
    }
}

/// A cluster `demo` in `db` as the reconciler finds it after its first reconcile: with an
/// external etcd, it carries the finalizer (`a_cluster_with_an_external_etcd_gets_the_finalizer_first`).
/// With TLS off, it already shows so (`Secure` False): its `PlaintextOptIn` event was published
/// (`plain_text_is_an_opt_in_the_status_shows_and_an_event_says`).
fn cluster(spec: Value) -> DpuKvCluster {
    let mut c = new_cluster(spec);
    if etcd_keys::needs_finalizer(&c) {
        c.metadata.finalizers = Some(vec![etcd_keys::FINALIZER.into()]);
    }
    if !c.spec.tls.enabled() {
        c.status = Some(
            serde_json::from_value(
                json!({"conditions": [{"type": "Secure", "status": "False", "reason": "PlaintextOptIn",
                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
            )
            .expect("a status"),
        );
    }
    c
}

/// A cluster `demo` in `db` as created: no finalizer yet.
fn new_cluster(spec: Value) -> DpuKvCluster {
    let spec: DpuKvClusterSpec = serde_json::from_value(spec).expect("spec");
    let mut c = DpuKvCluster::new("demo", spec);
    c.metadata.namespace = Some("db".into());
    c.metadata.uid = Some("6d1f3a4e-0000-4000-8000-000000000001".into());
    c.metadata.generation = Some(2);
    c
}

fn spec(nodes: i32, mode: &str) -> Value {
    json!({"nodes": nodes, "replicationFactor": 1, "storage": {"size": "10Gi"},
           "etcd": {"endpoints": ["http://etcd:2379"]}, "device": {"mode": mode}, "tls": {"mode": "Disabled"}})
}

fn respond(send: tower_test::mock::SendResponse<Response<Body>>, code: u16, body: Value) {
    let r =
        Response::builder().status(code).body(Body::from(serde_json::to_vec(&body).expect("json"))).expect("response");
    send.send_response(r);
}

/// A mock API server behind a context whose clusters' admin API is at `admin` (None: the
/// in-cluster address, which these tests never reach).
fn mock(admin: Option<String>) -> (Arc<Context>, Server) {
    mock_with(|client| match admin {
        Some(a) => Context::with_admin(client, Box::new(move |_| a.clone())),
        None => Context::new(client),
    })
}

/// A mock API server behind the context `make` builds over its client.
fn mock_with(make: impl FnOnce(Client) -> Arc<Context>) -> (Arc<Context>, Server) {
    let (svc, h) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = make(Client::new(svc, "db"));
    let (tx, requests) = tokio::sync::mpsc::channel(16);
    let events = Arc::new(Mutex::new(Vec::new()));
    let refuse_events = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tokio::spawn(serve(h, tx, events.clone(), refuse_events.clone()));
    (ctx, Server { requests, events, refuse_events })
}

/// The next request: it must be `method` on `path` (query aside), a PATCH a server-side apply
/// under the operator's field manager, forced; answers with what `answer` makes of the
/// request's body; returns that body.
async fn expect(handle: &mut Server, method: &str, path: &str, answer: impl FnOnce(&Value) -> (u16, Value)) -> Value {
    exchange(handle, method, path, "application/apply-patch+yaml", answer).await
}

/// The next request: a PATCH of `path` of `content_type` (a JSON or merge patch, not an apply).
async fn expect_patch(
    handle: &mut Server,
    path: &str,
    content_type: &str,
    answer: impl FnOnce(&Value) -> (u16, Value),
) -> Value {
    exchange(handle, "PATCH", path, content_type, answer).await
}

async fn exchange(
    handle: &mut Server,
    method: &str,
    path: &str,
    content_type: &str,
    answer: impl FnOnce(&Value) -> (u16, Value),
) -> Value {
    let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next())
        .await
        .unwrap_or_else(|_| panic!("no request came; expected {method} {path}"))
        .expect("the client is gone");
    let uri = req.uri().clone();
    // `path*`: any path that starts with `path`.
    let seen = match path.strip_suffix('*') {
        Some(prefix) if uri.path().starts_with(prefix) => path,
        _ => uri.path(),
    };
    assert_eq!((req.method().as_str(), seen), (method, path), "unexpected request {uri}");
    if method == "PATCH" {
        assert_eq!(req.headers().get("content-type").and_then(|v| v.to_str().ok()), Some(content_type), "{uri}");
        if content_type == "application/apply-patch+yaml" {
            let q = uri.query().unwrap_or_default();
            assert!(
                q.contains(&format!("fieldManager={MANAGER}")) && q.contains("force=true"),
                "server-side apply, forced: {q}"
            );
        }
    }
    let bytes = req.into_body().collect_bytes().await.expect("body");
    let body: Value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("json body") };
    let (code, out) = answer(&body);
    respond(send, code, out);
    body
}

/// The reconcile's result (a scripted exchange that went wrong fails here instead of hanging).
async fn finished<T>(task: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), task).await.expect("the reconcile ends").expect("task")
}

fn not_found() -> (u16, Value) {
    (
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
    )
}

/// The applied object back, with a status.
fn echo(status: Value) -> impl FnOnce(&Value) -> (u16, Value) {
    move |b| {
        let mut o = b.clone();
        o["status"] = status;
        (200, o)
    }
}

const SETS: &str = "/apis/apps/v1/namespaces/db/statefulsets";
const CONFIGS: &str = "/api/v1/namespaces/db/configmaps";

/// What `children` saw applied.
struct Applied {
    /// The node ConfigMap.
    config: Value,
    /// The node StatefulSet.
    set: Value,
}

/// The children's applies, in order (the node ConfigMap before the node StatefulSet that reads
/// it); the StatefulSet is answered with `ready` pods.
async fn children(h: &mut Server, ready: i64) -> Applied {
    children_with(h, ready, false).await
}

/// The NetworkPolicies, after the other children: the node's and the gateway's, and etcd's with
/// a managed etcd.
async fn policies(h: &mut Server, etcd: bool) {
    const NP: &str = "/apis/networking.k8s.io/v1/namespaces/db/networkpolicies";
    for name in ["demo-node", "demo-gateway"].into_iter().chain(etcd.then_some("demo-etcd")) {
        let p = expect(h, "PATCH", &format!("{NP}/{name}"), echo(json!({}))).await;
        assert_eq!(p["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    }
}

/// [`children`], with a managed etcd or not.
async fn children_with(h: &mut Server, ready: i64, etcd: bool) -> Applied {
    let config = expect(h, "PATCH", &format!("{CONFIGS}/demo-node-config-*"), echo(json!({}))).await;
    assert_eq!(config["data"]["DPUKV_CLUSTER"], "db.demo");
    assert_eq!(config["immutable"], true);
    let set =
        expect(h, "PATCH", &format!("{SETS}/demo-node"), echo(json!({"replicas": ready, "readyReplicas": ready})))
            .await;
    let svc = expect(h, "PATCH", "/api/v1/namespaces/db/services/demo-node", echo(json!({}))).await;
    assert_eq!(svc["spec"]["clusterIP"], "None");
    let gw = expect(h, "PATCH", "/apis/apps/v1/namespaces/db/deployments/demo-gateway", echo(json!({}))).await;
    assert_eq!(gw["kind"], "Deployment");
    expect(h, "PATCH", "/api/v1/namespaces/db/services/demo", echo(json!({}))).await;
    let pdb = expect(h, "PATCH", "/apis/policy/v1/namespaces/db/poddisruptionbudgets/demo-node", echo(json!({}))).await;
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    let pdb =
        expect(h, "PATCH", "/apis/policy/v1/namespaces/db/poddisruptionbudgets/demo-gateway", echo(json!({}))).await;
    assert_eq!(pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"], "gateway");
    if etcd {
        let pdb =
            expect(h, "PATCH", "/apis/policy/v1/namespaces/db/poddisruptionbudgets/demo-etcd", echo(json!({}))).await;
        assert_eq!(pdb["spec"]["maxUnavailable"], 1, "a quorum stays");
    }
    policies(h, etcd).await;
    Applied { config, set }
}

/// The status patch; answered, as the apiserver does, with the whole resource.
async fn status(h: &mut Server, c: &DpuKvCluster) -> Value {
    let whole = serde_json::to_value(c).expect("json");
    let s = expect(h, "PATCH", "/apis/dpukv.io/v1alpha1/namespaces/db/dpukvclusters/demo/status", move |b| {
        let mut o = whole;
        o["status"] = b["status"].clone();
        (200, o)
    })
    .await;
    assert_eq!((s["apiVersion"].as_str(), s["kind"].as_str()), (Some("dpukv.io/v1alpha1"), Some("DpuKvCluster")));
    s["status"].clone()
}

/// One reconcile of a cluster whose `ready` node pods run, with nothing to change: the live
/// StatefulSet read, the children applied, the status written (returned).
async fn steady_reconcile(h: &mut Server, c: &DpuKvCluster, ready: i64) -> Value {
    expect(h, "GET", &format!("{SETS}/demo-node"), running_set(c, ready)).await;
    children(h, ready).await;
    status(h, c).await
}

/// The status a failed reconcile patches: the last one, with `Reconciled` False carrying the
/// error; returns that condition's message.
async fn failure_status(h: &mut Server, c: &DpuKvCluster) -> String {
    let st = status(h, c).await;
    let r = condition(&st, "Reconciled");
    assert_eq!((r["status"].as_str(), r["reason"].as_str()), (Some("False"), Some("ReconcileFailed")), "{st}");
    assert_eq!(r["observedGeneration"], 2, "the generation that failed");
    r["message"].as_str().expect("message").to_string()
}

/// `c` as the next reconcile sees it: with the status the last one patched.
fn with_status(c: &DpuKvCluster, status: &Value) -> DpuKvCluster {
    let mut c = c.clone();
    c.status = Some(serde_json::from_value(status.clone()).expect("a status"));
    c
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"].as_array().expect("conditions").iter().find(|c| c["type"] == type_).expect("condition")
}

#[tokio::test]
async fn a_new_cluster_gets_its_children_applied_and_a_status() {
    let (ctx, mut h) = mock(None);
    let c = cluster(spec(3, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    let set = children(&mut h, 0).await.set;
    assert_eq!(set["spec"]["replicas"], 3);
    assert_eq!(set["metadata"]["ownerReferences"][0]["kind"], "DpuKvCluster");
    assert!(set["spec"]["template"]["spec"]["containers"][1]["resources"]["limits"].get("dpukv.io/dpu").is_none());
    let st = status(&mut h, &c).await;
    assert_eq!(st["phase"], "Creating");
    assert_eq!(st["observedGeneration"], 2);
    assert_eq!(condition(&st, "Available")["status"], "False");
    assert_eq!(st["selector"], "app.kubernetes.io/component=node,app.kubernetes.io/instance=demo");
    assert_eq!(condition(&st, "PodsScheduled")["status"], "True");
    finished(task).await.expect("reconciled");
}

/// A node pod the scheduler cannot place (no node has a DPU free) is visible: phase `Pending`,
/// `PodsScheduled` False naming the pod and the scheduler's words — not a cluster that only never
/// gets ready. (The operator's pods are watched, `run::watch_unscheduled`; what the watch keeps
/// is read from `unscheduled_of`.)
#[tokio::test]
async fn a_pod_the_scheduler_cannot_place_makes_the_cluster_pending_and_says_why() {
    let (ctx, mut h) = mock(None);
    let pod = |name: &str, instance: &str, scheduled: &str| -> Arc<k8s_openapi::api::core::v1::Pod> {
        Arc::new(
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": "db",
                "labels": {"app.kubernetes.io/instance": instance}},
                "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": scheduled,
                    "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient dpukv.io/dpu."}]}}))
            .expect("pod"),
        )
    };
    let kept = dpukv_operator::controller::unscheduled_of(&[
        pod("demo-node-2", "demo", "False"),
        pod("demo-node-1", "demo", "True"),
        pod("other-node-0", "other", "False"),
    ]);
    assert_eq!(kept.keys().collect::<Vec<_>>(), ["db/demo", "db/other"]);
    *ctx.unscheduled.write().expect("lock") = kept;
    let c = cluster(spec(3, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    children(&mut h, 2).await;
    let st = status(&mut h, &c).await;
    assert_eq!(st["phase"], "Pending", "{st}");
    let sched = condition(&st, "PodsScheduled");
    assert_eq!((sched["status"].as_str(), sched["reason"].as_str()), (Some("False"), Some("Unschedulable")));
    assert_eq!(sched["message"], "demo-node-2: 0/3 nodes are available: 3 Insufficient dpukv.io/dpu.");
    finished(task).await.expect("reconciled");
}

#[tokio::test]
pub(crate) async fn auto_mode_asks_for_a_dpu_when_the_nodes_advertise_one_per_pod() {
    let (ctx, mut h) = mock(Some(Master::default().start().await));
    let c = cluster(spec(3, "Auto"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    expect(&mut h, "GET", "/api/v1/nodes", |_| {
        (
            200,
            json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [
            {"metadata": {"name": "plain"}, "status": {"allocatable": {"cpu": "8"}}},
            {"metadata": {"name": "bf3"}, "status": {"allocatable": {"cpu": "8", "dpukv.io/dpu": "2"}}},
            {"metadata": {"name": "bf3-b"}, "status": {"allocatable": {"cpu": "8", "dpukv.io/dpu": "1"}}}]}),
        )
    })
    .await;
    let set = children(&mut h, 3).await.set;
    assert_eq!(set["spec"]["template"]["spec"]["containers"][1]["resources"]["limits"]["dpukv.io/dpu"], "1");
    let st = status(&mut h, &c).await;
    assert_eq!(st["deviceMode"], "Device", "the decision is recorded");
    assert_eq!((st["phase"].as_str(), st["readyNodes"].as_i64()), (Some("Running"), Some(3)));
    assert_eq!(condition(&st, "Available")["status"], "True");
    finished(task).await.expect("reconciled");
}

/// The node StatefulSet of `c` as the API server holds it once applied (with or without a DPU),
/// `replicas` pods ready.
fn live_set(c: &DpuKvCluster, dpu: bool, replicas: i64) -> Value {
    let mut set = serde_json::to_value(dpukv_operator::render::node_statefulset(c, dpu)).expect("json");
    set["spec"]["replicas"] = json!(replicas);
    set["status"] = json!({"replicas": replicas, "readyReplicas": replicas});
    set
}

fn dpu_limit(set: &Value) -> &Value {
    &set["spec"]["template"]["spec"]["containers"][1]["resources"]["limits"]["dpukv.io/dpu"]
}

/// `Auto` is decided once, when the cluster is created, and kept: a device plugin restarting
/// (allocatable 0 on every node for a while) or a DPU node joining never changes the pod
/// template of a running cluster — which would restart every pod, and could leave them Pending
/// for a DPU that is not there. The nodes are not even listed (the mock fails on any request the
/// test did not script). A new cluster gets a DPU only when the nodes advertise one per node pod.
#[tokio::test]
async fn auto_mode_is_decided_once_and_a_device_plugin_restart_changes_no_pod_template() {
    let (ctx, mut h) = mock(Some(Master::default().start().await));
    let decided = {
        let mut c = cluster(spec(3, "Auto"));
        c.status.get_or_insert_with(Default::default).device_mode = Some("Device".into());
        c
    };
    // Created before the status had the field (or its first status write failed): the live
    // StatefulSet says what it runs on.
    let older = {
        let mut c = decided.clone();
        c.status.get_or_insert_with(Default::default).device_mode = None;
        c
    };
    for c in [decided, older] {
        let live = live_set(&c, true, 3);
        let hash = live["metadata"]["annotations"][dpukv_operator::render::POD_TEMPLATE_ANNOTATION].clone();
        let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
        expect(&mut h, "GET", &format!("{SETS}/demo-node"), move |_| (200, live)).await;
        let set = children(&mut h, 3).await.set;
        assert_eq!(dpu_limit(&set), "1", "still on its DPU");
        assert_eq!(
            set["metadata"]["annotations"][dpukv_operator::render::POD_TEMPLATE_ANNOTATION],
            hash,
            "same template"
        );
        let st = status(&mut h, &c).await;
        assert_eq!(st["deviceMode"], "Device");
        assert_eq!(st["phase"], "Running", "no rollout");
        finished(task).await.expect("reconciled");
    }
    // A new cluster of 3 node pods where the nodes advertise 2 DPUs in all: the emulator.
    let c = cluster(spec(3, "Auto"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    expect(&mut h, "GET", "/api/v1/nodes", |_| {
        (
            200,
            json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [
            {"metadata": {"name": "bf3"}, "status": {"allocatable": {"cpu": "8", "dpukv.io/dpu": "2"}}}]}),
        )
    })
    .await;
    let set = children(&mut h, 0).await.set;
    assert!(dpu_limit(&set).is_null(), "2 DPUs for 3 pods: {set}");
    assert_eq!(status(&mut h, &c).await["deviceMode"], "Emulator");
    finished(task).await.expect("reconciled");
}

/// A claim as the API server holds it, of `size`.
fn claim(name: &str, size: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": "db"},
           "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}})
}

/// `storage.size` is rendered into the claim templates, which Kubernetes never lets change (one
/// such edit wedged every reconcile: 422): the applied StatefulSet keeps its live templates, and
/// each claim grows instead (a merge patch of its storage request); once they all have the size,
/// nothing is read again. A smaller size patches nothing and says so in the status.
#[tokio::test]
pub(crate) async fn a_larger_volume_grows_each_claim_and_the_claim_templates_stay() {
    const PVCS: &str = "/api/v1/namespaces/db/persistentvolumeclaims";
    let (ctx, mut h) = mock(Some(Master::default().start().await));
    let sized = |size: &str| {
        let mut s = spec(2, "Emulator");
        s["storage"]["size"] = json!(size);
        cluster(s)
    };
    let templates =
        |set: &Value| set["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"].clone();
    let annotation =
        |set: &Value| set["metadata"]["annotations"][dpukv_operator::claims::CLAIM_SIZE_ANNOTATION].clone();
    let mut live = live_set(&sized("10Gi"), false, 2);
    assert_eq!(templates(&live), "10Gi");
    // 10Gi -> 20Gi: claim 0 is patched, claim 1 already has it.
    let c = sized("20Gi");
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    let l = live.clone();
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), move |_| (200, l)).await;
    expect(&mut h, "GET", &format!("{PVCS}/data-demo-node-0"), |_| (200, claim("data-demo-node-0", "10Gi"))).await;
    let patch = expect_patch(&mut h, &format!("{PVCS}/data-demo-node-0"), "application/merge-patch+json", |_| {
        (200, claim("data-demo-node-0", "20Gi"))
    })
    .await;
    assert_eq!(patch, json!({"spec": {"resources": {"requests": {"storage": "20Gi"}}}}));
    expect(&mut h, "GET", &format!("{PVCS}/data-demo-node-1"), |_| (200, claim("data-demo-node-1", "20Gi"))).await;
    let set = children(&mut h, 2).await.set;
    assert_eq!(templates(&set), "10Gi", "the claim templates as they were made");
    assert_eq!(annotation(&set), "20Gi/2");
    let st = status(&mut h, &c).await;
    assert_eq!(condition(&st, "StorageResized")["status"], "True", "{st}");
    finished(task).await.expect("reconciled");
    // Done: the next reconcile reads no claim.
    live["metadata"]["annotations"][dpukv_operator::claims::CLAIM_SIZE_ANNOTATION] = json!("20Gi/2");
    let task = tokio::spawn(reconcile(Arc::new(with_status(&c, &st)), ctx.clone()));
    let l = live.clone();
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), move |_| (200, l)).await;
    let set = children(&mut h, 2).await.set;
    assert_eq!((templates(&set), annotation(&set)), (json!("10Gi"), json!("20Gi/2")));
    status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    // 20Gi -> 5Gi: refused, nothing patched, the status says why.
    let c = sized("5Gi");
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    let l = live.clone();
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), move |_| (200, l)).await;
    let set = children(&mut h, 2).await.set;
    assert_eq!((templates(&set), annotation(&set)), (json!("10Gi"), json!("20Gi/2")));
    let st = status(&mut h, &c).await;
    let cond = condition(&st, "StorageResized");
    assert_eq!((cond["status"].as_str(), cond["reason"].as_str()), (Some("False"), Some("ShrinkRefused")), "{st}");
    assert!(cond["message"].as_str().expect("message").contains("5Gi is smaller than the volumes' 20Gi"), "{cond}");
    finished(task).await.expect("reconciled");
}

/// A cluster's admin API as the operator uses it (`/cluster/drain/{node}`: POST asks, DELETE
/// stops, both answer the drain's progress — the host's answer format): nodes drain when the
/// test says so; every call is recorded.
#[derive(Clone, Default)]
struct Master {
    calls: Arc<Mutex<Vec<String>>>,
    /// Regions a node still leads and holds.
    left: Arc<Mutex<BTreeMap<u32, (u32, u32)>>>,
    draining: Arc<Mutex<BTreeMap<u32, bool>>>,
    /// What `GET /cluster/summary` answers (a healthy cluster when unset).
    summary: Arc<Mutex<Option<Value>>>,
    /// Nodes whose step-down is not done yet: regions led, movable.
    stepping: Arc<Mutex<BTreeMap<u32, (u32, u32)>>>,
    /// The backup schedule set (its `key=value` text).
    schedule: Arc<Mutex<Option<String>>>,
    /// What `POST /cluster/restore/...` answers: (status, body) — a running restore when unset.
    restore_answer: Arc<Mutex<Option<(u16, String)>>>,
}

impl Master {
    async fn start(self) -> String {
        use axum::extract::{Path, State};
        async fn drain(State(m): State<Master>, method: axum::http::Method, Path(node): Path<u32>) -> String {
            m.calls.lock().expect("lock").push(format!("{method} {node}"));
            let draining = method == axum::http::Method::POST;
            m.draining.lock().expect("lock").insert(node, draining);
            let (led, held) = m.left.lock().expect("lock").get(&node).copied().unwrap_or((0, 0));
            json!({"node": node, "draining": draining, "regions_led": led, "regions_held": held,
                   "done": draining && led == 0 && held == 0})
            .to_string()
        }
        async fn summary(State(m): State<Master>) -> String {
            let draining: Vec<u32> =
                m.draining.lock().expect("lock").iter().filter(|(_, d)| **d).map(|(n, _)| *n).collect();
            let healthy = json!({"master": 1, "nodes": 3, "regions": 1, "without_primary": 0, "under_replicated": 0,
                                 "draining": draining, "stepping_down": []});
            m.summary.lock().expect("lock").clone().unwrap_or(healthy).to_string()
        }
        async fn step_down(State(m): State<Master>, method: axum::http::Method, Path(node): Path<u32>) -> String {
            m.calls.lock().expect("lock").push(format!("{method} step-down {node}"));
            let asked = method == axum::http::Method::POST;
            let (led, movable) = m.stepping.lock().expect("lock").get(&node).copied().unwrap_or((0, 0));
            json!({"node": node, "stepping_down": asked, "regions_led": led, "movable": movable,
                   "done": asked && movable == 0})
            .to_string()
        }
        fn unhex(h: &str) -> String {
            let b: Vec<u8> =
                (0..h.len()).step_by(2).map(|i| u8::from_str_radix(&h[i..i + 2], 16).expect("hex")).collect();
            String::from_utf8(b).expect("utf-8")
        }
        async fn start_backup(State(m): State<Master>, Path(to): Path<String>) -> String {
            m.calls.lock().expect("lock").push(format!("POST backup {}", unhex(&to)));
            json!({"job": 7, "state": "running", "to": unhex(&to), "backup": null, "regions": 2, "parts": 0,
                   "uploaded_bytes": 0, "bytes": 0, "fence_held_ms": 30, "error": null})
            .to_string()
        }
        async fn backup_job(State(m): State<Master>, Path(job): Path<u64>) -> String {
            m.calls.lock().expect("lock").push(format!("GET backup {job}"));
            json!({"job": job, "state": "done", "to": "file:///b", "backup": "20261127T111523Z-00000007", "regions": 2,
                   "parts": 2, "uploaded_bytes": 10, "bytes": 30, "fence_held_ms": 30, "error": null})
            .to_string()
        }
        fn schedule_json(m: &Master) -> String {
            let to = m.schedule.lock().expect("lock").as_ref().map(|s| s.lines().next().unwrap_or("")[3..].to_string());
            json!({"schedule": to.as_ref().map(|to| json!({"to": to, "every_secs": 10.0})),
                   "last_backup": {"id": "20261127T111523Z-00000007", "to": "file:///b", "at_ms": 1_795_778_123_456u64,
                                   "bytes": 30, "uploaded_bytes": 10, "took_ms": 200}})
            .to_string()
        }
        async fn set_schedule(State(m): State<Master>, Path(spec): Path<String>) -> String {
            m.calls.lock().expect("lock").push("POST schedule".into());
            *m.schedule.lock().expect("lock") = Some(unhex(&spec));
            schedule_json(&m)
        }
        async fn schedule(State(m): State<Master>, method: axum::http::Method) -> String {
            m.calls.lock().expect("lock").push(format!("{method} schedule"));
            if method == axum::http::Method::DELETE {
                *m.schedule.lock().expect("lock") = None;
            }
            schedule_json(&m)
        }
        async fn restore(
            State(m): State<Master>,
            Path((from, id)): Path<(String, String)>,
        ) -> (axum::http::StatusCode, String) {
            m.calls.lock().expect("lock").push(format!("POST restore {} {id}", unhex(&from)));
            match m.restore_answer.lock().expect("lock").clone() {
                Some((code, body)) => (axum::http::StatusCode::from_u16(code).expect("status"), body),
                None => (
                    axum::http::StatusCode::OK,
                    json!({"state": "running", "from": unhex(&from), "backup": id, "regions": 2, "opened": 0,
                           "copied": 0, "errors": []})
                    .to_string(),
                ),
            }
        }
        async fn restore_progress(State(m): State<Master>) -> String {
            m.calls.lock().expect("lock").push("GET restore".into());
            json!({"state": "none", "from": null, "backup": null, "regions": 0, "opened": 0, "copied": 0, "errors": []})
                .to_string()
        }
        let app = axum::Router::new()
            .route("/cluster/backups/{arg}", axum::routing::post(start_backup).get(backup_job))
            .route("/cluster/backup-schedule/{spec}", axum::routing::post(set_schedule))
            .route("/cluster/backup-schedule", axum::routing::get(schedule).delete(schedule))
            .route("/cluster/restore/{from}/{id}", axum::routing::post(restore))
            .route("/cluster/restore", axum::routing::get(restore_progress))
            .route("/cluster/step-down/{node}", axum::routing::post(step_down).delete(step_down))
            .route("/cluster/drain/{node}", axum::routing::post(drain).delete(drain))
            .route("/cluster/summary", axum::routing::get(summary))
            .with_state(self);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        tokio::spawn(async move { axum::serve(l, app).await });
        addr
    }
}

/// The hash annotation the node StatefulSet of `c` is applied with (its live copy has it once
/// applied).
fn template_hash(c: &DpuKvCluster) -> String {
    let set = dpukv_operator::render::node_statefulset(c, false);
    set.metadata.annotations.expect("annotations")[dpukv_operator::render::POD_TEMPLATE_ANNOTATION].clone()
}

fn running_set(c: &DpuKvCluster, replicas: i64) -> impl FnOnce(&Value) -> (u16, Value) + use<> {
    let hash = template_hash(c);
    move |_| {
        (
            200,
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                     "metadata": {"name": "demo-node", "namespace": "db",
                                  "annotations": {dpukv_operator::render::POD_TEMPLATE_ANNOTATION: hash}},
                     "spec": {"replicas": replicas, "selector": {}, "template": {}, "serviceName": "demo-node"},
                     "status": {"replicas": replicas, "readyReplicas": replicas}}),
        )
    }
}

#[tokio::test]
async fn a_scale_in_drains_the_pods_that_go_before_the_statefulset_shrinks() {
    let master = Master::default();
    master.left.lock().expect("lock").extend([(4, (1, 2)), (5, (0, 1))]);
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr.clone()));
    let c = cluster(spec(3, "Emulator"));
    // 5 pods run, 3 are wanted: nodes 4 and 5 (ordinals 3 and 4) are asked to drain; they still
    // hold regions, so the StatefulSet keeps its 5 replicas.
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 5)).await;
    let set = children(&mut h, 5).await.set;
    assert_eq!(set["spec"]["replicas"], 5, "the pods that would go are kept until drained");
    let st = status(&mut h, &c).await;
    assert_eq!(st["phase"], "Draining");
    let d = condition(&st, "Draining");
    assert_eq!((d["status"].as_str(), d["reason"].as_str()), (Some("True"), Some("DrainInProgress")));
    assert!(d["message"].as_str().expect("message").contains("node 4: 1 regions led, 2 held"), "{d}");
    finished(task).await.expect("reconciled");
    assert_eq!(*master.calls.lock().expect("lock"), ["POST 4", "POST 5"]);
    let events = h.take_events();
    assert_eq!(events.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(), ["DrainStarted"]);
    assert!(events[0].note.contains("node 4 (demo-node-3), node 5 (demo-node-4)"), "{events:?}");
    assert_eq!(events[0].type_, "Normal");
    // Still draining: asked again, no new event.
    let c = with_status(&c, &st);
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 5)).await;
    assert_eq!(children(&mut h, 5).await.set["spec"]["replicas"], 5);
    let st = status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert!(h.take_events().is_empty(), "a drain under way is not started again");
    // The master moved everything off them: now the StatefulSet shrinks.
    master.left.lock().expect("lock").clear();
    let c = with_status(&c, &st);
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 5)).await;
    let set = children(&mut h, 3).await.set;
    assert_eq!(set["spec"]["replicas"], 3, "drained: the StatefulSet shrinks");
    let st = status(&mut h, &c).await;
    assert_eq!(condition(&st, "Draining")["status"], "False");
    finished(task).await.expect("reconciled");
    assert_eq!(h.reasons(), ["ScaledIn"]);
}

#[tokio::test]
async fn an_unreachable_master_stops_a_scale_in_before_anything_shrinks() {
    // A port nothing listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").to_string();
    let (ctx, mut h) = mock(Some(dead.clone()));
    let c = cluster(spec(3, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 5)).await;
    assert!(failure_status(&mut h, &c).await.contains("admin"), "the status says why");
    let e = finished(task).await.expect_err("no drain, no scale-in");
    assert!(matches!(e, dpukv_operator::controller::Error::Admin(_)), "{e}");
    // Nothing was applied: the client is gone without another request (but the failure's event
    // and status).
    let next = tokio::time::timeout(Duration::from_secs(5), h.next()).await.expect("the client is dropped");
    assert!(next.is_none(), "no request after the failed drain");
    assert_eq!(h.reasons(), ["ReconcileFailed"]);
}

#[tokio::test]
async fn a_scale_out_stops_draining_the_nodes_that_come_back() {
    let master = Master::default();
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr.clone()));
    let c = cluster(spec(5, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 3)).await;
    let set = children(&mut h, 3).await.set;
    assert_eq!(set["spec"]["replicas"], 5);
    status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert_eq!(
        *master.calls.lock().expect("lock"),
        ["DELETE 4", "DELETE step-down 4", "DELETE 5", "DELETE step-down 5"],
        "returning nodes are neither drained nor stepping down"
    );
    let events = h.take_events();
    assert_eq!(events.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(), ["ScaledOut"]);
    assert!(events[0].note.contains("from 3 to 5 pods"), "{events:?}");
}

/// A scale-in cancelled midway (5 → 3 → 5, nodes 4 and 5 draining when `nodes` went back to 5):
/// the StatefulSet never shrank, so there is no scale-out edge — the drains are taken back
/// anyway, from the summary's list, and a failed un-drain is tried again on the next reconcile.
#[tokio::test]
async fn a_scale_in_cancelled_midway_leaves_no_node_drained() {
    let master = Master::default();
    master.draining.lock().expect("lock").extend([(4, true), (5, true)]);
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr));
    let c = cluster(spec(5, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 5)).await;
    assert_eq!(children(&mut h, 5).await.set["spec"]["replicas"], 5);
    status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert_eq!(
        *master.calls.lock().expect("lock"),
        ["DELETE 4", "DELETE step-down 4", "DELETE 5", "DELETE step-down 5"],
        "the drains of nodes the cluster keeps are taken back"
    );
    let events = h.take_events();
    assert_eq!(events.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(), ["Undrained"]);
    assert!(events[0].note.contains("node 4 (demo-node-3), node 5 (demo-node-4)"), "{events:?}");
    // Nothing left: the next reconcile asks nothing.
    master.calls.lock().expect("lock").clear();
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    steady_reconcile(&mut h, &c, 5).await;
    finished(task).await.expect("reconciled");
    assert!(master.calls.lock().expect("lock").is_empty(), "{:?}", master.calls.lock().expect("lock"));
}

const OPS: &str = "/apis/dpukv.io/v1alpha1/namespaces/db/dpukvoperations";

/// The status an operation's reconcile applies (answered as the API server would).
async fn op_status(h: &mut Server, op: &dpukv_operator::operation::DpuKvOperation) -> Value {
    let whole = serde_json::to_value(op).expect("json");
    let path = format!("{OPS}/{}/status", op.metadata.name.as_deref().unwrap_or_default());
    exchange(h, "PATCH", &path, "application/apply-patch+yaml", move |b| {
        let mut o = whole;
        o["status"] = b["status"].clone();
        (200, o)
    })
    .await
}

/// A `DpuKvOperation` draining node pod demo-node-2 (node 3): its finalizer first; then the
/// drain asked of the master and its progress in the status (`Running`, then `Holding`); the
/// cluster's reconcile does not take the drain back while the operation holds it (with the
/// operations not yet listed, it takes none back); deleted, the node is undrained before the
/// finalizer goes. An operation naming a pod the cluster does not have is `Failed`.
#[tokio::test]
pub(crate) async fn an_operation_drains_a_node_holds_it_and_lifts_it_when_deleted() {
    use dpukv_operator::operation::{self, DpuKvOperation, DpuKvOperationSpec, OperationAction};
    let master = Master::default();
    master.left.lock().expect("lock").extend([(3, (1, 1))]);
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr));
    let c = cluster(spec(3, "Emulator"));
    // The operator reaches the cluster's control API once it reconciled it.
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    steady_reconcile(&mut h, &c, 3).await;
    finished(task).await.expect("reconciled");
    let new_op = |pod: &str| {
        let mut o = DpuKvOperation::new(
            "drain-2",
            DpuKvOperationSpec { cluster: "demo".into(), action: OperationAction::Drain, pod: pod.into() },
        );
        o.metadata.namespace = Some("db".into());
        o
    };
    let op = new_op("demo-node-2");
    let task = tokio::spawn(operation::reconcile(Arc::new(op.clone()), ctx.clone()));
    let mut with = serde_json::to_value(&op).expect("json");
    with["metadata"]["finalizers"] = json!([operation::FINALIZER]);
    let patch = expect_patch(&mut h, &format!("{OPS}/drain-2"), JSON_PATCH, move |_| (200, with)).await;
    assert_eq!(patch[1]["value"], json!([operation::FINALIZER]), "{patch}");
    finished(task).await.expect("finalizer added");
    let mut op = op;
    op.metadata.finalizers = Some(vec![operation::FINALIZER.into()]);
    let cluster_json = serde_json::to_value(&c).expect("json");
    // Under way: regions still on node 3.
    let task = tokio::spawn(operation::reconcile(Arc::new(op.clone()), ctx.clone()));
    let cj = cluster_json.clone();
    expect(&mut h, "GET", CLUSTER, move |_| (200, cj)).await;
    let st = op_status(&mut h, &op).await["status"].clone();
    assert_eq!(
        (st["phase"].as_str(), st["node"].as_i64(), st["regionsLed"].as_i64()),
        (Some("Running"), Some(3), Some(1)),
        "{st}"
    );
    finished(task).await.expect("reconciled");
    // Done: Holding.
    master.left.lock().expect("lock").clear();
    let task = tokio::spawn(operation::reconcile(Arc::new(op.clone()), ctx.clone()));
    let cj = cluster_json.clone();
    expect(&mut h, "GET", CLUSTER, move |_| (200, cj)).await;
    let st = op_status(&mut h, &op).await["status"].clone();
    assert_eq!(st["phase"], "Holding", "{st}");
    assert_eq!(
        finished(task).await.expect("reconciled"),
        kube::runtime::controller::Action::requeue(Duration::from_secs(60))
    );
    assert_eq!(*master.calls.lock().expect("lock"), ["POST 3", "POST 3"]);
    // The cluster's reconcile keeps it: node 3 is held; with the operations not listed yet,
    // nothing is taken back either.
    for held in [Some(BTreeMap::from([("db/demo".to_string(), [(OperationAction::Drain, 3)].into())])), None] {
        *ctx.held.write().expect("lock") = held;
        master.calls.lock().expect("lock").clear();
        let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
        steady_reconcile(&mut h, &c, 3).await;
        finished(task).await.expect("reconciled");
        assert!(master.calls.lock().expect("lock").is_empty(), "{:?}", master.calls.lock().expect("lock"));
    }
    // Deleted: undrained, then the finalizer goes.
    op.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time("2026-01-01T00:00:00Z".parse().expect("time")));
    let task = tokio::spawn(operation::reconcile(Arc::new(op.clone()), ctx.clone()));
    let cj = cluster_json.clone();
    expect(&mut h, "GET", CLUSTER, move |_| (200, cj)).await;
    let mut gone = serde_json::to_value(&op).expect("json");
    gone["metadata"]["finalizers"] = json!([]);
    let patch = expect_patch(&mut h, &format!("{OPS}/drain-2"), JSON_PATCH, move |_| (200, gone)).await;
    assert_eq!(patch[1], json!({"op": "remove", "path": "/metadata/finalizers/0"}), "{patch}");
    finished(task).await.expect("lifted");
    assert_eq!(*master.calls.lock().expect("lock"), ["DELETE 3"]);
    // A pod the cluster does not have: Failed, nothing asked.
    let mut bad = new_op("demo-node-7");
    bad.metadata.finalizers = Some(vec![operation::FINALIZER.into()]);
    master.calls.lock().expect("lock").clear();
    let task = tokio::spawn(operation::reconcile(Arc::new(bad.clone()), ctx.clone()));
    let cj = cluster_json.clone();
    expect(&mut h, "GET", CLUSTER, move |_| (200, cj)).await;
    let st = op_status(&mut h, &bad).await["status"].clone();
    assert_eq!(st["phase"], "Failed", "{st}");
    assert!(st["message"].as_str().is_some_and(|m| m.contains("not one of the 3 node pods")), "{st}");
    finished(task).await.expect("reconciled");
    assert!(master.calls.lock().expect("lock").is_empty());
}

/// `dpukv.io/paused: "true"`: the reconcile reads nothing, applies nothing and asks the master
/// nothing — only the status says it is paused; removed, the next reconcile is a normal one.
#[tokio::test]
async fn a_paused_cluster_is_left_alone_and_says_so() {
    let master = Master::default();
    master.draining.lock().expect("lock").extend([(3, true)]);
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr));
    let mut c = cluster(spec(2, "Emulator"));
    c.metadata.annotations = Some(BTreeMap::from([("dpukv.io/paused".to_string(), "true".to_string())]));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    let st = status(&mut h, &c).await;
    let p = condition(&st, "Paused");
    assert_eq!((p["status"].as_str(), p["reason"].as_str()), (Some("True"), Some("PausedByAnnotation")), "{st}");
    assert_eq!(finished(task).await.expect("reconciled"), kube::runtime::controller::Action::await_change());
    assert!(master.calls.lock().expect("lock").is_empty(), "nothing asked of the master");
    // Unpaused: a normal reconcile, `Paused` False.
    c.metadata.annotations = None;
    let task = tokio::spawn(reconcile(Arc::new(with_status(&c, &st)), ctx));
    let st = steady_reconcile(&mut h, &c, 3).await;
    assert_eq!(condition(&st, "Paused")["status"], "False");
    finished(task).await.expect("reconciled");
}

/// What is under way (here a drain that cannot move a region) unchanged for 15 minutes:
/// `Stalled` True, its message saying what waits, and one warning event; progress clears it.
#[tokio::test]
async fn a_drain_that_makes_no_progress_is_reported_stalled() {
    let master = Master::default();
    master.left.lock().expect("lock").extend([(4, (1, 2))]);
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr));
    let c = cluster(spec(3, "Emulator"));
    let round = |c: DpuKvCluster, ctx: Arc<Context>| reconcile(Arc::new(c), ctx);
    let task = tokio::spawn(round(c.clone(), ctx.clone()));
    let st = steady_reconcile(&mut h, &c, 4).await;
    finished(task).await.expect("reconciled");
    assert!(st["lastProgressTime"].is_string(), "a drain under way: {st}");
    assert_eq!(condition(&st, "Stalled")["status"], "False");
    h.take_events();
    // Twenty minutes on, the same.
    let mut earlier = st.clone();
    let twenty =
        k8s_openapi::jiff::Timestamp::now().checked_sub(k8s_openapi::jiff::SignedDuration::from_mins(20)).expect("t");
    earlier["lastProgressTime"] = json!(twenty.to_string());
    let c2 = with_status(&c, &earlier);
    let task = tokio::spawn(round(c2.clone(), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c2, 4)).await;
    children(&mut h, 4).await;
    let st = status(&mut h, &c2).await;
    finished(task).await.expect("reconciled");
    let stalled = condition(&st, "Stalled");
    assert_eq!((stalled["status"].as_str(), stalled["reason"].as_str()), (Some("True"), Some("NoProgress")), "{st}");
    let m = stalled["message"].as_str().expect("message");
    assert!(m.starts_with("no progress for 20 min") && m.contains("node 4: 1 regions led, 2 held"), "{m}");
    let events = h.take_events();
    assert_eq!(
        events.iter().map(|e| (e.type_.as_str(), e.reason.as_str())).collect::<Vec<_>>(),
        [("Warning", "Stalled")]
    );
    // The drain moves on: no longer stalled, progress dated now.
    master.left.lock().expect("lock").insert(4, (0, 1));
    let c3 = with_status(&c, &st);
    let task = tokio::spawn(round(c3.clone(), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c3, 4)).await;
    children(&mut h, 4).await;
    let st = status(&mut h, &c3).await;
    finished(task).await.expect("reconciled");
    assert_eq!(condition(&st, "Stalled")["status"], "False", "{st}");
    assert_ne!(st["lastProgressTime"], json!(twenty.to_string()));
}

/// An event the API server refuses fails no reconcile (it is logged, and that is all).
#[tokio::test]
async fn a_refused_event_fails_no_reconcile() {
    let master = Master::default();
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr));
    h.refuse_events.store(true, std::sync::atomic::Ordering::Relaxed);
    let c = cluster(spec(5, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    steady_reconcile(&mut h, &c, 3).await;
    finished(task).await.expect("reconciled although its ScaledOut event was refused");
}

/// Failures back off per cluster and a success resets the count; each failure is a
/// `ReconcileFailed` warning on the cluster (the same one again is its series, patched).
#[tokio::test]
pub(crate) async fn failures_back_off_per_cluster_and_a_success_resets() {
    assert_eq!(
        (backoff(1), backoff(2), backoff(3)),
        (Duration::from_secs(1), Duration::from_secs(2), Duration::from_secs(4))
    );
    assert_eq!(backoff(100), Duration::from_secs(256));
    let (ctx, mut h) = mock(None);
    let c = Arc::new(cluster(spec(3, "Emulator")));
    // The API server fails, twice: an error, then a growing wait.
    let mut e = None;
    for _ in 0..2 {
        let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
        expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| {
            (500, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "InternalError", "code": 500, "message": "etcd is down"}))
        })
        .await;
        // The failure is in the status too (a status written only on success hid it).
        assert!(failure_status(&mut h, &c).await.contains("etcd is down"));
        e = Some(finished(task).await.expect_err("an API failure is an error"));
    }
    let e = e.expect("an error");
    let events = h.take_events();
    let seen: Vec<(&str, &str, &str)> =
        events.iter().map(|e| (e.method.as_str(), e.type_.as_str(), e.reason.as_str())).collect();
    assert_eq!(
        seen,
        [("POST", "Warning", "ReconcileFailed"), ("PATCH", "Warning", "ReconcileFailed")],
        "one event, counted twice"
    );
    assert!(events[0].note.contains("etcd is down"), "{events:?}");
    let first = error_policy(c.clone(), &e, ctx.clone());
    let second = error_policy(c.clone(), &e, ctx.clone());
    assert_eq!(first, kube::runtime::controller::Action::requeue(Duration::from_secs(1)));
    assert_eq!(second, kube::runtime::controller::Action::requeue(Duration::from_secs(2)));
    // A success resets the count.
    let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    children(&mut h, 0).await;
    status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert_eq!(error_policy(c, &e, ctx), kube::runtime::controller::Action::requeue(Duration::from_secs(1)));
    assert!(h.take_events().is_empty(), "a success is no event");
}

/// Once node pods are ready, the status shows what the cluster itself says (its admin API's
/// summary): the regions, the pod running the master, and `Degraded` — regions without a live
/// primary (or short of copies), none, or `Unknown` when the summary cannot be read.
#[tokio::test]
async fn the_status_shows_the_regions_the_master_and_whether_the_cluster_is_degraded() {
    let master = Master::default();
    let addr = master.clone().start().await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").to_string();
    let c = cluster(spec(3, "Emulator"));
    let cases = [
        (
            Some(json!({"master": 2, "nodes": 3, "regions": 4, "without_primary": 1, "under_replicated": 2})),
            "True",
            "RegionsWithoutPrimary",
        ),
        (
            Some(json!({"master": 2, "nodes": 3, "regions": 4, "without_primary": 0, "under_replicated": 2})),
            "True",
            "RegionsUnderReplicated",
        ),
        (
            Some(json!({"master": 3, "nodes": 3, "regions": 6, "without_primary": 0, "under_replicated": 0})),
            "False",
            "AllRegionsReplicated",
        ),
        (None, "Unknown", "SummaryUnavailable"),
    ];
    for (summary, degraded, reason) in cases {
        let reachable = summary.is_some();
        *master.summary.lock().expect("lock") = summary.clone();
        let to = if reachable { addr.clone() } else { dead.clone() };
        let (ctx, mut h) = mock(Some(to));
        let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
        let st = steady_reconcile(&mut h, &c, 3).await;
        finished(task).await.expect("reconciled");
        let d = condition(&st, "Degraded");
        assert_eq!((d["status"].as_str(), d["reason"].as_str()), (Some(degraded), Some(reason)), "{st}");
        match summary {
            Some(s) => {
                assert_eq!(st["regions"], s["regions"]);
                let pod = format!("demo-node-{}", s["master"].as_i64().expect("master") - 1);
                assert_eq!(st["master"].as_str(), Some(pod.as_str()), "the pod running the master");
            }
            None => assert!(st.get("master").is_none() && st["regions"] == 0, "nothing made up: {st}"),
        }
    }
}

/// `ZonesSpread` from the summary's zone figures: no zones, copies apart, regions short of a copy
/// because every node that could take one is in a zone they have (placement cannot: add nodes
/// in other zones), regions with two copies in one zone.
#[tokio::test]
async fn the_status_says_whether_zones_keep_copies_apart_and_why_not() {
    let master = Master::default();
    let addr = master.clone().start().await;
    let c = cluster(spec(3, "Emulator"));
    let summary = |zones: u32, shared: u32, blocked: u32| {
        json!({"master": 1, "nodes": 3, "regions": 4, "without_primary": 0, "under_replicated": blocked,
               "zones": zones, "zone_shared": shared, "zone_blocked": blocked})
    };
    let cases = [
        (summary(0, 0, 0), "True", "NoZones", ""),
        (summary(3, 0, 0), "True", "DistinctZones", "(3 zones)"),
        (summary(2, 0, 2), "False", "FewerZonesThanCopies", "2 of 4 regions are short of a copy"),
        (summary(3, 1, 0), "False", "SharedZones", "1 of 4 regions have two copies in one zone"),
    ];
    for (s, status_, reason, says) in cases {
        *master.summary.lock().expect("lock") = Some(s);
        let (ctx, mut h) = mock(Some(addr.clone()));
        let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
        let st = steady_reconcile(&mut h, &c, 3).await;
        finished(task).await.expect("reconciled");
        let z = condition(&st, "ZonesSpread");
        assert_eq!((z["status"].as_str(), z["reason"].as_str()), (Some(status_), Some(reason)), "{st}");
        assert!(z["message"].as_str().is_some_and(|m| m.contains(says)), "{z}");
    }
}

/// `Degraded` turning True is a warning, turning False again a `Recovered` event — once each,
/// on the transition (the next reconciles compare with the status they find).
#[tokio::test]
async fn degraded_and_recovered_are_published_once_on_their_transitions() {
    let master = Master::default();
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr));
    let summary = |without: u32, under: u32| json!({"master": 1, "nodes": 3, "regions": 4, "without_primary": without, "under_replicated": under});
    // (the summary, the events this reconcile publishes)
    let steps: [(Value, &[(&str, &str)]); 5] = [
        (summary(0, 0), &[]),
        (summary(1, 1), &[("Warning", "Degraded")]),
        (summary(0, 2), &[]),
        (summary(0, 0), &[("Normal", "Recovered")]),
        (summary(0, 0), &[]),
    ];
    let mut c = cluster(spec(3, "Emulator"));
    for (i, (s, want)) in steps.into_iter().enumerate() {
        *master.summary.lock().expect("lock") = Some(s);
        let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
        let st = steady_reconcile(&mut h, &c, 3).await;
        finished(task).await.expect("reconciled");
        let events = h.take_events();
        let got: Vec<(&str, &str)> = events.iter().map(|e| (e.type_.as_str(), e.reason.as_str())).collect();
        assert_eq!(got, want, "step {i}");
        if let Some(e) = events.first() {
            assert_eq!(e.note, condition(&st, "Degraded")["message"].as_str().expect("message"), "step {i}");
        }
        c = with_status(&c, &st);
    }
}

/// With `etcd.managed`, the etcd Service and StatefulSet are applied first (the node pods need
/// them), owned by the cluster like every child.
#[tokio::test]
async fn a_managed_etcd_is_applied_before_the_nodes() {
    let (ctx, mut h) = mock(None);
    let c = cluster(json!({"nodes": 3, "replicationFactor": 1, "storage": {"size": "10Gi"},
                           "etcd": {"managed": {"replicas": 3}}, "device": {"mode": "Emulator"},
                           "tls": {"mode": "Disabled"}}));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    let etcd_svc = expect(&mut h, "PATCH", "/api/v1/namespaces/db/services/demo-etcd", echo(json!({}))).await;
    assert_eq!(etcd_svc["spec"]["clusterIP"], "None");
    expect(&mut h, "GET", &format!("{SETS}/demo-etcd"), |_| not_found()).await;
    let etcd = expect(&mut h, "PATCH", &format!("{SETS}/demo-etcd"), echo(json!({"replicas": 0}))).await;
    assert_eq!(
        (etcd["spec"]["replicas"].as_i64(), etcd["metadata"]["ownerReferences"][0]["kind"].as_str()),
        (Some(3), Some("DpuKvCluster"))
    );
    let applied = children_with(&mut h, 0, true).await;
    assert_eq!(applied.config["data"]["DPUKV_ETCD"], "http://demo-etcd.db.svc:2379", "the nodes use it");
    status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
}

/// The node StatefulSet as the apiserver would show it mid-upgrade: `replicas` pods, the
/// partition, how many run the new revision and how many are ready.
fn rolling_set(
    hash: String,
    replicas: i64,
    partition: i64,
    updated: i64,
    ready: i64,
    settled: bool,
) -> impl FnOnce(&Value) -> (u16, Value) {
    move |_| {
        (
            200,
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                   "metadata": {"name": "demo-node", "namespace": "db",
                                "annotations": {dpukv_operator::render::POD_TEMPLATE_ANNOTATION: hash}},
                   "spec": {"replicas": replicas, "selector": {}, "template": {}, "serviceName": "demo-node",
                            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}},
                   "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                              "currentRevision": "demo-node-1", "updateRevision": if settled { "demo-node-1" } else { "demo-node-2" }}}),
        )
    }
}

/// The node pods listed during a rollout: revision (`1` or `2`) and ready, by ordinal.
async fn node_pods(h: &mut Server, pods: &[(&str, bool)]) {
    let items: Vec<Value> = pods
        .iter()
        .enumerate()
        .map(|(o, (rev, ready))| {
            json!({"metadata": {"name": format!("demo-node-{o}"), "namespace": "db",
                                "labels": {"controller-revision-hash": format!("demo-node-{rev}")}},
                   "status": {"conditions": [{"type": "Ready", "status": if *ready { "True" } else { "False" }}]}})
        })
        .collect();
    let q = expect(h, "GET", "/api/v1/namespaces/db/pods", move |_| {
        (200, json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}))
    })
    .await;
    assert!(q.is_null(), "a list has no body");
}

/// Upgrades restart one pod at a time, highest ordinal first, each only once its primaries moved
/// to backups elsewhere and the cluster is whole; the pod restarted last may lead again once it
/// is ready; a pod that does not get ready on the new version stops the rollout; a settled
/// StatefulSet holds every pod (a changed template restarts none by itself).
#[tokio::test]
pub(crate) async fn an_upgrade_moves_each_pod_s_primaries_away_before_restarting_it_highest_first() {
    let master = Master::default();
    let addr = master.clone().start().await;
    let c = cluster(spec(3, "Emulator"));
    // (live set: partition, updated, ready, settled; node whose step-down is not done; summary)
    // -> (the partition applied, the admin calls, the phase, the events published). Each case's
    // reconcile finds the status the one before it patched, as in a rollout.
    struct Case {
        /// The live StatefulSet's template hash (None: the one `c` renders).
        hash: Option<&'static str>,
        live: (i64, i64, i64, bool),
        /// The node pods the reconcile lists (a rollout under way): revision (`1` or `2`) and
        /// ready, by ordinal.
        pods: Option<&'static [(&'static str, bool)]>,
        not_done: Option<u32>,
        summary: Option<Value>,
        partition: i64,
        calls: &'static [&'static str],
        phase: &'static str,
        events: &'static [&'static str],
    }
    let healthy = json!({"master": 1, "nodes": 3, "regions": 4, "without_primary": 0, "under_replicated": 0});
    let cases = [
        // Settled: every pod held.
        Case {
            hash: None,
            live: (3, 3, 3, true),
            pods: None,
            not_done: None,
            summary: None,
            partition: 3,
            calls: &[],
            phase: "Running",
            events: &[],
        },
        // The template changed: node 3's primaries move first; not done yet, nothing restarts.
        Case {
            hash: None,
            live: (3, 0, 3, false),
            pods: Some(&[("1", true), ("1", true), ("1", true)]),
            not_done: Some(3),
            summary: None,
            partition: 3,
            calls: &["POST step-down 3"],
            phase: "Upgrading",
            events: &[],
        },
        // Done: pod 2 (node 3) restarts.
        Case {
            hash: None,
            live: (3, 0, 3, false),
            pods: Some(&[("1", true), ("1", true), ("1", true)]),
            not_done: None,
            summary: None,
            partition: 2,
            calls: &["POST step-down 3"],
            phase: "Upgrading",
            events: &["RestartingPod demo-node-2"],
        },
        // Pod 2 not ready on the new revision yet: wait (a failing version stops here).
        Case {
            hash: None,
            live: (2, 1, 2, false),
            pods: Some(&[("1", true), ("1", true), ("2", false)]),
            not_done: None,
            summary: None,
            partition: 2,
            calls: &[],
            phase: "Upgrading",
            events: &[],
        },
        // Ready, but a region is short of copies (node 3 still catching up): it may lead again, the next waits.
        Case {
            hash: None,
            live: (2, 1, 3, false),
            pods: Some(&[("1", true), ("1", true), ("2", true)]),
            not_done: None,
            summary: Some(json!({"master": 1, "nodes": 3, "regions": 4, "without_primary": 0, "under_replicated": 1})),
            partition: 2,
            calls: &["DELETE step-down 3"],
            phase: "Upgrading",
            events: &["Degraded"],
        },
        // Whole again: node 2 steps down, pod 1 restarts.
        Case {
            hash: None,
            live: (2, 1, 3, false),
            pods: Some(&[("1", true), ("1", true), ("2", true)]),
            not_done: None,
            summary: Some(healthy.clone()),
            partition: 1,
            calls: &["DELETE step-down 3", "POST step-down 2"],
            phase: "Upgrading",
            events: &["RestartingPod demo-node-1", "Recovered"],
        },
        // Every pod restarted and ready (Kubernetes then shows one revision): every node may lead
        // again, every pod is held.
        Case {
            hash: None,
            live: (0, 3, 3, true),
            pods: None,
            not_done: None,
            summary: None,
            partition: 3,
            calls: &["DELETE step-down 1", "DELETE step-down 2", "DELETE step-down 3"],
            phase: "Running",
            events: &["RolloutFinished"],
        },
        // The template changed again mid-rollout (a revert, a newer version): every pod held until
        // the next reconcile starts again from the top; nothing steps down now.
        Case {
            hash: Some("0000000000000000"),
            live: (1, 2, 3, false),
            pods: None,
            not_done: None,
            summary: None,
            partition: 3,
            calls: &[],
            phase: "Upgrading",
            events: &[],
        },
        // The new version never got ready on pod 2 (case 3 forever) and `version` is reverted
        // (the template above): Kubernetes makes the old revision the update revision again;
        // pod 2, broken on the revision it runs, is restarted at once — its step-down asked, not
        // awaited, no wait for the cluster to be whole (it is what makes it not whole).
        Case {
            hash: None,
            live: (3, 2, 2, true),
            pods: Some(&[("1", true), ("1", true), ("2", false)]),
            not_done: Some(3),
            summary: Some(json!({"master": 1, "nodes": 3, "regions": 4, "without_primary": 0, "under_replicated": 4})),
            partition: 2,
            calls: &["POST step-down 3"],
            phase: "Upgrading",
            events: &["RestartingPod demo-node-2", "Degraded"],
        },
        // Pod 2 back on the old revision and ready: the rollout is over, every node may lead.
        Case {
            hash: None,
            live: (2, 3, 3, true),
            pods: None,
            not_done: None,
            summary: None,
            partition: 3,
            calls: &["DELETE step-down 1", "DELETE step-down 2", "DELETE step-down 3"],
            phase: "Running",
            events: &["Recovered", "RolloutFinished"],
        },
    ];
    let mut c = c;
    for (i, case) in cases.into_iter().enumerate() {
        master.calls.lock().expect("lock").clear();
        *master.stepping.lock().expect("lock") = case.not_done.map(|n| (n, (2, 2))).into_iter().collect();
        *master.summary.lock().expect("lock") = case.summary.clone();
        let (ctx, mut h) = mock(Some(addr.clone()));
        let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
        let (p, u, r, settled) = case.live;
        expect(
            &mut h,
            "GET",
            &format!("{SETS}/demo-node"),
            rolling_set(case.hash.map_or_else(|| template_hash(&c), String::from), 3, p, u, r, settled),
        )
        .await;
        if let Some(pods) = case.pods {
            node_pods(&mut h, pods).await;
        }
        let set = children(&mut h, r).await.set;
        let st = status(&mut h, &c).await;
        finished(task).await.expect("reconciled");
        assert_eq!(
            set["spec"]["updateStrategy"]["rollingUpdate"]["partition"].as_i64(),
            Some(case.partition),
            "case {i}: the partition applied"
        );
        let calls: Vec<String> =
            master.calls.lock().expect("lock").iter().filter(|c| c.contains("step-down")).cloned().collect();
        assert_eq!(calls, case.calls, "case {i}: the step-down calls");
        assert_eq!(st["phase"].as_str(), Some(case.phase), "case {i}: {st}");
        let events: Vec<String> = h
            .take_events()
            .into_iter()
            .map(|e| format!("{} {}", e.reason, e.related.unwrap_or_default()).trim_end().to_string())
            .collect();
        assert_eq!(events, case.events, "case {i}: the events");
        if case.phase == "Upgrading" {
            assert!(st.get("version").is_none(), "case {i}: no version while pods differ");
            assert!(
                condition(&st, "Progressing")["message"].as_str().expect("message").starts_with("upgrading"),
                "{st}"
            );
        }
        c = with_status(&c, &st);
    }
}

/// The node StatefulSet as the apiserver shows it: its template (of hash `hash`) has the host
/// read the ConfigMap `config`, and it remembers the ConfigMaps `previous`; `rolling`: a rollout
/// under way (pod 2 restarted on the new revision, not ready yet), else every pod on one
/// revision; `lagging`: its status not yet of its last spec (`observedGeneration` behind).
fn config_set(
    hash: String,
    config: &str,
    previous: &str,
    rolling: bool,
    lagging: bool,
) -> impl FnOnce(&Value) -> (u16, Value) + use<> {
    let (config, previous) = (config.to_string(), previous.to_string());
    move |_| {
        (
            200,
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                   "metadata": {"name": "demo-node", "namespace": "db", "generation": 4,
                                "annotations": {dpukv_operator::render::POD_TEMPLATE_ANNOTATION: hash,
                                                PREVIOUS_CONFIGS_ANNOTATION: previous}},
                   "spec": {"replicas": 3, "selector": {}, "serviceName": "demo-node",
                            "template": {"spec": {"containers": [
                                {"name": "host", "envFrom": [{"configMapRef": {"name": config}}]}]}},
                            "updateStrategy": {"type": "RollingUpdate",
                                               "rollingUpdate": {"partition": if rolling { 2 } else { 3 }}}},
                   "status": {"replicas": 3, "readyReplicas": if rolling { 2 } else { 3 },
                              "updatedReplicas": if rolling { 1 } else { 3 },
                              "observedGeneration": if lagging { 3 } else { 4 },
                              "currentRevision": "demo-node-1",
                              "updateRevision": if rolling { "demo-node-2" } else { "demo-node-1" }}}),
        )
    }
}

/// One reconcile of `c` finding the node StatefulSet `live`: the ConfigMap applied, then the
/// ConfigMaps deleted (each answered `delete_answer`), then the StatefulSet; returns the
/// ConfigMap's and the StatefulSet's bodies.
async fn reconcile_configs(
    addr: &str,
    c: &DpuKvCluster,
    (live, rolling): (impl FnOnce(&Value) -> (u16, Value), bool),
    deleted: &[&str],
    delete_answer: fn(&str) -> (u16, Value),
) -> Applied {
    let (ctx, mut h) = mock(Some(addr.to_string()));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), live).await;
    if rolling {
        // (pod 2 restarted on the new revision, not ready yet)
        node_pods(&mut h, &[("1", true), ("1", true), ("2", false)]).await;
    }
    let name = render::node_config_name(c);
    let config = expect(&mut h, "PATCH", &format!("{CONFIGS}/{name}"), echo(json!({}))).await;
    assert_eq!(config["immutable"], true);
    for d in deleted {
        expect(&mut h, "DELETE", &format!("{CONFIGS}/{d}"), move |_| delete_answer(d)).await;
    }
    let set =
        expect(&mut h, "PATCH", &format!("{SETS}/demo-node"), echo(json!({"replicas": 3, "readyReplicas": 3}))).await;
    expect(&mut h, "PATCH", "/api/v1/namespaces/db/services/demo-node", echo(json!({}))).await;
    expect(&mut h, "PATCH", "/apis/apps/v1/namespaces/db/deployments/demo-gateway", echo(json!({}))).await;
    expect(&mut h, "PATCH", "/api/v1/namespaces/db/services/demo", echo(json!({}))).await;
    expect(&mut h, "PATCH", "/apis/policy/v1/namespaces/db/poddisruptionbudgets/demo-node", echo(json!({}))).await;
    expect(&mut h, "PATCH", "/apis/policy/v1/namespaces/db/poddisruptionbudgets/demo-gateway", echo(json!({}))).await;
    policies(&mut h, false).await;
    status(&mut h, c).await;
    finished(task).await.expect("reconciled");
    Applied { config, set }
}

fn deleted_config(name: &str) -> (u16, Value) {
    (200, json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "db"}}))
}

fn previous_of(set: &Value) -> &str {
    set["metadata"]["annotations"][PREVIOUS_CONFIGS_ANNOTATION].as_str().expect("the previous ConfigMaps")
}

fn host_config(set: &Value) -> &str {
    let host = &set["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(host["name"], "host");
    host["envFrom"][0]["configMapRef"]["name"].as_str().expect("a ConfigMap")
}

/// A changed node setting is a new ConfigMap, named by its content, and a changed pod template
/// naming it; the old ConfigMap stays while any pod may run the old template (a held pod that
/// restarts by itself mid-rollout reads it again, not the new settings) — during the rollout,
/// and while the StatefulSet's status does not yet show the new template — and is deleted once
/// every pod runs the new one.
#[tokio::test]
pub(crate) async fn a_changed_setting_gets_a_new_config_map_and_the_old_one_goes_when_the_rollout_ended() {
    let addr = Master::default().start().await;
    let old = cluster(spec(3, "Emulator"));
    let mut new = old.clone();
    new.spec.fsync = "never".into();
    let (old_name, new_name) = (render::node_config_name(&old), render::node_config_name(&new));
    assert_ne!(old_name, new_name);
    // The setting changed: a new template, which names the new ConfigMap; the old one is remembered.
    let live = config_set(template_hash(&old), &old_name, "", false, false);
    let a = reconcile_configs(&addr, &new, (live, false), &[], deleted_config).await;
    assert_eq!(a.config["metadata"]["name"], new_name.as_str());
    assert_eq!(host_config(&a.set), new_name);
    assert_eq!(a.set["spec"]["updateStrategy"]["rollingUpdate"]["partition"], 3, "every pod held");
    assert_eq!(previous_of(&a.set), old_name, "the old ConfigMap kept");
    // Its status not yet of the new template (all pods "current"): kept.
    let live = config_set(template_hash(&new), &new_name, &old_name, false, true);
    let a = reconcile_configs(&addr, &new, (live, false), &[], deleted_config).await;
    assert_eq!(previous_of(&a.set), old_name, "kept while the status lags");
    // Rolling: pods 0 and 1 still run the old template: kept.
    let live = config_set(template_hash(&new), &new_name, &old_name, true, false);
    let a = reconcile_configs(&addr, &new, (live, true), &[], deleted_config).await;
    assert_eq!(previous_of(&a.set), old_name, "kept during the rollout");
    // Every pod on the new template: the old ConfigMap goes, and is forgotten.
    let live = config_set(template_hash(&new), &new_name, &old_name, false, false);
    let a = reconcile_configs(&addr, &new, (live, false), &[old_name.as_str()], deleted_config).await;
    assert_eq!(previous_of(&a.set), "", "one node ConfigMap left");
}

/// A setting reverted mid-rollout names the first ConfigMap again: the one the rollout was
/// going to is kept until the pods are back, then deleted (already gone: a 404 is no error);
/// the ConfigMap in use never is. A settled cluster whose settings did not change deletes nothing.
#[tokio::test]
async fn a_reverted_setting_never_deletes_the_config_map_in_use() {
    let addr = Master::default().start().await;
    let a_cluster = cluster(spec(3, "Emulator"));
    let mut b_cluster = a_cluster.clone();
    b_cluster.spec.fsync = "never".into();
    let (a, b) = (render::node_config_name(&a_cluster), render::node_config_name(&b_cluster));
    // B rolling out (pods on A remembered), then A again: B is remembered, A is not.
    let live = config_set(template_hash(&b_cluster), &b, &a, true, false);
    let out = reconcile_configs(&addr, &a_cluster, (live, false), &[], deleted_config).await;
    assert_eq!(host_config(&out.set), a);
    assert_eq!(previous_of(&out.set), b, "the ConfigMap in use is not a previous one");
    // Settled on A: B goes (already gone), A stays.
    let live = config_set(template_hash(&a_cluster), &a, &b, false, false);
    let out = reconcile_configs(&addr, &a_cluster, (live, false), &[b.as_str()], |_| not_found()).await;
    assert_eq!(previous_of(&out.set), "");
    // Settled, nothing changed, even if A were remembered (an older annotation): no deletion.
    for remembered in ["", a.as_str()] {
        let live = config_set(template_hash(&a_cluster), &a, remembered, false, false);
        let out = reconcile_configs(&addr, &a_cluster, (live, false), &[], deleted_config).await;
        assert_eq!(previous_of(&out.set), "");
    }
}

/// A condition's `lastTransitionTime` moves only when its status changes.
#[tokio::test]
async fn conditions_keep_their_transition_time_while_their_status_holds() {
    let master = Master::default();
    let addr = master.clone().start().await;
    let mut c = cluster(spec(3, "Emulator"));
    let long_ago = "2020-01-01T00:00:00Z";
    let old: serde_json::Value = json!({"conditions": [
        {"type": "Available", "status": "True", "reason": "NodesReady", "message": "", "lastTransitionTime": long_ago},
        {"type": "Draining", "status": "True", "reason": "DrainInProgress", "message": "", "lastTransitionTime": long_ago}]});
    c.status = Some(serde_json::from_value(old).expect("status"));
    let (ctx, mut h) = mock(Some(addr.clone()));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    let st = steady_reconcile(&mut h, &c, 3).await;
    finished(task).await.expect("reconciled");
    assert_eq!(condition(&st, "Available")["lastTransitionTime"], long_ago, "still True: unchanged");
    assert_ne!(condition(&st, "Draining")["lastTransitionTime"], long_ago, "True -> False: now");
}

// --- The finalizer: the cluster's keys in an external etcd (`etcd_keys`). ---

const CLUSTER: &str = "/apis/dpukv.io/v1alpha1/namespaces/db/dpukvclusters/demo";
const JSON_PATCH: &str = "application/json-patch+json";

/// A context whose "etcd" is `store`; the endpoints of every cleanup are recorded.
fn mock_etcd(store: MemStore, calls: Arc<Mutex<Vec<Vec<String>>>>) -> (Arc<Context>, Server) {
    mock_with(move |client| {
        let cleaner: etcd_keys::KeyCleaner = Box::new(move |target, prefix| {
            calls.lock().expect("lock").push(target.endpoints);
            let store = store.clone();
            Box::pin(async move { store.delete_prefix(&prefix).await })
        });
        Context::with(client, Box::new(|_| "127.0.0.1:9".to_string()), cleaner)
    })
}

/// A deleted cluster's status says so: phase `Deleting`, `Progressing` True (reason
/// `Deleting`) saying what the deletion waits for; returns that message.
async fn says_deleting(h: &mut Server, c: &DpuKvCluster) -> String {
    let st = status(h, c).await;
    assert_eq!(st["phase"], "Deleting", "{st}");
    let p = condition(&st, "Progressing");
    assert_eq!((p["status"].as_str(), p["reason"].as_str()), (Some("True"), Some("Deleting")), "{st}");
    p["message"].as_str().unwrap_or_default().to_string()
}

/// `c` deleted (as the API server shows it while finalizers hold it).
fn deleted(mut c: DpuKvCluster) -> DpuKvCluster {
    c.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time("2026-01-01T00:00:00Z".parse().expect("time")));
    c
}

/// The cluster's keys, a neighbour's whose name starts the same, and two other clusters'.
async fn etcd_with_keys() -> MemStore {
    let s = MemStore::new();
    for k in ["/dpukv/db.demo/config", "/dpukv/db.demo/regions/0000000001", "/dpukv/db.demo/last-region-id"] {
        s.put(k.as_bytes(), b"v", None).await.expect("put");
    }
    let lease = s.grant(Duration::from_secs(600)).await.expect("grant");
    s.put(b"/dpukv/db.demo/nodes/0000000001", b"n", Some(lease)).await.expect("put");
    for k in ["/dpukv/db.demo2/config", "/dpukv/prod.demo/config", "/dpukv/db.other/config"] {
        s.put(k.as_bytes(), b"v", None).await.expect("put");
    }
    s
}

async fn keys_of(s: &MemStore) -> Vec<String> {
    let (kvs, _) = s.range(b"/dpukv/").await.expect("range");
    kvs.into_iter().map(|kv| String::from_utf8(kv.key).expect("utf-8")).collect()
}

/// The finalizer's removal: a JSON patch testing it is still where it was, then removing it.
async fn finalizer_removed(h: &mut Server, c: &DpuKvCluster) {
    let mut gone = serde_json::to_value(c).expect("json");
    gone["metadata"]["finalizers"] = json!([]);
    let patch = expect_patch(h, CLUSTER, JSON_PATCH, move |_| (200, gone)).await;
    assert_eq!(
        patch,
        json!([{"op": "test", "path": "/metadata/finalizers/0", "value": "dpukv.io/etcd-keys"},
               {"op": "remove", "path": "/metadata/finalizers/0"}])
    );
}

/// A new cluster whose keys are in an external etcd gets the finalizer before anything else (a
/// JSON patch that fails if someone else changed the finalizers meanwhile); the patch makes the
/// next reconcile, which applies the children.
#[tokio::test]
pub(crate) async fn a_cluster_with_an_external_etcd_gets_the_finalizer_first() {
    let (ctx, mut h) = mock(None);
    let c = new_cluster(spec(3, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    let mut with = serde_json::to_value(&c).expect("json");
    with["metadata"]["finalizers"] = json!(["dpukv.io/etcd-keys"]);
    let patch = expect_patch(&mut h, CLUSTER, JSON_PATCH, move |_| (200, with)).await;
    assert_eq!(
        patch,
        json!([{"op": "test", "path": "/metadata/finalizers", "value": null},
               {"op": "add", "path": "/metadata/finalizers", "value": ["dpukv.io/etcd-keys"]}])
    );
    assert_eq!(finished(task).await.expect("reconciled"), kube::runtime::controller::Action::await_change());
    assert!(h.next().await.is_none(), "nothing else until the patched cluster comes back");
}

/// A cluster with a managed etcd needs no finalizer (its keys go with the etcd it owns: see
/// `a_managed_etcd_is_applied_before_the_nodes`, whose first request is the etcd Service);
/// deleted, it is left to the garbage collector — nothing is applied to a cluster that goes; its
/// status says it goes (in a foreground deletion it stays until its children are gone).
#[tokio::test]
async fn a_deleted_cluster_with_a_managed_etcd_is_left_to_the_garbage_collector() {
    let (ctx, mut h) = mock(None);
    let c = deleted(cluster(json!({"nodes": 3, "storage": {"size": "10Gi"}, "etcd": {"managed": {}}})));
    assert!(c.metadata.finalizers.is_none());
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    let why = says_deleting(&mut h, &c).await;
    assert!(why.contains("garbage collector"), "{why}");
    assert_eq!(finished(task).await.expect("reconciled"), kube::runtime::controller::Action::await_change());
    // Reconciled again with that status: nothing more to say.
    let mut again = c.clone();
    again.status = Some(
        serde_json::from_value(json!({"phase": "Deleting", "conditions": [{"type": "Progressing",
        "status": "True", "reason": "Deleting", "message": why, "observedGeneration": 2,
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}))
        .expect("status"),
    );
    let task = tokio::spawn(reconcile(Arc::new(again), ctx));
    finished(task).await.expect("reconciled");
    assert!(h.next().await.is_none(), "no request");
    assert!(h.reasons().is_empty());
}

/// A deleted cluster with an external etcd: its node pods are stopped first (they write under
/// the cluster's keys), the deletion waiting without backoff; once none runs, every key under
/// `/dpukv/db.demo/` is deleted in that etcd — those of `db.demo2`, `prod.demo` and `db.other`
/// stay — and only then is the finalizer removed.
#[tokio::test]
async fn a_deleted_cluster_s_nodes_stop_then_its_keys_are_deleted_then_its_finalizer_is_removed() {
    let store = etcd_with_keys().await;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (ctx, mut h) = mock_etcd(store.clone(), calls.clone());
    let c = Arc::new(deleted(cluster(spec(3, "Emulator"))));
    let set = |spec_replicas: i64, pods: i64| {
        move |_: &Value| {
            (
                200,
                json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                       "metadata": {"name": "demo-node", "namespace": "db", "generation": 4},
                       "spec": {"replicas": spec_replicas, "selector": {}, "template": {}, "serviceName": "demo-node"},
                       "status": {"replicas": pods, "observedGeneration": 4}}),
            )
        }
    };
    // Three pods run: scaled to none, and the cleanup waits.
    let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
    let why = says_deleting(&mut h, &c).await;
    assert!(why.contains("stopping the node pods"), "{why}");
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), set(3, 3)).await;
    let scale = expect_patch(&mut h, &format!("{SETS}/demo-node"), "application/merge-patch+json", set(0, 3)).await;
    assert_eq!(scale, json!({"spec": {"replicas": 0}}));
    let e = finished(task).await.expect_err("waiting for the pods");
    assert!(!e.is_failure(), "{e}");
    assert_eq!(
        error_policy(c.clone(), &e, ctx.clone()),
        kube::runtime::controller::Action::requeue(Duration::from_secs(5))
    );
    // One pod still terminating: still waiting, nothing deleted.
    let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
    says_deleting(&mut h, &c).await;
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), set(0, 1)).await;
    assert!(!finished(task).await.expect_err("waiting").is_failure());
    assert_eq!(keys_of(&store).await.len(), 7, "no key deleted while a node pod runs");
    assert!(calls.lock().expect("lock").is_empty());
    // None left: the keys go, then the finalizer.
    let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
    says_deleting(&mut h, &c).await;
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), set(0, 0)).await;
    finalizer_removed(&mut h, &c).await;
    assert_eq!(finished(task).await.expect("cleaned"), kube::runtime::controller::Action::await_change());
    assert_eq!(keys_of(&store).await, ["/dpukv/db.demo2/config", "/dpukv/db.other/config", "/dpukv/prod.demo/config"]);
    assert_eq!(*calls.lock().expect("lock"), [vec!["http://etcd:2379".to_string()]], "the spec's etcd");
    let events = h.take_events();
    let seen: Vec<(&str, &str)> = events.iter().map(|e| (e.type_.as_str(), e.reason.as_str())).collect();
    assert_eq!(seen, [("Normal", "StoppingNodes"), ("Normal", "EtcdKeysDeleted")], "no failure among them");
    assert!(events[1].note.contains("4 keys under /dpukv/db.demo/"), "{events:?}");
    // The first retry after a wait is a failure's first backoff: waits counted none.
    assert_eq!(
        error_policy(c, &dpukv_operator::controller::Error::NoNamespace, ctx),
        kube::runtime::controller::Action::requeue(Duration::from_secs(1))
    );
}

/// A cleanup that fails (etcd unreachable) keeps the finalizer — the deletion waits, retried
/// with backoff — and says why in a `CleanupFailed` warning.
#[tokio::test]
async fn a_failed_cleanup_keeps_the_finalizer() {
    let (ctx, mut h) = mock_with(|client| {
        let cleaner: etcd_keys::KeyCleaner =
            Box::new(|_, _| Box::pin(async { Err(dpukv_cluster::MetaError::Unavailable("etcd is gone".into())) }));
        Context::with(client, Box::new(|_| "127.0.0.1:9".to_string()), cleaner)
    });
    let c = Arc::new(deleted(cluster(spec(3, "Emulator"))));
    let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
    says_deleting(&mut h, &c).await;
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    let e = finished(task).await.expect_err("the keys are still there");
    assert!(matches!(e, dpukv_operator::controller::Error::EtcdCleanup(_)), "{e}");
    assert_eq!(error_policy(c, &e, ctx.clone()), kube::runtime::controller::Action::requeue(Duration::from_secs(1)));
    drop(ctx);
    assert!(h.next().await.is_none(), "the finalizer is not removed");
    let events = h.take_events();
    let seen: Vec<(&str, &str)> = events.iter().map(|e| (e.type_.as_str(), e.reason.as_str())).collect();
    assert_eq!(seen, [("Warning", "CleanupFailed")]);
    assert!(
        events[0].note.contains("etcd is gone") && events[0].note.contains("dpukv.io/skip-etcd-cleanup"),
        "{events:?}"
    );
}

/// `dpukv.io/skip-etcd-cleanup: "true"` lets the deletion go without touching etcd (one that is
/// gone for good): the finalizer is removed, the keys are left, a warning says so.
#[tokio::test]
async fn the_skip_annotation_removes_the_finalizer_without_cleaning() {
    let store = etcd_with_keys().await;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (ctx, mut h) = mock_etcd(store.clone(), calls.clone());
    let mut c = deleted(cluster(spec(3, "Emulator")));
    c.metadata.annotations = Some([(etcd_keys::SKIP_ANNOTATION.to_string(), "true".to_string())].into());
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    says_deleting(&mut h, &c).await;
    finalizer_removed(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert!(calls.lock().expect("lock").is_empty(), "etcd is not asked");
    assert_eq!(keys_of(&store).await.len(), 7, "every key left");
    assert_eq!(h.reasons(), ["EtcdCleanupSkipped"]);
}

const SECRETS: &str = "/api/v1/namespaces/db/secrets";

/// A Secret's key as text.
fn secret_text(s: &Value, key: &str) -> String {
    use base64::Engine;
    let b64 = s["data"][key].as_str().unwrap_or_else(|| panic!("no {key} in {}", s["metadata"]["name"]));
    String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b64).expect("base64")).expect("utf8")
}

/// `text` as a Secret's data value (base64).
fn b64(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// A GET of a Secret answered with `live` (404 when None); with `write`, the PATCH that follows
/// (a server-side apply) is expected and returned.
async fn secret(h: &mut Server, name: &str, live: Option<Value>, write: bool) -> Option<Value> {
    expect(h, "GET", &format!("{SECRETS}/{name}"), move |_| live.map_or_else(not_found, |v| (200, v))).await;
    if !write {
        return None;
    }
    let s = expect(h, "PATCH", &format!("{SECRETS}/{name}"), |b| (200, b.clone())).await;
    assert_eq!(s["metadata"]["ownerReferences"][0]["kind"], "DpuKvCluster", "{name} goes with the cluster");
    Some(s)
}

/// The control API's double behind mutual TLS: a TLS terminator with node 1's certificate that
/// admits only clients of the cluster's CA and records each client's URI SAN, in front of the
/// plain [`Master`].
async fn tls_master(master: &str, ca: &str, node: (&str, &str)) -> (String, Arc<Mutex<Vec<String>>>) {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(c.expect("ca")).expect("root");
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .expect("verifier");
    let chain = CertificateDer::pem_slice_iter(node.0.as_bytes()).collect::<Result<Vec<_>, _>>().expect("chain");
    let key = PrivateKeyDer::from_pem_slice(node.1.as_bytes()).expect("key");
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let clients = Arc::new(Mutex::new(Vec::new()));
    let (seen, master) = (clients.clone(), master.to_string());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let (acceptor, seen, master) = (acceptor.clone(), seen.clone(), master.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let der =
                    tls.get_ref().1.peer_certificates().and_then(|c| c.first().cloned()).expect("a client certificate");
                let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("x509");
                for n in cert
                    .subject_alternative_name()
                    .ok()
                    .flatten()
                    .into_iter()
                    .flat_map(|s| s.value.general_names.clone())
                {
                    if let x509_parser::prelude::GeneralName::URI(u) = n {
                        seen.lock().expect("lock").push(u.to_string());
                    }
                }
                let mut plain = tokio::net::TcpStream::connect(&master).await.expect("master");
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (addr, clients)
}

/// Issue 26: with no Secret named, the operator issues the cluster's CA and certificates — a pair
/// per node id, each naming its identity and its pod's DNS name —, writes nothing again while they
/// are good, issues the new ids' pairs before the StatefulSet grows in a scale-out (fails if the
/// node Secret is written after it), and calls the control API over mutual TLS as `operator`.
#[tokio::test]
pub(crate) async fn the_operator_issues_the_certificates_renews_none_that_are_good_and_adds_new_nodes_first() {
    use dpukv_operator::{certs, tls};
    let spec = json!({"nodes": 3, "replicationFactor": 1, "storage": {"size": "10Gi"},
                      "etcd": {"endpoints": ["http://etcd:2379"]}, "device": {"mode": "Emulator"}});
    let c = cluster(spec.clone());
    let (ctx, mut h) = mock(None);
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    let ca = secret(&mut h, "demo-ca", None, true).await.expect("the CA");
    let nodes = secret(&mut h, "demo-node-tls", None, true).await.expect("the node Secret");
    let gateway = secret(&mut h, "demo-gateway-tls", None, true).await.expect("the gateway's");
    let applied = children(&mut h, 0).await;
    let st = status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert_eq!(
        (condition(&st, "Secure")["status"].as_str(), condition(&st, "Secure")["reason"].as_str()),
        (Some("True"), Some("OperatorIssued"))
    );
    let host_env = applied.set["spec"]["template"]["spec"]["containers"][0]["env"].as_array().expect("env").clone();
    let cert = host_env.iter().find(|e| e["name"] == "DPUKV_TLS_CERT").expect("DPUKV_TLS_CERT");
    assert_eq!(cert["value"], "/etc/dpukv/tls/node-{node}.crt");
    let now = time::OffsetDateTime::now_utc();
    let ca_pair = certs::Pair { cert: secret_text(&ca, "ca.crt"), key: secret_text(&ca, "ca.key") };
    assert!(certs::ca_good(&ca_pair, now));
    assert_eq!(nodes["type"], "Opaque");
    assert!(
        nodes["data"].get("ca.key").is_none() && gateway["data"].get("ca.key").is_none(),
        "the CA's key stays in demo-ca"
    );
    for id in 1..=3 {
        let pair = certs::Pair {
            cert: secret_text(&nodes, &format!("node-{id}.crt")),
            key: secret_text(&nodes, &format!("node-{id}.key")),
        };
        assert!(certs::leaf_good(&pair, &ca_pair.cert, &tls::node_leaf(&c, id), now), "node {id}");
        assert!(tls::node_leaf(&c, id).dns.contains(&format!("demo-node-{}.demo-node.db.svc", id - 1)));
    }
    assert!(nodes["data"].get("node-4.crt").is_none());
    let gw = certs::Pair { cert: secret_text(&gateway, "tls.crt"), key: secret_text(&gateway, "tls.key") };
    assert!(certs::leaf_good(&gw, &ca_pair.cert, &tls::gateway_leaf(&c), now));
    assert_eq!(secret_text(&nodes, "ca.crt").trim(), ca_pair.cert.trim());

    // Scale out to 4 from 3 running pods: the certificates are read, only the node Secret is
    // written (node 4 added, nodes 1-3 kept), before the StatefulSet grows; the new node is
    // undrained over mutual TLS.
    let master = Master::default();
    let plain = master.clone().start().await;
    let node1 = (secret_text(&nodes, "node-1.crt"), secret_text(&nodes, "node-1.key"));
    let (addr, clients) = tls_master(&plain, &ca_pair.cert, (&node1.0, &node1.1)).await;
    let (ctx, mut h) = mock(Some(addr));
    let mut bigger = c.clone();
    bigger.spec.nodes = 4;
    let task = tokio::spawn(reconcile(Arc::new(bigger.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 3)).await;
    secret(&mut h, "demo-ca", Some(ca.clone()), false).await;
    let grown = secret(&mut h, "demo-node-tls", Some(nodes.clone()), true).await.expect("node 4 added");
    secret(&mut h, "demo-gateway-tls", Some(gateway.clone()), false).await;
    for id in 1..=3 {
        assert_eq!(grown["data"][format!("node-{id}.crt")], nodes["data"][format!("node-{id}.crt")], "node {id} kept");
    }
    let pair4 = certs::Pair { cert: secret_text(&grown, "node-4.crt"), key: secret_text(&grown, "node-4.key") };
    assert!(certs::leaf_good(&pair4, &ca_pair.cert, &tls::node_leaf(&bigger, 4), now));
    let set = children(&mut h, 3).await.set;
    assert_eq!(set["spec"]["replicas"], 4, "the StatefulSet grows after its new pod's pair exists");
    status(&mut h, &bigger).await;
    finished(task).await.expect("reconciled");
    assert!(master.calls.lock().expect("lock").contains(&"DELETE 4".to_string()), "node 4 undrained");
    let who = clients.lock().expect("lock").clone();
    assert!(!who.is_empty() && who.iter().all(|u| u == "spiffe://dpukv/db/demo/operator/dpukv-operator"), "{who:?}");
}

/// A control API whose certificate the cluster's CA did not sign is refused: nothing is drained
/// or undrained on the word of a server that is not one of the cluster's nodes.
#[tokio::test]
async fn the_operator_refuses_a_control_api_the_cluster_s_ca_did_not_sign() {
    use dpukv_operator::{certs, tls};
    let c = cluster(json!({"nodes": 4, "replicationFactor": 1, "storage": {"size": "10Gi"},
                           "etcd": {"endpoints": ["http://etcd:2379"]}, "device": {"mode": "Emulator"}}));
    let now = time::OffsetDateTime::now_utc();
    let impostor_ca = certs::new_ca("impostor", now).expect("ca");
    let impostor = certs::issue(&impostor_ca, &tls::node_leaf(&c, 1), now).expect("leaf");
    let master = Master::default();
    let plain = master.clone().start().await;
    let (addr, _) = tls_master(&plain, &impostor_ca.cert, (&impostor.cert, &impostor.key)).await;
    let (ctx, mut h) = mock(Some(addr));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), running_set(&c, 3)).await;
    secret(&mut h, "demo-ca", None, true).await;
    secret(&mut h, "demo-node-tls", None, true).await;
    secret(&mut h, "demo-gateway-tls", None, true).await;
    expect(&mut h, "PATCH", &format!("{CONFIGS}/demo-node-config-*"), echo(json!({}))).await;
    expect(&mut h, "PATCH", &format!("{SETS}/demo-node"), echo(json!({"replicas": 3, "readyReplicas": 3}))).await;
    assert!(failure_status(&mut h, &c).await.contains("TLS"));
    let e = finished(task).await.expect_err("the scale-out's undrain fails");
    assert!(e.to_string().contains("TLS"), "{e}");
    assert!(master.calls.lock().expect("lock").is_empty(), "the impostor was never asked anything");
}

/// `tls.certManager`: cert-manager Certificates per node, for the gateway and the operator,
/// from the issuer named; until their Secrets exist `Secure` says what it waits for.
#[tokio::test]
pub(crate) async fn cert_manager_gets_a_certificate_per_node_the_gateway_and_the_operator() {
    let c = cluster(json!({"nodes": 2, "replicationFactor": 1, "storage": {"size": "10Gi"},
                           "etcd": {"endpoints": ["http://etcd:2379"]}, "device": {"mode": "Emulator"},
                           "tls": {"certManager": {"issuerRef": {"name": "dpukv-ca", "kind": "ClusterIssuer"}}}}));
    let (ctx, mut h) = mock(None);
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    const CERTS: &str = "/apis/cert-manager.io/v1/namespaces/db/certificates";
    for (name, secret_name, uri) in [
        ("demo-node-1", "demo-node-1-tls", "spiffe://dpukv/db/demo/node/1"),
        ("demo-node-2", "demo-node-2-tls", "spiffe://dpukv/db/demo/node/2"),
        ("demo-gateway", "demo-gateway-tls", "spiffe://dpukv/db/demo/gateway/demo-gateway"),
        ("demo-operator", "demo-operator-tls", "spiffe://dpukv/db/demo/operator/dpukv-operator"),
    ] {
        let cert = expect(&mut h, "PATCH", &format!("{CERTS}/{name}"), |b| (200, b.clone())).await;
        assert_eq!(
            (cert["apiVersion"].as_str(), cert["kind"].as_str()),
            (Some("cert-manager.io/v1"), Some("Certificate"))
        );
        assert_eq!(cert["spec"]["secretName"], secret_name);
        assert_eq!(cert["spec"]["uris"], json!([uri]));
        assert_eq!(
            cert["spec"]["issuerRef"],
            json!({"name": "dpukv-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})
        );
    }
    secret(&mut h, "demo-node-1-tls", None, false).await;
    secret(&mut h, "demo-node-2-tls", None, false).await;
    secret(&mut h, "demo-operator-tls", None, false).await;
    children(&mut h, 0).await;
    let st = status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert_eq!(condition(&st, "Secure")["reason"], "CertificatesPending");
}

/// Issue 29: with `frontDoor`, each node's device gets a gateway certificate of its own
/// (`front-<id>` in the node Secret, identity `gateway/front-<id>`, its pod's names) — issued by
/// the operator, or asked of cert-manager per node and gathered into the node Secret.
#[tokio::test]
pub(crate) async fn with_a_front_door_each_device_gets_a_gateway_certificate_of_its_own() {
    use dpukv_operator::{certs, tls};
    let spec = json!({"nodes": 2, "replicationFactor": 1, "storage": {"size": "10Gi"},
                      "etcd": {"endpoints": ["http://etcd:2379"]}, "device": {"mode": "Emulator"},
                      "frontDoor": {"enabled": true}});
    let c = cluster(spec.clone());
    let (ctx, mut h) = mock(None);
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    let ca = secret(&mut h, "demo-ca", None, true).await.expect("the CA");
    let nodes = secret(&mut h, "demo-node-tls", None, true).await.expect("the node Secret");
    secret(&mut h, "demo-gateway-tls", None, true).await.expect("the gateway's");
    let fronts = secret(&mut h, "demo-front-tls", None, true).await.expect("the front doors' Secret");
    let applied = children(&mut h, 0).await;
    status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    let now = time::OffsetDateTime::now_utc();
    let ca_cert = secret_text(&ca, "ca.crt");
    assert!(nodes["data"].get("front-1.key").is_none(), "the hosts' Secret holds no gateway identity");
    for id in 1..=2 {
        let pair = certs::Pair {
            cert: secret_text(&fronts, &format!("front-{id}.crt")),
            key: secret_text(&fronts, &format!("front-{id}.key")),
        };
        let leaf = tls::front_leaf(&c, id);
        assert!(certs::leaf_good(&pair, &ca_cert, &leaf, now), "front door {id}");
        assert_eq!(leaf.uri.as_deref(), Some(format!("spiffe://dpukv/db/demo/gateway/front-{id}").as_str()));
        assert!(leaf.dns.contains(&format!("demo-node-{}.demo-node.db.svc", id - 1)));
        assert!(secret_text(&nodes, &format!("node-{id}.crt")).contains("CERTIFICATE"), "the node's own kept");
    }
    let device = &applied.set["spec"]["template"]["spec"]["containers"][1];
    assert_eq!(device["name"], "device");
    let env = device["env"].as_array().expect("env");
    assert!(
        env.iter()
            .any(|e| e["name"] == "DPUKV_FRONT_TLS_CERT" && e["value"] == "/etc/dpukv/front-tls/front-{node}.crt")
    );

    // cert-manager: a Certificate per node's front door, gathered into the node Secret.
    let mut spec = spec;
    spec["tls"] = json!({"certManager": {"issuerRef": {"name": "dpukv-ca", "kind": "ClusterIssuer"}}});
    let c = cluster(spec);
    let (ctx, mut h) = mock(None);
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    const CERTS: &str = "/apis/cert-manager.io/v1/namespaces/db/certificates";
    for (name, uri) in [
        ("demo-node-1", "spiffe://dpukv/db/demo/node/1"),
        ("demo-node-2", "spiffe://dpukv/db/demo/node/2"),
        ("demo-front-1", "spiffe://dpukv/db/demo/gateway/front-1"),
        ("demo-front-2", "spiffe://dpukv/db/demo/gateway/front-2"),
        ("demo-gateway", "spiffe://dpukv/db/demo/gateway/demo-gateway"),
        ("demo-operator", "spiffe://dpukv/db/demo/operator/dpukv-operator"),
    ] {
        let cert = expect(&mut h, "PATCH", &format!("{CERTS}/{name}"), |b| (200, b.clone())).await;
        assert_eq!(cert["spec"]["secretName"], format!("{name}-tls"));
        assert_eq!(cert["spec"]["uris"], json!([uri]));
    }
    let issued = |name: &str| {
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "db"},
               "data": {"ca.crt": b64("CA"), "tls.crt": b64(&format!("{name} cert")), "tls.key": b64(&format!("{name} key"))}})
    };
    for name in ["demo-node-1-tls", "demo-node-2-tls"] {
        secret(&mut h, name, Some(issued(name)), false).await;
    }
    let nodes = secret(&mut h, "demo-node-tls", None, true).await.expect("the node Secret");
    // One front door certificate not issued yet: the node Secret was written all the same, the
    // front doors' waits.
    secret(&mut h, "demo-front-1-tls", Some(issued("demo-front-1-tls")), false).await;
    secret(&mut h, "demo-front-2-tls", None, false).await;
    secret(&mut h, "demo-operator-tls", None, false).await;
    children(&mut h, 0).await;
    let st = status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    assert_eq!(condition(&st, "Secure")["reason"], "CertificatesPending");
    assert!(condition(&st, "Secure")["message"].as_str().is_some_and(|m| m.contains("demo-front-2-tls")));
    for id in 1..=2 {
        assert_eq!(secret_text(&nodes, &format!("node-{id}.key")), format!("demo-node-{id}-tls key"));
    }
    assert!(nodes["data"].get("front-1.crt").is_none(), "the hosts' Secret holds no gateway identity");
    // Both issued: the front doors' Secret.
    let (ctx, mut h) = mock(None);
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    for name in ["demo-node-1", "demo-node-2", "demo-front-1", "demo-front-2", "demo-gateway", "demo-operator"] {
        expect(&mut h, "PATCH", &format!("{CERTS}/{name}"), |b| (200, b.clone())).await;
    }
    for name in ["demo-node-1-tls", "demo-node-2-tls"] {
        secret(&mut h, name, Some(issued(name)), false).await;
    }
    secret(&mut h, "demo-node-tls", Some(nodes.clone()), false).await;
    for name in ["demo-front-1-tls", "demo-front-2-tls"] {
        secret(&mut h, name, Some(issued(name)), false).await;
    }
    let gathered = secret(&mut h, "demo-front-tls", None, true).await.expect("the front doors' Secret");
    for id in 1..=2 {
        assert_eq!(secret_text(&gathered, &format!("front-{id}.crt")), format!("demo-front-{id}-tls cert"));
    }
    secret(&mut h, "demo-operator-tls", None, false).await;
    children(&mut h, 0).await;
    status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
}

/// Issue 26: plain text only by `tls.mode: Disabled`, and then loudly — `Secure` False with reason
/// `PlaintextOptIn`, and a warning event the first time.
#[tokio::test]
async fn plain_text_is_an_opt_in_the_status_shows_and_an_event_says() {
    let (ctx, mut h) = mock(None);
    let c = new_cluster(spec(3, "Emulator"));
    let c = {
        let mut c = c;
        c.metadata.finalizers = Some(vec![etcd_keys::FINALIZER.into()]);
        c
    };
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    children(&mut h, 0).await;
    let st = status(&mut h, &c).await;
    finished(task).await.expect("reconciled");
    let secure = condition(&st, "Secure");
    assert_eq!((secure["status"].as_str(), secure["reason"].as_str()), (Some("False"), Some("PlaintextOptIn")));
    let events = h.take_events();
    assert!(events.iter().any(|e| e.reason == "PlaintextOptIn" && e.type_ == "Warning"), "{events:?}");
}

const BACKUPS: &str = "/apis/dpukv.io/v1alpha1/namespaces/db/dpukvbackups";
const SCHEDULES: &str = "/apis/dpukv.io/v1alpha1/namespaces/db/dpukvbackupschedules";
const RESTORES: &str = "/apis/dpukv.io/v1alpha1/namespaces/db/dpukvrestores";

/// The status a reconcile of `o` applies at `path` (answered as the API server would).
async fn applied_status(h: &mut Server, path: &str, o: &impl serde::Serialize) -> Value {
    let whole = serde_json::to_value(o).expect("json");
    expect(h, "PATCH", &format!("{path}/status"), move |b| {
        let mut o = whole;
        o["status"] = b["status"].clone();
        (200, o)
    })
    .await["status"]
        .clone()
}

/// The backup resources through the cluster's control API: a `DpuKvBackup` started once and
/// followed at its coordinator to `Done`; a `DpuKvBackupSchedule` gets its finalizer, sets the
/// cluster's schedule and shows the last backup, and stops the schedule when deleted; a
/// `DpuKvRestore` begun once and followed to `Done`, and one the cluster refuses is `Failed`
/// with the cluster's reason.
#[tokio::test]
pub(crate) async fn the_backup_resources_ask_the_cluster_and_report() {
    use dpukv_operator::backups::*;
    let master = Master::default();
    let addr = master.clone().start().await;
    let (ctx, mut h) = mock(Some(addr.clone()));
    let c = cluster(spec(3, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx.clone()));
    steady_reconcile(&mut h, &c, 3).await;
    finished(task).await.expect("reconciled");
    let cluster_json = serde_json::to_value(&c).expect("json");
    let cj = move |_: &Value| (200, cluster_json.clone());
    async fn get_cluster(h: &mut Server, cj: &(impl Fn(&Value) -> (u16, Value) + Clone)) {
        expect(h, "GET", CLUSTER, cj.clone()).await;
    }
    let ns = |mut m: kube::api::ObjectMeta| {
        m.namespace = Some("db".into());
        m
    };

    // A backup: started (job 7 at the node that answered), then followed there to Done.
    let mut b = DpuKvBackup::new("b1", DpuKvBackupSpec { cluster: "demo".into(), to: "file:///b".into() });
    b.metadata = ns(b.metadata);
    let task = tokio::spawn(reconcile_backup(Arc::new(b.clone()), ctx.clone()));
    get_cluster(&mut h, &cj).await;
    let st = applied_status(&mut h, &format!("{BACKUPS}/b1"), &b).await;
    assert_eq!(
        (st["phase"].as_str(), st["job"].as_u64(), st["coordinator"].as_str()),
        (Some("Running"), Some(7), Some(addr.as_str())),
        "{st}"
    );
    finished(task).await.expect("reconciled");
    b.status = Some(serde_json::from_value(st).expect("status"));
    let task = tokio::spawn(reconcile_backup(Arc::new(b.clone()), ctx.clone()));
    get_cluster(&mut h, &cj).await;
    let st = applied_status(&mut h, &format!("{BACKUPS}/b1"), &b).await;
    assert_eq!(
        (st["phase"].as_str(), st["backup"].as_str(), st["bytes"].as_u64()),
        (Some("Done"), Some("20261127T111523Z-00000007"), Some(30)),
        "{st}"
    );
    finished(task).await.expect("reconciled");
    b.status = Some(serde_json::from_value(st).expect("status"));
    // Done: nothing more is asked.
    assert_eq!(
        finished(tokio::spawn(reconcile_backup(Arc::new(b), ctx.clone()))).await.expect("ok"),
        kube::runtime::controller::Action::await_change()
    );
    assert_eq!(*master.calls.lock().expect("lock"), ["POST backup file:///b", "GET backup 7"]);
    master.calls.lock().expect("lock").clear();

    // A schedule: the finalizer, then the cluster's schedule and the last backup in the status;
    // deleted, the schedule stops before the finalizer goes.
    let mut s = DpuKvBackupSchedule::new(
        "nightly",
        DpuKvBackupScheduleSpec {
            cluster: "demo".into(),
            to: "file:///b".into(),
            schedule: None,
            every_seconds: Some(10),
            keep_last: Some(3),
            keep_within_seconds: None,
        },
    );
    s.metadata = ns(s.metadata);
    let task = tokio::spawn(reconcile_schedule(Arc::new(s.clone()), ctx.clone()));
    let mut with = serde_json::to_value(&s).expect("json");
    with["metadata"]["finalizers"] = json!([SCHEDULE_FINALIZER]);
    expect_patch(&mut h, &format!("{SCHEDULES}/nightly"), JSON_PATCH, move |_| (200, with)).await;
    finished(task).await.expect("finalizer added");
    s.metadata.finalizers = Some(vec![SCHEDULE_FINALIZER.into()]);
    let task = tokio::spawn(reconcile_schedule(Arc::new(s.clone()), ctx.clone()));
    get_cluster(&mut h, &cj).await;
    let st = applied_status(&mut h, &format!("{SCHEDULES}/nightly"), &s).await;
    assert_eq!(
        (st["phase"].as_str(), st["lastBackup"].as_str(), st["lastBackupTime"].as_str()),
        (Some("Active"), Some("20261127T111523Z-00000007"), Some("2026-11-27T11:15:23.456Z")),
        "{st}"
    );
    finished(task).await.expect("reconciled");
    assert_eq!(master.schedule.lock().expect("lock").as_deref(), Some("to=file:///b\nevery_ms=10000\nkeep_last=3\n"));
    s.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time("2026-01-01T00:00:00Z".parse().expect("time")));
    let task = tokio::spawn(reconcile_schedule(Arc::new(s.clone()), ctx.clone()));
    get_cluster(&mut h, &cj).await;
    let mut gone = serde_json::to_value(&s).expect("json");
    gone["metadata"]["finalizers"] = json!([]);
    expect_patch(&mut h, &format!("{SCHEDULES}/nightly"), JSON_PATCH, move |_| (200, gone)).await;
    finished(task).await.expect("stopped");
    assert_eq!(*master.calls.lock().expect("lock"), ["POST schedule", "GET schedule", "DELETE schedule"]);
    assert!(master.schedule.lock().expect("lock").is_none(), "the schedule stopped");
    master.calls.lock().expect("lock").clear();

    // A restore: begun, then followed until the cluster has none under way.
    let spec_of = |backup: &str| DpuKvRestoreSpec {
        cluster: "demo".into(),
        from: "file:///b".into(),
        backup: Some(backup.into()),
        at: None,
    };
    let mut r = DpuKvRestore::new("r1", spec_of("20261127T111523Z-00000007"));
    r.metadata = ns(r.metadata);
    let task = tokio::spawn(reconcile_restore(Arc::new(r.clone()), ctx.clone()));
    get_cluster(&mut h, &cj).await;
    let st = applied_status(&mut h, &format!("{RESTORES}/r1"), &r).await;
    assert_eq!((st["phase"].as_str(), st["regions"].as_u64()), (Some("Running"), Some(2)), "{st}");
    finished(task).await.expect("reconciled");
    r.status = Some(serde_json::from_value(st).expect("status"));
    let task = tokio::spawn(reconcile_restore(Arc::new(r.clone()), ctx.clone()));
    get_cluster(&mut h, &cj).await;
    let st = applied_status(&mut h, &format!("{RESTORES}/r1"), &r).await;
    assert_eq!(
        (st["phase"].as_str(), st["backup"].as_str()),
        (Some("Done"), Some("20261127T111523Z-00000007")),
        "{st}"
    );
    finished(task).await.expect("reconciled");
    assert_eq!(
        *master.calls.lock().expect("lock"),
        ["POST restore file:///b 20261127T111523Z-00000007", "GET restore"]
    );
    // Refused by the cluster (it holds keys): Failed, with the cluster's reason.
    *master.restore_answer.lock().expect("lock") =
        Some((409, "restore_cluster_not_empty: the cluster is not empty: regions [1] hold keys".into()));
    let mut r2 = DpuKvRestore::new("r2", spec_of("x"));
    r2.metadata = ns(r2.metadata);
    let task = tokio::spawn(reconcile_restore(Arc::new(r2.clone()), ctx.clone()));
    get_cluster(&mut h, &cj).await;
    let st = applied_status(&mut h, &format!("{RESTORES}/r2"), &r2).await;
    assert_eq!(st["phase"], "Failed", "{st}");
    assert!(st["message"].as_str().is_some_and(|m| m.contains("restore_cluster_not_empty")), "{st}");
    finished(task).await.expect("reconciled");
}
