//! dpukv-client: the async client of dpukv's binary protocol (docs/architecture.md: depends on
//! `proto` only). A [`Client`] keeps a pool of connections; each connection batches the requests
//! queued on it into frames (client-side batching, KV-Direct §3.4) and keeps many in flight,
//! matching responses to requests by id as they come back, in any order.
//!
//! # Layout
//! - `error`: [`ClientError`].
//! - `conn`: one pipelined connection (writer and reader tasks).
//! - `control`: a client of the hosts' control API (`/cluster/*`: drains, splits, summary,
//!   events, backups), for `dpukv` and the gateway's console.
//! - `routing`: the region map and a connection pool per node: each request goes to its
//!   region's primary, naming the region and epoch; the map is refreshed when a node says it
//!   is stale.
//! - `local`: a device in the caller's own process (a front end embedded in a device), reached
//!   by a call instead of a connection.
//! - `hot`: the lookup table of replicated keys (hKVS), and reads counted by who served them.
//! - `fat_root`: per region, the top of the tree gets start from (Fat-B+Tree start hints).
//! - `trace`: the trace context a caller's requests carry (a task-local scope).
//! - `workload`: YCSB and cloud-storage workloads, key choosers, a latency histogram (bench).
//! - this module: [`Client`], the typed operations.

mod conn;
pub mod control;
mod error;
mod fat_root;
mod hot;
pub mod local;
/// Ports reserved machine-wide (moved to `dpukv-net`, where the operator's and the device
/// plugin's tests reach it too).
pub use dpukv_net::ports;
mod routing;
pub mod trace;
pub mod workload;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use dpukv_proto as proto;
use dpukv_proto::{Cmp, Consistency, Elem, ErrorCode, Op, ReduceOp, Reply, Request, Response, Session, VecOp, WriteOp};
pub use error::ClientError;
pub use hot::ReadCounts;

/// Result alias.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// How [`Client::call`] retries.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Stop retrying an operation this long after its first attempt. For exactly-once writes it
    /// must stay below the server's retry window (120 s; see docs/protocol.md) so a retry is
    /// always answered from the server's session table.
    pub deadline: Duration,
    /// How long one attempt may wait for its response.
    pub attempt_timeout: Duration,
    /// The first backoff between attempts (it doubles up to `max_backoff`).
    pub first_backoff: Duration,
    /// The longest backoff.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            deadline: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(10),
            first_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(500),
        }
    }
}

/// This client's exactly-once session: its id, the next write's sequence number, and the
/// sequence numbers whose calls have not finished (the smallest bounds what the server may
/// forget).
struct WriteSession {
    client: u64,
    next_seq: AtomicU64,
    unfinished: Mutex<BTreeSet<u64>>,
    /// Signalled when a write finishes (one waiting for room in the window may go).
    finished: tokio::sync::Notify,
}

/// Most sequence numbers from the oldest unfinished write to the next: the server keeps 1024
/// entries per client, so with fewer in the window it never drops one a retry may still need.
const SESSION_WINDOW: u64 = 1000;

impl WriteSession {
    fn new() -> WriteSession {
        // 64 random bits (std's hasher keys come from the OS's random source), so ids of
        // different clients collide with negligible probability. Any id but 0 is valid.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        h.write_u32(std::process::id());
        let client = h.finish().max(1);
        WriteSession {
            client,
            next_seq: AtomicU64::new(1),
            unfinished: Mutex::new(BTreeSet::new()),
            finished: tokio::sync::Notify::new(),
        }
    }

    /// A new sequence number, unfinished until [`WriteSession::finish`]; waits while the window
    /// behind the oldest unfinished write is full.
    async fn start(&self) -> u64 {
        loop {
            let wait = self.finished.notified();
            {
                let mut open = self.unfinished.lock().unwrap_or_else(|e| e.into_inner());
                let next = self.next_seq.load(Ordering::Relaxed);
                if open.first().is_none_or(|&oldest| next - oldest < SESSION_WINDOW) {
                    self.next_seq.store(next + 1, Ordering::Relaxed);
                    open.insert(next);
                    return next;
                }
            }
            wait.await;
        }
    }

    fn finish(&self, seq: u64) {
        self.unfinished.lock().unwrap_or_else(|e| e.into_inner()).remove(&seq);
        self.finished.notify_waiters();
    }

    /// Every seq below this has finished (the server may forget them).
    fn acked_below(&self) -> u64 {
        let open = self.unfinished.lock().unwrap_or_else(|e| e.into_inner());
        open.first().copied().unwrap_or_else(|| self.next_seq.load(Ordering::Relaxed))
    }
}

/// How a [`Client`] connects.
#[derive(Clone, Default)]
pub struct Options {
    /// Connections per node (at least 1).
    pub pool: usize,
    /// A bearer token presented on every connection (docs/gateway.md).
    pub token: Option<Arc<[u8]>>,
    /// TLS on every connection (`dpukv_net::tls::ClientTls::load`: the CA to trust, and a
    /// certificate to present to servers that ask for one).
    pub tls: Option<Arc<dpukv_net::tls::ClientTls>>,
    /// How gets may be served (hot-key replicas; docs/hot-keys.md): the default for the typed
    /// operations ([`Client::with_consistency`] changes it).
    pub consistency: Consistency,
    /// Most keys the lookup table of replicated keys holds (0: never read from replicas).
    pub hot_keys: Option<usize>,
    /// Most tree nodes cached per region for start hints (the fat root; 0: send no hints).
    /// None: none (a direct client pays the lookup on its own CPU; docs/benchmarks.md, "Fat
    /// root"); the gateway caches [`DEFAULT_FAT_ROOT`] by default.
    pub fat_root: Option<usize>,
    /// `extended` mode: more of this client's requests in flight to a primary than this make it
    /// busy, and gets of replicated keys go to a replica (None: [`BUSY_IN_FLIGHT`]).
    pub busy_in_flight: Option<usize>,
    /// The node whose device runs in this process (a front end embedded in it): requests for
    /// the regions it leads, and those for the seed when `addr` is `local:`, are answered by a
    /// call, not over a connection.
    pub local: Option<local::Local>,
}

