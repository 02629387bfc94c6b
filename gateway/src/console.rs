//! The web console (docs/console.md): static pages at `/ui/` (embedded in the binary: no CDN, no
//! external fonts) and their JSON APIs under `/v1/console/` — the cluster, its regions with a
//! key-space heatmap over time, where reads are served (primaries' devices, replicas' devices,
//! the host) with the popular keys, the cluster's events, and actions (drain, step down, split).
//!
//! Sources: the region map (the gateway's client), every device's `stats` (binary protocol, the
//! gateway's own identity), and the hosts' control API (`/cluster/summary`, `/events`, `/loads`
//! with the gateway's certificate or the control token; actions with the control token).
//!
//! **One sampler, not one fan-out per page view**: a task takes a sample every
//! [`SAMPLE_EVERY`] — each device's statistics and the control API's summary, loads and events —
//! while the console was asked for in the last [`KEEP_SAMPLING`]; pages are answered from the
//! latest sample, so a client polling the APIs costs the cluster nothing more. The heatmap keeps
//! [`HEATMAP_SAMPLES`] intervals; history starts when the console is first opened.
//!
//! **Who sees what** (the gateway's tokens): any valid token sees the topology, counters and
//! events; region bounds and popular keys only where the token may read those keys (else
//! `redacted`); actions need `admin` on every key. An open gateway (no tokens) shows and allows
//! everything (plain mode). Actions also need the gateway's control credential
//! (`--control-token-file`): without one they answer `503 not_configured`.
//!
//! Bounds: at most [`HEATMAP_SAMPLES`] × (regions ≤ `stats::MAX_REGIONS`) counts, one sample in
//! flight, each device asked within the client's attempt timeout, each control call within its
//! deadlines.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Query, State};
use std::net::IpAddr;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dpukv_client::control::{ControlClient, ControlError};
use dpukv_proto::control::{Action, ControlRoute};
use dpukv_proto::regionmap::{RegionMap, RegionState};
use dpukv_proto::stats::DeviceStats;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::auth::{Perm, Principal};
use crate::http::api::Encoding;
use crate::http::{ApiError, Caller, HttpState, JsonBody, Peer};
use crate::upstream::Upstream;

/// How often the sampler samples.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How long after the last console request the sampler goes on.
pub const KEEP_SAMPLING: Duration = Duration::from_secs(600);
/// Intervals the heatmap keeps (5 minutes at 2 s).
pub const HEATMAP_SAMPLES: usize = 150;
/// Events kept (the cluster keeps 256).
const MAX_EVENTS: usize = 256;
/// The longest the sampler waits for any one source.
pub const ASK_WITHIN: Duration = Duration::from_secs(3);

const INDEX_HTML: &str = include_str!("../console/index.html");
const CONSOLE_JS: &str = include_str!("../console/console.js");
const CONSOLE_CSS: &str = include_str!("../console/console.css");

/// What the console needs besides the gateway's state.
#[derive(Clone, Default)]
pub struct ConsoleConfig {
    /// How to reach the hosts' control API (TLS with the gateway's certificate for reads; the
    /// token, if given, for actions and reads).
    pub control: ControlClient,
}

impl std::fmt::Debug for ConsoleConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleConfig").field("token", &self.control.token.is_some()).finish_non_exhaustive()
    }
}

/// One sample.
#[derive(Default)]
struct Sample {
    /// When (Unix ms).
    at_ms: u64,
    /// Each node's device statistics, or why not.
    devices: BTreeMap<u32, Result<DeviceStats, String>>,
    /// `/cluster/summary`, or why not.
    summary: Option<Result<Value, String>>,
    /// Region -> (bytes, writes per second) as the primaries reported.
    loads: HashMap<u32, (u64, u64)>,
    /// The cluster's events, oldest first.
    events: Vec<Value>,
    /// Each node's host (`/cluster/host` at its control API), or why not.
    hosts: BTreeMap<u32, Result<Value, String>>,
    /// The region map, asked afresh (the routing map may lag by `--map-refresh`).
    map: Option<Arc<RegionMap>>,
}

/// The heatmap: per interval, per region, (reads, writes).
#[derive(Default)]
struct Heat {
    times: VecDeque<u64>,
    cells: VecDeque<HashMap<u32, (u64, u64)>>,
    /// The last gets per (node, region) seen, to take differences.
    last_gets: HashMap<(u32, u32), u64>,
    /// Each device's uptime when last seen (a smaller one: it restarted).
    uptimes: HashMap<u32, u64>,
}

