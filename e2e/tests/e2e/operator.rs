//! The operator on real processes: the real `dpukv-operator` binary, pointed by a kubeconfig at
//! the API-server double (`dpukv_e2e::apiserver`), with the test kubelet
//! (`dpukv_e2e::kubelet`) running every pod it asks for as real `dpukv-node` + `dpukv-dpu` and
//! `dpukv-gateway` processes, each pod in a network namespace of its own (pod IPs, cluster DNS
//! names through each namespace's hosts file), on a real etcd. Needs root (network namespaces),
//! as the partition tests do.
//!
//! A `DpuKvCluster` of 3 nodes serves through its gateway; it scales to 4 and then to 2 while a
//! writer keeps writing — no node pod goes before the master drained it, and every acknowledged
//! write is still readable —; deleting the resource removes everything it owned, stops every
//! process and removes the cluster's keys from etcd.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_client::Client;
use dpukv_cluster::{EtcdOptions, EtcdStore, MetaStore};
use dpukv_e2e::apiserver::ApiServer;
use dpukv_e2e::cluster::http_call;
use dpukv_e2e::etcd::Etcd;
use dpukv_e2e::kubelet::{Kubelet, KubeletConfig, Slot};
use dpukv_e2e::netns::Net;
use dpukv_e2e::procs::{Proc, bin_dir};
use serde_json::{Value, json};

const NS: &str = "db";
/// The node pods' control API port (operator/src/render.rs; plain HTTP in this scenario).
const HOST_CONTROL: u16 = 9103;
/// The gateway's binary port (the CRD's default).
const GATEWAY_BINARY: u16 = 7379;
/// Namespaces: the operator's, etcd's, and the pods' slots.
const OPERATOR_HOST: u8 = 2;
const ETCD_HOST: u8 = 3;
const POD_HOSTS: std::ops::RangeInclusive<u8> = 10..=17;

struct Scene {
    // Dropped in this order (fields drop as declared): the operator (so no watch of its keeps the
    // API server's connections open), the kubelet's pods, the API server, etcd, the namespaces.
    _operator: Proc,
    kubelet: Kubelet,
    api: Arc<ApiServer>,
    operator_log: std::path::PathBuf,
    _etcd: Etcd,
    _net: Net,
    _dir: tempfile::TempDir,
}

impl Scene {
    fn start() -> Scene {
        let bins = bin_dir().expect("binaries");
        let hosts: Vec<u8> = [OPERATOR_HOST, ETCD_HOST].into_iter().chain(POD_HOSTS).collect();
        let net = Net::new(&hosts).expect("network namespaces (needs root and iproute2)");
        let etcd = Etcd::start_in(net.exec_prefix(ETCD_HOST), &net.addr(ETCD_HOST)).expect("etcd");
        let dir = tempfile::tempdir().expect("dir");
        let api = Arc::new(ApiServer::start(&net.addr(dpukv_e2e::netns::TEST_HOST)).expect("API server"));
        // The namespace enforces Pod Security `restricted`: every pod the operator renders (node,
        // gateway) must be admitted under it.
        api.enforce_restricted(NS);
        // The CRDs, as `kubectl apply -f manifests/crds/` installs them: from now on the double
        // admits every DpuKvCluster and DpuKvOperation write (spec and status) by their schemas
        // and CEL rules.
        let crds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/crds");
        for crd in [
            "dpukv.io_dpukvclusters.yaml",
            "dpukv.io_dpukvoperations.yaml",
            "dpukv.io_dpukvbackups.yaml",
            "dpukv.io_dpukvbackupschedules.yaml",
            "dpukv.io_dpukvrestores.yaml",
        ] {
            let text = std::fs::read_to_string(crds.join(crd)).expect("the CRD");
            let crd: Value = serde_saphyr::from_str(&text).expect("yaml");
            api.create("customresourcedefinitions", "", crd).expect("the double holds the CRD");
        }
        // Three Kubernetes nodes, without a DPU, one per zone (the test kubelet puts pod N on
        // node N mod 3).
        for (n, zone) in [(1, "zone-a"), (2, "zone-b"), (3, "zone-c")] {
            let node = json!({"metadata": {"name": format!("worker-{n}"),
                                           "labels": {"topology.kubernetes.io/zone": zone}},
                              "status": {"allocatable": {"cpu": "2"}}});
            api.create("nodes", "", node).expect("node");
        }
        let kubelet = Kubelet::start(
            api.clone(),
            KubeletConfig {
                slots: POD_HOSTS.map(|h| Slot { netns: net.ns(h), ip: net.addr(h) }).collect(),
                dns_only: vec![net.ns(OPERATOR_HOST)],
                bins: bins.clone(),
                root: dir.path().join("kubelet"),
            },
        )
        .expect("kubelet");
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig, "dpukv-system").expect("kubeconfig");
        let operator_log = dir.path().join("operator.log");
        let log = std::fs::File::create(&operator_log).expect("log");
        let operator = Command::new("ip")
            .args(["netns", "exec", &net.ns(OPERATOR_HOST)])
            .arg(bins.join("dpukv-operator"))
            .args(["--http", "0.0.0.0:8080", "--namespace", "dpukv-system"])
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAME", "dpukv-operator-0")
            .env("RUST_LOG", "info,dpukv_operator=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("dpukv-operator");
        Scene { _operator: Proc(operator), kubelet, api, operator_log, _etcd: etcd, _net: net, _dir: dir }
    }

