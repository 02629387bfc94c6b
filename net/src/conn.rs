//! Serving one protocol connection — a client of the device, or the device's link to the host —
//! so that nothing a peer sends can grow the process's memory past a stated bound:
//!
//! - **Bytes are charged before they are allocated.** A frame's header is read first (limits
//!   checked); its body is read in chunks of at most 64 KiB, each taken from the connection's
//!   budget ([`ConnConfig::conn_bytes`]) and from the process's ([`Budget`]) before the buffer
//!   grows for it, waiting (and so not reading the socket) while either is spent — so a peer
//!   that announces a large frame and sends it slowly holds only what it sent. Each request then keeps a charge for its own bytes plus the
//!   largest response it can produce, until that response is written; the read path gives back
//!   what a response did not use.
//! - **Requests in flight are capped** ([`ConnConfig::max_in_flight`]), ids must be unique among
//!   them (a duplicate is a protocol error: `bad_request` under id 0, then the connection
//!   closes), and every queue behind a connection is bounded by that cap.
//! - **Timeouts**: a connection with no complete frame header for [`ConnConfig::idle_timeout`] is
//!   closed; a frame whose bytes do not all arrive within [`ConnConfig::frame_timeout`] of its
//!   header (waiting for budget included) closes it (slow loris); a response write that does not finish within
//!   [`ConnConfig::write_timeout`] closes it (a peer that does not read).
//! - The writer frames ready responses in bounded buffers (one write per batch).

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_proto::limits::{MAX_KEY, MAX_OPS_PER_FRAME, MAX_SCAN_BYTES, MAX_VALUE};
use dpukv_proto::{
    DecodeError, ErrorCode, Op, OpCode, Reply, Request, Response, ResponseFrame, decode_requests, frame_header,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::latency::OpLatency;
use crate::telemetry;

/// Per-connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnConfig {
    /// Most requests in flight (read, not yet answered).
    pub max_in_flight: usize,
    /// Most bytes of frames, requests and responses held for the connection.
    pub conn_bytes: usize,
    /// A frame's bytes must all arrive within this once its header did.
    pub frame_timeout: Duration,
    /// A connection that sends no frame header for this long is closed.
    pub idle_timeout: Duration,
    /// A response write must finish within this.
    pub write_timeout: Duration,
}

