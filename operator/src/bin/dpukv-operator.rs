//! `dpukv-operator`: runs the `DpuKvCluster` controller against the cluster it finds (in-cluster
//! service account, or `KUBECONFIG`). Thin: the logic is in the library (docs/kubernetes.md).

use std::net::SocketAddr;

use anyhow::{Context, Result};
use clap::Parser;

/// The dpukv operator.
#[derive(Debug, Parser)]
#[command(name = "dpukv-operator", version)]
struct Args {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    #[arg(long, env = "DPUKV_OPERATOR_HTTP", default_value = "0.0.0.0:8080")]
    http: SocketAddr,
    /// Reconcile only while holding the Lease (so several replicas can run).
    #[arg(long, env = "DPUKV_OPERATOR_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// The Lease's name.
    #[arg(long, default_value = "dpukv-operator")]
    lease_name: String,
    /// The Lease's namespace (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Labels that select the operator's pods in its namespace (`k=v,k=v`): the clusters'
    /// NetworkPolicies let these pods, and no others, reach the nodes' control port.
    #[arg(
        long,
        env = "DPUKV_OPERATOR_POD_LABELS",
        default_value = "app.kubernetes.io/name=dpukv,app.kubernetes.io/component=operator"
    )]
    pod_labels: String,
}

#[tokio::main]
async fn main() -> Result<()> {
    let _telemetry = dpukv_net::telemetry::init("dpukv-operator");
    let args = Args::parse();
    let client = kube::Client::try_default().await.context("connecting to Kubernetes")?;
    let stop = dpukv_net::process::shutdown_on_signals();
    let m = dpukv_operator::run::Metrics::new();
    let listener = dpukv_operator::run::bind(args.http).await.with_context(|| format!("binding {}", args.http))?;
    tokio::spawn(dpukv_operator::run::serve_http(listener, m.clone(), stop.clone()));
    // Ready from now on, leading or not (a follower is a healthy replica).
    m.running.store(true, std::sync::atomic::Ordering::Release);
    let mut until = stop.clone();
    if args.leader_election {
        let identity = args.identity.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| format!("pid-{}", std::process::id()))
        });
        let cfg = dpukv_operator::lease::LeaseConfig {
            name: args.lease_name.clone(),
            identity,
            duration: std::time::Duration::from_secs(15),
            renew_every: std::time::Duration::from_secs(5),
        };
        let api = kube::Api::namespaced(client.clone(), &args.namespace);
        tracing::info!(lease = %cfg.name, namespace = %args.namespace, "waiting to lead");
        let Some(leadership) = dpukv_operator::lease::lead(api, cfg, stop.clone()).await else { return Ok(()) };
        until = leadership.lost;
    }
    tracing::info!("dpukv-operator running");
    let mut labels = std::collections::BTreeMap::new();
    for kv in args.pod_labels.split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').with_context(|| format!("--pod-labels: {kv:?} is not k=v"))?;
        labels.insert(k.trim().to_string(), v.trim().to_string());
    }
    let pods = dpukv_operator::render::OperatorPods { namespace: args.namespace.clone(), labels };
    let work = dpukv_operator::run::run_as(client, m.clone(), until.clone(), pods);
    if !dpukv_operator::run::unless_lost(work, until.clone(), stop.clone()).await {
        m.leader.set(0);
    }
    if !stop.is_cancelled() {
        // Leadership lost: exit, to start again as a follower.
        anyhow::bail!("leadership lost");
    }
    Ok(())
}