/// See the module documentation.
pub struct Console {
    cfg: ConsoleConfig,
    /// The control API as the sampler reads it: the gateway's certificate alone when it has one
    /// (the admin token is sent only with actions), else the token.
    reader: ControlClient,
    up: Arc<Upstream>,
    started: Instant,
    /// Unix ms of the last console request.
    asked_ms: AtomicU64,
    wake: Notify,
    latest: std::sync::Mutex<Option<Arc<Sample>>>,
    /// Reads per second per region over the last interval.
    rates: std::sync::Mutex<HashMap<u32, f64>>,
    heat: std::sync::Mutex<Heat>,
    sampled: Notify,
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Console {
    /// A console on `up`; its sampler runs on the calling runtime until `stop`.
    pub fn start(cfg: ConsoleConfig, up: Arc<Upstream>, stop: CancellationToken) -> Arc<Console> {
        let reader = ControlClient {
            token: if cfg.control.tls.is_some() { None } else { cfg.control.token.clone() },
            ..cfg.control.clone()
        };
        let c = Arc::new(Console {
            reader,
            cfg,
            up,
            started: Instant::now(),
            asked_ms: AtomicU64::new(0),
            wake: Notify::new(),
            latest: Default::default(),
            rates: Default::default(),
            heat: Default::default(),
            sampled: Notify::new(),
        });
        let me = c.clone();
        tokio::spawn(async move {
            loop {
                let idle = unix_ms().saturating_sub(me.asked_ms.load(Ordering::Relaxed));
                if me.asked_ms.load(Ordering::Relaxed) == 0 || idle > KEEP_SAMPLING.as_millis() as u64 {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = me.wake.notified() => {}
                    }
                    continue;
                }
                let began = Instant::now();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = me.sample() => {}
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(SAMPLE_EVERY.saturating_sub(began.elapsed())) => {}
                }
            }
        });
        c
    }

    /// The latest sample (waking the sampler). A request waits a few seconds at most for a
    /// sample when there is none, or the one there is older than two intervals (the sampler was
    /// idle).
    async fn current(&self) -> Arc<Sample> {
        self.asked_ms.store(unix_ms(), Ordering::Relaxed);
        self.wake.notify_one();
        let sampled = self.sampled.notified();
        tokio::pin!(sampled);
        sampled.as_mut().enable();
        let fresh_after = unix_ms().saturating_sub(2 * SAMPLE_EVERY.as_millis() as u64);
        if let Some(s) = lock(&self.latest).clone().filter(|s| s.at_ms >= fresh_after) {
            return s;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), sampled).await;
        lock(&self.latest).clone().unwrap_or_default()
    }

    /// Takes a sample (see the module documentation) and adds it to the heatmap. Every source is
    /// asked at once, each within [`ASK_WITHIN`]: one dead node slows no sample down.
    async fn sample(&self) {
        let mut s = Sample { at_ms: unix_ms(), ..Sample::default() };
        // A fresh map (what the pages show): the routing one is refreshed only every few seconds
        // unless a node says it moved, and a drain or a failover is what the console is for.
        let map = match tokio::time::timeout(ASK_WITHIN, self.up.client().region_map()).await {
            Ok(Ok(m)) => Some(Arc::new(m)),
            _ => self.up.client().current_map().await.ok(),
        };
        s.map = map.clone();
        let Some(map) = &map else {
            self.record(&s);
            *lock(&self.latest) = Some(Arc::new(s));
            self.sampled.notify_waiters();
            return;
        };
        let reader = &self.reader;
        let parse = |r: Result<Result<String, ControlError>, tokio::time::error::Elapsed>| match r {
            Ok(Ok(b)) => serde_json::from_str::<Value>(&b).map_err(|e| format!("not JSON: {e}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {ASK_WITHIN:?}")),
        };
        let devices = map.nodes.iter().map(|n| {
            let client = self.up.client();
            async move {
                let got = match tokio::time::timeout(ASK_WITHIN, client.device_stats(n.id)).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within {ASK_WITHIN:?}")),
                };
                (n.id, got)
            }
        });
        let hosts = map.nodes.iter().filter(|n| !n.admin.is_empty()).map(|n| async move {
            (n.id, parse(tokio::time::timeout(ASK_WITHIN, reader.must(&n.admin, &ControlRoute::Host)).await))
        });
        // The cluster-wide reads go to a node picked by this gateway's pid: gateways spread out.
        let addr = reader.endpoint(map, None).map(|fixed| {
            let mut all: Vec<&str> =
                map.nodes.iter().filter(|n| !n.admin.is_empty()).map(|n| n.admin.as_str()).collect();
            all.sort_unstable();
            if reader.addr.is_some() || all.is_empty() {
                fixed
            } else {
                all[std::process::id() as usize % all.len()].to_string()
            }
        });
        let cluster = async {
            match &addr {
                Ok(a) => {
                    let (summary, loads, events) = tokio::join!(
                        tokio::time::timeout(ASK_WITHIN, reader.must(a, &ControlRoute::Summary)),
                        tokio::time::timeout(ASK_WITHIN, reader.must(a, &ControlRoute::Loads)),
                        tokio::time::timeout(ASK_WITHIN, reader.must(a, &ControlRoute::Events)),
                    );
                    (parse(summary), parse(loads), parse(events))
                }
                Err(e) => (Err(e.to_string()), Err(e.to_string()), Err(e.to_string())),
            }
        };
        let (devices, hosts, (summary, loads, events)) =
            tokio::join!(crate::join::join_all(devices.collect()), crate::join::join_all(hosts.collect()), cluster);
        s.devices = devices.into_iter().collect();
        s.hosts = hosts.into_iter().collect();
        s.summary = Some(summary);
        if let Ok(v) = loads {
            for l in v["loads"].as_array().into_iter().flatten() {
                if let (Some(r), Some(b), Some(w)) =
                    (l["region"].as_u64(), l["bytes"].as_u64(), l["writes_per_sec"].as_u64())
                {
                    s.loads.insert(r as u32, (b, w));
                }
            }
        }
        match events {
            Ok(v) => {
                let all = v["events"].as_array().cloned().unwrap_or_default();
                s.events = all.into_iter().rev().take(MAX_EVENTS).rev().collect();
            }
            Err(_) => {
                if let Some(prev) = lock(&self.latest).as_ref() {
                    s.events = prev.events.clone();
                }
            }
        }
        self.record(&s);
        *lock(&self.latest) = Some(Arc::new(s));
        self.sampled.notify_waiters();
    }

    /// Adds a sample's gets (differences since the last) and write rates to the heatmap. After a
    /// gap (the sampler was idle) the differences start again; a device that restarted (its
    /// uptime went back) counts from zero; a device that did not answer keeps its last counts.
    fn record(&self, s: &Sample) {
        let mut heat = lock(&self.heat);
        let prev_at = heat.times.back().copied();
        let gap = prev_at.is_some_and(|p| s.at_ms.saturating_sub(p) > 2 * SAMPLE_EVERY.as_millis() as u64);
        if gap {
            heat.last_gets.clear();
            heat.uptimes.clear();
        }
        let secs = prev_at.filter(|_| !gap).map(|p| (s.at_ms.saturating_sub(p) as f64 / 1000.0).max(0.001));
        let mut cells: HashMap<u32, (u64, u64)> = HashMap::new();
        for (node, stats) in &s.devices {
            let Ok(stats) = stats else { continue };
            let uptime = stats.counter("uptime_ms").unwrap_or(0);
            if heat.uptimes.insert(*node, uptime).is_some_and(|before| uptime < before) {
                heat.last_gets.retain(|(n, _), _| n != node);
            }
            heat.last_gets.retain(|(n, r), _| n != node || stats.regions.iter().any(|x| x.region == *r));
            for r in &stats.regions {
                let key = (*node, r.region);
                let before = heat.last_gets.insert(key, r.gets);
                // First seen (or its slot was freed and taken again): nothing to compare with.
                let delta = before.map_or(0, |b| r.gets.saturating_sub(b));
                cells.entry(r.region).or_default().0 += delta;
            }
        }
        for (region, (_, wps)) in &s.loads {
            cells.entry(*region).or_default().1 = (*wps as f64 * secs.unwrap_or(0.0)) as u64;
        }
        if let Some(secs) = secs {
            *lock(&self.rates) = cells.iter().map(|(r, (reads, _))| (*r, *reads as f64 / secs)).collect();
        }
        heat.times.push_back(s.at_ms);
        heat.cells.push_back(cells);
        while heat.times.len() > HEATMAP_SAMPLES + 1 {
            heat.times.pop_front();
            heat.cells.pop_front();
        }
    }
}

