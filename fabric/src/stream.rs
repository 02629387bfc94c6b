//! A byte stream over a connected libfabric endpoint ([`FabricStream`]: `AsyncRead` and
//! `AsyncWrite`, so everything above it — the binary protocol's framing, TLS — is the same as on
//! TCP), and the listener that accepts them ([`FabricListener`]).
//!
//! Each message is a 4-byte header, the receive credits its sender returns (little-endian u32),
//! then payload: bytes of the stream, in order. Each write is sent at once as one message (or
//! several, past a buffer's size), as a socket sends a write: code written for TCP never
//! flushes. Flow control is by credits: each side posts
//! `nbufs` receive buffers before the connection is established, a sender may have at most as
//! many messages unconsumed at its peer as the peer told it it has posted, and a receiver posts
//! a buffer again once its payload was read and returns the credit on its next message — or on a
//! message of its own (no payload) once it owes half its buffers. The last credit is kept for
//! such a message, so two peers that both stopped reading can never leave each other without a
//! credit to return credits with. Memory is bounded by the buffers registered when the
//! connection was made: 2 × `nbufs` × `bufsize` bytes, nothing more, whatever the peer sends.
//!
//! Progress: completions are polled on the caller's task; with nothing to do a poll spins up to
//! [`Options::spin`] times, then (when `fi_trywait` allows) waits for the queues' descriptors
//! through the runtime's reactor. The two halves of a split stream share one waker set, so
//! whichever half sees the descriptor ready wakes both.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::FabricError;
use crate::ffi::{self, CmEvent, Completion};

/// A connection's buffers and polling.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Bytes per message buffer (header included).
    pub bufsize: usize,
    /// Receive buffers posted (and send buffers held) per connection: the peer's credits.
    pub nbufs: usize,
    /// Empty polls of the completion queue before waiting on its descriptor (None: by the
    /// provider, see [`spin_for`]).
    pub spin: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options { bufsize: 64 << 10, nbufs: 16, spin: None }
    }
}

/// Empty polls before waiting, by provider: none for the providers over kernel sockets (`tcp`,
/// `sockets`, `udp`: each poll is a system call), 64 for the others (RDMA NICs, shared memory:
/// a poll reads memory the NIC writes, and waiting costs a wake-up).
pub fn spin_for(provider: &str) -> u32 {
    let base = provider.split(';').next().unwrap_or("");
    if matches!(base, "tcp" | "sockets" | "udp" | "net") { 0 } else { 64 }
}

impl Options {
    /// What dpukv's binary protocol uses on both ends — the device's endpoint and the client —
    /// and so what a peer must use: 16 buffers of 64 KiB each way (2 MiB registered per
    /// connection), the spin by provider. Both ends assume the other's buffer count.
    pub const PROTOCOL: Options = Options { bufsize: 64 << 10, nbufs: 16, spin: None };

    fn checked(self) -> Result<Self, FabricError> {
        if self.nbufs < 4 || self.nbufs > 1024 || self.bufsize < 64 || self.bufsize > 16 << 20 {
            return Err(FabricError::Options(format!(
                "{} buffers of {} bytes (4 to 1024 buffers of 64 bytes to 16 MiB)",
                self.nbufs, self.bufsize
            )));
        }
        Ok(self)
    }
}

/// Bytes of a message's header.
const HEADER: usize = 4;
/// Times one poll asks the provider again when it says something is pending but nothing moves,
/// before it yields.
const MAX_RETRIES: u32 = 64;
/// libfabric's code for an operation flushed when its endpoint closed.
const ECANCELED: i32 = 125;

/// A listening fabric endpoint.
pub struct FabricListener {
    inner: Mutex<ffi::Listener>,
    opts: Options,
    port: u16,
    provider: String,
}

