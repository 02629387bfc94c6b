//! dpukv-gateway: one endpoint for a whole cluster (docs/gateway.md, docs/architecture.md §8).
//! Users and their tools talk to the gateway, not to regions: it routes each operation to its
//! region's primary device with the client library's router (the one routing implementation),
//! fans scans out across regions in parallel, and speaks three protocols — the binary protocol
//! (existing clients point at it unchanged), HTTP/JSON and the Redis protocol (RESP 2).
//!
//! It sits on `dpukv-client` (routing, exactly-once writes), `dpukv-net` (bounded binary
//! connections) and `dpukv-proto`; nothing depends on it.
//!
//! # Layout
//! - `config`: the binary's flags.
//! - `auth`: bearer tokens and their per-prefix grants.
//! - `throttle`: failed authentications, throttled per peer address.
//! - `budget`: each connection's share of the process's memory budget.
//! - `upstream`: the cluster as the gateway sees it; forwarding binary requests with their
//!   senders' exactly-once tags; the one-region map binary clients are shown.
//! - `scan`: scans across regions, read in parallel and taken in key order.
//! - `pivots`: where long scans inside one region are cut (cached pivots, learned gap sizes).
//! - `binary`: the binary protocol front end.
//! - `resp`: the Redis protocol front end.
//! - `http`: the HTTP/JSON front end (and `/metrics`, health, OpenAPI).
//! - `metrics`: latency histograms per front end and operation, errors, connections.
//! - `join`: polling many futures in one task (a frame's requests go upstream together).
//!
//! # Invariants
//! - The gateway holds no durable state: any number of them may serve one cluster, and one may
//!   be restarted at any time (only `SCAN` cursors of the RESP front end are its own, in a
//!   bounded table).
//! - A write is applied once: a binary client's exactly-once tag is kept end to end; the other
//!   front ends' writes carry the gateway's own tag, so its retries after a failover are
//!   answered from the node's session table.
//! - Every front end is bounded: connections, bytes held (the process's memory budget, from
//!   which requests reserve their largest reply; a connection at most its share) and time.
//! - Nothing is reserved for a client before it has authenticated (with tokens configured):
//!   an unauthenticated connection holds a fixed buffer and its place under the connection cap,
//!   for a bounded time.

// Allocations counted per thread in the unit tests (the GET path allocates nothing per command).
#[cfg(test)]
#[global_allocator]
static COUNTING: dpukv_alloc_count::Counting = dpukv_alloc_count::Counting;

pub mod auth;
pub mod binary;
pub mod budget;
pub mod config;
pub mod console;
pub mod http;
pub mod join;
pub mod metrics;
pub mod pivots;
pub mod resp;
pub mod scan;
pub mod throttle;
pub mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use dpukv_net::conn::Budget;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::binary::BinaryLimits;
use crate::http::HttpLimits;
use crate::metrics::Metrics;
use crate::resp::RespLimits;
use crate::scan::ScanLimits;
use crate::upstream::Upstream;