/// A key for JSON: (text, encoding).
fn shown_key(k: &[u8]) -> (String, Encoding) {
    match std::str::from_utf8(k) {
        Ok(s) if !s.chars().any(char::is_control) => (s.to_string(), Encoding::Utf8),
        _ => (Encoding::Base64.encode(k).unwrap_or_default(), Encoding::Base64),
    }
}

/// Whether the caller may read `key` (everyone on an open gateway).
fn may_read(p: Option<&Principal>, key: &[u8]) -> bool {
    p.is_none_or(|p| p.may(Perm::Read, key))
}

/// Whether the caller may run cluster actions: `admin` on every key (everyone on an open
/// gateway).
fn is_admin(p: Option<&Principal>) -> bool {
    p.is_none_or(|p| p.may_range(Perm::Admin, &[], &[]))
}

fn console_of(s: &HttpState) -> Result<&Arc<Console>, ApiError> {
    s.console
        .as_ref()
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", "the console is off (--no-console)"))
}

fn state_name(s: RegionState) -> &'static str {
    match s {
        RegionState::Serving => "serving",
        RegionState::Moving => "moving",
        RegionState::Splitting => "splitting",
        RegionState::Merging => "merging",
    }
}

/// The map the sample was taken with, else the gateway's routing map.
async fn map_of(s: &HttpState, sample: &Sample) -> Result<Arc<RegionMap>, ApiError> {
    match &sample.map {
        Some(m) => Ok(m.clone()),
        None => s.up.client().current_map().await.map_err(ApiError::from),
    }
}

