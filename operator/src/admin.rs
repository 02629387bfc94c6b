//! A cluster's admin API as the operator uses it (docs/cluster.md, docs/operations.md): asking
//! the master to drain nodes before their pods go, and to stop draining nodes that come back
//! (`POST`/`DELETE /cluster/drain/{node}`, whose JSON answer says how far the drain is:
//! `{"node", "draining", "regions_led", "regions_held", "done"}`); asking a node's primaries to
//! step down before its pod restarts (`POST`/`DELETE /cluster/step-down/{node}`); and the
//! cluster's summary for
//! the status (`GET /cluster/summary`: regions, master, regions without a live primary or short
//! of copies).
//!
//! A small HTTP/1.1 client on a TCP connection per call (`Connection: close`): every call has a
//! timeout ([`TIMEOUT`]) and an answer is read up to [`MAX_ANSWER`] bytes.

use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Each call's time limit (connect, send, answer).
pub const TIMEOUT: Duration = Duration::from_secs(5);
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
    /// An answer that is not a 200 with a drain status.
    #[error("admin endpoint {addr} answered: {answer}")]
    Refused {
        /// `host:port`.
        addr: String,
        /// The status line and body (shortened).
        answer: String,
    },
}

async fn call<T: serde::de::DeserializeOwned>(addr: &str, method: &str, path: &str) -> Result<T, AdminError> {
    let io = |source| AdminError::Io { addr: addr.to_string(), source };
    let request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        (&mut s).take(MAX_ANSWER as u64).read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
        .map_err(io)?;
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
pub async fn step_down(addr: &str, node: u32) -> Result<StepDownStatus, AdminError> {
    call(addr, "POST", &format!("/cluster/step-down/{node}")).await
}

/// Lets node `node` lead again (its pod restarted).
pub async fn step_up(addr: &str, node: u32) -> Result<StepDownStatus, AdminError> {
    call(addr, "DELETE", &format!("/cluster/step-down/{node}")).await
}

/// The cluster's summary.
pub async fn summary(addr: &str) -> Result<Summary, AdminError> {
    call(addr, "GET", "/cluster/summary").await
}

/// Asks for node `node` to be drained (idempotent) and answers how far it is.
pub async fn drain(addr: &str, node: u32) -> Result<DrainStatus, AdminError> {
    call(addr, "POST", &format!("/cluster/drain/{node}")).await
}

/// Asks that node `node` no longer be drained (a scale-out brought its pod back).
pub async fn undrain(addr: &str, node: u32) -> Result<DrainStatus, AdminError> {
    call(addr, "DELETE", &format!("/cluster/drain/{node}")).await
}
