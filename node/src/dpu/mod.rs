//! The device half of a node pod (`dpukv-dpu`, the DPU or its emulator sidecar): the pod's data
//! port. It executes GET, SCAN and FLOOR_SCAN itself from the regions' shared memory (arenas,
//! levels, log), wait-free per operation, and forwards writes and atomics to the host over its
//! unix socket, relaying the replies; requests complete out of order by id. It follows the host
//! through restarts: readers switch to the new arenas when the host republishes its tables, and
//! requests forwarded while the host is down fail with a retryable `Unavailable`.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use dpukv_proto::{ErrorCode, Request, Response, decode_responses, encode_requests};
use dpukv_storage::ReadStats;
use dpukv_storage::region::RegionReader;
use prometheus_client::registry::Registry;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, Admin};
use crate::conn::{self};
use crate::regions::RegionMap;

/// Device configuration.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// The shared memory directory the host publishes into.
    pub shm_dir: PathBuf,
    /// The data port.
    pub listen: SocketAddr,
    /// Baseline: forward reads to the host too.
    pub serve_reads_on_host: bool,
    /// Admin HTTP address.
    pub admin: Option<SocketAddr>,
    /// Most client connections.
    pub max_connections: usize,
}

/// Where the device serves.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// The data port.
    pub listen: SocketAddr,
    /// The admin endpoint, if any.
    pub admin: Option<SocketAddr>,
}

/// Device counters.
#[derive(Debug, Default)]
pub struct DeviceStats {
    /// Reads executed on the device.
    pub served: AtomicU64,
    /// Requests forwarded to the host.
    pub forwarded: AtomicU64,
    /// Requests answered `Unavailable` because the host could not be reached.
    pub unavailable: AtomicU64,
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
}

/// Serves the data port until `shutdown`.
pub async fn run(
    cfg: DeviceConfig,
    shutdown: CancellationToken,
    started: Option<tokio::sync::oneshot::Sender<DeviceInfo>>,
) -> Result<()> {
    let stats = Arc::new(DeviceStats::default());
    let ready = Arc::new(AtomicBool::new(false));
    let mut registry = Registry::default();
    registry.register_collector(Box::new(StatsCollector(stats.clone())));
    let admin_addr = match cfg.admin {
        Some(a) => {
            Some(admin::serve(a, Admin { ready: ready.clone(), registry: Arc::new(registry) }, shutdown.clone()).await?)
        }
        None => None,
    };
    let listener = TcpListener::bind(cfg.listen).await?;
    let local = listener.local_addr()?;
    // The region map comes from the host; wait for it.
    let map = loop {
        match RegionMap::load(&cfg.shm_dir) {
            Ok(m) => break m,
            Err(_) if !shutdown.is_cancelled() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => return Err(e),
        }
    };
    ready.store(true, Ordering::Release);
    if let Some(tx) = started {
        let _ = tx.send(DeviceInfo { listen: local, admin: admin_addr });
    }
    tracing::info!(listen = %local, "device serving");
    let tracker = TaskTracker::new();
    let limit = Arc::new(Semaphore::new(cfg.max_connections));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let (map, cfg, stats, stop) = (map.clone(), cfg.clone(), stats.clone(), shutdown.clone());
                tracker.spawn(async move {
                    if let Err(e) = connection(stream, map, cfg, stats, stop).await {
                        tracing::debug!(error = %e, "client connection ended");
                    }
                    drop(permit);
                });
            }
        }
    }
    ready.store(false, Ordering::Release);
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// The forwarding link of one client connection to the host.
struct HostLink {
    tx: mpsc::Sender<Vec<Request>>,
    pending: Arc<Mutex<HashSet<u64>>>,
    broken: Arc<AtomicBool>,
}

impl HostLink {
    async fn connect(shm: &Path, out: mpsc::Sender<Response>, stats: Arc<DeviceStats>) -> std::io::Result<HostLink> {
        let stream = UnixStream::connect(crate::host::socket_path(shm)).await?;
        let (mut r, mut w) = stream.into_split();
        let pending: Arc<Mutex<HashSet<u64>>> = Arc::new(Mutex::new(HashSet::new()));
        let broken = Arc::new(AtomicBool::new(false));
        let (tx, mut rx) = mpsc::channel::<Vec<Request>>(256);
        let b = broken.clone();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            while let Some(reqs) = rx.recv().await {
                buf.clear();
                encode_requests(&reqs, &mut buf);
                if w.write_all(&buf).await.is_err() {
                    break;
                }
            }
            b.store(true, Ordering::Release);
        });
        let (p, b) = (pending.clone(), broken.clone());
        tokio::spawn(async move {
            let mut buf = Vec::new();
            while let Ok(true) = conn::read_frame(&mut r, &mut buf).await {
                let Ok(resps) = decode_responses(&buf) else { break };
                for resp in resps {
                    if p.lock().unwrap_or_else(|e| e.into_inner()).remove(&resp.id) && out.send(resp).await.is_err() {
                        return;
                    }
                }
            }
            // The host went away: everything still forwarded gets a retryable error.
            b.store(true, Ordering::Release);
            let ids: Vec<u64> = p.lock().unwrap_or_else(|e| e.into_inner()).drain().collect();
            for id in ids {
                stats.unavailable.fetch_add(1, Ordering::Relaxed);
                let _ = out.send(Response::error(id, ErrorCode::Unavailable, "host unavailable; retry")).await;
            }
        });
        Ok(HostLink { tx, pending, broken })
    }
}

