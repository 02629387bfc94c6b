//! The `dpukv-gateway` binary's flags (with environment fallbacks), checked into a
//! [`GatewayConfig`].

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Result, bail};
use dpukv_net::conn::ConnArgs;

use crate::GatewayConfig;
use crate::binary::BinaryLimits;
use crate::http::HttpLimits;
use crate::resp::RespLimits;

/// `dpukv-gateway` flags.
#[derive(Debug, clap::Parser)]
#[command(
    name = "dpukv-gateway",
    version,
    about = "dpukv gateway: one endpoint for a whole cluster (binary protocol, HTTP/JSON, Redis protocol)"
)]
pub struct GatewayArgs {
    /// Node devices to learn the cluster from (comma separated; the first that answers).
    #[arg(long, env = "DPUKV_SEEDS", value_delimiter = ',', required = true)]
    pub seeds: Vec<String>,
    /// The binary protocol's port (existing clients point here unchanged).
    #[arg(long, env = "DPUKV_GATEWAY_LISTEN", default_value = "127.0.0.1:7080")]
    pub listen: SocketAddr,
    /// The HTTP/JSON port (also serves /metrics, /healthz, /readyz).
    #[arg(long, env = "DPUKV_GATEWAY_HTTP")]
    pub http: Option<SocketAddr>,
    /// The Redis protocol port.
    #[arg(long, env = "DPUKV_GATEWAY_RESP")]
    pub resp: Option<SocketAddr>,
    /// The admin endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, env = "DPUKV_GATEWAY_ADMIN")]
    pub admin: Option<SocketAddr>,
    /// Connections to each node device.
    #[arg(long, default_value_t = 4)]
    pub pool: usize,
    /// Tree nodes cached per region for start hints (the fat root, docs/hot-keys.md §9; 0: none).
    #[arg(long, env = "DPUKV_GATEWAY_FAT_ROOT", default_value_t = 4096)]
    pub fat_root: usize,
    /// `extended` consistency: requests in flight to a primary's device above which it is busy
    /// and gets of replicated keys go to a replica (docs/hot-keys.md).
    #[arg(long, default_value_t = dpukv_client::BUSY_IN_FLIGHT)]
    pub busy_in_flight: usize,
    /// Most connections per front end (more are closed at once).
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Parts of a scan read ahead in parallel.
    #[arg(long, default_value_t = 4)]
    pub scan_parallelism: usize,
    /// Scan parts all scans together may hold (each up to 4 MiB).
    #[arg(long, default_value_t = 64)]
    pub scan_parts: usize,
    /// Scans asking for at least this many items are split inside a region, at keys from the
    /// region's index, and the pieces read in parallel (0: never).
    #[arg(long, default_value_t = 1000)]
    pub scan_split_min: usize,
    /// Commands taken from a RESP connection at a time (a pipeline longer than this is run in
    /// turns).
    #[arg(long, default_value_t = 256)]
    pub resp_pipeline: usize,
    /// Most bytes of an HTTP request body.
    #[arg(long, default_value_t = 16 << 20)]
    pub http_max_body: usize,
    /// Seconds an HTTP request may take.
    #[arg(long, default_value_t = 60)]
    pub request_timeout: u64,
    /// Seconds an HTTP connection may take to send a request's headers — on a new connection,
    /// or between requests on a kept-alive one; then it is closed (idle or slow clients cannot
    /// hold the front end's connections).
    #[arg(long, default_value_t = 30)]
    pub http_idle_timeout: u64,
    /// With tokens configured: seconds a binary or RESP connection may take to authenticate
    /// before it is closed.
    #[arg(long, default_value_t = 10)]
    pub auth_timeout: u64,
    /// Failed authentications a peer address may make in a row (any front end); then one per
    /// `--auth-failure-window` / this, and its attempts in between are refused unheard.
    #[arg(long, default_value_t = 10)]
    pub auth_failures: u32,
    /// Seconds over which `--auth-failures` failures come back.
    #[arg(long, default_value_t = 10)]
    pub auth_failure_window: u64,
    /// Seconds between forced refreshes of the region map.
    #[arg(long, default_value_t = 5)]
    pub map_refresh: u64,
    /// SCAN cursors kept (the oldest go first) and for how many seconds.
    #[arg(long, default_value_t = 65536)]
    pub scan_cursors: usize,
    /// Seconds a SCAN cursor stays valid.
    #[arg(long, default_value_t = 600)]
    pub scan_cursor_ttl: u64,
    /// A JSON file of bearer tokens and their grants (docs/gateway.md); re-read when it changes.
    /// Without it (and without DPUKV_TOKENS) the gateway is open.
    #[arg(long, env = "DPUKV_TOKENS_FILE")]
    pub tokens: Option<std::path::PathBuf>,
    /// Serve no web console (`/ui/` and `/v1/console/` on the HTTP front end; docs/console.md).
    #[arg(long, env = "DPUKV_GATEWAY_NO_CONSOLE")]
    pub no_console: bool,
    /// The hosts' admin token (their `--admin-token-file`), in a file: the console's actions
    /// (drain, step down, split) go to the control API with it. Without it the console shows
    /// the cluster (with the gateway's certificate, or on a plain control API) but cannot act.
    #[arg(long, env = "DPUKV_CONTROL_TOKEN_FILE")]
    pub control_token_file: Option<std::path::PathBuf>,
    /// A control API address for the console (default: one a node advertises).
    #[arg(long, env = "DPUKV_CONTROL")]
    pub control: Option<String>,
    /// TLS on every front end (and, presenting this certificate, to the devices: with
    /// `--tls-ca` the devices' certificates are checked against it).
    #[command(flatten)]
    pub tls: dpukv_net::tls::TlsArgs,
    /// Connection limits (binary front end; the memory budget is the whole process's).
    #[command(flatten)]
    pub conn: ConnArgs,
}