impl Default for ConnConfig {
    fn default() -> Self {
        ConnConfig {
            max_in_flight: 4096,
            conn_bytes: 64 << 20,
            frame_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// Limits every server applies to its connections (flags shared by the node's binaries and the
/// gateway).
#[derive(Debug, Clone, clap::Args)]
pub struct ConnArgs {
    /// Bytes all connections together may hold (frames, requests in flight, responses not yet
    /// written); a connection waits, without reading, while it is spent.
    #[arg(long, env = "DPUKV_MEMORY_BUDGET", default_value_t = 1 << 30)]
    pub memory_budget: usize,
    /// Bytes one connection may hold (at least 32 MiB: two maximal frames).
    #[arg(long, default_value_t = 64 << 20)]
    pub conn_memory: usize,
    /// Requests one connection may have in flight.
    #[arg(long, default_value_t = 4096)]
    pub max_in_flight: usize,
    /// Seconds a connection may stay idle (no frame) before it is closed.
    #[arg(long, default_value_t = 300)]
    pub idle_timeout: u64,
    /// Seconds a frame's bytes may take to arrive once its header did.
    #[arg(long, default_value_t = 30)]
    pub frame_timeout: u64,
    /// Seconds a response write may take before the connection is closed.
    #[arg(long, default_value_t = 30)]
    pub write_timeout: u64,
    /// Seconds a shutdown waits for requests in flight.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
}

impl ConnArgs {
    /// The per-connection limits these flags give (checked).
    pub fn config(&self) -> Result<ConnConfig, String> {
        if self.conn_memory < 2 * dpukv_proto::limits::MAX_FRAME {
            return Err(format!(
                "--conn-memory must be at least {} bytes (two maximal frames)",
                2 * dpukv_proto::limits::MAX_FRAME
            ));
        }
        if self.memory_budget < self.conn_memory {
            return Err("--memory-budget must be at least --conn-memory".into());
        }
        if self.max_in_flight == 0 || self.idle_timeout == 0 || self.frame_timeout == 0 || self.write_timeout == 0 {
            return Err("limits and timeouts must be positive".into());
        }
        Ok(ConnConfig {
            max_in_flight: self.max_in_flight,
            conn_bytes: self.conn_memory,
            frame_timeout: Duration::from_secs(self.frame_timeout),
            idle_timeout: Duration::from_secs(self.idle_timeout),
            write_timeout: Duration::from_secs(self.write_timeout),
        })
    }
}

/// The process's byte budget, shared by all its connections.
#[derive(Clone)]
pub struct Budget {
    sem: Arc<Semaphore>,
    total: usize,
}

impl Budget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize) -> Budget {
        let bytes = bytes.min(Semaphore::MAX_PERMITS);
        Budget { sem: Arc::new(Semaphore::new(bytes)), total: bytes }
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.total - self.sem.available_permits()
    }

    /// Its size.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Bytes free now.
    pub fn available(&self) -> usize {
        self.sem.available_permits()
    }

    /// Takes `n` bytes (at most the whole budget) if they are free now; they are given back
    /// when the permit is dropped.
    pub fn try_hold(&self, n: usize) -> Option<OwnedSemaphorePermit> {
        let n = n.min(self.total).min(u32::MAX as usize) as u32;
        self.sem.clone().try_acquire_many_owned(n).ok()
    }

    /// Takes `n` bytes (at most the whole budget), waiting while they are spent; they are
    /// given back when the permit is dropped. For servers of other protocols sharing the
    /// process's budget (the gateway's RESP and HTTP front ends).
    pub async fn hold(&self, n: usize) -> OwnedSemaphorePermit {
        let n = n.min(self.total).min(u32::MAX as usize) as u32;
        self.sem.clone().acquire_many_owned(n).await.expect("the budget's semaphore is never closed")
    }
}

/// What a request holds until its response is written: bytes of the connection's and of the
/// process's budget, and one of the connection's in-flight slots.
#[derive(Debug, Default)]
pub struct Charge {
    conn: Option<OwnedSemaphorePermit>,
    global: Option<OwnedSemaphorePermit>,
    slot: Option<OwnedSemaphorePermit>,
    /// The request id this charge registered as in flight (released just before the response is
    /// written); None for responses to requests that never registered (errors, duplicates).
    id: Option<u64>,
    /// The request's operation and when its frame arrived: its latency is recorded once the
    /// response is written.
    timing: Option<(OpCode, Instant)>,
    /// The request's span, if it is traced: it ends when the response is written.
    span: Option<tracing::Span>,
}

impl Charge {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.conn.as_ref().map_or(0, |p| p.num_permits())
    }

    /// Gives back all but `keep` bytes (a response smaller than what was reserved for it).
    pub fn shrink_to(&mut self, keep: usize) {
        let extra = self.bytes().saturating_sub(keep);
        if extra > 0 {
            drop(self.conn.as_mut().and_then(|p| p.split(extra)));
            drop(self.global.as_mut().and_then(|p| p.split(extra)));
        }
    }

    /// Takes `n` of this charge's bytes into a charge of their own (without a slot).
    fn split_off(&mut self, n: usize) -> Charge {
        Charge {
            conn: self.conn.as_mut().and_then(|p| p.split(n)),
            global: self.global.as_mut().and_then(|p| p.split(n)),
            slot: None,
            id: None,
            timing: None,
            span: None,
        }
    }

    fn merge(&mut self, other: Charge) {
        for (mine, theirs) in
            [(&mut self.conn, other.conn), (&mut self.global, other.global), (&mut self.slot, other.slot)]
        {
            match (mine.as_mut(), theirs) {
                (Some(m), Some(t)) => m.merge(t),
                (None, t) => *mine = t,
                (_, None) => {}
            }
        }
        self.id = self.id.or(other.id);
        self.timing = self.timing.or(other.timing);
        self.span = self.span.take().or(other.span);
    }
}

/// Responses on their way out, each with the charge it releases once written: one, or a batch
/// already encoded as frame entries by the thread that produced it (a reader thread answers a
/// frame's reads together: the writer is woken once for them, and their buffers are freed by the
/// thread that allocated them).
#[derive(Debug)]
enum Outgoing {
    One(Response, Charge),
    Encoded { entries: Vec<u8>, charges: Vec<Charge> },
}

impl Outgoing {
    /// A batch large enough to be written as it is, after a header of its own: copied into a
    /// frame it would take its bytes twice while its charge counts them once.
    fn goes_alone(&self) -> bool {
        matches!(self, Outgoing::Encoded { entries, .. } if entries.len() >= WRITE_CHUNK)
    }
}

