//! The reconciler against a mock API server (`tower_test::mock::pair` behind a `kube::Client`,
//! as kube-rs' controller-rs fixtures do): each test scripts the requests the reconciler must
//! make, in order — method, path, field manager, body — answers them with realistic objects, and
//! fails on any request it did not expect.

use std::sync::Arc;
use std::time::Duration;

use dpukv_operator::controller::{Context, MANAGER, backoff, error_policy, reconcile};
use dpukv_operator::crd::{DpuKvCluster, DpuKvClusterSpec};
use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn cluster(spec: Value) -> DpuKvCluster {
    let spec: DpuKvClusterSpec = serde_json::from_value(spec).expect("spec");
    let mut c = DpuKvCluster::new("demo", spec);
    c.metadata.namespace = Some("db".into());
    c.metadata.uid = Some("6d1f3a4e-0000-4000-8000-000000000001".into());
    c.metadata.generation = Some(2);
    c
}

fn spec(nodes: i32, mode: &str) -> Value {
    json!({"nodes": nodes, "replicationFactor": 1, "storage": {"size": "10Gi"},
           "etcd": {"endpoints": ["http://etcd:2379"]}, "device": {"mode": mode}})
}

fn respond(send: tower_test::mock::SendResponse<Response<Body>>, code: u16, body: Value) {
    let r =
        Response::builder().status(code).body(Body::from(serde_json::to_vec(&body).expect("json"))).expect("response");
    send.send_response(r);
}

/// The next request: it must be `method` on `path` (query aside); answers with what `answer`
/// makes of the request's body; returns that body.
async fn expect(handle: &mut Handle, method: &str, path: &str, answer: impl FnOnce(&Value) -> (u16, Value)) -> Value {
    let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("no request came; expected {method} {path}"))
        .expect("the client is gone");
    let uri = req.uri().clone();
    assert_eq!((req.method().as_str(), uri.path()), (method, path), "unexpected request {uri}");
    if method == "PATCH" {
        let q = uri.query().unwrap_or_default();
        assert!(
            q.contains(&format!("fieldManager={MANAGER}")) && q.contains("force=true"),
            "server-side apply, forced: {q}"
        );
        assert_eq!(
            req.headers().get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/apply-patch+yaml")
        );
    }
    let bytes = req.into_body().collect_bytes().await.expect("body");
    let body: Value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("json body") };
    let (code, out) = answer(&body);
    respond(send, code, out);
    body
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

async fn children(h: &mut Handle, ready: i64) -> Value {
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
    set
}

/// The status patch; answered, as the apiserver does, with the whole resource.
async fn status(h: &mut Handle, c: &DpuKvCluster) -> Value {
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

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"].as_array().expect("conditions").iter().find(|c| c["type"] == type_).expect("condition")
}

#[tokio::test]
async fn a_new_cluster_gets_its_children_applied_and_a_status() {
    let (svc, mut h) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Context::new(Client::new(svc, "db"));
    let c = cluster(spec(3, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    let set = children(&mut h, 0).await;
    assert_eq!(set["spec"]["replicas"], 3);
    assert_eq!(set["metadata"]["ownerReferences"][0]["kind"], "DpuKvCluster");
    assert!(set["spec"]["template"]["spec"]["containers"][1]["resources"]["limits"].get("dpukv.io/dpu").is_none());
    let st = status(&mut h, &c).await;
    assert_eq!(st["phase"], "Creating");
    assert_eq!(st["observedGeneration"], 2);
    assert_eq!(condition(&st, "Available")["status"], "False");
    assert_eq!(st["selector"], "app.kubernetes.io/component=node,app.kubernetes.io/instance=demo");
    task.await.expect("task").expect("reconciled");
}

#[tokio::test]
async fn auto_mode_asks_for_a_dpu_when_a_node_advertises_one() {
    let (svc, mut h) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Context::new(Client::new(svc, "db"));
    let c = cluster(spec(3, "Auto"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", "/api/v1/nodes", |_| {
        (
            200,
            json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [
            {"metadata": {"name": "plain"}, "status": {"allocatable": {"cpu": "8"}}},
            {"metadata": {"name": "bf3"}, "status": {"allocatable": {"cpu": "8", "dpukv.io/dpu": "2"}}}]}),
        )
    })
    .await;
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    let set = children(&mut h, 3).await;
    assert_eq!(set["spec"]["template"]["spec"]["containers"][1]["resources"]["limits"]["dpukv.io/dpu"], "1");
    let st = status(&mut h, &c).await;
    assert_eq!((st["phase"].as_str(), st["readyNodes"].as_i64()), (Some("Running"), Some(3)));
    assert_eq!(condition(&st, "Available")["status"], "True");
    task.await.expect("task").expect("reconciled");
}

#[tokio::test]
async fn a_scale_in_never_shrinks_the_statefulset_before_a_drain() {
    let (svc, mut h) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Context::new(Client::new(svc, "db"));
    let c = cluster(spec(3, "Emulator"));
    let task = tokio::spawn(reconcile(Arc::new(c.clone()), ctx));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| {
        (
            200,
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                     "metadata": {"name": "demo-node", "namespace": "db"},
                     "spec": {"replicas": 5, "selector": {}, "template": {}, "serviceName": "demo-node"},
                     "status": {"replicas": 5, "readyReplicas": 5}}),
        )
    })
    .await;
    let set = children(&mut h, 5).await;
    assert_eq!(set["spec"]["replicas"], 5, "the pods that would go are kept until drained");
    let st = status(&mut h, &c).await;
    assert_eq!(st["phase"], "Draining");
    assert_eq!(condition(&st, "Draining")["status"], "True");
    assert_eq!(condition(&st, "Available")["status"], "False");
    task.await.expect("task").expect("reconciled");
}

#[tokio::test]
async fn failures_back_off_per_cluster_and_a_success_resets() {
    assert_eq!(
        (backoff(1), backoff(2), backoff(3)),
        (Duration::from_secs(1), Duration::from_secs(2), Duration::from_secs(4))
    );
    assert_eq!(backoff(100), Duration::from_secs(256));
    let (svc, mut h) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Context::new(Client::new(svc, "db"));
    let c = Arc::new(cluster(spec(3, "Emulator")));
    // The API server fails: an error, then a growing wait.
    let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| {
        (500, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "InternalError", "code": 500, "message": "etcd is down"}))
    })
    .await;
    let e = task.await.expect("task").expect_err("an API failure is an error");
    let first = error_policy(c.clone(), &e, ctx.clone());
    let second = error_policy(c.clone(), &e, ctx.clone());
    assert_eq!(first, kube::runtime::controller::Action::requeue(Duration::from_secs(1)));
    assert_eq!(second, kube::runtime::controller::Action::requeue(Duration::from_secs(2)));
    // A success resets the count.
    let task = tokio::spawn(reconcile(c.clone(), ctx.clone()));
    expect(&mut h, "GET", &format!("{SETS}/demo-node"), |_| not_found()).await;
    children(&mut h, 0).await;
    status(&mut h, &c).await;
    task.await.expect("task").expect("reconciled");
    assert_eq!(error_policy(c, &e, ctx), kube::runtime::controller::Action::requeue(Duration::from_secs(1)));
}
