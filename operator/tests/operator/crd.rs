//! The generated CRD: it is what `manifests/crds/` holds; its CEL rules, taken from the generated
//! schema and run by an embedded CEL interpreter (the `cel` crate) as the apiserver would — on
//! the object after defaulting, only where the value is present, transition rules only on
//! updates — accept every example in `manifests/examples/` and refuse what each rule is written
//! for.

use std::path::PathBuf;

use dpukv_operator::crd::DpuKvCluster;
use dpukv_operator::manifest::{CRD_PATH, crd_yaml};
use kube::CustomResourceExt;
use serde_json::{Value, json};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_committed_crd_is_what_the_types_generate() {
    let committed = std::fs::read_to_string(repo().join(CRD_PATH)).expect("the committed CRD");
    let generated = crd_yaml().expect("yaml");
    assert!(committed == generated, "{CRD_PATH} is stale: run `cargo run -p dpukv-operator --bin crdgen {CRD_PATH}`");
}

/// A rule of the schema, and where in the object it applies.
#[derive(Debug)]
struct Rule {
    path: Vec<String>,
    rule: String,
    message: String,
}

fn collect(schema: &Value, path: Vec<String>, out: &mut Vec<Rule>) {
    for v in schema.get("x-kubernetes-validations").and_then(Value::as_array).into_iter().flatten() {
        out.push(Rule {
            path: path.clone(),
            rule: v["rule"].as_str().expect("a rule").to_string(),
            message: v["message"].as_str().unwrap_or_default().to_string(),
        });
    }
    for (name, sub) in schema.get("properties").and_then(Value::as_object).into_iter().flatten() {
        let mut p = path.clone();
        p.push(name.clone());
        collect(sub, p, out);
    }
}

fn rules() -> Vec<Rule> {
    let crd = serde_json::to_value(DpuKvCluster::crd()).expect("json");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut out = Vec::new();
    collect(schema, Vec::new(), &mut out);
    out
}

fn at<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(k)).filter(|v| !v.is_null())
}

/// The object as the apiserver validates it: with its defaults filled in (the schema's defaults
/// are the types' serde defaults).
fn defaulted(raw: &Value) -> Value {
    let typed: DpuKvCluster = serde_json::from_value(raw.clone()).expect("the object fits the types");
    serde_json::to_value(typed).expect("json")
}

/// The messages of the rules `obj` breaks (an update when `old` is given).
fn broken(obj: &Value, old: Option<&Value>) -> Vec<String> {
    let obj = defaulted(obj);
    let old = old.map(defaulted);
    let mut out = Vec::new();
    for r in rules() {
        let Some(this) = at(&obj, &r.path) else { continue };
        let transition = r.rule.contains("oldSelf");
        let mut ctx = cel::Context::default();
        ctx.add_variable_from_value("self", cel::to_value(this).expect("cel value"));
        if transition {
            let Some(prev) = old.as_ref().and_then(|o| at(o, &r.path)) else { continue };
            ctx.add_variable_from_value("oldSelf", cel::to_value(prev).expect("cel value"));
        }
        let program =
            cel::Program::compile(&r.rule).unwrap_or_else(|e| panic!("rule {:?} does not compile: {e}", r.rule));
        match program.execute(&ctx) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(other) => out.push(format!("{} (got {other:?})", r.message)),
            Err(e) => out.push(format!("{} (error {e})", r.message)),
        }
    }
    out
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
    for r in &rules {
        cel::Program::compile(&r.rule).unwrap_or_else(|e| panic!("{:?}: {e}", r.rule));
    }
    let messages: Vec<&str> = rules.iter().map(|r| r.message.as_str()).collect();
    for m in [
        "replicationFactor must not exceed nodes",
        "regions cannot change once set (the master splits and merges them)",
        "storageClassName is immutable",
        "size must be a positive quantity",
        "give etcd.endpoints or etcd.managed, not both",
    ] {
        assert!(messages.contains(&m), "missing rule {m:?} in {messages:?}");
    }
    let crd = serde_json::to_value(DpuKvCluster::crd()).expect("json");
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["subresources"]["scale"]["specReplicasPath"], ".spec.nodes");
    let columns: Vec<&str> =
        v["additionalPrinterColumns"].as_array().expect("columns").iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(columns, ["Nodes", "Ready", "Regions", "Master", "Phase", "Age"]);
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
    assert!(b.iter().any(|m| m.starts_with(message)), "expected {message:?}, broken: {b:?}\n{v}");
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
    // On creation the transition rules do not apply.
    assert_eq!(broken(&with(|v| v["spec"]["regions"] = json!({"count": 16})), None), Vec::<String>::new());
}