impl FabricListener {
    /// Listens on `host:port` (0: any free port) with `provider` (empty: libfabric's first
    /// choice for connected message endpoints). Needs a Tokio runtime.
    pub fn bind(provider: &str, host: &str, port: u16, opts: Options) -> Result<Self, FabricError> {
        let opts = opts.checked()?;
        let mut l = ffi::Listener::listen(provider, host, &port.to_string(), opts.bufsize, opts.nbufs)?;
        let port = l.port()?;
        let provider = l.provider();
        Ok(FabricListener { inner: Mutex::new(l), opts, port, provider })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The provider it uses.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The next connection request, accepted. The connection is established once this end
    /// drives it — its first read, write, or [`FabricStream::established`] (providers with
    /// manual progress complete the handshake only then): whoever accepts gives each connection
    /// its own task, which waits for that within a deadline.
    pub async fn accept(&self) -> Result<FabricStream, FabricError> {
        self.accept_with(|| Some(())).await.map(|(s, ())| s)
    }

    /// [`FabricListener::accept`], admitting a request only when `admit` gives what the
    /// connection is to hold (a connection slot, its buffers' share of a memory budget) — asked
    /// before its buffers are registered; a request it refuses is refused at once.
    pub async fn accept_with<G>(&self, mut admit: impl FnMut() -> Option<G>) -> Result<(FabricStream, G), FabricError> {
        loop {
            let got = lock(&self.inner).accept_with(&mut admit)?;
            if let Some((c, held)) = got {
                let spin = self.opts.spin.unwrap_or_else(|| spin_for(&self.provider));
                return Ok((FabricStream::new(c, self.opts, spin), held));
            }
            std::future::poll_fn(|cx| lock(&self.inner).poll_ready(cx)).await?;
        }
    }

    /// The bytes each connection registers (its send and receive buffers).
    pub fn registered_per_connection(&self) -> usize {
        2 * self.opts.nbufs * self.opts.bufsize
    }
}

/// See the module documentation.
pub struct FabricStream {
    shared: Arc<Shared>,
}

struct Shared {
    wakers: Arc<Wakers>,
    state: Mutex<State>,
    spin: u32,
}

/// The tasks waiting on either half.
#[derive(Default)]
struct Wakers {
    reader: Mutex<Option<Waker>>,
    writer: Mutex<Option<Waker>>,
}

impl Wake for Wakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        for w in [&self.reader, &self.writer] {
            if let Some(w) = lock(w).take() {
                w.wake();
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Read,
    Write,
}

struct State {
    conn: ffi::Conn,
    nbufs: usize,
    bufsize: usize,
    connected: bool,
    /// The peer shut the connection down (reads end once what came is read).
    peer_shut: bool,
    /// This end shut it down.
    shut: bool,
    failed: Option<(std::io::ErrorKind, String)>,
    /// The event queue may hold something (a descriptor was ready since it was last read).
    cm_due: bool,
    /// Messages the peer can take now.
    credits: usize,
    /// Receive buffers posted again and not yet told to the peer.
    owed: usize,
    free_send: Vec<usize>,
    /// Sends the provider could not take yet (its queue was full), in order.
    unsent: VecDeque<(usize, usize)>,
    /// Received payloads not yet read: (buffer, from, to).
    ready: VecDeque<(usize, usize, usize)>,
}

impl FabricStream {
    /// Connects to `host:port` with `provider`; waits (up to `timeout`) until the connection
    /// is established. Needs a Tokio runtime.
    pub async fn connect(
        provider: &str,
        host: &str,
        port: u16,
        opts: Options,
        timeout: std::time::Duration,
    ) -> Result<FabricStream, FabricError> {
        let opts = opts.checked()?;
        let conn = ffi::Conn::connect(provider, host, &port.to_string(), opts.bufsize, opts.nbufs)?;
        let s = FabricStream::new(conn, opts, opts.spin.unwrap_or_else(|| spin_for(provider)));
        s.established(timeout).await.map_err(|e| match e {
            FabricError::TimedOut(_) => FabricError::TimedOut(format!("connecting to {host}:{port} over {provider}")),
            e => e,
        })?;
        Ok(s)
    }

    /// Waits (up to `timeout`) until the connection is established, driving its handshake.
    pub async fn established(&self, timeout: std::time::Duration) -> Result<(), FabricError> {
        match tokio::time::timeout(timeout, std::future::poll_fn(|cx| self.poll_connected(cx))).await {
            Ok(r) => r,
            Err(_) => Err(FabricError::TimedOut("waiting for the connection to be established".into())),
        }
    }

    fn new(conn: ffi::Conn, opts: Options, spin: u32) -> FabricStream {
        let state = State {
            conn,
            nbufs: opts.nbufs,
            bufsize: opts.bufsize,
            connected: false,
            peer_shut: false,
            shut: false,
            failed: None,
            cm_due: true,
            credits: opts.nbufs,
            owed: 0,
            free_send: (0..opts.nbufs).rev().collect(),
            unsent: VecDeque::new(),
            ready: VecDeque::new(),
        };
        FabricStream { shared: Arc::new(Shared { wakers: Arc::default(), state: Mutex::new(state), spin }) }
    }

