//! The device's links to the host: a few unix-socket connections shared by every client
//! connection (like a NIC's queues), each multiplexing forwarded writes under its own request ids
//! and routing the replies back. A link that breaks, or a request the host leaves unanswered for
//! the link timeout, fails what it carried with `outcome_unknown` (the host may or may not have
//! applied it); a write that could not even be sent fails with `unavailable` (it was not).
//!
//! Writes follow a failover as fast as reads do: once the host stops vouching for its region map
//! (its lease-bound authority lapsed: it is paused, cut off, or dead — [`HostVouch`]), the
//! device forwards no write (`unavailable`, not applied) and fails those it forwarded
//! (`outcome_unknown`) within [`VOUCH_CHECK`], so clients and gateways look the map up again
//! instead of waiting on a host that may never answer.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_proto::{ErrorCode, Request, Response, decode_responses, encode_requests, frame_header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use crate::conn::{Charge, Sink};
use crate::dpu::hot_keys::HotKeys;

/// Where a forwarded request's reply goes.
struct Route {
    client_id: u64,
    sink: Sink,
    charge: Charge,
    sent: Instant,
    /// The keys a write changes (hot keys: popular ones are synced once it is answered).
    keys: Vec<Vec<u8>>,
}

/// The keys `op` writes.
fn written_keys(op: &dpukv_proto::Op) -> Vec<Vec<u8>> {
    match op {
        op if op.code().is_write() => op.keys().map(<[u8]>::to_vec).collect(),
        _ => Vec::new(),
    }
}

/// A link's requests in flight, and whether the link is done (then nothing more is added: a
/// request that finds it closed was never sent).
#[derive(Default)]
struct InFlight {
    routes: HashMap<u64, Route>,
    closed: bool,
}

type Pending = Arc<Mutex<InFlight>>;

struct Link {
    tx: mpsc::Sender<Request>,
    pending: Pending,
    broken: Arc<AtomicBool>,
}

/// See the module documentation.
pub struct HostLinks {
    socket: PathBuf,
    links: Vec<tokio::sync::Mutex<Option<Link>>>,
    next: AtomicUsize,
    ids: AtomicU64,
    timeout: Duration,
    hot: Arc<HotKeys>,
    vouch: Arc<HostVouch>,
    /// Requests forwarded.
    pub forwarded: Arc<AtomicU64>,
    /// Requests failed because the host could not be reached or did not answer.
    pub unavailable: Arc<AtomicU64>,
}

/// Requests a link keeps in flight (and queued to send).
const LINK_QUEUE: usize = 8192;
/// How often a link looks at its host's vouch and at requests left unanswered.
pub const VOUCH_CHECK: Duration = Duration::from_millis(100);

/// Whether the host vouches for the region map it published (the announcement's valid-until
/// word, extended while its lease-bound authority lasts; docs/cluster.md §6): reopened when the
/// host publishes a new one. No announcement yet: the host is left to decide.
pub struct HostVouch {
    shm: PathBuf,
    cur: Mutex<Option<dpukv_storage::announce::Announcement>>,
}

impl HostVouch {
    /// The vouch of the host publishing in `shm`.
    pub fn new(shm: PathBuf) -> Arc<HostVouch> {
        Arc::new(HostVouch { shm, cur: Mutex::new(None) })
    }

    /// Whether the host vouches for its map now.
    pub fn holds(&self) -> bool {
        let mut cur = self.cur.lock().unwrap_or_else(|e| e.into_inner());
        if cur.as_ref().is_none_or(|a| a.closed()) {
            *cur = crate::pod::open_map(&self.shm).ok().map(|(_, a)| a);
        }
        cur.as_ref().is_none_or(|a| a.valid_now())
    }
}

