//! The device half of a node pod (`dpukv-dpu`, the DPU or its emulator sidecar): the pod's data
//! port. It reads only what the host exposes in the pod's shared directory (module `pod`): the
//! region map, and per region its control block, table sets, L0 arenas, and the level and log
//! segments those name, all mapped read-only. GET, SCAN, FLOOR_SCAN, REDUCE and FILTER run on a
//! fixed pool of reader threads (module `reads`), wait-free; writes and atomics go to the host over
//! a few shared links (module `link`) and their replies come back through the device. Requests
//! complete out of order by id. The device follows the host through restarts: a new host closes
//! the old announcement, and readers move to the new one.
//!
//! Hot keys (docs/hot-keys.md): as the primary of its host's regions the device counts gets,
//! keeps the popular keys' copies on the regions' backups' devices current (`hot_keys`), and as
//! a backup it holds other primaries' copies in its replica table (module `replica_table`) and
//! answers gets aimed at it as a replica.
//!
//! # Layout
//! - `access`: who may do what at the data port (by the caller's certificate's role).
//! - `link`: the links to the host (multiplexed, with a reply timeout).
//! - `hot_keys`: popular keys of the led regions and their sync to replicas.
//! - `front`: the gateway's RESP and HTTP front ends in this process (`--resp`, `--http`),
//!   serving this node's regions with no second hop.
//! - this module: [`DeviceConfig`], [`run`], the data port.

mod access;
mod front;
pub mod hot_keys;
mod link;
mod stats;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use dpukv_net::fabric::{FabricListener, FabricStream};
use dpukv_proto::{ErrorCode, Op, Reply, Request, Response};
use link::HostLinks;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, Admin};
use crate::conn::{self, Budget, ConnConfig, Incoming, Sink};
use crate::pod;
use crate::reads::{ReadCounters, ReadPool};
use crate::replica_table::{Clocks, ReplicaTable, ReplicaTableConfig};
use hot_keys::{HotKeys, HotKeysConfig};

/// Device configuration.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// The pod's shared memory directory, where the host publishes.
    pub shm_dir: PathBuf,
    /// The data port.
    pub listen: SocketAddr,
    /// Baseline: forward reads to the host too.
    pub serve_reads_on_host: bool,
    /// Admin HTTP address.
    pub admin: Option<SocketAddr>,
    /// Most client connections.
    pub max_connections: usize,
    /// Limits of each client connection.
    pub conn: ConnConfig,
    /// Bytes all client connections may hold at once (frames, requests, responses).
    pub memory_budget: usize,
    /// Reader threads (the device's cores).
    pub read_threads: usize,
    /// Links to the host.
    pub host_links: usize,
    /// A forwarded request the host has not answered after this has an unknown outcome.
    pub host_timeout: Duration,
    /// How long a shutdown waits for requests in flight.
    pub shutdown_grace: Duration,
    /// On the signal to stop, how long the device goes on serving while its host still runs
    /// (the host leaves first: its primaries move elsewhere while clients still reach them).
    pub leave_timeout: Duration,
    /// TLS on the data port (with client certificates: callers are checked by their role,
    /// module `access`).
    pub tls: Option<Arc<dpukv_net::tls::ServerTls>>,
    /// Hot keys of the led regions (admission, popular sets, sync to replicas).
    pub hot: HotKeysConfig,
    /// The replica table (other primaries' popular keys).
    pub replica_table: ReplicaTableConfig,
    /// The front door (the gateway's RESP/HTTP front ends) in this process, if any: its
    /// configuration, the seed and the local node filled in at start.
    pub front: Option<dpukv_gateway::GatewayConfig>,
    /// Threads the front door runs on, each with its own event loop, connections and share of
    /// the front door's memory budget (the kernel spreads clients among them).
    pub front_threads: usize,
    /// A libfabric endpoint beside the data port: (provider, empty for libfabric's choice;
    /// where).
    pub fabric: Option<(String, SocketAddr)>,
}

