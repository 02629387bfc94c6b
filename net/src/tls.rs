//! TLS on dpukv's connections (rustls, the `ring` provider): certificates and keys from PEM
//! files, **re-read when they change** — new handshakes use the new files, connections already
//! open keep going — and, with a CA given to a server and `client_auth`, mutual TLS (a peer must
//! present a certificate the CA signed).
//!
//! - Async servers take a [`ServerTls`] and [`ServerTls::accept`] each TCP connection; async
//!   clients a [`ClientTls`] and [`ClientTls::connect`]. Both yield a [`Stream`] (plain or TLS,
//!   one type for the code above). [`accept_peer`] also says who the peer is (a
//!   [`Peer`](crate::identity::Peer): its certificate's identity, checked against the server's
//!   own — module `identity`).
//! - Blocking code (replication runs on threads with `std::net`) uses
//!   [`ServerTls::accept_blocking`] and [`ClientTls::connect_blocking`]: they return one end of a
//!   local socket pair whose other end two threads pump through the TLS session, so the code
//!   above keeps reading and writing a plain stream, with its own threads and timeouts.
//! - A server that asks for client certificates ([`ClientAuth::Optional`] or
//!   [`ClientAuth::Required`]) must itself hold a certificate naming a dpukv identity: it
//!   places its peers in its cluster by it. A certificate without one does not load.
//!
//! Reloading: a thread per loaded configuration looks at the files' modification times every
//! [`RELOAD_EVERY`]; when one changed and the files load, the configuration is swapped; when they
//! do not load (a half-written file), the one in force stays and the error is logged. The thread
//! ends once its configuration is dropped.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use crate::identity::{Identity, IdentityError, Peer};
use dpukv_fabric::FabricStream;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How often certificate files are checked for changes.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// How long a handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds no usable PEM item of the kind needed.
    #[error("{path}: {what}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// rustls refused the configuration (a key that does not match its certificate, ...).
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// A server that checks its peers' identities holds a certificate naming none.
    #[error("{path}: {source} (a server that asks for client certificates needs one: docs/security.md)")]
    Identity {
        /// The certificate file.
        path: PathBuf,
        /// Why it names none.
        source: IdentityError,
    },
}

/// Where a process's certificate, key and CA are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA (PEM) that signs the peers' certificates: what clients trust, and what servers
    /// check client certificates against.
    pub ca: Option<PathBuf>,
}

/// TLS flags every process takes (`--tls-cert`, `--tls-key`, `--tls-ca`, `--tls-client-auth`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// This process's certificate chain (PEM). With `--tls-key`, its listeners speak TLS only
    /// (and it presents this certificate to the peers it connects to).
    #[arg(long, env = "DPUKV_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "DPUKV_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) that signs the cluster's certificates: trusted when connecting to peers, and
    /// the one client certificates must chain to with `--tls-client-auth`.
    #[arg(long, env = "DPUKV_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Require a client certificate signed by `--tls-ca` on this process's listeners (mutual TLS).
    #[arg(long, env = "DPUKV_TLS_CLIENT_AUTH")]
    pub tls_client_auth: bool,
}

/// What `{node}` in a certificate or key path stands for: the node's id.
pub const NODE_PLACEHOLDER: &str = "{node}";

impl TlsArgs {
    /// The flags with `{node}` in the certificate and key paths replaced by `node` (one Secret
    /// holds every node's pair: `--tls-cert /etc/dpukv/tls/node-{node}.crt`). A path with
    /// `{node}` needs the id (`--node-id` or `--node-index`).
    pub fn for_node(&self, node: Option<u32>) -> Result<TlsArgs, String> {
        let subst = |p: &Option<PathBuf>| -> Result<Option<PathBuf>, String> {
            let Some(p) = p else { return Ok(None) };
            let Some(text) = p.to_str() else { return Ok(Some(p.clone())) };
            if !text.contains(NODE_PLACEHOLDER) {
                return Ok(Some(p.clone()));
            }
            match node {
                Some(n) => Ok(Some(PathBuf::from(text.replace(NODE_PLACEHOLDER, &n.to_string())))),
                None => Err(format!("{text}: {NODE_PLACEHOLDER} needs the node's id (--node-id or --node-index)")),
            }
        };
        Ok(TlsArgs {
            tls_cert: subst(&self.tls_cert)?,
            tls_key: subst(&self.tls_key)?,
            tls_ca: self.tls_ca.clone(),
            tls_client_auth: self.tls_client_auth,
        })
    }

