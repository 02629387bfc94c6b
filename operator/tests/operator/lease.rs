//! Leader election against a mock API server: every request scripted (method, path, body), the
//! Lease answered as the apiserver would — created when absent, left alone while another replica
//! holds it, taken over (with the `resourceVersion` it read, one more transition) once its record
//! stayed unchanged for the lease's duration by this replica's own clock — whatever the holder's
//! wall clock wrote —, renewed when ours, and a 409 Conflict of a racing write meaning "not
//! leader".

use std::time::Duration;

use dpukv_operator::lease::{Elector, LeaseConfig};
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

fn held(holder: &str, renewed: Timestamp, version: &str) -> Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": "dpukv-operator", "namespace": "ops", "resourceVersion": version},
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
    let t0 = std::time::Instant::now();
    let at = |secs: u64| t0 + Duration::from_secs(secs);
    let secs = |n: i64| k8s_openapi::jiff::SignedDuration::from_secs(n);
    let attempt = |elector: std::sync::Arc<tokio::sync::Mutex<Elector>>, mono: std::time::Instant| {
        let api = api.clone();
        tokio::spawn(async move { elector.lock().await.try_acquire(&api, &cfg(), now, mono).await })
    };

    // Absent: created, ours.
    let a = std::sync::Arc::new(tokio::sync::Mutex::new(Elector::new()));
    let t = attempt(a.clone(), at(0));
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 404, status(404, "NotFound")).await;
    let created = next(&mut h, "POST", PATH, 201, Value::Null).await;
    assert_eq!(created["spec"]["holderIdentity"], "op-a");
    assert_eq!(created["spec"]["leaseDurationSeconds"], 15);
    assert!(ended(t).await.expect("ok"), "leader");

    // Held by another replica whose wall clock runs an hour behind (its renew time looks long
    // expired by ours): judged by this replica's clock from when it first saw the record, it is
    // fresh — left alone, nothing written.
    let b = std::sync::Arc::new(tokio::sync::Mutex::new(Elector::new()));
    let behind = now.checked_sub(secs(3600)).expect("time");
    let t = attempt(b.clone(), at(0));
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-b", behind, "41")).await;
    assert!(!ended(t).await.expect("ok"), "a skewed clock is not an expired lease");
    // Renewed 10 s later (a new record): still fresh at 20 s, 10 s after the change.
    let t = attempt(b.clone(), at(10));
    next(
        &mut h,
        "GET",
        &format!("{PATH}/dpukv-operator"),
        200,
        held("op-b", behind.checked_add(secs(5)).expect("t"), "42"),
    )
    .await;
    assert!(!ended(t).await.expect("ok"));
    let t = attempt(b.clone(), at(20));
    next(
        &mut h,
        "GET",
        &format!("{PATH}/dpukv-operator"),
        200,
        held("op-b", behind.checked_add(secs(5)).expect("t"), "42"),
    )
    .await;
    assert!(!ended(t).await.expect("ok"), "10 s since the last renewal: fresh");

    // Unchanged for more than 15 s by this replica's clock: taken over with the version read —
    // even though the holder's clock, an hour ahead, wrote a renew time in our future.
    let c = std::sync::Arc::new(tokio::sync::Mutex::new(Elector::new()));
    let ahead = now.checked_add(secs(3600)).expect("time");
    let t = attempt(c.clone(), at(0));
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-b", ahead, "43")).await;
    assert!(!ended(t).await.expect("ok"));
    let t = attempt(c.clone(), at(16));
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-b", ahead, "43")).await;
    let replaced = next(&mut h, "PUT", &format!("{PATH}/dpukv-operator"), 200, Value::Null).await;
    assert_eq!(replaced["metadata"]["resourceVersion"], "43", "an optimistic write");
    assert_eq!(
        (replaced["spec"]["holderIdentity"].as_str(), replaced["spec"]["leaseTransitions"].as_i64()),
        (Some("op-a"), Some(3))
    );
    assert!(ended(t).await.expect("ok"), "leader after the takeover");

    // Expired, but another replica wrote first: 409, not leader.
    let t = attempt(c.clone(), at(40));
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-b", ahead, "43")).await;
    next(&mut h, "PUT", &format!("{PATH}/dpukv-operator"), 409, status(409, "Conflict")).await;
    assert!(!ended(t).await.expect("ok"), "lost the race");

    // Ours: renewed, same acquire time and transitions, at once.
    let t = attempt(a.clone(), at(1));
    next(&mut h, "GET", &format!("{PATH}/dpukv-operator"), 200, held("op-a", now, "44")).await;
    let renewed = next(&mut h, "PUT", &format!("{PATH}/dpukv-operator"), 200, Value::Null).await;
    assert_eq!(renewed["spec"]["leaseTransitions"], 2);
    // MicroTime: microseconds on the wire.
    let at: Timestamp = renewed["spec"]["renewTime"].as_str().expect("renewTime").parse().expect("time");
    assert!(now.duration_since(at).as_secs_f64().abs() < 0.001, "renewed at {at}, now {now}");
    assert!(ended(t).await.expect("ok"));
}
