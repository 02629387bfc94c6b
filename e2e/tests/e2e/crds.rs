//! The committed CRDs (`manifests/crds/`, what users install; the operator's tests prove them
//! the ones its types generate), applied as the API server applies them (`crd_schema`: pruning,
//! defaults, types, the CEL rules — transition rules only on updates — with the Kubernetes
//! quantity library, by an embedded CEL interpreter): every example in `manifests/examples/`
//! passes, and each rule refuses what it is written for.

use std::path::PathBuf;

use dpukv_e2e::crd_schema::{CrdSchema, RuleAt};
use serde_json::{Value, json};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The schema of the committed CRD `file`.
fn committed(file: &str) -> CrdSchema {
    let text = std::fs::read_to_string(repo().join("manifests/crds").join(file)).expect("the committed CRD");
    let crd: Value = serde_saphyr::from_str(&text).expect("yaml");
    CrdSchema::from_crd(&crd).expect("the double holds the CRD")
}

fn schema() -> CrdSchema {
    committed("dpukv.io_dpukvclusters.yaml")
}

/// The `DpuKvOperation` CRD's rules: a pod of the cluster it names, and a spec that never
/// changes.
#[test]
fn an_operation_names_a_node_pod_of_its_cluster_and_never_changes() {
    let schema = committed("dpukv.io_dpukvoperations.yaml");
    let op = |cluster: &str, action: &str, pod: &str| {
        json!({"apiVersion": "dpukv.io/v1alpha1", "kind": "DpuKvOperation", "metadata": {"name": "op"},
               "spec": {"cluster": cluster, "action": action, "pod": pod}})
    };
    let broken = |o: &Value, old: Option<&Value>| -> Vec<String> {
        let mut o = o.clone();
        schema.admit(&mut o, old).err().unwrap_or_default().iter().map(ToString::to_string).collect()
    };
    assert_eq!(broken(&op("demo", "Drain", "demo-node-2"), None), Vec::<String>::new());
    let example = repo().join("manifests/examples/operations/drain-a-node.yaml");
    let example: Value = serde_saphyr::from_str(&std::fs::read_to_string(example).expect("the example")).expect("yaml");
    assert_eq!(broken(&example, None), Vec::<String>::new(), "the example");
    assert_eq!(broken(&op("demo", "StepDown", "demo-node-0"), None), Vec::<String>::new());
    for bad in ["demo-node-", "other-node-1", "demo-node-01", "demo-node-2x", "demo-gateway-0"] {
        let b = broken(&op("demo", "Drain", bad), None);
        assert!(b.iter().any(|m| m.contains("pod must be a node pod of the cluster")), "{bad}: {b:?}");
    }
    let b = broken(&op("demo", "Reboot", "demo-node-1"), None);
    assert!(b.iter().any(|m| m.contains("spec.action: Unsupported value: \"Reboot\"")), "{b:?}");
    let b = broken(&op("demo", "Drain", "demo-node-1"), Some(&op("demo", "Drain", "demo-node-2")));
    assert!(b.iter().any(|m| m.contains("an operation cannot change")), "{b:?}");
}