    /// The files, if TLS is on (both a certificate and a key); checks the flags go together.
    pub fn files(&self) -> Result<Option<TlsFiles>, String> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                if self.tls_client_auth && self.tls_ca.is_none() {
                    return Err("--tls-client-auth needs --tls-ca (the CA client certificates must chain to)".into());
                }
                Ok(Some(TlsFiles { cert: cert.clone(), key: key.clone(), ca: self.tls_ca.clone() }))
            }
            (None, None) if !self.tls_client_auth => Ok(None),
            (None, None) => Err("--tls-client-auth needs --tls-cert and --tls-key".into()),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
    }

    /// The server side, if TLS is on.
    pub fn server(&self) -> Result<Option<Arc<ServerTls>>, String> {
        match self.files()? {
            Some(f) => ServerTls::load(&f, self.tls_client_auth).map(Some).map_err(|e| e.to_string()),
            None => Ok(None),
        }
    }

    /// The server side with client certificates asked for but not required (a listener that
    /// also takes other credentials: the host's control API), if TLS is on.
    pub fn server_optional_auth(&self) -> Result<Option<Arc<ServerTls>>, String> {
        match self.files()? {
            Some(f) if f.ca.is_some() => {
                ServerTls::load_with(&f, ClientAuth::Optional).map(Some).map_err(|e| e.to_string())
            }
            Some(_) => Err("a listener that checks client certificates needs --tls-ca".into()),
            None => Ok(None),
        }
    }

    /// The client side (to connect to peers), if TLS is on: trusting `--tls-ca`, presenting this
    /// process's certificate.
    pub fn client(&self) -> Result<Option<Arc<ClientTls>>, String> {
        match self.files()? {
            Some(f) => {
                let Some(ca) = f.ca.clone() else {
                    return Err("TLS to peers needs --tls-ca (the CA that signs their certificates)".into());
                };
                ClientTls::load(&ca, Some((&f.cert, &f.key))).map(Some).map_err(|e| e.to_string())
            }
            None => Ok(None),
        }
    }
}

