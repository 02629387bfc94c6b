//! The binary protocol front end: the device's protocol v1 (docs/protocol.md), served with the
//! same bounded connection handling as a device (`dpukv_net::conn`: byte budgets, an in-flight
//! cap, timeouts). A frame's point operations are answered together (one frame back); scans
//! each on their own. With tokens configured (`auth`), a connection's `auth` request sets the
//! token its later requests run with, and each request is checked before it is forwarded.
//!
//! With tokens configured, a connection is first served **unauthenticated** here, outside
//! `dpukv_net::conn` and its budgets: its frames may hold 4 KiB (an `auth` request fits), each
//! read into a fixed buffer and answered at once (`unauthorized` to anything but `auth`), and
//! it must authenticate within `auth_timeout`. Only then does it get the connection limits and
//! its place in the memory budget. Failed `auth`s are throttled per peer address, and a
//! connection is closed after a few; a failed `auth` on an authenticated connection closes it.
//! A session whose token is revoked (removed from the token file) is closed when the file is
//! re-read; one whose grants changed runs with the new ones.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_net::conn::{self, Budget, ConnConfig, Incoming, Sink};
use dpukv_proto::{ErrorCode, ErrorReply, Op, Reply, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::{self, Access, Perm, Principal};
use crate::metrics::Metrics;
use crate::throttle::{self, AuthThrottle};
use crate::upstream::Upstream;

/// The front end's limits.
#[derive(Debug, Clone, Copy)]
pub struct BinaryLimits {
    /// Connections open at once (more are closed at once).
    pub max_connections: usize,
    /// Per-connection limits.
    pub conn: ConnConfig,
}

/// What the front end's connections share.
#[derive(Clone)]
pub struct Front {
    /// The cluster.
    pub up: Arc<Upstream>,
    /// Who may do what.
    pub access: Access,
    /// Failed authentications per peer address.
    pub throttle: Arc<AuthThrottle>,
    /// TLS, if the front end speaks it.
    pub tls: Option<Arc<dpukv_net::tls::ServerTls>>,
    /// Limits.
    pub limits: BinaryLimits,
    /// With tokens, how long a connection may take to authenticate.
    pub auth_timeout: Duration,
    /// The process's memory budget.
    pub budget: Budget,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

/// Bytes of a frame header.
const FRAME_HEADER: usize = 8;

/// The largest frame a connection may send before it has authenticated (an `auth` request,
/// whose token is at most 256 bytes, fits with room to spare).
pub const PRE_AUTH_FRAME: usize = 4096;

/// Serves `listener` until `stop`; connections are tracked by `tracker`.
pub async fn serve(listener: TcpListener, front: Front, stop: CancellationToken, tracker: TaskTracker) {
    let open = Arc::new(Semaphore::new(front.limits.max_connections));
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((stream, peer)) = accepted else { continue };
        // Past the limit a connection is closed at once (no queue of waiting sockets).
        let Ok(permit) = open.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (front, stop) = (front.clone(), stop.clone());
        tracker.spawn(async move {
            let opened = tokio::time::Instant::now();
            let mut stream = match dpukv_net::tls::accept(front.tls.as_deref(), stream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "a binary client failed the TLS handshake");
                    return;
                }
            };
            let _counted = front.metrics.connection("binary");
            let caller = if front.access.required() {
                let deadline = opened + front.auth_timeout;
                match unauthenticated(&mut stream, &front, peer.ip(), deadline, &stop).await {
                    Some(p) => Some(p),
                    None => return,
                }
            } else {
                None
            };
            serve_authenticated(stream, &front, peer.ip(), caller, stop).await;
            drop(permit);
        });
    }
}