    /// What a failing wait prints: the cluster's status, what failed, the last logs.
    fn report(&self) -> String {
        let status = self.api.get("dpukvclusters", NS, "demo").map(|c| c["status"].clone());
        let op = std::fs::read_to_string(&self.operator_log).unwrap_or_default();
        format!(
            "status: {status:#?}\nkubelet errors: {:#?}\nrequests for nodes: {:?}\n--- operator log (tail) ---\n{}\n--- pods (tails) ---\n{}",
            self.kubelet.errors(),
            self.api.requests().iter().filter(|r| r.contains("/nodes")).take(10).collect::<Vec<_>>(),
            &op[op.len().saturating_sub(6000)..],
            self.kubelet.logs(3000),
        )
    }

    /// Waits (at most `timeout`) for `f` to give something.
    fn wait<T>(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}\n{}", self.report());
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until the cluster reports `nodes` node pods ready and `Running`.
    fn wait_running(&self, nodes: i64) -> Value {
        self.wait(&format!("the cluster Running with {nodes} nodes"), Duration::from_secs(180), || {
            let c = self.api.get("dpukvclusters", NS, "demo")?;
            let s = &c["status"];
            let set = self.api.get("statefulsets", NS, "demo-node")?;
            (s["phase"] == "Running"
                && s["readyNodes"] == nodes
                && s["observedGeneration"] == c["metadata"]["generation"]
                && set["status"]["replicas"] == nodes)
                .then(|| s.clone())
        })
    }

    /// Waits until `more` writes beyond those acknowledged now are acknowledged too.
    fn more_writes(&self, acked: &Mutex<BTreeMap<String, String>>, more: usize, what: &str) {
        let before = acked.lock().expect("acked").len();
        self.wait(what, Duration::from_secs(60), || {
            (acked.lock().expect("acked").len() >= before + more).then_some(())
        });
    }

    /// A ready gateway pod's binary endpoint.
    fn gateway(&self) -> String {
        self.wait("a ready gateway pod", Duration::from_secs(60), || ready_gateway(&self.api))
    }
}

