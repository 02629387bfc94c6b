//! The read engine, shared by the device (its normal job) and the host (the
//! `--serve-reads-on-host` baseline): a fixed pool of reader threads — like a NIC's cores — each
//! owning one [`RegionReader`] per region, fed by bounded queues. Connections never own readers
//! (so connections are limited only by `--max-connections`, not by reader slots) and never run a
//! read on the async runtime (a read may page-fault on a mapped level or log segment).
//!
//! A reader thread learns the region map from the pod's shared directory (module `pod`) and
//! reloads it, and its readers, when a new host replaces it.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dpukv_client::local::GetInto;
use dpukv_proto::limits::{MAX_SCAN_BYTES, MAX_SCAN_ITEMS};
use dpukv_proto::{ErrorCode, ErrorReply, Op, Reply, Request, Response, ScanToken};
use dpukv_storage::ReadStats;
use dpukv_storage::announce::Announcement;
use dpukv_storage::region::RegionReader;
use tokio::sync::mpsc;

use crate::conn::{Charge, Sink, response_size};
use crate::pod;
use crate::regions::RegionMap;

/// Maps a storage error to a protocol error response.
pub fn storage_error(id: u64, e: &dpukv_storage::Error, write: bool) -> Response {
    Response::error(id, storage_code(e, write), e.code())
}

/// The protocol error code of a storage error (see [`storage_error`]).
fn storage_code(e: &dpukv_storage::Error, write: bool) -> ErrorCode {
    match e {
        dpukv_storage::Error::KeySize { .. } => ErrorCode::KeySize,
        dpukv_storage::Error::ValueTooLarge { .. } | dpukv_storage::Error::BatchTooLarge { .. } => {
            ErrorCode::ValueTooLarge
        }
        dpukv_storage::Error::KeyExists => ErrorCode::KeyExists,
        dpukv_storage::Error::KeyNotFound => ErrorCode::KeyNotFound,
        // Only a write can have an unknown outcome; a read that failed just failed, and an I/O
        // error under a read is most often a host replacing files (the reader reopens): retry.
        e if write && e.outcome_unknown() => ErrorCode::OutcomeUnknown,
        dpukv_storage::Error::Io { .. } if !write => ErrorCode::Unavailable,
        e if e.is_retryable() => ErrorCode::Unavailable,
        _ => ErrorCode::Internal,
    }
}

/// Why a read is refused before anything is read: the host has published no regions yet.
const NOT_PUBLISHED: &str = "the host has not published its regions yet; retry";
/// ... or has stopped vouching for its map (its lease could not be renewed, or it died): another
/// node may lead these regions by now.
const NOT_VOUCHED: &str = "this node's host is not renewing its authority: its region map may be stale";

/// Counters of the read engine.
#[derive(Debug, Default)]
pub struct ReadCounters {
    /// Reads executed.
    pub served: AtomicU64,
    /// Tree node buffers visited by reads (over `snapshots`: node visits per read).
    pub node_visits: AtomicU64,
    /// Arena snapshots taken by reads.
    pub snapshots: AtomicU64,
    /// Page-table changes applied from the arenas' command rings.
    pub ring_commands: AtomicU64,
    /// Page-table copies taken (first use, and after falling a ring behind).
    pub page_table_copies: AtomicU64,
    /// Interior nodes served from the node cache.
    pub cache_hits: AtomicU64,
    /// Interior nodes read from host memory.
    pub cache_misses: AtomicU64,
    /// Gets that started where their start hint said (fat root).
    pub hinted: AtomicU64,
    /// Gets whose start hint was stale (they started at the root).
    pub hint_misses: AtomicU64,
}

/// Sees each get a reader thread served from a region this node leads (the device's hot keys,
/// `dpu::hot_keys`); answers whether the key is replicated (the reply's flag).
pub trait ReadObserver: Send + Sync {
    /// A get of `key` in `region` was served.
    fn on_get(&self, region: &dpukv_proto::regionmap::RegionInfo, key: &[u8]) -> bool;
}

/// Reads of one frame of one connection, answered together.
struct Job {
    reqs: Vec<(Request, Charge)>,
    sink: Sink,
}

