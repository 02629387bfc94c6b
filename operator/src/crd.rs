//! The `DpuKvCluster` custom resource (`dpukv.io/v1alpha1`, namespaced): what users declare
//! (spec) and what the operator reports (status), derived into the CRD's OpenAPI schema with its
//! CEL validation rules (`x-kubernetes-validations`), printer columns and the scale subresource
//! (`kubectl scale dpukv/NAME --replicas=N` sets `spec.nodes`). `crdgen` writes the CRD to
//! `manifests/crds/`; a test fails when the file and these types drift apart.
//!
//! Field names are an interface: users script against them. Defaults are written into the
//! schema so `kubectl get -o yaml` shows what runs.

// kube's `printcolumn(...)` arguments repeat `type_ = ...` across columns, which clippy takes for
// duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, ResourceRequirements, Toleration, TopologySpreadConstraint};
use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A dpukv cluster: node pods (a host and a device container each), a gateway, and the cluster's
/// metadata in etcd.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "dpukv.io",
    version = "v1alpha1",
    kind = "DpuKvCluster",
    namespaced,
    status = "DpuKvClusterStatus",
    shortname = "dpukv",
    category = "dpukv",
    scale(
        spec_replicas_path = ".spec.nodes",
        status_replicas_path = ".status.nodes",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".spec.nodes"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyNodes"),
    printcolumn(name = "Regions", type_ = "integer", json_path = ".status.regions"),
    printcolumn(name = "Master", type_ = "string", json_path = ".status.master"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = Rule::new("self.replicationFactor <= self.nodes").message("replicationFactor must not exceed nodes"))]
#[x_kube(validation = Rule::new("!has(self.gateway) || !has(self.gateway.console) || !has(self.gateway.console.controlTokenSecret) || has(self.auth)").message("gateway.console.controlTokenSecret needs auth (the gateway's tokens decide who may act with it)"))]
#[x_kube(validation = Rule::new("!has(self.gateway) || !has(self.gateway.console) || !has(self.gateway.console.controlTokenSecret) || !has(self.tls) || self.tls.mode != 'Disabled'").message("gateway.console.controlTokenSecret needs TLS (without it the control API would take only the token, and the operator has none)"))]
#[x_kube(validation = Rule::new("!has(oldSelf.regions) || (has(self.regions) && self.regions == oldSelf.regions)").message("regions cannot change once set (the master splits and merges them)"))]
#[serde(rename_all = "camelCase")]
pub struct DpuKvClusterSpec {
    /// Node pods (each a host and a device container).
    #[schemars(range(min = 1, max = 1000))]
    pub nodes: i32,
    /// Copies of every region (1 = no backups); at most `nodes`.
    #[serde(default = "default_replication_factor")]
    #[schemars(range(min = 1, max = 7))]
    pub replication_factor: i32,
    /// The first layout of regions (immutable once set; later the master splits and merges).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regions: Option<RegionsSpec>,
    /// Where the device half runs.
    #[serde(default)]
    pub device: DeviceSpec,
    /// Resources of the host and device containers.
    #[serde(default)]
    pub resources: PodResources,
    /// Each node pod's volume for the value log and levels.
    pub storage: StorageSpec,
    /// The pod's shared memory (the arenas the device reads).
    #[serde(default)]
    pub shared_memory: SharedMemorySpec,
    /// The cluster's metadata store.
    pub etcd: EtcdSpec,
    /// TLS on every hop (on by default: the operator issues the certificates).
    #[serde(default)]
    pub tls: TlsSpec,
    /// Bearer tokens at the gateway, from a Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,
    /// The gateway Deployment and Service.
    #[serde(default)]
    pub gateway: GatewaySpec,
    /// The front door in every node's device: the gateway's Redis and HTTP front ends in the
    /// device's own process (docs/gateway.md, "The front door in each device"), on each node
    /// pod's address — a client connected to the node leading its keys is served with no second
    /// hop. Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub front_door: Option<FrontDoorSpec>,
    /// A libfabric endpoint in every node's device beside its data port (docs/protocol.md §1.1):
    /// the binary protocol over RDMA NICs (`verbs`: RoCE, InfiniBand, BlueField) or any network
    /// (`tcp`), registered in the region map so clients that dial it route over the fabric. Off
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<FabricSpec>,
    /// The image of every dpukv container (repository, without tag).
    #[serde(default = "default_image")]
    pub image: String,
    /// The dpukv version run (the image tag); changing it rolls the pods one at a time.
    #[serde(default = "default_version")]
    #[x_kube(validation = Rule::new("self.matches('^[0-9A-Za-z][0-9A-Za-z._-]{0,127}$')").message("version must be an image tag"))]
    pub version: String,
    /// When writes are synced: `always`, `never` or `interval:MS`.
    #[serde(default = "default_fsync")]
    #[x_kube(validation = Rule::new("self.matches('^(always|never|interval:[1-9][0-9]{0,6})$')").message("fsync is always, never or interval:MS"))]
    pub fsync: String,
    /// How backups get their index.
    #[serde(default)]
    pub backup_index: BackupIndex,
    /// Hot-key replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_keys: Option<HotKeysSpec>,
    /// Traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<TelemetrySpec>,
    /// What happens to a node pod's volume when the pod goes.
    #[serde(default)]
    pub persistent_volume_claim_retention: PvcRetention,
    /// NetworkPolicies around the cluster's pods (on by default).
    #[serde(default)]
    pub network_policy: NetworkPolicySpec,
    /// Backups (docs/backup.md): how the node pods reach object storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<BackupSpec>,
    /// Node pods' node selector.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Node pods' tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Node pods' affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Node pods' topology spread constraints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Node pods' priority class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
}