/// A gateway's configuration (see `config` for what each means).
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Node devices to learn the cluster from.
    pub seeds: Vec<String>,
    /// The binary front end (None: none — a front door embedded in a device, whose data port
    /// serves the binary protocol).
    pub listen: Option<SocketAddr>,
    /// The HTTP front end, if any.
    pub http: Option<SocketAddr>,
    /// The RESP front end, if any.
    pub resp: Option<SocketAddr>,
    /// The admin endpoint (`/healthz`, `/readyz`, `/metrics`), if any.
    pub admin: Option<SocketAddr>,
    /// Connections per node device.
    pub pool: usize,
    /// Tree nodes cached per region for start hints (0: none).
    pub fat_root: usize,
    /// `extended` mode: requests in flight to a primary above which it is busy.
    pub busy_in_flight: usize,
    /// The binary front end's limits.
    pub binary: BinaryLimits,
    /// The HTTP front end's limits.
    pub http_limits: HttpLimits,
    /// The RESP front end's limits.
    pub resp_limits: RespLimits,
    /// Bytes all requests together may hold.
    pub memory_budget: usize,
    /// Parts one scan reads ahead.
    pub scan_parallelism: usize,
    /// Parts all scans may hold.
    pub scan_parts: usize,
    /// Scans of at least this many items are split inside regions (0: never).
    pub scan_split_min: usize,
    /// How often the region map is refreshed even if no node said it moved.
    pub map_refresh: Duration,
    /// SCAN cursors kept.
    pub scan_cursors: usize,
    /// How long a SCAN cursor stays valid.
    pub scan_cursor_ttl: Duration,
    /// How long a shutdown waits for connections.
    pub shutdown_grace: Duration,
    /// With tokens, how long a binary or RESP connection may take to authenticate.
    pub auth_timeout: Duration,
    /// Failed authentications a peer address may make in a row.
    pub auth_failures: u32,
    /// Over which those failures come back.
    pub auth_failure_window: Duration,
    /// Where the bearer tokens come from (none: the gateway is open).
    pub tokens: auth::TokenSource,
    /// TLS on the front ends (the admin endpoint stays plain).
    pub tls_server: Option<Arc<dpukv_net::tls::ServerTls>>,
    /// TLS to the devices.
    pub tls_client: Option<Arc<dpukv_net::tls::ClientTls>>,
    /// Embedded in a device's process: that node, whose regions are served by a call (the
    /// seed [`dpukv_client::LOCAL_SEED`] names it).
    pub local: Option<dpukv_client::local::Local>,
    /// What this gateway shares with the others of its process (None: its own): a device's front
    /// door threads ([`start_threads`]).
    pub shared: Option<GatewayShared>,
    /// The web console on the HTTP front end (`/ui/`, `/v1/console/`; None: off).
    pub console: Option<console::ConsoleConfig>,
    /// Bind the front ends with `SO_REUSEPORT`, so that several gateways (one per thread of a
    /// device's front door) share their ports, the kernel spreading connections among them.
    pub reuse_port: bool,
}

impl GatewayConfig {
    /// How the gateway's client of the cluster connects.
    fn upstream_options(&self) -> dpukv_client::Options {
        dpukv_client::Options {
            pool: self.pool,
            token: None,
            tls: self.tls_client.clone(),
            fat_root: Some(self.fat_root),
            busy_in_flight: Some(self.busy_in_flight),
            local: self.local.clone(),
            ..Default::default()
        }
    }
}

/// How often the token file is looked at (a revoked token's sessions end within this).
pub const TOKEN_RELOAD: Duration = Duration::from_secs(2);

/// Peer addresses whose failed authentications are remembered.
const THROTTLED_PEERS: usize = 65_536;

/// Where a started gateway listens.
#[derive(Debug, Clone)]
pub struct GatewayInfo {
    /// The binary front end.
    pub binary: Option<SocketAddr>,
    /// The HTTP front end.
    pub http: Option<SocketAddr>,
    /// The RESP front end.
    pub resp: Option<SocketAddr>,
    /// The admin endpoint.
    pub admin: Option<SocketAddr>,
}

/// Starts `threads` gateways as `cfg` says, each on a thread of its own (`NAME-<i>`) with a
/// single-threaded event loop (a request is parsed, served and answered on one thread), all on
/// the same ports (`SO_REUSEPORT`: the kernel spreads the connections), sharing
/// [`GatewayShared`] (made here unless `cfg` has one), each with `1/threads` of the memory budget
/// and of each front end's connections; `customize` adjusts each thread's configuration. Returns
/// where they listen (a port 0 becomes the one the first bound) and their threads, which end on
/// `shutdown`.
pub async fn start_threads(
    mut cfg: GatewayConfig,
    threads: usize,
    name: &str,
    shutdown: CancellationToken,
    customize: impl Fn(usize, &mut GatewayConfig),
) -> Result<(GatewayInfo, Vec<std::thread::JoinHandle<()>>)> {
    let threads = threads.max(1);
    if cfg.shared.is_none() {
        cfg.shared = Some(GatewayShared::new(&cfg, Metrics::new(), shutdown.clone())?);
    }
    cfg.reuse_port = threads > 1;
    cfg.memory_budget = (cfg.memory_budget / threads).max(dpukv_proto::limits::MAX_VALUE * 4);
    // The process's bounds, split among the threads.
    for max in
        [&mut cfg.binary.max_connections, &mut cfg.http_limits.max_connections, &mut cfg.resp_limits.max_connections]
    {
        *max = max.div_ceil(threads);
    }
    let mut handles = Vec::new();
    let mut info = None;
    for i in 0..threads {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut this = cfg.clone();
        customize(i, &mut this);
        let stop = shutdown.clone();
        let what = name.to_string();
        let t = std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return tracing::error!(error = %e, "the {what}'s event loop could not start"),
            };
            if let Err(e) = rt.block_on(run(this, stop, Some(tx))) {
                tracing::error!(error = %e, "the {what} failed");
            }
        })?;
        handles.push(t);
        let started = rx.await.map_err(|_| anyhow::anyhow!("the {name} did not start (see the log)"))?;
        // The first bound the ports (a port 0 became a real one); the others share them.
        if info.is_none() {
            (cfg.listen, cfg.http, cfg.resp, cfg.admin) = (started.binary, started.http, started.resp, started.admin);
        }
        info.get_or_insert(started);
    }
    Ok((info.expect("at least one thread"), handles))
}

