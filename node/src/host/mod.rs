//! The host half of a node pod (`dpukv-node`): opens its regions (value log, L0 arena, levels),
//! publishes the region map and the regions' shared memory for the device (module `pod`), gives
//! each region its own writer and releaser threads (module `worker`), and serves the device's
//! forwarded writes and atomics on a unix socket (the same protocol as clients), acknowledging
//! each only when its fsync policy allows. Reads that reach the host (the `--serve-reads-on-host`
//! baseline) go to a reader pool over the same shared memory.
//!
//! # Layout
//! - `worker`: a region's writer (group commit, reservation station, exactly-once sessions,
//!   upkeep) and releaser.
//! - `cluster`: the host as a member of a cluster — registration, the master, and serving,
//!   backing and handing over regions as the region map in etcd says.
//! - `restoring`: fetching the regions a restore gives this node from the backup.
//! - this module: [`HostConfig`], [`run`], the socket server, and the file layer the host's
//!   durable files go through ([`durable_fs`]).

pub mod cluster;
pub mod cluster_metrics;
mod handoff;
mod restoring;
mod worker;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};
use dpukv_proto::{ErrorCode, Response};
use dpukv_storage::region::{Region, RegionConfig};
use dpukv_storage::vlog::FsyncPolicy;
use prometheus_client::registry::Registry;
use tokio::net::UnixListener;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
pub use worker::WriterStats;
use worker::{Job, start as start_writer};

use crate::admin::{self, Admin};
use crate::conn::{self, Budget, ConnConfig, Incoming, Sink};
use crate::pod;
use crate::reads::{ReadCounters, ReadPool};
use crate::regions::RegionMap;

/// Host configuration.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Durable data (a directory per region).
    pub data_dir: PathBuf,
    /// Shared memory directory (the pod's: arenas, control blocks, the region map, the socket).
    pub shm_dir: PathBuf,
    /// The regions.
    pub regions: RegionMap,
    /// Log durability.
    pub fsync: FsyncPolicy,
    /// L0 budget per region in bytes (0 = sized to the pod's memory: `sizing::auto_l0_budget`).
    pub l0_budget: u64,
    /// Admin HTTP address (None: no endpoint).
    pub admin: Option<SocketAddr>,
    /// Most device connections.
    pub max_connections: usize,
    /// Baseline: one read-modify-write per atomic instead of the reservation station's merging.
    pub per_op_atomics: bool,
    /// Limits of each device connection.
    pub conn: ConnConfig,
    /// Bytes all device connections may hold at once (frames, requests, responses).
    pub memory_budget: usize,
    /// Reader threads for reads that reach the host (the baseline).
    pub read_threads: usize,
    /// How long a shutdown waits for requests in flight.
    pub shutdown_grace: Duration,
    /// Membership of a cluster (None: a standalone node serving `regions`).
    pub cluster: Option<cluster::ClusterArgs>,
    /// The control API (a cluster's host only).
    pub control: Option<crate::control::ControlConfig>,
}

/// The map a host routes by and the writers of the regions it serves (the cluster agent swaps
/// both as regions come and go).
#[derive(Debug)]
pub struct Served {
    map: RegionMap,
    writers: HashMap<u32, mpsc::Sender<Job>>,
}

/// [`Served`], shared by the connections and the cluster agent.
pub type SharedServed = Arc<RwLock<Served>>;

/// Opens regions and starts their writers, alike for a standalone host and a cluster's.
#[derive(Clone)]
pub struct Opener {
    data_dir: PathBuf,
    shm_dir: PathBuf,
    fsync: dpukv_storage::vlog::FsyncPolicy,
    l0_budget: u64,
    per_op_atomics: bool,
    stats: Arc<WriterStats>,
    rt: tokio::runtime::Handle,
}

impl Opener {
    /// The node's `--fsync` (backups' copies follow it too).
    pub fn fsync(&self) -> dpukv_storage::vlog::FsyncPolicy {
        self.fsync
    }
}

