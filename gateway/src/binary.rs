//! The binary protocol front end: the device's protocol v1 (docs/protocol.md), served with the
//! same bounded connection handling as a device (`dpukv_net::conn`: byte budgets, an in-flight
//! cap, timeouts). A frame's point operations are answered together (one frame back); scans
//! each on their own. With tokens configured (`auth`), a connection's `auth` request sets the
//! token its later requests run with, and each request is checked before it is forwarded.

use std::sync::Arc;
use std::time::Instant;

use dpukv_net::conn::{self, Budget, ConnConfig, Incoming, Sink};
use dpukv_proto::{Op, Reply, Response};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::{self, Access, Perm, Principal};
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
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: TcpListener,
    up: Arc<Upstream>,
    access: Access,
    tls: Option<Arc<dpukv_net::tls::ServerTls>>,
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
        let (up, budget, metrics, stop, access, tls) =
            (up.clone(), budget.clone(), metrics.clone(), stop.clone(), access.clone(), tls.clone());
        tracker.spawn(async move {
            let stream = match dpukv_net::tls::accept(tls.as_deref(), stream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "a binary client failed the TLS handshake");
                    return;
                }
            };
            let _counted = metrics.connection("binary");
            // Who the connection's token belongs to (set by its `auth` request).
            let mut caller: Option<Arc<Principal>> = None;
            let dispatch = |batch: Vec<Incoming>, sink: Sink| {
                // Tokens first, in the frame's order; then each request is checked against the
                // token in force before anything is read or written for it.
                let mut allowed: Vec<(Incoming, Vec<u8>)> = Vec::with_capacity(batch.len());
                for inc in batch {
                    let refuse = |inc: Incoming, e: dpukv_proto::ErrorReply| {
                        metrics.error("binary", e.code.name());
                        let resp = Response { id: inc.req.id, version: 0, replicated: false, result: Err(e) };
                        sink.send(resp, inc.charge);
                    };
                    if let Op::Auth { token } = &inc.req.op {
                        match access.authenticate(token) {
                            Some(p) => caller = Some(p),
                            None if access.required() => {
                                caller = None;
                                refuse(inc, auth::unauthorized());
                                continue;
                            }
                            None => {}
                        }
                        let done = Response { id: inc.req.id, version: 0, replicated: false, result: Ok(Reply::Done) };
                        sink.send(done, inc.charge);
                        continue;
                    }
                    if let Op::ReplicaSync { .. } = inc.req.op {
                        // Devices send these to each other; through a gateway, never.
                        let e = dpukv_proto::ErrorReply {
                            code: dpukv_proto::ErrorCode::Forbidden,
                            message: "replica syncs go from device to device, not through a gateway".into(),
                        };
                        refuse(inc, e);
                        continue;
                    }
                    let mut inc = inc;
                    // Service level: a token's class chooses how its gets are served when the
                    // request does not.
                    if let Some(c) = caller.as_ref().and_then(|p| p.consistency)
                        && inc.req.consistency == dpukv_proto::Consistency::Linearizable
                        && matches!(inc.req.op, Op::Get { .. })
                    {
                        inc.req.consistency = c;
                    }
                    let floor_min = if access.required() {
                        let Some(p) = caller.as_ref() else {
                            refuse(inc, auth::unauthorized());
                            continue;
                        };
                        if let Err(e) = p.check(&inc.req.op) {
                            refuse(inc, e);
                            continue;
                        }
                        p.granted_prefix(Perm::Read, inc.req.op.key()).map(<[u8]>::to_vec).unwrap_or_default()
                    } else {
                        Vec::new()
                    };
                    allowed.push((inc, floor_min));
                }
                // A frame's point operations are answered together, by one task (see `join`);
                // a scan (which may take long) is answered on its own.
                let (scans, points): (Vec<_>, Vec<_>) =
                    allowed.into_iter().partition(|(i, _)| matches!(i.req.op, Op::Scan { .. } | Op::FloorScan { .. }));
                for one in scans {
                    // A scan's reads are new requests: they carry its trace through the scope.
                    let trace = one.0.req.trace;
                    let answer = answer(up.clone(), vec![one], sink.clone(), metrics.clone());
                    tokio::spawn(dpukv_client::trace::scope(trace, answer));
                }
                if !points.is_empty() {
                    tokio::spawn(answer(up.clone(), points, sink, metrics.clone()));
                }
                std::future::ready(())
            };
            // Requests get spans (a new trace unless the client sent one) when traces are
            // exported; forwarded, they carry the gateway's span.
            let obs = conn::Observer { latency: None, component: Some("gateway"), root: true };
            if let Err(e) = conn::serve(stream, limits.conn, budget, obs, stop, dispatch).await {
                tracing::debug!(error = %e, "binary connection ended");
            }
            drop(permit);
        });
    }
}

/// Answers `batch` through `sink`, all together once the last is answered.
async fn answer(up: Arc<Upstream>, batch: Vec<(Incoming, Vec<u8>)>, sink: Sink, metrics: Arc<Metrics>) {
    let started = Instant::now();
    let (reqs, charges): (Vec<_>, Vec<_>) = batch.into_iter().map(|(i, f)| ((i.req, f), i.charge)).unzip();
    let ops: Vec<&'static str> = reqs.iter().map(|(r, _)| r.op.code().name()).collect();
    // One connection to each device for the whole frame: its requests leave as one frame.
    let pin = Some(up.client().next_pin());
    let resps = crate::join::join_all(reqs.into_iter().map(|(r, f)| up.handle_on(r, pin, f)).collect()).await;
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
