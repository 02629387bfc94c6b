//! `dpukv-render FILE [--dpu]`: prints, as a YAML stream, the objects the operator makes of the
//! `DpuKvCluster` in FILE (docs/kubernetes.md "What the operator creates") — for review, and for
//! checking them against Kubernetes' schemas (`scripts/check-manifests.py` pipes them to
//! `kubernetes-validate`). `--dpu`: as if some node advertised the device resource (`Auto`). The
//! NetworkPolicies are rendered for an operator where the chart puts it by default.

use anyhow::{Context, Result, bail};
use dpukv_operator::crd::DpuKvCluster;
use dpukv_operator::render;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else { bail!("usage: dpukv-render FILE [--dpu]") };
    let dpu = args.next().as_deref() == Some("--dpu");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let mut c: DpuKvCluster = serde_saphyr::from_str(&text).with_context(|| format!("{path}: not a DpuKvCluster"))?;
    if c.metadata.namespace.is_none() {
        c.metadata.namespace = Some("default".into());
    }
    // An owner reference needs the resource's uid, which the apiserver assigns.
    c.metadata.uid.get_or_insert_with(|| "00000000-0000-0000-0000-000000000000".into());
    let mut docs = Vec::new();
    if let (Some(svc), Some(etcd)) = (render::etcd_service(&c), render::etcd_statefulset(&c)) {
        docs.extend([serde_json::to_value(svc)?, serde_json::to_value(etcd)?]);
    }
    docs.extend([
        serde_json::to_value(render::node_config_map(&c))?,
        serde_json::to_value(render::node_statefulset(&c, dpu))?,
        serde_json::to_value(render::node_service(&c))?,
        serde_json::to_value(render::gateway_deployment(&c))?,
        serde_json::to_value(render::gateway_service(&c))?,
        serde_json::to_value(render::node_pdb(&c))?,
    ]);
    for p in render::network_policies(&c, &render::OperatorPods::default()) {
        docs.push(serde_json::to_value(p)?);
    }
    // cert-manager's Certificates (`tls.certManager`); the operator's own certificates are
    // issued at run time into Secrets, never printed.
    for cert in dpukv_operator::tls::certificates(&c, c.spec.nodes.max(0) as u32) {
        let mut v = serde_json::to_value(&cert)?;
        v["apiVersion"] = "cert-manager.io/v1".into();
        v["kind"] = "Certificate".into();
        docs.push(v);
    }
    for d in docs {
        print!("---\n{}", serde_saphyr::to_string(&d)?);
    }
    Ok(())
}