/// The backup CRDs' rules, as the API server applies them: their examples pass; a location
/// is `file:///` or `s3://`; a schedule has a cron expression or an interval, not both; a
/// restore names a backup or a time, not both, and never changes; a backup never changes.
#[test]
fn the_backup_resources_are_checked_as_written() {
    let broken = |file: &str, o: &Value, old: Option<&Value>| -> Vec<String> {
        let schema = committed(file);
        let mut o = o.clone();
        schema.admit(&mut o, old).err().unwrap_or_default().iter().map(ToString::to_string).collect()
    };
    for (example, file) in [
        ("backup-now.yaml", "dpukv.io_dpukvbackups.yaml"),
        ("nightly.yaml", "dpukv.io_dpukvbackupschedules.yaml"),
        ("restore.yaml", "dpukv.io_dpukvrestores.yaml"),
    ] {
        let path = repo().join("manifests/examples/backups").join(example);
        let v: Value = serde_saphyr::from_str(&std::fs::read_to_string(path).expect("example")).expect("yaml");
        assert_eq!(broken(file, &v, None), Vec::<String>::new(), "{example}");
    }
    let obj = |kind: &str, spec: Value| json!({"apiVersion": "dpukv.io/v1alpha1", "kind": kind, "metadata": {"name": "x"}, "spec": spec});
    let backup = |to: &str| obj("DpuKvBackup", json!({"cluster": "demo", "to": to}));
    let b = broken("dpukv.io_dpukvbackups.yaml", &backup("ftp://x"), None);
    assert!(b.iter().any(|m| m.contains("to is file:///dir or s3://bucket/prefix")), "{b:?}");
    let b = broken("dpukv.io_dpukvbackups.yaml", &backup("s3://a/b"), Some(&backup("s3://a/c")));
    assert!(b.iter().any(|m| m.contains("a backup cannot change")), "{b:?}");
    let schedule = |spec: Value| obj("DpuKvBackupSchedule", spec);
    let file = "dpukv.io_dpukvbackupschedules.yaml";
    assert_eq!(
        broken(file, &schedule(json!({"cluster": "demo", "to": "s3://a", "everySeconds": 10})), None),
        Vec::<String>::new()
    );
    for bad in [
        json!({"cluster": "demo", "to": "s3://a"}),
        json!({"cluster": "demo", "to": "s3://a", "everySeconds": 10, "schedule": "* * * * *"}),
    ] {
        let b = broken(file, &schedule(bad.clone()), None);
        assert!(b.iter().any(|m| m.contains("give schedule (cron) or everySeconds, not both")), "{bad}: {b:?}");
    }
    let b = broken(file, &schedule(json!({"cluster": "demo", "to": "s3://a", "everySeconds": 0})), None);
    assert!(b.iter().any(|m| m.contains("everySeconds is at least 1")), "{b:?}");
    let restore = |spec: Value| obj("DpuKvRestore", spec);
    let file = "dpukv.io_dpukvrestores.yaml";
    let both = restore(json!({"cluster": "demo", "from": "s3://a", "backup": "x", "at": "2026-11-26T10:00:00Z"}));
    let b = broken(file, &both, None);
    assert!(b.iter().any(|m| m.contains("give backup or at, not both")), "{b:?}");
    let one = restore(json!({"cluster": "demo", "from": "s3://a", "backup": "x"}));
    let other = restore(json!({"cluster": "demo", "from": "s3://a", "backup": "y"}));
    assert_eq!(broken(file, &one, None), Vec::<String>::new());
    let b = broken(file, &one, Some(&other));
    assert!(b.iter().any(|m| m.contains("a restore cannot change")), "{b:?}");
    let b = broken(file, &restore(json!({"cluster": "demo", "from": "s3://a", "backup": "../x"})), None);
    assert!(b.iter().any(|m| m.contains("backup is a backup id")), "{b:?}");
}

fn rules() -> Vec<RuleAt> {
    schema().rules()
}

/// What the API server refuses in `obj` (an update of `old` when given): its field errors.
fn broken(obj: &Value, old: Option<&Value>) -> Vec<String> {
    let schema = schema();
    let mut obj = obj.clone();
    let old = old.map(|o| {
        let mut o = o.clone();
        schema.prune(&mut o);
        schema.fill_defaults(&mut o);
        o
    });
    schema.admit(&mut obj, old.as_ref()).err().unwrap_or_default().iter().map(ToString::to_string).collect()
}

