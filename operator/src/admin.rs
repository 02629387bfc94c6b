//! A cluster's admin API as the operator uses it (docs/cluster.md, docs/operations.md): asking
//! the master to drain nodes before their pods go, and to stop draining nodes that come back
//! (`POST`/`DELETE /cluster/drain/{node}`, whose JSON answer says how far the drain is:
//! `{"node", "draining", "regions_led", "regions_held", "done"}`); asking a node's primaries to
//! step down before its pod restarts (`POST`/`DELETE /cluster/step-down/{node}`); and the
//! cluster's summary for
//! the status (`GET /cluster/summary`: regions, master, regions without a live primary or short
//! of copies).
//!
//! These are the nodes' control API (port 9103): mutual TLS, the operator presenting its
//! `operator` certificate and checking the node's against the cluster's CA and the pod's DNS
//! name ([`Endpoint::tls`]); plain HTTP only for a cluster whose TLS is `Disabled`.
//!
//! A small HTTP/1.1 client on a TCP connection per call (`Connection: close`): every call has a
//! timeout ([`TIMEOUT`]) and an answer is read up to [`MAX_ANSWER`] bytes. An address may list
//! several hosts (comma-separated): the call goes to the first one that can be reached.

use std::time::Duration;

use std::sync::Arc;

use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Where a cluster's control API is, and how to talk to it.
#[derive(Clone)]
pub struct Endpoint {
    /// `host:port`, comma-separated (tried in order).
    pub addrs: String,
    /// Mutual TLS (the operator's certificate, the cluster's CA); None: plain HTTP.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl Endpoint {
    /// Plain HTTP at `addrs`.
    pub fn plain(addrs: impl Into<String>) -> Endpoint {
        Endpoint { addrs: addrs.into(), tls: None }
    }
}

/// Each call's time limit (connect, send, answer).
pub const TIMEOUT: Duration = Duration::from_secs(3);
/// The most bytes of an answer read.
pub const MAX_ANSWER: usize = 64 << 10;

/// A node's drain, as the master reports it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DrainStatus {
    /// The node.
    pub node: u32,
    /// A drain is requested.
    pub draining: bool,
    /// Regions it still leads.
    pub regions_led: u32,
    /// Regions it still holds a copy of.
    pub regions_held: u32,
    /// Requested and nothing left on it.
    pub done: bool,
}

/// A node's step-down, as the master reports it (`/cluster/step-down/{node}`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct StepDownStatus {
    /// The node.
    pub node: u32,
    /// A step-down is requested.
    pub stepping_down: bool,
    /// Regions it still leads.
    pub regions_led: u32,
    /// Of those, regions a backup elsewhere could take.
    pub movable: u32,
    /// Requested, nothing movable left, every handover released.
    pub done: bool,
}

/// The cluster as its metadata says (`GET /cluster/summary`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Summary {
    /// The node running the master (0: none elected).
    pub master: u32,
    /// Live (registered) nodes.
    pub nodes: u32,
    /// Regions.
    pub regions: u32,
    /// Regions whose primary is not live (a failover is due or under way).
    pub without_primary: u32,
    /// Regions with fewer in-sync copies than the replication factor allows on the live nodes.
    pub under_replicated: u32,
    /// Distinct zones among the live nodes not draining (0: no node has a zone; absent from
    /// nodes of an older version).
    #[serde(default)]
    pub zones: u32,
    /// Regions with two live copies in one zone.
    #[serde(default)]
    pub zone_shared: u32,
    /// Under-replicated regions whose every node that could take a copy is in a zone they have.
    #[serde(default)]
    pub zone_blocked: u32,
    /// Nodes asked to drain (absent from nodes of an older version: none).
    #[serde(default)]
    pub draining: Vec<u32>,
    /// Nodes asked to step down.
    #[serde(default)]
    pub stepping_down: Vec<u32>,
}

/// A backup job's progress, as the node coordinating it reports it (`/cluster/backups/{job}`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BackupJob {
    /// The job's number on that node.
    pub job: u64,
    /// `running`, `done` or `failed`.
    pub state: String,
    /// The backup's id, once its cut is taken.
    pub backup: Option<String>,
    /// Regions in the cut.
    pub regions: u32,
    /// Regions whose part is uploaded.
    pub parts: u32,
    /// Bytes uploaded (what the location lacked).
    pub uploaded_bytes: u64,
    /// Bytes the backup holds.
    pub bytes: u64,
    /// Why it failed.
    pub error: Option<String>,
}

/// A restore's progress (`/cluster/restore`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RestoreProgress {
    /// `running`, or `none` (no restore under way).
    pub state: String,
    /// The backup's id.
    pub backup: Option<String>,
    /// Regions the restore makes.
    pub regions: u32,
    /// Of those, open at their primaries.
    pub opened: u32,
    /// Of those, open and with every copy.
    pub copied: u32,
    /// The nodes' latest failures.
    #[serde(default)]
    pub errors: Vec<String>,
}

