//! The operator's permissions: the chart includes the rule files generated from
//! `operator/src/rbac.rs`; the controller's watches are allowed by them; and every rule is used
//! by a request the operator makes (least privilege: a rule nobody needs fails here).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use dpukv_operator::rbac::{CLUSTER_RULES, NAMESPACE_RULES, grants, rules_yaml};
use dpukv_operator::run::{Metrics, run};
use http::{Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[test]
fn the_chart_includes_the_rules_generated_from_the_code() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/dpukv/files");
    for (file, rules) in
        [("operator-clusterrole-rules.yaml", CLUSTER_RULES), ("operator-role-rules.yaml", NAMESPACE_RULES)]
    {
        let committed = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        assert_eq!(
            committed,
            rules_yaml(rules),
            "charts/dpukv/files/{file} differs from operator/src/rbac.rs: run \
             `cargo run -p dpukv-operator --bin crdgen -- --rbac charts/dpukv/files`"
        );
    }
}

/// The controller (`run`) against a mock API server: it lists and watches the clusters, the
/// kinds it owns, the nodes (their zones) and its pods (those the scheduler cannot place), in every namespace — each request checked against the rules. Lists are
/// answered empty; watches end at once (the watcher starts them again).
#[tokio::test]
pub(crate) async fn the_controller_lists_and_watches_the_clusters_and_what_they_own() {
    let (svc, mut h) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let stop = CancellationToken::new();
    let task = tokio::spawn(run(Client::new(svc, "default"), Metrics::new(), stop.clone()));
    let wanted: BTreeSet<(&str, &str)> = [
        "dpukvclusters",
        "statefulsets",
        "deployments",
        "services",
        "poddisruptionbudgets",
        "configmaps",
        "networkpolicies",
        "nodes",
        "pods",
        "dpukvoperations",
        "dpukvbackups",
        "dpukvbackupschedules",
        "dpukvrestores",
    ]
    .iter()
    .flat_map(|r| [(*r, "list"), (*r, "watch")])
    .collect();
    let mut got = BTreeSet::new();
    while !wanted.iter().all(|w| got.contains(&(w.0.to_string(), w.1.to_string()))) {
        let (req, send) = tokio::time::timeout(Duration::from_secs(10), h.next_request())
            .await
            .unwrap_or_else(|_| panic!("the controller stopped asking; seen {got:?}"))
            .expect("client");
        crate::calls::check(&req);
        let (path, query) = (req.uri().path().to_string(), req.uri().query().unwrap_or_default().to_string());
        assert!(!path.contains("/namespaces/"), "watches cover every namespace: {path}");
        let resource = path.rsplit('/').next().unwrap_or_default().to_string();
        let watch = query.split('&').any(|kv| kv == "watch=true");
        let ours =
            ["dpukvclusters", "dpukvoperations", "dpukvbackups", "dpukvbackupschedules", "dpukvrestores", "nodes"];
        if !ours.contains(&resource.as_str()) {
            assert!(
                query.contains("labelSelector=app.kubernetes.io%2Fmanaged-by%3Ddpukv-operator"),
                "only the operator's {resource} are listed and watched: {query}"
            );
        }
        got.insert((resource, if watch { "watch" } else { "list" }.to_string()));
        let body = if watch {
            Body::empty()
        } else {
            Body::from(
                serde_json::to_vec(
                    &json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "1"}, "items": []}),
                )
                .expect("json"),
            )
        };
        send.send_response(Response::builder().status(200).body(body).expect("response"));
    }
    stop.cancel();
    // Requests still in flight are left unanswered: dropping the handle ends them.
    drop(h);
    tokio::time::timeout(Duration::from_secs(10), task).await.expect("the controller stops").expect("task");
}

/// Least privilege: the controller's watches, a reconcile (in `Auto` device mode, so it asks for
/// the nodes), failing reconciles (an event, then the same event again), a new cluster getting
/// its finalizer, a rollout of changed settings (the old node ConfigMap deleted), leader election
/// (created, renewed, taken over), an upgrade (the node pods listed) and a volume grown (its
/// claims read and patched) together use every verb the rules grant, and nothing else.
#[test]
fn every_rule_is_used_by_a_request_the_operator_makes() {
    crate::calls::reset();
    the_controller_lists_and_watches_the_clusters_and_what_they_own();
    crate::reconcile::auto_mode_asks_for_a_dpu_when_the_nodes_advertise_one_per_pod();
    crate::reconcile::failures_back_off_per_cluster_and_a_success_resets();
    crate::reconcile::a_cluster_with_an_external_etcd_gets_the_finalizer_first();
    crate::reconcile::a_changed_setting_gets_a_new_config_map_and_the_old_one_goes_when_the_rollout_ended();
    crate::reconcile::the_operator_issues_the_certificates_renews_none_that_are_good_and_adds_new_nodes_first();
    crate::reconcile::cert_manager_gets_a_certificate_per_node_the_gateway_and_the_operator();
    crate::lease::the_lease_is_created_taken_over_when_expired_and_left_alone_when_held();
    crate::reconcile::an_upgrade_moves_each_pod_s_primaries_away_before_restarting_it_highest_first();
    crate::reconcile::a_larger_volume_grows_each_claim_and_the_claim_templates_stay();
    crate::reconcile::an_operation_drains_a_node_holds_it_and_lifts_it_when_deleted();
    crate::reconcile::the_backup_resources_ask_the_cluster_and_report();
    let mut all = grants(CLUSTER_RULES);
    all.extend(grants(NAMESPACE_RULES));
    let seen = crate::calls::seen();
    let unused: Vec<_> = all.difference(&seen).collect();
    assert!(unused.is_empty(), "rules no request of the operator needs (remove them): {unused:?}");
    assert_eq!(seen, all, "every request checked against the rules");
}
