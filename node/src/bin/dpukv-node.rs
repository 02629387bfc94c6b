//! `dpukv-node`: the host half of a node pod.

use clap::Parser;
use dpukv_node::config::{HostArgs, init_tracing, shutdown_on_signals};

/// Scans and frames allocate many small buffers across threads: mimalloc's per-thread heaps
/// serve them far cheaper than glibc's allocator (measured in docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let cfg = HostArgs::parse().config()?;
    dpukv_node::host::run(cfg, shutdown_on_signals(), None).await
}