/// A ready gateway pod's binary endpoint (what the cluster's Service would pick).
fn ready_gateway(api: &ApiServer) -> Option<String> {
    api.list("pods", Some(NS)).into_iter().find_map(|p| {
        let gateway = p["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway";
        let ready = p["status"]["conditions"][0]["status"] == "True";
        let ip = p["status"]["podIP"].as_str()?;
        (gateway && ready && p["metadata"]["deletionTimestamp"].is_null()).then(|| format!("{ip}:{GATEWAY_BINARY}"))
    })
}

/// The node ConfigMaps (`demo-node-config-<hash>`).
/// The DPU limits of a node StatefulSet's containers.
fn dpu_limits(set: &Value) -> Vec<Value> {
    set["spec"]["template"]["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["resources"]["limits"].get("dpukv.io/dpu").cloned())
        .collect()
}

fn node_configs(api: &ApiServer) -> Vec<String> {
    api.list("configmaps", Some(NS))
        .iter()
        .filter_map(|c| c["metadata"]["name"].as_str().map(String::from))
        .filter(|n| n.starts_with("demo-node-config-"))
        .collect()
}

/// A node pod as it went, and what its admin API said of its drain then.
type DrainSeen = (String, Option<String>);

/// What a node pod's admin API said as the pod went, as JSON (`what`: which status it was).
fn as_it_went(pod: &str, answer: &Option<String>, what: &str) -> Value {
    answer
        .as_deref()
        .and_then(|a| serde_json::from_str(a).ok())
        .unwrap_or_else(|| panic!("{pod}'s {what} was not readable as it went: {answer:?}"))
}

/// Writes keys `prefix-N` through a ready gateway pod until `stop`, remembering every
/// acknowledged one.
fn writer(
    rt: &tokio::runtime::Runtime,
    api: Arc<ApiServer>,
    prefix: &'static str,
    acked: Arc<Mutex<BTreeMap<String, String>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    rt.spawn(async move {
        let mut client = None;
        let (mut i, mut errors) = (0u64, 0u32);
        while !stop.load(Ordering::Acquire) {
            if client.is_none() {
                let Some(gateway) = ready_gateway(&api) else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                client = match Client::connect(&gateway, 1).await {
                    Ok(c) => Some(c),
                    Err(e) => {
                        errors += 1;
                        if errors <= 3 {
                            eprintln!("writer {prefix}: connecting to {gateway}: {e:#}");
                        }
                        None
                    }
                };
            }
            let Some(c) = &client else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let (k, v) = (format!("{prefix}-{i:05}"), format!("value-{prefix}-{i}"));
            match tokio::time::timeout(Duration::from_secs(10), c.put(k.as_bytes(), v.as_bytes())).await {
                Ok(Ok(_)) => {
                    acked.lock().expect("acked").insert(k, v);
                    i += 1;
                }
                // Not acknowledged: it may or may not have been applied; the next key is new.
                r => {
                    errors += 1;
                    if errors <= 3 {
                        eprintln!("writer {prefix}: {k}: {:?}", r.map(|r| r.map(|_| ())));
                    }
                    client = None;
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

#[test]
fn the_operator_scales_a_cluster_on_real_processes_without_losing_a_write_and_cleans_up() {
    let scene = Scene::start();
    let api = &scene.api;
    // Every node pod the StatefulSet controller takes away for a scale-in must be drained by the
    // master first (nothing led, nothing held): asked of the pod's own control API as it goes.
    // The same for every node pod an upgrade restarts: its primaries must have stepped down.
    let drained: Arc<Mutex<Vec<DrainSeen>>> = Arc::default();
    let stepped_down: Arc<Mutex<Vec<DrainSeen>>> = Arc::default();
    {
        let (drained, stepped_down) = (drained.clone(), stepped_down.clone());
        scene.kubelet.before_delete(move |pod, reason| {
            if pod["metadata"]["labels"]["app.kubernetes.io/component"] != "node" {
                return;
            }
            let ip = pod["status"]["podIP"].as_str().unwrap_or_default();
            let index: u32 = pod["metadata"]["labels"]["apps.kubernetes.io/pod-index"]
                .as_str()
                .and_then(|i| i.parse().ok())
                .unwrap_or(0);
            let (path, seen) = match reason {
                "ScaledIn" => (format!("/cluster/drain/{}", index + 1), &drained),
                _ => (format!("/cluster/step-down/{}", index + 1), &stepped_down),
            };
            let answer = http_call(&format!("{ip}:{HOST_CONTROL}"), "GET", &path, Duration::from_secs(3)).ok();
            seen.lock().expect("seen").push((pod["metadata"]["name"].as_str().unwrap_or_default().into(), answer));
        });
    }
    let etcd_url = format!("http://{}:2379", scene._net.addr(ETCD_HOST));
    let resource = json!({
        "apiVersion": "dpukv.io/v1alpha1", "kind": "DpuKvCluster",
        "metadata": {"name": "demo"},
        "spec": {
            "nodes": 3, "replicationFactor": 2,
            // Auto: decided once, at creation — no node advertises a DPU here, so Emulator.
            "device": {"mode": "Auto"},
            "storage": {"size": "1Gi"},
            "sharedMemory": {"size": "256Mi"},
            "etcd": {"endpoints": [etcd_url]},
            "regions": {"splitKeys": ["a-", "b-", "c-"]},
            "persistentVolumeClaimRetention": {"whenScaled": "Delete", "whenDeleted": "Delete"},
            "gateway": {"replicas": 1},
            // TLS is on by default; this scenario runs plain until the test kubelet mounts Secret
            // volumes (the node binaries take `{node}` paths and serve the control port) — then
            // drop this line.
            "tls": {"mode": "Disabled"},
        },
    });
    api.create("dpukvclusters", NS, resource.clone()).expect("create the DpuKvCluster");

    // The operator knows the Kubernetes nodes' zones (a watch of their metadata) and wrote them
    // for the hosts, which read theirs before they register.
    scene.wait("the zones ConfigMap", Duration::from_secs(60), || api.get("configmaps", NS, "demo-zones"));
    // 3 nodes: the operator created the children; the cluster serves.
    let status = scene.wait_running(3);
    assert!(status["master"].as_str().is_some_and(|m| m.starts_with("demo-node-")), "{status:#}");
    assert_eq!(status["regions"], 4, "{status:#}");
    let requests = api.requests();
    assert!(
        requests.iter().any(|r| r.starts_with("GET /apis/apps/v1/statefulsets?") && r.contains("watch=true")),
        "the operator watches what it owns"
    );
    assert!(
        requests.iter().any(|r| r.starts_with("PATCH /apis/dpukv.io/v1alpha1/namespaces/db/dpukvclusters/demo/status"))
    );
    assert_eq!(status["deviceMode"], "Emulator", "{status:#}");
    // A device plugin coming up — every node now advertises DPUs — changes no pod template: the
    // mode was decided at creation. (A change to the resource makes the operator reconcile; its
    // applies of the node StatefulSet are seen by the double.)
    let generation = api.get("statefulsets", NS, "demo-node").expect("set")["metadata"]["generation"].clone();
    let set_applies = || {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("PATCH /apis/apps/v1/namespaces/db/statefulsets/demo-node?"))
            .count()
    };
    let applied_before = set_applies();
    for n in 1..=3 {
        api.mutate("nodes", "", &format!("worker-{n}"), |o| o["status"]["allocatable"]["dpukv.io/dpu"] = json!("4"))
            .expect("node");
    }
    api.merge("dpukvclusters", NS, "demo", &json!({"metadata": {"annotations": {"example.com/touched": "1"}}}))
        .expect("touch the resource");
    scene.wait("a reconcile after the DPUs appeared", Duration::from_secs(60), || {
        (set_applies() > applied_before).then_some(())
    });
    let set = api.get("statefulsets", NS, "demo-node").expect("set");
    assert_eq!(set["metadata"]["generation"], generation, "the pod template did not change");
    assert!(dpu_limits(&set).is_empty(), "no pod asks for a DPU");
    let secure = status["conditions"].as_array().and_then(|c| c.iter().find(|c| c["type"] == "Secure")).cloned();
    assert_eq!(secure.as_ref().map(|s| s["reason"].clone()), Some(json!("PlaintextOptIn")), "{status:#}");
    for (plural, name) in [
        ("networkpolicies", "demo-node"),
        ("networkpolicies", "demo-gateway"),
        ("services", "demo-node"),
        ("services", "demo"),
        ("deployments", "demo-gateway"),
        ("poddisruptionbudgets", "demo-node"),
    ] {
        assert!(api.get(plural, NS, name).is_some(), "{plural}/{name} was applied");
    }
    let first_config = node_configs(api);
    assert_eq!(first_config.len(), 1, "one node configuration, named by its content: {first_config:?}");
    scene.gateway();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let acked: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> =
        ["a", "b", "c", "d"].into_iter().map(|p| writer(&rt, api.clone(), p, acked.clone(), stop.clone())).collect();
    scene.more_writes(&acked, 200, "writes acknowledged");

    // An upgrade under writes, with a changed setting: node pods restart one at a time, highest
    // ordinal first, each only once its primaries moved to backups elsewhere (asked of its admin
    // API as it goes); the pods not yet restarted keep reading the old configuration, which goes
    // once the rollout ended.
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"version": "0.2.0", "fsync": "interval:5"}}))
        .expect("upgrade");
    scene.wait("the upgrade finished", Duration::from_secs(240), || {
        let c = api.get("dpukvclusters", NS, "demo")?;
        let set = api.get("statefulsets", NS, "demo-node")?;
        let st = &set["status"];
        // The gateway runs the new version too (its pod replaced: a new image).
        let d = api.get("deployments", NS, "demo-gateway")?;
        let gw = &d["status"];
        let gateway_rolled = gw["observedGeneration"] == d["metadata"]["generation"]
            && d["spec"]["template"]["spec"]["containers"][0]["image"].as_str().is_some_and(|i| i.ends_with(":0.2.0"))
            && gw["replicas"] == 1
            && gw["updatedReplicas"] == 1
            && gw["readyReplicas"] == 1;
        (gateway_rolled
            && c["status"]["version"] == "0.2.0"
            && c["status"]["phase"] == "Running"
            && st["updatedReplicas"] == 3
            && st["readyReplicas"] == 3
            && st["currentRevision"] == st["updateRevision"])
            .then_some(())
    });
    let restarted: Vec<String> =
        scene.kubelet.deletions().into_iter().filter(|d| d.reason == "Updated").map(|d| d.pod).collect();
    assert_eq!(restarted, ["db/demo-node-2", "db/demo-node-1", "db/demo-node-0"], "one at a time, from the top");
    let stepped = stepped_down.lock().expect("stepped down").clone();
    assert_eq!(stepped.len(), 3, "{stepped:?}");
    for (pod, answer) in &stepped {
        let answer = as_it_went(pod, answer, "step-down");
        assert_eq!(
            (&answer["done"], &answer["regions_led"]),
            (&json!(true), &json!(0)),
            "{pod} restarted while leading: {answer}"
        );
    }
    scene.wait("the old node configuration pruned", Duration::from_secs(30), || {
        let now = node_configs(api);
        (now.len() == 1 && now != first_config).then_some(())
    });
    scene.more_writes(&acked, 100, "writes after the upgrade");

    // A failed upgrade, reverted: a version whose image crashes (the test kubelet runs a
    // `-broken` tag's containers as processes that exit at once) stops the rollout at the first
    // pod it restarts; setting `version` back brings that pod back on the working template — no
    // pod deleted by hand — and no other pod restarts.
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"version": "0.3.0-broken"}})).expect("a broken release");
    scene.wait("the rollout held at the broken pod", Duration::from_secs(120), || {
        let c = api.get("dpukvclusters", NS, "demo")?;
        let p = c["status"]["conditions"].as_array()?.iter().find(|x| x["type"] == "Progressing")?.clone();
        let held = p["message"].as_str()?.contains("waiting for demo-node-2 to be ready on the new revision");
        // The pod runs the broken revision and has crashed (not merely being replaced: a revert
        // in that window recreates it from the reverted template, with nothing to restart).
        let set = api.get("statefulsets", NS, "demo-node")?;
        let pod = api.get("pods", NS, "demo-node-2")?;
        let on_broken = pod["metadata"]["labels"]["controller-revision-hash"] == set["status"]["updateRevision"];
        let crashed =
            pod["status"]["containerStatuses"].as_array()?.iter().any(|c| c["restartCount"].as_u64() >= Some(1));
        (held && on_broken && crashed && c["status"]["phase"] == "Upgrading").then_some(())
    });
    let before_revert = scene.kubelet.deletions().len();
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"version": "0.2.0"}})).expect("revert");
    scene.wait("the reverted rollout whole again", Duration::from_secs(180), || {
        let c = api.get("dpukvclusters", NS, "demo")?;
        let st = api.get("statefulsets", NS, "demo-node")?["status"].clone();
        (c["status"]["version"] == "0.2.0"
            && c["status"]["phase"] == "Running"
            && c["status"]["observedGeneration"] == c["metadata"]["generation"]
            && st["readyReplicas"] == 3
            && st["updatedReplicas"] == 3
            && st["currentRevision"] == st["updateRevision"])
            .then_some(())
    });
    let after: Vec<String> = scene.kubelet.deletions()[before_revert..]
        .iter()
        .filter(|d| d.reason == "Updated" && d.pod.starts_with("db/demo-node-"))
        .map(|d| d.pod.clone())
        .collect();
    assert_eq!(after, ["db/demo-node-2"], "only the broken pod restarted by the revert");
    scene.more_writes(&acked, 100, "writes after the reverted upgrade");

    // A larger volume: the claim templates cannot change (the API server refuses: 422), so each
    // claim grows instead, and everything else goes on being reconciled. A smaller one is
    // refused, and the status says so.
    let claim_size = |c: &str| {
        api.get("persistentvolumeclaims", NS, c).map(|c| c["spec"]["resources"]["requests"]["storage"].clone())
    };
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"storage": {"size": "2Gi"}}})).expect("grow the volumes");
    scene.wait("every claim grown to 2Gi", Duration::from_secs(60), || {
        let c = api.get("dpukvclusters", NS, "demo")?;
        let grown = (0..3).all(|o| claim_size(&format!("data-demo-node-{o}")) == Some(json!("2Gi")));
        (grown && c["status"]["observedGeneration"] == c["metadata"]["generation"] && c["status"]["phase"] == "Running")
            .then_some(())
    });
    let set = api.get("statefulsets", NS, "demo-node").expect("set");
    assert_eq!(
        set["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"], "1Gi",
        "templates kept"
    );
    // A shrink is refused by the CRD's rule, as the real API server refuses it (the operator's
    // own refusal, for a CRD without the rule, is tested in reconcile.rs with the larger volume).
    let e = api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"storage": {"size": "1Gi"}}})).expect_err("shrink");
    assert!(e.code == 422 && e.message.contains("storage.size cannot shrink"), "{e}");
    assert_eq!(claim_size("data-demo-node-0"), Some(json!("2Gi")), "no claim shrank");

    // Scale out to 6: 3 zones × 2 nodes (the new pods' claims, made at the template's 1Gi, grow
    // to 2Gi too).
    let gateway_before = ready_gateway(api);
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"nodes": 6}})).expect("scale out");
    scene.wait_running(6);
    scene.wait("the new pods' claims grown", Duration::from_secs(60), || {
        (3..6).all(|o| claim_size(&format!("data-demo-node-{o}")) == Some(json!("2Gi"))).then_some(())
    });
    scene.more_writes(&acked, 200, "writes on 6 nodes");
    // Zones: each host read its Kubernetes node's zone (the operator's zones ConfigMap) and
    // registered with it; pod N runs on worker-(N mod 3 + 1), so pods 0 and 3 share zone-a, 1 and
    // 4 zone-b, 2 and 5 zone-c — no region may have both its copies in one of those pairs.
    let zones = api.get("configmaps", NS, "demo-zones").expect("the zones ConfigMap");
    assert_eq!(zones["data"]["worker-3"], "zone-c", "{zones}");
    let map =
        scene.wait("every region's copies in distinct zones, on at least 4 nodes", Duration::from_secs(60), || {
            let map = rt.block_on(async {
                let c = Client::connect(&scene.gateway(), 1).await.ok()?;
                c.region_map().await.ok()
            })?;
            let zone = |id: u32| map.node(id).map(|n| n.zone.clone()).unwrap_or_default();
            let zoned = map.nodes.len() == 6 && map.nodes.iter().all(|n| n.zone.starts_with("zone-"));
            let apart = map.regions.iter().all(|r| {
                let mut zs: Vec<String> =
                    std::iter::once(r.primary).chain(r.backups.iter().copied()).map(zone).collect();
                let n = zs.len();
                zs.sort();
                zs.dedup();
                zs.len() == n && n == 2
            });
            // Balance moved copies to the new pods: the second node of each zone is used too.
            let used: std::collections::BTreeSet<u32> =
                map.regions.iter().flat_map(|r| std::iter::once(r.primary).chain(r.backups.iter().copied())).collect();
            (zoned && apart && used.len() >= 4).then_some(map)
        });
    for ordinal in 0..6u32 {
        let zone = ["zone-a", "zone-b", "zone-c"][ordinal as usize % 3];
        assert_eq!(map.node(ordinal + 1).map(|n| n.zone.as_str()), Some(zone), "node {}: {map:?}", ordinal + 1);
    }
    // The resource says the copies are spread.
    scene.wait("the ZonesSpread condition True over 3 zones", Duration::from_secs(60), || {
        let c = api.get("dpukvclusters", NS, "demo")?;
        let conditions = c["status"]["conditions"].as_array()?.clone();
        let spread = conditions.iter().find(|c| c["type"] == "ZonesSpread")?;
        (spread["status"] == "True"
            && spread["reason"] == "DistinctZones"
            && spread["message"].as_str()?.contains("(3 zones)"))
        .then_some(())
    });
    // A node pod evicted (deleted) under writes: its host hands its primaries over before it
    // stops (SIGTERM), so the writers wait for a handover, never for a failover after a lease
    // ends; the StatefulSet makes the pod again and it rejoins.
    let victim = api.get("pods", NS, "demo-node-1").expect("pod");
    let (acked_len, watching) = (acked.clone(), Arc::new(AtomicBool::new(true)));
    let stall = {
        let watching = watching.clone();
        std::thread::spawn(move || {
            let (mut longest, mut last, mut since) = (Duration::ZERO, 0, Instant::now());
            while watching.load(Ordering::Acquire) {
                let n = acked_len.lock().expect("acked").len();
                if n != last {
                    (last, since) = (n, Instant::now());
                }
                longest = longest.max(since.elapsed());
                std::thread::sleep(Duration::from_millis(10));
            }
            longest
        })
    };
    api.delete("pods", NS, "demo-node-1").expect("evict demo-node-1");
    scene.wait("demo-node-1 made again", Duration::from_secs(60), || {
        let p = api.get("pods", NS, "demo-node-1")?;
        (p["metadata"]["uid"] != victim["metadata"]["uid"]).then_some(())
    });
    scene.wait_running(6);
    scene.more_writes(&acked, 100, "writes after the eviction");
    watching.store(false, Ordering::Release);
    let longest = stall.join().expect("stall watcher");
    let host_log = scene.kubelet.container_log(NS, "demo-node-1", "host");
    assert!(host_log.contains("left: primaries handed over"), "the evicted host handed its primaries over first");
    eprintln!("eviction of demo-node-1: the writers' longest stall {longest:?}");
    assert!(longest < Duration::from_secs(5), "the writers stalled {longest:?}: more than a failover");
    // A scale-in to 2 cancelled while it drains: no node stays drained (the master would move
    // every region off them for good).
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"nodes": 2}})).expect("scale in");
    scene.wait("the drain under way", Duration::from_secs(60), || {
        let c = api.get("dpukvclusters", NS, "demo")?;
        (c["status"]["phase"] == "Draining").then_some(())
    });
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"nodes": 6}})).expect("cancel the scale-in");
    scene.wait_running(6);
    scene.wait("no node left draining", Duration::from_secs(60), || {
        let ip = api.get("pods", NS, "demo-node-0")?["status"]["podIP"].as_str()?.to_string();
        let summary =
            http_call(&format!("{ip}:{HOST_CONTROL}"), "GET", "/cluster/summary", Duration::from_secs(3)).ok()?;
        let summary: Value = serde_json::from_str(&summary).ok()?;
        (summary["draining"] == json!([])).then_some(())
    });
    // The console's view of the resource: its status mirrored into the cluster by the operator.
    scene.wait("the resource's status mirrored for the console", Duration::from_secs(60), || {
        let ip = api.get("pods", NS, "demo-node-0")?["status"]["podIP"].as_str()?.to_string();
        let summary =
            http_call(&format!("{ip}:{HOST_CONTROL}"), "GET", "/cluster/summary", Duration::from_secs(3)).ok()?;
        let k8s = serde_json::from_str::<Value>(&summary).ok()?["kubernetes"].clone();
        let status = api.get("dpukvclusters", NS, "demo")?["status"].clone();
        let available =
            |conds: &Value| conds.as_array()?.iter().find(|c| c["type"] == "Available").map(|c| c["status"].clone());
        (k8s["resource"] == format!("{NS}/demo")
            && k8s["phase"] == status["phase"]
            && available(&k8s["conditions"]).is_some()
            && available(&k8s["conditions"]) == available(&status["conditions"]))
        .then_some(())
    });
    scene.more_writes(&acked, 100, "writes after the cancelled scale-in");

    // A drain through Kubernetes: a `DpuKvOperation` drains demo-node-3 (node 4) under the
    // writes and holds it — the cluster's reconciles, every few seconds, do not take it back —;
    // deleting the operation undrains the node.
    let draining_now = || -> Option<Value> {
        let ip = api.get("pods", NS, "demo-node-0")?["status"]["podIP"].as_str()?.to_string();
        let summary =
            http_call(&format!("{ip}:{HOST_CONTROL}"), "GET", "/cluster/summary", Duration::from_secs(3)).ok()?;
        Some(serde_json::from_str::<Value>(&summary).ok()?["draining"].clone())
    };
    let operation = json!({"apiVersion": "dpukv.io/v1alpha1", "kind": "DpuKvOperation", "metadata": {"name": "drain-3"},
                           "spec": {"cluster": "demo", "action": "Drain", "pod": "demo-node-3"}});
    api.create("dpukvoperations", NS, operation).expect("the operation");
    scene.wait("the operation's drain done and held", Duration::from_secs(90), || {
        let o = api.get("dpukvoperations", NS, "drain-3")?;
        (o["status"]["phase"] == "Holding" && o["status"]["regionsHeld"] == 0).then_some(())
    });
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(draining_now(), Some(json!([4])), "still drained after the cluster's reconciles");
    api.delete("dpukvoperations", NS, "drain-3").expect("delete the operation");
    scene.wait("the operation lifted, then gone", Duration::from_secs(60), || {
        (api.get("dpukvoperations", NS, "drain-3").is_none() && draining_now()? == json!([])).then_some(())
    });
    scene.more_writes(&acked, 100, "writes after the operation");
    let scaled_in_before = scene.kubelet.deletions().into_iter().filter(|d| d.reason == "ScaledIn").count();
    let drained_before = drained.lock().expect("drained").len();
    api.merge("dpukvclusters", NS, "demo", &json!({"spec": {"nodes": 2}})).expect("scale in");
    let status = scene.wait_running(2);
    scene.more_writes(&acked, 100, "writes on 2 nodes");
    stop.store(true, Ordering::Release);
    for w in writers {
        rt.block_on(w).expect("writer");
    }
    assert_eq!(status["regions"], 4, "{status:#}");
    assert_eq!(ready_gateway(api), gateway_before, "scaling the nodes left the gateway pod alone");

    // The pods that went were drained first, and their volumes went after them.
    // (The cancelled scale-in may have shrunk the StatefulSet before it was cancelled: only the
    // last one's are counted.)
    let mut scaled_in: Vec<String> = scene
        .kubelet
        .deletions()
        .into_iter()
        .filter(|d| d.reason == "ScaledIn")
        .skip(scaled_in_before)
        .map(|d| d.pod)
        .collect();
    scaled_in.sort();
    assert_eq!(
        scaled_in,
        ["db/demo-node-2", "db/demo-node-3", "db/demo-node-4", "db/demo-node-5"],
        "the highest ordinals went, once each"
    );
    let drained = drained.lock().expect("drained").clone();
    assert_eq!(drained.len(), drained_before + 4, "{drained:?}");
    for (pod, answer) in &drained {
        let answer = as_it_went(pod, answer, "drain status");
        assert_eq!(
            (&answer["done"], &answer["regions_led"], &answer["regions_held"]),
            (&json!(true), &json!(0), &json!(0)),
            "{pod} went before its drain finished: {answer}"
        );
    }
    scene.wait("the claims of the pods that went deleted (whenScaled: Delete)", Duration::from_secs(30), || {
        (2..6)
            .map(|o| format!("data-demo-node-{o}"))
            .all(|c| api.get("persistentvolumeclaims", NS, &c).is_none())
            .then_some(())
    });
    assert!(api.get("persistentvolumeclaims", NS, "data-demo-node-1").is_some());

    // Every acknowledged write is still there.
    let acked = acked.lock().expect("acked").clone();
    assert!(acked.len() >= 500, "{} writes acknowledged", acked.len());
    rt.block_on(async {
        let c = Client::connect(&scene.gateway(), 2).await.expect("connect to the gateway");
        for (k, v) in &acked {
            let got = c.get(k.as_bytes()).await.unwrap_or_else(|e| panic!("reading {k}: {e}"));
            assert_eq!(got.as_deref(), Some(v.as_bytes()), "{k} was acknowledged");
        }
    });

    // Backups through Kubernetes (docs/backup.md §7): a `DpuKvBackupSchedule` makes the cluster
    // take a backup every 2 s; one whose cut is after the last acknowledged write holds them all.
    let stopped_ms = unix_ms();
    let backups_dir = scene._dir.path().join("backups");
    let location = format!("file://{}", backups_dir.display());
    let schedule = json!({"apiVersion": "dpukv.io/v1alpha1", "kind": "DpuKvBackupSchedule", "metadata": {"name": "often"},
                          "spec": {"cluster": "demo", "to": location, "everySeconds": 2, "keepLast": 5}});
    api.create("dpukvbackupschedules", NS, schedule).expect("create the DpuKvBackupSchedule");
    let backup_id = scene.wait("a scheduled backup after the last write", Duration::from_secs(60), || {
        let st = api.get("dpukvbackupschedules", NS, "often")?["status"].clone();
        let at = dpukv_backup::manifest::parse_utc(st["lastBackupTime"].as_str()?)?;
        (st["phase"] == "Active" && at > stopped_ms).then(|| st["lastBackup"].as_str().map(String::from)).flatten()
    });
    let taken = rt.block_on(async {
        let loc = dpukv_backup::Location::open(&location).expect("location");
        loc.list().await.expect("list")
    });
    assert!(taken.contains(&backup_id), "{backup_id} is at the location: {taken:?}");
    api.delete("dpukvbackupschedules", NS, "often").expect("delete the schedule");
    scene.wait("the schedule gone (its finalizer stopped it)", Duration::from_secs(30), || {
        api.get("dpukvbackupschedules", NS, "often").is_none().then_some(())
    });

    // What `kubectl describe` shows: the operator's events on the resource.
    let reasons = |api: &ApiServer| -> Vec<String> {
        api.list("events", Some(NS))
            .iter()
            .filter(|e| e["regarding"]["name"] == "demo" && e["reportingController"] == "dpukv-operator")
            .filter_map(|e| e["reason"].as_str().map(String::from))
            .collect()
    };
    let seen = reasons(api);
    for r in ["ScaledOut", "DrainStarted", "ScaledIn"] {
        assert!(seen.iter().any(|s| s == r), "a {r} event: {seen:?}");
    }

    // Deleting the resource: everything it owned goes, every process stops, and the cluster's
    // keys leave etcd.
    let keys = |prefix: &'static str| {
        let url = etcd_url.clone();
        rt.block_on(async move {
            let s = EtcdStore::connect_checked(&EtcdOptions::new([url])).await.expect("etcd");
            s.range(prefix.as_bytes()).await.expect("range").0.len()
        })
    };
    assert!(keys("/dpukv/db.demo/") > 0, "the cluster keeps its metadata in etcd");
    api.delete("dpukvclusters", NS, "demo").expect("delete");
    // The keys go only once no node process runs (one would write its registration back).
    let store = rt.block_on(EtcdStore::connect_checked(&EtcdOptions::new([etcd_url.clone()]))).expect("etcd");
    scene.wait("the cluster's keys deleted", Duration::from_secs(60), || {
        let left = rt.block_on(store.range(b"/dpukv/db.demo/")).expect("range").0.len();
        (left == 0).then(|| {
            let running = scene.kubelet.running();
            assert!(
                !running.iter().any(|p| p.starts_with("db/demo-node-")),
                "the keys were deleted while node pods ran: {running:?}"
            );
        })
    });
    scene.wait("the DpuKvCluster gone", Duration::from_secs(60), || {
        api.get("dpukvclusters", NS, "demo").is_none().then_some(())
    });
    scene.wait("every owned object and process gone", Duration::from_secs(60), || {
        let left: usize =
            ["statefulsets", "deployments", "services", "poddisruptionbudgets", "pods", "persistentvolumeclaims"]
                .iter()
                .map(|p| api.list(p, Some(NS)).len())
                .sum();
        (left == 0 && scene.kubelet.running().is_empty()).then_some(())
    });
    assert_eq!(keys("/dpukv/db.demo/"), 0, "the finalizer removed the cluster's etcd keys");
    let seen = reasons(api);
    assert!(seen.iter().any(|s| s == "EtcdKeysDeleted"), "{seen:?}");
    assert!(api.list("configmaps", Some(NS)).is_empty(), "the node configuration went with its owner");

    // The deleted cluster back: a new `DpuKvCluster` of the same name (empty: its keys and
    // volumes went), and a `DpuKvRestore` of the backup taken after the last write — every
    // acknowledged write is there again.
    // (Emulator: the nodes advertise DPUs since the device plugin came up, which this scenario's
    // kubelet cannot hand to a pod.)
    let mut again = resource;
    again["spec"]["device"] = json!({"mode": "Emulator"});
    api.create("dpukvclusters", NS, again).expect("create the DpuKvCluster again");
    scene.wait_running(3);
    let restore = json!({"apiVersion": "dpukv.io/v1alpha1", "kind": "DpuKvRestore", "metadata": {"name": "back"},
                         "spec": {"cluster": "demo", "from": location, "backup": backup_id}});
    api.create("dpukvrestores", NS, restore).expect("create the DpuKvRestore");
    let st = scene.wait("the restore done", Duration::from_secs(120), || {
        let st = api.get("dpukvrestores", NS, "back")?["status"].clone();
        assert_ne!(st["phase"], "Failed", "{st:#}");
        (st["phase"] == "Done").then_some(st)
    });
    assert_eq!(st["backup"], backup_id.as_str(), "{st:#}");
    rt.block_on(async {
        let c = Client::connect(&scene.gateway(), 2).await.expect("connect to the gateway");
        for (k, v) in &acked {
            let got = c.get(k.as_bytes()).await.unwrap_or_else(|e| panic!("reading {k} after the restore: {e}"));
            assert_eq!(got.as_deref(), Some(v.as_bytes()), "{k} was acknowledged before the backup");
        }
    });
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64
}
