//! A cluster host's control API (`--control-listen`, docs/operations.md "Control API"): the
//! routes of `dpukv_proto::control` — `/cluster/drain/{node}` (POST: drain the node; GET: its
//! progress; DELETE: stop draining it), `/cluster/step-down/{node}` (POST: move the node's
//! primaries to backups elsewhere, keeping its copies — before a restart; GET: progress;
//! DELETE: stop), `/cluster/split/{region}/{hex key}` and `/cluster/merge/{region}` (POST: ask
//! the master to split a region at a key, or to merge it into its left neighbour; checked
//! against the current map first) and `/cluster/summary` (GET: the master, live nodes, regions,
//! regions without a live primary or short of copies), `/cluster/events` (GET: the cluster's
//! event log), `/cluster/loads` (GET: the regions' reported sizes and write rates) and
//! `/cluster/host` (GET: this host's CPU, memory, uptime and lease age), and `/cluster/backups/{hex location}`
//! (POST: a backup of the cluster to that location, coordinated by this node; docs/backup.md)
//! and `/cluster/backups/{job}` (GET: its progress), `/cluster/restore/{hex location}[/{id}]`
//! (POST: restore a backup into the empty cluster) and `/cluster/restore` (GET: the restore's
//! progress; DELETE: abandon it) — what `dpukv cluster`, `dpukv backup`, `dpukv restore` and the
//! operator call.
//!
//! Who may call (docs/security.md §3), checked before the route is looked at:
//! - with TLS, a client certificate of role `operator` or `admin` of this cluster (the listener
//!   asks for one, and serves clients without one only for a token);
//! - or `Authorization: Bearer <token>` equal to the contents of `--admin-token-file`
//!   (compared by SHA-256 digest, in constant time; the file is re-read when it changes);
//! - without TLS and without a token file, anyone (plain mode: bind it to loopback).
//!
//! Refusals: 401 `unauthorized` (no credential), 403 `forbidden` (a credential that does not
//! grant it). Bounded: [`LIMITS`] (module `http`), and every etcd request has its deadline.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use dpukv_cluster::keys::Keys;
use dpukv_cluster::master::Snapshot;
use dpukv_net::identity::{Peer, Refusal, Role};
use dpukv_net::tls::ServerTls;
use dpukv_proto::control::{Action, ControlRoute};

use crate::backup::JobProgress;
use tokio_util::sync::CancellationToken;

/// The control API's bounds: a few callers at once, one request per connection, its header
/// within 5 s, its answer within 30 s.
pub const LIMITS: crate::http::Limits = crate::http::Limits {
    max_connections: 32,
    header_timeout: Duration::from_secs(5),
    max_life: Duration::from_secs(30),
    keep_alive: false,
};

/// The roles whose certificates may call the control API.
const CONTROL_ROLES: &[Role] = &[Role::Operator, Role::Admin];
/// ... and read what the gateway's console shows ([`console_reads`]): the gateway too.
const READ_ROLES: &[Role] = &[Role::Operator, Role::Admin, Role::Gateway];

/// What the gateway's certificate may read: the summary, events, loads, the host, and drain and
/// step-down progress — nothing of backups or restores, and nothing that changes the cluster.
fn console_reads(route: &ControlRoute) -> bool {
    match route {
        ControlRoute::Summary | ControlRoute::Events | ControlRoute::Loads | ControlRoute::Host => true,
        ControlRoute::Drain { action, .. } | ControlRoute::StepDown { action, .. } => *action == Action::Progress,
        _ => false,
    }
}

/// The longest token file read.
const MAX_TOKEN_FILE: u64 = 4096;
/// The shortest token accepted (a guessable token is no credential).
pub const MIN_TOKEN: usize = 16;

/// Where the control API listens and whom it serves.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// Its address.
    pub listen: SocketAddr,
    /// TLS (client certificates asked for, not required), if configured.
    pub tls: Option<Arc<ServerTls>>,
    /// The bearer token it also accepts, if any.
    pub token: Option<Arc<AdminToken>>,
}

/// Where cluster requests go: the cluster's etcd and key layout.
#[derive(Debug, Clone)]
pub struct ClusterControl {
    /// How to reach etcd.
    pub etcd: dpukv_cluster::EtcdOptions,
    /// The cluster's keys.
    pub keys: dpukv_cluster::keys::Keys,
    /// The host serving this API (`/cluster/host`; None: not known).
    pub host: Option<HostFacts>,
}

