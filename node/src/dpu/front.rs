//! The front door in the device's process (issue 29, docs/gateway.md §"Front door on the
//! device"): the gateway's RESP and HTTP front ends, run inside `dpukv-dpu`, reaching this
//! node's own regions by a call ([`InProcess`], a [`LocalDevice`]) instead of a second network
//! hop — on a DPU the NIC is the front door. Keys of regions other nodes lead are forwarded to
//! their devices as the standalone gateway forwards them; tokens, limits and every reply are the
//! gateway's own (the same code).
//!
//! An in-process request is checked exactly as one from the data port (the region and epoch it
//! names against the map the host vouches for); it skips only the data port's certificate
//! check — the front end authenticated its caller with its own tokens. A get is served on the
//! calling thread ([`ReadPool::serve_now`]); other reads go to the reader threads, writes and
//! atomics to the host's links, as from a connection.

use std::sync::Arc;

use dpukv_client::local::{GetInto, LocalCall, LocalDevice};
use dpukv_proto::{Op, Request};

use super::link::HostLinks;
use crate::conn::{Charge, Incoming, Sink};
use crate::reads::ReadPool;
use crate::replica_table::ReplicaTable;

/// This device, called from its own process (see the module documentation): one per front
/// door thread, with links to the host of its own (their tasks run on that thread's event loop).
pub(crate) struct InProcess {
    pub(crate) reads: Arc<ReadPool>,
    pub(crate) links: Arc<HostLinks>,
    pub(crate) table: Arc<ReplicaTable>,
    pub(crate) on_host: bool,
}

impl LocalDevice for InProcess {
    fn call(&self, req: Request) -> LocalCall<'_> {
        if matches!(req.op, Op::Get { .. }) && !req.replica && !self.on_host {
            return LocalCall::Ready(self.reads.serve_now(&req));
        }
        let (sink, answer) = Sink::to_caller();
        LocalCall::Later(Box::pin(async move {
            let batch = vec![Incoming { req, charge: Charge::default() }];
            super::dispatch(batch, sink, &self.reads, &self.links, &self.table, self.on_host).await;
            answer.await.ok()
        }))
    }

    fn get_into(&self, region: u32, epoch: u64, key: &[u8], out: &mut Vec<u8>) -> Option<GetInto> {
        (!self.on_host).then(|| self.reads.get_into(region, epoch, key, out))
    }
}

/// Where a started front door serves, and its threads (they end on the shutdown signal).
pub(crate) struct Started {
    pub(crate) resp: Option<std::net::SocketAddr>,
    pub(crate) http: Option<std::net::SocketAddr>,
    pub(crate) threads: Vec<std::thread::JoinHandle<()>>,
}

/// Starts the front door on `threads` threads, each a gateway on a single-threaded event loop
/// (a request is parsed, served from this device's memory and answered on one thread, with no
/// hand-off: the cost per request of a thread-per-core server), all on the same ports
/// (`SO_REUSEPORT`), each with `1/threads` of the memory budget, all recording into `metrics`
/// (registered in the device's admin registry: `dpukv_gateway_*` on the device's `/metrics`).
pub(crate) async fn start(
    mut cfg: dpukv_gateway::GatewayConfig,
    threads: usize,
    device: InProcess,
    metrics: Arc<dpukv_gateway::metrics::Metrics>,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Started> {
    let node = crate::pod::open_map(device.reads.shm())?.0.node();
    cfg.seeds = vec![dpukv_client::LOCAL_SEED.to_string()];
    // The console is the standalone gateway's (it gathers every device's statistics).
    cfg.console = None;
    // One set of metrics (the device's `/metrics` shows them), tokens, login throttle and SCAN
    // cursors for all threads.
    cfg.shared = Some(dpukv_gateway::GatewayShared::new(&cfg, metrics, stop.clone())?);
    let (info, handles) = dpukv_gateway::start_threads(cfg, threads, "dpukv-front", stop, |_, this| {
        let mine = InProcess {
            reads: device.reads.clone(),
            links: device.links.sibling(),
            table: device.table.clone(),
            on_host: device.on_host,
        };
        this.local = Some(dpukv_client::local::Local { node, device: Arc::new(mine) });
    })
    .await?;
    let out = Started { resp: info.resp, http: info.http, threads: handles };
    Ok(out)
}