/// See the module documentation.
pub struct ReadPool {
    queues: Vec<mpsc::Sender<Job>>,
    next: AtomicUsize,
    /// Reader states for gets served on the caller's thread ([`ReadPool::serve_now`]): one is
    /// taken for a get and put back after, so there are at most as many as threads ever called
    /// at once (the device's async workers).
    inline: Arc<std::sync::Mutex<Vec<ReaderThread>>>,
    shm: PathBuf,
    device: bool,
    counters: Arc<ReadCounters>,
    observer: Option<Arc<dyn ReadObserver>>,
}

/// Reads queued per reader thread.
const QUEUE: usize = 1024;

/// A get served on the caller's thread that takes longer than this is logged.
const SLOW_INLINE: std::time::Duration = std::time::Duration::from_millis(50);

/// A reader thread idle this long lets go of what the host retired.
const IDLE_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

impl ReadPool {
    /// Starts `threads` reader threads on the pod's shared directory `shm`; `device`: read arenas
    /// through page-table copies fed by their command rings (the device), else through the page
    /// tables (the host's CPU).
    /// `observer` sees every get served (hot keys).
    pub fn start(
        shm: PathBuf,
        threads: usize,
        device: bool,
        counters: Arc<ReadCounters>,
        observer: Option<Arc<dyn ReadObserver>>,
    ) -> std::io::Result<ReadPool> {
        let mut queues = Vec::new();
        for i in 0..threads.max(1) {
            let (tx, rx) = mpsc::channel(QUEUE);
            let (shm, counters, observer) = (shm.clone(), counters.clone(), observer.clone());
            let rt = tokio::runtime::Handle::try_current().ok();
            std::thread::Builder::new().name(format!("dpukv-read-{i}")).spawn(move || {
                ReaderThread { shm, device, counters, observer, state: None, seen: ReadStats::default() }.run(rx, rt)
            })?;
            queues.push(tx);
        }
        let inline: Arc<std::sync::Mutex<Vec<ReaderThread>>> = Default::default();
        {
            // The inline states let go of what the host retired as the threads' do when idle.
            let inline = Arc::downgrade(&inline);
            std::thread::Builder::new().name("dpukv-read-idle".into()).spawn(move || {
                while let Some(states) = inline.upgrade() {
                    for s in states.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
                        s.refresh();
                    }
                    drop(states);
                    std::thread::sleep(IDLE_REFRESH);
                }
            })?;
        }
        Ok(ReadPool { queues, next: AtomicUsize::new(0), inline, shm, device, counters, observer })
    }

    /// The pod's shared directory the readers read.
    pub fn shm(&self) -> &std::path::Path {
        &self.shm
    }

    /// Serves one get on the calling thread, as a reader thread would (same checks, same
    /// counters): no hand-off to a reader thread and back, for a front end in the device's own
    /// process. A get is bounded work — one descent and one value read from memory the host
    /// maps — but a value in a log segment not in the page cache is read from disk on this
    /// thread.
    pub fn serve_now(&self, req: &Request) -> Response {
        let began = std::time::Instant::now();
        let resp = self.inline_read(|reader| reader.serve(req));
        let took = began.elapsed();
        if took > SLOW_INLINE {
            tracing::warn!(?took, "a get served on a front door thread was slow (its connections waited)");
        }
        resp
    }

    /// [`ReadPool::serve_now`] of a get of `key` (naming `region` and `epoch`, 0: any), its
    /// value appended to `out`: the same checks and counters, and no allocation but `out`'s
    /// growth (a reader state is reused; the value is copied once, from where it is stored).
    /// Not timed: a caller that answers connections on this thread logs a slow one.
    pub fn get_into(&self, region: u32, epoch: u64, key: &[u8], out: &mut Vec<u8>) -> GetInto {
        self.inline_read(|reader| reader.get_into(region, epoch, key, out))
    }

    /// Runs one read on the calling thread with a reader state taken from the pool (a new one
    /// if none is free) and put back after, counted as served.
    fn inline_read<T>(&self, read: impl FnOnce(&mut ReaderThread) -> T) -> T {
        let taken = self.inline.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut reader = taken.unwrap_or_else(|| ReaderThread {
            shm: self.shm.clone(),
            device: self.device,
            counters: self.counters.clone(),
            observer: self.observer.clone(),
            state: None,
            seen: ReadStats::default(),
        });
        let out = read(&mut reader);
        self.counters.served.fetch_add(1, Ordering::Relaxed);
        self.inline.lock().unwrap_or_else(|e| e.into_inner()).push(reader);
        out
    }

    /// Queues reads (of one connection) for one reader thread, which answers them together
    /// through `sink` (waits while that thread's queue is full).
    /// A frame holding several scans (a gateway reading a long scan's pieces in parallel batches
    /// them into one frame) has each scan read by the next thread, so they run in parallel; the
    /// frame's point reads stay together.
    pub async fn submit(&self, mut reqs: Vec<(Request, Charge)>, sink: Sink) {
        let is_scan = |r: &Request| matches!(r.op, Op::Scan { .. } | Op::FloorScan { .. });
        if self.queues.len() > 1 && reqs.iter().filter(|(r, _)| is_scan(r)).count() > 1 {
            let (scans, points): (Vec<_>, Vec<_>) = reqs.into_iter().partition(|(r, _)| is_scan(r));
            for scan in scans {
                self.submit_job(vec![scan], sink.clone()).await;
            }
            reqs = points;
        }
        self.submit_job(reqs, sink).await
    }

    async fn submit_job(&self, reqs: Vec<(Request, Charge)>, sink: Sink) {
        if reqs.is_empty() {
            return;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.queues.len();
        if let Err(mpsc::error::SendError(job)) = self.queues[i].send(Job { reqs, sink }).await {
            let out = job
                .reqs
                .into_iter()
                .map(|(r, c)| (Response::error(r.id, ErrorCode::Unavailable, "the read engine stopped"), c))
                .collect();
            job.sink.send_many(out);
        }
    }
}