/// A listener on `a` (with `SO_REUSEPORT` when `reuse`).
async fn bind(a: SocketAddr, reuse: bool) -> Result<TcpListener> {
    if !reuse {
        return TcpListener::bind(a).await.with_context(|| format!("binding {a}"));
    }
    let s = if a.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    s.set_reuseaddr(true)?;
    s.set_reuseport(true)?;
    s.bind(a).with_context(|| format!("binding {a}"))?;
    Ok(s.listen(1024)?)
}

/// What the gateways of one process share — a device's front door threads ([`start_threads`]):
/// the metrics, the tokens (one reload), the login throttle (a peer's failures count in every
/// thread) and the `SCAN` cursors (a cursor may be continued on another connection, which may
/// land on another thread).
#[derive(Clone)]
pub struct GatewayShared {
    /// The metrics.
    pub metrics: Arc<Metrics>,
    access: auth::Access,
    throttle: Arc<throttle::AuthThrottle>,
    cursors: Arc<resp::cursors::Cursors>,
}

impl std::fmt::Debug for GatewayShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayShared").finish_non_exhaustive()
    }
}

impl GatewayShared {
    /// For gateways configured as `cfg`, recording into `metrics`: the tokens loaded (a bad
    /// document is an error) and, from a file, re-read until `shutdown` (a task on the calling
    /// runtime).
    pub fn new(cfg: &GatewayConfig, metrics: Arc<Metrics>, shutdown: CancellationToken) -> Result<GatewayShared> {
        let access = auth::Access::load(&cfg.tokens).map_err(anyhow::Error::msg)?;
        if let auth::TokenSource::File(p) = &cfg.tokens {
            access.reload_every(p.clone(), TOKEN_RELOAD, shutdown);
        }
        Ok(GatewayShared {
            metrics,
            access,
            throttle: Arc::new(throttle::AuthThrottle::new(
                cfg.auth_failures,
                cfg.auth_failure_window,
                THROTTLED_PEERS,
            )),
            cursors: Arc::new(resp::cursors::Cursors::new(cfg.scan_cursors, cfg.scan_cursor_ttl)),
        })
    }
}