/// Serves a connection before it has authenticated (see the module documentation): the
/// principal once an `auth` succeeds, or `None` when the connection is done.
async fn unauthenticated(
    stream: &mut dpukv_net::tls::Stream,
    front: &Front,
    peer: IpAddr,
    deadline: tokio::time::Instant,
    stop: &CancellationToken,
) -> Option<Arc<Principal>> {
    let mut failures = 0;
    let mut buf = Vec::with_capacity(PRE_AUTH_FRAME);
    loop {
        buf.clear();
        buf.resize(FRAME_HEADER, 0);
        let got = tokio::select! {
            _ = stop.cancelled() => return None,
            got = tokio::time::timeout_at(deadline, stream.read_exact(&mut buf)) => got,
        };
        if !matches!(got, Ok(Ok(_))) {
            return None; // gone, or not authenticated in time
        }
        let h = match dpukv_proto::frame_header(&buf) {
            Ok(Some(h)) if h.requests && h.total <= PRE_AUTH_FRAME => h,
            Ok(Some(h)) if h.requests => {
                let e = "authenticate first: send an auth request alone in the connection's first frame";
                refuse_and_close(stream, front, vec![Response::error(0, ErrorCode::FrameTooLarge, e)]).await;
                return None;
            }
            Ok(_) => {
                let e = "not a request frame";
                refuse_and_close(stream, front, vec![Response::error(0, ErrorCode::BadRequest, e)]).await;
                return None;
            }
            Err(e) => {
                refuse_and_close(stream, front, vec![Response::error(0, ErrorCode::BadRequest, e.to_string())]).await;
                return None;
            }
        };
        buf.resize(h.total, 0);
        let got = tokio::time::timeout_at(deadline, stream.read_exact(&mut buf[FRAME_HEADER..])).await;
        if !matches!(got, Ok(Ok(_))) {
            return None;
        }
        let entries = match dpukv_proto::decode_requests(&buf) {
            Ok(e) => e,
            Err(e) => {
                refuse_and_close(stream, front, vec![Response::error(0, ErrorCode::BadRequest, e.to_string())]).await;
                return None;
            }
        };
        let mut caller = None;
        let mut out = Vec::with_capacity(entries.len());
        for entry in entries {
            let req = match entry {
                Ok(r) => r,
                Err((id, code, what)) => {
                    out.push(Response::error(id, code, what));
                    continue;
                }
            };
            let result = match &req.op {
                Op::Auth { token } if caller.is_none() => match authenticate(front, peer, token) {
                    Ok(p) => {
                        caller = Some(p);
                        Ok(Reply::Done)
                    }
                    Err(e) => {
                        failures += 1;
                        Err(e)
                    }
                },
                _ => Err(ErrorReply {
                    code: ErrorCode::Unauthorized,
                    message: "a valid token is needed first: send an auth request alone in the connection's first frame, and wait for its answer".into(),
                }),
            };
            if let Err(e) = &result {
                front.metrics.error("binary", e.code.name());
            }
            out.push(Response { id: req.id, version: 0, replicated: false, result });
        }
        if write(stream, front, out).await.is_err() || failures >= throttle::PER_CONNECTION {
            return None;
        }
        if caller.is_some() {
            return caller;
        }
    }
}

/// Answers `resps` and lets the connection go (see `crate::resp::linger`).
async fn refuse_and_close(stream: &mut dpukv_net::tls::Stream, front: &Front, resps: Vec<Response>) {
    if write(stream, front, resps).await.is_ok() {
        crate::resp::linger(stream).await;
    }
}

/// Checks `token` for `peer`: its principal, or why not (throttled, or unknown: a failure).
fn authenticate(front: &Front, peer: IpAddr, token: &[u8]) -> Result<Arc<Principal>, ErrorReply> {
    if let Err(wait) = front.throttle.check(peer) {
        return Err(ErrorReply {
            code: ErrorCode::Unauthorized,
            message: format!("too many failed authentications from this address: retry in {} s", wait.as_secs().max(1)),
        });
    }
    match front.access.authenticate(token) {
        Some(p) => Ok(p),
        None => {
            front.throttle.failed(peer);
            Err(auth::unauthorized())
        }
    }
}

