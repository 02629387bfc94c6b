//! The host half of a node pod (`dpukv-node`): opens its regions (value log, L0 arena, levels),
//! publishes their arenas and the region map in the shared directory for the device, and
//! executes the writes and atomics the device forwards over a unix socket (the same protocol as
//! clients), acknowledging each only when it is durable. Reads that reach the host (the
//! `--serve-reads-on-host` baseline) are served from the same shared memory.
//!
//! # Layout
//! - `pipeline`: the write pipeline thread (group commit, reservation station, durability).
//! - this module: [`HostConfig`], [`run`], the socket server.

mod pipeline;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use dpukv_proto::{ErrorCode, Request, Response};
use dpukv_storage::region::{Region, RegionConfig, RegionReader};
use dpukv_storage::vlog::FsyncPolicy;
pub use pipeline::{Job, Pipeline, PipelineStats};
use prometheus_client::registry::Registry;
use tokio::net::UnixListener;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, Admin};
use crate::conn::{self};
use crate::regions::RegionMap;

/// Host configuration.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Durable data (a directory per region).
    pub data_dir: PathBuf,
    /// Shared memory directory (arenas, table sets, `REGIONS`, the host socket).
    pub shm_dir: PathBuf,
    /// The regions.
    pub regions: RegionMap,
    /// Log durability.
    pub fsync: FsyncPolicy,
    /// L0 budget per region in bytes (0 = the default).
    pub l0_budget: u64,
    /// Admin HTTP address (None: no endpoint).
    pub admin: Option<SocketAddr>,
    /// Most device connections.
    pub max_connections: usize,
    /// Baseline: one read-modify-write per atomic instead of the reservation station's merging.
    pub per_op_atomics: bool,
}

/// What [`run`] reports once it serves.
#[derive(Debug, Clone)]
pub struct HostInfo {
    /// The unix socket the device connects to.
    pub socket: PathBuf,
    /// The admin endpoint, if any.
    pub admin: Option<SocketAddr>,
}

/// The socket path in a shared directory.
pub fn socket_path(shm_dir: &std::path::Path) -> PathBuf {
    shm_dir.join("host.sock")
}

/// Opens the regions, starts the pipeline and serves until `shutdown`; `started` receives the
/// addresses once serving.
pub async fn run(
    cfg: HostConfig,
    shutdown: CancellationToken,
    started: Option<tokio::sync::oneshot::Sender<HostInfo>>,
) -> Result<()> {
    std::fs::create_dir_all(&cfg.shm_dir).with_context(|| format!("creating {}", cfg.shm_dir.display()))?;
    let mut regions = Vec::new();
    for spec in cfg.regions.regions() {
        let mut rc = RegionConfig::new(
            cfg.data_dir.join(format!("region-{}", spec.id)),
            cfg.shm_dir.join(format!("region-{}", spec.id)),
        );
        rc.vlog.fsync = cfg.fsync;
        if cfg.l0_budget > 0 {
            rc.l0_budget = cfg.l0_budget;
        }
        let (region, rec) = Region::open(rc).with_context(|| format!("opening region {}", spec.id))?;
        tracing::info!(region = spec.id, replayed = rec.replayed, dropped = rec.dropped, "region open");
        regions.push(region);
    }
    cfg.regions.store(&cfg.shm_dir)?;

    let stats = Arc::new(PipelineStats::default());
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(1024);
    let mut pipeline = Pipeline::new(regions, cfg.regions.clone(), stats.clone());
    pipeline.per_op_atomics = cfg.per_op_atomics;
    let pipeline_thread =
        std::thread::Builder::new().name("dpukv-pipeline".into()).spawn(move || pipeline.run(jobs_rx))?;

    let ready = Arc::new(AtomicBool::new(false));
    let mut registry = Registry::default();
    let s = stats.clone();
    registry.register_collector(Box::new(StatsCollector(s)));
    let admin_addr = match cfg.admin {
        Some(a) => {
            Some(admin::serve(a, Admin { ready: ready.clone(), registry: Arc::new(registry) }, shutdown.clone()).await?)
        }
        None => None,
    };

    let socket = socket_path(&cfg.shm_dir);
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
    ready.store(true, Ordering::Release);
    if let Some(tx) = started {
        let _ = tx.send(HostInfo { socket: socket.clone(), admin: admin_addr });
    }
    tracing::info!(socket = %socket.display(), "host serving");
    let tracker = TaskTracker::new();
    let limit = Arc::new(Semaphore::new(cfg.max_connections));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    tracing::warn!("connection limit reached; refusing a device connection");
                    continue;
                };
                let (jobs, map, shm, stop) = (jobs_tx.clone(), cfg.regions.clone(), cfg.shm_dir.clone(), shutdown.clone());
                tracker.spawn(async move {
                    if let Err(e) = connection(stream, jobs, map, shm, stop).await {
                        tracing::debug!(error = %e, "device connection ended");
                    }
                    drop(permit);
                });
            }
        }
    }
    ready.store(false, Ordering::Release);
    tracker.close();
    tracker.wait().await;
    drop(jobs_tx);
    let _ = tokio::task::spawn_blocking(move || pipeline_thread.join()).await;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// One device connection: decodes frames, serves reads from shared memory, queues writes.