/// Where a connection's responses go (cheap to clone; never blocks: the channel holds as many
/// messages as the connection has requests in flight, and every message holds at least one) —
/// or, for a request made in this process ([`Sink::to_caller`]), the one caller waiting for it.
#[derive(Clone, Debug)]
pub struct Sink(Route);

#[derive(Clone, Debug)]
enum Route {
    Conn(mpsc::Sender<Outgoing>),
    /// One in-process request: its response goes to its caller, unencoded (its charge is
    /// released as it goes: there is nothing to write).
    Caller(Arc<Mutex<Option<oneshot::Sender<Response>>>>),
}

impl Sink {
    /// A sink for one request made in this process (a front end in the device's own process):
    /// its response comes back on the receiver, unencoded. Further responses are dropped.
    pub fn to_caller() -> (Sink, oneshot::Receiver<Response>) {
        let (tx, rx) = oneshot::channel();
        (Sink(Route::Caller(Arc::new(Mutex::new(Some(tx))))), rx)
    }

    /// Queues a response. If the connection is gone it is dropped (with its charge).
    pub fn send(&self, resp: Response, charge: Charge) {
        match &self.0 {
            Route::Conn(_) => self.queue(Outgoing::One(resp, charge)),
            Route::Caller(_) => self.answer(resp),
        }
    }

    /// Encodes responses here and queues them to go out together.
    pub fn send_many(&self, out: Vec<(Response, Charge)>) {
        if let Route::Caller(_) = &self.0 {
            for (resp, _) in out {
                self.answer(resp);
            }
            return;
        }
        let mut out = out.into_iter();
        while !out.as_slice().is_empty() {
            // Sized once (an upper bound): growing by doubling would copy large pages of scans.
            let size = out.as_slice().iter().take(MAX_OPS_PER_FRAME).map(|(r, _)| response_size(r)).sum();
            let mut entries = Vec::with_capacity(size);
            let mut charges = Vec::new();
            for (resp, charge) in out.by_ref().take(MAX_OPS_PER_FRAME) {
                dpukv_proto::encode_response_entry(&resp, &mut entries);
                charges.push(charge);
            }
            self.queue(Outgoing::Encoded { entries, charges });
        }
    }

    fn answer(&self, resp: Response) {
        if let Route::Caller(c) = &self.0
            && let Some(tx) = c.lock().unwrap_or_else(|e| e.into_inner()).take()
        {
            let _ = tx.send(resp);
        }
    }

    fn queue(&self, o: Outgoing) {
        let Route::Conn(tx) = &self.0 else { return };
        if let Err(mpsc::error::TrySendError::Full(_)) = tx.try_send(o) {
            // Cannot happen while every response belongs to a request holding a slot.
            tracing::error!("a connection's response queue is full; dropping responses");
        }
    }

    /// Whether the connection (or the in-process caller) is gone.
    pub fn is_closed(&self) -> bool {
        match &self.0 {
            Route::Conn(tx) => tx.is_closed(),
            Route::Caller(c) => c.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_none_or(|tx| tx.is_closed()),
        }
    }
}