/// The seed address that names the device in this process ([`Options::local`]).
pub const LOCAL_SEED: &str = "local:";

/// The gateway's fat-root budget by default: nodes per region.
pub const DEFAULT_FAT_ROOT: usize = 4096;

/// Lookup-table size when [`Options::hot_keys`] is None.
pub const DEFAULT_HOT_KEYS: usize = 100_000;

/// `extended` mode by default: a primary with more requests than this in flight from this client
/// is busy, and gets of replicated keys go to a replica ([`Options::busy_in_flight`]).
pub const BUSY_IN_FLIGHT: usize = 32;

/// A part of a range scan ([`Client::scan_part`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanPart {
    /// Keys and values, ascending.
    pub items: Vec<(Vec<u8>, Vec<u8>)>,
    /// The part stopped at a limit before the range's end (the rest may hold more items).
    pub more: bool,
}

/// The key right after `k` in byte order.
pub fn successor(k: &[u8]) -> Vec<u8> {
    let mut s = k.to_vec();
    s.push(0);
    s
}

/// Where a write's exactly-once tag comes from.
#[derive(Clone, Copy)]
enum Tag<'a> {
    /// This client's session and the write's sequence number.
    Own(&'a Arc<WriteSession>, u64),
    /// The tag another client gave the request (a gateway forwards it).
    Forwarded(Session),
}

/// A write's sequence number, finished when dropped.
struct Unfinished<'a>(&'a Arc<WriteSession>, u64);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        self.0.finish(self.1);
    }
}

/// A pool of pipelined connections to one endpoint.
///
/// Retries: reads are retried on any transient failure. A write whose outcome is unknown (the
/// connection broke, the attempt timed out, or the server answered `outcome_unknown`) is retried
/// only with its exactly-once tag — the client's random id and the write's sequence number — so
/// the server answers the retry from its record of the first attempt instead of applying it
/// again. Without sessions ([`Client::without_sessions`]) such a write fails with
/// [`ClientError::OutcomeUnknown`] and is never repeated.
#[derive(Clone)]
pub struct Client {
    router: Arc<routing::Router>,
    next: Arc<AtomicUsize>,
    session: Option<Arc<WriteSession>>,
    consistency: Consistency,
    hot: Arc<hot::HotKeyTable>,
    reads: Arc<ReadCounts>,
    fat: Arc<fat_root::FatRoots>,
    /// `extended` mode's threshold ([`Options::busy_in_flight`]).
    busy_in_flight: usize,
    /// How operations are retried.
    pub retry: RetryPolicy,
}

impl Client {
    /// Connects `pool` connections to `addr` (host:port), with exactly-once writes. `addr` is
    /// any node of a cluster (or a standalone node): requests are routed to their regions'
    /// primaries by the region map it answers (learned at the first request).
    pub async fn connect(addr: &str, pool: usize) -> Result<Client> {
        Self::connect_with(addr, Options { pool, ..Options::default() }).await
    }

    /// Like [`Client::connect`], presenting `token` on every connection (a gateway with tokens
    /// configured needs one: docs/gateway.md; devices accept any).
    pub async fn connect_with_token(addr: &str, pool: usize, token: &[u8]) -> Result<Client> {
        Self::connect_with(addr, Options { pool, token: Some(Arc::from(token)), ..Options::default() }).await
    }

    /// Connects with `opts` (pool size, token, TLS).
    pub async fn connect_with(addr: &str, opts: Options) -> Result<Client> {
        let (pool, token, tls) = (opts.pool.max(1), opts.token, opts.tls);
        let seed = match &opts.local {
            Some(l) if addr == LOCAL_SEED => Arc::new(routing::Pool::local(l.device.clone())),
            _ => {
                let mut conns = Vec::new();
                for _ in 0..pool {
                    conns.push(conn::Connection::open(addr, token.clone(), tls.clone()).await?);
                }
                Arc::new(routing::Pool::new(conns))
            }
        };
        Ok(Client {
            router: Arc::new(routing::Router::new(addr, pool, seed, token, tls, opts.local)),
            next: Arc::new(AtomicUsize::new(0)),
            session: Some(Arc::new(WriteSession::new())),
            consistency: opts.consistency,
            hot: Arc::new(hot::HotKeyTable::new(opts.hot_keys.unwrap_or(DEFAULT_HOT_KEYS))),
            reads: Arc::new(ReadCounts::default()),
            fat: Arc::new(fat_root::FatRoots::new(opts.fat_root.unwrap_or(0))),
            busy_in_flight: opts.busy_in_flight.unwrap_or(BUSY_IN_FLIGHT),
            retry: RetryPolicy::default(),
        })
    }

    /// This client without exactly-once tags: writes whose outcome is unknown are not retried.
    pub fn without_sessions(mut self) -> Client {
        self.session = None;
        self
    }

    /// This client (sharing its connections) reading with `c` by default.
    pub fn with_consistency(mut self, c: Consistency) -> Client {
        self.consistency = c;
        self
    }

    /// The consistency the typed operations read with.
    pub fn consistency(&self) -> Consistency {
        self.consistency
    }

    /// Gets served by primaries and by replicas so far (every clone of this client counted).
    pub fn read_counts(&self) -> Arc<ReadCounts> {
        self.reads.clone()
    }

    /// The exactly-once session's client id, if writes are tagged.
    pub fn session_id(&self) -> Option<u64> {
        self.session.as_ref().map(|s| s.client)
    }

