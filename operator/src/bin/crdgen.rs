//! `crdgen`: writes the CRDs (YAML) — `DpuKvCluster`, `DpuKvOperation`, `DpuKvBackup`,
//! `DpuKvBackupSchedule` and `DpuKvRestore` — to standard output,
//! or into the repository's `manifests/crds/` when given the repository's root (`crdgen .`);
//! `crdgen --rbac DIR` writes the operator's RBAC rule lists the chart includes
//! (`DIR/operator-clusterrole-rules.yaml`, `DIR/operator-role-rules.yaml`; `crdgen --rbac
//! charts/dpukv/files`).

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
    let crds = dpukv_operator::manifest::crds().context("serializing the CRDs")?;
    match args.first() {
        Some(root) => {
            for (path, yaml) in crds {
                let path = std::path::Path::new(root).join(path);
                std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
            }
        }
        None => {
            for (_, yaml) in crds {
                print!("---\n{yaml}");
            }
        }
    }
    Ok(())
}
