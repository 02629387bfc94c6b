//! Command-line configuration of the two node binaries (flags with environment fallbacks).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use dpukv_storage::vlog::FsyncPolicy;

use std::time::Duration;

use crate::conn::ConnConfig;
use crate::dpu::DeviceConfig;
use crate::host::HostConfig;
use crate::regions::RegionMap;

pub use dpukv_net::conn::ConnArgs;
pub use dpukv_net::tls::TlsArgs;

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).min(MAX_READ_THREADS)
}

/// Most reader threads per process: every reader thread holds a reader slot in each arena (128
/// per arena), shared by the host's and the device's readers and the readers of tools.
pub const MAX_READ_THREADS: usize = 48;

fn read_threads(n: usize) -> Result<usize> {
    if !(1..=MAX_READ_THREADS).contains(&n) {
        bail!("--read-threads must be 1..={MAX_READ_THREADS} (each holds a reader slot in every arena)");
    }
    Ok(n)
}

/// Parses `always`, `never` or `interval:MS` (MS >= 1).
pub fn parse_fsync(s: &str) -> Result<FsyncPolicy> {
    FsyncPolicy::parse(s).map_err(|e| anyhow::anyhow!("--fsync: {e}"))
}

/// `dpukv-node` flags.
#[derive(Debug, clap::Parser)]
#[command(name = "dpukv-node", version, about = "dpukv host: regions, writes, atomics")]
pub struct HostArgs {
    /// Durable data directory.
    #[arg(long, env = "DPUKV_DATA_DIR")]
    pub data_dir: PathBuf,
    /// Shared memory directory (arenas; shared with the device).
    #[arg(long, env = "DPUKV_SHM_DIR")]
    pub shm_dir: PathBuf,
    /// Region split keys, comma separated (UTF-8); none = one region.
    #[arg(long, env = "DPUKV_SPLIT_KEYS", default_value = "")]
    pub split_keys: String,
    /// The first layout as a number of regions, split evenly over the first two bytes of the
    /// key space (instead of `--split-keys`; 1 = one region).
    #[arg(long, env = "DPUKV_REGIONS", default_value_t = 1)]
    pub regions: u32,
    /// Log durability: `always` (a write is acknowledged once synced), `interval:MS`
    /// (acknowledged once written to the OS, synced within MS) or `never`.
    #[arg(long, env = "DPUKV_FSYNC", default_value = "always")]
    pub fsync: String,
    /// L0 budget per region in bytes (0 = sized to the pod's memory: an eighth of the memory
    /// limit and at most a quarter of the shared directory's file system, shared among the
    /// regions, within 64 MiB..4 GiB).
    #[arg(long, env = "DPUKV_L0_BUDGET", default_value_t = 0)]
    pub l0_budget: u64,
    /// Admin HTTP address (/healthz, /readyz, /metrics; read-only, plain HTTP).
    #[arg(long, env = "DPUKV_ADMIN")]
    pub admin: Option<SocketAddr>,
    /// The control API's address (`/cluster/*`: drain, step-down, split, merge, summary; a
    /// cluster's host only). With TLS (`--tls-*`) it speaks HTTPS and serves callers with a
    /// certificate of role `operator` or `admin` of this cluster, or the token of
    /// `--admin-token-file`; without TLS it is plain HTTP (bind it to loopback or a trusted
    /// network). The address `dpukv cluster` finds in the region map.
    #[arg(long, env = "DPUKV_CONTROL_LISTEN")]
    pub control_listen: Option<SocketAddr>,
    /// A file with a bearer token (16 to 4096 bytes; surrounding white space ignored) the
    /// control API accepts too (`Authorization: Bearer ...`); re-read when it changes.
    #[arg(long, env = "DPUKV_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Most device connections.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Baseline for benchmarks: execute every atomic as its own read-modify-write and log append.
    #[arg(long)]
    pub no_reservation_station: bool,
    /// Reader threads for reads that reach the host (the --serve-reads-on-host baseline).
    #[arg(long, default_value_t = 2)]
    pub read_threads: usize,
    /// Connection limits.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Cluster membership (without `--cluster`: a standalone node).
    #[command(flatten)]
    pub cluster: ClusterFlags,
    /// TLS on the replication links (the host's listener, and its connections to backups) and
    /// the control API. `{node}` in the certificate and key paths is replaced by the node id.
    /// With TLS, `--tls-client-auth` is required: replication is taken only from the node the
    /// region map names (docs/security.md).
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// Flags of a host that is a member of a cluster.
#[derive(Debug, clap::Args)]
pub struct ClusterFlags {
    /// The cluster's name: with it, the node joins the cluster in etcd (`--etcd`) and serves
    /// the regions the region map gives it; `--split-keys` is then the first layout's.
    #[arg(long, env = "DPUKV_CLUSTER")]
    pub cluster: Option<String>,
    /// This node's id in the cluster (unique, not 0).
    #[arg(long, env = "DPUKV_NODE_ID", conflicts_with = "node_index")]
    pub node_id: Option<u32>,
    /// This node's index from 0 (its id is the index + 1): what a Kubernetes StatefulSet gives
    /// each pod (its ordinal, the `apps.kubernetes.io/pod-index` label).
    #[arg(long, env = "DPUKV_NODE_INDEX")]
    pub node_index: Option<u32>,
    /// etcd client URLs, comma separated (`https://` with `--etcd-ca`).
    #[arg(long, env = "DPUKV_ETCD", default_value = "http://127.0.0.1:2379")]
    pub etcd: String,
    /// etcd's CA (PEM): TLS to etcd, whose certificate must chain to it.
    #[arg(long, env = "DPUKV_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// A client certificate (PEM) for etcd (`--client-cert-auth`), with `--etcd-key`; re-read
    /// when it changes.
    #[arg(long, env = "DPUKV_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// The etcd client certificate's key (PEM).
    #[arg(long, env = "DPUKV_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// Where this host accepts replication connections from primaries.
    #[arg(long, env = "DPUKV_REPLICATION_LISTEN", default_value = "0.0.0.0:7071")]
    pub replication_listen: SocketAddr,
    /// The address clients reach this node's device at (as registered).
    #[arg(long, env = "DPUKV_ADVERTISE_DEVICE")]
    pub advertise_device: Option<String>,
    /// The address primaries reach this host's replication port at (default: the listen
    /// address).
    #[arg(long, env = "DPUKV_ADVERTISE_REPLICATION")]
    pub advertise_replication: Option<String>,
    /// Where clients reach this node's device over libfabric (`fabric://PROVIDER/HOST:PORT`:
    /// its `--fabric-listen`, as reachable), registered in the region map: clients that dial
    /// the cluster over the fabric route to it there.
    #[arg(long, env = "DPUKV_ADVERTISE_FABRIC")]
    pub advertise_fabric: Option<String>,
    /// Failure domain (replicas of a region go to different zones when zones are given).
    #[arg(long, env = "DPUKV_ZONE", default_value = "")]
    pub zone: String,
    /// Without `--zone`: a directory holding one file per Kubernetes node, named by the node,
    /// holding its zone (the operator's `NAME-zones` ConfigMap, mounted); this host's file is
    /// `--k8s-node`'s.
    #[arg(long, env = "DPUKV_ZONE_DIR")]
    pub zone_dir: Option<PathBuf>,
    /// The Kubernetes node this pod runs on (the downward API's `spec.nodeName`).
    #[arg(long, env = "DPUKV_K8S_NODE")]
    pub k8s_node: Option<String>,
    /// How long (s) to wait for this node's zone file to appear (a ConfigMap volume is updated
    /// a while after the operator writes a new node's zone) before registering without a zone.
    #[arg(long, env = "DPUKV_ZONE_WAIT_SECS", default_value_t = 90)]
    pub zone_wait_secs: u64,
    /// Node lease TTL in milliseconds (failover takes about this long; etcd's minimum is 1.5 ×
    /// its election timeout).
    #[arg(long, env = "DPUKV_LEASE_TTL_MS", default_value_t = 2000)]
    pub lease_ttl_ms: u64,
    /// Replicas per region, for the cluster's first configuration.
    #[arg(long, env = "DPUKV_REPLICATION_FACTOR", default_value_t = 3)]
    pub replication_factor: usize,
    /// How long a write waits for its backups before its outcome is declared unknown (ms).
    #[arg(long, env = "DPUKV_REPLICATION_TIMEOUT_MS", default_value_t = 5000)]
    pub replication_timeout_ms: u64,
    /// A backup or joining node that takes no log for this long (ms) while writes wait — a full
    /// disk, a one-way partition, a stuck process — is reported to the master, which takes it
    /// out of the region's write set; writes go on with fewer copies. Must be below
    /// `--replication-timeout-ms`, so writes waiting for it are acknowledged, not timed out;
    /// 0: never (a stuck backup then holds up its regions' writes until its lease ends).
    #[arg(long, env = "DPUKV_STALL_TIMEOUT_MS", default_value_t = 2000)]
    pub stall_timeout_ms: u64,
    /// A copy of a region this node stops backing (its lease lapsed, a move was cancelled) is
    /// kept aside this long (s): given the region back, the node resumes from its own log —
    /// streamed only what it lacks — instead of being copied again. 0: deleted at once.
    #[arg(long, env = "DPUKV_RETAIN_COPIES_SECS", default_value_t = 600)]
    pub retain_copies_secs: u64,
    /// On SIGTERM (a pod deleted or evicted), wait up to this long (s) for this node's
    /// primaries to move to backups elsewhere before stopping: writers see a handover, not a
    /// failover. 0: stop at once (the regions fail over when the lease ends).
    #[arg(long, env = "DPUKV_LEAVE_TIMEOUT_SECS", default_value_t = 20)]
    pub leave_timeout_secs: u64,
    /// A primary keeps up to this much of its log (MiB per region) from garbage collection
    /// while a backup is behind, or for 10 minutes after one left the region: such a backup
    /// resumes from its own copy. Further behind, it is copied again. 0: nothing kept.
    #[arg(long, env = "DPUKV_RETAIN_LOG_MIB", default_value_t = 1024)]
    pub retain_log_mib: u64,
    /// How backups index their copies, for the cluster's first configuration: `send` (Send
    /// Index: they install the primary's compaction outputs) or `build` (Build Index: they
    /// replay their log copies and compact themselves — the baseline).
    #[arg(long, env = "DPUKV_BACKUP_INDEX", default_value = "send", value_parser = ["send", "build"])]
    pub backup_index: String,
    /// Most MiB per second this node sends, over all its senders, to backups that are catching
    /// up (copying the log they missed, or the whole index); 0: no cap. Steady replication is
    /// never slowed.
    #[arg(long, env = "DPUKV_CATCH_UP_MIB_PER_SEC", default_value_t = 128)]
    pub catch_up_mib_per_sec: u64,
    /// Most MiB per second this node uploads to backup locations, over all its uploads, while
    /// its writers are not busy (docs/backup.md §3); 0: no cap.
    #[arg(long, env = "DPUKV_BACKUP_MIB_PER_SEC", default_value_t = 200)]
    pub backup_mib_per_sec: u64,
    /// Most MiB per second this node uploads to backup locations while its writers apply more
    /// than 100 writes a second: a backup then takes longer instead of slowing the writes
    /// (docs/backup.md §3); never above `--backup-mib-per-sec`; 0: that cap.
    #[arg(long, env = "DPUKV_BACKUP_BUSY_MIB_PER_SEC", default_value_t = 20)]
    pub backup_busy_mib_per_sec: u64,
    /// Split a region past this estimated size in bytes, for the cluster's first configuration
    /// (0: never by size).
    #[arg(long, env = "DPUKV_SPLIT_BYTES", default_value_t = dpukv_cluster::keys::DEFAULT_SPLIT_BYTES)]
    pub split_bytes: u64,
    /// Split a region taking more writes per second than this, for the cluster's first
    /// configuration (0: never by load).
    #[arg(long, env = "DPUKV_SPLIT_WRITES_PER_SEC", default_value_t = 0)]
    pub split_writes_per_sec: u64,
    /// Merge neighbouring regions both smaller than this many bytes (and placed alike), for the
    /// cluster's first configuration (0: only on request, `dpukv cluster merge`).
    #[arg(long, env = "DPUKV_MERGE_BYTES", default_value_t = 0)]
    pub merge_bytes: u64,
}

/// The node id `--node-id` or `--node-index` give (None: neither).
fn node_id_of(id: Option<u32>, index: Option<u32>) -> Result<Option<u32>> {
    match id.or(index.and_then(|i| i.checked_add(1))) {
        Some(0) => bail!("--node-id must not be 0"),
        other => Ok(other),
    }
}

/// The TLS flags with `{node}` replaced; with TLS, client certificates must be required, and
/// the process's own certificate must name node `node` (when known) — a certificate of another
/// node or role would make it refuse its peers or be refused by them.
fn node_tls(tls: &TlsArgs, node: Option<u32>, what: &str) -> Result<TlsArgs> {
    let tls = tls.for_node(node).map_err(anyhow::Error::msg)?;
    if tls.files().map_err(anyhow::Error::msg)?.is_some() && !tls.tls_client_auth {
        bail!(
            "with TLS, {what} needs --tls-client-auth: it checks its callers' roles by their certificates              (docs/security.md)"
        );
    }
    Ok(tls)
}

/// Checks that `server`'s certificate names node `node`.
fn check_own_identity(server: &dpukv_net::tls::ServerTls, node: Option<u32>) -> Result<()> {
    use dpukv_net::identity::Role;
    let own = server.own_identity();
    match (&own, node) {
        (Some(id), Some(n)) if id.role == Role::Node && id.node_id() == Some(n) => Ok(()),
        (Some(id), None) if id.role == Role::Node => Ok(()),
        (Some(id), _) => bail!(
            "this process's certificate names {id}, not node {}: give each node its own (node-{{node}} paths)",
            node.map_or("?".into(), |n| n.to_string())
        ),
        (None, _) => bail!("this process's certificate names no spiffe://dpukv/... identity"),
    }
}

/// Checks that the front door's certificate names a gateway of the cluster `node` (the node's
/// own identity) belongs to: a node's certificate would be refused by the devices it forwards to,
/// and another cluster's would be a stranger there.
fn check_front_identity(front: &dpukv_net::tls::ServerTls, node: Option<&dpukv_net::identity::Identity>) -> Result<()> {
    use dpukv_net::identity::Role;
    let Some(id) = front.own_identity() else {
        bail!("the front door's certificate (--front-tls-cert) names no spiffe://dpukv/... identity");
    };
    if id.role != Role::Gateway {
        bail!("the front door's certificate (--front-tls-cert) names {id}: it must be a gateway's");
    }
    if let Some(n) = node
        && (n.namespace != id.namespace || n.cluster != id.cluster)
    {
        bail!("the front door's certificate names {id}, of another cluster than this node's ({n})");
    }
    Ok(())
}

impl ClusterFlags {
    /// This node's id, if given.
    fn node_id(&self) -> Result<Option<u32>> {
        node_id_of(self.node_id, self.node_index)
    }