/// The region map a reader thread (or the device's hot-key sync thread) reads by, and a reader
/// per region (opened on first use).
pub(crate) struct Regions {
    map: RegionMap,
    announcement: Announcement,
    readers: Vec<Option<RegionReader>>,
}

struct ReaderThread {
    shm: PathBuf,
    device: bool,
    counters: Arc<ReadCounters>,
    observer: Option<Arc<dyn ReadObserver>>,
    state: Option<Regions>,
    seen: ReadStats,
}

impl ReaderThread {
    fn run(mut self, mut rx: mpsc::Receiver<Job>, rt: Option<tokio::runtime::Handle>) {
        loop {
            // Work already queued is taken without parking (or entering the runtime).
            let job = match rx.try_recv() {
                Ok(job) => job,
                Err(mpsc::error::TryRecvError::Disconnected) => break,
                Err(mpsc::error::TryRecvError::Empty) => match &rt {
                    Some(rt) => match rt.block_on(async { tokio::time::timeout(IDLE_REFRESH, rx.recv()).await }) {
                        Ok(Some(job)) => job,
                        Ok(None) => break,
                        Err(_) => {
                            self.refresh();
                            continue;
                        }
                    },
                    None => match rx.blocking_recv() {
                        Some(job) => job,
                        None => break,
                    },
                },
            };
            let n = job.reqs.len() as u64;
            let out = job
                .reqs
                .into_iter()
                .map(|(req, mut charge)| {
                    let resp = self.serve(&req);
                    charge.shrink_to(response_size(&resp));
                    (resp, charge)
                })
                .collect();
            self.counters.served.fetch_add(n, Ordering::Relaxed);
            job.sink.send_many(out);
        }
    }

    /// While idle: lets go of what the host retired (arenas, deleted log segments, a closed
    /// map), which this thread's readers would otherwise keep mapped until their next read.
    fn refresh(&mut self) {
        if self.state.as_ref().is_some_and(Regions::closed) {
            self.state = None;
        }
        if let Some(s) = &mut self.state {
            s.refresh();
        }
    }