/// What `/cluster/host` tells of the host serving the control API.
#[derive(Clone, Debug)]
pub struct HostFacts {
    /// Its node id.
    pub node: u32,
    /// When the process started serving.
    pub started: std::time::Instant,
    /// Its lease's TTL (it renews every third of it).
    pub lease_ttl: std::time::Duration,
    /// Its cluster agent's figures: its lease's authority (when it was last renewed) and how far
    /// each backup of the regions it leads is behind.
    pub cluster: Arc<crate::host::cluster_metrics::ClusterMetrics>,
}

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// It cannot be read.
    #[error("reading the admin token file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Its token is too short or too long.
    #[error("the admin token file {0} must hold one token of {MIN_TOKEN} to {MAX_TOKEN_FILE} bytes")]
    Size(PathBuf),
}

/// The admin token (`--admin-token-file`): kept as its SHA-256 digest, re-read when the file's
/// modification time changes (a new token that does not load is logged, the old one kept).
#[derive(Debug)]
pub struct AdminToken {
    path: PathBuf,
    current: Mutex<(Option<SystemTime>, [u8; 32])>,
}

fn digest(b: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, b);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Equal, in time independent of where they differ.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn read_token(path: &Path) -> Result<[u8; 32], TokenError> {
    use std::io::Read;
    let err = |source| TokenError::Read { path: path.to_path_buf(), source };
    let mut text = Vec::new();
    std::fs::File::open(path).map_err(err)?.take(MAX_TOKEN_FILE + 1).read_to_end(&mut text).map_err(err)?;
    let token = text.trim_ascii();
    if token.len() < MIN_TOKEN || text.len() as u64 > MAX_TOKEN_FILE {
        return Err(TokenError::Size(path.to_path_buf()));
    }
    Ok(digest(token))
}

impl AdminToken {
    /// Reads the token in `path` (surrounding white space is not part of it).
    pub fn load(path: &Path) -> Result<AdminToken, TokenError> {
        let stamp = modified(path);
        let d = read_token(path)?;
        Ok(AdminToken { path: path.to_path_buf(), current: Mutex::new((stamp, d)) })
    }

    /// Whether `presented` is the token in force.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let stamp = modified(&self.path);
        if stamp != cur.0 {
            match read_token(&self.path) {
                Ok(d) => *cur = (stamp, d),
                Err(e) => {
                    tracing::error!(error = %e, "the admin token file changed but does not load; keeping the token in force")
                }
            }
        }
        same(&cur.1, &digest(presented))
    }
}

#[derive(Clone)]
struct Control {
    cluster: ClusterControl,
    token: Option<Arc<AdminToken>>,
    tls: bool,
    backups: Arc<Mutex<BackupJobs>>,
}

/// The backup jobs this node coordinates (`/cluster/backups`): at most one running at a time,
/// and the last [`KEPT_JOBS`] kept for their progress.
#[derive(Debug, Default)]
struct BackupJobs {
    next: u64,
    jobs: std::collections::BTreeMap<u64, Arc<Mutex<JobProgress>>>,
}

/// Finished backup jobs whose progress a node keeps.
const KEPT_JOBS: usize = 16;

fn progress_json(p: &Mutex<JobProgress>) -> String {
    let p = p.lock().unwrap_or_else(|e| e.into_inner()).clone();
    serde_json::to_string(&p).unwrap_or_default() + "\n"
}