impl Opener {
    /// Region `id`'s data directory.
    pub fn dir(&self, id: u32) -> PathBuf {
        self.data_dir.join(format!("region-{id}"))
    }

    /// Opens region `id` (creating it if new; replaying its log tail) and starts its writer;
    /// returns the started writer and a reader of its log's bytes (for replication).
    pub fn open(
        &self,
        id: u32,
        repl: Option<worker::Replicated>,
    ) -> Result<(worker::Started, dpukv_storage::vlog::LogTail)> {
        let mut rc = RegionConfig::new(self.dir(id), pod::region_dir(&self.shm_dir, id)).with_fs(durable_fs());
        rc.vlog.fsync = self.fsync;
        rc.l0_budget = self.l0_budget;
        // Room for a full L0 and the slack of its allocation (the arena file is sparse: only
        // what is used takes memory).
        rc.arena.capacity = rc.arena.capacity.max(self.l0_budget.saturating_mul(2));
        // Opening replays the log tail: the host serves nothing before its regions are open.
        let (region, rec) = Region::open(rc).with_context(|| format!("opening region {id}"))?;
        tracing::info!(region = id, replayed = rec.replayed, dropped = rec.dropped, "region open");
        let tail = region.vlog().tail();
        let started =
            start_writer(id, region, self.per_op_atomics, self.stats.clone(), WRITER_QUEUE, self.rt.clone(), repl)?;
        Ok((started, tail))
    }
}

/// What [`run`] reports once it serves.
#[derive(Debug, Clone)]
pub struct HostInfo {
    /// The unix socket the device connects to.
    pub socket: PathBuf,
    /// The admin endpoint, if any.
    pub admin: Option<SocketAddr>,
    /// The control API, if any.
    pub control: Option<SocketAddr>,
}

/// The environment variable that, set to `1`, sends every durable file operation of the host's
/// regions and backup copies through a [`dpukv_storage::fs::JournalFs`] (an undo journal in
/// `<data dir>/fault-journal`), so a test can SIGKILL the pod and then simulate a power loss
/// with `dpukv-store power-cut`. **Tests only**: it slows every write; the chart and the
/// operator never set it.
pub const FAULT_JOURNAL_ENV: &str = "DPUKV_FAULT_JOURNAL";

static DURABLE_FS: OnceLock<Arc<dyn dpukv_storage::fs::Fs>> = OnceLock::new();

/// The file layer of this process's durable files: the operating system's, or the fault journal
/// once [`run`] chose it (`DPUKV_FAULT_JOURNAL=1`; one journaled host per process).
pub fn durable_fs() -> Arc<dyn dpukv_storage::fs::Fs> {
    DURABLE_FS.get().cloned().unwrap_or_else(dpukv_storage::fs::real)
}

/// With `DPUKV_FAULT_JOURNAL=1`, journals the durable files under `data_dir`; the shared memory
/// in `shm_dir` is what a power cut empties.
fn choose_durable_fs(data_dir: &std::path::Path, shm_dir: &std::path::Path) -> Result<()> {
    if std::env::var_os(FAULT_JOURNAL_ENV).is_none_or(|v| v != "1") {
        return Ok(());
    }
    let open = || -> std::io::Result<dpukv_storage::fs::JournalFs> {
        let j = dpukv_storage::fs::JournalFs::open(data_dir)?;
        j.add_volatile(shm_dir)?;
        Ok(j)
    };
    let j = open().with_context(|| format!("opening the fault journal in {}", data_dir.display()))?;
    tracing::warn!(journal = %j.journal_dir().display(), "{FAULT_JOURNAL_ENV}=1: durable files go through the fault journal (tests only)");
    let _ = DURABLE_FS.set(Arc::new(j));
    Ok(())
}

/// Jobs queued per region writer.
const WRITER_QUEUE: usize = 4096;