/// A sink whose responses the caller reads back one at a time (`next(within)`: the next
/// response, or None if none came within), for tests of code that answers through sinks. It
/// holds up to 4,096 responses; each must be sent alone ([`Sink::send`]).
pub fn collecting_sink() -> (Sink, impl FnMut(Duration) -> Option<Response>) {
    let (tx, mut rx) = mpsc::channel(4096);
    let next = move |within: Duration| {
        let deadline = std::time::Instant::now() + within;
        loop {
            match rx.try_recv() {
                Ok(Outgoing::One(r, _)) => return Some(r),
                // Responses sent together are decoded no further here.
                Ok(Outgoing::Encoded { .. }) => continue,
                Err(_) if std::time::Instant::now() >= deadline => return None,
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    };
    (Sink(Route::Conn(tx)), next)
}

/// One request read from a connection, with its charge.
#[derive(Debug)]
pub struct Incoming {
    /// The request.
    pub req: Request,
    /// What it holds until its response is written.
    pub charge: Charge,
}

/// The bytes a request holds while in flight: its own, and room for its largest response.
pub fn reserve(req: &Request) -> usize {
    request_size(req) + response_reserve(req)
}

/// About the bytes a request takes (in memory, or encoded on the wire).
pub fn request_size(req: &Request) -> usize {
    req.size_hint()
}

/// Room for the largest response a request can get.
fn response_reserve(req: &Request) -> usize {
    match &req.op {
        Op::Get { .. } | Op::Filter { .. } | Op::CompareAndSwap { .. } => MAX_VALUE,
        Op::Scan { max_bytes, limit, .. } | Op::FloorScan { max_bytes, limit, .. } => {
            let bytes = if *max_bytes == 0 { MAX_SCAN_BYTES } else { (*max_bytes).min(MAX_SCAN_BYTES) } as usize;
            // The page may overshoot by one item, and each item costs its framing.
            bytes + MAX_VALUE + 16 * (*limit as usize).min(10_000) + 4096
        }
        Op::Pivots { max, .. } => (*max).min(dpukv_proto::limits::MAX_PIVOTS) as usize * (MAX_KEY + 4) + 64,
        // Children with their fences: bounded by the reply's node limit, and their keys by twice
        // the separators of the (at most 64) nodes expanded, each at most a 64 KiB node.
        Op::TreeNodes { .. } => dpukv_proto::limits::MAX_TREE_NODES * 48 + dpukv_proto::limits::MAX_EXPAND * 2 * 65536,
        _ => 0,
    }
}

/// Bytes a response takes on the wire (roughly: what its charge should keep until written).
pub fn response_size(r: &Response) -> usize {
    64 + match &r.result {
        Ok(Reply::Value(Some(v))) | Ok(Reply::Vector(v)) => v.len(),
        Ok(Reply::Items { items, token }) => {
            token.len() + items.iter().map(|(k, v)| k.len() + v.len() + 8).sum::<usize>()
        }
        Ok(Reply::Cas { current, .. }) => current.as_ref().map_or(0, Vec::len),
        Ok(Reply::Keys(keys)) => keys.iter().map(|k| k.len() + 4).sum::<usize>(),
        Ok(Reply::Added(r)) => r.len() * 9,
        Ok(Reply::TreeNodes { nodes, .. }) => nodes.iter().map(|(_, n)| n.size_hint()).sum::<usize>(),
        Ok(Reply::RegionMap(m)) => m.regions.iter().map(|r| r.start.len() + 64).sum::<usize>() + m.nodes.len() * 1100,
        Ok(Reply::Stats(s)) => {
            s.counters.len() * 80
                + s.regions.iter().map(|r| 32 + r.top.iter().map(|(k, _)| k.len() + 8).sum::<usize>()).sum::<usize>()
        }
        Err(e) => e.message.len(),
        _ => 0,
    }
}

/// Why a connection stopped.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent a frame that cannot be trusted (it was told why first).
    #[error("bad frame: {0}")]
    Decode(DecodeError),
    /// No frame header within the idle timeout.
    #[error("idle for too long")]
    Idle,
    /// A frame did not arrive in time once its header did.
    #[error("frame body too slow")]
    SlowFrame,
    /// A request reused the id of one still in flight.
    #[error("duplicate request id {0} in flight")]
    DuplicateId(u64),
}

/// What a connection records of its requests.
#[derive(Debug, Clone, Default)]
pub struct Observer {
    /// Latency per operation, recorded when a response has been written.
    pub latency: Option<OpLatency>,
    /// Make a span for each traced request, named after this component (`device`, `host`,
    /// `gateway`); None: no spans.
    pub component: Option<&'static str>,
    /// Also start a trace for requests that carry none (a front end).
    pub root: bool,
}

/// Serves one connection until it ends, the peer misbehaves, or `stop`: the requests read are
/// handed to `dispatch` with their charges, a frame's together (earlier if taking a charge must
/// wait, so nothing taken waits on what is not yet dispatched); `dispatch` answers each through
/// the sink (now or later, from any thread).
pub async fn serve<S, D, F>(
    stream: S,
    cfg: ConnConfig,
    budget: Budget,
    obs: Observer,
    stop: CancellationToken,
    mut dispatch: D,
) -> Result<(), ConnError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
    D: FnMut(Vec<Incoming>, Sink) -> F,
    F: Future<Output = ()>,
{
    let (r, w) = tokio::io::split(stream);
    // Small frames (a pipelining client's) come many per read: one system call for many
    // headers and bodies. A part of a frame larger than the buffer bypasses it.
    let mut r = tokio::io::BufReader::with_capacity(READ_BUFFER, r);
    let conn_bytes = Arc::new(Semaphore::new(cfg.conn_bytes));
    let slots = Arc::new(Semaphore::new(cfg.max_in_flight));
    let ids: Arc<Mutex<HashSet<u64>>> = Arc::new(Mutex::new(HashSet::new()));
    let gone = stop.child_token();
    let (sink, writer) = spawn_writer(w, &cfg, ids.clone(), obs.latency.clone(), gone.clone());
    let out = 'frames: loop {
        let mut head = [0u8; 8];
        let got = tokio::select! {
            _ = gone.cancelled() => break Ok(()),
            got = tokio::time::timeout(cfg.idle_timeout, r.read_exact(&mut head)) => got,
        };
        match got {
            Err(_) => break Err(ConnError::Idle),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Ok(Err(e)) => break Err(ConnError::Io(e)),
            Ok(Ok(_)) => {}
        }
        let h = match frame_header(&head) {
            Ok(Some(h)) if h.requests => h,
            Ok(_) => break Err(bad_frame(&sink, DecodeError::Malformed("not a request frame"))),
            Err(e) => break Err(bad_frame(&sink, e)),
        };
        // The body arrives in chunks, each charged before its bytes are allocated: a peer that
        // announces a large frame and sends it slowly holds only what it sent (plus one chunk).
        // Waiting for the budget counts against the frame's timeout: connections holding parts
        // of frames while waiting for each other's budget give theirs back when it expires, so
        // they can never wait on each other forever.
        let mut frame = Charge::default();
        let mut buf = Vec::with_capacity(h.total.min(FRAME_CHUNK));
        buf.extend_from_slice(&head);
        let deadline = tokio::time::Instant::now() + cfg.frame_timeout;
        let mut failed = None;
        while buf.len() < h.total {
            let want = (h.total - buf.len()).min(FRAME_CHUNK);
            let more = tokio::select! {
                _ = gone.cancelled() => None,
                _ = tokio::time::sleep_until(deadline) => {
                    failed = Some(ConnError::SlowFrame);
                    None
                }
                c = take(&conn_bytes, &budget, want) => Some(c),
            };
            let Some(more) = more else { break };
            frame.merge(more);
            buf.reserve_exact(want);
            let mut chunk = (&mut r).take(want as u64);
            let got = tokio::time::timeout_at(deadline, async {
                while chunk.limit() > 0 {
                    if chunk.read_buf(&mut buf).await? == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                }
                Ok::<_, std::io::Error>(())
            })
            .await;
            match got {
                Err(_) => failed = Some(ConnError::SlowFrame),
                Ok(Err(e)) => failed = Some(ConnError::Io(e)),
                Ok(Ok(())) => continue,
            }
            break;
        }
        if let Some(e) = failed {
            break Err(e);
        }
        if buf.len() < h.total {
            break Ok(()); // stopping
        }
        let entries = match decode_requests(&buf) {
            Ok(e) => e,
            Err(e) => break Err(bad_frame(&sink, e)),
        };
        let arrived = Instant::now();
        drop(buf);
        let mut batch: Vec<Incoming> = Vec::with_capacity(entries.len());
        for entry in entries {
            let slot = match slots.clone().try_acquire_owned() {
                Ok(s) => Some(s),
                Err(_) => {
                    if !batch.is_empty() {
                        dispatch(std::mem::take(&mut batch), sink.clone()).await;
                    }
                    tokio::select! {
                        _ = gone.cancelled() => None,
                        s = slots.clone().acquire_owned() => s.ok(),
                    }
                }
            };
            let Some(slot) = slot else { break };
            let mut charge = Charge { slot: Some(slot), ..Charge::default() };
            match entry {
                Err((id, code, what)) => {
                    charge.merge(frame.split_off(64));
                    sink.send(Response::error(id, code, what), charge);
                }
                Ok(mut req) => {
                    if !ids.lock().unwrap_or_else(|e| e.into_inner()).insert(req.id) {
                        // An answer under the duplicated id would be taken for the original's:
                        // a protocol error, so the connection ends (requests in flight on it
                        // end with it, their outcome unknown to the client).
                        let what = format!("request id {} is already in flight on this connection", req.id);
                        sink.send(Response::error(0, ErrorCode::BadRequest, what), Charge::default());
                        break 'frames Err(ConnError::DuplicateId(req.id));
                    }
                    charge.id = Some(req.id);
                    charge.timing = Some((req.op.code(), arrived));
                    // A traced request gets a span here; what it sends on carries the span.
                    if let Some(component) = obs.component
                        && (req.trace.is_some() || obs.root)
                        && let Some((span, ctx)) =
                            telemetry::op_span(component, req.op.code(), req.trace.as_ref(), obs.root)
                    {
                        charge.span = Some(span);
                        req.trace = Some(ctx);
                    }
                    let need = reserve(&req);
                    let have = frame.bytes().min(need);
                    charge.merge(frame.split_off(have));
                    if need > have {
                        let more = match try_take(&conn_bytes, &budget, need - have) {
                            Some(c) => c,
                            None => {
                                if !batch.is_empty() {
                                    dispatch(std::mem::take(&mut batch), sink.clone()).await;
                                }
                                tokio::select! {
                                    _ = gone.cancelled() => break,
                                    c = take(&conn_bytes, &budget, need - have) => c,
                                }
                            }
                        };
                        charge.merge(more);
                    }
                    batch.push(Incoming { req, charge });
                }
            }
        }
        if !batch.is_empty() {
            dispatch(batch, sink.clone()).await;
        }
    };
    drop(sink);
    let _ = writer.await;
    if matches!(out, Err(ConnError::Decode(_) | ConnError::DuplicateId(_))) {
        // Our write side is shut after the error reply; read (and drop) what the peer still
        // sends for a moment, so closing with unread input does not reset the connection
        // before the peer reads the reply.
        let mut scratch = vec![0u8; 16 << 10];
        let mut left = LINGER_BYTES;
        let _ = tokio::time::timeout(LINGER, async {
            while left > 0 {
                match r.read(&mut scratch).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => left = left.saturating_sub(n),
                }
            }
        })
        .await;
    }
    out
}