fn lock(p: &Pending) -> std::sync::MutexGuard<'_, InFlight> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostLinks {
    /// `n` links to the host socket at `socket`, failing requests unanswered after `timeout`.
    /// `hot`: told each write's keys once the host answered it (or may have applied it).
    /// `vouch`: whether the host still vouches for its map (writes are neither forwarded nor
    /// left waiting once it does not).
    pub fn new(
        socket: PathBuf,
        n: usize,
        timeout: Duration,
        hot: Arc<HotKeys>,
        vouch: Arc<HostVouch>,
    ) -> Arc<HostLinks> {
        Arc::new(HostLinks {
            socket,
            links: (0..n.max(1)).map(|_| tokio::sync::Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            ids: AtomicU64::new(1),
            timeout,
            hot,
            vouch,
            forwarded: Arc::new(AtomicU64::new(0)),
            unavailable: Arc::new(AtomicU64::new(0)),
        })
    }

    /// A link of its own to the same host (the same timeout), sharing these links' counters,
    /// hot keys and vouch: a front door thread's, whose tasks run on its event loop. One link:
    /// what the thread's connections send in one turn of its loop goes in one frame.
    pub fn sibling(&self) -> Arc<HostLinks> {
        Arc::new(HostLinks {
            socket: self.socket.clone(),
            links: vec![tokio::sync::Mutex::new(None)],
            next: AtomicUsize::new(0),
            ids: AtomicU64::new(1),
            timeout: self.timeout,
            hot: self.hot.clone(),
            vouch: self.vouch.clone(),
            forwarded: self.forwarded.clone(),
            unavailable: self.unavailable.clone(),
        })
    }

    /// Forwards `req`; its reply (or the failure) goes to `sink` under its own id.
    pub async fn forward(&self, mut req: Request, charge: Charge, sink: Sink) {
        if !self.vouch.holds() {
            // Another node may lead these regions by now: not forwarded (not applied); the
            // client looks the map up again.
            self.unavailable.fetch_add(1, Ordering::Relaxed);
            let r = Response::error(
                req.id,
                ErrorCode::Unavailable,
                "this node's host is not renewing its authority: its region map may be stale",
            );
            return sink.send(r, charge);
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.links.len();
        let (tx, pending) = {
            let mut slot = self.links[i].lock().await;
            if slot.as_ref().is_none_or(|l| l.broken.load(Ordering::Acquire)) {
                *slot = self.connect().await;
            }
            match slot.as_ref() {
                Some(l) => (l.tx.clone(), l.pending.clone()),
                None => {
                    self.unavailable.fetch_add(1, Ordering::Relaxed);
                    let r = Response::error(req.id, ErrorCode::Unavailable, "host unavailable; retry");
                    return sink.send(r, charge);
                }
            }
        };
        let link_id = self.ids.fetch_add(1, Ordering::Relaxed);
        let client_id = std::mem::replace(&mut req.id, link_id);
        {
            let mut p = lock(&pending);
            if p.closed {
                // The link ended after it was picked: nothing was sent.
                drop(p);
                self.unavailable.fetch_add(1, Ordering::Relaxed);
                return sink
                    .send(Response::error(client_id, ErrorCode::Unavailable, "host unavailable; retry"), charge);
            }
            // (Copied only when hot keys are on: a write's hot path otherwise.)
            let keys = if self.hot.enabled() { written_keys(&req.op) } else { Vec::new() };
            p.routes.insert(link_id, Route { client_id, sink, charge, sent: Instant::now(), keys });
        }
        self.forwarded.fetch_add(1, Ordering::Relaxed);
        if tx.send(req).await.is_err()
            && let Some(r) = lock(&pending).routes.remove(&link_id)
        {
            // Never sent: not applied.
            self.unavailable.fetch_add(1, Ordering::Relaxed);
            r.sink.send(Response::error(r.client_id, ErrorCode::Unavailable, "host unavailable; retry"), r.charge);
        }
    }

    async fn connect(&self) -> Option<Link> {
        let stream = tokio::time::timeout(self.timeout, UnixStream::connect(&self.socket)).await.ok()?.ok()?;
        let (mut r, mut w) = stream.into_split();
        let pending: Pending = Arc::new(Mutex::new(InFlight::default()));
        let broken = Arc::new(AtomicBool::new(false));
        let (tx, mut rx) = mpsc::channel::<Request>(LINK_QUEUE);
        let b = broken.clone();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(256);
            let mut buf = Vec::with_capacity(64 << 10);
            let mut carry: Option<Request> = None;
            loop {
                let first = match carry.take() {
                    Some(r) => r,
                    None => match rx.recv().await {
                        Some(r) => r,
                        None => break,
                    },
                };
                // Frames stay under the protocol's limit (a request came in a frame of its own, so
                // any one fits); large values go a few at a time.
                let mut bytes = crate::conn::request_size(&first);
                batch.push(first);
                while batch.len() < dpukv_proto::limits::MAX_OPS_PER_FRAME {
                    match rx.try_recv() {
                        Ok(r) => {
                            let n = crate::conn::request_size(&r);
                            if bytes + n > dpukv_proto::limits::MAX_FRAME / 2 {
                                carry = Some(r);
                                break;
                            }
                            bytes += n;
                            batch.push(r);
                        }
                        Err(_) => break,
                    }
                }
                buf.clear();
                encode_requests(&batch, &mut buf);
                batch.clear();
                if w.write_all(&buf).await.is_err() {
                    break;
                }
                if buf.capacity() > 4 << 20 {
                    buf = Vec::with_capacity(64 << 10);
                }
            }
            b.store(true, Ordering::Release);
        });
        let (p, b, unavailable, timeout) = (pending.clone(), broken.clone(), self.unavailable.clone(), self.timeout);
        let (hot, vouch) = (self.hot.clone(), self.vouch.clone());
        tokio::spawn(async move {
            // A write whose outcome is unknown may be applied now or later (within the link's
            // timeout, while the host works through what it read): its keys are synced now and
            // again after that.
            let unknown = |keys: Vec<Vec<u8>>| {
                if keys.is_empty() {
                    return;
                }
                hot.on_write(&keys);
                let hot = hot.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(timeout).await;
                    hot.on_write(&keys);
                });
            };
            let fail_all = |p: &Pending, why: &str| {
                let routes: Vec<Route> = {
                    let mut p = lock(p);
                    p.closed = true;
                    p.routes.drain().map(|(_, r)| r).collect()
                };
                for r in routes {
                    unavailable.fetch_add(1, Ordering::Relaxed);
                    unknown(r.keys);
                    r.sink.send(Response::error(r.client_id, ErrorCode::OutcomeUnknown, why), r.charge);
                }
            };
            let mut buf: Vec<u8> = Vec::with_capacity(128 << 10);
            let mut tick = tokio::time::interval(VOUCH_CHECK);
            loop {
                buf.reserve(64 << 10);
                tokio::select! {
                    got = r.read_buf(&mut buf) => {
                        if !matches!(got, Ok(n) if n > 0) {
                            break;
                        }
                    }
                    _ = tick.tick() => {
                        // Requests the host has not answered in time — or at all, once it no
                        // longer vouches for its map (it may never answer: paused, cut off):
                        // their outcome is unknown.
                        let lapsed = !vouch.holds();
                        let late: Vec<Route> = {
                            let mut p = lock(&p);
                            let ids: Vec<u64> = p
                                .routes
                                .iter()
                                .filter(|(_, r)| lapsed || r.sent.elapsed() > timeout)
                                .map(|(id, _)| *id)
                                .collect();
                            ids.into_iter().filter_map(|id| p.routes.remove(&id)).collect()
                        };
                        let why = if lapsed {
                            "the host stopped renewing its authority; the write's outcome is unknown"
                        } else {
                            "the host did not answer in time"
                        };
                        for r in late {
                            unavailable.fetch_add(1, Ordering::Relaxed);
                            unknown(r.keys);
                            r.sink.send(Response::error(r.client_id, ErrorCode::OutcomeUnknown, why), r.charge);
                        }
                        continue;
                    }
                }
                let mut used = 0;
                loop {
                    match frame_header(&buf[used..]) {
                        Ok(Some(h)) if buf.len() - used >= h.total => {
                            let Ok(resps) = decode_responses(&buf[used..used + h.total]) else {
                                b.store(true, Ordering::Release);
                                fail_all(&p, "the host sent a malformed reply; outcome unknown");
                                return;
                            };
                            used += h.total;
                            for mut resp in resps {
                                if let Some(route) = lock(&p).routes.remove(&resp.id) {
                                    // Before the client sees the answer (the watermarks' rule).
                                    hot.on_write(&route.keys);
                                    resp.id = route.client_id;
                                    route.sink.send(resp, route.charge);
                                }
                            }
                        }
                        Ok(_) => break,
                        Err(_) => {
                            b.store(true, Ordering::Release);
                            fail_all(&p, "the host sent a malformed reply; outcome unknown");
                            return;
                        }
                    }
                }
                buf.drain(..used);
            }
            // The host went away: everything still forwarded has an unknown outcome.
            b.store(true, Ordering::Release);
            fail_all(&p, "host unavailable; the write's outcome is unknown");
        });
        Some(Link { tx, pending, broken })
    }
}
