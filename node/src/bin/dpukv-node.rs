//! `dpukv-node`: the host half of a node pod.

use clap::Parser;
use dpukv_node::config::{HostArgs, shutdown_on_signals, telemetry};

/// Scans and frames allocate many small buffers across threads: mimalloc's per-thread heaps
/// serve them far cheaper than glibc's allocator (measured in docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = telemetry::init("dpukv-node");
    let cfg = HostArgs::parse().config()?;
    let out = dpukv_node::host::run(cfg, shutdown_on_signals(), None).await;
    telemetry.shutdown();
    out
}