/// TLS flags of a client (`dpukv`, `dpukv-bench`): the CA to trust, and a certificate to present
/// to servers that ask for one.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClientTlsArgs {
    /// Speak TLS, trusting this CA (PEM).
    #[arg(id = "tls_ca", long = "tls-ca", env = "DPUKV_TLS_CA", global = true)]
    pub ca: Option<PathBuf>,
    /// A certificate chain (PEM) to present (servers with client authentication ask).
    #[arg(id = "tls_cert", long = "tls-cert", env = "DPUKV_TLS_CERT", global = true, requires = "tls_key")]
    pub cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(id = "tls_key", long = "tls-key", env = "DPUKV_TLS_KEY", global = true, requires = "tls_cert")]
    pub key: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// The client side, if TLS is asked for.
    pub fn client(&self) -> Result<Option<Arc<ClientTls>>, String> {
        match (&self.ca, &self.cert, &self.key) {
            (Some(ca), Some(c), Some(k)) => ClientTls::load(ca, Some((c, k))).map(Some).map_err(|e| e.to_string()),
            (Some(ca), None, None) => ClientTls::load(ca, None).map(Some).map_err(|e| e.to_string()),
            (None, None, None) => Ok(None),
            (None, _, _) => Err("--tls-cert and --tls-key need --tls-ca (the CA to trust)".into()),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem { path: path.to_path_buf(), what: format!("not PEM certificates: {e}") })?;
    if certs.is_empty() {
        return Err(TlsError::Pem { path: path.to_path_buf(), what: "no certificate in the file".into() });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| TlsError::Pem { path: path.to_path_buf(), what: format!("no usable private key: {e}") })
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for c in certs(path)? {
        store.add(c).map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            what: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(store)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The latest modification time among `paths` (None if one cannot be read).
fn stamp(paths: &[PathBuf]) -> Option<Vec<SystemTime>> {
    paths.iter().map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()).collect()
}

/// Re-loads with `load` whenever one of `paths` changes, into `slot`, until it is dropped.
fn watch<T: Send + Sync + 'static>(
    slot: Weak<RwLock<Arc<T>>>,
    paths: Vec<PathBuf>,
    load: impl Fn() -> Result<T, TlsError> + Send + 'static,
) {
    let spawned = std::thread::Builder::new().name("dpukv-tls-reload".into()).spawn(move || {
        let mut seen = stamp(&paths);
        loop {
            std::thread::sleep(RELOAD_EVERY);
            let Some(slot) = slot.upgrade() else { return };
            let now = stamp(&paths);
            if now == seen {
                continue;
            }
            match load() {
                Ok(c) => {
                    *slot.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(c);
                    seen = now;
                    tracing::info!(files = ?paths, "reloaded the TLS certificates");
                }
                // Maybe a file half written: try again at the next look (seen is not updated).
                Err(e) => {
                    tracing::error!(error = %e, "the TLS files changed but do not load; keeping the ones in force")
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "starting the TLS reload thread failed: certificates will not be re-read");
    }
}

/// Whether a server asks its clients for certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// No (clients prove themselves otherwise: tokens).
    None,
    /// Asked for, not required: a client without one is served as [`Peer::Anonymous`].
    Optional,
    /// Required: mutual TLS (a client without a certificate the CA signed is refused).
    Required,
}

/// What a server's configuration holds: the rustls configuration and the identity its own
/// certificate names.
#[derive(Debug)]
struct ServerLoaded {
    config: Arc<ServerConfig>,
    own: Option<Identity>,
}

/// A server's TLS configuration, kept current (see the module documentation).
#[derive(Debug)]
pub struct ServerTls {
    current: Arc<RwLock<Arc<ServerLoaded>>>,
}

impl ServerTls {
    /// Loads `files`; with `client_auth`, clients must present a certificate signed by `files.ca`.
    pub fn load(files: &TlsFiles, client_auth: bool) -> Result<Arc<ServerTls>, TlsError> {
        ServerTls::load_with(files, if client_auth { ClientAuth::Required } else { ClientAuth::None })
    }

    /// Loads `files`, asking clients for certificates signed by `files.ca` as `auth` says. A
    /// server that asks must hold a certificate naming a dpukv identity (see the module
    /// documentation).
    pub fn load_with(files: &TlsFiles, auth: ClientAuth) -> Result<Arc<ServerTls>, TlsError> {
        let build = {
            let files = files.clone();
            move || -> Result<ServerLoaded, TlsError> {
                let builder = ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
                let builder = match (&files.ca, auth) {
                    (Some(ca), ClientAuth::Required | ClientAuth::Optional) => {
                        let v = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots(ca)?));
                        let v = if auth == ClientAuth::Optional { v.allow_unauthenticated() } else { v };
                        let verifier = v
                            .build()
                            .map_err(|e| TlsError::Pem { path: ca.clone(), what: format!("client verifier: {e}") })?;
                        builder.with_client_cert_verifier(verifier)
                    }
                    _ => builder.with_no_client_auth(),
                };
                let chain = certs(&files.cert)?;
                let own = match Identity::from_certificate(&chain[0]) {
                    Ok(id) => Some(id),
                    Err(source) if auth != ClientAuth::None => {
                        return Err(TlsError::Identity { path: files.cert.clone(), source });
                    }
                    Err(_) => None,
                };
                let config = builder.with_single_cert(chain, key(&files.key)?)?;
                Ok(ServerLoaded { config: Arc::new(config), own })
            }
        };
        let current = Arc::new(RwLock::new(Arc::new(build()?)));
        let mut paths = vec![files.cert.clone(), files.key.clone()];
        paths.extend(files.ca.clone());
        watch(Arc::downgrade(&current), paths, build);
        Ok(Arc::new(ServerTls { current }))
    }

    fn loaded(&self) -> Arc<ServerLoaded> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.loaded().config.clone()
    }

    /// The identity the certificate in force names (None: it names none).
    pub fn own_identity(&self) -> Option<Identity> {
        self.loaded().own.clone()
    }

    /// Who the peer of `stream` (accepted by this server) is.
    pub fn peer(&self, stream: &Stream) -> Peer {
        let certs = match stream {
            Stream::Server(s) => s.get_ref().1.peer_certificates(),
            Stream::FabricServer(s) => s.get_ref().1.peer_certificates(),
            _ => return Peer::Unchecked,
        };
        Peer::of(self.loaded().own.as_ref(), certs.and_then(|c| c.first()).map(|c| c.as_ref()))
    }

    /// Runs the handshake on an accepted connection (within [`HANDSHAKE_TIMEOUT`]).
    pub async fn accept(&self, tcp: TcpStream) -> std::io::Result<Stream> {
        self.handshake(tcp).await.map(|s| Stream::Server(Box::new(s)))
    }

    /// [`ServerTls::accept`] on an accepted fabric connection.
    pub async fn accept_fabric(&self, fabric: FabricStream) -> std::io::Result<Stream> {
        self.handshake(fabric).await.map(|s| Stream::FabricServer(Box::new(s)))
    }

    async fn handshake<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: IO,
    ) -> std::io::Result<tokio_rustls::server::TlsStream<IO>> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config());
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
            Ok(r) => r,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// [`ServerTls::accept`] for blocking code: the handshake runs here; the plain end of a
    /// local socket pair comes back (see the module documentation), with who the peer is.
    pub fn accept_blocking(&self, tcp: std::net::TcpStream) -> std::io::Result<(UnixStream, Peer)> {
        let loaded = self.loaded();
        let conn = rustls::ServerConnection::new(loaded.config.clone()).map_err(std::io::Error::other)?;
        let (stream, cert) = bridge(rustls::Connection::Server(conn), tcp)?;
        Ok((stream, Peer::of(loaded.own.as_ref(), cert.as_deref())))
    }
}

/// A client's TLS configuration, kept current (see the module documentation).
#[derive(Debug)]
pub struct ClientTls {
    current: Arc<RwLock<Arc<ClientConfig>>>,
}

