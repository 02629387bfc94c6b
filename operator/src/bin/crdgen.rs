//! `crdgen`: writes the `DpuKvCluster` CRD (YAML) to standard output, or to the path given
//! (`crdgen manifests/crds/dpukv.io_dpukvclusters.yaml`); `crdgen --rbac DIR` writes the
//! operator's RBAC rule lists the chart includes (`DIR/operator-clusterrole-rules.yaml`,
//! `DIR/operator-role-rules.yaml`; `crdgen --rbac charts/dpukv/files`).

use anyhow::{Context, Result};
use dpukv_operator::rbac;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--rbac") {
        let dir = std::path::PathBuf::from(args.get(1).context("usage: crdgen --rbac DIR")?);
        for (file, rules) in [
            ("operator-clusterrole-rules.yaml", rbac::CLUSTER_RULES),
            ("operator-role-rules.yaml", rbac::NAMESPACE_RULES),
        ] {
            let path = dir.join(file);
            std::fs::write(&path, rbac::rules_yaml(rules)).with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    let yaml = dpukv_operator::manifest::crd_yaml().context("serializing the CRD")?;
    match args.first() {
        Some(path) => std::fs::write(path, yaml).with_context(|| format!("writing {path}"))?,
        None => print!("{yaml}"),
    }
    Ok(())
}