async fn connection(
    stream: tokio::net::UnixStream,
    jobs: mpsc::Sender<Job>,
    map: RegionMap,
    shm: PathBuf,
    stop: CancellationToken,
) -> Result<()> {
    let (mut r, w) = stream.into_split();
    let (out, writer) = conn::spawn_writer(w);
    let mut readers: Option<Vec<RegionReader>> = None;
    let mut buf = Vec::new();
    while let Some(entries) = conn::next_requests(&mut r, &mut buf, &out, &stop).await {
        let mut writes: Vec<Request> = Vec::new();
        for e in entries {
            match e {
                Err((id, code, what)) => out.tx.send(Response::error(id, code, what)).await?,
                Ok(req) if req.op.code().is_write() => writes.push(req),
                Ok(req) => {
                    if readers.is_none() {
                        readers = open_readers(&shm, &map, false).ok();
                    }
                    let resp = match readers.as_mut() {
                        Some(rs) => crate::reads::serve(rs, &map, &req),
                        None => Response::error(req.id, ErrorCode::Unavailable, "regions are not readable yet"),
                    };
                    out.tx.send(resp).await?;
                }
            }
        }
        if !writes.is_empty() {
            jobs.send(Job { reqs: writes, reply: out.tx.clone() }).await.context("the write pipeline stopped")?;
        }
    }
    drop(out);
    let _ = writer.await;
    Ok(())
}

/// Readers of every region's shared memory, in map order; `device`: through page-table copies
/// fed by the command rings (the device), else through the page tables (the host's CPU).
pub fn open_readers(shm: &std::path::Path, map: &RegionMap, device: bool) -> dpukv_storage::Result<Vec<RegionReader>> {
    map.regions()
        .iter()
        .map(|s| {
            let dir = shm.join(format!("region-{}", s.id));
            if device { RegionReader::open_device(dir) } else { RegionReader::open(dir) }
        })
        .collect()
}

/// Exposes the pipeline's counters to Prometheus.
#[derive(Debug)]
struct StatsCollector(Arc<PipelineStats>);

impl prometheus_client::collector::Collector for StatsCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        admin::encode_counters(
            &mut enc,
            &[
                ("dpukv_host_rounds", "write pipeline rounds", &self.0.rounds),
                ("dpukv_host_writes", "write requests applied", &self.0.writes),
                ("dpukv_host_atomics", "atomics executed in the reservation station", &self.0.atomics),
                ("dpukv_host_write_backs", "values written back by the reservation station", &self.0.write_backs),
            ],
        )
    }
}

impl std::fmt::Debug for PipelineStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineStats").field("rounds", &self.rounds.load(Ordering::Relaxed)).finish()
    }
}