/// The cluster's backup schedule and its last backup (`/cluster/backup-schedule`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ScheduleStatus {
    /// The schedule in force (None: none).
    pub schedule: Option<serde_json::Value>,
    /// The last finished backup.
    pub last_backup: Option<LastBackup>,
}

/// The cluster's last finished backup.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct LastBackup {
    /// Its id.
    pub id: String,
    /// Its location.
    pub to: String,
    /// When its cut committed (Unix ms).
    pub at_ms: u64,
    /// Bytes it holds.
    pub bytes: u64,
    /// Bytes it uploaded.
    pub uploaded_bytes: u64,
    /// How long it took (ms).
    pub took_ms: u64,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Starts a backup of the cluster to `to`: the job and the address of the node coordinating
/// it (its progress is asked there: [`backup_job`]).
pub async fn start_backup(ep: &Endpoint, to: &str) -> Result<(BackupJob, String), AdminError> {
    call_answering(ep, "POST", &format!("/cluster/backups/{}", hex(to.as_bytes()))).await
}

/// Backup job `job`'s progress at its coordinator (`ep` holds that one address).
pub async fn backup_job(ep: &Endpoint, job: u64) -> Result<BackupJob, AdminError> {
    call(ep, "GET", &format!("/cluster/backups/{job}")).await
}

/// Sets the cluster's backup schedule (`spec`: its `key=value` lines).
pub async fn set_schedule(ep: &Endpoint, spec: &str) -> Result<ScheduleStatus, AdminError> {
    call(ep, "POST", &format!("/cluster/backup-schedule/{}", hex(spec.as_bytes()))).await
}

/// The cluster's backup schedule and last backup.
pub async fn schedule(ep: &Endpoint) -> Result<ScheduleStatus, AdminError> {
    call(ep, "GET", "/cluster/backup-schedule").await
}

/// Stops the cluster's backup schedule.
pub async fn unschedule(ep: &Endpoint) -> Result<ScheduleStatus, AdminError> {
    call(ep, "DELETE", "/cluster/backup-schedule").await
}

/// Begins restoring backup `backup` (an id, `at-<unix ms>`, or None: the latest) from `from`
/// into the cluster — or follows the same restore under way.
pub async fn restore(ep: &Endpoint, from: &str, backup: Option<&str>) -> Result<RestoreProgress, AdminError> {
    let path = match backup {
        Some(b) => format!("/cluster/restore/{}/{b}", hex(from.as_bytes())),
        None => format!("/cluster/restore/{}", hex(from.as_bytes())),
    };
    call(ep, "POST", &path).await
}

/// The restore under way.
pub async fn restore_progress(ep: &Endpoint) -> Result<RestoreProgress, AdminError> {
    call(ep, "GET", "/cluster/restore").await
}

impl AdminError {
    /// The HTTP status of a refusal (None: no answer).
    pub fn status(&self) -> Option<u16> {
        match self {
            AdminError::Refused { answer, .. } => answer.split(' ').nth(1).and_then(|c| c.parse().ok()),
            _ => None,
        }
    }

    /// A refusal's body (its first line: `code: message`).
    pub fn body(&self) -> String {
        match self {
            AdminError::Refused { answer, .. } => {
                answer.split_once("\r\n\r\n").map_or("", |(_, b)| b).trim().lines().next().unwrap_or("").to_string()
            }
            other => other.to_string(),
        }
    }
}

/// What a call to the admin API can fail with.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No answer in time, or the connection failed.
    #[error("admin endpoint {addr}: {source}")]
    Io {
        /// `host:port`.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TLS handshake failed (a certificate refused either way, a name that does not match).
    #[error("admin endpoint {addr}: TLS: {source}")]
    Tls {
        /// `host:port`.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// An answer that is not a 200 with a drain status.
    #[error("admin endpoint {addr} answered: {answer}")]
    Refused {
        /// `host:port`.
        addr: String,
        /// The status line and body (shortened).
        answer: String,
    },
}

/// The call on the first of `addrs` (comma-separated `host:port`s) that can be reached: a node
/// pod restarting (an upgrade restarts them all in turn) must not stop the operator's calls —
/// every host answers for the whole cluster. An answer (even a refusal) ends the search; only an
/// address that cannot be reached, or answers nothing in time, passes the call to the next.
async fn call<T: serde::de::DeserializeOwned>(ep: &Endpoint, method: &str, path: &str) -> Result<T, AdminError> {
    call_answering(ep, method, path).await.map(|(t, _)| t)
}

/// [`call`], with the address that answered.
async fn call_answering<T: serde::de::DeserializeOwned>(
    ep: &Endpoint,
    method: &str,
    path: &str,
) -> Result<(T, String), AdminError> {
    let addrs = ep.addrs.as_str();
    let mut last = None;
    for addr in addrs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        match call_one(addr, ep.tls.as_ref(), method, path).await {
            Err(e @ AdminError::Io { .. }) => last = Some(e),
            other => return other.map(|t| (t, addr.to_string())),
        }
    }
    Err(last.unwrap_or_else(|| AdminError::Io {
        addr: addrs.to_string(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no admin address"),
    }))
}

/// Sends `request` on `s` and reads the answer to its end.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, request: &str) -> std::io::Result<Vec<u8>> {
    s.write_all(request.as_bytes()).await?;
    s.flush().await?;
    let mut answer = Vec::new();
    (&mut s).take(MAX_ANSWER as u64).read_to_end(&mut answer).await?;
    Ok(answer)
}