/// Opens the regions, starts their writers and serves until `shutdown`; `started` receives the
/// addresses once serving.
pub async fn run(
    cfg: HostConfig,
    signal: CancellationToken,
    started: Option<tokio::sync::oneshot::Sender<HostInfo>>,
) -> Result<()> {
    // The signal to stop, and the stop itself: a member of a cluster first leaves — its
    // primaries move to backups elsewhere (`cluster::leave`, bounded) — while it still serves.
    let shutdown = CancellationToken::new();
    let _stopped = shutdown.clone().drop_guard();
    {
        let (shutdown, cluster) = (shutdown.clone(), cfg.cluster.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = signal.cancelled() => {
                    if let Some(c) = &cluster {
                        cluster::leave(c, c.leave_timeout).await;
                    }
                    shutdown.cancel();
                }
                _ = shutdown.cancelled() => {}
            }
        });
    }
    std::fs::create_dir_all(&cfg.shm_dir).with_context(|| format!("creating {}", cfg.shm_dir.display()))?;
    choose_durable_fs(&cfg.data_dir, &cfg.shm_dir)?;
    let stats = Arc::new(WriterStats::default());
    let rt = tokio::runtime::Handle::current();
    let mut writer_threads = Vec::new();
    let regions_hint = if cfg.cluster.is_some() { 4 } else { cfg.regions.regions().len() };
    let l0_budget = match cfg.l0_budget {
        0 => crate::sizing::auto_l0_budget(&cfg.shm_dir, regions_hint),
        b => b,
    };
    tracing::info!(l0_budget_mib = l0_budget >> 20, regions = regions_hint, "L0 budget per region");
    let opener = Opener {
        data_dir: cfg.data_dir.clone(),
        shm_dir: cfg.shm_dir.clone(),
        fsync: cfg.fsync,
        l0_budget,
        per_op_atomics: cfg.per_op_atomics,
        stats: stats.clone(),
        rt: rt.clone(),
    };
    let served: SharedServed = Arc::new(RwLock::new(Served { map: cfg.regions.clone(), writers: HashMap::new() }));
    let mut agent = None;
    let cluster_metrics = Arc::new(cluster_metrics::ClusterMetrics::default());
    let _map = match &cfg.cluster {
        None => {
            cfg.regions.pin_to(&cfg.data_dir)?;
            for spec in cfg.regions.regions() {
                let (worker::Started { queue, thread, .. }, _) = opener.open(spec.id, None)?;
                served.write().unwrap_or_else(|e| e.into_inner()).writers.insert(spec.id, queue);
                writer_threads.push(thread);
            }
            // The regions' shared memory is in place: the device may read by this map from now on.
            Some(pod::publish_map(&cfg.shm_dir, &cfg.regions, u64::MAX)?)
        }
        Some(c) => {
            std::fs::create_dir_all(&cfg.data_dir).with_context(|| format!("creating {}", cfg.data_dir.display()))?;
            // The agent joins the cluster and publishes maps as regions come; until its first
            // map, the device waits.
            let (c, served, opener, stop) = (c.clone(), served.clone(), opener.clone(), shutdown.clone());
            let metrics = cluster_metrics.clone();
            agent = Some(tokio::spawn(async move {
                let r = cluster::run(c, served, opener, metrics, stop.clone()).await;
                if let Err(e) = &r {
                    // A host that cannot be a member must not go on serving as if it were one.
                    tracing::error!(error = %format!("{e:#}"), "the cluster agent failed; stopping");
                    stop.cancel();
                }
                r
            }));
            None
        }
    };
    let reads = Arc::new(ReadPool::start(
        cfg.shm_dir.clone(),
        cfg.read_threads,
        false,
        Arc::new(ReadCounters::default()),
        None,
    )?);

    let ready = Arc::new(AtomicBool::new(false));
    let mut registry = Registry::default();
    registry.register_collector(Box::new(StatsCollector(stats.clone())));
    let latency = dpukv_net::latency::OpLatency::register(
        &mut registry,
        "dpukv_host_request_duration_seconds",
        "Time from a request's arrival from the device to its answer written back, by operation",
    );
    if cfg.cluster.is_some() {
        registry.register_collector(Box::new(cluster_metrics::ClusterCollector(cluster_metrics.clone())));
    }
    let admin_addr = match cfg.admin {
        Some(a) => {
            let state = Admin { ready: ready.clone(), registry: Arc::new(registry) };
            Some(admin::serve(a, state, shutdown.clone()).await?)
        }
        None => None,
    };
    // The cluster's backup schedule runs on whichever node is master (docs/backup.md §4).
    if let Some(c) = &cfg.cluster {
        let keys = dpukv_cluster::keys::Keys::new(&c.name).map_err(|e| anyhow::anyhow!("{e}"))?;
        let run = crate::backup::run_schedule(
            c.etcd.clone(),
            keys,
            c.name.clone(),
            cluster_metrics.master.clone(),
            shutdown.clone(),
        );
        tokio::spawn(run);
    }
    let control_addr = match (&cfg.control, &cfg.cluster) {
        (Some(ctl), Some(c)) => {
            let cluster = crate::control::ClusterControl {
                etcd: c.etcd.clone(),
                keys: dpukv_cluster::keys::Keys::new(&c.name).map_err(|e| anyhow::anyhow!("{e}"))?,
                host: Some(crate::control::HostFacts {
                    node: c.node_id,
                    started: std::time::Instant::now(),
                    lease_ttl: c.lease_ttl,
                    cluster: cluster_metrics.clone(),
                }),
            };
            Some(crate::control::serve(ctl.clone(), cluster, shutdown.clone()).await?)
        }
        _ => None,
    };

    let socket = pod::socket_path(&cfg.shm_dir);
    let _ = std::fs::remove_file(&socket);
    let listener =
        std::os::unix::net::UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
    listener.set_nonblocking(true)?;
    // The device's links are served on a thread of their own with a single-threaded event loop
    // (docs/architecture.md §3): a frame is read, its writes queued to their regions' writers and
    // their answers written back on one thread, which sleeps in epoll between frames — on the
    // process's multi-threaded runtime each frame woke one worker and often a second to steal
    // the task, ~1.5 µs of wake-ups per write at 16 writes in flight.
    let links = {
        let (served, reads, stop) = (served.clone(), reads.clone(), shutdown.clone());
        let (conn_cfg, grace, max_connections, memory_budget) =
            (cfg.conn, cfg.shutdown_grace, cfg.max_connections, cfg.memory_budget);
        std::thread::Builder::new().name("dpukv-links".into()).spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(serve_links(
                listener,
                served,
                reads,
                latency,
                LinkLimits { conn: conn_cfg, grace, max_connections, memory_budget },
                stop,
            ))
        })?
    };
    ready.store(true, Ordering::Release);
    if let Some(tx) = started {
        let _ = tx.send(HostInfo { socket: socket.clone(), admin: admin_addr, control: control_addr });
    }
    tracing::info!(socket = %socket.display(), "host serving");
    shutdown.cancelled().await;
    ready.store(false, Ordering::Release);
    match tokio::task::spawn_blocking(move || links.join()).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the device links' thread failed"),
        _ => tracing::warn!("the device links' thread panicked"),
    }
    // The agent hands back its regions' writer threads (and leaves the cluster).
    let mut agent_failed = None;
    if let Some(a) = agent {
        match a.await {
            Ok(Ok(threads)) => writer_threads.extend(threads),
            Ok(Err(e)) => agent_failed = Some(e),
            Err(e) => agent_failed = Some(anyhow::anyhow!("the cluster agent panicked: {e}")),
        }
    }
    // Dropping the queues stops the writers: they finish their rounds, then close their regions
    // (every write made durable, compactions finished). Wait for them, within the grace period.
    served.write().unwrap_or_else(|e| e.into_inner()).writers.clear();
    let joined = tokio::task::spawn_blocking(move || {
        for t in writer_threads {
            let _ = t.join();
        }
    });
    if tokio::time::timeout(cfg.shutdown_grace, joined).await.is_err() {
        tracing::warn!("region writers did not close within the shutdown grace period");
    }
    let _ = std::fs::remove_file(&socket);
    match agent_failed {
        Some(e) => Err(e.context("the cluster agent failed")),
        None => Ok(()),
    }
}