    /// How to reach etcd.
    fn etcd_options(&self) -> Result<dpukv_cluster::EtcdOptions> {
        let etcd: Vec<String> = self.etcd.split(',').filter(|u| !u.is_empty()).map(str::to_string).collect();
        if etcd.is_empty() {
            bail!("--etcd names no URL");
        }
        let opts = dpukv_cluster::EtcdOptions::new(etcd);
        let tls = match (&self.etcd_ca, &self.etcd_cert, &self.etcd_key) {
            (None, None, None) => return Ok(opts),
            (Some(ca), Some(c), Some(k)) => dpukv_net::tls::ClientTls::load(ca, Some((c, k))),
            (Some(ca), None, None) => dpukv_net::tls::ClientTls::load(ca, None),
            (None, _, _) => bail!("--etcd-cert and --etcd-key need --etcd-ca"),
            _ => bail!("--etcd-cert and --etcd-key go together"),
        }
        .map_err(|e| anyhow::anyhow!("TLS to etcd: {e}"))?;
        Ok(opts.with_tls(dpukv_cluster::EtcdTls::new(move || tls.config())))
    }

    fn config(
        &self,
        split_keys: &[Vec<u8>],
        advertise_admin: Option<SocketAddr>,
        tls: &TlsArgs,
    ) -> Result<Option<crate::host::cluster::ClusterArgs>> {
        let Some(name) = &self.cluster else { return Ok(None) };
        let Some(node_id) = self.node_id()? else {
            bail!("--cluster needs --node-id (unique in the cluster, not 0) or --node-index");
        };
        let Some(device) = self.advertise_device.clone() else {
            bail!("--cluster needs --advertise-device (where clients reach this node's device)");
        };
        if let Some(f) = &self.advertise_fabric {
            dpukv_net::fabric::FabricAddr::parse(f).map_err(|e| anyhow::anyhow!("--advertise-fabric: {e}"))?;
        }
        let etcd = self.etcd_options()?;
        if self.stall_timeout_ms >= self.replication_timeout_ms {
            bail!(
                "--stall-timeout-ms ({}) must be below --replication-timeout-ms ({}), or 0 (never)",
                self.stall_timeout_ms,
                self.replication_timeout_ms
            );
        }
        Ok(Some(crate::host::cluster::ClusterArgs {
            name: name.clone(),
            node_id,
            etcd,
            replication_listen: self.replication_listen,
            advertise_device: device,
            advertise_replication: self
                .advertise_replication
                .clone()
                .unwrap_or_else(|| self.replication_listen.to_string()),
            advertise_admin: advertise_admin.map(|a| a.to_string()).unwrap_or_default(),
            advertise_fabric: self.advertise_fabric.clone().unwrap_or_default(),
            zone: self.zone.clone(),
            zone_file: match (&self.zone_dir, &self.k8s_node) {
                (Some(d), Some(n)) if self.zone.is_empty() && !n.is_empty() => Some(d.join(n)),
                _ => None,
            },
            zone_wait: Duration::from_secs(self.zone_wait_secs),
            lease_ttl: Duration::from_millis(self.lease_ttl_ms.max(100)),
            bootstrap: dpukv_cluster::keys::ClusterConfig {
                backup_index: if self.backup_index == "build" {
                    dpukv_cluster::keys::BackupIndex::Build
                } else {
                    dpukv_cluster::keys::BackupIndex::Send
                },
                split_bytes: self.split_bytes,
                split_writes_per_sec: self.split_writes_per_sec,
                merge_bytes: self.merge_bytes,
                ..dpukv_cluster::keys::ClusterConfig::new(self.replication_factor.max(1), split_keys.to_vec())
            },
            replication_timeout: Duration::from_millis(self.replication_timeout_ms.max(1)),
            stall_timeout: (self.stall_timeout_ms > 0).then(|| Duration::from_millis(self.stall_timeout_ms)),
            retain_copies: Duration::from_secs(self.retain_copies_secs),
            leave_timeout: Duration::from_secs(self.leave_timeout_secs),
            retain_log: self.retain_log_mib.saturating_mul(1 << 20),
            catch_up: crate::replication::CatchUpCap::new(self.catch_up_mib_per_sec.saturating_mul(1 << 20)),
            backup_rate: self.backup_mib_per_sec.saturating_mul(1 << 20),
            backup_busy_rate: self.backup_busy_mib_per_sec.saturating_mul(1 << 20),
            tls_server: match tls.server().map_err(anyhow::Error::msg)? {
                Some(server) => {
                    check_own_identity(&server, Some(node_id))?;
                    Some(server)
                }
                None => None,
            },
            tls_client: tls.client().map_err(anyhow::Error::msg)?,
        }))
    }
}

impl HostArgs {
    /// The validated configuration.
    pub fn config(&self) -> Result<HostConfig> {
        // Table sets record these paths for the device, as text.
        for (flag, p) in [("--data-dir", &self.data_dir), ("--shm-dir", &self.shm_dir)] {
            if p.to_str().is_none() {
                bail!("{flag} must be a UTF-8 path: {}", p.display());
            }
        }
        let mut keys: Vec<Vec<u8>> =
            self.split_keys.split(',').filter(|k| !k.is_empty()).map(|k| k.as_bytes().to_vec()).collect();
        if self.regions > 1 {
            if !keys.is_empty() {
                bail!("give --regions or --split-keys, not both");
            }
            keys = even_split_keys(self.regions)?;
        }
        let tls = node_tls(&self.tls, self.cluster.node_id()?, "a host")?;
        let control = match self.control_listen {
            None if self.admin_token_file.is_some() => bail!("--admin-token-file needs --control-listen"),
            None => None,
            Some(_) if self.cluster.cluster.is_none() => bail!("--control-listen needs --cluster"),
            Some(listen) => {
                let token = match &self.admin_token_file {
                    Some(p) => Some(Arc::new(crate::control::AdminToken::load(p)?)),
                    None => None,
                };
                let tls = tls.server_optional_auth().map_err(anyhow::Error::msg)?;
                if let Some(t) = &tls {
                    check_own_identity(t, self.cluster.node_id()?)?;
                }
                Some(crate::control::ControlConfig { listen, tls, token })
            }
        };
        Ok(HostConfig {
            data_dir: self.data_dir.clone(),
            shm_dir: self.shm_dir.clone(),
            regions: RegionMap::split_at(&keys)?,
            fsync: parse_fsync(&self.fsync)?,
            l0_budget: self.l0_budget,
            admin: self.admin,
            max_connections: self.max_connections.max(1),
            per_op_atomics: self.no_reservation_station,
            // The host's peers are the device's few long-lived links: an idle link is not a
            // client to shed, and closing one races with a write being forwarded on it.
            conn: ConnConfig {
                idle_timeout: Duration::from_secs(365 * 24 * 3600),
                ..self.conn.config().map_err(anyhow::Error::msg)?
            },
            memory_budget: self.conn.memory_budget,
            read_threads: read_threads(self.read_threads)?,
            shutdown_grace: Duration::from_secs(self.conn.shutdown_grace),
            cluster: self.cluster.config(&keys, self.control_listen.or(self.admin), &tls)?,
            control,
        })
    }
}

/// `dpukv-dpu` flags.
#[derive(Debug, clap::Parser)]
#[command(name = "dpukv-dpu", version, about = "dpukv device: the data port; reads from host memory")]
pub struct DeviceArgs {
    /// Shared memory directory the host publishes into.
    #[arg(long, env = "DPUKV_SHM_DIR")]
    pub shm_dir: PathBuf,
    /// Data port.
    #[arg(long, env = "DPUKV_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Forward reads to the host as well (the baseline for benchmarks).
    #[arg(long)]
    pub serve_reads_on_host: bool,
    /// Admin HTTP address.
    #[arg(long, env = "DPUKV_DEVICE_ADMIN")]
    pub admin: Option<SocketAddr>,
    /// The DPUs this container was given (the device plugin's `DPUKV_DEVICE_IDS`: card slots,
    /// comma-separated); each is checked at start in `--device-dir`.
    #[arg(long, env = "DPUKV_DEVICE_IDS", default_value = "")]
    pub device_ids: String,
    /// Refuse to start without a DPU given and present (`Device` mode: the operator sets it) —
    /// a pod that got none would otherwise run as an emulator unnoticed.
    #[arg(long, env = "DPUKV_REQUIRE_DEVICE", default_value_t = false, action = clap::ArgAction::Set)]
    pub require_device: bool,
    /// Where the device plugin mounts the given functions' sysfs directories (`/<address>`).
    #[arg(long, env = "DPUKV_DEVICE_DIR", default_value = "/run/dpukv/devices")]
    pub device_dir: PathBuf,
    /// Most client connections (more are closed at once).
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Reader threads: the device's cores (default: one per CPU).
    #[arg(long, default_value_t = default_threads())]
    pub read_threads: usize,
    /// Links to the host, shared by all client connections.
    #[arg(long, default_value_t = 2)]
    pub host_links: usize,
    /// Seconds a forwarded write may wait for the host's reply before its outcome is reported
    /// unknown.
    #[arg(long, default_value_t = 30)]
    pub host_timeout: u64,
    /// On SIGTERM, go on serving while this pod's host still runs — it leaves first, handing
    /// its primaries over (`dpukv-node --leave-timeout-secs`) — up to this long (s); then stop.
    #[arg(long, env = "DPUKV_DEVICE_LEAVE_TIMEOUT_SECS", default_value_t = 25)]
    pub leave_timeout_secs: u64,
    /// Connection limits.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// TLS on the data port: `--tls-client-auth` is required with it; each request is checked
    /// against the role its caller's certificate names (docs/security.md). `{node}` in the
    /// certificate and key paths is replaced by the node id.
    #[command(flatten)]
    pub tls: TlsArgs,
    /// This node's id (for `{node}` in certificate paths; checked against its certificate).
    #[arg(long, env = "DPUKV_NODE_ID", conflicts_with = "node_index")]
    pub node_id: Option<u32>,
    /// This node's index from 0 (its id is the index + 1), as a StatefulSet pod's ordinal.
    #[arg(long, env = "DPUKV_NODE_INDEX")]
    pub node_index: Option<u32>,
    /// Hot keys: most popular keys per led region, replicated to its backups' devices (0: none).
    #[arg(long, env = "DPUKV_POPULAR_CAPACITY", default_value_t = 10_000)]
    pub popular_capacity: usize,
    /// Hot keys: reads of a key within the window that make it popular (hKVS's K).
    #[arg(long, env = "DPUKV_POPULAR_K", default_value_t = 4)]
    pub popular_k: u32,
    /// Hot keys: the reads the admission window spans (hKVS's N).
    #[arg(long, env = "DPUKV_POPULAR_WINDOW", default_value_t = 100_000)]
    pub popular_window: usize,
    /// Hot keys: when a region's popular set is full, admit a key only if the window saw it more
    /// often than the key it would evict (`false`: the paper's plain LRU, every qualifying key
    /// evicts the least recently read one).
    #[arg(long, env = "DPUKV_POPULAR_GATE", default_value_t = true, action = clap::ArgAction::Set)]
    pub popular_gate: bool,
    /// Hot keys: milliseconds between syncs (and watermarks) to replicas.
    #[arg(long, env = "DPUKV_REPLICA_SYNC_INTERVAL_MS", default_value_t = 10)]
    pub replica_sync_interval_ms: u64,
    /// Hot keys: sync requests a backup's link may hold queued or unanswered.
    #[arg(long, default_value_t = 64)]
    pub replica_max_outstanding: usize,
    /// Replica table: most copies of other primaries' popular keys.
    #[arg(long, env = "DPUKV_REPLICA_TABLE_KEYS", default_value_t = 100_000)]
    pub replica_table_keys: usize,
    /// Replica table: most MiB of keys and values.
    #[arg(long, default_value_t = 64)]
    pub replica_table_mib: usize,
    /// Replica table: a copy whose primary has not vouched for it this long (ms) is not served.
    #[arg(long, env = "DPUKV_REPLICA_MAX_LAG_MS", default_value_t = 1000)]
    pub replica_max_lag_ms: u64,
    /// How far apart the nodes' clocks may be (ms): added to a copy's age.
    #[arg(long, env = "DPUKV_MAX_CLOCK_SKEW_MS", default_value_t = 5)]
    pub max_clock_skew_ms: u64,
    /// The front door: serve the Redis protocol here, in this process — this node's regions
    /// with no second hop, other keys forwarded to their nodes (the gateway's RESP front end,
    /// docs/gateway.md).
    #[arg(long, env = "DPUKV_DEVICE_RESP")]
    pub resp: Option<SocketAddr>,
    /// The front door: serve HTTP/JSON here (as `--resp`; the gateway's HTTP front end).
    #[arg(long, env = "DPUKV_DEVICE_HTTP")]
    pub http: Option<SocketAddr>,
    /// The front door's bearer tokens (the gateway's `--tokens` file; or DPUKV_TOKENS). Without
    /// them the front door is open.
    #[arg(long, env = "DPUKV_TOKENS_FILE")]
    pub tokens: Option<PathBuf>,
    /// Threads the front door runs on (each its own event loop; clients spread among them).
    #[arg(long, env = "DPUKV_FRONT_THREADS", default_value_t = 1)]
    pub front_threads: usize,
    /// The front door's certificate chain (PEM) when the data port speaks TLS: a gateway's
    /// identity of this cluster (`spiffe://dpukv/<namespace>/<cluster>/gateway/<name>`), presented
    /// to the front door's clients and, with mutual TLS, to the devices it forwards to — the
    /// node's own certificate may not read or write at other devices (docs/security.md).
    /// `{node}` is replaced by the node id. The CA is `--tls-ca`.
    #[arg(long, env = "DPUKV_FRONT_TLS_CERT")]
    pub front_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "DPUKV_FRONT_TLS_KEY")]
    pub front_tls_key: Option<PathBuf>,
    /// Also serve the binary protocol on a libfabric endpoint here (`host:port`, port 0: any
    /// free one), beside the data port: RDMA NICs through `verbs`, or the `tcp` provider. Same
    /// requests, limits, roles and TLS as the data port (docs/protocol.md, "Transports").
    #[arg(long, env = "DPUKV_FABRIC_LISTEN")]
    pub fabric_listen: Option<SocketAddr>,
    /// The libfabric provider of `--fabric-listen` (`verbs`, `tcp`, `efa`, ...; empty:
    /// libfabric's first choice for connected message endpoints, `fi_info -t FI_EP_MSG`).
    #[arg(long, env = "DPUKV_FABRIC_PROVIDER", default_value = "")]
    pub fabric_provider: String,
}