/// `GET /v1/console/overview`.
#[utoipa::path(get, path = "/v1/console/overview", tag = "console",
    responses((status = 200, description = "The cluster: nodes (device and host figures), the master, health (docs/console.md)"), (status = 401, body = crate::http::api::ErrorBody)))]
pub(crate) async fn overview(State(s): State<HttpState>, caller: Caller) -> Result<axum::Json<Value>, ApiError> {
    let c = console_of(&s)?;
    let sample = c.current().await;
    let map = map_of(&s, &sample).await?;
    let p = caller.principal();
    let summary = sample.summary.as_ref();
    let ok_summary = summary.and_then(|r| r.as_ref().ok());
    let draining = |n: u32| ok_summary.is_some_and(|v| v["draining"].as_array().is_some_and(|a| a.contains(&json!(n))));
    let stepping =
        |n: u32| ok_summary.is_some_and(|v| v["stepping_down"].as_array().is_some_and(|a| a.contains(&json!(n))));
    let mut ids: Vec<u32> = map.nodes.iter().map(|n| n.id).collect();
    // Nodes the regions name that are not live (lost).
    for r in &map.regions {
        for id in r.replicas() {
            if id != 0 && !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids.sort_unstable();
    let nodes: Vec<Value> = ids
        .iter()
        .map(|&id| {
            let info = map.node(id);
            let led = map.regions.iter().filter(|r| r.primary == id).count();
            let backed = map.regions.iter().filter(|r| r.backups.contains(&id)).count();
            let (device_stats, error) = match sample.devices.get(&id) {
                Some(Ok(d)) => (device_json(d), Value::Null),
                Some(Err(e)) => (Value::Null, json!(e)),
                None => (Value::Null, json!(if info.is_some() { "not sampled yet" } else { "not registered (lost)" })),
            };
            json!({
                "id": id,
                "zone": info.map_or("", |n| n.zone.as_str()),
                "device": info.map_or("", |n| n.device.as_str()),
                "fabric": info.map_or("", |n| n.fabric.as_str()),
                "control": info.map_or("", |n| n.admin.as_str()),
                "is_master": map.master == id,
                "live": info.is_some(),
                "draining": draining(id),
                "stepping_down": stepping(id),
                "regions_led": led,
                "regions_backed": backed,
                "device_stats": device_stats,
                "host_stats": match sample.hosts.get(&id) {
                    Some(Ok(h)) => json!({
                        "uptime_s": h["uptime_ms"].as_u64().map(|v| v / 1000),
                        "cpu_seconds": h["cpu_ms"].as_u64().map(|v| v as f64 / 1000.0),
                        "rss_bytes": h["rss_bytes"],
                        "lease_age_ms": h["lease_age_ms"],
                        "lease_ttl_ms": h["lease_ttl_ms"],
                    }),
                    _ => Value::Null,
                },
                "error": error,
            })
        })
        .collect();
    let (control, health, master, age) = match summary {
        Some(Ok(v)) => (
            json!({"ok": true, "error": null}),
            json!({
                "nodes": v["nodes"], "regions": v["regions"], "without_primary": v["without_primary"],
                "under_replicated": v["under_replicated"], "zones": v["zones"],
            }),
            v["master"].clone(),
            v["master_round_age_ms"].clone(),
        ),
        Some(Err(e)) => (json!({"ok": false, "error": e}), Value::Null, json!(map.master), Value::Null),
        None => (json!({"ok": false, "error": "not sampled yet"}), Value::Null, json!(map.master), Value::Null),
    };
    Ok(axum::Json(json!({
        "gateway": {"version": env!("CARGO_PKG_VERSION"), "uptime_s": c.started.elapsed().as_secs()},
        "you": {"name": p.map(|p| p.name.clone()), "admin": is_admin(p)},
        "control": control,
        "master": master,
        "master_round_age_ms": age,
        "health": health,
        "sampled_ms": sample.at_ms,
        // The DpuKvCluster's status as the operator last mirrored it (null off Kubernetes).
        "kubernetes": summary.and_then(|r| r.as_ref().ok()).map_or(Value::Null, |v| v["kubernetes"].clone()),
        "nodes": nodes,
    })))
}

fn device_json(d: &DeviceStats) -> Value {
    let c = |n: &str| d.counter(n);
    json!({
        "uptime_s": c("uptime_ms").map(|v| v / 1000),
        "cpu_seconds": c("cpu_ms").map(|v| v as f64 / 1000.0),
        "rss_bytes": c("rss_bytes"),
        "mode": if c("reads_on_host") == Some(1) { "host-reads" } else { "device" },
        "reads_served": c("reads_served"),
        "replica_reads": c("replica_reads"),
        "reads_forwarded": c("forwarded"),
        "node_visits": c("node_visits"),
    })
}

/// `GET /v1/console/regions`.
#[utoipa::path(get, path = "/v1/console/regions", tag = "console",
    responses((status = 200, description = "The regions (bounds as the token may read them, placement, sizes, rates) and the heatmap"), (status = 401, body = crate::http::api::ErrorBody)))]