    /// Serves `req` from the current regions (loaded on first use, and again once a new host
    /// closed the map).
    fn serve(&mut self, req: &Request) -> Response {
        let Some(regions) = current(&mut self.state, &self.shm) else {
            return Response::error(req.id, ErrorCode::Unavailable, NOT_PUBLISHED);
        };
        let resp = serve(regions, &self.shm, self.device, self.observer.as_deref(), req);
        self.account();
        resp
    }

    /// [`ReaderThread::serve`] of a get (see [`ReadPool::get_into`]).
    fn get_into(&mut self, region: u32, epoch: u64, key: &[u8], out: &mut Vec<u8>) -> GetInto {
        let refused = |code, message: &str| GetInto::Error(ErrorReply { code, message: message.into() });
        let Some(regions) = current(&mut self.state, &self.shm) else {
            return refused(ErrorCode::Unavailable, NOT_PUBLISHED);
        };
        if !regions.vouched() {
            return refused(ErrorCode::Unavailable, NOT_VOUCHED);
        }
        let i = match regions.map.check_key(key, region, epoch) {
            Ok(i) => i,
            Err((code, what)) => return refused(code, what),
        };
        let got = regions.reader(i, &self.shm, self.device).and_then(|r| r.get_into(key, None, out));
        let answer = match got {
            Ok((found, version)) => {
                let replicated = self.observer.as_ref().is_some_and(|o| o.on_get(&regions.map.regions()[i], key));
                match found {
                    Some(len) => GetInto::Value { len, version, replicated },
                    None => GetInto::Missing { replicated },
                }
            }
            Err(e) => {
                regions.failed(i, &e);
                refused(storage_code(&e, false), e.code())
            }
        };
        self.account();
        answer
    }

    /// Adds what the readers counted since last time to the shared counters.
    fn account(&mut self) {
        let Some(s) = &self.state else { return };
        let now = s.readers.iter().flatten().map(RegionReader::read_stats).fold(ReadStats::default(), add);
        let c = &self.counters;
        let d = |a: u64, b: u64| a.saturating_sub(b);
        c.node_visits.fetch_add(d(now.node_visits, self.seen.node_visits), Ordering::Relaxed);
        c.snapshots.fetch_add(d(now.snapshots, self.seen.snapshots), Ordering::Relaxed);
        c.ring_commands.fetch_add(d(now.commands, self.seen.commands), Ordering::Relaxed);
        c.page_table_copies.fetch_add(d(now.resyncs, self.seen.resyncs), Ordering::Relaxed);
        c.cache_hits.fetch_add(d(now.cache_hits, self.seen.cache_hits), Ordering::Relaxed);
        c.cache_misses.fetch_add(d(now.cache_misses, self.seen.cache_misses), Ordering::Relaxed);
        c.hinted.fetch_add(d(now.hinted, self.seen.hinted), Ordering::Relaxed);
        c.hint_misses.fetch_add(d(now.hint_misses, self.seen.hint_misses), Ordering::Relaxed);
        self.seen = now;
    }
}

fn add(a: ReadStats, b: ReadStats) -> ReadStats {
    ReadStats {
        snapshots: a.snapshots + b.snapshots,
        node_visits: a.node_visits + b.node_visits,
        resyncs: a.resyncs + b.resyncs,
        commands: a.commands + b.commands,
        cache_hits: a.cache_hits + b.cache_hits,
        cache_misses: a.cache_misses + b.cache_misses,
        hinted: a.hinted + b.hinted,
        hint_misses: a.hint_misses + b.hint_misses,
    }
}

impl Regions {
    /// The map the host published in `shm`, no reader open yet.
    pub(crate) fn load(shm: &std::path::Path) -> Option<Regions> {
        let (map, announcement) = pod::open_map(shm).ok()?;
        let readers = map.regions().iter().map(|_| None).collect();
        Some(Regions { map, announcement, readers })
    }

    /// A newer host replaced this map.
    pub(crate) fn closed(&self) -> bool {
        self.announcement.closed()
    }

    /// Whether the host vouches for the map now (its lease-bound authority holds).
    pub(crate) fn vouched(&self) -> bool {
        self.announcement.valid_now()
    }

