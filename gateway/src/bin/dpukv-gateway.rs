//! `dpukv-gateway`: one endpoint for a whole cluster (binary protocol, HTTP/JSON, Redis protocol).

use clap::Parser;
use dpukv_gateway::config::GatewayArgs;
use dpukv_net::process::{init_tracing, shutdown_on_signals};

/// Many small buffers are allocated across threads (frames, replies): mimalloc's per-thread
/// heaps serve them cheaper than glibc's allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let cfg = GatewayArgs::parse().config()?;
    dpukv_gateway::run(cfg, shutdown_on_signals(), None).await
}
