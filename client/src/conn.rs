//! One pipelined connection: callers queue requests on a bounded channel; a writer task drains
//! everything queued into one frame (assigning ids) and writes it with one `write`; a reader task
//! completes the callers by id. A broken connection fails what is in flight with `Disconnected`
//! and is re-dialled by the next request.
//!
//! System calls are what a pipelined client spends its CPU on, so both tasks amortize them:
//! - the writer yields once after the first queued request before draining the queue, so the
//!   callers woken by the same batch of responses queue their next requests first and they all
//!   go out in one frame and one write (without the yield each woken caller's request would be
//!   written on its own);
//! - the reader reads into a buffer of at least [`READ_CHUNK`] bytes and decodes every complete
//!   frame in it ([`take_frames`]), never reading a frame's header and body with separate calls.
//!
//! Bounds: the queue holds at most [`MAX_IN_FLIGHT`] requests (callers beyond wait), and the
//! writer takes no more from it while [`MAX_IN_FLIGHT`] written requests are unanswered (it waits
//! for the reader to complete some), so the waiter table stays below `MAX_IN_FLIGHT` plus one
//! frame's entries.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_net::tls::{ClientTls, Stream};
use dpukv_proto::{DecodeError, Request, Response, decode_responses, encode_requests, frame_header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc, oneshot};

use crate::error::ClientError;

/// A caller waiting for its response, until its deadline.
struct Waiter {
    done: oneshot::Sender<Result<Response, ClientError>>,
    deadline: Instant,
}

type Waiters = Arc<Mutex<HashMap<u64, Waiter>>>;
type Queued = (Request, Waiter);

/// See the module documentation.
pub(crate) struct Connection {
    addr: String,
    /// Presented (`auth`) on every dial, if given.
    token: Option<Arc<[u8]>>,
    /// TLS on every dial, if given.
    tls: Option<Arc<ClientTls>>,
    /// The live connection.
    live: Mutex<Live>,
    /// Held while re-dialling, so concurrent callers dial once.
    dialing: tokio::sync::Mutex<()>,
}

/// Most requests queued on one connection, and most written and not yet answered.
const MAX_IN_FLIGHT: usize = 4096;

/// The reader asks the socket for at least this many bytes per `read`.
const READ_CHUNK: usize = 64 << 10;

/// A read buffer grown beyond this (for a large frame) is given back once it is drained.
const KEEP_BUFFER: usize = 4 << 20;

/// How often the reader fails the callers whose deadline passed (one timer per connection, not
/// one per request).
const SWEEP_EVERY: Duration = Duration::from_millis(100);

impl Connection {
    pub(crate) async fn open(
        addr: &str,
        token: Option<Arc<[u8]>>,
        tls: Option<Arc<ClientTls>>,
    ) -> Result<Connection, ClientError> {
        let live = dial(addr, token.as_deref(), tls.as_deref()).await?;
        Ok(Connection { addr: addr.to_string(), token, tls, live: Mutex::new(live), dialing: Default::default() })
    }

    /// Sends `req` and waits for its response, at most `timeout` (then `TimedOut`: the request
    /// may still execute).
    pub(crate) async fn call(&self, req: Request, timeout: Duration) -> Result<Response, ClientError> {
        if let Err(c) = req.op.validate() {
            return Err(ClientError::Invalid(c));
        }
        let deadline = Instant::now() + timeout;
        let tx = self.sender().await?;
        let (done, wait) = oneshot::channel();
        tx.send((req, Waiter { done, deadline })).await.map_err(|_| ClientError::Disconnected)?;
        wait.await.map_err(|_| ClientError::Disconnected)?
    }

    /// The live connection's queue, re-dialling if the connection is gone.
    async fn sender(&self) -> Result<mpsc::Sender<Queued>, ClientError> {
        if let Some(tx) = lock(&self.live).sender() {
            return Ok(tx);
        }
        let _dialing = self.dialing.lock().await;
        if let Some(tx) = lock(&self.live).sender() {
            return Ok(tx); // another caller re-dialled
        }
        let live = dial(&self.addr, self.token.as_deref(), self.tls.as_deref()).await?;
        let tx = live.tx.clone();
        *lock(&self.live) = live;
        Ok(tx)
    }
}

/// A dialled connection: its queue, and whether its reader has seen it end.
struct Live {
    tx: mpsc::Sender<Queued>,
    closed: Arc<AtomicBool>,
}