    /// The map.
    pub(crate) fn map(&self) -> &RegionMap {
        &self.map
    }

    /// Lets go of what the host retired (arenas, deleted log segments), which the readers would
    /// otherwise keep mapped until their next read; a reader that fails is dropped.
    pub(crate) fn refresh(&mut self) {
        for slot in &mut self.readers {
            if slot.as_mut().is_some_and(|r| r.refresh().is_err()) {
                *slot = None;
            }
        }
    }

    /// `key`'s value and version in region `i`; a reader that fails is dropped (reopened next
    /// time: the host may have restarted).
    pub(crate) fn get_versioned(
        &mut self,
        i: usize,
        shm: &std::path::Path,
        device: bool,
        key: &[u8],
    ) -> dpukv_storage::Result<(Option<Vec<u8>>, u64)> {
        let r = self.reader(i, shm, device).and_then(|r| r.get_versioned(key));
        if r.is_err() {
            self.readers[i] = None;
        }
        r
    }

    /// After a read of region `i` failed with `e`: its reader is dropped (reopened next time: the
    /// host may have restarted), unless the request itself was at fault.
    fn failed(&mut self, i: usize, e: &dpukv_storage::Error) {
        if !matches!(e, dpukv_storage::Error::KeySize { .. } | dpukv_storage::Error::ValueTooLarge { .. }) {
            self.readers[i] = None;
        }
    }

    /// Region `i`'s reader, opened if needed.
    fn reader(&mut self, i: usize, shm: &std::path::Path, device: bool) -> dpukv_storage::Result<&mut RegionReader> {
        if self.readers[i].is_none() {
            let dir = pod::region_dir(shm, self.map.regions()[i].id);
            let r = if device { RegionReader::open_device(dir)? } else { RegionReader::open(dir)? };
            self.readers[i] = Some(r);
        }
        Ok(self.readers[i].as_mut().expect("opened above"))
    }
}

/// The current regions in `state`: loaded on first use, and again once a new host closed the
/// map (None: the host has published none yet).
fn current<'s>(state: &'s mut Option<Regions>, shm: &std::path::Path) -> Option<&'s mut Regions> {
    if state.as_ref().is_none_or(Regions::closed) {
        *state = None;
        *state = Regions::load(shm);
    }
    state.as_mut()
}

/// A request's start hint as the storage engine's (used or not, the readers count it:
/// `ReadStats::hinted`).
fn storage_hint(h: &dpukv_proto::StartHint) -> dpukv_storage::StartHint<'_> {
    dpukv_storage::StartHint {
        arena: h.arena,
        lid: h.node.lid,
        version: h.node.version,
        lo: &h.node.lo,
        hi: h.node.hi.as_deref(),
    }
}

/// A protocol tree node as the storage engine's.
fn top_node(n: &dpukv_proto::TreeNode) -> dpukv_storage::TopNode {
    dpukv_storage::TopNode { lid: n.lid, version: n.version, level: n.level, lo: n.lo.clone(), hi: n.hi.clone() }
}

/// The storage engine's tree node as the protocol's.
fn tree_node(n: dpukv_storage::TopNode) -> dpukv_proto::TreeNode {
    dpukv_proto::TreeNode { lid: n.lid, version: n.version, level: n.level, lo: n.lo, hi: n.hi }
}

