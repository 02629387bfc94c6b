//! `dpukv-dpu`: the device half of a node pod (DPU or emulator sidecar).

use clap::Parser;
use dpukv_node::config::{DeviceArgs, init_tracing, shutdown_on_signals};

/// Scans and frames allocate many small buffers across threads: mimalloc's per-thread heaps
/// serve them far cheaper than glibc's allocator (measured in docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let cfg = DeviceArgs::parse().config()?;
    dpukv_node::dpu::run(cfg, shutdown_on_signals(), None).await
}
