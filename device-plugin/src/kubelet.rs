//! Talking to the kubelet: gRPC over a unix socket (a tonic channel whose connector dials the
//! socket), and `Register` — the plugin's API version, its socket's name in the kubelet's
//! directory, its resource name and options.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::api::RegisterRequest;
use crate::api::registration_client::RegistrationClient;

/// The API version this plugin speaks.
pub const API_VERSION: &str = "v1beta1";

/// The kubelet's directory of device plugin sockets.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

/// The kubelet's registration socket's name in that directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// Why registering failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The kubelet's socket could not be reached.
    #[error("cannot reach the kubelet at {path}: {source}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The kubelet refused (a version it does not support, a resource name taken).
    #[error("the kubelet refused the registration: {0}")]
    Refused(#[from] tonic::Status),
}

/// A gRPC channel to the unix socket at `path` (the URI is a placeholder: the connector dials
/// the socket).
pub async fn channel(path: &Path, timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    Endpoint::from_static("http://[::1]:1")
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}

/// Registers the plugin serving on `endpoint` (a socket name in the kubelet's directory) for
/// `resource` with the kubelet at `kubelet_socket`.
pub async fn register(kubelet_socket: &Path, endpoint: &str, resource: &str) -> Result<(), RegisterError> {
    let ch = channel(kubelet_socket, Duration::from_secs(5))
        .await
        .map_err(|source| RegisterError::Connect { path: kubelet_socket.to_path_buf(), source })?;
    RegistrationClient::new(ch)
        .register(RegisterRequest {
            version: API_VERSION.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: Some(crate::plugin::options()),
        })
        .await?;
    Ok(())
}