/// Starts a backup of the cluster to `to`, coordinated by this node (docs/backup.md): 200 with
/// the job's progress (`job` names it for `GET /cluster/backups/{job}`); 400 for a location that cannot be used; 409 while another runs here.
async fn start_backup(c: &Control, to: String) -> Answer {
    if let Err(e) = dpukv_backup::Location::open(&to) {
        return text(StatusCode::BAD_REQUEST, format!("{}: {e}\n", e.code()));
    }
    let progress = {
        let mut jobs = c.backups.lock().unwrap_or_else(|e| e.into_inner());
        let running = jobs.jobs.values().any(|p| p.lock().unwrap_or_else(|e| e.into_inner()).state == "running");
        if running {
            return text(StatusCode::CONFLICT, "backup_running: a backup this node coordinates is running\n".into());
        }
        jobs.next += 1;
        let job = jobs.next;
        let progress = Arc::new(Mutex::new(JobProgress::running(job, &to)));
        jobs.jobs.insert(job, progress.clone());
        while jobs.jobs.len() > KEPT_JOBS {
            let oldest = *jobs.jobs.keys().next().expect("more than KEPT_JOBS");
            jobs.jobs.remove(&oldest);
        }
        progress
    };
    let (cluster, p) = (c.cluster.clone(), progress.clone());
    tokio::spawn(async move {
        let name = std::str::from_utf8(cluster.keys.root())
            .ok()
            .and_then(|r| r.strip_prefix("/dpukv/"))
            .map(|r| r.trim_end_matches('/').to_string())
            .unwrap_or_default();
        let out = match dpukv_cluster::EtcdStore::connect(&cluster.etcd).await {
            Ok(store) => crate::backup::coordinate(&store, &cluster.keys, &name, &to, &p).await,
            Err(e) => Err(format!("{}: {e}", e.code())),
        };
        let mut g = p.lock().unwrap_or_else(|e| e.into_inner());
        match out {
            Ok(m) => {
                tracing::info!(backup = %m.id, to = %to, bytes = m.bytes(), uploaded = m.uploaded_bytes, "backup done");
                g.state = "done";
            }
            Err(e) => {
                tracing::warn!(to = %to, error = %e, "backup failed");
                g.state = "failed";
                g.error = Some(e);
            }
        }
    });
    json(progress_json(&progress))
}

/// A backup job's progress: 404 for a job this node does not know (or no longer keeps).
fn backup_status(c: &Control, job: u64) -> Answer {
    let jobs = c.backups.lock().unwrap_or_else(|e| e.into_inner());
    match jobs.jobs.get(&job) {
        Some(p) => json(progress_json(p)),
        None => text(StatusCode::NOT_FOUND, format!("backup_job_not_found: no backup job {job} on this node\n")),
    }
}

