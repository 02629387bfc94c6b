//! `dpukv-operator`: runs the `DpuKvCluster` controller against the cluster it finds (in-cluster
//! service account, or `KUBECONFIG`). Thin: the logic is in the library (docs/kubernetes.md).

use std::net::SocketAddr;

use anyhow::{Context, Result};
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// The dpukv operator.
#[derive(Debug, Parser)]
#[command(name = "dpukv-operator", version)]
struct Args {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    #[arg(long, env = "DPUKV_OPERATOR_HTTP", default_value = "0.0.0.0:8080")]
    http: SocketAddr,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let client = kube::Client::try_default().await.context("connecting to Kubernetes")?;
    let stop = CancellationToken::new();
    let m = dpukv_operator::run::Metrics::new();
    let listener = dpukv_operator::run::bind(args.http).await.with_context(|| format!("binding {}", args.http))?;
    tokio::spawn(dpukv_operator::run::serve_http(listener, m.clone(), stop.clone()));
    let s = stop.clone();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        s.cancel();
    });
    tracing::info!("dpukv-operator running");
    dpukv_operator::run::run(client, m, stop).await;
    Ok(())
}
