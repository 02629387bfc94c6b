//! The binary protocol front end: the device's protocol v1 (docs/protocol.md), served with the
//! same bounded connection handling as a device (`dpukv_net::conn`: byte budgets, an in-flight
//! cap, timeouts). Each request is answered by [`Upstream::handle`] on a task of its own, so
//! requests of one connection run concurrently and are answered as they finish, matched by id.

use std::sync::Arc;
use std::time::Instant;

use dpukv_net::conn::{self, Budget, ConnConfig, Incoming, Sink};
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
                for Incoming { req, charge } in batch {
                    let (up, sink, metrics) = (up.clone(), sink.clone(), metrics.clone());
                    tokio::spawn(async move {
                        let started = Instant::now();
                        let op = req.op.code().name();
                        let resp = up.handle(req).await;
                        if let Err(e) = &resp.result {
                            metrics.error("binary", e.code.name());
                        }
                        metrics.observe("binary", op, started);
                        sink.send(resp, charge);
                    });
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