/// Begins a restore of `backup` (the latest if None) from `from` (docs/backup.md §5), or
/// follows the same one already under way: 200 with its progress once the cut replaced the map;
/// 400 for a location that cannot be used, 404 for a backup not there, 409 for a cluster that
/// holds keys or another restore under way, 503 when the cut cannot be taken now.
async fn start_restore(c: &ClusterControl, from: &str, backup: Option<&str>) -> Answer {
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    match crate::backup::begin_restore(&store, &c.keys, from, backup).await {
        Ok(job) => {
            tracing::info!(from = %job.from, backup = %job.backup, "restore under way");
            match dpukv_cluster::master::read(&store, &c.keys).await {
                Ok(snap) => json(progress_of(&snap)),
                Err(e) => unavailable(e),
            }
        }
        Err(e) => {
            let code = e.split(':').next().unwrap_or_default();
            let status = match code {
                "backup_bad_location" | "backup_manifest_invalid" | "restore_refused" => StatusCode::BAD_REQUEST,
                "backup_not_found" => StatusCode::NOT_FOUND,
                "restore_cluster_not_empty" | "restore_running" => StatusCode::CONFLICT,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            tracing::warn!(from, error = %e, "a restore was refused");
            text(status, format!("{e}\n"))
        }
    }
}

/// The cluster's backup schedule (docs/backup.md §4): set (`spec`, checked: 400
/// `backup_schedule_invalid` or `backup_bad_location`), stopped (Cancel), or only shown; the
/// answer is the schedule then and the last finished backup, as JSON.
async fn backup_schedule(c: &ClusterControl, spec: Option<Vec<u8>>, action: Action) -> Answer {
    use dpukv_cluster::MetaStore;
    use dpukv_cluster::schedule::BackupSchedule;
    let parsed = match spec.as_deref().map(BackupSchedule::decode) {
        Some(Err(e)) => return text(StatusCode::BAD_REQUEST, format!("backup_schedule_invalid: {e}\n")),
        Some(Ok(s)) => Some(s),
        None => None,
    };
    if let Some(Err(e)) = parsed.as_ref().map(|s| dpukv_backup::Location::open(&s.to)) {
        return text(StatusCode::BAD_REQUEST, format!("{}: {e}\n", e.code()));
    }
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let changed = match (parsed, action) {
        (Some(s), _) => store.put(&c.keys.backup_schedule(), &s.encode(), None).await.map(|_| ()),
        (None, Action::Cancel) => store.delete(&c.keys.backup_schedule()).await.map(|_| ()),
        (None, _) => Ok(()),
    };
    if let Err(e) = changed {
        return unavailable(e);
    }
    let snap = match dpukv_cluster::master::read(&store, &c.keys).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let schedule = snap.backup_schedule.map(|s| {
        serde_json::json!({
            "to": s.to,
            "every_secs": s.every.as_secs_f64(),
            "cron": s.cron.map(|c| c.text),
            "keep_last": s.keep_last,
            "keep_within_secs": s.keep_within.map(|d| d.as_secs_f64()),
        })
    });
    let last = snap.last_backup.map(|b| {
        serde_json::json!({
            "id": b.id, "to": b.to, "at_ms": b.at_ms, "bytes": b.bytes, "uploaded_bytes": b.uploaded, "took_ms": b.took_ms,
        })
    });
    json(serde_json::json!({ "schedule": schedule, "last_backup": last }).to_string() + "\n")
}

fn progress_of(snap: &Snapshot) -> String {
    serde_json::to_string(&crate::backup::restore_progress(snap)).unwrap_or_default() + "\n"
}

/// The restore under way: its progress (GET), or abandoned (DELETE: its regions go and the
/// master lays out empty ones; 200 with `state: none` either way).
async fn restore_status(c: &ClusterControl, action: Action) -> Answer {
    use dpukv_cluster::MetaStore;
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    for _ in 0..10 {
        let snap = match dpukv_cluster::master::read(&store, &c.keys).await {
            Ok(s) => s,
            Err(e) => return unavailable(e),
        };
        let abort = match action {
            Action::Cancel => dpukv_cluster::restore::abort_txn(&c.keys, &snap),
            _ => None,
        };
        let Some(txn) = abort else { return json(progress_of(&snap)) };
        match store.txn(txn).await {
            Ok(t) if t.succeeded => tracing::warn!("abandoned the restore under way"),
            Ok(_) => {} // it ended or changed meanwhile: look again
            Err(e) => return unavailable(e),
        }
    }
    text(StatusCode::SERVICE_UNAVAILABLE, "restore_busy: the restore kept changing; try again\n".into())
}

/// Whether the caller may use the control API: see the module documentation.
fn authorize(c: &Control, peer: &Peer, headers: &HeaderMap, route: Option<&ControlRoute>) -> Result<(), Refusal> {
    const WHAT: &str = "the control API";
    if let Some(auth) = headers.get(axum::http::header::AUTHORIZATION) {
        let presented = auth.as_bytes().strip_prefix(b"Bearer ").map(<[u8]>::trim_ascii);
        return match (&c.token, presented) {
            (Some(t), Some(p)) if t.matches(p) => Ok(()),
            (Some(_), Some(_)) => Err(Refusal::Forbidden("the bearer token is not the admin token".into())),
            (None, Some(_)) => Err(Refusal::Forbidden("this node takes no admin token (--admin-token-file)".into())),
            (_, None) => Err(Refusal::Unauthorized("the Authorization header is not `Bearer <token>`".into())),
        };
    }
    match peer {
        // Plain HTTP: only a token could be checked.
        Peer::Unchecked if c.token.is_some() => {
            Err(Refusal::Unauthorized(format!("{WHAT} needs the admin token (Authorization: Bearer)")))
        }
        Peer::Anonymous if c.token.is_some() => Err(Refusal::Unauthorized(format!(
            "{WHAT} needs a client certificate of role operator or admin, or the admin token"
        ))),
        _ if route.is_some_and(console_reads) => peer.allow(READ_ROLES, WHAT),
        _ => peer.allow(CONTROL_ROLES, WHAT),
    }
}

type Answer = (StatusCode, [(&'static str, &'static str); 1], String);

fn text(code: StatusCode, body: String) -> Answer {
    (code, [("content-type", "text/plain; charset=utf-8")], body)
}

fn json(body: String) -> Answer {
    (StatusCode::OK, [("content-type", "application/json")], body)
}

/// A node's drain: requested, and what it still holds.
fn drain_status(snap: &Snapshot, node: u32) -> String {
    let led = snap.map.regions.iter().filter(|r| r.primary == node).count();
    let held = snap.map.regions.iter().filter(|r| r.backups.contains(&node) || r.joining.contains(&node)).count();
    let draining = snap.facts.draining.contains(&node);
    let done = draining && led == 0 && held == 0;
    format!(
        "{{\"node\": {node}, \"draining\": {draining}, \"regions_led\": {led}, \"regions_held\": {held}, \"done\": {done}}}\n"
    )
}

/// A node's step-down: requested, the regions it still leads, those of them a backup elsewhere
/// could take, and whether it is done (nothing movable left, every handover released).
fn step_down_status(snap: &Snapshot, node: u32) -> String {
    let p = snap.step_down_progress(node);
    format!(
        "{{\"node\": {node}, \"stepping_down\": {}, \"regions_led\": {}, \"movable\": {}, \"done\": {}}}\n",
        p.requested, p.led, p.movable, p.done
    )
}

/// The cluster at a glance (`master::Snapshot::health`), and the nodes asked to drain or step
/// down (the operator takes back requests nothing needs any more: a scale-in cancelled midway).
fn summary_status(snap: &Snapshot) -> String {
    let h = snap.health();
    let age = h.master_round_age_ms.map_or("null".to_string(), |a| a.to_string());
    let list = |s: &std::collections::BTreeSet<u32>| s.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
    format!(
        "{{\"master\": {}, \"master_round_age_ms\": {age}, \"nodes\": {}, \"regions\": {}, \"without_primary\": {}, \"under_replicated\": {}, \"zones\": {}, \"zone_shared\": {}, \"zone_blocked\": {}, \"draining\": [{}], \"stepping_down\": [{}]}}\n",
        h.master,
        h.nodes,
        h.regions,
        h.without_primary,
        h.under_replicated,
        h.zones,
        h.zone_shared,
        h.zone_blocked,
        list(&snap.facts.draining),
        list(&snap.facts.stepping_down)
    )
}

fn unavailable(e: dpukv_cluster::MetaError) -> Answer {
    text(StatusCode::SERVICE_UNAVAILABLE, format!("{}: {e}\n", e.code()))
}

/// A node's request key (drain, step-down) and its value: `Request` puts it, `Cancel` removes
/// it, then `status` of the cluster as etcd has it now, as JSON.
async fn node_request(
    c: &ClusterControl,
    action: Action,
    key: fn(&Keys, u32) -> Vec<u8>,
    node: u32,
    value: &[u8],
    status: impl FnOnce(&Snapshot) -> String,
) -> Answer {
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    use dpukv_cluster::MetaStore;
    let changed = match action {
        Action::Request => store.put(&key(&c.keys, node), value, None).await.map(|_| ()),
        Action::Cancel => store.delete(&key(&c.keys, node)).await.map(|_| ()),
        Action::Progress => Ok(()),
    };
    if let Err(e) = changed {
        return unavailable(e);
    }
    match dpukv_cluster::master::read(&store, &c.keys).await {
        Ok(snap) => json(status(&snap)),
        Err(e) => unavailable(e),
    }
}

/// The cluster at a glance, from etcd, with the custom resource's status as the operator last
/// mirrored it (`kubernetes`: null when none).
async fn summary(c: &ClusterControl) -> Answer {
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    use dpukv_cluster::MetaStore;
    let key = c.keys.kubernetes();
    let (snap, k8s) = tokio::join!(dpukv_cluster::master::read(&store, &c.keys), store.get(&key));
    match snap {
        Ok(snap) => {
            // The summary's fields keep their order and spacing (readers match on them); the
            // mirror goes last.
            let mirrored =
                k8s.ok().flatten().and_then(|kv| serde_json::from_slice::<serde_json::Value>(&kv.value).ok());
            let mirrored = mirrored.unwrap_or(serde_json::Value::Null);
            let status = summary_status(&snap);
            let head = status.trim_end().strip_suffix('}').unwrap_or(status.trim_end());
            json(format!("{head}, \"kubernetes\": {mirrored}}}\n"))
        }
        Err(e) => unavailable(e),
    }
}

/// Stores the custom resource's status the operator mirrors (a JSON object), unless it says what
/// the one stored says (its `observed_ms` aside: the stored one keeps when it last changed).
async fn mirror_kubernetes(c: &ClusterControl, status: &[u8]) -> Answer {
    let mut given = match serde_json::from_slice::<serde_json::Value>(status) {
        Ok(v) if v.is_object() => v,
        _ => return text(StatusCode::BAD_REQUEST, "bad_request: the status must be a JSON object\n".into()),
    };
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    use dpukv_cluster::MetaStore;
    let key = c.keys.kubernetes();
    let stored =
        store.get(&key).await.ok().flatten().and_then(|kv| serde_json::from_slice::<serde_json::Value>(&kv.value).ok());
    let same = stored.is_some_and(|mut v| {
        v.as_object_mut().map(|o| o.remove("observed_ms"));
        given.as_object_mut().map(|o| o.remove("observed_ms"));
        v == given
    });
    if !same && let Err(e) = store.put(&key, status, None).await {
        return unavailable(e);
    }
    json("{\"stored\": true}\n".into())
}

/// The cluster's event log, oldest first: `{"events": [...]}` (`dpukv_cluster::events`).
async fn events(c: &ClusterControl) -> Answer {
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    match dpukv_cluster::events::load(&store, &c.keys).await {
        Ok(events) => json(format!("{}\n", serde_json::json!({ "events": events }))),
        Err(e) => unavailable(e),
    }
}

/// This host's process: `{"node", "uptime_ms", "cpu_ms", "rss_bytes", "lease_age_ms",
/// "lease_ttl_ms", "lags"}`
/// (CPU and memory from `/proc/self`; the lease age is the time since it was last renewed, null
/// if never; `lags`: per backup of each region it leads, `{"region", "backup", "bytes",
/// "records"}` the backup does not hold yet).
fn host_facts(c: &ClusterControl) -> Answer {
    let Some(h) = &c.host else { return text(StatusCode::NOT_FOUND, "no host facts here\n".into()) };
    let (cpu_ms, rss) = crate::process::usage();
    let body = serde_json::json!({
        "node": h.node,
        "uptime_ms": h.started.elapsed().as_millis() as u64,
        "cpu_ms": cpu_ms,
        "rss_bytes": rss,
        "lease_age_ms": h.cluster.authority.since_renewed().map(|d| d.as_millis() as u64),
        "lease_ttl_ms": h.lease_ttl.as_millis() as u64,
        "lags": h.cluster.lags().into_iter().map(|(region, backup, bytes, records)| {
            serde_json::json!({"region": region, "backup": backup, "bytes": bytes, "records": records})
        }).collect::<Vec<_>>(),
    });
    json(format!("{body}\n"))
}

/// The regions' sizes and write rates as their primaries last reported them:
/// `{"loads": [{"region", "bytes", "writes_per_sec"}]}` (reports are written when they change
/// by a tenth, every 2 s at most, under the primary's lease).
async fn loads(c: &ClusterControl) -> Answer {
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    match dpukv_cluster::master::read(&store, &c.keys).await {
        Ok(snap) => {
            let mut loads: Vec<_> = snap.handoffs.load.iter().collect();
            loads.sort_by_key(|(id, _)| **id);
            let loads: Vec<_> = loads
                .into_iter()
                .map(|(id, l)| serde_json::json!({"region": id, "bytes": l.bytes, "writes_per_sec": l.writes_per_sec}))
                .collect();
            json(format!("{}\n", serde_json::json!({ "loads": loads })))
        }
        Err(e) => unavailable(e),
    }
}

/// Checks a split or merge request against the current map and records it for the master.
async fn request_handoff(c: &ClusterControl, region: u32, split_at: Option<Vec<u8>>) -> Answer {
    let store = match dpukv_cluster::EtcdStore::connect(&c.etcd).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let snap = match dpukv_cluster::master::read(&store, &c.keys).await {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let regions = &snap.map.regions;
    let Some(i) = regions.iter().position(|r| r.id == region) else {
        return text(StatusCode::NOT_FOUND, format!("no region {region}\n"));
    };
    let r = &regions[i];
    let bad = |m: String| text(StatusCode::BAD_REQUEST, m + "\n");
    use dpukv_cluster::MetaStore;
    let put = match &split_at {
        Some(k) => {
            if !(r.start.as_slice() < k.as_slice() && r.contains(k)) {
                return bad(format!("the key is not strictly inside region {region}"));
            }
            store.put(&c.keys.split_request(region), k, None).await
        }
        None => {
            let Some(l) = i.checked_sub(1).map(|j| &regions[j]) else {
                return bad(format!("region {region} is the first: it has no left neighbour to merge into"));
            };
            let set =
                |r: &dpukv_proto::regionmap::RegionInfo| r.replicas().collect::<std::collections::BTreeSet<u32>>();
            if set(l) != set(r) {
                return bad(format!(
                    "regions {} and {region} are on different nodes ({:?} vs {:?}): only regions on the same \
                     nodes merge",
                    l.id,
                    set(l),
                    set(r)
                ));
            }
            store.put(&c.keys.merge_request(region), b"merge", None).await
        }
    };
    match put {
        Ok(_) => json(format!("{{\"region\": {region}, \"requested\": true}}\n")),
        Err(e) => unavailable(e),
    }
}

/// Every request: authorized first, then routed.
async fn handle(
    State(c): State<Control>,
    Extension(peer): Extension<Peer>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let route = match uri.query() {
        Some(_) => Err(dpukv_proto::control::RouteError::NotFound),
        None => ControlRoute::parse(method.as_str(), uri.path()),
    };
    if let Err(r) = authorize(&c, &peer, &headers, route.as_ref().ok()) {
        tracing::info!(peer = ?peer, %method, path = uri.path(), refusal = %r, "a control API request was refused");
        let status = match r {
            Refusal::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Refusal::Forbidden(_) => StatusCode::FORBIDDEN,
        };
        let mut resp = text(status, format!("{r}\n")).into_response();
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer realm=\"dpukv-control\""),
            );
        }
        return resp;
    }
    let route = match route {
        Ok(r) => r,
        Err(e) => {
            let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
            return text(status, format!("{}: {e}\n", e.code())).into_response();
        }
    };
    if route.mutates() {
        tracing::info!(peer = ?peer.identity().map(|i| i.uri()), route = route.path(), method = route.method(), "control request");
    }
    let k = &c.cluster;
    let answer = match route {
        ControlRoute::Drain { node, action } => {
            node_request(k, action, Keys::drain, node, b"drain", |s| drain_status(s, node)).await
        }
        ControlRoute::StepDown { node, action } => {
            node_request(k, action, Keys::step_down, node, b"step-down", |s| step_down_status(s, node)).await
        }
        ControlRoute::Split { region, key } => request_handoff(k, region, Some(key)).await,
        ControlRoute::Merge { region } => request_handoff(k, region, None).await,
        ControlRoute::Summary => summary(k).await,
        ControlRoute::Events => events(k).await,
        ControlRoute::Loads => loads(k).await,
        ControlRoute::Host => host_facts(k),
        ControlRoute::Kubernetes { status } => mirror_kubernetes(k, &status).await,
        ControlRoute::Backup { to } => start_backup(&c, to).await,
        ControlRoute::BackupStatus { job } => backup_status(&c, job),
        ControlRoute::Restore { from, backup } => start_restore(k, &from, backup.as_deref()).await,
        ControlRoute::RestoreStatus { action } => restore_status(k, action).await,
        ControlRoute::SetBackupSchedule { spec } => backup_schedule(k, Some(spec), Action::Request).await,
        ControlRoute::BackupSchedule { action } => backup_schedule(k, None, action).await,
    };
    answer.into_response()
}