impl DeviceArgs {
    /// The front door's configuration (None: no `--resp` or `--http`): the gateway's defaults,
    /// no binary front end (the data port is one), these ports and tokens. With TLS on the data
    /// port (`data`: its server side, already loaded; `ca` its CA), the front door speaks TLS too,
    /// with a gateway certificate of this cluster of its own ([`DeviceArgs::front_tls_cert`]).
    fn front_door(
        &self,
        data: Option<&dpukv_net::tls::ServerTls>,
        ca: Option<PathBuf>,
        node: Option<u32>,
    ) -> Result<Option<dpukv_gateway::GatewayConfig>> {
        if self.resp.is_none() && self.http.is_none() {
            if self.front_tls_cert.is_some() || self.front_tls_key.is_some() {
                bail!("--front-tls-cert and --front-tls-key are the front door's: give --resp or --http");
            }
            return Ok(None);
        }
        // No fat root: its start hints save the device's work by spending the caller's, and
        // here both are this process.
        let mut args = vec!["dpukv-dpu".into(), "--seeds".into(), dpukv_client::LOCAL_SEED.into()];
        args.extend(["--fat-root".into(), "0".into()]);
        if let Some(t) = &self.tokens {
            args.push("--tokens".into());
            args.push(t.as_os_str().to_owned());
        }
        let mut cfg = <dpukv_gateway::config::GatewayArgs as clap::Parser>::try_parse_from(args)?.config()?;
        (cfg.listen, cfg.resp, cfg.http) = (None, self.resp, self.http);
        // TLS as given here, never from the gateway's environment variables (in this process
        // DPUKV_TLS_CERT names the node's certificate).
        (cfg.tls_server, cfg.tls_client) = (None, None);
        let front = TlsArgs {
            tls_cert: self.front_tls_cert.clone(),
            tls_key: self.front_tls_key.clone(),
            tls_ca: ca,
            tls_client_auth: false,
        }
        .for_node(node)
        .map_err(anyhow::Error::msg)?;
        match (data, front.files().map_err(anyhow::Error::msg)?.is_some()) {
            (None, false) => {}
            (None, true) => bail!(
                "--front-tls-cert: the front door speaks TLS when the data port does (--tls-cert, --tls-key, \
                 --tls-client-auth)"
            ),
            (Some(_), false) => bail!(
                "with TLS on the data port, the front door (--resp, --http) needs --front-tls-cert and \
                 --front-tls-key: a gateway certificate of this cluster (it forwards other nodes' keys to \
                 their devices, where a node's certificate may not read or write; docs/security.md)"
            ),
            (Some(data), true) => {
                let server = front.server().map_err(anyhow::Error::msg)?.context("the front door's TLS")?;
                check_front_identity(&server, data.own_identity().as_ref())?;
                cfg.tls_server = Some(server);
                cfg.tls_client = front.client().map_err(anyhow::Error::msg)?;
            }
        }
        Ok(Some(cfg))
    }

