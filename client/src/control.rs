//! A client of the hosts' control API (`/cluster/*`, docs/operations.md "Control API"): what
//! `dpukv cluster`, `dpukv backup`, `dpukv restore` and the gateway's console call. One request
//! per connection (the API keeps none alive), with TLS and an admin certificate or a bearer
//! token; every call has deadlines (connect within 5 s, answered within 30 s) and reads at most
//! [`MAX_CONTROL_ANSWER`] bytes.

use std::sync::Arc;
use std::time::Duration;

use dpukv_proto::control::ControlRoute;
use dpukv_proto::regionmap::RegionMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The most bytes of a control API answer read.
pub const MAX_CONTROL_ANSWER: u64 = 1 << 20;
/// A connection must be made within this.
pub const CONNECT_WITHIN: Duration = Duration::from_secs(5);
/// An answer must come within this.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// Why a control API call failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No node advertises a control API and none was given.
    #[error("no node advertises a control API (hosts need --control-listen), and no --control was given")]
    NoEndpoint,
    /// Connecting, TLS, or the exchange failed.
    #[error("the control API at {addr}: {why}")]
    Io {
        /// Where.
        addr: String,
        /// What went wrong.
        why: String,
    },
    /// The answer was not HTTP.
    #[error("the control API at {0} answered no HTTP")]
    NotHttp(String),
    /// It answered, but not 200.
    #[error("{addr} answered {status}: {body}{hint}")]
    Refused {
        /// Where.
        addr: String,
        /// The HTTP status.
        status: u16,
        /// Its body (trimmed).
        body: String,
        /// What to do about it, if known.
        hint: &'static str,
    },
}

impl ControlError {
    /// A stable code: `no_endpoint`, `io`, `not_http`, `refused`.
    pub fn code(&self) -> &'static str {
        match self {
            ControlError::NoEndpoint => "no_endpoint",
            ControlError::Io { .. } => "io",
            ControlError::NotHttp(_) => "not_http",
            ControlError::Refused { .. } => "refused",
        }
    }
}

/// How to reach the hosts' control API.
#[derive(Clone, Default)]
pub struct ControlClient {
    /// TLS (trusting the cluster's CA, presenting an admin or operator certificate), if used.
    pub tls: Option<Arc<dpukv_net::tls::ClientTls>>,
    /// A bearer token (the hosts' `--admin-token-file`), if used.
    pub token: Option<String>,
    /// A fixed address, else one a node advertises.
    pub addr: Option<String>,
}

impl ControlClient {
    /// The fixed address, or a control API a node advertises (preferring one not on node
    /// `avoid`).
    pub fn endpoint(&self, map: &RegionMap, avoid: Option<u32>) -> Result<String, ControlError> {
        if let Some(a) = &self.addr {
            return Ok(a.clone());
        }
        map.nodes
            .iter()
            .filter(|n| !n.admin.is_empty())
            .min_by_key(|n| Some(n.id) == avoid)
            .map(|n| n.admin.clone())
            .ok_or(ControlError::NoEndpoint)
    }

    /// One request to the control API at `addr`: the status code and the body.
    pub async fn call(&self, addr: &str, route: &ControlRoute) -> Result<(u16, String), ControlError> {
        let io = |why: String| ControlError::Io { addr: addr.to_string(), why };
        let exchange = async {
            let tcp = tokio::time::timeout(CONNECT_WITHIN, tokio::net::TcpStream::connect(addr))
                .await
                .map_err(|_| io("no answer to connecting within 5 s".into()))?
                .map_err(|e| io(format!("connecting: {e}")))?;
            let mut s = match &self.tls {
                Some(t) => t.connect(tcp, addr).await.map_err(|e| match dpukv_net::tls::refusal(&e) {
                    Some(why) => io(format!("TLS: {why}")),
                    None => io(format!("TLS: {e}")),
                })?,
                None => dpukv_net::tls::Stream::Plain(tcp),
            };
            let auth = self.token.as_deref().map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
            let req = format!(
                "{} {} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n",
                route.method(),
                route.path()
            );
            s.write_all(req.as_bytes()).await.map_err(|e| io(e.to_string()))?;
            s.flush().await.map_err(|e| io(e.to_string()))?;
            let mut resp = Vec::new();
            // A refused TLS session ends the read with an error after what was answered.
            let read = (&mut s).take(MAX_CONTROL_ANSWER).read_to_end(&mut resp).await;
            if resp.is_empty()
                && let Err(e) = read
            {
                return Err(io(e.to_string()));
            }
            Ok(resp)
        };
        let resp =
            tokio::time::timeout(ANSWER_WITHIN, exchange).await.map_err(|_| io("no answer within 30 s".into()))??;
        if self.tls.is_none() && dpukv_net::tls::looks_like_tls(&resp) {
            return Err(io("it speaks TLS: give --tls-ca (and an admin certificate, or --admin-token)".into()));
        }
        let text = String::from_utf8_lossy(&resp);
        let code = text
            .strip_prefix("HTTP/1.")
            .and_then(|t| t.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| ControlError::NotHttp(addr.to_string()))?;
        Ok((code, text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("").to_string()))
    }

    /// [`ControlClient::call`], failing unless the answer is a 200.
    pub async fn must(&self, addr: &str, route: &ControlRoute) -> Result<String, ControlError> {
        let (status, body) = self.call(addr, route).await?;
        if status != 200 {
            let hint = match status {
                401 | 403 => {
                    " (the control API wants an admin certificate — --tls-ca, --tls-cert, --tls-key — or --admin-token)"
                }
                _ => "",
            };
            return Err(ControlError::Refused { addr: addr.to_string(), status, body: body.trim().to_string(), hint });
        }
        Ok(body)
    }
}