/// Binds `cfg.listen` and serves the control API for `cluster` until `shutdown` (within
/// [`LIMITS`]); returns the bound address.
pub async fn serve(
    cfg: ControlConfig,
    cluster: ClusterControl,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let state = Control { cluster, token: cfg.token.clone(), tls: cfg.tls.is_some(), backups: Arc::default() };
    if !state.tls && state.token.is_none() {
        tracing::warn!(listen = %cfg.listen, "the control API runs without TLS and without a token: anyone who reaches it can drain and split (plain mode)");
    }
    let app = Router::new().fallback(handle).with_state(state);
    crate::http::serve(cfg.listen, cfg.tls, app, LIMITS, shutdown).await
}

#[cfg(test)]
mod tests {
    use dpukv_net::identity::Identity;

    use super::*;

    fn control(token: Option<&Path>) -> Control {
        Control {
            cluster: ClusterControl {
                etcd: dpukv_cluster::EtcdOptions::new(["http://127.0.0.1:1"]),
                keys: Keys::new("c").expect("keys"),
                host: None,
            },
            token: token.map(|p| Arc::new(AdminToken::load(p).expect("token"))),
            tls: false,
            backups: Arc::default(),
        }
    }

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(axum::http::header::AUTHORIZATION, format!("Bearer {t}").parse().expect("header"));
        h
    }

    fn member(role: Role) -> Peer {
        Peer::Member(Identity::new("db", "demo", role, "x").expect("id"))
    }

    #[test]
    fn certificates_of_operator_or_admin_or_the_token_are_let_in() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("token");
        std::fs::write(&file, "0123456789abcdef-secret\n").expect("write");
        let with = control(Some(&file));
        let without = control(None);
        let none = HeaderMap::new();
        let drain = ControlRoute::Drain { node: 1, action: Action::Request };
        let code = |c: &Control, p: &Peer, h: &HeaderMap| authorize(c, p, h, Some(&drain)).map_err(|r| r.code());
        let read =
            |c: &Control, p: &Peer, r: ControlRoute| authorize(c, p, &HeaderMap::new(), Some(&r)).map_err(|r| r.code());
        // Certificates.
        for c in [&with, &without] {
            assert_eq!(code(c, &member(Role::Admin), &none), Ok(()));
            assert_eq!(code(c, &member(Role::Operator), &none), Ok(()));
            assert_eq!(code(c, &member(Role::Gateway), &none), Err("forbidden"));
            assert_eq!(code(c, &member(Role::Node), &none), Err("forbidden"));
            // The gateway's console reads the summary, events, loads, hosts and progress; nothing
            // of backups, and it changes nothing.
            let gateway = member(Role::Gateway);
            for r in [ControlRoute::Summary, ControlRoute::Events, ControlRoute::Loads, ControlRoute::Host] {
                assert_eq!(read(c, &gateway, r), Ok(()));
            }
            assert_eq!(read(c, &gateway, ControlRoute::Drain { node: 2, action: Action::Progress }), Ok(()));
            assert_eq!(read(c, &gateway, ControlRoute::Drain { node: 2, action: Action::Cancel }), Err("forbidden"));
            assert_eq!(read(c, &gateway, ControlRoute::BackupStatus { job: 1 }), Err("forbidden"));
            assert_eq!(read(c, &gateway, ControlRoute::RestoreStatus { action: Action::Progress }), Err("forbidden"));
            assert_eq!(read(c, &gateway, ControlRoute::BackupSchedule { action: Action::Progress }), Err("forbidden"));
            assert_eq!(read(c, &member(Role::Node), ControlRoute::Summary), Err("forbidden"));
            assert_eq!(read(c, &member(Role::Client), ControlRoute::Summary), Err("forbidden"));
            assert_eq!(code(c, &Peer::Anonymous, &none), Err("unauthorized"));
            let stranger = Peer::Stranger(Identity::new("db", "other", Role::Admin, "x").expect("id"));
            assert_eq!(code(c, &stranger, &none), Err("forbidden"));
        }
        // The token, with or without TLS; surrounding white space in the file is not part of it.
        assert_eq!(code(&with, &Peer::Anonymous, &bearer("0123456789abcdef-secret")), Ok(()));
        assert_eq!(code(&with, &Peer::Unchecked, &bearer("0123456789abcdef-secret")), Ok(()));
        assert_eq!(code(&with, &Peer::Unchecked, &bearer("0123456789abcdef-secreT")), Err("forbidden"));
        assert_eq!(code(&with, &Peer::Unchecked, &none), Err("unauthorized"));
        assert_eq!(code(&without, &Peer::Unchecked, &bearer("x")), Err("forbidden"));
        // Plain mode without a token: open.
        assert_eq!(code(&without, &Peer::Unchecked, &none), Ok(()));
        // A rotated token is read again; the old one no longer works.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(&file, "fedcba9876543210-new").expect("write");
        let later = SystemTime::now() + Duration::from_secs(5);
        std::fs::File::options().write(true).open(&file).and_then(|f| f.set_modified(later)).expect("touch");
        assert_eq!(code(&with, &Peer::Unchecked, &bearer("fedcba9876543210-new")), Ok(()));
        assert_eq!(code(&with, &Peer::Unchecked, &bearer("0123456789abcdef-secret")), Err("forbidden"));
        // A token file with too short a token does not load.
        std::fs::write(&file, "short").expect("write");
        assert!(AdminToken::load(&file).is_err());
    }
}
