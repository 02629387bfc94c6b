//! The plugin's life: scan the devices every `health_interval` (a missing device turns
//! unhealthy, see `plugin::Inventory`), serve the `DevicePlugin` service on a unix socket in the
//! kubelet's directory, register with the kubelet (retrying with backoff until it answers), and
//! start over — new socket, new registration — when the kubelet restarts (its `kubelet.sock` is
//! re-created: another inode) or our socket is removed (a restarting kubelet deletes every
//! plugin's socket). On stop, the streams end, the server stops and the socket is removed.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::api::device_plugin_server::DevicePluginServer;
use crate::kubelet::{self, KUBELET_SOCKET};
use crate::metrics::Metrics;
use crate::plugin::{Inventory, Plugin};
use crate::sysfs::Source;

/// How the plugin runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The kubelet's device plugin directory (holds `kubelet.sock` and our socket).
    pub dir: PathBuf,
    /// The resource offered (`dpukv.io/dpu`).
    pub resource: String,
    /// Our socket's file name in `dir`.
    pub socket: String,
    /// Where devices come from.
    pub source: Source,
    /// How often devices are scanned.
    pub health_interval: Duration,
    /// How often the kubelet's socket and ours are checked.
    pub watch_interval: Duration,
}

/// What stopped the plugin.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A file or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Io { what, source }
}

/// A file's identity (device, inode): a re-created socket has another.
fn identity(p: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

/// Scans the devices into `inventory` now and then every `every` until `stop`.
fn watch_devices(
    source: Source,
    inventory: Arc<Inventory>,
    metrics: Arc<Metrics>,
    every: Duration,
    stop: CancellationToken,
) {
    let scan = move || match source.scan() {
        Ok(found) => {
            if inventory.update(found) {
                let now = inventory.snapshot();
                let healthy = now.values().filter(|k| k.healthy).count();
                tracing::info!(healthy, unhealthy = now.len() - healthy, "devices changed");
                metrics.healthy.set(healthy as i64);
                metrics.unhealthy.set((now.len() - healthy) as i64);
            }
        }
        Err(e) => tracing::warn!(error = %e, "scanning devices failed; keeping the last scan"),
    };
    scan();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            scan();
        }
    });
}

/// Runs the plugin until `stop` (see the module documentation).
pub async fn run(cfg: Config, metrics: Arc<Metrics>, stop: CancellationToken) -> Result<(), RunError> {
    let inventory = Arc::new(Inventory::default());
    watch_devices(cfg.source.clone(), inventory.clone(), metrics.clone(), cfg.health_interval, stop.clone());
    let sock = cfg.dir.join(&cfg.socket);
    let kubelet_sock = cfg.dir.join(KUBELET_SOCKET);
    while !stop.is_cancelled() {
        // Serve on a fresh socket (a previous run's file, or one the kubelet left, goes first).
        match std::fs::remove_file(&sock) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io(format!("removing {}", sock.display()))(e));
            }
            _ => {}
        }
        let listener = tokio::net::UnixListener::bind(&sock).map_err(io(format!("binding {}", sock.display())))?;
        let mine = identity(&sock);
        let session = stop.child_token();
        let service = DevicePluginServer::new(Plugin::new(inventory.clone(), metrics.clone(), session.clone()));
        let done = session.clone();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move { done.cancelled().await }),
        );
        // Register, retrying while the kubelet is away.
        let mut backoff = Duration::from_millis(100);
        let registered_with = loop {
            let before = identity(&kubelet_sock);
            match kubelet::register(&kubelet_sock, &cfg.socket, &cfg.resource).await {
                Ok(()) => break before,
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "registration failed");
                    tokio::select! {
                        _ = stop.cancelled() => break None,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        };
        if !stop.is_cancelled() {
            tracing::info!(resource = %cfg.resource, socket = %sock.display(), "registered with the kubelet");
            metrics.registrations.inc();
            metrics.registered.store(true, Ordering::Release);
            // Until the kubelet restarts, our socket goes, or we stop.
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(cfg.watch_interval) => {}
                }
                let kubelet_now = identity(&kubelet_sock);
                if kubelet_now.is_none() || kubelet_now != registered_with || identity(&sock) != mine {
                    tracing::info!("the kubelet restarted or our socket went: registering again");
                    break;
                }
            }
            metrics.registered.store(false, Ordering::Release);
        }
        session.cancel();
        match server.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "the plugin's gRPC server failed"),
            Err(e) => tracing::warn!(error = %e, "the plugin's gRPC server panicked"),
            Ok(Ok(())) => {}
        }
        if identity(&sock) == mine {
            let _ = std::fs::remove_file(&sock);
        }
        if !stop.is_cancelled() {
            // The kubelet is restarting: give it a moment to create its socket.
            tokio::time::sleep(cfg.watch_interval).await;
        }
    }
    Ok(())
}