impl ClientTls {
    /// Trusts the certificates `ca` signs; presents `identity` (certificate chain, key) if given
    /// (for servers that ask: mutual TLS).
    pub fn load(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<Arc<ClientTls>, TlsError> {
        let (ca, identity) = (ca.to_path_buf(), identity.map(|(c, k)| (c.to_path_buf(), k.to_path_buf())));
        let build = {
            let (ca, identity) = (ca.clone(), identity.clone());
            move || -> Result<ClientConfig, TlsError> {
                let builder = ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(roots(&ca)?);
                Ok(match &identity {
                    Some((c, k)) => builder.with_client_auth_cert(certs(c)?, key(k)?)?,
                    None => builder.with_no_client_auth(),
                })
            }
        };
        let current = Arc::new(RwLock::new(Arc::new(build()?)));
        let mut paths = vec![ca];
        if let Some((c, k)) = identity {
            paths.extend([c, k]);
        }
        watch(Arc::downgrade(&current), paths, build);
        Ok(Arc::new(ClientTls { current }))
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<ClientConfig> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Runs the handshake on a connection to `addr` (`host:port`: the certificate must name the
    /// host, an IP address or a DNS name), within [`HANDSHAKE_TIMEOUT`].
    pub async fn connect(&self, tcp: TcpStream, addr: &str) -> std::io::Result<Stream> {
        self.handshake(tcp, addr).await.map(|s| Stream::Client(Box::new(s)))
    }

    /// [`ClientTls::connect`] on an established fabric connection to `addr` (`host:port`).
    pub async fn connect_fabric(&self, fabric: FabricStream, addr: &str) -> std::io::Result<Stream> {
        self.handshake(fabric, addr).await.map(|s| Stream::FabricClient(Box::new(s)))
    }

    async fn handshake<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: IO,
        addr: &str,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<IO>> {
        let name = server_name(addr)?;
        let connector = tokio_rustls::TlsConnector::from(self.config());
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, io)).await {
            Ok(r) => r,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// [`ClientTls::connect`] for blocking code: the plain end of a local socket pair comes back
    /// once the handshake is done (see the module documentation).
    /// `addr` is what was dialled (`host:port`): its host is the name the server's certificate
    /// must carry (a DNS name, or an IP address).
    pub fn connect_blocking(&self, tcp: std::net::TcpStream, addr: &str) -> std::io::Result<UnixStream> {
        let name = server_name(addr)?;
        let conn = rustls::ClientConnection::new(self.config(), name).map_err(std::io::Error::other)?;
        bridge(rustls::Connection::Client(conn), tcp).map(|(s, _)| s)
    }
}

/// The name a certificate must carry for `addr` (`host:port`).
fn server_name(addr: &str) -> std::io::Result<ServerName<'static>> {
    let host = match addr.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => addr,
    };
    ServerName::try_from(host.to_string()).map_err(|e| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host:?} as a TLS server name: {e}"))
    })
}

/// Completes the handshake of `conn` on `tcp` (blocking, within [`HANDSHAKE_TIMEOUT`]), then
/// pumps between the TLS session and a new local socket pair; returns the pair's other end and
/// the first certificate the peer presented (DER), if any. Two
/// threads pump: one reads the network and hands the plaintext on, one reads the plaintext and
/// sends it encrypted. The session is locked only while records are processed or produced; the
/// socket's write side has a lock of its own, taken before the session's is let go, so records
/// leave in the order they were sealed, and no lock is held across a blocking read. Either side
/// closing closes the other.
fn bridge(
    mut conn: rustls::Connection,
    mut tcp: std::net::TcpStream,
) -> std::io::Result<(UnixStream, Option<Vec<u8>>)> {
    use std::sync::Mutex;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)?;
    }
    tcp.set_read_timeout(None)?;
    let peer_cert = conn.peer_certificates().and_then(|c| c.first()).map(|c| c.to_vec());
    // Plaintext the handshake's last read brought along: a peer may send data right behind its
    // Finished, in the same segment. It is handed on first — else it would sit in the session
    // while the pump waits for bytes the peer will not send until it is answered.
    let (mut early, mut early_eof) = (Vec::new(), false);
    let mut chunk = [0u8; 16 << 10];
    loop {
        match conn.reader().read(&mut chunk) {
            Ok(0) => {
                early_eof = true;
                break;
            }
            Ok(m) => early.extend_from_slice(&chunk[..m]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    let (local, remote) = UnixStream::pair()?;
    let conn = Arc::new(Mutex::new(conn));
    let wire = Arc::new(Mutex::new(tcp.try_clone()?));
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Seals what the session wants to send and writes it, in order (see above).
    fn flush(conn: &Mutex<rustls::Connection>, wire: &Mutex<std::net::TcpStream>, plain: &[u8]) -> std::io::Result<()> {
        let mut sealed = Vec::with_capacity(plain.len() + 64);
        let mut c = lock(conn);
        if !plain.is_empty() {
            c.writer().write_all(plain)?;
        }
        while c.wants_write() {
            c.write_tls(&mut sealed)?;
        }
        let mut w = lock(wire);
        drop(c);
        w.write_all(&sealed)
    }
    // Network -> plaintext.
    let (mut net_in, mut out, c1, w1) = (tcp.try_clone()?, remote.try_clone()?, conn.clone(), wire.clone());
    std::thread::Builder::new().name("dpukv-tls-in".into()).spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        let mut plain = vec![0u8; 64 << 10];
        let go_on = out.write_all(&early).is_ok() && !early_eof;
        'pump: loop {
            if !go_on {
                break;
            }
            let n = match net_in.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut chunks: Vec<Vec<u8>> = Vec::new();
            let owed = {
                let mut c = lock(&c1);
                let mut rd = &buf[..n];
                while !rd.is_empty() {
                    if c.read_tls(&mut rd).is_err() || c.process_new_packets().is_err() {
                        break 'pump;
                    }
                    // Take the plaintext out before feeding more: rustls holds a bounded amount.
                    loop {
                        match c.reader().read(&mut plain) {
                            Ok(0) => break,
                            Ok(m) => chunks.push(plain[..m].to_vec()),
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(_) => break 'pump,
                        }
                    }
                }
                c.wants_write()
            };
            // Alerts or session tickets the peer is owed.
            if owed && flush(&c1, &w1, &[]).is_err() {
                break;
            }
            for ch in chunks {
                if out.write_all(&ch).is_err() {
                    break 'pump;
                }
            }
        }
        // The peer stopped sending (or the connection broke): the local side reads its end.
        let _ = out.shutdown(std::net::Shutdown::Write);
        let _ = net_in.shutdown(std::net::Shutdown::Read);
    })?;
    // Plaintext -> network.
    let (mut inp, c2, w2) = (remote, conn, wire);
    std::thread::Builder::new().name("dpukv-tls-out".into()).spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match inp.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if flush(&c2, &w2, &buf[..n]).is_err() {
                break;
            }
        }
        // The local side stopped sending: so does the session (the other direction goes on
        // until the peer closes it).
        lock(&c2).send_close_notify();
        let _ = flush(&c2, &w2, &[]);
        let _ = lock(&w2).shutdown(std::net::Shutdown::Write);
    })?;
    drop(tcp);
    Ok((local, peer_cert))
}