/// Where the device serves.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// The data port.
    pub listen: SocketAddr,
    /// The admin endpoint, if any.
    pub admin: Option<SocketAddr>,
    /// The front door's RESP port, if any.
    pub resp: Option<SocketAddr>,
    /// The front door's HTTP port, if any.
    pub http: Option<SocketAddr>,
    /// The libfabric endpoint, if any (`fabric://PROVIDER/HOST:PORT`).
    pub fabric: Option<dpukv_net::fabric::FabricAddr>,
}

/// Serves the data port until `signal` — and past it while this pod's host still runs (its
/// socket is there), up to `leave_timeout`: a pod's containers get SIGTERM together, and the host
/// hands its primaries over before it stops; a device gone first would refuse the clients still
/// routed to those primaries.
pub async fn run(
    cfg: DeviceConfig,
    signal: CancellationToken,
    started: Option<tokio::sync::oneshot::Sender<DeviceInfo>>,
) -> Result<()> {
    let shutdown = CancellationToken::new();
    let _stopped = shutdown.clone().drop_guard();
    {
        let (shutdown, socket, bound) = (shutdown.clone(), pod::socket_path(&cfg.shm_dir), cfg.leave_timeout);
        tokio::spawn(async move {
            tokio::select! {
                _ = signal.cancelled() => {}
                _ = shutdown.cancelled() => return,
            }
            // The host runs while its socket takes connections.
            let began = std::time::Instant::now();
            while began.elapsed() < bound && std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            shutdown.cancel();
        });
    }
    let reads_counters = Arc::new(ReadCounters::default());
    let hot = HotKeys::new(cfg.hot.clone());
    let table = Arc::new(ReplicaTable::new(cfg.replica_table));
    let vouch = link::HostVouch::new(cfg.shm_dir.clone());
    let links = HostLinks::new(pod::socket_path(&cfg.shm_dir), cfg.host_links, cfg.host_timeout, hot.clone(), vouch);
    let refused = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(AtomicBool::new(false));
    let mut registry = Registry::default();
    let counters = Arc::new(stats::DeviceCounters {
        started: std::time::Instant::now(),
        reads: reads_counters.clone(),
        forwarded: links.forwarded.clone(),
        unavailable: links.unavailable.clone(),
        hot: hot.clone(),
        table: table.clone(),
        refused: refused.clone(),
        on_host: cfg.serve_reads_on_host,
    });
    registry.register_collector(Box::new(stats::Collector(counters.clone())));
    let latency = dpukv_net::latency::OpLatency::register(
        &mut registry,
        "dpukv_device_request_duration_seconds",
        "Time from a request's arrival at the device to its answer written, by operation",
    );
    // The front door's metrics (the gateway's own names), on this device's `/metrics`.
    let front_metrics = cfg.front.as_ref().map(|_| {
        let m = dpukv_gateway::metrics::Metrics::new();
        m.register_into(&mut registry);
        m
    });
    let admin_addr = match cfg.admin {
        Some(a) => {
            Some(admin::serve(a, Admin { ready: ready.clone(), registry: Arc::new(registry) }, shutdown.clone()).await?)
        }
        None => None,
    };
    let listener = TcpListener::bind(cfg.listen).await?;
    let local = listener.local_addr()?;
    let fabric = match &cfg.fabric {
        Some((provider, at)) => {
            let l =
                FabricListener::bind(provider, &at.ip().to_string(), at.port(), dpukv_net::fabric::Options::PROTOCOL)
                    .with_context(|| format!("--fabric-listen {at}"))?;
            Some(l)
        }
        None => None,
    };
    let fabric_addr = fabric.as_ref().zip(cfg.fabric.as_ref()).map(|(l, (_, at))| dpukv_net::fabric::FabricAddr {
        provider: l.provider().to_string(),
        host: at.ip().to_string(),
        port: l.port(),
    });
    // The host publishes the region map once its regions are open; wait for it.
    while pod::open_map(&cfg.shm_dir).is_err() {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let observer: Arc<dyn crate::reads::ReadObserver> = hot.clone();
    let reads = Arc::new(ReadPool::start(cfg.shm_dir.clone(), cfg.read_threads, true, reads_counters, Some(observer))?);
    hot_keys::start_sync(
        hot.clone(),
        table.clone(),
        cfg.shm_dir.clone(),
        tokio::runtime::Handle::current(),
        shutdown.child_token(),
    )?;
    let tracker = TaskTracker::new();
    let (mut resp, mut http) = (None, None);
    let mut fronts = Vec::new();
    if let (Some(front), Some(metrics)) = (cfg.front.clone(), front_metrics) {
        let device = front::InProcess {
            reads: reads.clone(),
            links: links.clone(),
            table: table.clone(),
            on_host: cfg.serve_reads_on_host,
        };
        let started = front::start(front, cfg.front_threads, device, metrics, shutdown.clone()).await?;
        (resp, http, fronts) = (started.resp, started.http, started.threads);
    }
    ready.store(true, Ordering::Release);
    if let Some(tx) = started {
        let _ = tx.send(DeviceInfo { listen: local, admin: admin_addr, resp, http, fabric: fabric_addr.clone() });
    }
    let fabric_text = fabric_addr.as_ref().map(ToString::to_string).unwrap_or_default();
    tracing::info!(listen = %local, resp = ?resp, http = ?http, fabric = %fabric_text, "device serving");
    let limit = Arc::new(Semaphore::new(cfg.max_connections));
    let budget = Budget::new(cfg.memory_budget);
    let serving = Arc::new(Serving {
        reads,
        links,
        budget: budget.clone(),
        stop: shutdown.clone(),
        table,
        hot,
        refused,
        counters,
        conn: cfg.conn,
        on_host: cfg.serve_reads_on_host,
        tls: cfg.tls.clone(),
        latency: latency.clone(),
        tracker: tracker.clone(),
    });
    if let Some(l) = fabric {
        tracker.spawn(accept_fabric(l, serving.clone(), limit.clone()));
    }
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let _ = stream.set_nodelay(true);
        // Past the limit the connection is closed at once (no queue of waiting sockets).
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        serving.spawn(Accepted::Tcp(stream), permit, None);
    }
    ready.store(false, Ordering::Release);
    tracker.close();
    if tokio::time::timeout(cfg.shutdown_grace, tracker.wait()).await.is_err() {
        tracing::warn!("connections did not finish within the shutdown grace period");
    }
    // The front door's threads stop on the same signal, within the same grace.
    let joined = tokio::task::spawn_blocking(move || fronts.into_iter().for_each(|t| drop(t.join())));
    if tokio::time::timeout(cfg.shutdown_grace, joined).await.is_err() {
        tracing::warn!("the front door did not stop within the shutdown grace period");
    }
    Ok(())
}