    /// The validated configuration.
    pub fn config(&self) -> Result<DeviceConfig> {
        if self.host_timeout == 0 {
            bail!("--host-timeout must be positive");
        }
        check_devices(&self.device_ids, &self.device_dir, self.require_device)?;
        let node = node_id_of(self.node_id, self.node_index)?;
        let tls = node_tls(&self.tls, node, "a device")?;
        let server = tls.server().map_err(anyhow::Error::msg)?;
        if let Some(s) = &server {
            check_own_identity(s, node)?;
        }
        let front = self.front_door(server.as_deref(), tls.tls_ca.clone(), node)?;
        Ok(DeviceConfig {
            shm_dir: self.shm_dir.clone(),
            listen: self.listen,
            serve_reads_on_host: self.serve_reads_on_host,
            admin: self.admin,
            max_connections: self.max_connections.max(1),
            conn: self.conn.config().map_err(anyhow::Error::msg)?,
            memory_budget: self.conn.memory_budget,
            read_threads: read_threads(self.read_threads)?,
            host_links: self.host_links.max(1),
            host_timeout: Duration::from_secs(self.host_timeout),
            leave_timeout: Duration::from_secs(self.leave_timeout_secs),
            shutdown_grace: Duration::from_secs(self.conn.shutdown_grace),
            tls: server,
            hot: crate::dpu::hot_keys::HotKeysConfig {
                popularity: crate::popular::PopularityConfig {
                    k: self.popular_k.max(1),
                    window: self.popular_window,
                    capacity: self.popular_capacity,
                    gate: self.popular_gate,
                },
                sync_interval: Duration::from_millis(self.replica_sync_interval_ms.max(1)),
                max_outstanding: self.replica_max_outstanding.max(1),
                // Syncs to TLS data ports need `--tls-ca` (without it none are sent, and replicas
                // simply answer nothing: reads go to primaries).
                tls: tls.client().unwrap_or(None),
                max_clock_skew_ms: self.max_clock_skew_ms,
            },
            replica_table: crate::replica_table::ReplicaTableConfig {
                max_keys: self.replica_table_keys,
                max_bytes: self.replica_table_mib << 20,
                max_lag_ms: self.replica_max_lag_ms,
                max_clock_skew_ms: self.max_clock_skew_ms,
            },
            front,
            front_threads: self.front_threads,
            fabric: self.fabric_listen.map(|at| (self.fabric_provider.clone(), at)),
        })
    }
}