async fn connection(
    stream: TcpStream,
    map: RegionMap,
    cfg: DeviceConfig,
    stats: Arc<DeviceStats>,
    stop: CancellationToken,
) -> Result<()> {
    let (mut r, w) = stream.into_split();
    let (out, writer) = conn::spawn_writer(w);
    let mut readers: Option<Vec<RegionReader>> = None;
    let mut seen = ReadStats::default();
    let mut link: Option<HostLink> = None;
    let mut buf = Vec::new();
    while let Some(entries) = conn::next_requests(&mut r, &mut buf, &out, &stop).await {
        let mut forward: Vec<Request> = Vec::new();
        for e in entries {
            match e {
                Err((id, code, what)) => out.tx.send(Response::error(id, code, what)).await?,
                Ok(req) if req.op.code().is_write() || cfg.serve_reads_on_host => forward.push(req),
                Ok(req) => {
                    if readers.is_none() {
                        readers = crate::host::open_readers(&cfg.shm_dir, &map, true).ok();
                        seen = Default::default();
                    }
                    let resp = match readers.as_mut() {
                        Some(rs) => {
                            let r = crate::reads::serve(rs, &map, &req);
                            let now = rs.iter().map(RegionReader::read_stats).fold(ReadStats::default(), add);
                            stats.node_visits.fetch_add(now.node_visits - seen.node_visits, Ordering::Relaxed);
                            stats.snapshots.fetch_add(now.snapshots - seen.snapshots, Ordering::Relaxed);
                            stats.ring_commands.fetch_add(now.commands - seen.commands, Ordering::Relaxed);
                            stats.page_table_copies.fetch_add(now.resyncs - seen.resyncs, Ordering::Relaxed);
                            stats.cache_hits.fetch_add(now.cache_hits - seen.cache_hits, Ordering::Relaxed);
                            stats.cache_misses.fetch_add(now.cache_misses - seen.cache_misses, Ordering::Relaxed);
                            seen = now;
                            r
                        }
                        None => Response::error(req.id, ErrorCode::Unavailable, "regions are not readable yet; retry"),
                    };
                    if resp.result.as_ref().is_err_and(|e| e.code == ErrorCode::Unavailable) {
                        readers = None; // reopen next time (the host may have restarted)
                    }
                    stats.served.fetch_add(1, Ordering::Relaxed);
                    out.tx.send(resp).await?;
                }
            }
        }
        if forward.is_empty() {
            continue;
        }
        if link.as_ref().is_none_or(|l| l.broken.load(Ordering::Acquire)) {
            link = HostLink::connect(&cfg.shm_dir, out.tx.clone(), stats.clone()).await.ok();
        }
        match &link {
            Some(l) => {
                l.pending.lock().unwrap_or_else(|e| e.into_inner()).extend(forward.iter().map(|r| r.id));
                stats.forwarded.fetch_add(forward.len() as u64, Ordering::Relaxed);
                if let Err(mpsc::error::SendError(reqs)) = l.tx.send(forward).await {
                    for r in reqs {
                        if l.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&r.id) {
                            out.tx
                                .send(Response::error(r.id, ErrorCode::Unavailable, "host unavailable; retry"))
                                .await?;
                        }
                    }
                }
            }
            None => {
                for r in forward {
                    stats.unavailable.fetch_add(1, Ordering::Relaxed);
                    out.tx.send(Response::error(r.id, ErrorCode::Unavailable, "host unavailable; retry")).await?;
                }
            }
        }
    }
    drop(link);
    drop(out);
    let _ = writer.await;
    Ok(())
}

fn add(a: ReadStats, b: ReadStats) -> ReadStats {
    ReadStats {
        snapshots: a.snapshots + b.snapshots,
        node_visits: a.node_visits + b.node_visits,
        resyncs: a.resyncs + b.resyncs,
        commands: a.commands + b.commands,
        cache_hits: a.cache_hits + b.cache_hits,
        cache_misses: a.cache_misses + b.cache_misses,
    }
}

#[derive(Debug)]
struct StatsCollector(Arc<DeviceStats>);

impl prometheus_client::collector::Collector for StatsCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        admin::encode_counters(
            &mut enc,
            &[
                ("dpukv_device_reads_served", "reads executed on the device", &self.0.served),
                ("dpukv_device_forwarded", "requests forwarded to the host", &self.0.forwarded),
                ("dpukv_device_unavailable", "requests failed because the host was unreachable", &self.0.unavailable),
                ("dpukv_device_node_visits", "tree node buffers visited by reads", &self.0.node_visits),
                ("dpukv_device_snapshots", "arena snapshots taken by reads", &self.0.snapshots),
                (
                    "dpukv_device_ring_commands",
                    "page-table changes applied from the command rings",
                    &self.0.ring_commands,
                ),
                (
                    "dpukv_device_page_table_copies",
                    "page-table copies taken (first use, ring overruns)",
                    &self.0.page_table_copies,
                ),
                (
                    "dpukv_device_node_cache_hits",
                    "interior nodes served from the device's node cache",
                    &self.0.cache_hits,
                ),
                ("dpukv_device_node_cache_misses", "interior nodes read from host memory", &self.0.cache_misses),
            ],
        )
    }
}
