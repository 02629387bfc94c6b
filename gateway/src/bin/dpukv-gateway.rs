//! `dpukv-gateway`: one endpoint for a whole cluster (binary protocol, HTTP/JSON, Redis protocol).

use clap::Parser;
use dpukv_gateway::config::GatewayArgs;
use dpukv_net::process::shutdown_on_signals;
use dpukv_net::telemetry;

/// Many small buffers are allocated across threads (frames, replies): mimalloc's per-thread
/// heaps serve them cheaper than glibc's allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let telemetry = telemetry::init("dpukv-gateway");
    let cfg = GatewayArgs::parse().config()?;
    let out = dpukv_gateway::run(cfg, shutdown_on_signals(), None).await;
    telemetry.shutdown();
    out
}
