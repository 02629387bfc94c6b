//! Hot keys on a primary (hKVS §4.2 and §4.5; docs/hot-keys.md): which of the regions' keys this
//! device's reads made popular, and the **sync** that keeps their copies on the regions' backups'
//! devices (their replica tables) current.
//!
//! - Reader threads report each get they serve for a region this node leads
//!   ([`HotKeys::on_get`]): the moving-window admission and LRU set of `popular` decide, and the
//!   answer says whether the key is replicated (the reply's `replicated` flag).
//! - The links report each write's keys once the host answered it ([`HotKeys::on_write`]) —
//!   before the client sees the answer — so a popular key written is marked **dirty**;
//!   admissions and evictions mark keys dirty too.
//! - The sync thread, every `sync_interval`, notes the time `T`, takes each region's dirty keys,
//!   reads their current values (from the same shared memory the readers read), and sends them to
//!   every backup of the region — a value, or an invalidation for a key no longer popular or
//!   absent — followed by the watermark `T`: every write acknowledged before `T` was marked dirty
//!   before `T`, so it is reflected in what was sent (module `replica_table` serves by it).
//! - Back-pressure (hKVS §4.4): each backup's link holds at most `max_outstanding` sync requests
//!   queued or unanswered. A round that does not fit is not sent (nothing is sent without its
//!   watermark's guarantee), and that link's next round that fits sends the whole popular set
//!   after a reset. A link that reconnects starts the same way. Memory is bounded by the popular
//!   sets, the dirty sets (at most twice a set's capacity, else the region resends everything)
//!   and the links' queues.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use dpukv_proto::regionmap::RegionInfo;
use dpukv_proto::{Op, Request, SyncEntry, decode_responses, encode_requests, frame_header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::popular::{Event, Popularity, PopularityConfig};
use crate::reads::{ReadObserver, Regions};
use crate::regions::RegionMap;
use crate::replica_table::{CLOCK_JUMP_FLOOR_MS, ReplicaTable};

/// Hot-key settings of a device.
#[derive(Debug, Clone)]
pub struct HotKeysConfig {
    /// Admission and the popular set's bound, per region (capacity 0: no hot keys).
    pub popularity: PopularityConfig,
    /// How often dirty keys and the watermark are sent.
    pub sync_interval: Duration,
    /// Sync requests a backup's link holds queued or unanswered.
    pub max_outstanding: usize,
    /// TLS to other devices' data ports (the cluster's certificate), if they use it.
    pub tls: Option<Arc<dpukv_net::tls::ClientTls>>,
    /// How far the nodes' wall clocks may be apart: a jump of this device's wall clock against
    /// its monotonic clock by more (at least 50 ms), between two sync rounds, stops that
    /// round's watermarks.
    pub max_clock_skew_ms: u64,
}

impl Default for HotKeysConfig {
    fn default() -> Self {
        HotKeysConfig {
            popularity: PopularityConfig::default(),
            sync_interval: Duration::from_millis(10),
            max_outstanding: 64,
            tls: None,
            max_clock_skew_ms: 5,
        }
    }
}

/// Counters and gauges (docs/operations.md).
#[derive(Debug, Default)]
pub struct HotCounters {
    /// Popular keys now, over the regions this node leads.
    pub popular: AtomicU64,
    /// Sync requests sent to replicas.
    pub sync_requests: AtomicU64,
    /// Sync requests queued or unanswered.
    pub outstanding: AtomicI64,
    /// Keys admitted to popular sets.
    pub admitted: AtomicU64,
    /// Keys evicted from popular sets.
    pub evicted: AtomicU64,
    /// Rounds a backup's link could not take (back-pressure).
    pub overflows: AtomicU64,
    /// Sync rounds skipped because the wall clock jumped.
    pub clock_jumps: AtomicU64,
}

/// One led region's popular keys.
struct Tracked {
    epoch: u64,
    start: Vec<u8>,
    end: Option<Vec<u8>>,
    popularity: Popularity,
    /// Keys whose copies must be sent again (value or invalidation).
    dirty: HashSet<Vec<u8>>,
    /// Every copy must be sent again (after a reset): a new tracker, an overflow, a new host.
    full: bool,
}

/// See the module documentation.
pub struct HotKeys {
    cfg: HotKeysConfig,
    regions: Mutex<HashMap<u32, Tracked>>,
    map: RwLock<Option<Arc<RegionMap>>>,
    /// What it did.
    pub counters: HotCounters,
    /// Gets served per region (every get of a region this node leads, hot keys on or off).
    pub(crate) gets: super::stats::RegionCounts,
}

/// What a round sends for one region.
struct Round {
    dirty: Vec<Vec<u8>>,
    /// The whole popular set (when some link, or the region, needs a reset).
    all: Option<Vec<Vec<u8>>>,
    full: bool,
}

impl HotKeys {
    /// No popular keys yet.
    pub fn new(cfg: HotKeysConfig) -> Arc<HotKeys> {
        Arc::new(HotKeys {
            cfg,
            regions: Mutex::new(HashMap::new()),
            map: RwLock::new(None),
            counters: HotCounters::default(),
            gets: Default::default(),
        })
    }

    /// Per region this node leads (by the map of the sync thread's last round): the gets served,
    /// the popular set's size, and its `top` most read keys.
    pub(crate) fn region_stats(&self, top: usize) -> Vec<dpukv_proto::stats::RegionStats> {
        let map = self.map();
        let gets = self.gets.take_stock(|id| super::stats::still_led(map.as_deref(), id));
        let regions = self.lock();
        let mut budget = dpukv_proto::stats::MAX_TOP_BYTES;
        gets.into_iter()
            .map(|(region, gets)| {
                let t = regions.get(&region);
                let mut keys = t.map_or_else(Vec::new, |t| t.popularity.top(top));
                keys.retain(|(k, _)| {
                    let fits = k.len() <= budget;
                    budget = budget.saturating_sub(if fits { k.len() } else { budget });
                    fits
                });
                dpukv_proto::stats::RegionStats {
                    region,
                    gets,
                    capacity: t.map_or(0, |_| self.cfg.popularity.capacity as u32),
                    popular: t.map_or(0, |t| t.popularity.len() as u32),
                    distinct: t.map_or(0, |t| t.popularity.distinct() as u32),
                    top: keys,
                }
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Tracked>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether keys can become popular at all (a popular-set capacity above 0).
    /// The region map the device serves (as of the syncer's last round; None before its first).
    pub(crate) fn map(&self) -> Option<Arc<RegionMap>> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn enabled(&self) -> bool {
        self.cfg.popularity.capacity > 0
    }

    /// Marks the keys of a write the host answered (or may have applied) dirty, if popular.
    pub fn on_write(&self, keys: &[Vec<u8>]) {
        if !self.enabled() || keys.is_empty() {
            return;
        }
        let Some(map) = self.map.read().unwrap_or_else(|e| e.into_inner()).clone() else { return };
        let mut regions = self.lock();
        for k in keys {
            let id = map.regions()[map.route(k)].id;
            if let Some(t) = regions.get_mut(&id)
                && t.popularity.is_popular(k)
            {
                t.dirty.insert(k.clone());
            }
        }
    }

    /// Every copy is sent again (a new host: writes may have been applied unseen).
    pub fn resync_all(&self) {
        for t in self.lock().values_mut() {
            t.full = true;
        }
    }

    fn take(&self, id: u32, want_all: bool) -> Option<Round> {
        let mut regions = self.lock();
        let t = regions.get_mut(&id)?;
        let full = std::mem::take(&mut t.full);
        let dirty: Vec<Vec<u8>> = t.dirty.drain().collect();
        let all = (want_all || full).then(|| t.popularity.keys());
        Some(Round { dirty, all, full })
    }

    /// A key found absent when its copy was to be sent: not popular any more (it has nothing to
    /// replicate until it is written and read again).
    fn forget(&self, id: u32, key: &[u8]) {
        if let Some(t) = self.lock().get_mut(&id) {
            t.popularity.forget(key);
        }
    }

    /// Keeps only the trackers of `led` (regions this node leads that have backups); updates
    /// the gauge.
    fn retain(&self, led: &HashSet<u32>) {
        let mut regions = self.lock();
        regions.retain(|id, _| led.contains(id));
        let n: usize = regions.values().map(|t| t.popularity.len()).sum();
        self.counters.popular.store(n as u64, Ordering::Relaxed);
    }
}

impl ReadObserver for HotKeys {
    fn on_get(&self, region: &RegionInfo, key: &[u8]) -> bool {
        self.gets.add(region.id);
        if !self.enabled() {
            return false;
        }
        if region.backups.is_empty() {
            // Nobody to hold copies (a pod alone, a region with RF 1): counting its gets would be
            // pure cost (about 5% of a device's CPU per get, by a profile). The sync thread drops
            // a tracker left from before (`retain`).
            return false;
        }
        let mut regions = self.lock();
        let fresh = || Tracked {
            epoch: region.epoch,
            start: region.start.clone(),
            end: region.end.clone(),
            popularity: Popularity::new(self.cfg.popularity),
            dirty: HashSet::new(),
            full: true,
        };
        let t = regions.entry(region.id).or_insert_with(fresh);
        if t.epoch != region.epoch || t.start != region.start || t.end != region.end {
            // The region changed (a new epoch, a split): its copies start over.
            *t = fresh();
        }
        let mut events = Vec::new();
        let popular = t.popularity.read(key, &mut events);
        for e in events {
            let k = match e {
                Event::Admitted(k) => {
                    self.counters.admitted.fetch_add(1, Ordering::Relaxed);
                    k
                }
                Event::Evicted(k) => {
                    self.counters.evicted.fetch_add(1, Ordering::Relaxed);
                    k
                }
            };
            t.dirty.insert(k);
        }
        if t.dirty.len() > 2 * self.cfg.popularity.capacity {
            t.dirty.clear();
            t.full = true;
        }
        popular && !t.full && !t.dirty.contains(key)
    }
}

/// Milliseconds since the Unix epoch (the watermarks' clock).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A sync request and the link generation it was built for.
type Queued = (u64, Request);

/// The sync thread's handle on one backup device.
struct Link {
    tx: mpsc::Sender<Queued>,
    /// Bumped by the link's task at each new connection.
    generation: Arc<AtomicU64>,
    /// The generation the sync thread last built for.
    seen: u64,
    /// Regions whose copies this link must resend whole (after a reset).
    needs_full: HashSet<u32>,
    /// The epoch of each led region this link's replica was told of (a new primary tells its
    /// backups' replica tables at once: their copies of the old primary's keys go).
    announced: HashMap<u32, u64>,
    stop: CancellationToken,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Most entries and bytes of one sync request.
const MAX_ENTRIES: usize = 512;
const MAX_BYTES: usize = 256 << 10;

/// Starts the sync thread (see the module documentation); it stops with `stop`.
pub fn start_sync(
    hot: Arc<HotKeys>,
    table: Arc<ReplicaTable>,
    shm: PathBuf,
    rt: tokio::runtime::Handle,
    stop: CancellationToken,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("dpukv-hot-sync".into()).spawn(move || {
        let mut s = Syncer {
            hot,
            table,
            shm,
            rt,
            stop,
            state: None,
            links: HashMap::new(),
            refreshed: std::time::Instant::now(),
            clock_offset: None,
        };
        while !s.stop.is_cancelled() {
            std::thread::sleep(s.hot.cfg.sync_interval);
            s.round();
        }
    })?;
    Ok(())
}

struct Syncer {
    hot: Arc<HotKeys>,
    table: Arc<ReplicaTable>,
    shm: PathBuf,
    rt: tokio::runtime::Handle,
    stop: CancellationToken,
    /// The host's regions (and a reader per region) and the same map, shared with `hot`.
    state: Option<(Regions, Arc<RegionMap>)>,
    links: HashMap<String, Link>,
    /// When the readers last let go of what the host retired.
    refreshed: std::time::Instant,
    /// The wall clock minus the monotonic clock (ms) at the last round: how the wall clock
    /// moved against real time since.
    clock_offset: Option<i128>,
}

impl Syncer {
    fn round(&mut self) {
        // Like the reader threads: let go of retired arenas and deleted log segments now and then
        // (a reader keeps them mapped until its next read otherwise).
        if self.refreshed.elapsed() >= Duration::from_secs(1) {
            self.refreshed = std::time::Instant::now();
            if let Some((regions, _)) = &mut self.state {
                regions.refresh();
            }
        }
        if self.state.as_ref().is_none_or(|s| s.0.closed()) {
            if self.state.take().is_some() {
                // A new host: writes in flight when the old one went may be applied unseen.
                self.hot.resync_all();
            }
            let Some(regions) = Regions::load(&self.shm) else { return };
            let map = Arc::new(regions.map().clone());
            *self.hot.map.write().unwrap_or_else(|e| e.into_inner()) = Some(map.clone());
            self.state = Some((regions, map));
        }
        let map = self.state.as_ref().expect("loaded above").1.clone();
        let led: HashSet<u32> =
            (0..map.regions().len()).filter(|&i| map.serves(i)).map(|i| map.regions()[i].id).collect();
        self.table.forget_regions(led.iter().copied());
        let copied = map.regions().iter().filter(|r| led.contains(&r.id) && !r.backups.is_empty());
        self.hot.retain(&copied.map(|r| r.id).collect());
        if !self.hot.enabled() {
            return;
        }
        // The links this round needs: every backup of a led region (with a device address).
        let mut wanted: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, r) in map.regions().iter().enumerate() {
            if !map.serves(i) {
                continue;
            }
            for b in r.backups.iter().filter(|&&b| b != map.node()) {
                if let Some(n) = map.cluster().node(*b).filter(|n| !n.device.is_empty()) {
                    wanted.entry(n.device.clone()).or_default().push(i);
                }
            }
        }
        self.links.retain(|addr, _| wanted.contains_key(addr));
        for addr in wanted.keys() {
            if !self.links.contains_key(addr) {
                let link = self.open_link(addr.clone());
                self.links.insert(addr.clone(), link);
            }
        }
        for link in self.links.values_mut() {
            let g = link.generation.load(Ordering::Acquire);
            if g != link.seen {
                // A new connection (or the first): the replica's table starts over.
                link.seen = g;
                link.needs_full = led.clone();
                link.announced.clear();
            }
        }
        // A watermark says every write acknowledged before it is reflected: true only while the
        // host's lease-bound authority holds (checked after reading the clock). Once it lapsed
        // another node may lead these regions and acknowledge writes — a paused host's device
        // once went on stamping fresh watermarks. Dirty keys wait for a round that may vouch.
        let t = now_ms();
        if !self.state.as_ref().is_some_and(|s| s.0.vouched()) {
            return;
        }
        // A wall clock that jumped (against the monotonic clock, which counts real time) makes
        // `t` no promise about real time: no watermark this round, and every replica drops this
        // node's copies (a reset) until a round on a steady clock sends them again.
        let offset = i128::from(t) - i128::from(dpukv_storage::announce::monotonic_ns() / 1_000_000);
        let limit = u128::from(self.hot.cfg.max_clock_skew_ms.max(CLOCK_JUMP_FLOOR_MS));
        let jumped = self.clock_offset.is_some_and(|o| (offset - o).unsigned_abs() > limit);
        self.clock_offset = Some(offset);
        if jumped {
            self.hot.counters.clock_jumps.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("the wall clock jumped against the monotonic clock: replicas drop this node's copies");
            for link in self.links.values_mut() {
                link.announced.clear();
            }
            return;
        }
        for (i, r) in map.regions().iter().enumerate() {
            if !map.serves(i) {
                continue;
            }
            let addrs: Vec<&String> = wanted.iter().filter(|(_, is)| is.contains(&i)).map(|(a, _)| a).collect();
            // A region led at a new epoch (this node was just promoted, or its backups changed):
            // the replicas hear the epoch now — their copies from an older primary go — not at
            // the first get of a popular key.
            for a in &addrs {
                let link = self.links.get_mut(*a).expect("opened above");
                if link.announced.get(&r.id) != Some(&r.epoch) {
                    let announce = requests(r.id, r.epoch, 0, true, Vec::new());
                    if link.tx.capacity() >= announce.len() {
                        for req in announce {
                            self.hot.counters.outstanding.fetch_add(1, Ordering::Relaxed);
                            if link.tx.try_send((link.seen, req)).is_err() {
                                self.hot.counters.outstanding.fetch_sub(1, Ordering::Relaxed);
                            }
                        }
                        link.announced.insert(r.id, r.epoch);
                        link.needs_full.insert(r.id);
                    }
                }
            }
            let want_all = addrs.iter().any(|a| self.links[*a].needs_full.contains(&r.id));
            let Some(round) = self.hot.take(r.id, want_all) else {
                // Nothing read yet: still vouch for "no copies" being current (nothing to send).
                continue;
            };
            if addrs.is_empty() {
                continue; // no backup to copy to (the dirty keys were taken: nothing to send)
            }
            let delta = self.entries(i, r.id, &round.dirty);
            let whole = round.all.as_ref().map(|keys| self.entries(i, r.id, keys));
            for a in addrs {
                let link = self.links.get_mut(a).expect("opened above");
                let full = round.full || link.needs_full.contains(&r.id);
                let (entries, reset) = match (&whole, full) {
                    (Some(w), true) => (w.clone(), true),
                    _ => (delta.clone(), false),
                };
                let reqs = requests(r.id, r.epoch, t, reset, entries);
                if link.tx.capacity() < reqs.len() {
                    // Back-pressure: this replica is behind; it gets everything once it caught up.
                    self.hot.counters.overflows.fetch_add(1, Ordering::Relaxed);
                    link.needs_full.insert(r.id);
                    continue;
                }
                for req in reqs {
                    self.hot.counters.outstanding.fetch_add(1, Ordering::Relaxed);
                    if link.tx.try_send((link.seen, req)).is_err() {
                        self.hot.counters.outstanding.fetch_sub(1, Ordering::Relaxed);
                        link.needs_full.insert(r.id);
                        break;
                    }
                }
                if full {
                    link.needs_full.remove(&r.id);
                }
            }
        }
    }

    /// The sync entries for `keys` of region `i`: each popular key's current value, else an
    /// invalidation.
    fn entries(&mut self, i: usize, id: u32, keys: &[Vec<u8>]) -> Vec<SyncEntry> {
        let mut out = Vec::with_capacity(keys.len());
        let popular: Vec<bool> = {
            let regions = self.hot.lock();
            keys.iter().map(|k| regions.get(&id).is_some_and(|t| t.popularity.is_popular(k))).collect()
        };
        for (k, popular) in keys.iter().zip(popular) {
            let read = if popular { self.read(i, k) } else { None };
            match read {
                Some((Some(v), version)) => out.push(SyncEntry { key: k.clone(), version, value: Some(v) }),
                other => {
                    if matches!(other, Some((None, _))) {
                        self.hot.forget(id, k);
                    }
                    out.push(SyncEntry { key: k.clone(), version: 0, value: None });
                }
            }
        }
        out
    }

    /// `key`'s value and version in region `i` (None: it could not be read; invalidate).
    fn read(&mut self, i: usize, key: &[u8]) -> Option<(Option<Vec<u8>>, u64)> {
        self.state.as_mut()?.0.get_versioned(i, &self.shm, true, key).ok()
    }

    fn open_link(&self, addr: String) -> Link {
        let (tx, rx) = mpsc::channel(self.hot.cfg.max_outstanding.max(1));
        let generation = Arc::new(AtomicU64::new(0));
        let stop = self.stop.child_token();
        let task = LinkTask {
            addr,
            tls: self.hot.cfg.tls.clone(),
            generation: generation.clone(),
            hot: self.hot.clone(),
            max_outstanding: self.hot.cfg.max_outstanding.max(1),
        };
        self.rt.spawn(task.run(rx, stop.clone()));
        Link { tx, generation, seen: 0, needs_full: HashSet::new(), announced: HashMap::new(), stop }
    }
}

/// `entries` cut into sync requests within the size limits; the last carries the watermark.
fn requests(region: u32, epoch: u64, watermark_ms: u64, reset: bool, entries: Vec<SyncEntry>) -> Vec<Request> {
    let mut out = Vec::new();
    let mut cur: Vec<SyncEntry> = Vec::new();
    let mut bytes = 0;
    let mut first = true;
    let mk = |entries: Vec<SyncEntry>, reset: bool, watermark_ms: u64| {
        let mut r = Request::new(0, Op::ReplicaSync { watermark_ms, reset, entries });
        (r.region, r.epoch) = (region, epoch);
        r
    };
    for e in entries {
        let n = e.key.len() + e.value.as_ref().map_or(0, Vec::len) + 16;
        if !cur.is_empty() && (cur.len() == MAX_ENTRIES || bytes + n > MAX_BYTES) {
            out.push(mk(std::mem::take(&mut cur), reset && first, 0));
            first = false;
            bytes = 0;
        }
        bytes += n;
        cur.push(e);
    }
    out.push(mk(cur, reset && first, watermark_ms));
    out
}

/// One backup device's connection: sends the queued sync requests in order, at most
/// `max_outstanding` unanswered; reconnects (a new generation) when it breaks.
struct LinkTask {
    addr: String,
    tls: Option<Arc<dpukv_net::tls::ClientTls>>,
    generation: Arc<AtomicU64>,
    hot: Arc<HotKeys>,
    max_outstanding: usize,
}

impl LinkTask {
    async fn run(self, mut rx: mpsc::Receiver<Queued>, stop: CancellationToken) {
        let outstanding = &self.hot.counters.outstanding;
        loop {
            let stream = tokio::select! {
                _ = stop.cancelled() => break,
                s = self.connect() => s,
            };
            let Some(stream) = stream else {
                // Unreachable: what is queued cannot be sent in order any more.
                while rx.try_recv().is_ok() {
                    outstanding.fetch_sub(1, Ordering::Relaxed);
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => continue,
                }
            };
            let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
            let unanswered = self.serve(stream, &mut rx, generation, &stop).await;
            outstanding.fetch_sub(unanswered as i64, Ordering::Relaxed);
            if stop.is_cancelled() {
                break;
            }
        }
        while rx.try_recv().is_ok() {
            outstanding.fetch_sub(1, Ordering::Relaxed);
        }
    }

    async fn connect(&self) -> Option<dpukv_net::tls::Stream> {
        let tcp = tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(&self.addr))
            .await
            .ok()?
            .ok()?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            Some(t) => t.connect(tcp, &self.addr).await.ok(),
            None => Some(dpukv_net::tls::Stream::Plain(tcp)),
        }
    }

    /// Runs one connection until it breaks or `stop`; answers how many requests it left
    /// unanswered.
    async fn serve(
        &self,
        stream: dpukv_net::tls::Stream,
        rx: &mut mpsc::Receiver<Queued>,
        generation: u64,
        stop: &CancellationToken,
    ) -> usize {
        let (mut r, mut w) = tokio::io::split(stream);
        let outstanding = &self.hot.counters.outstanding;
        let mut unanswered = 0usize;
        let mut next_id = 1u64;
        let mut buf: Vec<u8> = Vec::with_capacity(4096);
        let mut out = Vec::new();
        loop {
            let room = unanswered < self.max_outstanding;
            tokio::select! {
                _ = stop.cancelled() => return unanswered,
                q = rx.recv(), if room => {
                    let Some((g, mut req)) = q else { return unanswered };
                    if g != generation {
                        // Built for an earlier connection: its deltas assume copies that may be gone.
                        outstanding.fetch_sub(1, Ordering::Relaxed);
                        continue;
                    }
                    req.id = next_id;
                    next_id += 1;
                    out.clear();
                    encode_requests(std::slice::from_ref(&req), &mut out);
                    if w.write_all(&out).await.is_err() {
                        outstanding.fetch_sub(1, Ordering::Relaxed);
                        return unanswered;
                    }
                    unanswered += 1;
                    self.hot.counters.sync_requests.fetch_add(1, Ordering::Relaxed);
                }
                got = r.read_buf(&mut buf) => {
                    if !matches!(got, Ok(n) if n > 0) {
                        return unanswered;
                    }
                    let mut used = 0;
                    while let Ok(Some(h)) = frame_header(&buf[used..]) {
                        if buf.len() - used < h.total {
                            break;
                        }
                        let Ok(resps) = decode_responses(&buf[used..used + h.total]) else { return unanswered };
                        used += h.total;
                        for resp in resps {
                            if let Err(e) = &resp.result {
                                tracing::debug!(addr = %self.addr, code = e.code.name(), "a replica refused a sync");
                            }
                            unanswered = unanswered.saturating_sub(1);
                            outstanding.fetch_sub(1, Ordering::Relaxed);
                        }
                    }
                    buf.drain(..used);
                    if buf.capacity() > 1 << 20 && buf.is_empty() {
                        buf = Vec::with_capacity(4096);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica that accepts the connection and never reads or answers: the link holds at most
    /// `max_outstanding` queued and `max_outstanding` unanswered, and refuses the rest (the sync
    /// thread then resyncs that replica whole later) — memory stays bounded however slow it is.
    #[tokio::test]
    async fn a_replica_that_never_answers_holds_at_most_the_bound() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let held = tokio::spawn(async move {
            let (sock, _) = listener.accept().await.expect("accept");
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(sock);
        });
        let hot = HotKeys::new(HotKeysConfig { max_outstanding: 4, ..HotKeysConfig::default() });
        let (tx, rx) = mpsc::channel(4);
        let generation = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let task = LinkTask { addr, tls: None, generation: generation.clone(), hot: hot.clone(), max_outstanding: 4 };
        let run = tokio::spawn(task.run(rx, stop.clone()));
        while generation.load(Ordering::Acquire) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let big = vec![SyncEntry { key: b"k".to_vec(), version: 1, value: Some(vec![7; 200 << 10]) }];
        let mut taken = 0;
        for _ in 0..200 {
            let req = requests(1, 1, now_ms(), false, big.clone()).remove(0);
            if tx.try_send((1, req)).is_ok() {
                hot.counters.outstanding.fetch_add(1, Ordering::Relaxed);
                taken += 1;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(taken <= 8, "{taken} requests held for a replica that answers nothing (bound 4 + 4)");
        assert!(hot.counters.outstanding.load(Ordering::Relaxed) <= 8);
        stop.cancel();
        run.await.expect("the link task ends");
        assert_eq!(hot.counters.outstanding.load(Ordering::Relaxed), 0, "nothing counted once the link is gone");
        held.abort();
    }

    #[test]
    fn requests_fit_the_limits_and_only_the_last_carries_the_watermark() {
        let entries: Vec<SyncEntry> = (0..1500)
            .map(|i| SyncEntry { key: format!("k{i}").into_bytes(), version: 1, value: Some(vec![0; 300]) })
            .collect();
        let reqs = requests(4, 9, 77, true, entries);
        assert!(reqs.len() >= 3);
        let mut n = 0;
        for (j, r) in reqs.iter().enumerate() {
            let Op::ReplicaSync { watermark_ms, reset, entries } = &r.op else { panic!() };
            assert_eq!((r.region, r.epoch), (4, 9));
            assert!(entries.len() <= MAX_ENTRIES && r.size_hint() <= MAX_BYTES + (64 << 10));
            assert_eq!(*reset, j == 0, "only the first resets");
            assert_eq!(*watermark_ms, if j == reqs.len() - 1 { 77 } else { 0 });
            assert!(r.op.validate().is_ok());
            n += entries.len();
        }
        assert_eq!(n, 1500);
        let empty = requests(1, 1, 5, false, vec![]);
        assert_eq!(empty.len(), 1, "a round with nothing dirty still sends its watermark");
    }
}
