//! The binary protocol front end: the device's protocol v1 (docs/protocol.md), served with the
//! same bounded connection handling as a device (`dpukv_net::conn`: byte budgets, an in-flight
//! cap, timeouts). Each request is answered by [`Upstream::handle`] on a task of its own, so
//! requests of one connection run concurrently and are answered as they finish, matched by id.

use std::sync::Arc;
use std::time::Instant;

use dpukv_net::conn::{self, Budget, ConnConfig, Incoming, Sink};
use dpukv_proto::Op;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::Metrics;
use crate::upstream::Upstream;

/// The front end's limits.
#[derive(Debug, Clone, Copy)]
pub struct BinaryLimits {
    /// Connections open at once (more are closed at once).
    pub max_connections: usize,
    /// Per-connection limits.
    pub conn: ConnConfig,
}

/// Serves `listener` until `stop`; connections are tracked by `tracker`.
pub async fn serve(
    listener: TcpListener,
    up: Arc<Upstream>,
    limits: BinaryLimits,
    budget: Budget,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let open = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else { continue };
        // Past the limit a connection is closed at once (no queue of waiting sockets).
        let Ok(permit) = open.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (up, budget, metrics, stop) = (up.clone(), budget.clone(), metrics.clone(), stop.clone());
        tracker.spawn(async move {
            let _counted = metrics.connection("binary");
            let dispatch = |batch: Vec<Incoming>, sink: Sink| {
                // A frame's point operations are answered together, by one task (see `join`);
                // a scan (which may take long) is answered on its own.
                let (scans, points): (Vec<Incoming>, Vec<Incoming>) =
                    batch.into_iter().partition(|i| matches!(i.req.op, Op::Scan { .. } | Op::FloorScan { .. }));
                for one in scans {
                    tokio::spawn(answer(up.clone(), vec![one], sink.clone(), metrics.clone()));
                }
                if !points.is_empty() {
                    tokio::spawn(answer(up.clone(), points, sink, metrics.clone()));
                }
                std::future::ready(())
            };
            if let Err(e) = conn::serve(stream, limits.conn, budget, stop, dispatch).await {
                tracing::debug!(error = %e, "binary connection ended");
            }
            drop(permit);
        });
    }
}

/// Answers `batch` through `sink`, all together once the last is answered.
async fn answer(up: Arc<Upstream>, batch: Vec<Incoming>, sink: Sink, metrics: Arc<Metrics>) {
    let started = Instant::now();
    let (reqs, charges): (Vec<_>, Vec<_>) = batch.into_iter().map(|i| (i.req, i.charge)).unzip();
    let ops: Vec<&'static str> = reqs.iter().map(|r| r.op.code().name()).collect();
    // One connection to each device for the whole frame: its requests leave as one frame.
    let pin = Some(up.client().next_pin());
    let resps = crate::join::join_all(reqs.into_iter().map(|r| up.handle_on(r, pin)).collect()).await;
    for (resp, op) in resps.iter().zip(&ops) {
        if let Err(e) = &resp.result {
            metrics.error("binary", e.code.name());
        }
        metrics.observe("binary", op, started);
    }
    let out = resps
        .into_iter()
        .zip(charges)
        .map(|(resp, mut charge)| {
            // What was reserved for the largest answer and not used goes back now.
            charge.shrink_to(conn::response_size(&resp));
            (resp, charge)
        })
        .collect();
    sink.send_many(out);
}
