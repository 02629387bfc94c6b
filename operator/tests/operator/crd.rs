//! The generated CRDs: they are what `manifests/crds/` holds (the chart and `install.yaml` copy
//! them); the scale subresource and printer columns are as documented; every example fits the
//! types the operator reads. (Their schemas and CEL rules are tested as the API server applies
//! them in `e2e/tests/e2e/crds.rs`, on the committed files.)

use std::path::PathBuf;

use dpukv_operator::backups::{DpuKvBackup, DpuKvBackupSchedule, DpuKvRestore};
use dpukv_operator::crd::DpuKvCluster;
use dpukv_operator::manifest::crds;
use dpukv_operator::operation::DpuKvOperation;
use kube::CustomResourceExt;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_committed_crds_are_what_the_types_generate() {
    let crds = crds().expect("yaml");
    assert_eq!(crds.len(), 5);
    for (path, generated) in crds {
        let committed = std::fs::read_to_string(repo().join(path)).expect("the committed CRD");
        assert!(committed == generated, "{path} is stale: run `cargo run -p dpukv-operator --bin crdgen .`");
    }
}

#[test]
fn the_crds_have_their_subresources_and_printer_columns() {
    let columns = |crd: &Value| -> Vec<String> {
        crd["spec"]["versions"][0]["additionalPrinterColumns"]
            .as_array()
            .expect("columns")
            .iter()
            .filter_map(|c| c["name"].as_str().map(String::from))
            .collect()
    };
    let crd = serde_json::to_value(DpuKvCluster::crd()).expect("json");
    assert_eq!(crd["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"], ".spec.nodes");
    assert_eq!(columns(&crd), ["Nodes", "Ready", "Regions", "Master", "Phase", "Age"]);
    let crd = serde_json::to_value(DpuKvOperation::crd()).expect("json");
    assert!(crd["spec"]["versions"][0]["subresources"]["status"].is_object());
    assert_eq!(columns(&crd), ["Cluster", "Action", "Pod", "Phase", "Age"]);
    for (crd, want) in [
        (serde_json::to_value(DpuKvBackup::crd()).expect("json"), vec!["Cluster", "Backup", "Phase", "Age"]),
        (
            serde_json::to_value(DpuKvBackupSchedule::crd()).expect("json"),
            vec!["Cluster", "Schedule", "Every", "Last backup", "Phase"],
        ),
        (serde_json::to_value(DpuKvRestore::crd()).expect("json"), vec!["Cluster", "Backup", "Phase", "Age"]),
    ] {
        assert!(crd["spec"]["versions"][0]["subresources"]["status"].is_object());
        assert_eq!(columns(&crd), want);
    }
}

/// Every example, read as the operator reads it (into its types).
#[test]
fn every_example_fits_the_types() {
    let mut seen = 0;
    for dir in ["manifests/examples", "manifests/examples/operations", "manifests/examples/backups"] {
        for e in std::fs::read_dir(repo().join(dir)).expect("examples") {
            let p = e.expect("entry").path();
            if p.extension().is_none_or(|x| x != "yaml") {
                continue;
            }
            let v: Value = serde_saphyr::from_str(&std::fs::read_to_string(&p).expect("read")).expect("yaml");
            match v["kind"].as_str() {
                Some("DpuKvCluster") => {
                    let _: DpuKvCluster = serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                }
                Some("DpuKvOperation") => {
                    let _: DpuKvOperation =
                        serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                }
                Some("DpuKvBackup") => {
                    let _: DpuKvBackup = serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                }
                Some("DpuKvBackupSchedule") => {
                    let _: DpuKvBackupSchedule =
                        serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                }
                Some("DpuKvRestore") => {
                    let _: DpuKvRestore = serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                }
                _ => continue,
            }
            seen += 1;
        }
    }
    assert!(seen >= 9, "{seen} examples");
}