/// A connection accepted on the data port or the fabric endpoint.
enum Accepted {
    Tcp(tokio::net::TcpStream),
    Fabric(FabricStream),
}

/// What serving a client connection needs, shared by the data port's and the fabric endpoint's
/// accept loops.
struct Serving {
    reads: Arc<ReadPool>,
    links: Arc<HostLinks>,
    budget: Budget,
    stop: CancellationToken,
    table: Arc<ReplicaTable>,
    hot: Arc<HotKeys>,
    refused: Arc<AtomicU64>,
    counters: Arc<stats::DeviceCounters>,
    conn: ConnConfig,
    on_host: bool,
    tls: Option<Arc<dpukv_net::tls::ServerTls>>,
    latency: dpukv_net::latency::OpLatency,
    tracker: TaskTracker,
}

impl Serving {
    /// Serves an accepted connection on a task of its own, holding `permit` (its connection
    /// slot) and `held` (memory it holds outside the request budgets: a fabric connection's
    /// registered buffers) until it ends.
    fn spawn(
        self: &Arc<Self>,
        accepted: Accepted,
        permit: tokio::sync::OwnedSemaphorePermit,
        held: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let s = self.clone();
        let obs = conn::Observer { latency: Some(s.latency.clone()), component: Some("device"), root: false };
        self.tracker.spawn(async move {
            let accepted = match accepted {
                Accepted::Tcp(t) => dpukv_net::tls::accept_peer(s.tls.as_deref(), t).await,
                Accepted::Fabric(f) => dpukv_net::tls::accept_fabric_peer(s.tls.as_deref(), f).await,
            };
            let (stream, peer) = match accepted {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "a client failed the TLS handshake");
                    return;
                }
            };
            let dispatch = |batch: Vec<Incoming>, sink: Sink| {
                let batch = access::admit(batch, &peer, || s.hot.map(), &sink, &s.refused);
                if s.on_host {
                    // Gets go to the host whole: counted here, by the region they name.
                    for i in &batch {
                        if matches!(i.req.op, Op::Get { .. }) && !i.req.replica && i.req.region != 0 {
                            s.hot.gets.add(i.req.region);
                        }
                    }
                }
                // Statistics are the device's own: answered here (never by the host).
                let (asks, batch): (Vec<_>, Vec<_>) = batch.into_iter().partition(|i| matches!(i.req.op, Op::Stats));
                for Incoming { req, charge } in asks {
                    let result = Ok(Reply::Stats(s.counters.snapshot()));
                    sink.send(Response { id: req.id, version: 0, replicated: false, result }, charge);
                }
                dispatch(batch, sink, &s.reads, &s.links, &s.table, s.on_host)
            };
            if let Err(e) = conn::serve(stream, s.conn, s.budget.clone(), obs, s.stop.clone(), dispatch).await {
                tracing::debug!(error = %e, "client connection ended");
            }
            drop((permit, held));
        });
    }
}