/// Checks the DPUs a device container was given: each id (a card's slot, `0000:03:00`) must have
/// at least one function mounted under `dir` (`dir/0000:03:00.0`, with its `vendor` file) — an
/// id whose functions are missing is a device that went away between allocation and start; with
/// `require`, at least one must be given.
pub fn check_devices(ids: &str, dir: &std::path::Path, require: bool) -> Result<Vec<String>> {
    let ids: Vec<String> = ids.split(',').map(str::trim).filter(|i| !i.is_empty()).map(String::from).collect();
    if ids.is_empty() {
        if require {
            bail!(
                "no DPU was given to this container (DPUKV_DEVICE_IDS is empty) and --require-device is set \
                 (device mode Device): is the dpukv device plugin running on this node, and does the pod \
                 ask for its resource?"
            );
        }
        return Ok(ids);
    }
    let mounted: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().filter_map(|e| e.file_name().to_str().map(String::from)).collect())
        .unwrap_or_default();
    for id in &ids {
        let present = mounted
            .iter()
            .filter(|m| m.strip_prefix(id.as_str()).is_some_and(|rest| rest.starts_with('.')))
            .any(|m| dir.join(m).join("vendor").is_file());
        if !present {
            bail!(
                "DPU {id} was given to this container but none of its functions is present under {} \
                 (the device went away, or the device plugin did not mount it)",
                dir.display()
            );
        }
    }
    Ok(ids)
}