    /// Sends one request on the next connection and waits for its response (no retries, no
    /// session tag unless `req` has one), at most [`RetryPolicy::attempt_timeout`].
    pub async fn send_request(&self, req: Request) -> Result<Response> {
        self.send_within(req, self.retry.attempt_timeout, true, None).await
    }

    /// Sends `req` to the primary of its key's region; `name`: name the region and its epoch
    /// (if `req` names none), so that a node leading it no more refuses it; `pin`: which of the
    /// device's connections to use (None: the next in turn).
    async fn send_within(
        &self,
        mut req: Request,
        timeout: Duration,
        name: bool,
        pin: Option<usize>,
    ) -> Result<Response> {
        if req.trace.is_none() {
            req.trace = trace::current();
        }
        if matches!(req.op, Op::Get { .. }) {
            self.reads.asked(req.consistency);
        }
        // A get that may be served by a replica, of a key a primary said is replicated.
        let hot = !req.replica
            && req.consistency != Consistency::Linearizable
            && matches!(req.op, Op::Get { .. })
            && self.hot.contains(req.op.key());
        let t = match self.router.target(&req, timeout, hot).await {
            Ok(t) => t,
            Err(e) => {
                // The node the map names cannot be reached (or there is no map): learn it again.
                self.router.invalidate();
                return Err(e);
            }
        };
        if name && req.region == 0 {
            (req.region, req.epoch) = (t.region, t.epoch);
        }
        let i = pin.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed));
        if hot && let Some(replica) = self.pick_replica(&req, &t) {
            let mut r = req.clone();
            (r.replica, r.region, r.epoch) = (true, t.region, t.epoch);
            match replica.call(i, r, timeout).await {
                Ok(resp @ Response { result: Ok(_), .. }) => {
                    self.reads.replica.fetch_add(1, Ordering::Relaxed);
                    return Ok(resp);
                }
                // No fresh copy there (or the replica failed): the primary answers.
                Ok(Response { result: Err(e), .. }) if e.code == ErrorCode::NotReplicated => {
                    self.hot.learn(req.op.key(), false)
                }
                _ => {}
            }
        }
        let hinted_key = match &req.op {
            Op::Get { key } => Some(key),
            // A scan from `lo` (a continuation starts elsewhere).
            Op::Scan { lo, token, .. } if token.is_empty() && !lo.is_empty() => Some(lo),
            _ => None,
        };
        if let Some(key) = hinted_key
            && req.hint.is_none()
            && t.region != 0
        {
            let (hint, wanted) = self.fat.hint(t.region, t.epoch, key);
            req.hint = hint;
            if let fat_root::Wanted::Build = wanted {
                self.build_fat_root(t.region, t.epoch, key.clone());
            }
        }
        // A get's key, to learn from its answer whether it is replicated (the request itself is
        // handed over: every other request, a write's value too, is not copied).
        let get_key = match &req.op {
            Op::Get { key } => Some(key.clone()),
            _ => None,
        };
        let r = t.pool.call(i, req, timeout).await;
        if let (Some(key), Ok(resp @ Response { result: Ok(_), .. })) = (&get_key, &r) {
            self.reads.primary.fetch_add(1, Ordering::Relaxed);
            if resp.replicated || self.hot.contains(key) {
                self.hot.learn(key, resp.replicated);
            }
        }
        // A node that says the map moved on (or cannot be reached): learn it again.
        let stale = match &r {
            Ok(Response { result: Err(e), .. }) => {
                // (An unknown outcome too: the node may have stopped leading the region.)
                matches!(
                    e.code,
                    ErrorCode::StaleEpoch | ErrorCode::WrongRegion | ErrorCode::Unavailable | ErrorCode::OutcomeUnknown
                )
            }
            Ok(_) => false,
            Err(_) => true,
        };
        if stale {
            self.router.invalidate();
        }
        r
    }

    /// Builds region `region`'s fat root in the background, asking the region's primary with
    /// `tree_nodes` (`key`: a key of the region, to route by).
    fn build_fat_root(&self, region: u32, epoch: u64, key: Vec<u8>) {
        let c = self.clone();
        tokio::spawn(async move {
            let fat = c.fat.clone();
            let expand = |nodes: Vec<dpukv_proto::TreeNode>| {
                let (c, key) = (c.clone(), key.clone());
                async move {
                    let mut r = Request::new(0, Op::TreeNodes { key, nodes });
                    (r.region, r.epoch) = (region, epoch);
                    match c.send_within(r, c.retry.attempt_timeout, false, None).await {
                        Ok(Response { result: Ok(Reply::TreeNodes { arena, nodes }), .. }) => Some((arena, nodes)),
                        _ => None,
                    }
                }
            };
            fat.build(region, epoch, expand).await;
        });
    }

    /// Which replica a get of a replicated key goes to under its consistency (None: the
    /// primary): `bounded` and `extended` (when the primary is busy) pick the least busy
    /// replica; `interleaved` the least busy of primary and replicas — devices that answer
    /// faster have fewer requests in flight, so reads spread by measured capacity.
    fn pick_replica<'a>(&self, req: &Request, t: &'a routing::Target) -> Option<&'a routing::Pool> {
        let least = t.replicas.iter().min_by_key(|p| p.in_flight())?;
        match req.consistency {
            Consistency::Linearizable => None,
            Consistency::Bounded { .. } => Some(least),
            Consistency::Extended => (t.pool.in_flight() > self.busy_in_flight).then_some(&**least),
            Consistency::Interleaved => (least.in_flight() <= t.pool.in_flight()).then_some(&**least),
        }
    }

    /// The region map this client routes by, as last learned (None before the first request).
    pub fn routing_map(&self) -> Option<Arc<dpukv_proto::regionmap::RegionMap>> {
        self.router.map()
    }

    /// The region map requests are routed by, learned first if this client has none (from its
    /// seed and every node it has talked to; the newest answer wins).
    pub async fn current_map(&self) -> Result<Arc<dpukv_proto::regionmap::RegionMap>> {
        match self.router.map() {
            Some(m) => Ok(m),
            None => self.router.refresh(self.retry.attempt_timeout).await,
        }
    }

    /// Forgets the region map: the next request learns it again. (A node says when a request
    /// went by a stale map; a process that wants changes sooner — a gateway — forgets it now
    /// and then.)
    pub fn forget_map(&self) {
        self.router.invalidate();
    }

    /// Sends one untagged request (no retries).
    pub async fn send(&self, op: Op) -> Result<Response> {
        self.send_request(Request::new(0, op)).await
    }

    /// Sends `op`, retrying what is safe to retry (see [`Client`]) with backoff until
    /// [`RetryPolicy::deadline`]; returns the reply and the version, or the final error.
    ///
    /// A scan or floor scan sent this way reads one page of the region holding its `lo`: the
    /// reply's token is empty at that region's end even when `hi` lies beyond it (docs/protocol.md
    /// §6). Use [`Client::scan`] to read a range across regions.
    pub async fn call(&self, op: Op) -> Result<(Reply, u64)> {
        let write = op.code().is_write();
        let session = self.session.as_ref().filter(|_| write);
        let seq = match session {
            Some(s) => Some(Unfinished(s, s.start().await)),
            None => None,
        };
        // `seq` finishes when dropped: also when this future is dropped mid-call.
        let tag = seq.as_ref().map(|u| Tag::Own(u.0, u.1));
        let mut req = Request::new(0, op);
        if matches!(req.op, Op::Get { .. }) {
            req.consistency = self.consistency;
        }
        self.call_inner(req, write, tag, None).await
    }

    /// Sends a request another client sent to this process (a gateway's front end): routed by
    /// its key and retried like [`Client::call`], except that a write keeps the sender's
    /// exactly-once tag (`req.session`, retried under it) and an untagged write whose outcome is
    /// unknown is never repeated (its sender chose not to tag it). The request's own region,
    /// epoch and id are replaced. Every outcome comes back as a response: a failure to reach the
    /// cluster is `unavailable` (nothing was applied) or `outcome_unknown` (a write may have
    /// been).
    pub async fn forward(&self, req: Request) -> Response {
        self.forward_on(req, None).await
    }

    /// Like [`Client::forward`]; the first attempt goes on the device's connection number
    /// `pin` (modulo the pool): requests forwarded together with one `pin` leave together, in
    /// one frame, and their answers come back together.
    pub async fn forward_on(&self, mut req: Request, pin: Option<usize>) -> Response {
        let id = req.id;
        let write = req.op.code().is_write();
        let tag = req.session.take().filter(|_| write).map(Tag::Forwarded);
        (req.id, req.region, req.epoch, req.replica) = (0, 0, 0, false);
        if !matches!(req.op, Op::Get { .. }) {
            // Only gets have copies on replicas; other reads are answered by primaries.
            req.consistency = Consistency::Linearizable;
        }
        match self.call_inner(req, write, tag, pin).await {
            Ok((reply, version)) => Response { id, version, replicated: false, result: Ok(reply) },
            Err(e) => Response { id, version: 0, replicated: false, result: Err(e.into_reply(write)) },
        }
    }

    /// A pin for [`Client::forward_on`]: the next connection in turn.
    pub fn next_pin(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    async fn call_inner(
        &self,
        mut req: Request,
        write: bool,
        tag: Option<Tag<'_>>,
        mut pin: Option<usize>,
    ) -> Result<(Reply, u64)> {
        let policy = self.retry;
        let started = tokio::time::Instant::now();
        let mut delay = policy.first_backoff;
        // Whether an earlier attempt may have been applied.
        let mut maybe_applied = false;
        loop {
            match tag {
                Some(Tag::Own(s, seq)) => {
                    req.session =
                        Some(Session { client: s.client, seq, acked_below: s.acked_below(), retry: maybe_applied })
                }
                Some(Tag::Forwarded(s)) => req.session = Some(Session { retry: s.retry || maybe_applied, ..s }),
                None => {}
            }
            // Only the first attempt is pinned: a retry goes on the next connection in turn.
            let err = match self.send_within(req.clone(), policy.attempt_timeout, true, pin.take()).await {
                Ok(Response { result: Ok(reply), version, .. }) => return Ok((reply, version)),
                Ok(Response { result: Err(e), .. }) => ClientError::Server(e),
                Err(e) => e,
            };
            let unknown = err.outcome_unknown();
            if write && unknown {
                maybe_applied = true;
            }
            // `wrong_region`: the request went by a stale map and was not executed.
            let moved = err.code() == Some(ErrorCode::WrongRegion);
            // A batch that spans regions by the map as it is now is refused again however often
            // it is sent: answered at once, for the caller to split (`batch_across_regions`) —
            // as outcome unknown if an earlier attempt may have been applied (a caller must not
            // send its writes again as new ones then: they could apply twice).
            if moved
                && matches!(req.op, Op::Batch { .. } | Op::AddTexts { .. })
                && self.spans_regions_now(req.op.keys()).await
            {
                return Err(if maybe_applied { ClientError::OutcomeUnknown(Box::new(err)) } else { err });
            }
            let retryable = err.is_retryable() || moved || (unknown && (!write || tag.is_some()));
            let out_of_time = started.elapsed() + delay > policy.deadline;
            if !retryable || out_of_time || (write && unknown && tag.is_none()) {
                return Err(if write && maybe_applied { ClientError::OutcomeUnknown(Box::new(err)) } else { err });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(policy.max_backoff);
        }
    }

    /// Whether `keys` fall in more than one region by the newest map (learnt again if the one in
    /// use was forgotten; false if it cannot be had).
    async fn spans_regions_now<'k>(&self, keys: impl Iterator<Item = &'k [u8]>) -> bool {
        let map = match self.router.map() {
            Some(m) => m,
            None => match self.router.refresh(self.retry.attempt_timeout).await {
                Ok(m) => m,
                Err(_) => return false,
            },
        };
        in_several_regions(&map, keys)
    }

    /// The value of `key`.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.call(Op::Get { key: key.to_vec() }).await?.0 {
            Reply::Value(v) => Ok(v),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Whether a device in this process ([`Options::local`]) answers the requests of the regions
    /// it leads (see [`Client::get_now`]).
    pub fn has_local(&self) -> bool {
        self.router.has_local()
    }

    /// The value of `key` if the device in this process ([`Options::local`]) leads its region
    /// by this client's map and answers at once — a get with no task, no retry loop and no
    /// copy of the request; None otherwise (then [`Client::get`] answers, with its retries:
    /// also when the device refused, so a stale map is learned again there).
    pub fn get_now(&self, key: &[u8]) -> Option<Result<Option<Vec<u8>>>> {
        let mut value = Vec::new();
        self.get_now_into(key, &mut value).map(|r| r.map(|found| found.map(|_| value)))
    }

    /// [`Client::get_now`] with the value appended to `out` (the device copies it there once,
    /// from where it is stored; nothing else is allocated): `Some(Ok(Some(version)))` when the key
    /// has a value (appended; the version of the entry that decided it), `Some(Ok(None))` when it
    /// has none, None when the device in this process does not answer it at once (then
    /// [`Client::get`] does).
    pub fn get_now_into(&self, key: &[u8], out: &mut Vec<u8>) -> Option<Result<Option<u64>>> {
        if !self.router.has_local() || key.is_empty() || key.len() > dpukv_proto::limits::MAX_KEY {
            return None; // no device here, or a key the full path refuses with its error
        }
        if self.consistency != Consistency::Linearizable && self.hot.contains(key) {
            return None; // a replica may serve it: the full path decides
        }
        let (found, replicated) = match self.router.get_local_into(key, out)? {
            local::GetInto::Value { version, replicated, .. } => (Some(version), replicated),
            local::GetInto::Missing { replicated } => (None, replicated),
            // Retryable, or the map moved on: the full path retries (and learns the map again).
            local::GetInto::Error(e)
                if e.code.is_retryable() || matches!(e.code, ErrorCode::StaleEpoch | ErrorCode::WrongRegion) =>
            {
                return None;
            }
            local::GetInto::Error(e) => return Some(Err(ClientError::Server(e))),
        };
        self.reads.primary.fetch_add(1, Ordering::Relaxed);
        if replicated || self.hot.contains(key) {
            self.hot.learn(key, replicated);
        }
        Some(Ok(found))
    }

    /// Upsert; returns the write's version.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Put { key: key.to_vec(), value: value.to_vec() }).await?.1)
    }

    /// Insert (fails with `KeyExists`).
    pub async fn insert(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Insert { key: key.to_vec(), value: value.to_vec() }).await?.1)
    }

    /// Update (fails with `KeyNotFound`).
    pub async fn update(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Update { key: key.to_vec(), value: value.to_vec() }).await?.1)
    }

    /// Delete.
    pub async fn delete(&self, key: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Delete { key: key.to_vec() }).await?.1)
    }

    /// Writes applied atomically. They must all fall in one region (a node answers
    /// `wrong_region` otherwise); [`Client::batch_across_regions`] splits them instead.
    pub async fn batch(&self, ops: Vec<WriteOp>) -> Result<u64> {
        let mut shares = self.by_region(ops).await?;
        if shares.len() > 1 {
            // Refused at once rather than retried as if the map were stale.
            return Err(ClientError::Server(dpukv_proto::ErrorReply {
                code: ErrorCode::WrongRegion,
                message: "a batch must stay within one region (batch_across_regions splits it)".into(),
            }));
        }
        let ops = shares.pop_first().map(|(_, ops)| ops).unwrap_or_default();
        Ok(self.call(Op::Batch { ops }).await?.1)
    }

    /// `ops` grouped by region (ids, by the map in use), each group in the order given.
    async fn by_region(&self, ops: Vec<WriteOp>) -> Result<std::collections::BTreeMap<u32, Vec<WriteOp>>> {
        let map = match self.router.map() {
            Some(m) => m,
            None => self.router.refresh(self.retry.attempt_timeout).await?,
        };
        let mut shares: std::collections::BTreeMap<u32, Vec<WriteOp>> = std::collections::BTreeMap::new();
        for op in ops {
            shares.entry(map.region_of(op.key()).map_or(0, |r| r.id)).or_default().push(op);
        }
        Ok(shares)
    }

    /// Writes `ops` split by region: each region's share is one atomic batch (in the order
    /// given), the shares go concurrently, and the whole is **not** atomic across regions — if
    /// one share fails, others may have been applied (each is retried exactly once as usual).
    /// A share refused because it spans regions by the cluster's map (a region split after
    /// this client's map was read: refused before anything was applied) is split again by the
    /// refreshed map and sent again, up to [`RESPLITS`] times. Returns the newest version, or
    /// the first error.
    pub async fn batch_across_regions(&self, ops: Vec<WriteOp>) -> Result<u64> {
        let mut newest = 0;
        let mut pending = ops;
        let mut refused: Vec<(Vec<WriteOp>, ClientError)> = Vec::new();
        for round in 0..=RESPLITS {
            if round > 0 {
                // Sent again only if the refreshed map splits it (else the refusal was not
                // about regions: it stands).
                let map = self.router.refresh(self.retry.attempt_timeout).await?;
                for (share, e) in refused.drain(..) {
                    if !in_several_regions(&map, share.iter().map(WriteOp::key)) {
                        return Err(e);
                    }
                    pending.extend(share);
                }
            }
            let mut tasks = tokio::task::JoinSet::new();
            for share in self.by_region(std::mem::take(&mut pending)).await?.into_values() {
                let (c, trace) = (self.clone(), trace::current());
                let call = async move {
                    let r = c.call(Op::Batch { ops: share.clone() }).await.map(|(_, v)| v);
                    (share, r)
                };
                tasks.spawn(trace::scope(trace, call));
            }
            let mut first_err = None;
            while let Some(r) = tasks.join_next().await {
                match r {
                    Ok((_, Ok(v))) => newest = newest.max(v),
                    Ok((share, Err(e))) if round < RESPLITS && spans_regions(&e) => refused.push((share, e)),
                    Ok((_, Err(e))) => {
                        first_err.get_or_insert(e);
                    }
                    Err(e) => {
                        first_err.get_or_insert(ClientError::Io(std::io::Error::other(e.to_string())));
                    }
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
            if refused.is_empty() {
                break;
            }
        }
        Ok(newest)
    }

    /// Up to `limit` items with keys in `[lo, hi]` (an empty `hi`: to the end of the key
    /// space), in key order, across regions (see [`Client::scan_part`]).
    pub async fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(self.scan_part(lo, hi, limit, 0).await?.items)
    }

    /// Like [`Client::scan`] from the largest key `<= lo` (from `lo` if there is none).
    pub async fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let from = self.floor_key(lo).await?.unwrap_or_else(|| lo.to_vec());
        self.scan(&from, hi, limit).await
    }

    /// The largest key `<= key`, if there is one: asked region by region, backwards from
    /// `key`'s, each request naming its region (so a node answers only for a region it leads).
    pub async fn floor_key(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let map = self.current_map().await?;
        let first = map.route(key);
        for i in (0..map.regions.len().min(first + 1)).rev() {
            let at = if i == first { key.to_vec() } else { map.regions[i].last_key().unwrap_or_default() };
            let op = Op::FloorScan { lo: at.clone(), hi: at.clone(), limit: 1, max_bytes: 0, token: Vec::new() };
            match self.call(op).await?.0 {
                Reply::Items { items, .. } => {
                    if let Some((k, _)) = items.into_iter().next().filter(|(k, _)| k.as_slice() <= at.as_slice()) {
                        return Ok(Some(k));
                    }
                }
                other => return Err(ClientError::unexpected(&other)),
            }
        }
        Ok(None)
    }

    /// Up to `max` keys inside `(lo, hi)` that cut it into parts holding similar shares of the
    /// data, from the index of `lo`'s region (only that region's part of the range): where a long
    /// scan can be split to be read in parallel. An estimate; none for a small range.
    pub async fn pivots(&self, lo: &[u8], hi: &[u8], max: u16) -> Result<Vec<Vec<u8>>> {
        let op = Op::Pivots { lo: lo.to_vec(), hi: hi.to_vec(), max: max.min(proto::limits::MAX_PIVOTS) };
        match self.call(op).await?.0 {
            Reply::Keys(keys) => Ok(keys),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// A part of the scan of `[lo, hi]` (an empty `hi`: to the end of the key space): up to
    /// `limit` items in key order, with at most about `max_bytes` of keys and values (0: no
    /// bound; a part always holds its first item). `more` says the part stopped at a limit
    /// before the range's end: the rest begins after its last key.
    ///
    /// Pages through the regions by the region map. Each page goes to the primary of its first
    /// key's region without naming the region, its upper bound cut at that region's end: the
    /// node reads on through regions it leads (a region split off from the one the map names)
    /// and answers `wrong_region` if the range runs into one it does not lead — then the map is
    /// learned again and the page planned again, from where the last one stopped. So an empty
    /// token means the page's range is done, and every key is seen once whatever the map did
    /// meanwhile. Each page is read at its own snapshot (per region).
    pub async fn scan_part(&self, lo: &[u8], hi: &[u8], limit: usize, max_bytes: usize) -> Result<ScanPart> {
        let mut out = ScanPart::default();
        let mut bytes = 0usize;
        let mut from = lo.to_vec();
        let policy = self.retry;
        let started = tokio::time::Instant::now();
        let mut delay = policy.first_backoff;
        let full = |n: usize, b: usize| n >= limit || (max_bytes != 0 && b >= max_bytes);
        while !full(out.items.len(), bytes) {
            if !hi.is_empty() && from.as_slice() > hi {
                return Ok(out);
            }
            let map = self.current_map().await?;
            let region = map.region_of(&from).cloned();
            let Some(region) = region else {
                return Err(ClientError::Server(dpukv_proto::ErrorReply {
                    code: ErrorCode::Unavailable,
                    message: "the region map is empty".into(),
                }));
            };
            // The page ends at the range's end, or at its region's.
            let (page_hi, last_page) = match region.last_key() {
                None => (hi.to_vec(), true),
                Some(r) if hi.is_empty() || r.as_slice() < hi => (r, false),
                Some(_) => (hi.to_vec(), true),
            };
            let want = (limit - out.items.len()).min(proto::limits::MAX_SCAN_ITEMS as usize) as u32;
            let want_bytes = if max_bytes == 0 {
                0
            } else {
                (max_bytes - bytes).clamp(1, proto::limits::MAX_SCAN_BYTES as usize) as u32
            };
            let op = Op::Scan { lo: from.clone(), hi: page_hi, limit: want, max_bytes: want_bytes, token: Vec::new() };
            let err = match self.send_within(Request::new(0, op), policy.attempt_timeout, false, None).await {
                Ok(Response { result: Ok(Reply::Items { items, token }), .. }) => {
                    delay = policy.first_backoff;
                    bytes += items.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
                    out.items.extend(items);
                    if !token.is_empty() {
                        // Cut by a limit: the rest of the page's range begins after its last key.
                        match out.items.last() {
                            Some((k, _)) => from = successor(k),
                            None => return Err(ClientError::Unexpected("a page with a token and no item".into())),
                        }
                    } else if last_page {
                        return Ok(out);
                    } else {
                        from = region.end.clone().unwrap_or_default();
                    }
                    continue;
                }
                Ok(Response { result: Ok(other), .. }) => return Err(ClientError::unexpected(&other)),
                Ok(Response { result: Err(e), .. }) => ClientError::Server(e),
                Err(e) => e,
            };
            // A read: retried on anything transient (the map is learned again where it moved).
            let moved = matches!(err.code(), Some(ErrorCode::WrongRegion | ErrorCode::StaleEpoch));
            let transient = err.is_retryable() || err.outcome_unknown() || moved;
            if !transient || started.elapsed() + delay > policy.deadline {
                return Err(err);
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(policy.max_backoff);
        }
        out.more = true;
        Ok(out)
    }

    /// Adds `delta` to the u64 value; returns the old value.
    pub async fn fetch_add(&self, key: &[u8], delta: u64) -> Result<u64> {
        match self.call(Op::FetchAdd { key: key.to_vec(), delta }).await?.0 {
            Reply::Scalar(s) => Ok(u64::from_le_bytes(s)),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Adds each of `deltas` in turn to the value read as decimal text (Redis's `INCRBY`; absent
    /// = 0), applied in order and made durable together; each increment's result, or none for
    /// one that would overflow (it had no effect). `TypeMismatch` if the value is not a decimal
    /// 64-bit integer.
    pub async fn add_text(&self, key: &[u8], deltas: &[i64]) -> Result<Vec<Option<i64>>> {
        match self.call(Op::AddText { key: key.to_vec(), deltas: deltas.to_vec() }).await?.0 {
            Reply::Added(r) if r.len() == deltas.len() => Ok(r),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// [`Client::add_text`] for several keys of one region at once (`adds`: each key and its
    /// deltas, at most [`dpukv_proto::limits::MAX_ADD_KEYS`] keys), applied whole or not at all
    /// under one version: every increment's result, key after key. `TypeMismatch` (nothing
    /// applied) if any value is not a decimal 64-bit integer; `WrongRegion` if the keys span
    /// regions.
    pub async fn add_texts(&self, adds: &[dpukv_proto::KeyDeltas]) -> Result<Vec<Option<i64>>> {
        let n: usize = adds.iter().map(|(_, d)| d.len()).sum();
        match self.call(Op::AddTexts { adds: adds.to_vec() }).await?.0 {
            Reply::Added(r) if r.len() == n => Ok(r),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Compare-and-swap; returns whether it swapped and the value found.
    pub async fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<(bool, Option<Vec<u8>>)> {
        let op = Op::CompareAndSwap { key: key.to_vec(), expected: expected.map(<[u8]>::to_vec), new: new.to_vec() };
        match self.call(op).await?.0 {
            Reply::Cas { swapped, current } => Ok((swapped, current)),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Element-wise update with a scalar.
    pub async fn vector_scalar(&self, key: &[u8], elem: Elem, op: VecOp, operand: [u8; 8]) -> Result<()> {
        self.call(Op::VectorScalar { key: key.to_vec(), elem, op, operand }).await.map(|_| ())
    }

    /// Element-wise update with a vector.
    pub async fn vector_vector(&self, key: &[u8], elem: Elem, op: VecOp, operand: Vec<u8>) -> Result<()> {
        self.call(Op::VectorVector { key: key.to_vec(), elem, op, operand }).await.map(|_| ())
    }

    /// Reduction (8 bytes, read as `elem`).
    pub async fn reduce(&self, key: &[u8], elem: Elem, op: ReduceOp) -> Result<[u8; 8]> {
        match self.call(Op::Reduce { key: key.to_vec(), elem, op }).await?.0 {
            Reply::Scalar(s) => Ok(s),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// The cluster's region map as the node knows it (a standalone node: its regions, all led by
    /// node 1, whose device address is empty — the node asked).
    pub async fn region_map(&self) -> Result<dpukv_proto::regionmap::RegionMap> {
        match self.call(Op::RegionMap).await?.0 {
            Reply::RegionMap(m) => Ok(m),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Node `node`'s device statistics (`stats`: a cluster role or an administrator only;
    /// docs/protocol.md §5), within one attempt's time.
    pub async fn device_stats(&self, node: u32) -> Result<dpukv_proto::stats::DeviceStats> {
        let pool = self.router.node_pool(node, self.retry.attempt_timeout).await?;
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let resp = pool.call(i, Request::new(0, Op::Stats), self.retry.attempt_timeout).await?;
        match resp.result {
            Ok(Reply::Stats(s)) => Ok(s),
            Ok(other) => Err(ClientError::unexpected(&other)),
            Err(e) => Err(ClientError::Server(e)),
        }
    }

    /// The elements matching `element cmp operand`.
    pub async fn filter(&self, key: &[u8], elem: Elem, cmp: Cmp, operand: [u8; 8]) -> Result<Vec<u8>> {
        match self.call(Op::Filter { key: key.to_vec(), elem, cmp, operand }).await?.0 {
            Reply::Vector(v) => Ok(v),
            other => Err(ClientError::unexpected(&other)),
        }
    }
}

/// How many times [`Client::batch_across_regions`] splits a refused share again.
pub const RESPLITS: usize = 5;

/// Whether `keys` fall in more than one region of `map` (keys no region holds not counted).
fn in_several_regions<'k>(map: &dpukv_proto::regionmap::RegionMap, keys: impl Iterator<Item = &'k [u8]>) -> bool {
    let mut ids = keys.filter_map(|k| map.region_of(k).map(|r| r.id));
    ids.next().is_some_and(|first| ids.any(|id| id != first))
}

/// Whether `e` refused a batch for spanning regions before any attempt of it may have been
/// applied (an outcome-unknown refusal is not: sending its writes again could apply them twice).
fn spans_regions(e: &ClientError) -> bool {
    match e {
        ClientError::Server(r) => matches!(r.code, ErrorCode::Unsupported | ErrorCode::WrongRegion),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use dpukv_proto::encode_responses;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A standalone node's region map: one region, led by node 1, reached at the address asked.
    fn standalone_map() -> dpukv_proto::regionmap::RegionMap {
        use dpukv_proto::regionmap::{NodeInfo, RegionInfo, RegionMap, RegionState};
        let region = RegionInfo {
            id: 1,
            start: vec![],
            end: None,
            primary: 1,
            backups: vec![],
            joining: vec![],
            epoch: 1,
            state: RegionState::Serving,
        };
        let node = NodeInfo {
            id: 1,
            device: String::new(),
            replication: String::new(),
            admin: String::new(),
            zone: String::new(),
            fabric: String::new(),
        };
        RegionMap { revision: 0, master: 0, regions: vec![region], nodes: vec![node] }
    }

    /// A server that drops each of its first `drop_first` connections after reading one request
    /// frame (the region map excepted), then answers every request `Done`; it records every
    /// request it read but the region map's.
    async fn flaky_server(drop_first: usize) -> (String, Arc<Mutex<Vec<Request>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a local port");
        let addr = listener.local_addr().expect("bound").to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            for n in 0.. {
                let Ok((mut s, _)) = listener.accept().await else { return };
                let log = log.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let Ok(got) = s.read(&mut chunk).await else { return };
                        if got == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..got]);
                        while let Some(reqs) = crate::conn::tests::next_frame(&mut buf) {
                            // The region map (a standalone node's) is always answered, and not
                            // counted: the client asks for it before its first request.
                            let map_only = reqs.iter().all(|r| r.op == Op::RegionMap);
                            if !map_only {
                                log.lock().expect("log").extend(reqs.iter().cloned());
                                if n < drop_first {
                                    return; // the request is "maybe applied"
                                }
                            }
                            let resps: Vec<Response> = reqs
                                .iter()
                                .map(|r| {
                                    let result = if r.op == Op::RegionMap {
                                        let map = standalone_map();
                                        Ok(Reply::RegionMap(map))
                                    } else {
                                        Ok(Reply::Done)
                                    };
                                    Response { id: r.id, version: 1, replicated: false, result }
                                })
                                .collect();
                            let mut out = Vec::new();
                            encode_responses(&resps, &mut out);
                            s.write_all(&out).await.expect("write");
                        }
                    }
                });
            }
        });
        (addr, seen)
    }

    #[tokio::test]
    async fn a_write_of_unknown_outcome_is_retried_only_with_its_session_tag() {
        let (addr, seen) = flaky_server(1).await;
        let c = Client::connect(&addr, 1).await.expect("connect");
        c.put(b"k", b"v").await.expect("retried with its tag, then answered");
        let seen = seen.lock().expect("log").clone();
        assert_eq!(seen.len(), 2, "one attempt lost, one retry");
        let (a, b) = (seen[0].session.expect("tagged"), seen[1].session.expect("tagged"));
        assert_eq!((a.client, a.seq, a.retry), (c.session_id().expect("session"), 1, false));
        assert_eq!((b.client, b.seq, b.retry), (a.client, 1, true), "the retry names the same write");
        // The next write is the next seq, and tells the server seq 1 is done.
        let (addr2, seen2) = flaky_server(0).await;
        let c2 = Client { router: Client::connect(&addr2, 1).await.expect("connect").router, ..c.clone() };
        c2.delete(b"k").await.expect("answered");
        let s = seen2.lock().expect("log")[0].session.expect("tagged");
        assert_eq!((s.seq, s.acked_below, s.retry), (2, 2, false));
    }

    #[tokio::test]
    async fn without_sessions_a_write_of_unknown_outcome_is_never_repeated() {
        let (addr, seen) = flaky_server(1).await;
        let c = Client::connect(&addr, 1).await.expect("connect").without_sessions();
        let err = c.fetch_add(b"n", 1).await.expect_err("its outcome is unknown");
        assert!(matches!(err, ClientError::OutcomeUnknown(_)), "{err:?}");
        assert_eq!(seen.lock().expect("log").len(), 1, "sent once, never again");
        assert!(seen.lock().expect("log")[0].session.is_none());
        // Reads are retried (and never tagged).
        let (addr, seen) = flaky_server(1).await;
        let c = Client::connect(&addr, 1).await.expect("connect").without_sessions();
        assert!(matches!(c.call(Op::Get { key: b"k".to_vec() }).await, Ok((Reply::Done, 1))));
        // (The fat root's `tree_nodes` requests aside.)
        let gets = seen.lock().expect("log").iter().filter(|r| matches!(r.op, Op::Get { .. })).count();
        assert_eq!(gets, 2);
    }

    /// A batch refused as spanning regions after an earlier attempt may have been applied is
    /// not one to split and send again as new writes (they could apply twice): only a plain
    /// refusal is.
    #[test]
    fn only_a_batch_refused_before_any_attempt_may_have_applied_is_split_again() {
        let refused =
            || ClientError::Server(dpukv_proto::ErrorReply { code: ErrorCode::WrongRegion, message: "spans".into() });
        assert!(spans_regions(&refused()));
        assert!(!spans_regions(&ClientError::OutcomeUnknown(Box::new(refused()))));
    }

    #[tokio::test]
    async fn retries_stop_at_the_deadline() {
        let (addr, seen) = flaky_server(usize::MAX).await;
        let mut c = Client::connect(&addr, 1).await.expect("connect");
        c.retry.deadline = Duration::from_secs(1);
        let started = std::time::Instant::now();
        let err = c.put(b"k", b"v").await.expect_err("never answered");
        assert!(matches!(err, ClientError::OutcomeUnknown(_)), "{err:?}");
        // Stopped at the deadline (loosely: the machine may be slow), not retrying forever.
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
        assert!(seen.lock().expect("log").len() > 2, "retried until the deadline");
    }
}