fn default_replication_factor() -> i32 {
    3
}
fn default_image() -> String {
    "dpukv/dpukv".into()
}
fn default_version() -> String {
    env!("CARGO_PKG_VERSION").into()
}
fn default_fsync() -> String {
    "always".into()
}

/// The first regions: a count (split evenly over the key space) or explicit split keys.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("has(self.count) != has(self.splitKeys)").message("give regions.count or regions.splitKeys, not both"))]
#[serde(rename_all = "camelCase")]
pub struct RegionsSpec {
    /// Regions, split evenly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub count: Option<i32>,
    /// Keys where regions begin (the first region begins at the empty key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4095))]
    pub split_keys: Option<Vec<String>>,
}

/// Where the device half runs.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSpec {
    /// `Device`: on a DPU given by the device plugin; `Emulator`: an emulator sidecar;
    /// `Auto`: decided once, when the cluster is created — `Device` when the Kubernetes nodes
    /// advertise at least one of the resource per node pod, else `Emulator` — and kept
    /// (`status.deviceMode`): a DPU node joining or a device plugin restarting never changes a
    /// running cluster's pods.
    #[serde(default)]
    pub mode: DeviceMode,
    /// The extended resource the device plugin advertises.
    #[serde(default = "default_resource_name")]
    pub resource_name: String,
}

impl Default for DeviceSpec {
    fn default() -> Self {
        DeviceSpec { mode: DeviceMode::default(), resource_name: default_resource_name() }
    }
}

fn default_resource_name() -> String {
    "dpukv.io/dpu".into()
}

/// See [`DeviceSpec::mode`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceMode {
    /// A DPU from the device plugin.
    Device,
    /// The emulator sidecar.
    Emulator,
    /// Decided once at creation: Device when the nodes advertise enough of the resource, else
    /// Emulator (see [`DeviceSpec::mode`]).
    #[default]
    Auto,
}

/// Resources of the two containers of a node pod.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodResources {
    /// The host container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<ResourceRequirements>,
    /// The device container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<ResourceRequirements>,
}

/// A positive quantity (`10Gi`, `500M`, `1.5Ti`).
const QUANTITY_RULE: &str =
    "self.matches('^([1-9][0-9]*(\\\\.[0-9]+)?|0\\\\.[0-9]*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$')";

/// A node pod's volume.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("has(self.storageClassName) == has(oldSelf.storageClassName) && (!has(self.storageClassName) || self.storageClassName == oldSelf.storageClassName)").message("storageClassName is immutable"))]
#[x_kube(validation = Rule::new("!isQuantity(self.size) || !isQuantity(oldSelf.size) || quantity(self.size).compareTo(quantity(oldSelf.size)) >= 0").message("storage.size cannot shrink (volumes only grow)"))]
#[serde(rename_all = "camelCase")]
pub struct StorageSpec {
    /// Its size (a positive quantity).
    #[x_kube(validation = Rule::new(QUANTITY_RULE).message("size must be a positive quantity"))]
    pub size: String,
    /// Its storage class (the cluster's default when absent); immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

/// The pod's shared memory.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SharedMemorySpec {
    /// The memory-backed volume's size limit (the arenas; a positive quantity).
    #[serde(default = "default_shm")]
    #[x_kube(validation = Rule::new(QUANTITY_RULE).message("size must be a positive quantity"))]
    pub size: String,
}