async fn call_one<T: serde::de::DeserializeOwned>(
    addr: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
    method: &str,
    path: &str,
) -> Result<T, AdminError> {
    let io = |source| AdminError::Io { addr: addr.to_string(), source };
    let request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
    let answer = async {
        let tcp = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
        match tls {
            None => exchange(tcp, &request).await.map_err(io),
            Some(cfg) => {
                let tls_err = |source| AdminError::Tls { addr: addr.to_string(), source };
                let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
                let name = rustls_pki_types::ServerName::try_from(host.to_string())
                    .map_err(|e| tls_err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
                let s = tokio_rustls::TlsConnector::from(cfg.clone()).connect(name, tcp).await.map_err(tls_err)?;
                exchange(s, &request).await.map_err(io)
            }
        }
    };
    let answer = tokio::time::timeout(TIMEOUT, answer).await.map_err(|_| io(std::io::ErrorKind::TimedOut.into()))??;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let refused = || AdminError::Refused { addr: addr.to_string(), answer: text.chars().take(300).collect() };
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(refused());
    }
    serde_json::from_str(body.trim()).map_err(|_| refused())
}

/// Asks for node `node`'s primaries to move to backups elsewhere (before its pod restarts; it
/// keeps its copies), and answers how far that is.
pub async fn step_down(addr: &Endpoint, node: u32) -> Result<StepDownStatus, AdminError> {
    call(addr, "POST", &format!("/cluster/step-down/{node}")).await
}

/// Lets node `node` lead again (its pod restarted).
pub async fn step_up(addr: &Endpoint, node: u32) -> Result<StepDownStatus, AdminError> {
    call(addr, "DELETE", &format!("/cluster/step-down/{node}")).await
}

/// Mirrors the custom resource's status (`status`, a JSON object of at most 8 KiB) into the
/// cluster, where the gateway's console shows it (docs/console.md).
pub async fn mirror_status(addr: &Endpoint, status: &serde_json::Value) -> Result<(), AdminError> {
    let route = dpukv_proto::control::ControlRoute::Kubernetes { status: status.to_string().into_bytes() };
    call::<serde_json::Value>(addr, "POST", &route.path()).await.map(|_| ())
}

/// The cluster's summary.
pub async fn summary(addr: &Endpoint) -> Result<Summary, AdminError> {
    call(addr, "GET", "/cluster/summary").await
}

/// Asks for node `node` to be drained (idempotent) and answers how far it is.
pub async fn drain(addr: &Endpoint, node: u32) -> Result<DrainStatus, AdminError> {
    call(addr, "POST", &format!("/cluster/drain/{node}")).await
}

/// Asks that node `node` no longer be drained (a scale-out brought its pod back).
pub async fn undrain(addr: &Endpoint, node: u32) -> Result<DrainStatus, AdminError> {
    call(addr, "DELETE", &format!("/cluster/drain/{node}")).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host admin endpoint answering every call with `status` and `body`, once per connection.
    async fn endpoint(status: &'static str, body: &'static str) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let answer = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n{body}", body.len());
                let _ = s.write_all(answer.as_bytes()).await;
            }
        });
        addr
    }

    /// A port nothing listens on.
    async fn closed() -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr").to_string()
    }

    #[tokio::test]
    async fn a_call_goes_to_the_first_host_that_can_be_reached_and_stops_at_an_answer() {
        let summary = r#"{"master": 2, "nodes": 3, "regions": 4, "without_primary": 0, "under_replicated": 0}"#;
        let up = endpoint("200 OK", summary).await;
        let down = closed().await;
        let s = summary_of(&format!("{down},{up}")).await.expect("the second host answers");
        assert_eq!((s.master, s.regions), (2, 4));
        // A refusal is an answer: the next host is not asked.
        let refusing = endpoint("503 Service Unavailable", "etcd unavailable").await;
        let e = summary_of(&format!("{refusing},{up}")).await.expect_err("refused");
        assert!(matches!(e, AdminError::Refused { .. }), "{e}");
        let e = summary_of(&down).await.expect_err("nothing reachable");
        assert!(matches!(e, AdminError::Io { .. }), "{e}");
    }

    async fn summary_of(addrs: &str) -> Result<Summary, AdminError> {
        summary(&Endpoint::plain(addrs)).await
    }
}
