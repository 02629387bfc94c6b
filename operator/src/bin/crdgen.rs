//! `crdgen`: writes the `DpuKvCluster` CRD (YAML) to standard output, or to the path given
//! (`crdgen manifests/crds/dpukv.io_dpukvclusters.yaml`).

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let yaml = dpukv_operator::manifest::crd_yaml().context("serializing the CRD")?;
    match std::env::args().nth(1) {
        Some(path) => std::fs::write(&path, yaml).with_context(|| format!("writing {path}"))?,
        None => print!("{yaml}"),
    }
    Ok(())
}