/// Bounds of the device links' connections.
struct LinkLimits {
    conn: ConnConfig,
    grace: Duration,
    max_connections: usize,
    memory_budget: usize,
}

/// Serves the device's links on `listener` until `stop`, then waits (within the grace period)
/// for the requests in flight on them.
async fn serve_links(
    listener: std::os::unix::net::UnixListener,
    served: SharedServed,
    reads: Arc<ReadPool>,
    latency: dpukv_net::latency::OpLatency,
    limits: LinkLimits,
    stop: CancellationToken,
) -> Result<()> {
    let listener = UnixListener::from_std(listener)?;
    let tracker = TaskTracker::new();
    let limit = Arc::new(Semaphore::new(limits.max_connections));
    let budget = Budget::new(limits.memory_budget);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    tracing::warn!("connection limit reached; refusing a device connection");
                    continue;
                };
                let (served, reads, budget, stop) = (served.clone(), reads.clone(), budget.clone(), stop.clone());
                let conn_cfg = limits.conn;
                let obs = conn::Observer { latency: Some(latency.clone()), component: Some("host"), root: false };
                tracker.spawn(async move {
                    let dispatch = |batch: Vec<Incoming>, sink: Sink| dispatch(batch, sink, &served, &reads);
                    if let Err(e) = conn::serve(stream, conn_cfg, budget, obs, stop, dispatch).await {
                        tracing::debug!(error = %e, "device connection ended");
                    }
                    drop(permit);
                });
            }
        }
    }
    tracker.close();
    if tokio::time::timeout(limits.grace, tracker.wait()).await.is_err() {
        tracing::warn!("connections did not finish within the shutdown grace period");
    }
    Ok(())
}