impl Live {
    /// The queue, while the connection is up.
    fn sender(&self) -> Option<mpsc::Sender<Queued>> {
        (!self.tx.is_closed() && !self.closed.load(Ordering::Acquire)).then(|| self.tx.clone())
    }
}

/// How long presenting a token on a new connection may take.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a fabric connection may take to be established.
const FABRIC_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `addr`: `host:port` over TCP, or `fabric://PROVIDER/HOST:PORT` over libfabric;
/// with TLS when given.
pub(crate) async fn connect(addr: &str, tls: Option<&ClientTls>) -> Result<Stream, ClientError> {
    use dpukv_net::fabric::{FabricAddr, FabricError, FabricStream};
    let tls_failed = |e: std::io::Error| match dpukv_net::tls::refusal(&e) {
        Some(why) => ClientError::Tls(format!("{addr}: {why}")),
        None => ClientError::Io(e),
    };
    if !FabricAddr::is_fabric(addr) {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        return match tls {
            Some(t) => t.connect(tcp, addr).await.map_err(tls_failed),
            None => Ok(Stream::Plain(tcp)),
        };
    }
    let at = FabricAddr::parse(addr).map_err(|e| ClientError::Fabric(e.to_string()))?;
    let fabric = FabricStream::connect(
        &at.provider,
        &at.host,
        at.port,
        dpukv_net::fabric::Options::PROTOCOL,
        FABRIC_CONNECT_TIMEOUT,
    )
    .await
    .map_err(|e| match e {
        FabricError::NotBuilt | FabricError::Unavailable(_) | FabricError::Address(_) | FabricError::Options(_) => {
            ClientError::Fabric(e.to_string())
        }
        e => ClientError::Io(std::io::Error::other(e)),
    })?;
    match tls {
        Some(t) => t.connect_fabric(fabric, &format!("{}:{}", at.host, at.port)).await.map_err(tls_failed),
        None => Ok(Stream::Fabric(Box::new(fabric))),
    }
}

async fn dial(addr: &str, token: Option<&[u8]>, tls: Option<&ClientTls>) -> Result<Live, ClientError> {
    let mut stream = connect(addr, tls).await?;
    if let Some(t) = token {
        match tokio::time::timeout(AUTH_TIMEOUT, authenticate(&mut stream, t)).await {
            Ok(r) => r?,
            Err(_) => return Err(ClientError::TimedOut),
        }
    }
    let (r, w) = tokio::io::split(stream);
    let waiters: Waiters = Arc::new(Mutex::new(HashMap::with_capacity(256)));
    // Set by the reader when the connection is gone, before it drops the waiters; the writer
    // checks it after registering new ones, so none is left waiting forever.
    let closed = Arc::new(AtomicBool::new(false));
    // Signalled by the reader when it completed requests (the writer may be waiting for room).
    let room = Arc::new(Notify::new());
    let (tx, rx) = mpsc::channel::<Queued>(MAX_IN_FLIGHT);
    tokio::spawn(write_loop(w, rx, waiters.clone(), closed.clone(), room.clone()));
    let live = Live { tx, closed: closed.clone() };
    tokio::spawn(async move {
        // Any error ends the connection; dropping the senders fails every request in flight with
        // Disconnected (they may have executed), or with why the server refused the connection.
        let refused = read_loop(r, &waiters, &room).await;
        closed.store(true, Ordering::Release);
        let mut w = lock(&waiters);
        if let Some(why) = refused {
            for (_, x) in w.drain() {
                let _ = x.done.send(Err(ClientError::Tls(why.clone())));
            }
        }
        w.clear();
        drop(w);
        room.notify_one();
    });
    Ok(live)
}