/// Serves a read request (get, scan, floor scan, reduce, filter, tree nodes).
/// `observer` sees each get served (and says whether its key is replicated: the reply's flag).
fn serve(
    regions: &mut Regions,
    shm: &std::path::Path,
    device: bool,
    observer: Option<&dyn ReadObserver>,
    req: &Request,
) -> Response {
    let ok = |result| Response { id: req.id, version: 0, replicated: false, result: Ok(result) };
    if req.read_version != 0 {
        // Old versions live only as long as readers pin them; reading at a chosen one is not
        // offered: say so rather than answer at another version.
        return Response::error(req.id, ErrorCode::Unsupported, "reads at a chosen version are not supported; send 0");
    }
    if let Op::RegionMap = req.op {
        return ok(Reply::RegionMap(regions.map.cluster().clone()));
    }
    if let Op::Auth { .. } = req.op {
        // A device does not check tokens (a gateway does; nodes sit behind it, on the cluster's
        // own network): any token is accepted.
        return ok(Reply::Done);
    }
    if !regions.vouched() {
        return Response::error(req.id, ErrorCode::Unavailable, NOT_VOUCHED);
    }
    let i = match regions.map.check(req) {
        Ok(i) => i,
        Err((code, what)) => return Response::error(req.id, code, what),
    };
    let out = match &req.op {
        Op::Get { key } => {
            let hint = req.hint.as_deref().map(storage_hint);
            let got = regions.reader(i, shm, device).and_then(|r| r.get_versioned_hinted(key, hint.as_ref()));
            got.map(|(v, version)| {
                let replicated = observer.is_some_and(|o| o.on_get(&regions.map.regions()[i], key));
                Response { id: req.id, version, replicated, result: Ok(Reply::Value(v)) }
            })
        }
        Op::TreeNodes { nodes, .. } => {
            let nodes: Vec<_> = nodes.iter().map(top_node).collect();
            regions.reader(i, shm, device).and_then(|r| r.expand(&nodes)).map(|(arena, found)| {
                // Cut after the last parent whose children all fit (a parent is expanded whole
                // or not at all: the client asks again for what is missing).
                let mut end = found.len();
                if end > dpukv_proto::limits::MAX_TREE_NODES {
                    let cut_parent = found[dpukv_proto::limits::MAX_TREE_NODES].0;
                    end = found.iter().position(|(p, _)| *p == cut_parent).unwrap_or(0);
                }
                let nodes = found.into_iter().take(end).map(|(parent, n)| (parent as u16, tree_node(n))).collect();
                ok(Reply::TreeNodes { arena, nodes })
            })
        }
        Op::Scan { lo, hi, limit, max_bytes, token } | Op::FloorScan { lo, hi, limit, max_bytes, token } => {
            let floor = matches!(req.op, Op::FloorScan { .. });
            let only = (req.region != 0).then_some(i);
            // A start hint (for a scan from `lo`, no token) serves the first region's descent.
            let hint = req.hint.as_deref().filter(|_| !floor && token.is_empty()).map(storage_hint);
            match scan(regions, shm, device, only, (lo, hi), (*limit, *max_bytes), token, floor, hint.as_ref()) {
                Ok(Ok(r)) => Ok(ok(r)),
                Ok(Err(ErrorCode::WrongRegion)) => Ok(Response::error(
                    req.id,
                    ErrorCode::WrongRegion,
                    "the scan continues in a region this node does not serve: refresh the region map",
                )),
                Ok(Err(code)) => Ok(Response::error(req.id, code, "malformed continuation token")),
                Err(e) => Err(e),
            }
        }
        Op::Pivots { lo, hi, max } => {
            // Within the region's own range (a split's source may still hold the half it gave
            // away).
            let r = &regions.map.regions()[i];
            let from = lo.as_slice().max(r.start.as_slice()).to_vec();
            let to = match &r.end {
                Some(end) if hi.is_empty() || end < hi => end.clone(),
                _ => hi.clone(),
            };
            regions
                .reader(i, shm, device)
                .and_then(|r| r.pivots(&from, &to, *max as usize))
                .map(|keys| ok(Reply::Keys(keys)))
        }
        Op::Reduce { key, elem, op } => regions.reader(i, shm, device).and_then(|r| r.get(key)).map(|v| match v {
            Some(v) => match crate::atomics::vector::reduce(&v, *elem, *op) {
                Ok(s) => ok(Reply::Scalar(s)),
                Err(_) => {
                    Response::error(req.id, ErrorCode::TypeMismatch, "value is not an array of that element type")
                }
            },
            None => Response::error(req.id, ErrorCode::KeyNotFound, "no value for the key"),
        }),
        Op::Filter { key, elem, cmp, operand } => {
            regions.reader(i, shm, device).and_then(|r| r.get(key)).map(|v| match v {
                Some(v) => match crate::atomics::vector::filter(&v, *elem, *cmp, operand) {
                    Ok(out) => ok(Reply::Vector(out)),
                    Err(_) => {
                        Response::error(req.id, ErrorCode::TypeMismatch, "value is not an array of that element type")
                    }
                },
                None => Response::error(req.id, ErrorCode::KeyNotFound, "no value for the key"),
            })
        }
        _ => Ok(Response::error(req.id, ErrorCode::Internal, "not a read")),
    };
    out.unwrap_or_else(|e| {
        regions.failed(i, &e);
        storage_error(req.id, &e, false)
    })
}