/// Routes one request of a device connection: writes and atomics to their region's writer,
/// reads to the reader pool.
async fn dispatch(batch: Vec<Incoming>, sink: Sink, served: &SharedServed, reads: &ReadPool) {
    let mut local = Vec::new();
    for Incoming { req, charge } in batch {
        if !req.op.code().is_write() {
            local.push((req, charge));
            continue;
        }
        let writer = {
            let s = served.read().unwrap_or_else(|e| e.into_inner());
            s.map.check(&req).map(|i| s.writers.get(&s.map.regions()[i].id).cloned())
        };
        let writer = match writer {
            Ok(Some(w)) => w,
            Ok(None) => {
                let r = Response::error(req.id, ErrorCode::Unavailable, "the region is opening or closing here");
                sink.send(r, charge);
                continue;
            }
            Err((code, what)) => {
                sink.send(Response::error(req.id, code, what), charge);
                continue;
            }
        };
        let id = req.id;
        if let Err(mpsc::error::SendError(job)) = writer.send(Job { req, charge, sink: sink.clone() }).await {
            let r = Response::error(id, ErrorCode::Unavailable, "the region's writer stopped");
            job.sink.send(r, job.charge);
        }
    }
    reads.submit(local, sink).await
}

/// Exposes the writers' counters to Prometheus.
#[derive(Debug)]
struct StatsCollector(Arc<WriterStats>);

impl prometheus_client::collector::Collector for StatsCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        admin::encode_counters(
            &mut enc,
            &[
                ("dpukv_host_rounds", "write rounds (each: one group commit per region)", &self.0.rounds),
                ("dpukv_host_writes", "write requests applied", &self.0.writes),
                ("dpukv_host_atomics", "atomics executed in the reservation station", &self.0.atomics),
                ("dpukv_host_write_backs", "values written back by the reservation station", &self.0.write_backs),
                (
                    "dpukv_host_deduplicated",
                    "retried writes answered from the exactly-once sessions",
                    &self.0.deduplicated,
                ),
                ("dpukv_host_gc_segments", "value-log segments garbage collection took out", &self.0.gc_segments),
            ],
        )
    }
}
