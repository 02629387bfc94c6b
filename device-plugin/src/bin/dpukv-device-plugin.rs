//! `dpukv-device-plugin`: advertises DPUs (or emulated devices) to the kubelet as a resource.
//! Flags in `--help`; docs/device-plugin.md.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use dpukv_device_plugin::sysfs::{BLUEFIELD, PciId, Source};
use dpukv_device_plugin::{kubelet, metrics, runner};

/// The kubelet device plugin for dpukv's DPUs.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The resource name offered.
    #[arg(long, env = "DPUKV_RESOURCE", default_value = "dpukv.io/dpu")]
    resource: String,
    /// The kubelet's device plugin directory.
    #[arg(long, default_value = kubelet::DEVICE_PLUGIN_DIR)]
    plugin_dir: PathBuf,
    /// Our socket's file name in that directory.
    #[arg(long, default_value = "dpukv-dpu.sock")]
    socket: String,
    /// The sysfs root to scan for PCI functions.
    #[arg(long, default_value = "/sys")]
    sysfs: PathBuf,
    /// PCI vendor:device ids to offer (repeatable; default: BlueField, BlueField-2, BlueField-3).
    #[arg(long = "pci-id")]
    pci_ids: Vec<PciId>,
    /// Offer this many emulated devices instead of scanning PCI.
    #[arg(long)]
    emulated: Option<usize>,
    /// Seconds between device scans (health).
    #[arg(long, default_value_t = 5)]
    health_interval: u64,
    /// Where `/metrics` and `/healthz` are served.
    #[arg(long, default_value = "0.0.0.0:9465")]
    metrics: SocketAddr,
}

#[tokio::main]
async fn main() -> Result<()> {
    let _telemetry = dpukv_net::telemetry::init("dpukv-device-plugin");
    let args = Args::parse();
    let source = match args.emulated {
        Some(n) => Source::Emulated(n),
        None => Source::Pci {
            root: args.sysfs,
            ids: if args.pci_ids.is_empty() { BLUEFIELD.to_vec() } else { args.pci_ids },
        },
    };
    let stop = dpukv_net::process::shutdown_on_signals();
    let m = metrics::Metrics::new();
    let listener = metrics::bind(args.metrics).await.with_context(|| format!("binding {}", args.metrics))?;
    tokio::spawn(metrics::serve(listener, m.clone(), stop.clone()));
    let cfg = runner::Config {
        dir: args.plugin_dir,
        resource: args.resource,
        socket: args.socket,
        source,
        health_interval: Duration::from_secs(args.health_interval.max(1)),
        watch_interval: Duration::from_millis(500),
    };
    runner::run(cfg, m, stop).await.context("device plugin")?;
    tracing::info!("stopped");
    Ok(())
}
