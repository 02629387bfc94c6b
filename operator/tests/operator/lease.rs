//! Leader election against a mock API server: every request scripted (method, path, body), the
//! Lease answered as the apiserver would — created when absent, left alone while another replica
//! holds it fresh, taken over (with the `resourceVersion` it read, one more transition) when it
//! expired, renewed when ours, and a 409 Conflict of a racing write meaning "not leader".

use std::time::Duration;

use dpukv_operator::lease::{LeaseConfig, try_acquire};
use http::{Request, Response};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::{Api, Client};
use serde_json::{Value, json};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases";

fn cfg() -> LeaseConfig {
    LeaseConfig {
        name: "dpukv-operator".into(),
        identity: "op-a".into(),
        duration: Duration::from_secs(15),
        renew_every: Duration::from_secs(5),
    }
}

async fn next(h: &mut Handle, method: &str, path: &str, code: u16, answer: Value) -> Value {
    let (req, send) =
        tokio::time::timeout(Duration::from_secs(10), h.next_request()).await.expect("a request").expect("client");
    crate::calls::check(&req);
    assert_eq!((req.method().as_str(), req.uri().path()), (method, path));
    let bytes = req.into_body().collect_bytes().await.expect("body");
    let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("json") };
    let answer = if answer.is_null() { body.clone() } else { answer };
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(&answer).expect("json")))
            .expect("response"),
    );
    body
}

/// The attempt's answer (a scripted exchange that went wrong fails here instead of hanging).
async fn ended(t: tokio::task::JoinHandle<Result<bool, kube::Error>>) -> Result<bool, kube::Error> {
    tokio::time::timeout(Duration::from_secs(10), t).await.expect("the attempt ends").expect("task")
}

fn held(holder: &str, renewed: Timestamp) -> Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": "dpukv-operator", "namespace": "ops", "resourceVersion": "41"},
           "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renewed.to_string(),
                    "acquireTime": renewed.to_string(), "leaseTransitions": 2}})
}

fn status(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code, "message": reason})
}

#[tokio::test]
pub(crate) async fn the_lease_is_created_taken_over_when_expired_and_left_alone_when_held() {
    let (svc, mut h) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let api: Api<Lease> = Api::namespaced(Client::new(svc, "ops"), "ops");
    let now = Timestamp::now();

    // Absent: created, ours.
    let t = tokio::spawn({
        let api = api.clone();
        async move { try_acquire(&api, &cfg(), now).await }
    });
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 404, status(404, "NotFound")).await;
    let created = next(&mut h, "POST", PATH, 201, Value::Null).await;
    assert_eq!(created["spec"]["holderIdentity"], "op-a");
    assert_eq!(created["spec"]["leaseDurationSeconds"], 15);
    assert!(ended(t).await.expect("ok"), "leader");

    // Held by another replica, renewed 3 s ago: not ours, nothing written.
    let t = tokio::spawn({
        let api = api.clone();
        async move { try_acquire(&api, &cfg(), now).await }
    });
    let three = now.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(3)).expect("time");
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-b", three)).await;
    assert!(!ended(t).await.expect("ok"), "follower");

    // Held by another replica, last renewed 20 s ago (> 15 s): taken over with the version read.
    let t = tokio::spawn({
        let api = api.clone();
        async move { try_acquire(&api, &cfg(), now).await }
    });
    let twenty = now.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(20)).expect("time");
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-b", twenty)).await;
    let replaced = next(&mut h, "PUT", &format!("{PATH}/dpukv-operator"), 200, Value::Null).await;
    assert_eq!(replaced["metadata"]["resourceVersion"], "41", "an optimistic write");
    assert_eq!(
        (replaced["spec"]["holderIdentity"].as_str(), replaced["spec"]["leaseTransitions"].as_i64()),
        (Some("op-a"), Some(3))
    );
    assert!(ended(t).await.expect("ok"), "leader after the takeover");

    // Expired, but another replica wrote first: 409, not leader.
    let t = tokio::spawn({
        let api = api.clone();
        async move { try_acquire(&api, &cfg(), now).await }
    });
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-b", twenty)).await;
    next(&mut h, "PUT", &format!("{PATH}/dpukv-operator"), 409, status(409, "Conflict")).await;
    assert!(!ended(t).await.expect("ok"), "lost the race");

    // Ours: renewed, same acquire time and transitions.
    let t = tokio::spawn({
        let api = api.clone();
        async move { try_acquire(&api, &cfg(), now).await }
    });
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-a", three)).await;
    let renewed = next(&mut h, "PUT", &format!("{PATH}/dpukv-operator"), 200, Value::Null).await;
    assert_eq!(renewed["spec"]["leaseTransitions"], 2);
    // MicroTime: microseconds on the wire.
    let at: Timestamp = renewed["spec"]["renewTime"].as_str().expect("renewTime").parse().expect("time");
    assert!(now.duration_since(at).as_secs_f64().abs() < 0.001, "renewed at {at}, now {now}");
    assert!(ended(t).await.expect("ok"));
}