/// How long, and for how many bytes, a connection closed for a protocol error keeps reading.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

fn bad_frame(sink: &Sink, e: DecodeError) -> ConnError {
    let code = if matches!(e, DecodeError::TooLarge(_)) { ErrorCode::FrameTooLarge } else { ErrorCode::BadRequest };
    sink.send(Response::error(0, code, e.to_string()), Charge::default());
    ConnError::Decode(e)
}

/// Takes `n` bytes from the connection's and the process's budgets if both have them now.
fn try_take(conn: &Arc<Semaphore>, budget: &Budget, n: usize) -> Option<Charge> {
    let n32 = n.min(u32::MAX as usize) as u32;
    let c = conn.clone().try_acquire_many_owned(n32).ok()?;
    let g = budget.sem.clone().try_acquire_many_owned(n32).ok()?;
    Some(Charge { conn: Some(c), global: Some(g), ..Charge::default() })
}

/// Takes `n` bytes from the connection's and the process's budgets (waiting while either is
/// spent).
async fn take(conn: &Arc<Semaphore>, budget: &Budget, n: usize) -> Charge {
    let n32 = n.min(u32::MAX as usize) as u32;
    let c = conn.clone().acquire_many_owned(n32).await.ok();
    let g = budget.sem.clone().acquire_many_owned(n32).await.ok();
    Charge { conn: c, global: g, ..Charge::default() }
}