impl Default for SharedMemorySpec {
    fn default() -> Self {
        SharedMemorySpec { size: default_shm() }
    }
}

fn default_shm() -> String {
    "2Gi".into()
}

/// The metadata store: an existing etcd, or one the operator runs.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("(has(self.endpoints) && size(self.endpoints) > 0) != has(self.managed)").message("give etcd.endpoints or etcd.managed, not both"))]
#[x_kube(validation = Rule::new("has(self.managed) == has(oldSelf.managed) && (!has(self.managed) || self.managed.replicas == oldSelf.managed.replicas)").message("a managed etcd's members cannot change (nor can etcd switch between managed and endpoints)"))]
#[x_kube(validation = Rule::new("!has(self.clientSecret) || (has(self.endpoints) && size(self.endpoints) > 0)").message("etcd.clientSecret goes with etcd.endpoints (a managed etcd's certificates are the operator's)"))]
#[serde(rename_all = "camelCase")]
pub struct EtcdSpec {
    /// Client URLs of an existing etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<String>>,
    /// An etcd StatefulSet run by the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed: Option<ManagedEtcd>,
    /// With `endpoints` (`https://`): a Secret holding `ca.crt` (etcd's CA), `tls.crt` and
    /// `tls.key` (a client certificate etcd's `--client-cert-auth` accepts). The node hosts
    /// mount it and speak TLS to etcd with it; the operator reads it to delete the cluster's keys
    /// when the cluster is deleted. (A managed etcd's certificates are the operator's own.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_secret: Option<String>,
}

/// An etcd the operator runs.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("!isQuantity(self.storage) || !isQuantity(oldSelf.storage) || quantity(self.storage).compareTo(quantity(oldSelf.storage)) >= 0").message("etcd.managed.storage cannot shrink (volumes only grow)"))]
#[serde(rename_all = "camelCase")]
pub struct ManagedEtcd {
    /// Members: 1, 3 or 5.
    #[serde(default = "default_etcd_replicas")]
    #[x_kube(validation = Rule::new("self in [1, 3, 5]").message("etcd members are 1, 3 or 5"))]
    pub replicas: i32,
    /// Each member's volume (a positive quantity).
    #[serde(default = "default_etcd_storage")]
    #[x_kube(validation = Rule::new(QUANTITY_RULE).message("storage must be a positive quantity"))]
    pub storage: String,
    /// The etcd image (etcd 3.4 or 3.5: `etcd` on the image's PATH).
    #[serde(default = "default_etcd_image")]
    pub image: String,
}

fn default_etcd_image() -> String {
    "quay.io/coreos/etcd:v3.5.17".into()
}

fn default_etcd_replicas() -> i32 {
    3
}
fn default_etcd_storage() -> String {
    "1Gi".into()
}

/// TLS on every hop (docs/security.md). On by default: with no Secret named and no
/// cert-manager issuer, the operator issues and renews a CA and every certificate itself.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("!(has(self.clusterSecret) && has(self.certManager))").message("give tls.clusterSecret or tls.certManager, not both"))]
#[x_kube(validation = Rule::new("self.mode != 'Disabled' || !(has(self.clusterSecret) || has(self.gatewaySecret) || has(self.operatorSecret) || has(self.certManager))").message("tls.mode Disabled takes no certificates"))]
#[x_kube(validation = Rule::new("has(self.clusterSecret) || !(has(self.gatewaySecret) || has(self.operatorSecret))").message("tls.gatewaySecret and tls.operatorSecret go with tls.clusterSecret"))]
#[serde(rename_all = "camelCase")]
pub struct TlsSpec {
    /// `Enabled` (the default) or `Disabled`: plain TCP and HTTP everywhere, an explicit opt-in
    /// the status shows (`Secure` False, reason `PlaintextOptIn`).
    #[serde(default)]
    pub mode: TlsMode,
    /// Your own certificates for the node pods: a Secret with `ca.crt` and `node-<id>.crt` /
    /// `node-<id>.key` for every node id (1..=nodes), each with the URI SAN
    /// `spiffe://dpukv/<namespace>/<cluster>/node/<id>`. Absent: the operator issues them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_secret: Option<String>,
    /// With `clusterSecret`: the gateway's Secret (`tls.crt`, `tls.key`, `ca.crt`; role
    /// `gateway`, from the same CA; the cluster secret's CA when absent is not enough — the
    /// gateway needs a certificate of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_secret: Option<String>,
    /// With `clusterSecret`: the operator's client certificate for the nodes' control API
    /// (`tls.crt`, `tls.key`, `ca.crt`; role `operator`), in the cluster's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator_secret: Option<String>,
    /// Certificates from cert-manager instead of the operator's own CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_manager: Option<CertManagerSpec>,
}