/// `key`, or region `i`'s last key if `key` is past it: a region's reads see only its own range,
/// never keys it still holds from before a split (deleted in the background, docs/cluster.md §9).
fn clamp(regions: &Regions, i: usize, key: &[u8]) -> Vec<u8> {
    match regions.map.regions()[i].last_key() {
        Some(last) if last.as_slice() < key => last,
        _ => key.to_vec(),
    }
}

/// A scan page across the node's regions (or only region `only`), from the token's position.
#[allow(clippy::too_many_arguments)]
fn scan(
    regions: &mut Regions,
    shm: &std::path::Path,
    device: bool,
    only: Option<usize>,
    (lo, hi): (&[u8], &[u8]),
    (limit, max_bytes): (u32, u32),
    token: &[u8],
    floor: bool,
    hint: Option<&dpukv_storage::StartHint<'_>>,
) -> dpukv_storage::Result<Result<Reply, ErrorCode>> {
    let limit = if limit == 0 { MAX_SCAN_ITEMS } else { limit.min(MAX_SCAN_ITEMS) } as usize;
    let max_bytes = if max_bytes == 0 { MAX_SCAN_BYTES } else { max_bytes.min(MAX_SCAN_BYTES) } as usize;
    // An empty upper bound means "to the end of the key space".
    let hi_all = [0xffu8; dpukv_proto::limits::MAX_KEY + 1];
    let hi = if hi.is_empty() { &hi_all[..] } else { hi };
    let mut start = if token.is_empty() {
        lo.to_vec()
    } else {
        match ScanToken::decode(token) {
            // Never before `lo`, whatever the token says.
            Some(t) => dpukv_proto::regionmap::key_after(&t.after).max(lo.to_vec()),
            None => return Ok(Err(ErrorCode::BadToken)),
        }
    };
    let first = only.unwrap_or_else(|| regions.map.route(&start));
    if floor && token.is_empty() {
        // Honeycomb's SCAN starts at the largest key <= lo, which may sit in an earlier region.
        // Searched backwards through the regions this node leads; one it does not lead may
        // hold it, so the search stops there: `wrong_region` (a client finds floors across
        // nodes region by region, naming each).
        let from = only.map_or(0, |i| i);
        for i in (from..=first).rev() {
            if !regions.map.serves(i) {
                return Ok(Err(ErrorCode::WrongRegion));
            }
            // Only the region's own keys (a split's source may still hold the half it gave away).
            let at = clamp(regions, i, lo);
            let f = regions.reader(i, shm, device)?.floor_scan(&at, &at, 1)?;
            if let Some((k, _)) = f.into_iter().next() {
                start = k;
                break;
            }
        }
    }
    let mut items: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut bytes = 0usize;
    let mut more = false;
    let mut version = 0;
    let range = match only {
        Some(i) => i..i + 1,
        None => regions.map.overlapping(&start, hi),
    };
    for i in range {
        if !regions.map.serves(i) {
            // Another node leads the rest: a page ends here (with a token if it holds items).
            if items.is_empty() {
                return Ok(Err(ErrorCode::WrongRegion));
            }
            more = true;
            break;
        }
        let want = limit + 1 - items.len();
        let hi_i = clamp(regions, i, hi);
        let from = start.as_slice().max(regions.map.regions()[i].start.as_slice()).to_vec();
        let budget = max_bytes.saturating_sub(bytes).max(1);
        let hint = hint.filter(|_| items.is_empty());
        let (page, v) = regions.reader(i, shm, device)?.scan_bounded_hinted(&from, &hi_i, want, budget, hint)?;
        version = version.max(v);
        for (k, v) in page {
            if items.len() == limit || (bytes + k.len() + v.len() > max_bytes && !items.is_empty()) {
                more = true;
                break;
            }
            bytes += k.len() + v.len();
            items.push((k, v));
        }
        // A full page whose last region had nothing more goes on to the next region (asking
        // for one item), so a token means more items may follow; a page cut by bytes cannot
        // tell, and says so.
        if more || bytes >= max_bytes {
            more = true;
            break;
        }
    }
    let token = match (more, items.last()) {
        (true, Some((k, _))) => ScanToken { read_version: version, after: k.clone() }.encode(),
        _ => Vec::new(),
    };
    Ok(Ok(Reply::Items { items, token }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dpukv_storage::region::{Region, RegionConfig};
    use dpukv_storage::vlog::FsyncPolicy;

    /// `key:NNNNNNNN`, written without allocating.
    fn key(i: u32) -> [u8; 12] {
        let mut k = *b"key:00000000";
        let mut n = i;
        for d in k[4..].iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
        k
    }

    /// A get served on the caller's thread into its buffer (the front door's GETs) allocates
    /// nothing once the region's reader is open — the value is copied once, from the host's
    /// arena into the caller's buffer — and answers what `serve_now` answers, refusals included
    /// (with the buffer left as it was).
    #[test]
    fn a_get_into_the_callers_buffer_allocates_nothing_and_answers_as_a_request_does() {
        let dir = tempfile::tempdir().expect("tempdir");
        let shm = dir.path().join("shm");
        let map = RegionMap::split_at(&[]).expect("map");
        let rc = RegionConfig::tiny(dir.path().join("r"), pod::region_dir(&shm, 1), FsyncPolicy::Never);
        let (mut region, _) = Region::open(rc).expect("open the region");
        for i in 0..3000 {
            region.put(&key(i), &[(i % 251) as u8; 64]).expect("put");
        }
        let _published = pod::publish_map(&shm, &map, u64::MAX).expect("publish the map");
        let pool = ReadPool::start(shm, 1, true, Arc::default(), None).expect("read pool");
        let mut out = Vec::with_capacity(1 << 16);
        // The first get opens the region's reader, and the first descents fill the device's
        // node cache (those allocate): one pass over the keys first.
        assert!(matches!(pool.get_into(0, 0, &key(7), &mut out), GetInto::Value { len: 64, replicated: false, .. }));
        assert_eq!(out, [7u8; 64]);
        for i in 0..3000 {
            out.clear();
            assert!(matches!(
                pool.get_into(1, 1, &key(i), &mut out),
                GetInto::Value { len: 64, replicated: false, .. }
            ));
        }
        out.clear();
        let before = dpukv_alloc_count::allocations();
        let mut found = 0;
        for i in (0..3000).step_by(7) {
            match pool.get_into(1, 1, &key(i), &mut out) {
                GetInto::Value { len: 64, replicated: false, version } if version > 0 => found += 1,
                other => panic!("key {i}: {other:?}"),
            }
            assert_eq!(out[out.len() - 64..], [(i % 251) as u8; 64]);
        }
        assert_eq!(pool.get_into(1, 1, &key(3001), &mut out), GetInto::Missing { replicated: false });
        let allocated = dpukv_alloc_count::allocations() - before;
        assert_eq!((allocated, found, out.len()), (0, 429, 429 * 64), "allocations for {found} gets");
        // As a request answers.
        let r = pool.serve_now(&Request::new(1, Op::Get { key: key(42).to_vec() }));
        assert_eq!(r.result, Ok(Reply::Value(Some(vec![42; 64]))));
        // Refusals, the buffer untouched.
        out.clear();
        let code = |g: GetInto| match g {
            GetInto::Error(e) => e.code,
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(code(pool.get_into(1, 9, &key(1), &mut out)), ErrorCode::StaleEpoch);
        assert_eq!(code(pool.get_into(2, 0, &key(1), &mut out)), ErrorCode::WrongRegion);
        assert!(out.is_empty());
    }
}