pub(crate) async fn regions(State(s): State<HttpState>, caller: Caller) -> Result<axum::Json<Value>, ApiError> {
    let c = console_of(&s)?;
    let sample = c.current().await;
    let map = map_of(&s, &sample).await?;
    let p = caller.principal();
    let rates = lock(&c.rates).clone();
    let regions: Vec<Value> = map
        .regions
        .iter()
        .map(|r| {
            let visible = may_read(p, &r.start) && r.end.as_deref().is_none_or(|e| may_read(p, e));
            let (start, end, enc) = if visible {
                let (st, se) = shown_key(&r.start);
                let end = r.end.as_deref().map(shown_key);
                // One encoding for both bounds.
                let base64 = se == Encoding::Base64 || end.as_ref().is_some_and(|(_, e)| *e == Encoding::Base64);
                if base64 {
                    let b = |k: &[u8]| Encoding::Base64.encode(k).unwrap_or_default();
                    (json!(b(&r.start)), r.end.as_deref().map_or(Value::Null, |e| json!(b(e))), "base64")
                } else {
                    (json!(st), end.map_or(Value::Null, |(t, _)| json!(t)), "utf8")
                }
            } else {
                (json!(""), Value::Null, "utf8")
            };
            let load = sample.loads.get(&r.id);
            // How far each backup is behind, as the primary's host says (null: it did not answer).
            let lag = match sample.hosts.get(&r.primary) {
                Some(Ok(h)) => {
                    let lags = h["lags"].as_array().cloned().unwrap_or_default();
                    let of = |b: u32| lags.iter().find(|l| l["region"] == r.id && l["backup"] == b).cloned();
                    json!(
                        r.backups
                            .iter()
                            .map(|&b| of(b).map_or_else(
                                || json!({"backup": b, "bytes": null, "records": null}),
                                |l| json!({"backup": b, "bytes": l["bytes"], "records": l["records"]})
                            ))
                            .collect::<Vec<_>>()
                    )
                }
                _ => Value::Null,
            };
            json!({
                "id": r.id, "start": start, "end": end, "encoding": enc, "redacted": !visible,
                "primary": r.primary, "backups": r.backups, "joining": r.joining, "epoch": r.epoch,
                "state": state_name(r.state),
                "bytes": load.map(|l| l.0), "writes_per_sec": load.map(|l| l.1), "lag": lag,
                "reads_per_sec": rates.get(&r.id),
            })
        })
        .collect();
    let heat = lock(&c.heat);
    let ids: Vec<u32> = map.regions.iter().map(|r| r.id).collect();
    // The first sample has no interval before it.
    let skip = usize::from(heat.times.len() > 1);
    let times: Vec<u64> = heat.times.iter().skip(skip).copied().collect();
    let cell = |i: &HashMap<u32, (u64, u64)>, f: fn(&(u64, u64)) -> u64| {
        ids.iter().map(|id| i.get(id).map_or(0, f)).collect::<Vec<u64>>()
    };
    let reads: Vec<Vec<u64>> = heat.cells.iter().skip(skip).map(|i| cell(i, |c| c.0)).collect();
    let writes: Vec<Vec<u64>> = heat.cells.iter().skip(skip).map(|i| cell(i, |c| c.1)).collect();
    Ok(axum::Json(json!({
        "regions": regions,
        "heatmap": {
            "interval_ms": SAMPLE_EVERY.as_millis() as u64, "times": times, "regions": ids,
            "reads": reads, "writes": writes,
        },
    })))
}

/// H(n), the n-th harmonic number.
fn harmonic(n: u64) -> f64 {
    if n < 1_000 {
        (1..=n).map(|k| 1.0 / k as f64).sum()
    } else {
        // ln n + γ + 1/(2n): exact enough past a thousand.
        (n as f64).ln() + 0.577_215_664_901_532_9 + 1.0 / (2.0 * n as f64)
    }
}

/// H(n)/H(N) for a set of `n` keys among `big_n` (None without keys read).
fn ceiling(n: u64, big_n: u64) -> Option<f64> {
    (big_n > 0).then(|| harmonic(n.min(big_n)) / harmonic(big_n))
}

/// `GET /v1/console/reads`.
#[utoipa::path(get, path = "/v1/console/reads", tag = "console",
    responses((status = 200, description = "Where gets are served, per device, by consistency mode, and the popular keys"), (status = 401, body = crate::http::api::ErrorBody)))]