    fn poll_connected(&self, cx: &mut Context<'_>) -> Poll<Result<(), FabricError>> {
        self.shared
            .poll_op(cx, Side::Write, |st| {
                if st.connected {
                    Some(Ok(()))
                } else if st.peer_shut {
                    Some(Err(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "the peer refused")))
                } else {
                    st.failed.as_ref().map(|(k, m)| Err(std::io::Error::new(*k, m.clone())))
                }
            })
            .map_err(FabricError::Io)
    }
}

impl Shared {
    /// Runs `op` until it answers, driving the connection between tries; waits (Pending) when
    /// nothing moves.
    fn poll_op<T>(
        &self,
        cx: &mut Context<'_>,
        side: Side,
        mut op: impl FnMut(&mut State) -> Option<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        let mine = if side == Side::Read { &self.wakers.reader } else { &self.wakers.writer };
        *lock(mine) = Some(cx.waker().clone());
        let mut st = lock(&self.state);
        let (mut spins, mut retries) = (0, 0);
        // Without polling first: a write with credits and a buffer to spare, or a read of what an
        // earlier poll received, needs no call into the provider.
        if let Some(r) = op(&mut st) {
            return Poll::Ready(r);
        }
        loop {
            let moved = st.drive();
            if let Some(r) = op(&mut st) {
                if moved {
                    self.wake_other(side);
                }
                return Poll::Ready(r);
            }
            if moved {
                self.wake_other(side);
                continue;
            }
            if spins < self.spin {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            match st.conn.may_wait() {
                Ok(true) => {}
                Ok(false) => {
                    // Something is pending: maybe a connection event (read at the next poll).
                    // Bounded: a provider that keeps saying so without anything moving is given
                    // the thread back (this task runs again at once), never spun on with the
                    // stream locked.
                    st.cm_due = true;
                    retries += 1;
                    if retries >= MAX_RETRIES {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    continue;
                }
                Err(e) => {
                    st.fail(e);
                    continue;
                }
            }
            // Whichever half waits, both are woken.
            let waker = Waker::from(self.wakers.clone());
            match st.conn.poll_ready(&mut Context::from_waker(&waker)) {
                Poll::Ready(Ok(())) => {
                    // (Either queue: its connection events are read at the next poll.)
                    st.cm_due = true;
                    spins = 0;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn wake_other(&self, side: Side) {
        let other = if side == Side::Read { &self.wakers.writer } else { &self.wakers.reader };
        if let Some(w) = lock(other).take() {
            w.wake();
        }
    }
}

impl State {
    fn fail(&mut self, e: FabricError) {
        if self.failed.is_none() {
            tracing::debug!(error = %e, "a fabric connection failed");
            self.failed = Some((std::io::ErrorKind::ConnectionReset, e.to_string()));
        }
    }

    fn io_error(&self) -> Option<std::io::Error> {
        self.failed.as_ref().map(|(k, m)| std::io::Error::new(*k, m.clone()))
    }

    /// Takes every completion, and connection events until connected or once a descriptor
    /// said the queues have news; whether anything changed.
    fn drive(&mut self) -> bool {
        let mut moved = false;
        let cm = std::mem::take(&mut self.cm_due) || !self.connected;
        while cm && !self.peer_shut {
            match self.conn.poll_cm() {
                Ok(CmEvent::Nothing) => break,
                Ok(CmEvent::Connected) => self.connected = true,
                Ok(CmEvent::Shutdown) => self.peer_shut = true,
                Err(e) => {
                    self.fail(e);
                    break;
                }
            }
            moved = true;
        }
        let mut done = [Completion::default(); 16];
        loop {
            let n = match self.conn.poll_cq(&mut done) {
                Ok(n) => n,
                Err(e) => {
                    self.fail(e);
                    break;
                }
            };
            if n == 0 {
                break;
            }
            moved = true;
            for c in &done[..n] {
                self.complete(c);
            }
        }
        while let Some(&(i, len)) = self.unsent.front() {
            match self.conn.send(i, len, self.nbufs, self.bufsize) {
                Ok(()) => {
                    self.unsent.pop_front();
                    moved = true;
                }
                Err(FabricError::Call { code: ffi::EAGAIN, .. }) => break,
                Err(e) => {
                    self.fail(e);
                    break;
                }
            }
        }
        self.return_credits();
        moved
    }

    fn complete(&mut self, c: &Completion) {
        let i = c.index as usize;
        if i >= self.nbufs {
            self.fail(FabricError::Protocol(format!("a completion of buffer {i} of {}", self.nbufs)));
            return;
        }
        if c.recv == 0 {
            self.free_send.push(i);
            if c.error != 0 {
                self.fail(ffi_error("send", c.error));
            }
            return;
        }
        if c.error == -ECANCELED {
            // Flushed: the connection is closing.
            self.peer_shut = true;
            return;
        }
        if c.error != 0 {
            self.fail(ffi_error("receive", c.error));
            return;
        }
        let len = c.len as usize;
        if len < HEADER || len > self.bufsize {
            self.fail(FabricError::Protocol(format!("a message of {len} bytes")));
            return;
        }
        let buf = self.conn.recv_buf(i, self.nbufs, self.bufsize);
        let granted = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        // (Credits in flight: sends not yet completed keep theirs until the peer returns them.)
        if self.credits + granted > self.nbufs {
            self.fail(FabricError::Protocol(format!("{granted} credits returned past {}", self.nbufs)));
            return;
        }
        self.credits += granted;
        if len > HEADER {
            self.ready.push_back((i, HEADER, len));
        } else {
            self.repost(i);
        }
    }

    fn repost(&mut self, i: usize) {
        match self.conn.post_recv(i, self.nbufs) {
            Ok(()) => self.owed += 1,
            Err(e) => self.fail(e),
        }
    }

    /// A message of its own for the credits owed, once half the buffers are owed (with the last
    /// credit, kept for this).
    fn return_credits(&mut self) {
        if self.owed < self.nbufs / 2 || !self.connected || self.failed.is_some() || self.peer_shut {
            return;
        }
        if self.credits == 0 {
            return;
        }
        let Some(i) = self.free_send.pop() else { return };
        self.credits -= 1;
        self.post(i, HEADER);
    }

    /// Sends the first `len` bytes of send buffer `i` (its credit taken), with the credits owed.
    fn post(&mut self, i: usize, len: usize) {
        let owed = std::mem::take(&mut self.owed) as u32;
        self.conn.send_buf(i, self.nbufs, self.bufsize)[..HEADER].copy_from_slice(&owed.to_le_bytes());
        if !self.unsent.is_empty() {
            self.unsent.push_back((i, len));
            return;
        }
        match self.conn.send(i, len, self.nbufs, self.bufsize) {
            Ok(()) => {}
            Err(FabricError::Call { code: ffi::EAGAIN, .. }) => self.unsent.push_back((i, len)),
            Err(e) => self.fail(e),
        }
    }
}

fn ffi_error(what: &'static str, code: i32) -> FabricError {
    FabricError::Call { what, code: -code, message: ffi::strerror(-code) }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl AsyncRead for FabricStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        self.shared.poll_op(cx, Side::Read, |st| {
            if let Some(&(i, from, to)) = st.ready.front() {
                let n = buf.remaining().min(to - from);
                buf.put_slice(&st.conn.recv_buf(i, st.nbufs, st.bufsize)[from..from + n]);
                if from + n == to {
                    st.ready.pop_front();
                    st.repost(i);
                    st.return_credits();
                } else if let Some(front) = st.ready.front_mut() {
                    front.1 += n;
                }
                return Some(Ok(()));
            }
            if let Some(e) = st.io_error() {
                return Some(Err(e));
            }
            // The end of the stream: the peer (or this end) shut it down.
            (st.peer_shut || st.shut).then_some(Ok(()))
        })
    }
}

impl AsyncWrite for FabricStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.shared.poll_op(cx, Side::Write, |st| {
            if let Some(e) = st.io_error() {
                return Some(Err(e));
            }
            if st.peer_shut || st.shut {
                return Some(Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the fabric connection is shut")));
            }
            if !st.connected {
                return None;
            }
            // Keep the last credit for returning credits.
            if st.credits < 2 {
                return None;
            }
            let i = st.free_send.pop()?;
            st.credits -= 1;
            let n = data.len().min(st.bufsize - HEADER);
            st.conn.send_buf(i, st.nbufs, st.bufsize)[HEADER..HEADER + n].copy_from_slice(&data[..n]);
            // Sent now, as a TCP write would be: code written for sockets does not flush.
            st.post(i, HEADER + n);
            Some(Ok(n))
        })
    }

    /// Hands the provider what it could not take before (its queue was full); every write was
    /// sent already. Like a socket's flush, it does not wait for the peer.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let mut st = lock(&self.shared.state);
        if !st.unsent.is_empty() {
            st.drive();
        }
        Poll::Ready(st.io_error().map_or(Ok(()), Err))
    }

    /// Ends the connection both ways (libfabric's connections have no half-close: the peer's
    /// reads end, and so do its writes). Waits until every send completed (the provider may drop
    /// what is still queued when the endpoint shuts down), then shuts the connection down.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.shared.poll_op(cx, Side::Write, |st| {
            let sent = st.unsent.is_empty() && st.free_send.len() == st.nbufs;
            if !(sent || st.failed.is_some() || st.peer_shut || !st.connected) {
                return None;
            }
            if !st.shut {
                st.shut = true;
                st.conn.shutdown();
            }
            Some(Ok(()))
        })
    }
}