/// See [`TlsSpec::mode`].
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// TLS on every hop (mutual inside the cluster).
    #[default]
    Enabled,
    /// Plain text (an explicit opt-in; shown in the status).
    Disabled,
}

/// Where the certificates come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsSource {
    /// The operator's own CA (`NAME-ca`).
    Operator,
    /// The user's Secrets.
    Secrets,
    /// cert-manager `Certificate`s.
    CertManager,
    /// None: plain text.
    Disabled,
}

impl TlsSpec {
    /// Where this cluster's certificates come from.
    pub fn source(&self) -> TlsSource {
        match (self.mode, &self.cluster_secret, &self.cert_manager) {
            (TlsMode::Disabled, _, _) => TlsSource::Disabled,
            (_, Some(_), _) => TlsSource::Secrets,
            (_, None, Some(_)) => TlsSource::CertManager,
            (_, None, None) => TlsSource::Operator,
        }
    }

    /// Whether TLS is on.
    pub fn enabled(&self) -> bool {
        self.mode == TlsMode::Enabled
    }
}

/// cert-manager as the source of the certificates (`cert-manager.io/v1` `Certificate`s).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CertManagerSpec {
    /// The issuer that signs them (a CA issuer whose certificate the cluster trusts).
    pub issuer_ref: IssuerRef,
}

/// A cert-manager issuer.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IssuerRef {
    /// Its name.
    pub name: String,
    /// `Issuer` (in the cluster's namespace) or `ClusterIssuer`.
    #[serde(default = "default_issuer_kind")]
    #[x_kube(validation = Rule::new("self in ['Issuer', 'ClusterIssuer']").message("issuerRef.kind is Issuer or ClusterIssuer"))]
    pub kind: String,
    /// Its API group.
    #[serde(default = "default_issuer_group")]
    pub group: String,
}

fn default_issuer_kind() -> String {
    "Issuer".into()
}
fn default_issuer_group() -> String {
    "cert-manager.io".into()
}

/// NetworkPolicies (`networking.k8s.io/v1`) that let only the cluster's own flows in and out of
/// its pods (docs/security.md §3).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// Render them (your CNI must enforce NetworkPolicies for them to mean anything).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The namespaces whose pods may scrape the metrics ports (9100, 9101, 9102).
    #[serde(default = "default_monitoring_namespaces")]
    pub monitoring_namespace_selector: LabelSelector,
    /// Of those namespaces' pods, the ones that may (all when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitoring_pod_selector: Option<LabelSelector>,
    /// Who may reach the gateway's front ends (`from` of a NetworkPolicy rule; anyone when
    /// absent — they are the cluster's endpoint, with tokens and TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clients: Option<Vec<NetworkPolicyPeer>>,
}

impl Default for NetworkPolicySpec {
    fn default() -> Self {
        NetworkPolicySpec {
            enabled: true,
            monitoring_namespace_selector: default_monitoring_namespaces(),
            monitoring_pod_selector: None,
            clients: None,
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_monitoring_namespaces() -> LabelSelector {
    LabelSelector {
        match_labels: Some(BTreeMap::from([("kubernetes.io/metadata.name".to_string(), "monitoring".to_string())])),
        ..Default::default()
    }
}

/// Bearer tokens.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AuthSpec {
    /// A Secret whose `tokens` key holds the gateway's token file (docs/gateway.md).
    pub tokens_secret: String,
}

/// The gateway.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    /// Gateway pods.
    #[serde(default = "default_gateway_replicas")]
    #[schemars(range(min = 0, max = 100))]
    pub replicas: i32,
    /// Its Service's type.
    #[serde(default)]
    pub service_type: ServiceType,
    /// Its ports.
    #[serde(default)]
    pub ports: GatewayPorts,
    /// The web console on the HTTP port (`/ui/`, docs/console.md).
    #[serde(default)]
    pub console: ConsoleSpec,
}

impl Default for GatewaySpec {
    fn default() -> Self {
        GatewaySpec {
            replicas: default_gateway_replicas(),
            service_type: ServiceType::default(),
            ports: GatewayPorts::default(),
            console: ConsoleSpec::default(),
        }
    }
}

/// The gateway's web console.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConsoleSpec {
    /// Serve it (default true). It shows the cluster to the gateway's tokens; the gateway reads
    /// the hosts' control API with its certificate (NetworkPolicy: gateway → control port).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// A Secret with the key `token` (16 bytes or more): the hosts take it as their control
    /// API's admin token and the gateway acts with it — the console's drain, step-down and
    /// split. Absent: the console shows but cannot act. Needs TLS (the operator reaches the
    /// control API with its certificate) and `auth` (the gateway's tokens decide who may act).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_token_secret: Option<String>,
}

