//! `dpukv-dpu`: the device half of a node pod (DPU or emulator sidecar).

use clap::Parser;
use dpukv_node::config::{DeviceArgs, shutdown_on_signals, telemetry};

/// Scans and frames allocate many small buffers across threads: mimalloc's per-thread heaps
/// serve them far cheaper than glibc's allocator (measured in docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = telemetry::init("dpukv-dpu");
    let cfg = DeviceArgs::parse().config()?;
    let out = dpukv_node::dpu::run(cfg, shutdown_on_signals(), None).await;
    telemetry.shutdown();
    out
}