/// Split keys for `n` regions of equal shares of the key space, by its first two bytes: region
/// i begins at the two bytes of `i * 65536 / n` (at most 65536 regions).
pub fn even_split_keys(n: u32) -> Result<Vec<Vec<u8>>> {
    if n == 0 || n > 65_536 {
        bail!("--regions must be 1 to 65536, not {n}");
    }
    Ok((1..u64::from(n)).map(|i| (i * 65_536 / u64::from(n)) as u16).map(|v| v.to_be_bytes().to_vec()).collect())
}

pub use dpukv_net::process::shutdown_on_signals;
pub use dpukv_net::telemetry;

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn a_device_checks_the_dpus_it_was_given_and_refuses_to_start_without_one_when_required() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(check_devices("", dir.path(), false).expect("no DPU, none required").is_empty());
        let e = check_devices("", dir.path(), true).expect_err("required").to_string();
        assert!(e.contains("no DPU was given"), "{e}");
        let f = dir.path().join("0000:03:00.1");
        std::fs::create_dir_all(&f).expect("dir");
        std::fs::write(f.join("vendor"), "0x15b3\n").expect("vendor");
        assert_eq!(check_devices("0000:03:00", dir.path(), true).expect("present"), ["0000:03:00"]);
        let e = check_devices("0000:03:00,0000:81:00", dir.path(), true).expect_err("one missing").to_string();
        assert!(e.contains("DPU 0000:81:00 was given") && e.contains("none of its functions"), "{e}");
        // A prefix of another address is not a match.
        assert!(check_devices("0000:03:0", dir.path(), false).is_err());
    }

    #[test]
    fn regions_split_the_key_space_evenly_by_its_first_two_bytes() {
        assert!(even_split_keys(1).expect("one").is_empty());
        assert_eq!(even_split_keys(4).expect("four"), [vec![0x40, 0], vec![0x80, 0], vec![0xc0, 0]]);
        let k = even_split_keys(64).expect("64");
        assert_eq!(k.len(), 63);
        assert!(k.windows(2).all(|w| w[0] < w[1]), "ascending");
        assert!(even_split_keys(0).is_err() && even_split_keys(70_000).is_err());
        let host = |args: &[&str]| {
            let mut argv = vec!["dpukv-node", "--data-dir", "/d", "--shm-dir", "/s"];
            argv.extend_from_slice(args);
            HostArgs::try_parse_from(argv).expect("args").config()
        };
        assert_eq!(host(&["--regions", "8"]).expect("config").regions.regions().len(), 8);
        assert!(host(&["--regions", "8", "--split-keys", "m"]).is_err(), "one or the other");
    }

    fn cluster_of(args: &[&str]) -> Result<Option<crate::host::cluster::ClusterArgs>> {
        let mut argv = vec!["dpukv-node", "--data-dir", "/d", "--shm-dir", "/s", "--cluster", "c"];
        argv.extend_from_slice(args);
        let a = HostArgs::try_parse_from(argv)?;
        a.cluster.config(&[], None, &a.tls)
    }

    #[test]
    fn a_node_index_gives_the_id_after_it() {
        let c = cluster_of(&["--node-index", "0", "--advertise-device", "n-0.n:7070"]).expect("ok").expect("cluster");
        assert_eq!(c.node_id, 1);
        let c = cluster_of(&["--node-id", "7", "--advertise-device", "a:1"]).expect("ok").expect("cluster");
        assert_eq!(c.node_id, 7);
        assert!(cluster_of(&["--node-id", "7", "--node-index", "2", "--advertise-device", "a:1"]).is_err());
        assert!(cluster_of(&["--advertise-device", "a:1"]).is_err(), "neither");
        assert!(cluster_of(&["--node-id", "0", "--advertise-device", "a:1"]).is_err(), "0 is no id");
    }

    /// Each node's host and device take their own certificate by their id (`{node}`), require
    /// client certificates with TLS, and refuse to start with another node's certificate.
    #[test]
    fn each_node_takes_its_own_certificate_by_its_id() {
        use dpukv_net::identity::{Identity, Role};
        use dpukv_net::tls::{LocalCa, TlsFiles};
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = LocalCa::new().expect("CA");
        let ca_pem = dir.path().join("ca.pem");
        ca.write_ca(&ca_pem).expect("CA");
        for id in 1..=2 {
            let f = TlsFiles {
                cert: dir.path().join(format!("node-{id}.pem")),
                key: dir.path().join(format!("node-{id}.key")),
                ca: None,
            };
            let me = Identity::new("local", "c", Role::Node, &id.to_string()).expect("identity");
            ca.issue(&["127.0.0.1"], Some(&me), &f).expect("issue");
        }
        let path = |name: &str| dir.path().join(name).display().to_string();
        let (cert, key, ca_arg) = (path("node-{node}.pem"), path("node-{node}.key"), path("ca.pem"));
        let device = |extra: &[&str], mutual: bool| {
            let mut argv =
                vec!["dpukv-dpu", "--shm-dir", "/s", "--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca_arg];
            if mutual {
                argv.push("--tls-client-auth");
            }
            argv.extend_from_slice(extra);
            DeviceArgs::try_parse_from(argv).expect("flags").config().map(|_| ()).map_err(|e| format!("{e:#}"))
        };
        assert_eq!(device(&["--node-index", "1"], true), Ok(()), "node 2 by its index");
        assert_eq!(device(&["--node-id", "1"], true), Ok(()));
        assert!(device(&["--node-id", "1"], false).expect_err("no client auth").contains("--tls-client-auth"));
        assert!(device(&[], true).expect_err("no id").contains("{node}"));
        assert!(device(&["--node-id", "3"], true).is_err(), "no certificate for node 3");
        // A fixed path to another node's certificate.
        let other = path("node-1.pem");
        let other_key = path("node-1.key");
        let argv = [
            "dpukv-dpu",
            "--shm-dir",
            "/s",
            "--tls-cert",
            &other,
            "--tls-key",
            &other_key,
            "--tls-ca",
            &ca_arg,
            "--tls-client-auth",
            "--node-id",
            "2",
        ];
        let e = DeviceArgs::try_parse_from(argv).expect("flags").config().expect_err("another node's certificate");
        assert!(format!("{e:#}").contains("not node 2"), "{e:#}");
        // A host: its replication listener and control API by its id.
        let host = |extra: &[&str]| {
            let mut argv = vec![
                "dpukv-node",
                "--data-dir",
                "/d",
                "--shm-dir",
                "/s",
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--tls-ca",
                &ca_arg,
                "--tls-client-auth",
            ];
            argv.extend_from_slice(extra);
            HostArgs::try_parse_from(argv).expect("flags").config().map_err(|e| format!("{e:#}"))
        };
        let cluster =
            ["--cluster", "c", "--node-index", "0", "--advertise-device", "a:1", "--control-listen", "127.0.0.1:0"];
        let c = host(&cluster).expect("a host with its control API");
        let control = c.control.expect("control");
        assert_eq!(control.tls.expect("TLS").own_identity().and_then(|i| i.node_id()), Some(1));
        assert!(c.cluster.expect("cluster").tls_server.is_some());
        let standalone = host(&["--node-id", "1", "--control-listen", "127.0.0.1:0"]);
        assert!(standalone.expect_err("no cluster").contains("--control-listen needs --cluster"));
    }

    /// With TLS on the data port, the front door (`--resp`, `--http`) speaks TLS too, with a
    /// gateway certificate of the node's cluster of its own (`{node}` by the id) — presented to
    /// its clients and to the devices it forwards to; it refuses to start without one, with a
    /// node's certificate, or with another cluster's; a front door certificate without TLS on the
    /// data port is refused too.
    #[test]
    fn a_front_door_with_tls_takes_a_gateway_certificate_of_its_own_cluster() {
        use dpukv_net::identity::{Identity, Role};
        use dpukv_net::tls::{LocalCa, TlsFiles};
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = LocalCa::new().expect("CA");
        ca.write_ca(&dir.path().join("ca.pem")).expect("CA");
        let issue = |name: &str, cluster: &str, role: Role, id: &str| {
            let f = TlsFiles {
                cert: dir.path().join(format!("{name}.pem")),
                key: dir.path().join(format!("{name}.key")),
                ca: None,
            };
            ca.issue(&["127.0.0.1"], Some(&Identity::new("local", cluster, role, id).expect("identity")), &f)
                .expect("issue");
        };
        issue("node-1", "c", Role::Node, "1");
        issue("front-1", "c", Role::Gateway, "front-1");
        issue("front-other", "other", Role::Gateway, "front-1");
        let path = |name: &str| dir.path().join(name).display().to_string();
        let (cert, key, ca_arg) = (path("node-{node}.pem"), path("node-{node}.key"), path("ca.pem"));
        let node_tls = ["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca_arg, "--tls-client-auth"];
        let device = |tls: bool, front: Option<&str>| {
            let mut argv = vec!["dpukv-dpu", "--shm-dir", "/s", "--node-id", "1", "--resp", "127.0.0.1:0"];
            if tls {
                argv.extend_from_slice(&node_tls);
            }
            let (fc, fk) = front.map(|f| (path(&format!("{f}.pem")), path(&format!("{f}.key")))).unzip();
            if let (Some(fc), Some(fk)) = (&fc, &fk) {
                argv.extend(["--front-tls-cert", fc, "--front-tls-key", fk]);
            }
            DeviceArgs::try_parse_from(argv).expect("flags").config().map_err(|e| format!("{e:#}"))
        };
        let c = device(true, Some("front-{node}")).expect("a gateway certificate of the node's cluster");
        let front = c.front.expect("front door");
        let own = front.tls_server.expect("the front door speaks TLS").own_identity().expect("identity");
        assert_eq!((own.role, own.id.as_str()), (Role::Gateway, "front-1"));
        assert!(front.tls_client.is_some(), "it presents it to the devices it forwards to");
        let e = device(true, None).expect_err("no front door certificate");
        assert!(e.contains("--front-tls-cert"), "{e}");
        let e = device(true, Some("node-1")).expect_err("a node's certificate");
        assert!(e.contains("must be a gateway's"), "{e}");
        let e = device(true, Some("front-other")).expect_err("another cluster's");
        assert!(e.contains("another cluster"), "{e}");
        let e = device(false, Some("front-1")).expect_err("no TLS on the data port");
        assert!(e.contains("when the data port does"), "{e}");
        // Plain text: no TLS, whatever the gateway's variables in this process would say.
        let plain = device(false, None).expect("plain").front.expect("front door");
        assert!(plain.tls_server.is_none() && plain.tls_client.is_none());
    }
}