impl Default for ConsoleSpec {
    fn default() -> Self {
        ConsoleSpec { enabled: true, control_token_secret: None }
    }
}

fn default_gateway_replicas() -> i32 {
    2
}

/// A Service type.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ServiceType {
    /// Inside the cluster.
    #[default]
    ClusterIP,
    /// On every node's port.
    NodePort,
    /// A cloud load balancer.
    LoadBalancer,
}

/// The gateway's three front ends.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.binary != self.http && self.http != self.resp && self.binary != self.resp").message("gateway ports must differ"))]
#[serde(rename_all = "camelCase")]
pub struct GatewayPorts {
    /// The binary protocol.
    #[serde(default = "default_binary_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub binary: i32,
    /// HTTP/JSON (and `/metrics`).
    #[serde(default = "default_http_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub http: i32,
    /// The Redis protocol.
    #[serde(default = "default_resp_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub resp: i32,
}

impl Default for GatewayPorts {
    fn default() -> Self {
        GatewayPorts { binary: default_binary_port(), http: default_http_port(), resp: default_resp_port() }
    }
}

fn default_binary_port() -> i32 {
    7379
}
fn default_http_port() -> i32 {
    8080
}
fn default_resp_port() -> i32 {
    6379
}

/// The front door in each node's device (see [`DpuKvClusterSpec::front_door`]). With TLS, each
/// device presents a `gateway` certificate of its own (the node Secret's `front-<id>.crt` and
/// `.key`: issued by the operator or cert-manager, or given with the Secrets); with `auth`, it
/// takes the gateway's tokens.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.resp != self.http").message("frontDoor ports must differ"))]
#[x_kube(validation = Rule::new("!(self.resp in [7070, 7071, 9100, 9101, 9103]) && !(self.http in [7070, 7071, 9100, 9101, 9103])").message("frontDoor ports must not be a node pod's own (7070, 7071, 9100, 9101, 9103)"))]
#[serde(rename_all = "camelCase")]
pub struct FrontDoorSpec {
    /// Serve it.
    #[serde(default)]
    pub enabled: bool,
    /// The Redis protocol.
    #[serde(default = "default_resp_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub resp: i32,
    /// HTTP/JSON.
    #[serde(default = "default_http_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub http: i32,
    /// Threads it runs on in each device (each its own event loop; clients spread among them).
    #[serde(default = "default_front_threads")]
    #[schemars(range(min = 1, max = 64))]
    pub threads: i32,
}

fn default_front_threads() -> i32 {
    1
}

/// The fabric endpoint in each node's device (see [`DpuKvClusterSpec::fabric`]). It speaks TLS
/// when the data port does, with the node's certificate, and takes the same roles.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("!(self.port in [7070, 7071, 9100, 9101, 9103])").message("fabric.port must not be a node pod's own (7070, 7071, 9100, 9101, 9103)"))]
#[serde(rename_all = "camelCase")]
pub struct FabricSpec {
    /// Serve it.
    #[serde(default)]
    pub enabled: bool,
    /// The libfabric provider (`verbs`, `efa`, `tcp`, ...; the image must carry libfabric and the
    /// provider: the default image has none, see docs/kubernetes.md).
    #[serde(default = "default_fabric_provider")]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9_;-]{1,64}$')").message("fabric.provider must be a libfabric provider name"))]
    pub provider: String,
    /// The endpoint's port on each node pod.
    #[serde(default = "default_fabric_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// An extended resource the device container asks one of (an RDMA device plugin's, e.g.
    /// `rdma/hca_shared_devices_a` of the k8s-rdma-shared-dev-plugin, or `rdma/hca`); none: the
    /// provider needs no device (`tcp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^([a-z0-9.-]+/)?[A-Za-z0-9_.-]{1,63}$')").message("fabric.rdmaResource must be a resource name"))]
    pub rdma_resource: Option<String>,
    /// Give the device container `IPC_LOCK`, so its registered buffers may be pinned past the
    /// memory-lock limit (RDMA providers pin what they register). Kubernetes sets no per-pod
    /// memlock limit, so this is how one lifts it; it takes the pod out of Pod Security
    /// `restricted` (its namespace needs `privileged`). Off: the runtime's limit applies (enough
    /// for `tcp`, which pins nothing).
    #[serde(default)]
    pub lock_memory: bool,
}