/// A connection over TCP or a libfabric endpoint, plain or TLS (one type for the code above).
pub enum Stream {
    /// TCP, no TLS.
    Plain(TcpStream),
    /// A server's end of a TLS session over TCP.
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    /// A client's end of a TLS session over TCP.
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// A fabric connection, no TLS.
    Fabric(Box<FabricStream>),
    /// A server's end of a TLS session over a fabric connection.
    FabricServer(Box<tokio_rustls::server::TlsStream<FabricStream>>),
    /// A client's end of a TLS session over a fabric connection.
    FabricClient(Box<tokio_rustls::client::TlsStream<FabricStream>>),
}

/// Runs `$e` on the stream inside whichever variant `$s` is.
macro_rules! each {
    ($s:expr, $io:ident => $e:expr) => {
        match $s.get_mut() {
            Stream::Plain($io) => {
                let $io = Pin::new($io);
                $e
            }
            Stream::Server($io) => {
                let $io = Pin::new($io.as_mut());
                $e
            }
            Stream::Client($io) => {
                let $io = Pin::new($io.as_mut());
                $e
            }
            Stream::Fabric($io) => {
                let $io = Pin::new($io.as_mut());
                $e
            }
            Stream::FabricServer($io) => {
                let $io = Pin::new($io.as_mut());
                $e
            }
            Stream::FabricClient($io) => {
                let $io = Pin::new($io.as_mut());
                $e
            }
        }
    };
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        each!(self, io => io.poll_read(cx, buf))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        each!(self, io => io.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        each!(self, io => io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        each!(self, io => io.poll_shutdown(cx))
    }
}

/// Why a TLS peer refused this end, if `e` says it did: a fatal alert it sent (a certificate it
/// wanted and did not get, or did not trust) or a certificate this end did not trust. Such a
/// connection never carried a request, and trying again will not help.
pub fn refusal(e: &std::io::Error) -> Option<String> {
    let inner = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    match inner {
        rustls::Error::AlertReceived(a) => Some(format!("the server refused the TLS session ({a:?})")),
        rustls::Error::InvalidCertificate(c) => Some(format!("the server's certificate is not trusted ({c:?})")),
        rustls::Error::NoCertificatesPresented => Some("the server presented no certificate".into()),
        _ => None,
    }
}

/// Whether `bytes` (what a server sent first) look like a TLS record: a plain client reached a
/// TLS listener.
pub fn looks_like_tls(bytes: &[u8]) -> bool {
    matches!(bytes, [0x14..=0x17, 0x03, 0x00..=0x04, ..])
}

/// Accepts with TLS when `tls` is given (else plainly): what every async listener does.
pub async fn accept(tls: Option<&ServerTls>, tcp: TcpStream) -> std::io::Result<Stream> {
    match tls {
        Some(t) => t.accept(tcp).await,
        None => Ok(Stream::Plain(tcp)),
    }
}

/// [`accept_peer`] for a fabric connection: established first (within [`HANDSHAKE_TIMEOUT`]:
/// providers with manual progress finish the connection's handshake only when this end drives
/// it), then TLS when `tls` is given.
pub async fn accept_fabric_peer(tls: Option<&ServerTls>, fabric: FabricStream) -> std::io::Result<(Stream, Peer)> {
    fabric.established(HANDSHAKE_TIMEOUT).await.map_err(std::io::Error::other)?;
    match tls {
        Some(t) => {
            let s = t.accept_fabric(fabric).await?;
            let peer = t.peer(&s);
            Ok((s, peer))
        }
        None => Ok((Stream::Fabric(Box::new(fabric)), Peer::Unchecked)),
    }
}

/// [`accept`], and who the peer is ([`Peer::Unchecked`] without TLS): what a listener that
/// checks its callers' roles does.
pub async fn accept_peer(tls: Option<&ServerTls>, tcp: TcpStream) -> std::io::Result<(Stream, Peer)> {
    match tls {
        Some(t) => {
            let s = t.accept(tcp).await?;
            let peer = t.peer(&s);
            Ok((s, peer))
        }
        None => Ok((Stream::Plain(tcp), Peer::Unchecked)),
    }
}

/// Makes a CA and one certificate signed by it for `hosts` (IP addresses or DNS names; the
/// certificate serves as a server's and as a client's, for mutual TLS) naming `identity` (a URI
/// SAN), written to `dir` as `ca.pem`, `cert.pem` and `key.pem` (the key readable by its owner
/// only): for tests. Not for production: use your own CA there.
#[cfg(any(test, feature = "local-ca"))]
pub fn make_local_ca(dir: &Path, hosts: &[&str], identity: Option<&Identity>) -> Result<TlsFiles, String> {
    let ca = LocalCa::new()?;
    let files = TlsFiles { cert: dir.join("cert.pem"), key: dir.join("key.pem"), ca: Some(dir.join("ca.pem")) };
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    ca.issue(hosts, identity, &files)?;
    ca.write_ca(&dir.join("ca.pem"))?;
    Ok(files)
}

/// A CA held in memory (its key is never written): issues certificates for local clusters and
/// tests (see [`make_local_ca`]).
#[cfg(any(test, feature = "local-ca"))]
pub struct LocalCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

#[cfg(any(test, feature = "local-ca"))]
impl LocalCa {
    /// A new CA with a new key.
    pub fn new() -> Result<LocalCa, String> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let e = |e: rcgen::Error| e.to_string();
        let key = KeyPair::generate().map_err(e)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        ca.distinguished_name.push(DnType::CommonName, "dpukv local CA");
        let pem = ca.self_signed(&key).map_err(e)?.pem();
        Ok(LocalCa { issuer: rcgen::Issuer::new(ca, key), pem })
    }

    /// Writes the CA's certificate (PEM) to `path`.
    pub fn write_ca(&self, path: &Path) -> Result<(), String> {
        std::fs::write(path, &self.pem).map_err(|e| e.to_string())
    }

    /// Writes a new certificate and key signed by this CA for `hosts`, naming `identity` (its
    /// URI SAN) if given, into `files` (replacing them atomically: a reloading process never
    /// reads half a file).
    pub fn issue(&self, hosts: &[&str], identity: Option<&Identity>, files: &TlsFiles) -> Result<(), String> {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose, SanType};
        let e = |e: rcgen::Error| e.to_string();
        let key = KeyPair::generate().map_err(e)?;
        let mut leaf = CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>()).map_err(e)?;
        if let Some(id) = identity {
            leaf.subject_alt_names.push(SanType::URI(id.uri().try_into().map_err(e)?));
        }
        leaf.distinguished_name.push(DnType::CommonName, hosts.first().copied().unwrap_or("dpukv"));
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = leaf.signed_by(&key, &self.issuer).map_err(e)?;
        let write = |path: &Path, text: &str, private: bool| -> Result<(), String> {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, text).map_err(|e| e.to_string())?;
            if private {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map_err(|e| e.to_string())?;
            }
            std::fs::rename(&tmp, path).map_err(|e| e.to_string())
        };
        write(&files.key, &key.serialize_pem(), true)?;
        write(&files.cert, &cert.pem(), false)
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener as StdListener;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::identity::Role;

    fn node(id: u32) -> Identity {
        Identity::new("local", "test", Role::Node, &id.to_string()).expect("identity")
    }

    /// A server that echoes what it reads, with `tls`; its address.
    async fn echo_server(tls: Arc<ServerTls>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = l.accept().await else { return };
                let tls = tls.clone();
                tokio::spawn(async move {
                    let Ok(mut s) = tls.accept(tcp).await else { return };
                    let mut buf = vec![0u8; 4096];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                        let _ = s.flush().await;
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut Stream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg).await?;
        s.flush().await?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await?;
        Ok(got)
    }

    fn peer_cert(s: &Stream) -> Vec<u8> {
        match s {
            Stream::Client(t) => t.get_ref().1.peer_certificates().expect("a peer certificate")[0].to_vec(),
            _ => panic!("a client stream"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mutual_tls_holds_and_refuses_strangers_and_plaintext() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = make_local_ca(&dir.path().join("a"), &["127.0.0.1"], Some(&node(1))).expect("CA a");
        let other = make_local_ca(&dir.path().join("b"), &["127.0.0.1"], Some(&node(1))).expect("CA b");
        let server = ServerTls::load(&files, true).expect("server");
        let addr = echo_server(server).await;
        let ca = files.ca.clone().expect("ca");
        // A client of the same CA, with its certificate: served.
        let ok = ClientTls::load(&ca, Some((&files.cert, &files.key))).expect("client");
        let mut s = ok.connect(TcpStream::connect(&addr).await.expect("tcp"), &addr).await.expect("handshake");
        assert_eq!(round_trip(&mut s, b"hello").await.expect("echo"), b"hello");
        // Trusting another CA: the server's certificate is refused.
        let stranger = ClientTls::load(other.ca.as_deref().expect("ca"), None).expect("client");
        assert!(stranger.connect(TcpStream::connect(&addr).await.expect("tcp"), &addr).await.is_err());
        // Without a client certificate (mutual TLS asked): refused — at the handshake or at the
        // first read (TLS 1.3 servers judge the certificate after the client's Finished).
        let anon = ClientTls::load(&ca, None).expect("client");
        match anon.connect(TcpStream::connect(&addr).await.expect("tcp"), &addr).await {
            Err(_) => {}
            Ok(mut s) => assert!(round_trip(&mut s, b"x").await.is_err(), "a client without a certificate"),
        }
        // A certificate from another CA: refused likewise.
        let forged = ClientTls::load(&ca, Some((&other.cert, &other.key))).expect("client");
        match forged.connect(TcpStream::connect(&addr).await.expect("tcp"), &addr).await {
            Err(_) => {}
            Ok(mut s) => assert!(round_trip(&mut s, b"x").await.is_err(), "a client certificate of another CA"),
        }
        // Plaintext: the server closes the connection; nothing is echoed.
        let mut plain = TcpStream::connect(&addr).await.expect("tcp");
        plain.write_all(b"GET / HTTP/1.0\r\n\r\n").await.expect("write");
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut got)).await;
        assert!(!got.windows(3).any(|w| w == b"GET"), "plaintext is never served");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn certificates_rotate_without_dropping_open_connections() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = make_local_ca(dir.path(), &["127.0.0.1"], Some(&node(1))).expect("CA");
        let server = ServerTls::load(&files, false).expect("server");
        let addr = echo_server(server).await;
        let client = ClientTls::load(files.ca.as_deref().expect("ca"), None).expect("client");
        let mut open = client.connect(TcpStream::connect(&addr).await.expect("tcp"), &addr).await.expect("handshake");
        let first = peer_cert(&open);
        // A new certificate from the same CA (its key is gone: re-sign with a new CA key would
        // need clients to trust it; here the CA is made again from the same files' issuer).
        let ca_dir = dir.path().join("ca2");
        let rotated = make_local_ca(&ca_dir, &["127.0.0.1"], None).expect("new CA");
        std::fs::copy(&rotated.cert, &files.cert).expect("cert");
        std::fs::copy(&rotated.key, &files.key).expect("key");
        std::fs::copy(rotated.ca.as_deref().expect("ca"), files.ca.as_deref().expect("ca")).expect("ca");
        let new_client = ClientTls::load(files.ca.as_deref().expect("ca"), None).expect("client");
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        let fresh = loop {
            if let Ok(s) = new_client.connect(TcpStream::connect(&addr).await.expect("tcp"), &addr).await {
                break s;
            }
            assert!(std::time::Instant::now() < deadline, "the new certificate was never served");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_ne!(peer_cert(&fresh), first, "new handshakes get the new certificate");
        // The connection opened before still works.
        assert_eq!(round_trip(&mut open, b"still here").await.expect("echo"), b"still here");
    }

    #[test]
    fn the_blocking_bridge_carries_both_directions_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = make_local_ca(dir.path(), &["127.0.0.1"], Some(&node(1))).expect("CA");
        let server = ServerTls::load(&files, true).expect("server");
        let client =
            ClientTls::load(files.ca.as_deref().expect("ca"), Some((&files.cert, &files.key))).expect("client");
        let l = StdListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let srv = std::thread::spawn(move || {
            let (tcp, _) = l.accept().expect("accept");
            let (mut s, _) = server.accept_blocking(tcp).expect("handshake");
            // Echo everything back while the client is still writing.
            let mut r = s.try_clone().expect("clone");
            let mut buf = vec![0u8; 8192];
            loop {
                let n = r.read(&mut buf).expect("read");
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).expect("write");
            }
        });
        let tcp = std::net::TcpStream::connect(addr).expect("tcp");
        let mut s = client.connect_blocking(tcp, &addr.to_string()).expect("handshake");
        let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i % 251) as u8).collect();
        let mut w = s.try_clone().expect("clone");
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            w.write_all(&sent).expect("write");
            w.shutdown(std::net::Shutdown::Write).expect("shutdown");
        });
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("read");
        writer.join().expect("writer");
        assert!(got == data, "8 MiB echoed through two bridges, in order");
        drop(s);
        srv.join().expect("server");
    }

    /// A client that writes right behind its Finished (rustls sends data queued during the
    /// handshake in the same flight): the server's bridge must hand it on although it arrived
    /// with the handshake's last read. Without that, the data sits in the session and both sides
    /// wait for each other (what a replication Hello did under load).
    #[test]
    fn data_arriving_with_the_handshake_is_handed_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = make_local_ca(dir.path(), &["127.0.0.1"], Some(&node(1))).expect("CA");
        let server = ServerTls::load(&files, false).expect("server");
        let client = ClientTls::load(files.ca.as_deref().expect("ca"), None).expect("client");
        let l = StdListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let srv = std::thread::spawn(move || {
            let (tcp, _) = l.accept().expect("accept");
            // The client's Finished and its data are both here before the handshake reads.
            std::thread::sleep(Duration::from_millis(300));
            let (mut s, _) = server.accept_blocking(tcp).expect("handshake");
            s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            let mut got = [0u8; 5];
            s.read_exact(&mut got).map(|_| got)
        });
        let mut tcp = std::net::TcpStream::connect(addr).expect("tcp");
        let name = ServerName::IpAddress(addr.ip().into());
        let mut conn = rustls::ClientConnection::new(client.config(), name).expect("client session");
        conn.writer().write_all(b"hello").expect("queue early data");
        while conn.is_handshaking() || conn.wants_write() {
            conn.complete_io(&mut tcp).expect("handshake");
        }
        let got = srv.join().expect("server").expect("the early data reaches the server's reader");
        assert_eq!(&got, b"hello");
    }

    /// The server knows its own identity and its peers': a member of its cluster by its
    /// certificate's URI SAN, a stranger of another cluster, anonymous without a certificate
    /// (optional client authentication), and the same through the blocking bridge. A server
    /// that asks for client certificates does not load a certificate naming no identity.
    #[test]
    fn servers_know_who_their_peers_are() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = LocalCa::new().expect("CA");
        let ca_pem = dir.path().join("ca.pem");
        ca.write_ca(&ca_pem).expect("CA");
        let issue = |name: &str, id: Option<Identity>| {
            let f = TlsFiles {
                cert: dir.path().join(format!("{name}.pem")),
                key: dir.path().join(format!("{name}.key")),
                ca: Some(ca_pem.clone()),
            };
            ca.issue(&["127.0.0.1"], id.as_ref(), &f).expect("issue");
            f
        };
        let server = issue("server", Some(node(1)));
        let gateway = issue("gateway", Some(Identity::new("local", "test", Role::Gateway, "gw").expect("id")));
        let stranger = issue("stranger", Some(Identity::new("local", "other", Role::Admin, "x").expect("id")));
        let nameless = issue("nameless", None);
        assert!(
            matches!(ServerTls::load(&nameless, true), Err(TlsError::Identity { .. })),
            "a server checking peers needs an identity"
        );
        assert!(ServerTls::load(&nameless, false).is_ok(), "one that does not, does not");
        let tls = ServerTls::load_with(&server, ClientAuth::Optional).expect("server");
        assert_eq!(tls.own_identity(), Some(node(1)));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let peer_of = |client: Option<&TlsFiles>| -> Peer {
            let identity = client.map(|f| (f.cert.as_path(), f.key.as_path()));
            // Through the blocking bridge.
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = l.local_addr().expect("addr").to_string();
            let c = ClientTls::load(&ca_pem, identity).expect("client");
            let t = std::thread::spawn(move || {
                let tcp = std::net::TcpStream::connect(&addr).expect("tcp");
                let mut s = c.connect_blocking(tcp, &addr).expect("handshake");
                s.write_all(b"x").expect("write");
                let mut b = [0u8; 1];
                s.read_exact(&mut b).expect("read");
            });
            let (tcp, _) = l.accept().expect("accept");
            let (mut s, peer) = tls.accept_blocking(tcp).expect("handshake");
            let mut b = [0u8; 1];
            s.read_exact(&mut b).expect("read");
            s.write_all(b"y").expect("write");
            t.join().expect("client");
            // Through the async accept.
            let c = ClientTls::load(&ca_pem, identity).expect("client");
            let peer_async = rt.block_on(async {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
                let addr = l.local_addr().expect("addr").to_string();
                let connect = tokio::spawn(async move {
                    let tcp = TcpStream::connect(&addr).await.expect("tcp");
                    let mut s = c.connect(tcp, &addr).await.expect("handshake");
                    s.write_all(b"x").await.expect("write");
                    s.flush().await.expect("flush");
                    let mut b = [0u8; 1];
                    s.read_exact(&mut b).await.expect("read");
                });
                let (tcp, _) = l.accept().await.expect("accept");
                let (mut s, peer) = accept_peer(Some(&tls), tcp).await.expect("handshake");
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await.expect("read");
                s.write_all(b"y").await.expect("write");
                s.flush().await.expect("flush");
                connect.await.expect("client");
                peer
            });
            assert_eq!(peer, peer_async, "the blocking and the async accept agree");
            peer
        };
        let gw = Identity::new("local", "test", Role::Gateway, "gw").expect("id");
        assert_eq!(peer_of(Some(&gateway)), Peer::Member(gw));
        assert!(matches!(peer_of(Some(&stranger)), Peer::Stranger(_)));
        assert!(matches!(peer_of(Some(&nameless)), Peer::Unrecognized(_)));
        assert_eq!(peer_of(None), Peer::Anonymous);
    }

    #[test]
    fn node_placeholders_are_replaced_by_the_node_id() {
        let args = TlsArgs {
            tls_cert: Some("/etc/dpukv/tls/node-{node}.crt".into()),
            tls_key: Some("/etc/dpukv/tls/node-{node}.key".into()),
            tls_ca: Some("/etc/dpukv/tls/ca.crt".into()),
            tls_client_auth: true,
        };
        let a = args.for_node(Some(3)).expect("replaced");
        assert_eq!(a.tls_cert.as_deref(), Some(Path::new("/etc/dpukv/tls/node-3.crt")));
        assert_eq!(a.tls_key.as_deref(), Some(Path::new("/etc/dpukv/tls/node-3.key")));
        assert_eq!(a.tls_ca.as_deref(), Some(Path::new("/etc/dpukv/tls/ca.crt")));
        assert!(args.for_node(None).is_err(), "{{node}} without an id");
        assert_eq!(TlsArgs::default().for_node(None).expect("no TLS").tls_cert, None);
    }
}