/// Presents `token` (an `auth` request alone in the connection's first frame) and waits for the
/// answer, before the connection carries anything else.
async fn authenticate(stream: &mut Stream, token: &[u8]) -> Result<(), ClientError> {
    let req = Request::new(u64::MAX, dpukv_proto::Op::Auth { token: token.to_vec() });
    if let Err(c) = req.op.validate() {
        return Err(ClientError::Invalid(c));
    }
    let mut buf = Vec::new();
    encode_requests(std::slice::from_ref(&req), &mut buf);
    stream.write_all(&buf).await?;
    let mut got = Vec::with_capacity(256);
    loop {
        if let Some(h) = frame_header(&got).map_err(ClientError::Protocol)? {
            if h.requests || h.total > 64 << 10 {
                return Err(ClientError::Protocol(DecodeError::Malformed("not an answer to auth")));
            }
            if got.len() >= h.total {
                let resps = decode_responses(&got[..h.total]).map_err(ClientError::Protocol)?;
                return match resps.into_iter().next() {
                    Some(Response { result: Ok(_), .. }) => Ok(()),
                    Some(Response { result: Err(e), .. }) => Err(ClientError::Server(e)),
                    None => Err(ClientError::Protocol(DecodeError::Malformed("no answer to auth"))),
                };
            }
        }
        if stream.read_buf(&mut got).await? == 0 {
            return Err(ClientError::Disconnected);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

async fn write_loop(
    mut w: WriteHalf<Stream>,
    mut rx: mpsc::Receiver<Queued>,
    waiters: Waiters,
    closed: Arc<AtomicBool>,
    room: Arc<Notify>,
) {
    let mut next_id = 1u64;
    let mut reqs = Vec::with_capacity(256);
    let mut buf = Vec::with_capacity(64 << 10);
    while let Some(first) = rx.recv().await {
        // Let the other runnable callers queue theirs (see the module documentation).
        tokio::task::yield_now().await;
        while lock(&waiters).len() >= MAX_IN_FLIGHT && !closed.load(Ordering::Acquire) {
            room.notified().await;
        }
        {
            let mut w = lock(&waiters);
            let mut bytes = 0;
            let mut next = Some(first);
            // Client-side batching: everything queued goes out in one frame (within limits).
            while let Some((mut req, waiter)) = next.take() {
                bytes += req.size_hint();
                req.id = next_id;
                next_id += 1;
                w.insert(req.id, waiter);
                reqs.push(req);
                if reqs.len() < dpukv_proto::limits::MAX_OPS_PER_FRAME && bytes < dpukv_proto::limits::MAX_FRAME / 4 {
                    next = rx.try_recv().ok();
                }
            }
            if closed.load(Ordering::Acquire) {
                w.clear();
                break;
            }
        }
        buf.clear();
        encode_requests(&reqs, &mut buf);
        reqs.clear();
        if w.write_all(&buf).await.is_err() {
            break;
        }
        if buf.capacity() > KEEP_BUFFER {
            buf = Vec::with_capacity(64 << 10);
        }
    }
    lock(&waiters).clear();
    // Tell the server we are done (TLS: close_notify; then FIN): it closes its end, and the
    // reader, which shares the stream, sees the end and stops. Dropping this half alone would
    // not close the socket.
    let _ = tokio::time::timeout(Duration::from_secs(5), w.shutdown()).await;
}

/// Reads until the connection closes, fails or sends bytes that are not protocol v1. Returns why
/// the server refused the connection if it did so before answering anything (a TLS alert, or
/// TLS spoken to a plain client): nothing sent on it was executed.
async fn read_loop(mut r: ReadHalf<Stream>, waiters: &Waiters, room: &Notify) -> Option<String> {
    let mut answered = false;
    let mut buf = Vec::with_capacity(2 * READ_CHUNK);
    let mut resps = Vec::with_capacity(256);
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        buf.reserve(READ_CHUNK);
        tokio::select! {
            got = r.read_buf(&mut buf) => match got {
                Ok(0) => return (!answered && dpukv_net::tls::looks_like_tls(&buf)).then(tls_spoken),
                Err(e) => return if answered { None } else { dpukv_net::tls::refusal(&e) },
                Ok(_) => {}
            },
            _ = sweep.tick() => {
                expire(waiters, room);
                continue;
            }
        }
        let Ok(used) = take_frames(&buf, &mut resps) else {
            return (!answered && dpukv_net::tls::looks_like_tls(&buf)).then(tls_spoken);
        };
        if !resps.is_empty() {
            answered = true;
            let mut w = lock(waiters);
            for resp in resps.drain(..) {
                if let Some(waiter) = w.remove(&resp.id) {
                    let _ = waiter.done.send(Ok(resp));
                }
            }
            drop(w);
            room.notify_one();
        }
        buf.drain(..used);
        if buf.is_empty() && buf.capacity() > KEEP_BUFFER {
            buf = Vec::with_capacity(2 * READ_CHUNK);
        } else if let Ok(Some(h)) = frame_header(&buf) {
            // Room for all of a large frame, so it is read in as few calls as possible.
            buf.reserve(h.total.saturating_sub(buf.len()));
        }
    }
}

fn tls_spoken() -> String {
    "the server speaks TLS and this client does not (give it the CA to trust)".to_string()
}

/// Fails the callers whose deadline passed with `TimedOut` (their ids stay unused: a late
/// response finds no waiter and is dropped).
fn expire(waiters: &Waiters, room: &Notify) {
    let now = Instant::now();
    let mut w = lock(waiters);
    let late: Vec<u64> = w.iter().filter(|(_, x)| x.deadline <= now).map(|(id, _)| *id).collect();
    if late.is_empty() {
        return;
    }
    for id in late {
        if let Some(x) = w.remove(&id) {
            let _ = x.done.send(Err(ClientError::TimedOut));
        }
    }
    drop(w);
    room.notify_one();
}

/// Decodes every complete response frame at the start of `buf` into `out`; returns the bytes
/// they took (what follows is the start of an incomplete frame).
fn take_frames(buf: &[u8], out: &mut Vec<Response>) -> Result<usize, DecodeError> {
    let mut pos = 0;
    while let Some(h) = frame_header(&buf[pos..])? {
        if h.requests {
            return Err(DecodeError::Malformed("a request frame from the server"));
        }
        if buf.len() - pos < h.total {
            break;
        }
        out.extend(decode_responses(&buf[pos..pos + h.total])?);
        pos += h.total;
    }
    Ok(pos)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use dpukv_proto::{Op, Reply, encode_responses};
    use tokio::net::TcpListener;

    use super::*;

    /// Takes the next complete request frame off the front of a fake server's read buffer, with
    /// its requests (all must be valid); None until one has arrived whole.
    pub(crate) fn next_frame(buf: &mut Vec<u8>) -> Option<Vec<Request>> {
        let h = frame_header(buf).expect("a request frame header")?;
        if buf.len() < h.total {
            return None;
        }
        let reqs = dpukv_proto::decode_requests(&buf[..h.total]).expect("a request frame");
        buf.drain(..h.total);
        Some(reqs.into_iter().map(|r| r.expect("a valid request")).collect())
    }

    fn resp(id: u64, value: &[u8]) -> Response {
        Response { id, version: id, replicated: false, result: Ok(Reply::Value(Some(value.to_vec()))) }
    }

    #[test]
    fn take_frames_decodes_every_complete_frame_and_stops_at_a_partial_one() {
        let mut bytes = Vec::new();
        encode_responses(&[resp(1, b"a"), resp(2, b"b")], &mut bytes);
        encode_responses(&[resp(3, b"c")], &mut bytes);
        let two_frames = bytes.len();
        encode_responses(&[resp(4, b"d")], &mut bytes);
        let mut out = Vec::new();
        assert_eq!(take_frames(&bytes, &mut out).expect("valid frames"), bytes.len());
        assert_eq!(out.iter().map(|r| r.id).collect::<Vec<_>>(), [1, 2, 3, 4]);
        // Every cut inside the last frame leaves it for the next read.
        for cut in two_frames..bytes.len() {
            out.clear();
            assert_eq!(take_frames(&bytes[..cut], &mut out).expect("valid prefix"), two_frames, "cut {cut}");
            assert_eq!(out.len(), 3);
        }
        let mut bad = bytes.clone();
        bad[4] = 9; // version
        assert!(take_frames(&bad, &mut out).is_err());
    }

    /// A fake server that answers every request frame in reverse order, one byte per write, then
    /// all in one write: the client's chunked reader must match every response to its caller.
    #[tokio::test]
    async fn responses_split_across_reads_and_out_of_order_reach_their_callers() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a local port");
        let addr = listener.local_addr().expect("bound").to_string();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("one client");
            s.set_nodelay(true).expect("nodelay");
            let mut buf = Vec::new();
            let mut round = 0;
            loop {
                let mut chunk = [0u8; 4096];
                let n = s.read(&mut chunk).await.expect("read");
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
                while let Some(reqs) = next_frame(&mut buf) {
                    let mut resps: Vec<Response> = reqs.into_iter().map(|r| resp(r.id, r.op.key())).collect();
                    resps.reverse();
                    let mut out = Vec::new();
                    for r in &resps {
                        encode_responses(std::slice::from_ref(r), &mut out);
                    }
                    round += 1;
                    if round % 2 == 1 {
                        for b in out {
                            s.write_all(&[b]).await.expect("write");
                        }
                    } else {
                        s.write_all(&out).await.expect("write");
                    }
                }
            }
        });
        let conn = Arc::new(Connection::open(&addr, None, None).await.expect("connect"));
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..200u32 {
            let conn = conn.clone();
            calls.spawn(async move {
                let key = format!("key{i}").into_bytes();
                let got = conn
                    .call(Request::new(0, Op::Get { key: key.clone() }), Duration::from_secs(10))
                    .await
                    .expect("answered");
                assert_eq!(got.result, Ok(Reply::Value(Some(key))));
            });
        }
        while let Some(r) = calls.join_next().await {
            r.expect("call task");
        }
    }

    /// A fake server that answers only when the client has stopped sending for 200 ms: the
    /// client must stop writing at `MAX_IN_FLIGHT` unanswered requests (plus one frame) and wait.
    #[tokio::test]
    async fn unanswered_requests_are_bounded() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a local port");
        let addr = listener.local_addr().expect("bound").to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("one client");
            let (mut buf, mut unanswered, mut most) = (Vec::new(), Vec::new(), 0);
            loop {
                let mut chunk = [0u8; 65536];
                match tokio::time::timeout(Duration::from_millis(200), s.read(&mut chunk)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return most,
                    Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
                    Err(_) => {
                        let mut out = Vec::new();
                        for id in unanswered.drain(..) {
                            encode_responses(&[resp(id, b"v")], &mut out);
                        }
                        s.write_all(&out).await.expect("write");
                        continue;
                    }
                }
                while let Some(reqs) = next_frame(&mut buf) {
                    unanswered.extend(reqs.into_iter().map(|r| r.id));
                    most = most.max(unanswered.len());
                }
            }
        });
        let conn = Arc::new(Connection::open(&addr, None, None).await.expect("connect"));
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..(MAX_IN_FLIGHT * 2 + 100) {
            let conn = conn.clone();
            calls.spawn(async move {
                let got = conn
                    .call(Request::new(0, Op::Get { key: format!("k{i}").into_bytes() }), Duration::from_secs(10))
                    .await;
                assert_eq!(got.expect("answered").result, Ok(Reply::Value(Some(b"v".to_vec()))));
            });
        }
        while let Some(r) = calls.join_next().await {
            r.expect("call task");
        }
        drop(conn);
        let most = server.await.expect("server task");
        assert!(most >= MAX_IN_FLIGHT, "the client kept only {most} in flight");
        assert!(most < MAX_IN_FLIGHT + dpukv_proto::limits::MAX_OPS_PER_FRAME, "{most} unanswered requests");
    }

    /// The server drops the first connection with a request in flight: that call fails with
    /// `Disconnected`, and the next call dials again and is answered.
    #[tokio::test]
    async fn a_lost_connection_fails_its_requests_and_is_dialled_again() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a local port");
        let addr = listener.local_addr().expect("bound").to_string();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("the first connection");
            let mut chunk = [0u8; 4096];
            assert!(s.read(&mut chunk).await.expect("read") > 0);
            drop(s);
            let (mut s, _) = listener.accept().await.expect("the second connection");
            let mut buf = Vec::new();
            loop {
                let n = s.read(&mut chunk).await.expect("read");
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
                while let Some(reqs) = next_frame(&mut buf) {
                    let mut out = Vec::new();
                    for r in reqs {
                        encode_responses(&[resp(r.id, b"v")], &mut out);
                    }
                    s.write_all(&out).await.expect("write");
                }
            }
        });
        let conn = Connection::open(&addr, None, None).await.expect("connect");
        let get = || Request::new(0, Op::Get { key: b"k".to_vec() });
        assert!(matches!(conn.call(get(), Duration::from_secs(10)).await, Err(ClientError::Disconnected)));
        let answered = conn.call(get(), Duration::from_secs(10)).await.expect("answered after re-dialling");
        assert_eq!(answered.result, Ok(Reply::Value(Some(b"v".to_vec()))));
    }

    /// A server that reads and never answers: the call fails with `TimedOut` at its deadline
    /// (swept by the connection's reader), and the connection stays usable for other calls.
    #[tokio::test]
    async fn an_unanswered_request_times_out_at_its_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a local port");
        let addr = listener.local_addr().expect("bound").to_string();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("one client");
            let mut chunk = [0u8; 4096];
            while s.read(&mut chunk).await.is_ok_and(|n| n > 0) {}
        });
        let conn = Connection::open(&addr, None, None).await.expect("connect");
        let started = std::time::Instant::now();
        let got = conn.call(Request::new(0, Op::Get { key: b"k".to_vec() }), Duration::from_millis(300)).await;
        assert!(matches!(got, Err(ClientError::TimedOut)), "{got:?}");
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(5), "{took:?}");
    }
}