impl GatewayArgs {
    /// The validated configuration.
    pub fn config(&self) -> Result<GatewayConfig> {
        if self.seeds.iter().all(|s| s.trim().is_empty()) {
            bail!("--seeds needs at least one node device address");
        }
        for (flag, v) in [
            ("--pool", self.pool),
            ("--max-connections", self.max_connections),
            ("--scan-parallelism", self.scan_parallelism),
            ("--scan-parts", self.scan_parts),
            ("--resp-pipeline", self.resp_pipeline),
            ("--scan-cursors", self.scan_cursors),
        ] {
            if v == 0 {
                bail!("{flag} must be positive");
            }
        }
        if self.http_max_body < 1024
            || self.request_timeout == 0
            || self.map_refresh == 0
            || self.scan_cursor_ttl == 0
            || self.http_idle_timeout == 0
            || self.auth_timeout == 0
            || self.auth_failures == 0
            || self.auth_failure_window == 0
        {
            bail!("--http-max-body must be at least 1024, and timeouts and --auth-failures positive");
        }
        let conn = self.conn.config().map_err(anyhow::Error::msg)?;
        Ok(GatewayConfig {
            seeds: self.seeds.iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
            listen: Some(self.listen),
            http: self.http,
            resp: self.resp,
            admin: self.admin,
            pool: self.pool,
            fat_root: self.fat_root,
            busy_in_flight: self.busy_in_flight,
            binary: BinaryLimits { max_connections: self.max_connections, conn },
            http_limits: HttpLimits {
                max_connections: self.max_connections,
                max_body: self.http_max_body,
                request_timeout: Duration::from_secs(self.request_timeout),
                idle_timeout: Duration::from_secs(self.http_idle_timeout),
            },
            resp_limits: RespLimits {
                max_connections: self.max_connections,
                max_pipeline: self.resp_pipeline,
                idle_timeout: conn.idle_timeout,
                write_timeout: conn.write_timeout,
                command: crate::resp::frame::Limits::default(),
                command_timeout: conn.frame_timeout,
                conn_memory: conn.conn_bytes,
                auth_timeout: Duration::from_secs(self.auth_timeout),
            },
            auth_timeout: Duration::from_secs(self.auth_timeout),
            auth_failures: self.auth_failures,
            auth_failure_window: Duration::from_secs(self.auth_failure_window),
            memory_budget: self.conn.memory_budget,
            scan_parallelism: self.scan_parallelism,
            scan_parts: self.scan_parts,
            scan_split_min: self.scan_split_min,
            map_refresh: Duration::from_secs(self.map_refresh),
            scan_cursors: self.scan_cursors,
            scan_cursor_ttl: Duration::from_secs(self.scan_cursor_ttl),
            shutdown_grace: Duration::from_secs(self.conn.shutdown_grace),
            // The document itself may come in DPUKV_TOKENS (a Kubernetes secret as an
            // environment variable); it is read here, never logged.
            tls_server: self.tls.server().map_err(anyhow::Error::msg)?,
            tls_client: self.tls.client().map_err(anyhow::Error::msg)?,
            tokens: match (&self.tokens, std::env::var("DPUKV_TOKENS").ok().filter(|t| !t.trim().is_empty())) {
                (Some(_), Some(_)) => bail!("give --tokens (DPUKV_TOKENS_FILE) or DPUKV_TOKENS, not both"),
                (Some(p), None) => crate::auth::TokenSource::File(p.clone()),
                (None, Some(doc)) => crate::auth::TokenSource::Inline(doc),
                (None, None) => crate::auth::TokenSource::None,
            },
            local: None,
            shared: None,
            console: if self.no_console {
                None
            } else {
                Some(crate::console::ConsoleConfig {
                    control: dpukv_client::control::ControlClient {
                        tls: self.tls.client().map_err(anyhow::Error::msg)?,
                        token: match &self.control_token_file {
                            Some(p) => Some(read_token(p)?),
                            None => None,
                        },
                        addr: self.control.clone(),
                    },
                })
            },
            reuse_port: false,
        })
    }
}

/// The control token in `path` (trimmed; 16 bytes at least, as the hosts require).
fn read_token(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(4096).read_to_string(&mut text))
        .map_err(|e| anyhow::anyhow!("--control-token-file {}: {e}", path.display()))?;
    let t = text.trim().to_string();
    if t.len() < 16 {
        bail!("--control-token-file {}: the token must be at least 16 bytes", path.display());
    }
    Ok(t)
}