/// The fabric endpoint's accept loop: a connection request is admitted only with a connection
/// slot (`--max-connections`, shared with the data port) and its registered buffers' share of
/// the memory budget (`--memory-budget`), checked before its buffers are registered; refused at
/// once otherwise.
async fn accept_fabric(l: FabricListener, serving: Arc<Serving>, limit: Arc<Semaphore>) {
    let bytes = l.registered_per_connection();
    loop {
        let admit = || {
            let permit = limit.clone().try_acquire_owned().ok()?;
            let held = serving.budget.try_hold(bytes)?;
            Some((permit, held))
        };
        let accepted = tokio::select! {
            _ = serving.stop.cancelled() => return,
            a = l.accept_with(admit) => a,
        };
        match accepted {
            Ok((stream, (permit, held))) => serving.spawn(Accepted::Fabric(stream), permit, Some(held)),
            Err(e) => {
                tracing::warn!(error = %e, "accepting a fabric connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Routes one client request: reads to the reader pool, writes and atomics to the host; replica
/// syncs and gets aimed at this device as a replica to the replica table.
async fn dispatch(
    batch: Vec<Incoming>,
    sink: Sink,
    reads: &ReadPool,
    links: &HostLinks,
    table: &ReplicaTable,
    on_host: bool,
) {
    let mut local = Vec::with_capacity(batch.len());
    for Incoming { req, charge } in batch {
        if let Some(resp) = replica_op(&req, table) {
            sink.send(resp, charge);
        } else if req.op.code().is_write() || on_host {
            links.forward(req, charge, sink.clone()).await
        } else {
            local.push((req, charge));
        }
    }
    reads.submit(local, sink).await
}

/// Answers a replica sync or a get aimed at this device as a replica (None: not one).
fn replica_op(req: &Request, table: &ReplicaTable) -> Option<Response> {
    match &req.op {
        Op::ReplicaSync { watermark_ms, reset, entries } => {
            Some(match table.apply(req.region, req.epoch, *watermark_ms, *reset, entries.clone(), Clocks::now()) {
                Ok(()) => Response { id: req.id, version: 0, replicated: false, result: Ok(Reply::Done) },
                Err(e) => Response::error(req.id, ErrorCode::StaleEpoch, e.to_string()),
            })
        }
        Op::Get { key } if req.replica => {
            Some(match table.read(req.region, req.epoch, key, req.consistency, Clocks::now()) {
                Ok((v, version)) => {
                    Response { id: req.id, version, replicated: true, result: Ok(Reply::Value(Some(v))) }
                }
                Err(_) => Response::error(
                    req.id,
                    ErrorCode::NotReplicated,
                    "no copy of the key here fresh enough for the read's consistency: read the primary",
                ),
            })
        }
        _ => None,
    }
}