fn examples() -> Vec<(String, Value)> {
    let dir = repo().join("manifests/examples");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).expect("examples") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "yaml") {
            let text = std::fs::read_to_string(&p).expect("read");
            let v: Value = serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            if v["kind"] == "DpuKvCluster" {
                out.push((p.display().to_string(), v));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn the_crd_has_every_rule_and_they_compile() {
    let rules = rules();
    let messages: Vec<&str> = rules.iter().map(|r| r.message.as_str()).collect();
    for m in [
        "replicationFactor must not exceed nodes",
        "regions cannot change once set (the master splits and merges them)",
        "storageClassName is immutable",
        "size must be a positive quantity",
        "give etcd.endpoints or etcd.managed, not both",
        "storage.size cannot shrink (volumes only grow)",
        "etcd.managed.storage cannot shrink (volumes only grow)",
    ] {
        assert!(messages.contains(&m), "missing rule {m:?} in {messages:?}");
    }
}

#[test]
fn every_example_passes_the_rules() {
    let examples = examples();
    assert!(examples.len() >= 4, "{examples:?}");
    for (name, v) in examples {
        assert_eq!(broken(&v, None), Vec::<String>::new(), "{name}");
        // An update that changes nothing passes the transition rules too.
        assert_eq!(broken(&v, Some(&v)), Vec::<String>::new(), "{name} (unchanged update)");
    }
}

fn base() -> Value {
    json!({
        "apiVersion": "dpukv.io/v1alpha1", "kind": "DpuKvCluster", "metadata": {"name": "t"},
        "spec": {"nodes": 3, "storage": {"size": "10Gi", "storageClassName": "fast"},
                 "etcd": {"endpoints": ["http://etcd:2379"]}, "regions": {"count": 8}}
    })
}

fn with(patch: impl FnOnce(&mut Value)) -> Value {
    let mut v = base();
    patch(&mut v);
    v
}

fn refused(v: &Value, old: Option<&Value>, message: &str) {
    let b = broken(v, old);
    assert!(b.iter().any(|m| m.contains(message)), "expected {message:?}, broken: {b:?}\n{v}");
}

#[test]
fn rules_refuse_what_they_are_written_for() {
    assert_eq!(broken(&base(), None), Vec::<String>::new());
    refused(&with(|v| v["spec"]["nodes"] = json!(2)), None, "replicationFactor must not exceed nodes");
    assert_eq!(
        broken(
            &with(|v| {
                v["spec"]["nodes"] = json!(1);
                v["spec"]["replicationFactor"] = json!(1);
            }),
            None
        ),
        Vec::<String>::new()
    );
    for bad in ["0", "0Gi", "-1Gi", "ten", "10GB", ""] {
        refused(&with(|v| v["spec"]["storage"]["size"] = json!(bad)), None, "size must be a positive quantity");
    }
    for good in ["1", "10Gi", "1.5Ti", "0.5Gi", "500M"] {
        assert_eq!(broken(&with(|v| v["spec"]["storage"]["size"] = json!(good)), None), Vec::<String>::new(), "{good}");
    }
    refused(&with(|v| v["spec"]["sharedMemory"] = json!({"size": "0"})), None, "size must be a positive quantity");
    refused(
        &with(|v| v["spec"]["etcd"]["managed"] = json!({"replicas": 3})),
        None,
        "give etcd.endpoints or etcd.managed, not both",
    );
    refused(&with(|v| v["spec"]["etcd"] = json!({})), None, "give etcd.endpoints or etcd.managed, not both");
    refused(&with(|v| v["spec"]["etcd"] = json!({"managed": {"replicas": 2}})), None, "etcd members are 1, 3 or 5");
    refused(
        &with(|v| v["spec"]["etcd"] = json!({"managed": {"replicas": 3}, "clientSecret": "mine"})),
        None,
        "etcd.clientSecret goes with etcd.endpoints",
    );
    let external = with(|v| v["spec"]["etcd"] = json!({"endpoints": ["https://etcd:2379"], "clientSecret": "mine"}));
    assert_eq!(broken(&external, None), Vec::<String>::new(), "an external etcd with its client Secret");
    refused(&with(|v| v["spec"]["regions"] = json!({"count": 4, "splitKeys": ["m"]})), None, "give regions.count");
    refused(&with(|v| v["spec"]["fsync"] = json!("sometimes")), None, "fsync is always, never or interval:MS");
    refused(&with(|v| v["spec"]["version"] = json!("1.0 beta")), None, "version must be an image tag");
    refused(&with(|v| v["spec"]["gateway"] = json!({"ports": {"binary": 6379}})), None, "gateway ports must differ");
    let front = with(|v| v["spec"]["frontDoor"] = json!({"enabled": true}));
    assert_eq!(broken(&front, None), Vec::<String>::new(), "a front door on its default ports");
    refused(
        &with(|v| v["spec"]["frontDoor"] = json!({"enabled": true, "http": 6379})),
        None,
        "frontDoor ports must differ",
    );
    refused(
        &with(|v| v["spec"]["frontDoor"] = json!({"enabled": true, "resp": 7070})),
        None,
        "frontDoor ports must not be a node pod's own",
    );
    let fabric = with(|v| {
        v["spec"]["fabric"] = json!({"enabled": true, "provider": "verbs", "rdmaResource": "rdma/hca_shared_devices_a"})
    });
    assert_eq!(broken(&fabric, None), Vec::<String>::new(), "a fabric endpoint on its default port");
    refused(
        &with(|v| v["spec"]["fabric"] = json!({"enabled": true, "port": 7071})),
        None,
        "fabric.port must not be a node pod's own",
    );
    refused(
        &with(|v| v["spec"]["fabric"] = json!({"enabled": true, "provider": "verbs; rm -rf /"})),
        None,
        "fabric.provider must be a libfabric provider name",
    );
    refused(
        &with(|v| v["spec"]["fabric"] = json!({"enabled": true, "rdmaResource": "rdma/hca shared"})),
        None,
        "fabric.rdmaResource must be a resource name",
    );
    let console = with(|v| {
        v["spec"]["gateway"] = json!({"console": {"controlTokenSecret": "ctl"}});
        v["spec"]["auth"] = json!({"tokensSecret": "tok"});
    });
    assert_eq!(broken(&console, None), Vec::<String>::new(), "the console's control token with TLS and tokens");
    refused(
        &with(|v| {
            v["spec"]["gateway"] = json!({"console": {"controlTokenSecret": "ctl"}});
            v["spec"]["auth"] = json!({"tokensSecret": "tok"});
            v["spec"]["tls"] = json!({"mode": "Disabled"});
        }),
        None,
        "gateway.console.controlTokenSecret needs TLS",
    );
    refused(
        &with(|v| v["spec"]["gateway"] = json!({"console": {"controlTokenSecret": "ctl"}})),
        None,
        "gateway.console.controlTokenSecret needs auth",
    );
}

#[test]
fn transition_rules_keep_the_storage_class_and_the_regions() {
    let old = base();
    let scaled = with(|v| v["spec"]["nodes"] = json!(5));
    assert_eq!(broken(&scaled, Some(&old)), Vec::<String>::new(), "scaling is an allowed change");
    refused(
        &with(|v| v["spec"]["storage"]["storageClassName"] = json!("slow")),
        Some(&old),
        "storageClassName is immutable",
    );
    refused(
        &with(|v| {
            v["spec"]["storage"].as_object_mut().expect("object").remove("storageClassName");
        }),
        Some(&old),
        "storageClassName is immutable",
    );
    refused(&with(|v| v["spec"]["regions"] = json!({"count": 16})), Some(&old), "regions cannot change once set");
    let unset = with(|v| {
        v["spec"].as_object_mut().expect("object").remove("regions");
    });
    assert_eq!(broken(&base(), Some(&unset)), Vec::<String>::new(), "regions may be set once");
    let managed = with(|v| v["spec"]["etcd"] = json!({"managed": {"replicas": 3}}));
    let grown = with(|v| v["spec"]["etcd"] = json!({"managed": {"replicas": 5}}));
    const ETCD_FIXED: &str = "a managed etcd's members cannot change";
    refused(&grown, Some(&managed), ETCD_FIXED);
    refused(&managed, Some(&old), ETCD_FIXED);
    let bigger = with(|v| v["spec"]["etcd"] = json!({"managed": {"replicas": 3, "storage": "8Gi"}}));
    assert_eq!(broken(&bigger, Some(&managed)), Vec::<String>::new(), "other etcd settings may change");
    refused(&managed, Some(&bigger), "etcd.managed.storage cannot shrink");
    // Volumes only grow: the claims' size may rise, never fall (whatever the unit).
    let grown = with(|v| v["spec"]["storage"]["size"] = json!("10241Mi"));
    assert_eq!(broken(&grown, Some(&old)), Vec::<String>::new(), "a growth");
    refused(&old, Some(&grown), "storage.size cannot shrink");
    refused(&with(|v| v["spec"]["storage"]["size"] = json!("10G")), Some(&old), "storage.size cannot shrink");
    // On creation the transition rules do not apply.
    assert_eq!(broken(&with(|v| v["spec"]["regions"] = json!({"count": 16})), None), Vec::<String>::new());
}