pub(crate) async fn reads(State(s): State<HttpState>, caller: Caller) -> Result<axum::Json<Value>, ApiError> {
    let c = console_of(&s)?;
    let sample = c.current().await;
    let p = caller.principal();
    let counts = s.up.client().read_counts();
    let (gw_primary, gw_replica) = counts.get();
    let modes: serde_json::Map<String, Value> =
        dpukv_client::ReadCounts::MODES.iter().zip(counts.modes()).map(|(m, n)| (m.to_string(), json!(n))).collect();
    let (mut served, mut replica, mut forwarded, mut visits) = (0u64, 0u64, 0u64, 0u64);
    let mut devices = Vec::new();
    let mut popular = Vec::new();
    for (node, d) in &sample.devices {
        let Ok(d) = d else { continue };
        let v = |n: &str| d.counter(n).unwrap_or(0);
        let on_host = v("reads_on_host") == 1;
        // Gets of the regions it leads (reads served counts scans and region maps too).
        let gets = d.regions.iter().map(|r| r.gets).sum::<u64>() + v("gets_unattributed");
        served += if on_host { 0 } else { gets };
        forwarded += if on_host { gets } else { 0 };
        replica += v("replica_reads");
        visits += v("node_visits");
        devices.push(json!({
            "node": node, "mode": if on_host { "host-reads" } else { "device" }, "gets": gets,
            "reads_served": v("reads_served"), "replica_reads": v("replica_reads"),
            "reads_forwarded": v("forwarded"), "node_visits": v("node_visits"),
        }));
        for r in &d.regions {
            if r.capacity == 0 {
                continue;
            }
            let (shown, hidden): (Vec<_>, Vec<_>) = r.top.iter().partition(|(k, _)| may_read(p, k));
            let keys: Vec<Value> = shown
                .into_iter()
                .map(|(k, n)| {
                    let (t, e) = shown_key(k);
                    json!({"key": t, "encoding": e, "count": n})
                })
                .collect();
            popular.push(json!({
                "region": r.region, "node": node, "capacity": r.capacity, "size": r.popular,
                "keys": keys, "hidden": hidden.len(),
                // hKVS §4.5: the most a set of `capacity` keys can take of a zipf(1) workload
                // over N keys is H(capacity)/H(N); N here is the keys read in the popularity
                // window (those that compete for the set).
                "ceiling": ceiling(r.capacity as u64, r.distinct as u64),
            }));
        }
    }
    let total = served + replica + forwarded;
    let share = |n: u64| if total == 0 { Value::Null } else { json!(n as f64 / total as f64) };
    let primary_reads = served.max(1);
    Ok(axum::Json(json!({
        "gateway": {"primary": gw_primary, "replica": gw_replica},
        "consistency": modes,
        "devices": devices,
        "share": {"primary_device": share(served), "replica_device": share(replica), "host": share(forwarded)},
        "visits_per_read": if served == 0 { Value::Null } else { json!(visits as f64 / primary_reads as f64) },
        "popular": popular,
    })))
}

/// The query of `GET /v1/console/events`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsQuery {
    /// Only events after this sequence number.
    after: Option<u64>,
}

/// `GET /v1/console/events`.
#[utoipa::path(get, path = "/v1/console/events", tag = "console",
    responses((status = 200, description = "The events of the cluster, oldest first (after: only those past a sequence number)"), (status = 401, body = crate::http::api::ErrorBody)))]
pub(crate) async fn events(
    State(s): State<HttpState>,
    caller: Caller,
    q: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let Query(q) = q?;
    let c = console_of(&s)?;
    let sample = c.current().await;
    let p = caller.principal();
    let events: Vec<Value> = sample
        .events
        .iter()
        .filter(|e| q.after.is_none_or(|a| e["seq"].as_u64().is_some_and(|s| s > a)))
        .map(|e| shown_event(e, p))
        .collect();
    Ok(axum::Json(json!({ "events": events })))
}

/// An event as `p` may see it: a split's key only if it may read it (`key`, `encoding`; else
/// `key_hidden`), a backup's location only for an administrator.
fn shown_event(e: &Value, p: Option<&Principal>) -> Value {
    let mut e = e.clone();
    let Some(obj) = e.as_object_mut() else { return e };
    if let Some(hex) = obj.remove("key_hex") {
        match hex.as_str().and_then(dpukv_proto::control::unhex) {
            Some(k) if may_read(p, &k) => {
                let (t, enc) = shown_key(&k);
                obj.insert("key".into(), json!(t));
                obj.insert("encoding".into(), json!(enc));
            }
            _ => {
                obj.insert("key_hidden".into(), json!(true));
            }
        }
    }
    if !is_admin(p) {
        obj.remove("location");
    }
    e
}