/// Writes `resps` as one frame (within the write timeout).
async fn write(stream: &mut dpukv_net::tls::Stream, front: &Front, resps: Vec<Response>) -> std::io::Result<()> {
    let mut out = Vec::new();
    dpukv_proto::encode_responses(&resps, &mut out);
    match tokio::time::timeout(front.limits.conn.write_timeout, stream.write_all(&out)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Serves a connection that may run requests: authenticated as `caller` (with tokens), or any
/// connection of an open gateway.
async fn serve_authenticated(
    stream: dpukv_net::tls::Stream,
    front: &Front,
    peer: IpAddr,
    caller: Option<Arc<Principal>>,
    stop: CancellationToken,
) {
    let (up, access, metrics) = (&front.up, &front.access, &front.metrics);
    let conn_stop = stop.child_token();
    // The token in force for the connection: its grants follow the token document; once its
    // token is revoked, the connection is closed.
    let caller = Arc::new(Mutex::new(caller));
    let watcher = access.required().then(|| {
        let (access, caller, conn_stop) = (access.clone(), caller.clone(), conn_stop.clone());
        tokio::spawn(async move {
            let mut changes = access.changed();
            while changes.changed().await.is_ok() {
                let mut c = caller.lock().unwrap_or_else(|e| e.into_inner());
                let Some(p) = c.clone() else { continue };
                match access.current(&p) {
                    Some(now) => *c = Some(now),
                    None => {
                        tracing::info!(token = %p.name, "a revoked token's binary session is closed");
                        *c = None;
                        conn_stop.cancel();
                        return;
                    }
                }
            }
        })
    });
    let dispatch = |batch: Vec<Incoming>, sink: Sink| {
        // Tokens first, in the frame's order; then each request is checked against the token in
        // force before anything is read or written for it.
        let mut allowed: Vec<(Incoming, Vec<u8>, Option<Arc<Principal>>)> = Vec::with_capacity(batch.len());
        for inc in batch {
            let refuse = |mut inc: Incoming, e: ErrorReply| {
                metrics.error("binary", e.code.name());
                let resp = Response { id: inc.req.id, version: 0, replicated: false, result: Err(e) };
                // What was reserved for the request's answer goes back now.
                inc.charge.shrink_to(conn::response_size(&resp));
                sink.send(resp, inc.charge);
            };
            let current = caller.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Op::Auth { token } = &inc.req.op {
                if access.required() {
                    match authenticate(front, peer, token) {
                        Ok(p) => *caller.lock().unwrap_or_else(|e| e.into_inner()) = Some(p),
                        Err(e) => {
                            // A failed auth leaves no token in force: the connection ends.
                            *caller.lock().unwrap_or_else(|e| e.into_inner()) = None;
                            refuse(inc, e);
                            conn_stop.cancel();
                            continue;
                        }
                    }
                }
                let mut inc = inc;
                let done = Response { id: inc.req.id, version: 0, replicated: false, result: Ok(Reply::Done) };
                inc.charge.shrink_to(conn::response_size(&done));
                sink.send(done, inc.charge);
                continue;
            }
            if let Op::ReplicaSync { .. } = inc.req.op {
                // Devices send these to each other; through a gateway, never.
                let e = ErrorReply {
                    code: ErrorCode::Forbidden,
                    message: "replica syncs go from device to device, not through a gateway".into(),
                };
                refuse(inc, e);
                continue;
            }
            let mut inc = inc;
            // Service level: a token's class chooses how its gets are served when the request
            // does not.
            if let Some(c) = current.as_ref().and_then(|p| p.consistency)
                && inc.req.consistency == dpukv_proto::Consistency::Linearizable
                && matches!(inc.req.op, Op::Get { .. })
            {
                inc.req.consistency = c;
            }
            let floor_min = if access.required() {
                let Some(p) = current.as_ref() else {
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
            allowed.push((inc, floor_min, current));
        }
        // A frame's point operations are answered together, by one task (see `join`); a scan
        // (which may take long) is answered on its own.
        let (scans, points): (Vec<_>, Vec<_>) =
            allowed.into_iter().partition(|(i, _, _)| matches!(i.req.op, Op::Scan { .. } | Op::FloorScan { .. }));
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
    // Requests get spans (a new trace unless the client sent one) when traces are exported;
    // forwarded, they carry the gateway's span.
    let obs = conn::Observer { latency: None, component: Some("gateway"), root: true };
    if let Err(e) = conn::serve(stream, front.limits.conn, front.budget.clone(), obs, conn_stop.clone(), dispatch).await
    {
        tracing::debug!(error = %e, "binary connection ended");
    }
    if let Some(w) = watcher {
        w.abort();
    }
}

/// Answers `batch` through `sink`, all together once the last is answered.
async fn answer(
    up: Arc<Upstream>,
    batch: Vec<(Incoming, Vec<u8>, Option<Arc<Principal>>)>,
    sink: Sink,
    metrics: Arc<Metrics>,
) {
    let started = Instant::now();
    let mut reqs = Vec::with_capacity(batch.len());
    let mut charges = Vec::with_capacity(batch.len());
    for (i, floor_min, caller) in batch {
        reqs.push((i.req, floor_min, caller));
        charges.push(i.charge);
    }
    let ops: Vec<&'static str> = reqs.iter().map(|(r, _, _)| r.op.code().name()).collect();
    // One connection to each device for the whole frame: its requests leave as one frame.
    let pin = Some(up.client().next_pin());
    let up = &up;
    let resps = crate::join::join_all(
        reqs.into_iter().map(|(r, f, c)| async move { up.handle_on(r, pin, f, c.as_deref()).await }).collect(),
    )
    .await;
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