/// Bytes each connection reads ahead (a fixed cost per connection, outside the budgets:
/// `--max-connections` bounds it).
const READ_BUFFER: usize = 16 << 10;

/// A frame's body is read (and charged) in chunks of at most this many bytes.
const FRAME_CHUNK: usize = 64 << 10;

/// Bytes of responses framed per write (at least one response, however large).
const WRITE_CHUNK: usize = 256 << 10;

/// Frees the request ids of responses about to be written: a peer may reuse an id as soon as it
/// has read its answer, so they are free before the answer can reach it (the bytes and slots
/// the charges hold wait for the write).
fn free_ids(ids: &Mutex<HashSet<u64>>, charges: &[Charge]) {
    let mut ids = ids.lock().unwrap_or_else(|e| e.into_inner());
    for id in charges.iter().filter_map(|c| c.id) {
        ids.remove(&id);
    }
}

/// Records the latency of the requests whose responses were just written.
fn record(latency: Option<&OpLatency>, charges: &[Charge]) {
    if let Some(l) = latency {
        let now = Instant::now();
        for (op, arrived) in charges.iter().filter_map(|c| c.timing) {
            l.observe(op, now.saturating_duration_since(arrived));
        }
    }
}

fn spawn_writer<W: AsyncWrite + Send + 'static>(
    w: tokio::io::WriteHalf<W>,
    cfg: &ConnConfig,
    ids: Arc<Mutex<HashSet<u64>>>,
    latency: Option<OpLatency>,
    gone: CancellationToken,
) -> (Sink, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<Outgoing>(cfg.max_in_flight + 16);
    let timeout = cfg.write_timeout;
    let task = tokio::spawn(async move {
        let mut w = w;
        let mut pending: std::collections::VecDeque<Outgoing> = std::collections::VecDeque::new();
        let mut charges: Vec<Charge> = Vec::with_capacity(64);
        let mut buf = Vec::with_capacity(64 << 10);
        loop {
            if pending.is_empty() {
                match rx.recv().await {
                    Some(o) => pending.push_back(o),
                    None => break,
                }
            }
            while pending.len() < MAX_OPS_PER_FRAME {
                match rx.try_recv() {
                    Ok(o) => pending.push_back(o),
                    Err(_) => break,
                }
            }
            if pending.front().is_some_and(Outgoing::goes_alone)
                && let Some(Outgoing::Encoded { entries, charges: c }) = pending.pop_front()
            {
                let head = ResponseFrame::header(entries.len(), c.len());
                free_ids(&ids, &c);
                let write = async {
                    w.write_all(&head).await?;
                    w.write_all(&entries).await
                };
                let ok = matches!(tokio::time::timeout(timeout, write).await, Ok(Ok(())));
                if ok {
                    record(latency.as_ref(), &c);
                }
                drop((entries, c)); // written: their bytes and slots go back
                if !ok {
                    gone.cancel();
                    break;
                }
                continue;
            }
            // One frame: at least one message, however large; then up to the limits.
            buf.clear();
            let mut frame = ResponseFrame::begin(&mut buf);
            while let Some(o) = pending.front() {
                let n = match o {
                    Outgoing::One(..) => 1,
                    Outgoing::Encoded { charges, .. } => charges.len(),
                };
                let full = frame.count() + n > MAX_OPS_PER_FRAME || buf.len() >= WRITE_CHUNK;
                if frame.count() > 0 && (o.goes_alone() || full) {
                    break;
                }
                match pending.pop_front().expect("a front") {
                    Outgoing::One(resp, charge) => {
                        frame.push(&mut buf, &resp);
                        charges.push(charge);
                    }
                    Outgoing::Encoded { entries, charges: c } => {
                        frame.push_encoded(&mut buf, &entries, c.len());
                        charges.extend(c);
                    }
                }
            }
            frame.finish(&mut buf);
            free_ids(&ids, &charges);
            let ok = matches!(tokio::time::timeout(timeout, w.write_all(&buf)).await, Ok(Ok(())));
            if ok {
                record(latency.as_ref(), &charges);
            }
            charges.clear(); // written: their bytes and slots go back
            if buf.capacity() > 4 * WRITE_CHUNK {
                buf = Vec::with_capacity(64 << 10);
            }
            if !ok {
                gone.cancel();
                break;
            }
        }
        rx.close();
        let _ = tokio::time::timeout(timeout, w.shutdown()).await;
    });
    (Sink(Route::Conn(tx)), task)
}

#[cfg(test)]
mod tests {
    use dpukv_proto::{ErrorCode, Reply, Response};

    use super::{Charge, Sink};

    fn done(id: u64) -> Response {
        Response { id, version: 7, replicated: false, result: Ok(Reply::Done) }
    }

    #[tokio::test]
    async fn a_caller_sink_hands_its_one_response_over_unencoded() {
        let (sink, answer) = Sink::to_caller();
        assert!(!sink.is_closed());
        // A batch answers with its first response; what follows is dropped, not queued.
        sink.send_many(vec![(done(3), Charge::default()), (done(4), Charge::default())]);
        let r = answer.await.expect("answered");
        assert_eq!((r.id, r.version), (3, 7));
        assert!(sink.is_closed(), "answered: nothing more goes anywhere");
        sink.send(Response::error(5, ErrorCode::Internal, "late"), Charge::default());
    }

    #[test]
    fn a_caller_sink_whose_caller_left_is_closed() {
        let (sink, answer) = Sink::to_caller();
        drop(answer);
        assert!(sink.is_closed());
        sink.send(done(1), Charge::default()); // dropped quietly
    }
}