/// Whether a request may run an action: the caller's grant (admin on every key), and — because a
/// browser sends requests a page of another site asks for — the request's own origin: a fetch
/// another site started (`Sec-Fetch-Site`, `Origin` not this host) is refused. With tokens that
/// is all (a bearer token is never sent by a browser on its own); on an open gateway (no tokens)
/// actions are taken only from this machine (a loopback peer, and a `Host` that is a loopback
/// address or `localhost`: a page whose DNS name was rebound to this address names itself).
fn may_act<'a>(
    s: &'a HttpState,
    caller: &Caller,
    headers: &HeaderMap,
    peer: Option<IpAddr>,
) -> Result<&'a Arc<Console>, ApiError> {
    let c = console_of(s)?;
    let refuse = |m: &str| ApiError::new(StatusCode::FORBIDDEN, "forbidden", m);
    if !is_admin(caller.principal()) {
        return Err(refuse("this token may not run cluster actions (they need admin on every key)"));
    }
    let header = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    if header("sec-fetch-site").is_some_and(|v| v != "same-origin" && v != "none") {
        return Err(refuse("a cluster action must come from the console's own pages"));
    }
    let host = header("host").unwrap_or("");
    if let Some(origin) = header("origin") {
        let own = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://")) == Some(host);
        if !own {
            return Err(refuse("a cluster action must come from the console's own pages"));
        }
    }
    if caller.principal().is_none() {
        let name =
            host.rsplit_once(':').map_or(host, |(h, p)| if p.bytes().all(|b| b.is_ascii_digit()) { h } else { host });
        let name = name.trim_start_matches('[').trim_end_matches(']');
        let local_name =
            name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|a| a.is_loopback());
        if !peer.is_some_and(|p| p.is_loopback()) || !local_name {
            return Err(refuse(
                "the gateway has no tokens: cluster actions are taken only from this machine (give the gateway tokens)",
            ));
        }
    }
    Ok(c)
}

/// Runs `route` on a control API: its JSON answer, or its refusal as an answer with its status.
async fn act(s: &HttpState, c: &Console, route: ControlRoute, avoid: Option<u32>) -> Result<Value, Response> {
    let map = s.up.client().current_map().await.map_err(|e| ApiError::from(e).into_response())?;
    let addr =
        c.cfg.control.endpoint(&map, avoid).map_err(|e| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e.to_string()).into_response()
        })?;
    if route.mutates() {
        tracing::info!(route = route.path(), method = route.method(), "a console action");
    }
    match c.cfg.control.call(&addr, &route).await {
        Ok((200, body)) => Ok(serde_json::from_str::<Value>(&body).unwrap_or_else(|_| json!({"answer": body.trim()}))),
        Ok((status, body)) => {
            let code = match status {
                401 | 403 => "not_configured",
                404 => "not_found",
                400 => "bad_request",
                _ => "unavailable",
            };
            let message = match status {
                401 | 403 => format!(
                    "the control API refused the gateway ({status}: {}): give the gateway the control token (--control-token-file)",
                    body.trim()
                ),
                _ => body.trim().to_string(),
            };
            let status = match status {
                401 | 403 => StatusCode::SERVICE_UNAVAILABLE,
                s => StatusCode::from_u16(s).unwrap_or(StatusCode::BAD_GATEWAY),
            };
            Err(ApiError::new(status, code, message).into_response())
        }
        Err(e) => Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e.to_string()).into_response()),
    }
}

fn action_of(method: &axum::http::Method) -> Action {
    match *method {
        axum::http::Method::POST => Action::Request,
        axum::http::Method::DELETE => Action::Cancel,
        _ => Action::Progress,
    }
}

/// `POST|GET|DELETE /v1/console/actions/drain/{node}`.
#[utoipa::path(post, path = "/v1/console/actions/drain/{node}", tag = "console", params(("node" = u32, Path, description = "The node")),
    responses((status = 200, description = "Drain a node (POST), its progress (GET), stop (DELETE): admin on every key"), (status = 403, body = crate::http::api::ErrorBody), (status = 503, body = crate::http::api::ErrorBody, description = "not_configured: the gateway has no control token")))]
pub(crate) async fn drain(
    State(s): State<HttpState>,
    caller: Caller,
    method: axum::http::Method,
    headers: HeaderMap,
    peer: Option<axum::Extension<Peer>>,
    Path(node): Path<u32>,
) -> Response {
    let c = match may_act(&s, &caller, &headers, peer.map(|p| p.0.0)) {
        Ok(c) => c.clone(),
        Err(e) => return e.into_response(),
    };
    match act(&s, &c, ControlRoute::Drain { node, action: action_of(&method) }, Some(node)).await {
        Ok(mut v) => {
            // The regions it still has a part in, led or held.
            let left = v["regions_led"].as_u64().unwrap_or(0) + v["regions_held"].as_u64().unwrap_or(0);
            v["regions"] = json!(left);
            axum::Json(v).into_response()
        }
        Err(r) => r,
    }
}

/// `POST|GET|DELETE /v1/console/actions/step-down/{node}`.
#[utoipa::path(post, path = "/v1/console/actions/step-down/{node}", tag = "console", params(("node" = u32, Path, description = "The node")),
    responses((status = 200, description = "Step a node down (POST), its progress (GET), stop (DELETE): admin on every key"), (status = 403, body = crate::http::api::ErrorBody), (status = 503, body = crate::http::api::ErrorBody, description = "not_configured: the gateway has no control token")))]