/// Runs a gateway until `shutdown`; tells `started` where it listens once it serves.
pub async fn run(
    cfg: GatewayConfig,
    shutdown: CancellationToken,
    started: Option<tokio::sync::oneshot::Sender<GatewayInfo>>,
) -> Result<()> {
    // A bad token document stops the start, before anything listens.
    let shared = match cfg.shared.clone() {
        Some(s) => s,
        None => GatewayShared::new(&cfg, Metrics::new(), shutdown.clone())?,
    };
    let metrics = shared.metrics.clone();
    let binary_listener = match cfg.listen {
        Some(a) => Some(bind(a, cfg.reuse_port).await?),
        None => None,
    };
    let http_listener = match cfg.http {
        Some(a) => Some(bind(a, cfg.reuse_port).await?),
        None => None,
    };
    let admin_listener = match cfg.admin {
        Some(a) => Some(bind(a, cfg.reuse_port).await?),
        None => None,
    };
    let resp_listener = match cfg.resp {
        Some(a) => Some(bind(a, cfg.reuse_port).await?),
        None => None,
    };
    let scans = ScanLimits {
        parallelism: cfg.scan_parallelism,
        part_permits: Arc::new(Semaphore::new(cfg.scan_parts)),
        split_min: cfg.scan_split_min,
        parts_total: cfg.scan_parts,
        metrics: metrics.clone(),
        pivots: Default::default(),
    };
    // The cluster may not be up yet: keep trying (a gateway is started beside its cluster).
    let mut delay = Duration::from_millis(100);
    let up = loop {
        match Upstream::connect(&cfg.seeds, cfg.upstream_options(), scans.clone()).await {
            Ok(u) => break Arc::new(u),
            Err(e) => tracing::warn!(error = %e, retry_in = ?delay, "the cluster does not answer yet"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(2));
    };
    up.refresh_map_every(cfg.map_refresh, shutdown.clone());
    metrics.count_reads(up.client().read_counts());
    let budget = Budget::new(cfg.memory_budget);
    let tracker = TaskTracker::new();
    let info = GatewayInfo {
        binary: binary_listener.as_ref().map(TcpListener::local_addr).transpose()?,
        http: http_listener.as_ref().map(TcpListener::local_addr).transpose()?,
        resp: resp_listener.as_ref().map(TcpListener::local_addr).transpose()?,
        admin: admin_listener.as_ref().map(TcpListener::local_addr).transpose()?,
    };
    let (access, throttle) = (shared.access.clone(), shared.throttle.clone());
    metrics.watch_budget(budget.clone());
    if let Some(l) = binary_listener {
        tracker.spawn(binary::serve(
            l,
            binary::Front {
                up: up.clone(),
                access: access.clone(),
                throttle: throttle.clone(),
                tls: cfg.tls_server.clone(),
                limits: cfg.binary,
                auth_timeout: cfg.auth_timeout,
                budget: budget.clone(),
                metrics: metrics.clone(),
            },
            shutdown.clone(),
            tracker.clone(),
        ));
    }
    let console = match (&cfg.console, &http_listener) {
        (Some(c), Some(_)) => Some(console::Console::start(c.clone(), up.clone(), shutdown.clone())),
        _ => None,
    };
    let state = http::HttpState {
        console,
        up: up.clone(),
        access: access.clone(),
        throttle: throttle.clone(),
        limits: cfg.http_limits,
        budget: budget.clone(),
        starvation: budget::Starvation::watch(
            budget.clone(),
            dpukv_proto::limits::MAX_VALUE + (64 << 10),
            Duration::from_millis(500),
            shutdown.clone(),
        ),
        metrics: metrics.clone(),
    };
    for (l, router, what, tls) in [
        (http_listener, http::router(state.clone()), "HTTP front end", cfg.tls_server.clone()),
        (admin_listener, http::admin_router(state.clone()), "admin endpoint", None),
    ] {
        let Some(l) = l else { continue };
        let (stop, state) = (shutdown.clone(), state.clone());
        tracker.spawn(async move {
            if let Err(e) = http::serve(l, router, &state, tls, stop).await {
                tracing::error!(error = %e, "the {what} failed");
            }
        });
    }
    if let Some(l) = resp_listener {
        let shared = Arc::new(resp::Shared {
            up: up.clone(),
            access: access.clone(),
            throttle: throttle.clone(),
            limits: cfg.resp_limits,
            budget: budget.clone(),
            cursors: shared.cursors.clone(),
            metrics: metrics.clone(),
            port: info.resp.map_or(0, |a| a.port()),
            tls: cfg.tls_server.clone(),
        });
        tracker.spawn(resp::serve(l, shared, shutdown.clone(), tracker.clone()));
    }
    tracing::info!(binary = ?info.binary, http = ?info.http, resp = ?info.resp, admin = ?info.admin, "gateway serving");
    if let Some(tx) = started {
        let _ = tx.send(info);
    }
    shutdown.cancelled().await;
    tracker.close();
    if tokio::time::timeout(cfg.shutdown_grace, tracker.wait()).await.is_err() {
        tracing::warn!("connections did not finish within the shutdown grace period");
    }
    Ok(())
}