fn default_fabric_provider() -> String {
    "verbs".into()
}

fn default_fabric_port() -> i32 {
    7075
}

/// How backups get their index (docs/cluster.md).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum BackupIndex {
    /// The primary ships its compacted index (Tebis Send Index).
    #[default]
    Send,
    /// Backups replay and compact themselves (the baseline).
    Build,
}

/// Hot-key replicas (hKVS).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HotKeysSpec {
    /// Replicate popular keys to other nodes' devices.
    #[serde(default)]
    pub enabled: bool,
    /// Popular keys per region.
    #[serde(default = "default_hot_capacity")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub capacity: i32,
    /// Reads within the window that make a key popular.
    #[serde(default = "default_hot_k")]
    #[schemars(range(min = 1, max = 1000))]
    pub k: i32,
    /// Reads the window spans.
    #[serde(default = "default_hot_window")]
    #[schemars(range(min = 1, max = 10_000_000))]
    pub window: i32,
}

fn default_hot_capacity() -> i32 {
    10_000
}
fn default_hot_k() -> i32 {
    4
}
fn default_hot_window() -> i32 {
    100_000
}

/// How the node pods reach backup locations.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct BackupSpec {
    /// A Secret in the cluster's namespace whose keys become the node hosts' environment:
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT` (an
    /// S3-compatible store), ... for `s3://` locations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
}

/// Traces.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TelemetrySpec {
    /// The OTLP (gRPC) endpoint spans are exported to.
    pub otlp_endpoint: String,
}

/// What happens to node pods' volumes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PvcRetention {
    /// When a scale-in removed the pod (after its drain).
    #[serde(default)]
    pub when_scaled: RetentionPolicy,
    /// When the cluster is deleted.
    #[serde(default)]
    pub when_deleted: RetentionPolicy,
}

/// Keep or delete a volume.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RetentionPolicy {
    /// Keep it (delete it by hand).
    #[default]
    Retain,
    /// Delete it.
    Delete,
}

/// What the operator reports.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DpuKvClusterStatus {
    /// `Creating` (no node pod ready yet), `Pending` (pods not all ready, some the scheduler
    /// cannot place), `Running`, `Degraded` (running, with regions short of a primary or of
    /// copies), `Scaling`, `Draining`, `Upgrading` or `Deleting`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// `Available`, `Progressing`, `Stalled`, `Degraded`, `Draining`, `Secure`, `StorageResized`,
    /// `PodsScheduled`, `ZonesSpread`, `Paused`, `Reconciled` (False with the error when the last reconcile
    /// failed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Node pods ready.
    #[serde(default)]
    pub ready_nodes: i32,
    /// Node pods running, ready or not (the scale subresource's current replicas: an autoscaler
    /// reading ready pods would take pods still starting for missing ones and scale again).
    #[serde(default)]
    pub nodes: i32,
    /// Regions in the cluster's map.
    #[serde(default)]
    pub regions: i32,
    /// The node running the master.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<String>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The version every node pod runs (absent while a rollout is under way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The node pods' label selector (the scale subresource's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// When what is under way (a rollout, a drain, pods getting ready) last changed; absent
    /// when nothing is. Unchanged for [`crate::controller::STALL_AFTER`]: `Stalled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_time: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Where the device half runs, as decided (`Device` or `Emulator`): `Auto` is decided once,
    /// when the cluster is created, and kept — a DPU node joining or a device plugin restarting
    /// never changes a running cluster's pods; set `device.mode` to change it on purpose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_mode: Option<String>,
}