pub(crate) async fn step_down(
    State(s): State<HttpState>,
    caller: Caller,
    method: axum::http::Method,
    headers: HeaderMap,
    peer: Option<axum::Extension<Peer>>,
    Path(node): Path<u32>,
) -> Response {
    let c = match may_act(&s, &caller, &headers, peer.map(|p| p.0.0)) {
        Ok(c) => c.clone(),
        Err(e) => return e.into_response(),
    };
    act(&s, &c, ControlRoute::StepDown { node, action: action_of(&method) }, Some(node))
        .await
        .map_or_else(|r| r, |v| axum::Json(v).into_response())
}

/// The body of a split.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SplitBody {
    /// Where the new region starts.
    key: String,
    /// How `key` is written (default `utf8`).
    encoding: Option<Encoding>,
}

/// `POST /v1/console/actions/split/{region}`.
#[utoipa::path(post, path = "/v1/console/actions/split/{region}", tag = "console", params(("region" = u32, Path, description = "The region")),
    request_body(content = Object, description = "{key, encoding}: where the new region starts"),
    responses((status = 200, description = "The split is asked of the master"), (status = 400, body = crate::http::api::ErrorBody), (status = 403, body = crate::http::api::ErrorBody)))]
pub(crate) async fn split(
    State(s): State<HttpState>,
    caller: Caller,
    headers: HeaderMap,
    peer: Option<axum::Extension<Peer>>,
    Path(region): Path<u32>,
    JsonBody(body): JsonBody<SplitBody>,
) -> Response {
    let c = match may_act(&s, &caller, &headers, peer.map(|p| p.0.0)) {
        Ok(c) => c.clone(),
        Err(e) => return e.into_response(),
    };
    let key = match body.encoding.unwrap_or_default().decode(&body.key) {
        Ok(k) if !k.is_empty() && k.len() <= dpukv_proto::limits::MAX_KEY => k,
        Ok(_) => {
            return ApiError::new(StatusCode::BAD_REQUEST, "bad_request", "the key must be 1 to 1024 bytes")
                .into_response();
        }
        Err(e) => return ApiError::new(StatusCode::BAD_REQUEST, "bad_encoding", format!("key: {e}")).into_response(),
    };
    if let Err(r) = act(&s, &c, ControlRoute::Split { region, key: key.clone() }, None).await {
        return r;
    }
    let (t, e) = shown_key(&key);
    axum::Json(json!({"region": region, "key": t, "encoding": e, "accepted": true})).into_response()
}

/// Serves an embedded asset with its type, a strict content security policy and no caching
/// beyond revalidation.
fn asset(body: &'static str, kind: &'static str) -> Response {
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    r
}

/// The console's routes (merged into the HTTP front end's router, under its middleware: the
/// `/v1/console/` APIs need a token like every `/v1/` route; the pages hold no data).
pub fn routes() -> Router<HttpState> {
    Router::new()
        .route("/ui", get(|| async { axum::response::Redirect::permanent("/ui/") }))
        .route("/ui/", get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/ui/index.html", get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/ui/console.js", get(|| async { asset(CONSOLE_JS, "text/javascript; charset=utf-8") }))
        .route("/ui/console.css", get(|| async { asset(CONSOLE_CSS, "text/css; charset=utf-8") }))
        .route("/v1/console/overview", get(overview))
        .route("/v1/console/regions", get(regions))
        .route("/v1/console/reads", get(reads))
        .route("/v1/console/events", get(events))
        .route("/v1/console/actions/drain/{node}", post(drain).get(drain).delete(drain))
        .route("/v1/console/actions/step-down/{node}", post(step_down).get(step_down).delete(step_down))
        .route("/v1/console/actions/split/{region}", post(split))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harmonic_numbers_are_close_enough_either_way() {
        assert!((harmonic(1) - 1.0).abs() < 1e-12);
        assert!((harmonic(4) - 25.0 / 12.0).abs() < 1e-12);
        let exact: f64 = (1..=5000).map(|k| 1.0 / k as f64).sum();
        assert!((harmonic(5000) - exact).abs() < 1e-6);
        assert_eq!(ceiling(10, 0), None);
        assert_eq!(ceiling(10, 5), Some(1.0), "a set as large as the keys takes every read");
        assert!(ceiling(1_000, 1_000_000).is_some_and(|c| (0.5..0.56).contains(&c)));
    }

    #[test]
    fn keys_are_shown_as_text_or_base64() {
        assert_eq!(shown_key(b"user:1"), ("user:1".to_string(), Encoding::Utf8));
        assert_eq!(shown_key(&[0xff, 0x00]).1, Encoding::Base64);
        assert_eq!(shown_key(b"a\nb").1, Encoding::Base64);
    }
}
