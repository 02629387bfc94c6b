//! What a `DpuKvCluster` becomes (docs/kubernetes.md "What the operator creates"): pure
//! functions from the resource to the objects the controller applies — the node StatefulSet (a
//! host and a device container sharing a memory-backed volume, a volume claim for the log and
//! levels, one process namespace) and its headless Service, the node hosts' ConfigMap (their
//! cluster-wide settings, immutable, named by a hash of them: the pod template names it), the gateway Deployment and Service,
//! the node pods' PodDisruptionBudget, and with `etcd.managed` an etcd StatefulSet and its
//! headless Service. Every object carries the cluster's labels and an owner reference to the
//! resource, so deleting the resource deletes them.
//!
//! Node ids: a node pod's id is its StatefulSet ordinal + 1 (`DPUKV_NODE_INDEX` from the pod's
//! `apps.kubernetes.io/pod-index` label), stable across restarts; it advertises its device and
//! replication addresses by the pod's DNS name under the headless Service.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, RollingUpdateStatefulSetStrategy, StatefulSet,
    StatefulSetPersistentVolumeClaimRetentionPolicy, StatefulSetSpec, StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMap, ConfigMapEnvSource, ConfigMapVolumeSource, Container, ContainerPort,
    EmptyDirVolumeSource, EnvFromSource, EnvVar, EnvVarSource, HTTPGetAction, ObjectFieldSelector,
    PersistentVolumeClaim, PersistentVolumeClaimSpec, PodAffinityTerm, PodAntiAffinity, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, SecretVolumeSource, SecurityContext, Service,
    ServicePort, ServiceSpec, TCPSocketAction, TopologySpreadConstraint, Volume, VolumeMount,
    VolumeResourceRequirements, WeightedPodAffinityTerm,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::crd::{DeviceMode, DpuKvCluster, FabricSpec, FrontDoorSpec, RetentionPolicy, ServiceType};

/// The device container's data port.
pub const DEVICE_PORT: i32 = 7070;
/// The host's replication port.
pub const REPLICATION_PORT: i32 = 7071;
/// The host's admin port: `/healthz`, `/readyz`, `/metrics` (read-only; plain HTTP for the
/// kubelet's probes and monitoring).
pub const HOST_ADMIN_PORT: i32 = 9100;
/// The host's control API (`/cluster/*`: drains, step-downs, the summary), mutual TLS with the
/// `operator` or `admin` role (docs/security.md §3).
pub const CONTROL_PORT: i32 = 9103;
/// The device's admin port.
pub const DEVICE_ADMIN_PORT: i32 = 9101;
/// The gateway's admin port.
pub const GATEWAY_ADMIN_PORT: i32 = 9102;
/// Where the host keeps its log and levels.
pub const DATA_DIR: &str = "/var/lib/dpukv/data";
/// The shared directory of the pod's two halves (the memory-backed volume).
pub const SHM_DIR: &str = "/dev/shm/dpukv";
/// Where TLS material is mounted (the node Secret in node pods, the gateway's in gateway pods).
pub const TLS_DIR: &str = "/etc/dpukv/tls";
/// Where a device's front door finds its certificate (the front door Secret).
pub const FRONT_TLS_DIR: &str = "/etc/dpukv/front-tls";
/// Where a gateway, or a device's front door, finds the tokens (the `auth` Secret).
pub const AUTH_DIR: &str = "/etc/dpukv/auth";
/// Where a node host finds its etcd client certificate (`ca.crt`, `tls.crt`, `tls.key`).
pub const ETCD_TLS_DIR: &str = "/etc/dpukv/etcd";
/// Where the hosts and the gateway find the console's control token
/// (`gateway.console.controlTokenSecret`).
pub const CONTROL_TOKEN_DIR: &str = "/etc/dpukv/control";
/// Where an etcd member finds its certificate.
pub const ETCD_MEMBER_TLS_DIR: &str = "/etc/etcd/tls";
/// The user and group every dpukv and etcd container runs as (the image's `nonroot`); the
/// pods' `fsGroup` too, so a volume owned by root is made writable for it.
pub const RUN_AS: i64 = 65532;

/// The front door Secret (`frontDoor` with TLS): `ca.crt`, and `front-<id>.crt` /
/// `front-<id>.key` for every node id — each device's front door's gateway identity, mounted in
/// the device containers only (a gateway identity may read and write at every device: the hosts
/// do not hold one).
pub fn front_tls_secret(c: &DpuKvCluster) -> String {
    format!("{}-front-tls", c.name_any())
}

/// The node Secret: `ca.crt`, and `node-<id>.crt` / `node-<id>.key` for every node id.
pub fn node_tls_secret(c: &DpuKvCluster) -> String {
    c.spec.tls.cluster_secret.clone().unwrap_or_else(|| format!("{}-node-tls", c.name_any()))
}

/// The gateway's Secret (`tls.crt`, `tls.key`, `ca.crt`).
pub fn gateway_tls_secret(c: &DpuKvCluster) -> String {
    c.spec.tls.gateway_secret.clone().unwrap_or_else(|| format!("{}-gateway-tls", c.name_any()))
}

/// The operator's CA Secret (`ca.crt`, `ca.key`, and `ca-previous.crt` after a renewal): read by
/// the operator only, mounted nowhere.
pub fn ca_secret(c: &DpuKvCluster) -> String {
    format!("{}-ca", c.name_any())
}

/// The managed etcd's own CA (separate from the cluster's: a gateway's certificate cannot reach
/// etcd).
pub fn etcd_ca_secret(c: &DpuKvCluster) -> String {
    format!("{}-etcd-ca", c.name_any())
}

/// The managed etcd members' certificate (server and peer): `ca.crt`, `tls.crt`, `tls.key`.
pub fn etcd_tls_secret(c: &DpuKvCluster) -> String {
    format!("{}-etcd-tls", c.name_any())
}

/// The node hosts' etcd client certificate (`ca.crt`, `tls.crt`, `tls.key`): mounted in the host
/// container only. The operator's own for a managed etcd; `etcd.clientSecret` for an external one.
pub fn etcd_client_secret(c: &DpuKvCluster) -> String {
    c.spec.etcd.client_secret.clone().unwrap_or_else(|| format!("{}-etcd-client", c.name_any()))
}

/// Whether the operator runs etcd with TLS and issues its certificates (a managed etcd, TLS on).
pub fn managed_etcd_tls(c: &DpuKvCluster) -> bool {
    c.spec.tls.enabled() && c.spec.etcd.managed.is_some()
}

/// Whether the node hosts talk to etcd over TLS with a client certificate: a managed etcd with
/// TLS on, or an external one given `etcd.clientSecret`.
pub fn etcd_tls(c: &DpuKvCluster) -> bool {
    managed_etcd_tls(c) || (c.spec.etcd.managed.is_none() && c.spec.etcd.client_secret.is_some())
}

/// The per-node file names in the node Secret: the node binary replaces `{node}` with its id.
pub const NODE_CERT_FILE: &str = "node-{node}.crt";
/// See [`NODE_CERT_FILE`].
pub const NODE_KEY_FILE: &str = "node-{node}.key";

/// Whether the device half gets a DPU: `Device` mode, or `Auto` decided as `Device` (the
/// controller decides once and keeps it: `controller::device_mode`).
pub fn uses_device(c: &DpuKvCluster, dpu_available: bool) -> bool {
    match c.spec.device.mode {
        DeviceMode::Device => true,
        DeviceMode::Emulator => false,
        DeviceMode::Auto => dpu_available,
    }
}

/// Whether a node StatefulSet's device container asks for `resource` (a DPU): what a running
/// cluster was decided to run on.
pub fn requests_device(set: &StatefulSet, resource: &str) -> bool {
    let Some(pod) = set.spec.template.spec.as_ref() else { return false };
    pod.containers
        .iter()
        .filter(|c| c.name == "device")
        .any(|c| c.resources.as_ref().and_then(|r| r.limits.as_ref()).is_some_and(|l| l.contains_key(resource)))
}

/// The labels of a component's objects (`node` or `gateway`).
pub fn labels(c: &DpuKvCluster, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "dpukv".to_string()),
        ("app.kubernetes.io/instance".to_string(), c.name_any()),
        ("app.kubernetes.io/component".to_string(), component.to_string()),
        ("app.kubernetes.io/managed-by".to_string(), "dpukv-operator".to_string()),
    ])
}

/// The label selector of a component's pods (the labels that never change).
pub fn selector(c: &DpuKvCluster, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/instance".to_string(), c.name_any()),
        ("app.kubernetes.io/component".to_string(), component.to_string()),
    ])
}

/// `selector` as the string the scale subresource reports.
pub fn selector_string(c: &DpuKvCluster) -> String {
    selector(c, "node").iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// The node StatefulSet's (and headless Service's) name.
pub fn node_name(c: &DpuKvCluster) -> String {
    format!("{}-node", c.name_any())
}

/// The DNS name of node pod `pod` under the headless Service (`pod` may be `$(POD_NAME)`, which
/// Kubernetes expands in a container's environment).
pub fn pod_host(c: &DpuKvCluster, pod: &str) -> String {
    let ns = c.namespace().unwrap_or_else(|| "default".into());
    format!("{pod}.{}.{ns}.svc", node_name(c))
}

/// The gateway Deployment's name (its Service is the cluster's own name).
pub fn gateway_name(c: &DpuKvCluster) -> String {
    format!("{}-gateway", c.name_any())
}

fn meta(c: &DpuKvCluster, name: String, component: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: c.namespace(),
        labels: Some(labels(c, component)),
        owner_references: c.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector { field_path: path.into(), ..Default::default() }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn port(name: &str, p: i32) -> ContainerPort {
    ContainerPort { name: Some(name.into()), container_port: p, ..Default::default() }
}

fn http_probe(path: &str, p: i32, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction { path: Some(path.into()), port: IntOrString::Int(p), ..Default::default() }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount { name: name.into(), mount_path: path.into(), read_only: Some(read_only), ..Default::default() }
}

/// A container that passes Pod Security `restricted` (with [`restricted_pod`]): no privilege
/// escalation, every capability dropped, a read-only root file system (the processes write only
/// to their volumes).
pub fn restricted_container() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), ..Default::default() }),
        ..Default::default()
    }
}

/// A pod that passes Pod Security `restricted`: non-root ([`RUN_AS`], its group too), the
/// runtime's default seccomp profile, and `fsGroup` so volumes (a cloud disk owned by root) are
/// group-writable for it — changed only when the volume's root is not the group's already.
pub fn restricted_pod() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS),
        run_as_group: Some(RUN_AS),
        fs_group: Some(RUN_AS),
        fs_group_change_policy: Some("OnRootMismatch".into()),
        seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), ..Default::default() }),
        ..Default::default()
    }
}

fn secret_volume(name: &str, secret: &str) -> Volume {
    Volume {
        name: name.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.into()),
            // Readable by the owner and the pod's group (fsGroup) only.
            default_mode: Some(0o440),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn empty_dir(name: &str) -> Volume {
    Volume { name: name.into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() }
}

/// The `data` volume claim of a StatefulSet's pods.
fn data_claim(size: &str, class: &Option<String>) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta { name: Some("data".into()), ..Default::default() },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: class.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_string(), Quantity(size.to_string()))])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn image(c: &DpuKvCluster) -> String {
    format!("{}:{}", c.spec.image, c.spec.version)
}

fn etcd_endpoints(c: &DpuKvCluster) -> String {
    match (&c.spec.etcd.endpoints, &c.spec.etcd.managed) {
        (Some(e), _) if !e.is_empty() => e.join(","),
        // The managed etcd's Service (by the name its certificate carries).
        _ => {
            let scheme = if managed_etcd_tls(c) { "https" } else { "http" };
            let ns = c.namespace().unwrap_or_else(|| "default".into());
            format!("{scheme}://{}.{ns}.svc:{ETCD_CLIENT_PORT}", etcd_name(c))
        }
    }
}

/// The managed etcd's client port.
pub const ETCD_CLIENT_PORT: i32 = 2379;
/// The managed etcd's peer port.
pub const ETCD_PEER_PORT: i32 = 2380;

/// The managed etcd's StatefulSet and Service.
pub fn etcd_name(c: &DpuKvCluster) -> String {
    format!("{}-etcd", c.name_any())
}

/// The managed etcd's headless Service: each member's DNS name for its peers (published before
/// it is ready: members must find each other to form a quorum), and the name clients use.
pub fn etcd_service(c: &DpuKvCluster) -> Option<Service> {
    c.spec.etcd.managed.as_ref()?;
    Some(Service {
        metadata: meta(c, etcd_name(c), "etcd"),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(selector(c, "etcd")),
            ports: Some(vec![service_port("client", ETCD_CLIENT_PORT), service_port("peer", ETCD_PEER_PORT)]),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The managed etcd (`etcd.managed`): `replicas` members started together (a member waits for
/// a quorum), each on its own volume, as a non-root user with nothing else allowed.
pub fn etcd_statefulset(c: &DpuKvCluster) -> Option<StatefulSet> {
    let m = c.spec.etcd.managed.as_ref()?;
    let name = etcd_name(c);
    let ns = c.namespace().unwrap_or_else(|| "default".into());
    let tls = managed_etcd_tls(c);
    let scheme = if tls { "https" } else { "http" };
    let peer = |pod: &str| format!("{scheme}://{pod}.{name}.{ns}.svc:{ETCD_PEER_PORT}");
    let members: Vec<String> =
        (0..m.replicas).map(|i| format!("{name}-{i}={}", peer(&format!("{name}-{i}")))).collect();
    let mut args = vec![
        "--name=$(POD_NAME)".to_string(),
        "--data-dir=/var/lib/etcd/data".into(),
        format!("--listen-client-urls={scheme}://0.0.0.0:{ETCD_CLIENT_PORT}"),
        format!("--advertise-client-urls={scheme}://$(POD_NAME).{name}.{ns}.svc:{ETCD_CLIENT_PORT}"),
        format!("--listen-peer-urls={scheme}://0.0.0.0:{ETCD_PEER_PORT}"),
        format!("--initial-advertise-peer-urls={}", peer("$(POD_NAME)")),
        format!("--initial-cluster={}", members.join(",")),
        "--initial-cluster-state=new".into(),
        format!("--initial-cluster-token={ns}-{name}"),
    ];
    if tls {
        // Clients (the node hosts) and peers each present a certificate of the etcd CA.
        let f = |file: &str| format!("{ETCD_MEMBER_TLS_DIR}/{file}");
        args.extend([
            "--client-cert-auth".to_string(),
            format!("--trusted-ca-file={}", f("ca.crt")),
            format!("--cert-file={}", f("tls.crt")),
            format!("--key-file={}", f("tls.key")),
            "--peer-client-cert-auth".into(),
            format!("--peer-trusted-ca-file={}", f("ca.crt")),
            format!("--peer-cert-file={}", f("tls.crt")),
            format!("--peer-key-file={}", f("tls.key")),
        ]);
    }
    let tcp = |period| Probe {
        tcp_socket: Some(TCPSocketAction { port: IntOrString::Int(ETCD_CLIENT_PORT), ..Default::default() }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        ..Default::default()
    };
    let etcd = Container {
        name: "etcd".into(),
        image: Some(m.image.clone()),
        command: Some(vec!["etcd".into()]),
        args: Some(args),
        env: Some(vec![env_field("POD_NAME", "metadata.name")]),
        ports: Some(vec![port("client", ETCD_CLIENT_PORT), port("peer", ETCD_PEER_PORT)]),
        readiness_probe: Some(tcp(5)),
        liveness_probe: Some(Probe { initial_delay_seconds: Some(15), ..tcp(10) }),
        volume_mounts: Some(
            std::iter::once(mount("data", "/var/lib/etcd", false))
                .chain(tls.then(|| mount("tls", ETCD_MEMBER_TLS_DIR, true)))
                .collect(),
        ),
        security_context: Some(restricted_container()),
        ..Default::default()
    };
    let volumes = tls.then(|| vec![secret_volume("tls", &etcd_tls_secret(c))]);
    let s = &c.spec;
    Some(StatefulSet {
        metadata: meta(c, name.clone(), "etcd"),
        spec: StatefulSetSpec {
            replicas: Some(m.replicas),
            service_name: Some(name),
            // Members start together: each waits for a quorum of the others to become ready.
            pod_management_policy: Some("Parallel".into()),
            selector: LabelSelector { match_labels: Some(selector(c, "etcd")), ..Default::default() },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels(c, "etcd")), ..Default::default() }),
                spec: Some(PodSpec {
                    containers: vec![etcd],
                    volumes,
                    security_context: Some(restricted_pod()),
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    node_selector: (!s.node_selector.is_empty()).then(|| s.node_selector.clone()),
                    tolerations: (!s.tolerations.is_empty()).then(|| s.tolerations.clone()),
                    priority_class_name: s.priority_class_name.clone(),
                    ..Default::default()
                }),
            },
            volume_claim_templates: Some(vec![data_claim(&m.storage, &s.storage.storage_class_name)]),
            // The metadata is the cluster's: its volumes go with the cluster — a cluster created
            // again under the same name must not find the old one's regions and nodes. (A
            // member's volume stays across restarts; members never scale.)
            persistent_volume_claim_retention_policy: Some(StatefulSetPersistentVolumeClaimRetentionPolicy {
                when_deleted: Some("Delete".into()),
                when_scaled: Some("Retain".into()),
            }),
            ..Default::default()
        },
        ..Default::default()
    })
}

/// The TLS settings of a node container (host or device): its own pair from the node Secret by
/// its id (`{node}`, which the node binaries replace), the cluster's CA, mutual TLS.
fn node_tls_env(c: &DpuKvCluster) -> Vec<EnvVar> {
    if !c.spec.tls.enabled() {
        return Vec::new();
    }
    vec![
        env("DPUKV_TLS_CERT", format!("{TLS_DIR}/{NODE_CERT_FILE}")),
        env("DPUKV_TLS_KEY", format!("{TLS_DIR}/{NODE_KEY_FILE}")),
        env("DPUKV_TLS_CA", format!("{TLS_DIR}/ca.crt")),
        env("DPUKV_TLS_CLIENT_AUTH", "true"),
    ]
}

/// The cluster's name in etcd (`NAMESPACE.NAME`; its keys are under `/dpukv/NAMESPACE.NAME/`).
pub fn cluster_name(c: &DpuKvCluster) -> String {
    format!("{}.{}", c.namespace().unwrap_or_else(|| "default".into()), c.name_any())
}

/// How many hex digits of [`config_hash`] the node ConfigMap's name carries.
const CONFIG_NAME_HASH: usize = 10;

/// The node ConfigMap's name: `NAME-node-config-HASH`, by its content (the first
/// [`CONFIG_NAME_HASH`] hex digits of [`config_hash`]). A changed setting is a new ConfigMap
/// and a new pod template (its `envFrom` names it); pods of the old template keep reading the
/// old ConfigMap, which stays until no pod runs that template (`controller`).
pub fn node_config_name(c: &DpuKvCluster) -> String {
    let hash = config_hash(&ConfigMap { data: Some(node_config_data(c)), ..Default::default() });
    format!("{}-node-config-{}", c.name_any(), &hash[..CONFIG_NAME_HASH])
}

/// The node hosts' settings that are the same in every pod, as environment variables: the
/// cluster's name in etcd (`NAMESPACE.NAME`), etcd, fsync, replication factor, backup index,
/// where replication listens, the first layout's split keys and the OTLP endpoint when set.
/// What differs per pod (its name and index from the downward API, the addresses it advertises,
/// which expand `$(POD_NAME)` — expansion works in `env` only) stays in the container's `env`.
fn node_config_data(c: &DpuKvCluster) -> BTreeMap<String, String> {
    let s = &c.spec;
    let mut data = BTreeMap::from([
        ("DPUKV_CLUSTER".to_string(), cluster_name(c)),
        ("DPUKV_ETCD".to_string(), etcd_endpoints(c)),
        ("DPUKV_FSYNC".to_string(), s.fsync.clone()),
        ("DPUKV_REPLICATION_FACTOR".to_string(), s.replication_factor.to_string()),
        (
            "DPUKV_BACKUP_INDEX".to_string(),
            serde_json::to_value(s.backup_index).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default(),
        ),
        ("DPUKV_REPLICATION_LISTEN".to_string(), format!("0.0.0.0:{REPLICATION_PORT}")),
        // The control API: mutual TLS with the node certificate (plain HTTP when TLS is off).
        ("DPUKV_CONTROL_LISTEN".to_string(), format!("0.0.0.0:{CONTROL_PORT}")),
        ("DPUKV_ZONE_DIR".to_string(), ZONES_DIR.to_string()),
    ]);
    if s.gateway.console.control_token_secret.is_some() {
        // The control API's admin token: the gateway's console acts with it.
        data.insert("DPUKV_ADMIN_TOKEN_FILE".into(), format!("{CONTROL_TOKEN_DIR}/token"));
    }
    if etcd_tls(c) {
        for (k, file) in [("DPUKV_ETCD_CA", "ca.crt"), ("DPUKV_ETCD_CERT", "tls.crt"), ("DPUKV_ETCD_KEY", "tls.key")] {
            data.insert(k.into(), format!("{ETCD_TLS_DIR}/{file}"));
        }
    }
    if let Some(keys) = s.regions.as_ref().and_then(|r| r.split_keys.as_ref()) {
        data.insert("DPUKV_SPLIT_KEYS".into(), keys.join(","));
    }
    if let Some(n) = s.regions.as_ref().and_then(|r| r.count) {
        data.insert("DPUKV_REGIONS".into(), n.to_string());
    }
    if let Some(t) = &s.telemetry {
        data.insert("OTEL_EXPORTER_OTLP_ENDPOINT".into(), t.otlp_endpoint.clone());
    }
    data
}

/// The label Kubernetes puts on a node for its zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Where a host finds the zones ConfigMap (a file per Kubernetes node, holding its zone).
pub const ZONES_DIR: &str = "/etc/dpukv/zones";

/// The zones ConfigMap's name: `NAME-zones`.
pub fn zones_config_name(c: &DpuKvCluster) -> String {
    format!("{}-zones", c.name_any())
}

/// The zones ConfigMap: each Kubernetes node's zone, by node name. Mounted in the node pods (a
/// volume, updated in place), where each host reads the file of the node it runs on
/// (`DPUKV_ZONE_DIR`, `DPUKV_K8S_NODE`) and registers with that zone: the master keeps a
/// region's copies in distinct zones.
pub fn zones_config_map(c: &DpuKvCluster, zones: BTreeMap<String, String>) -> ConfigMap {
    ConfigMap { metadata: meta(c, zones_config_name(c), "node"), data: Some(zones), ..Default::default() }
}

/// The node hosts' ConfigMap ([`node_config_data`]), named by its content
/// ([`node_config_name`]) and immutable: a container reads it into its environment when it
/// starts, so a pod restarting by itself mid-rollout (a crash, an eviction) reads the settings
/// of its own template, never those of one it has not been rolled to.
pub fn node_config_map(c: &DpuKvCluster) -> ConfigMap {
    ConfigMap {
        metadata: meta(c, node_config_name(c), "node"),
        data: Some(node_config_data(c)),
        immutable: Some(true),
        ..Default::default()
    }
}

/// A hash of a ConfigMap's data (FNV-1a 64 over its JSON, like [`pod_template_hash`]).
pub fn config_hash(cm: &ConfigMap) -> String {
    fnv(&serde_json::to_vec(&cm.data).unwrap_or_default())
}

/// The node pods: see the module documentation.
pub fn node_statefulset(c: &DpuKvCluster, dpu_available: bool) -> StatefulSet {
    let name = node_name(c);
    let dns = pod_host(c, "$(POD_NAME)");
    let device = uses_device(c, dpu_available);
    let s = &c.spec;
    let tls = s.tls.enabled();
    let node_index = env_field("DPUKV_NODE_INDEX", "metadata.labels['apps.kubernetes.io/pod-index']");
    let mut host_env = vec![
        env_field("POD_NAME", "metadata.name"),
        env_field("DPUKV_K8S_NODE", "spec.nodeName"),
        node_index.clone(),
        env("DPUKV_ADVERTISE_DEVICE", format!("{dns}:{DEVICE_PORT}")),
        env("DPUKV_ADVERTISE_REPLICATION", format!("{dns}:{REPLICATION_PORT}")),
    ];
    if let Some(f) = fabric(c) {
        host_env.push(env("DPUKV_ADVERTISE_FABRIC", format!("fabric://{}/{dns}:{}", f.provider, f.port)));
    }
    host_env.extend(node_tls_env(c));
    // Volumes: the data claim (the host writes it; the device maps its levels and log segments
    // read-only, at the same path: the host records absolute paths), the shared memory (both
    // write: the device its reader slots), a scratch /tmp each (the root file system is
    // read-only), the node Secret (both), the etcd client Secret (the host only).
    let mut host_mounts = vec![
        mount("data", "/var/lib/dpukv", false),
        mount("shm", "/dev/shm", false),
        mount("tmp", "/tmp", false),
        mount("zones", ZONES_DIR, true),
    ];
    let mut device_mounts =
        vec![mount("data", "/var/lib/dpukv", true), mount("shm", "/dev/shm", false), mount("tmp", "/tmp", false)];
    if tls {
        host_mounts.push(mount("tls", TLS_DIR, true));
        device_mounts.push(mount("tls", TLS_DIR, true));
    }
    if etcd_tls(c) {
        host_mounts.push(mount("etcd-tls", ETCD_TLS_DIR, true));
    }
    if c.spec.gateway.console.control_token_secret.is_some() {
        host_mounts.push(mount("control-token", CONTROL_TOKEN_DIR, true));
    }
    let host = Container {
        name: "host".into(),
        image: Some(image(c)),
        command: Some(vec![
            "dpukv-node".into(),
            "--data-dir".into(),
            DATA_DIR.into(),
            "--shm-dir".into(),
            SHM_DIR.into(),
            "--admin".into(),
            format!("0.0.0.0:{HOST_ADMIN_PORT}"),
        ]),
        env: Some(host_env),
        env_from: Some(
            [EnvFromSource {
                config_map_ref: Some(ConfigMapEnvSource { name: node_config_name(c), optional: None }),
                ..Default::default()
            }]
            .into_iter()
            // Backup credentials (docs/backup.md §7): the Secret's keys as the host's `AWS_*`.
            .chain(s.backup.as_ref().and_then(|b| b.credentials_secret.clone()).map(|name| EnvFromSource {
                secret_ref: Some(k8s_openapi::api::core::v1::SecretEnvSource { name, optional: None }),
                ..Default::default()
            }))
            .collect(),
        ),
        ports: Some(vec![
            port("replication", REPLICATION_PORT),
            port("host-admin", HOST_ADMIN_PORT),
            port("control", CONTROL_PORT),
        ]),
        readiness_probe: Some(http_probe("/readyz", HOST_ADMIN_PORT, 2)),
        liveness_probe: Some(http_probe("/healthz", HOST_ADMIN_PORT, 10)),
        resources: s.resources.host.clone(),
        volume_mounts: Some(host_mounts),
        security_context: Some(restricted_container()),
        ..Default::default()
    };
    let mut device_env = vec![node_index, env("DPUKV_LISTEN", format!("0.0.0.0:{DEVICE_PORT}"))];
    if let Some(t) = &s.telemetry {
        device_env.push(env("OTEL_EXPORTER_OTLP_ENDPOINT", t.otlp_endpoint.clone()));
    }
    // Hot keys (the device tracks each led region's popular keys and replicates them to its
    // backups' devices): as `hotKeys` says; off without it (capacity 0).
    match &s.hot_keys {
        Some(h) => {
            device_env.push(env("DPUKV_POPULAR_CAPACITY", if h.enabled { h.capacity } else { 0 }.to_string()));
            device_env.push(env("DPUKV_POPULAR_K", h.k.to_string()));
            device_env.push(env("DPUKV_POPULAR_WINDOW", h.window.to_string()));
        }
        None => device_env.push(env("DPUKV_POPULAR_CAPACITY", "0")),
    }
    device_env.extend(node_tls_env(c));
    // The front door (docs/gateway.md): the gateway's Redis and HTTP front ends in the device;
    // with TLS a gateway certificate of its own, with `auth` the gateway's tokens.
    let mut device_ports = vec![port("data", DEVICE_PORT), port("device-admin", DEVICE_ADMIN_PORT)];
    if let Some(f) = front_door(c) {
        device_env.extend([
            env("DPUKV_DEVICE_RESP", format!("0.0.0.0:{}", f.resp)),
            env("DPUKV_DEVICE_HTTP", format!("0.0.0.0:{}", f.http)),
            env("DPUKV_FRONT_THREADS", f.threads.to_string()),
        ]);
        if tls {
            device_env.extend([
                env("DPUKV_FRONT_TLS_CERT", format!("{FRONT_TLS_DIR}/front-{{node}}.crt")),
                env("DPUKV_FRONT_TLS_KEY", format!("{FRONT_TLS_DIR}/front-{{node}}.key")),
            ]);
            device_mounts.push(mount("front-tls", FRONT_TLS_DIR, true));
        }
        if s.auth.is_some() {
            device_env.push(env("DPUKV_TOKENS_FILE", format!("{AUTH_DIR}/tokens")));
            device_mounts.push(mount("auth", AUTH_DIR, true));
        }
        device_ports.extend([port("resp", f.resp), port("http", f.http)]);
    }
    // The fabric endpoint (docs/protocol.md §1.1): with the data port's TLS and roles.
    let mut device_security = restricted_container();
    if let Some(f) = fabric(c) {
        device_env.extend([
            env("DPUKV_FABRIC_LISTEN", format!("0.0.0.0:{}", f.port)),
            env("DPUKV_FABRIC_PROVIDER", f.provider.clone()),
        ]);
        device_ports.push(port("fabric", f.port));
        if f.lock_memory
            && let Some(caps) = device_security.capabilities.as_mut()
        {
            caps.add = Some(vec!["IPC_LOCK".into()]);
        }
    }
    if device {
        // Device mode: a container that got no DPU (or lost it) refuses to start, saying why.
        device_env.push(env("DPUKV_REQUIRE_DEVICE", "true"));
    }
    let mut device_resources = s.resources.device.clone().unwrap_or_default();
    if device {
        // One DPU from the device plugin: an extended resource is asked for in limits.
        let limits = device_resources.limits.get_or_insert_with(BTreeMap::new);
        limits.insert(s.device.resource_name.clone(), Quantity("1".into()));
    }
    if let Some(r) = fabric(c).and_then(|f| f.rdma_resource.as_ref()) {
        // One RDMA device (or share) from its device plugin.
        device_resources.limits.get_or_insert_with(BTreeMap::new).insert(r.clone(), Quantity("1".into()));
    }
    let device_container = Container {
        name: "device".into(),
        image: Some(image(c)),
        command: Some(vec![
            "dpukv-dpu".into(),
            "--shm-dir".into(),
            SHM_DIR.into(),
            "--admin".into(),
            format!("0.0.0.0:{DEVICE_ADMIN_PORT}"),
        ]),
        env: Some(device_env),
        ports: Some(device_ports),
        readiness_probe: Some(http_probe("/readyz", DEVICE_ADMIN_PORT, 2)),
        liveness_probe: Some(http_probe("/healthz", DEVICE_ADMIN_PORT, 10)),
        resources: (device_resources != ResourceRequirements::default()).then_some(device_resources),
        volume_mounts: Some(device_mounts),
        security_context: Some(device_security),
        ..Default::default()
    };
    let mut volumes = vec![
        Volume {
            name: "shm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(Quantity(s.shared_memory.size.clone())),
                ..Default::default()
            }),
            ..Default::default()
        },
        empty_dir("tmp"),
        // Optional: absent until some Kubernetes node has a zone.
        Volume {
            name: "zones".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: zones_config_name(c),
                optional: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    if tls {
        volumes.push(secret_volume("tls", &node_tls_secret(c)));
    }
    if let (Some(_), Some(a)) = (front_door(c), &s.auth) {
        volumes.push(secret_volume("auth", &a.tokens_secret));
    }
    if front_door(c).is_some() && tls {
        // Optional: while cert-manager has not issued it yet (or a user has not created it),
        // the pod starts — its host serves — and the device waits, restarting, for the files.
        let mut v = secret_volume("front-tls", &front_tls_secret(c));
        if let Some(src) = v.secret.as_mut() {
            src.optional = Some(true);
        }
        volumes.push(v);
    }
    if etcd_tls(c) {
        volumes.push(secret_volume("etcd-tls", &etcd_client_secret(c)));
    }
    if let Some(secret) = &c.spec.gateway.console.control_token_secret {
        volumes.push(secret_volume("control-token", secret));
    }
    let retention = |p: RetentionPolicy| match p {
        RetentionPolicy::Retain => "Retain".to_string(),
        RetentionPolicy::Delete => "Delete".to_string(),
    };
    let mut set = StatefulSet {
        metadata: meta(c, name.clone(), "node"),
        spec: StatefulSetSpec {
            replicas: Some(s.nodes),
            service_name: Some(name),
            selector: LabelSelector { match_labels: Some(selector(c, "node")), ..Default::default() },
            // Pods start together (the master places regions once they registered); the
            // operator restarts them itself, one at a time, for upgrades.
            pod_management_policy: Some("Parallel".into()),
            // Rolling updates held by a partition the controller lowers one pod at a time, once
            // that pod's primaries moved away (`controller`); rendered holding every pod.
            update_strategy: Some(StatefulSetUpdateStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateStatefulSetStrategy {
                    partition: Some(c.spec.nodes),
                    ..Default::default()
                }),
            }),
            persistent_volume_claim_retention_policy: Some(StatefulSetPersistentVolumeClaimRetentionPolicy {
                when_scaled: Some(retention(s.persistent_volume_claim_retention.when_scaled)),
                when_deleted: Some(retention(s.persistent_volume_claim_retention.when_deleted)),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels(c, "node")), ..Default::default() }),
                spec: Some(PodSpec {
                    // No shared process namespace: the device would see the host's processes
                    // (and through /proc/PID/root reach its files and Secrets). Reader slots of
                    // a device in another pid namespace are taken back by their heartbeat lease
                    // instead of by pid (docs/storage-format.md, "Liveness of a slot's owner").
                    containers: vec![host, device_container],
                    security_context: Some(restricted_pod()),
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    volumes: Some(volumes),
                    node_selector: (!s.node_selector.is_empty()).then(|| s.node_selector.clone()),
                    tolerations: (!s.tolerations.is_empty()).then(|| s.tolerations.clone()),
                    affinity: Some(s.affinity.clone().unwrap_or_else(|| default_affinity(c))),
                    topology_spread_constraints: Some(if s.topology_spread_constraints.is_empty() {
                        default_spread(c)
                    } else {
                        s.topology_spread_constraints.clone()
                    }),
                    priority_class_name: s.priority_class_name.clone(),
                    termination_grace_period_seconds: Some(60),
                    ..Default::default()
                }),
            },
            volume_claim_templates: Some(vec![data_claim(&s.storage.size, &s.storage.storage_class_name)]),
            ..Default::default()
        },
        ..Default::default()
    };
    let hash = pod_template_hash(&set);
    set.metadata.annotations = Some(BTreeMap::from([(POD_TEMPLATE_ANNOTATION.to_string(), hash)]));
    set
}

/// Node pods' affinity unless the resource gives one: preferably not two on one Kubernetes node
/// (a node lost would take two copies of some regions).
fn default_affinity(c: &DpuKvCluster) -> Affinity {
    Affinity {
        pod_anti_affinity: Some(PodAntiAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![WeightedPodAffinityTerm {
                weight: 100,
                pod_affinity_term: PodAffinityTerm {
                    label_selector: Some(LabelSelector {
                        match_labels: Some(selector(c, "node")),
                        ..Default::default()
                    }),
                    topology_key: "kubernetes.io/hostname".into(),
                    ..Default::default()
                },
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Node pods' spread unless the resource gives one: evenly over the zones, as far as the
/// scheduler can (`ScheduleAnyway`: a cluster in one zone still starts).
fn default_spread(c: &DpuKvCluster) -> Vec<TopologySpreadConstraint> {
    vec![TopologySpreadConstraint {
        max_skew: 1,
        topology_key: ZONE_LABEL.into(),
        when_unsatisfiable: "ScheduleAnyway".into(),
        label_selector: Some(LabelSelector { match_labels: Some(selector(c, "node")), ..Default::default() }),
        ..Default::default()
    }]
}

/// The node StatefulSet's annotation holding [`pod_template_hash`] of the template it was
/// applied with: the controller tells a changed template from the live one by it (the live
/// template carries the API server's defaults, so the two never compare equal).
pub const POD_TEMPLATE_ANNOTATION: &str = "dpukv.io/pod-template-hash";

/// A hash of a StatefulSet's pod template as rendered (FNV-1a 64 over its JSON: stable across
/// builds and Rust versions).
pub fn pod_template_hash(set: &StatefulSet) -> String {
    fnv(&serde_json::to_vec(&set.spec.template).unwrap_or_default())
}

/// FNV-1a 64 of `bytes`, as 16 hex digits.
fn fnv(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{h:016x}")
}

fn service_port(name: &str, p: i32) -> ServicePort {
    ServicePort { name: Some(name.into()), port: p, target_port: Some(IntOrString::Int(p)), ..Default::default() }
}

/// The front door in each device, if enabled.
pub fn front_door(c: &DpuKvCluster) -> Option<&FrontDoorSpec> {
    c.spec.front_door.as_ref().filter(|f| f.enabled)
}

/// The fabric endpoint in each device, if enabled.
pub fn fabric(c: &DpuKvCluster) -> Option<&FabricSpec> {
    c.spec.fabric.as_ref().filter(|f| f.enabled)
}

/// The node pods' headless Service: stable DNS names for every pod (published before they are
/// ready: a node must be reachable to catch up and become ready).
pub fn node_service(c: &DpuKvCluster) -> Service {
    Service {
        metadata: meta(c, node_name(c), "node"),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(selector(c, "node")),
            // Only what peers and clients dial (and the front door's ports): the admin (metrics)
            // and control ports are reached per pod, by monitoring and the operator, never
            // through this Service.
            ports: Some(
                [service_port("data", DEVICE_PORT), service_port("replication", REPLICATION_PORT)]
                    .into_iter()
                    .chain(
                        front_door(c)
                            .into_iter()
                            .flat_map(|f| [service_port("resp", f.resp), service_port("http", f.http)]),
                    )
                    .chain(fabric(c).map(|f| service_port("fabric", f.port)))
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The gateway pods.
pub fn gateway_deployment(c: &DpuKvCluster) -> Deployment {
    let s = &c.spec;
    let nodes = node_name(c);
    // Seeds: the first three node pods' devices, whatever `nodes` is (the gateway takes the map
    // from the first that answers and skips names that do not resolve): a scale must not change
    // the gateway's template — that would restart every gateway pod for nothing.
    let seeds: Vec<String> =
        (0..3).map(|i| format!("{}:{DEVICE_PORT}", pod_host(c, &format!("{nodes}-{i}")))).collect();
    let p = &s.gateway.ports;
    let mut vars = vec![
        env("DPUKV_SEEDS", seeds.join(",")),
        env("DPUKV_GATEWAY_LISTEN", format!("0.0.0.0:{}", p.binary)),
        env("DPUKV_GATEWAY_HTTP", format!("0.0.0.0:{}", p.http)),
        env("DPUKV_GATEWAY_RESP", format!("0.0.0.0:{}", p.resp)),
        env("DPUKV_GATEWAY_ADMIN", format!("0.0.0.0:{GATEWAY_ADMIN_PORT}")),
    ];
    let mut mounts = vec![mount("tmp", "/tmp", false)];
    let mut volumes = vec![empty_dir("tmp")];
    if s.tls.enabled() {
        // One certificate (role gateway, the cluster's CA) for the front ends and towards the
        // devices (mutual TLS); the front ends do not ask clients for one.
        vars.extend([
            env("DPUKV_TLS_CERT", format!("{TLS_DIR}/tls.crt")),
            env("DPUKV_TLS_KEY", format!("{TLS_DIR}/tls.key")),
            env("DPUKV_TLS_CA", format!("{TLS_DIR}/ca.crt")),
        ]);
        mounts.push(mount("tls", TLS_DIR, true));
        volumes.push(secret_volume("tls", &gateway_tls_secret(c)));
    }
    if let Some(a) = &s.auth {
        vars.push(env("DPUKV_TOKENS_FILE", format!("{AUTH_DIR}/tokens")));
        mounts.push(mount("auth", AUTH_DIR, true));
        volumes.push(secret_volume("auth", &a.tokens_secret));
    }
    if let Some(t) = &s.telemetry {
        vars.push(env("OTEL_EXPORTER_OTLP_ENDPOINT", t.otlp_endpoint.clone()));
    }
    if !s.gateway.console.enabled {
        vars.push(env("DPUKV_GATEWAY_NO_CONSOLE", "true".to_string()));
    }
    if let Some(secret) = &s.gateway.console.control_token_secret {
        vars.push(env("DPUKV_CONTROL_TOKEN_FILE", format!("{CONTROL_TOKEN_DIR}/token")));
        mounts.push(mount("control-token", CONTROL_TOKEN_DIR, true));
        volumes.push(secret_volume("control-token", secret));
    }
    let container = Container {
        name: "gateway".into(),
        image: Some(image(c)),
        command: Some(vec!["dpukv-gateway".into()]),
        env: Some(vars),
        ports: Some(vec![
            port("binary", p.binary),
            port("http", p.http),
            port("resp", p.resp),
            port("gateway-admin", GATEWAY_ADMIN_PORT),
        ]),
        readiness_probe: Some(http_probe("/readyz", GATEWAY_ADMIN_PORT, 2)),
        liveness_probe: Some(http_probe("/healthz", GATEWAY_ADMIN_PORT, 10)),
        volume_mounts: Some(mounts),
        security_context: Some(restricted_container()),
        ..Default::default()
    };
    Deployment {
        metadata: meta(c, gateway_name(c), "gateway"),
        spec: DeploymentSpec {
            replicas: Some(s.gateway.replicas),
            selector: LabelSelector { match_labels: Some(selector(c, "gateway")), ..Default::default() },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels(c, "gateway")), ..Default::default() }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: Some(volumes),
                    security_context: Some(restricted_pod()),
                    // It never calls the API server.
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The cluster's endpoint: the gateway's Service, named like the cluster.
pub fn gateway_service(c: &DpuKvCluster) -> Service {
    let p = &c.spec.gateway.ports;
    let type_ = match c.spec.gateway.service_type {
        ServiceType::ClusterIP => "ClusterIP",
        ServiceType::NodePort => "NodePort",
        ServiceType::LoadBalancer => "LoadBalancer",
    };
    Service {
        metadata: meta(c, c.name_any(), "gateway"),
        spec: Some(ServiceSpec {
            type_: Some(type_.into()),
            selector: Some(selector(c, "gateway")),
            ports: Some(vec![
                service_port("binary", p.binary),
                service_port("http", p.http),
                service_port("resp", p.resp),
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// At most one node pod down at a time by voluntary disruptions (drains, upgrades).
pub fn node_pdb(c: &DpuKvCluster) -> PodDisruptionBudget {
    pdb(c, node_name(c), "node")
}

/// The gateway pods' disruption budget: one voluntary eviction at a time (the Service keeps the
/// others).
pub fn gateway_pdb(c: &DpuKvCluster) -> PodDisruptionBudget {
    pdb(c, gateway_name(c), "gateway")
}

/// The managed etcd's disruption budget: one member evicted at a time (a quorum stays).
pub fn etcd_pdb(c: &DpuKvCluster) -> Option<PodDisruptionBudget> {
    c.spec.etcd.managed.as_ref()?;
    Some(pdb(c, etcd_name(c), "etcd"))
}

fn pdb(c: &DpuKvCluster, name: String, component: &str) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(c, name, component),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector { match_labels: Some(selector(c, component)), ..Default::default() }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Where the operator's pods run: the NetworkPolicies let them (and only them) reach the nodes'
/// control port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorPods {
    /// Their namespace.
    pub namespace: String,
    /// Labels that select them there.
    pub labels: BTreeMap<String, String>,
}

impl Default for OperatorPods {
    /// The chart's defaults (release namespace `dpukv-system`).
    fn default() -> Self {
        OperatorPods {
            namespace: "dpukv-system".into(),
            labels: BTreeMap::from([
                ("app.kubernetes.io/name".to_string(), "dpukv".to_string()),
                ("app.kubernetes.io/component".to_string(), "operator".to_string()),
            ]),
        }
    }
}

fn tcp(p: i32) -> NetworkPolicyPort {
    NetworkPolicyPort { protocol: Some("TCP".into()), port: Some(IntOrString::Int(p)), ..Default::default() }
}

fn pods_of(c: &DpuKvCluster, component: &str) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        pod_selector: Some(LabelSelector { match_labels: Some(selector(c, component)), ..Default::default() }),
        ..Default::default()
    }
}

fn ingress(from: Vec<NetworkPolicyPeer>, ports: &[i32]) -> NetworkPolicyIngressRule {
    NetworkPolicyIngressRule {
        from: (!from.is_empty()).then_some(from),
        ports: Some(ports.iter().copied().map(tcp).collect()),
    }
}

fn egress(to: Vec<NetworkPolicyPeer>, ports: Vec<NetworkPolicyPort>) -> NetworkPolicyEgressRule {
    NetworkPolicyEgressRule { to: (!to.is_empty()).then_some(to), ports: Some(ports) }
}

/// Name resolution, wherever the cluster's DNS runs (a Service, a node-local cache).
fn dns_egress() -> NetworkPolicyEgressRule {
    let port = |proto: &str| NetworkPolicyPort {
        protocol: Some(proto.into()),
        port: Some(IntOrString::Int(53)),
        ..Default::default()
    };
    egress(Vec::new(), vec![port("UDP"), port("TCP")])
}

/// The port of a URL (`scheme://host:port/...`), or `default`.
fn url_port(url: &str, default: i32) -> i32 {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or_default();
    authority.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or(default)
}

/// Traces leave for the OTLP endpoint's port (wherever it is).
fn otlp_egress(c: &DpuKvCluster) -> Option<NetworkPolicyEgressRule> {
    let t = c.spec.telemetry.as_ref()?;
    Some(egress(Vec::new(), vec![tcp(url_port(&t.otlp_endpoint, 4317))]))
}

fn monitoring(c: &DpuKvCluster) -> NetworkPolicyPeer {
    let n = &c.spec.network_policy;
    NetworkPolicyPeer {
        namespace_selector: Some(n.monitoring_namespace_selector.clone()),
        pod_selector: n.monitoring_pod_selector.clone(),
        ..Default::default()
    }
}

fn policy(
    c: &DpuKvCluster,
    name: String,
    component: &str,
    ing: Vec<NetworkPolicyIngressRule>,
    eg: Vec<NetworkPolicyEgressRule>,
) -> NetworkPolicy {
    NetworkPolicy {
        metadata: meta(c, name, component),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector { match_labels: Some(selector(c, component)), ..Default::default() }),
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: Some(ing),
            egress: Some(eg),
        }),
    }
}

/// The NetworkPolicies around the cluster's pods (`networkPolicy.enabled`; none when off): each
/// component's pods take in and send out only the flows of docs/security.md §3 —
/// - node pods: the device data port from the gateway and the other node pods (hot-key copies),
///   replication between node pods, the control port from the operator's pods, the metrics
///   ports from monitoring; out to the other node pods, etcd's client port, DNS and the OTLP
///   endpoint;
/// - gateway pods: the front ends from the clients (`networkPolicy.clients`, anyone when
///   absent), the metrics port from monitoring; out to the devices, DNS and the OTLP endpoint;
/// - managed etcd pods: the client port from the node pods, the peer port between members; out
///   to the members and DNS (the operator never connects to a managed etcd).
///
/// The kubelet's probes are not affected (traffic from a pod's node is always allowed).
pub fn network_policies(c: &DpuKvCluster, operator: &OperatorPods) -> Vec<NetworkPolicy> {
    let s = &c.spec;
    if !s.network_policy.enabled {
        return Vec::new();
    }
    let ns_of = |ns: &str| LabelSelector {
        match_labels: Some(BTreeMap::from([("kubernetes.io/metadata.name".to_string(), ns.to_string())])),
        ..Default::default()
    };
    let operator_pods = NetworkPolicyPeer {
        namespace_selector: Some(ns_of(&operator.namespace)),
        pod_selector: Some(LabelSelector { match_labels: Some(operator.labels.clone()), ..Default::default() }),
        ..Default::default()
    };
    let etcd_egress = match (&s.etcd.endpoints, &s.etcd.managed) {
        (Some(e), _) if !e.is_empty() => {
            let mut ports: Vec<i32> = e.iter().map(|u| url_port(u, ETCD_CLIENT_PORT)).collect();
            ports.sort_unstable();
            ports.dedup();
            egress(Vec::new(), ports.into_iter().map(tcp).collect())
        }
        _ => egress(vec![pods_of(c, "etcd")], vec![tcp(ETCD_CLIENT_PORT)]),
    };
    let mut node_out = vec![
        egress(vec![pods_of(c, "node")], vec![tcp(DEVICE_PORT), tcp(REPLICATION_PORT)]),
        etcd_egress,
        dns_egress(),
    ];
    node_out.extend(otlp_egress(c));
    // Who may reach the front ends: the gateway's, and each device's front door (anyone when
    // `networkPolicy.clients` is absent).
    let clients = s.network_policy.clients.clone().unwrap_or_default();
    let node = policy(
        c,
        node_name(c),
        "node",
        vec![
            ingress(vec![pods_of(c, "gateway"), pods_of(c, "node")], &[DEVICE_PORT]),
            ingress(vec![pods_of(c, "node")], &[REPLICATION_PORT]),
            // The control API: the operator, and the gateway's console (it reads with its
            // certificate, acts with the control token).
            ingress(
                std::iter::once(operator_pods)
                    .chain(s.gateway.console.enabled.then(|| pods_of(c, "gateway")))
                    .collect(),
                &[CONTROL_PORT],
            ),
            ingress(vec![monitoring(c)], &[HOST_ADMIN_PORT, DEVICE_ADMIN_PORT]),
        ]
        .into_iter()
        // The front door: from the gateway's clients, like the gateway's front ends.
        .chain(front_door(c).map(|f| ingress(clients.clone(), &[f.resp, f.http])))
        // The fabric endpoint: from the gateway's clients and the gateway (a policy covers the
        // `tcp` provider's traffic; RDMA bypasses the kernel's network stack, and with it
        // NetworkPolicies — the endpoint's roles and TLS still apply).
        .chain(fabric(c).map(|f| {
            let mut from = clients.clone();
            if !from.is_empty() {
                from.push(pods_of(c, "gateway"));
            }
            ingress(from, &[f.port])
        }))
        .collect(),
        node_out,
    );
    let p = &s.gateway.ports;
    let mut node_ports = vec![tcp(DEVICE_PORT)];
    if s.gateway.console.enabled {
        node_ports.push(tcp(CONTROL_PORT));
    }
    let mut gateway_out = vec![egress(vec![pods_of(c, "node")], node_ports), dns_egress()];
    gateway_out.extend(otlp_egress(c));
    let gateway = policy(
        c,
        gateway_name(c),
        "gateway",
        vec![ingress(clients, &[p.binary, p.http, p.resp]), ingress(vec![monitoring(c)], &[GATEWAY_ADMIN_PORT])],
        gateway_out,
    );
    let mut out = vec![node, gateway];
    if s.etcd.managed.is_some() {
        out.push(policy(
            c,
            etcd_name(c),
            "etcd",
            vec![
                ingress(vec![pods_of(c, "node")], &[ETCD_CLIENT_PORT]),
                ingress(vec![pods_of(c, "etcd")], &[ETCD_PEER_PORT]),
            ],
            vec![egress(vec![pods_of(c, "etcd")], vec![tcp(ETCD_PEER_PORT)]), dns_egress()],
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::DpuKvClusterSpec;

    fn cluster(spec: serde_json::Value) -> DpuKvCluster {
        let spec: DpuKvClusterSpec = serde_json::from_value(spec).expect("spec");
        let mut c = DpuKvCluster::new("demo", spec);
        c.metadata.namespace = Some("db".into());
        c.metadata.uid = Some("uid-1".into());
        c
    }

    fn base(mode: &str) -> DpuKvCluster {
        cluster(serde_json::json!({
            "nodes": 3, "storage": {"size": "10Gi", "storageClassName": "fast"},
            "etcd": {"endpoints": ["http://etcd:2379"]}, "device": {"mode": mode}
        }))
    }

    fn container<'a>(s: &'a StatefulSet, name: &str) -> &'a Container {
        let pod = s.spec.template.spec.as_ref().expect("pod");
        pod.containers.iter().find(|c| c.name == name).expect("container")
    }

    fn dpu_limit(c: &Container) -> Option<&Quantity> {
        c.resources.as_ref().and_then(|r| r.limits.as_ref()).and_then(|l| l.get("dpukv.io/dpu"))
    }

    fn env_of<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
        c.env.as_ref()?.iter().find(|e| e.name == name)?.value.as_deref()
    }

    /// A node host's setting from the node ConfigMap.
    fn config_of(c: &DpuKvCluster, name: &str) -> Option<String> {
        node_config_map(c).data?.get(name).cloned()
    }

    /// The ConfigMap the host container of `s` reads its settings from.
    fn config_ref(s: &StatefulSet) -> String {
        let from = container(s, "host").env_from.as_ref().expect("envFrom");
        assert_eq!(from.len(), 1);
        from[0].config_map_ref.as_ref().expect("a ConfigMap").name.clone()
    }

    /// `backup.credentialsSecret`: the Secret's keys reach the host container's environment
    /// (and nothing else's); without it, no Secret is named.
    #[test]
    fn backup_credentials_come_from_the_named_secret() {
        let mut c = base("Emulator");
        c.spec.backup = Some(crate::crd::BackupSpec { credentials_secret: Some("s3-creds".into()) });
        let s = node_statefulset(&c, false);
        let from = container(&s, "host").env_from.clone().expect("envFrom");
        assert_eq!(from[1].secret_ref.as_ref().map(|r| r.name.as_str()), Some("s3-creds"), "{from:?}");
        assert!(container(&s, "device").env_from.iter().flatten().all(|f| f.secret_ref.is_none()));
        c.spec.backup = None;
        assert_eq!(config_ref(&node_statefulset(&c, false)), node_config_name(&c));
    }

    #[test]
    fn node_hosts_read_their_cluster_wide_settings_from_a_config_map_and_their_own_from_env() {
        let c = base("Emulator");
        let cm = node_config_map(&c);
        let name = format!("demo-node-config-{}", &config_hash(&cm)[..10]);
        assert_eq!(cm.metadata.name.as_deref(), Some(name.as_str()), "named by its content");
        assert_eq!(cm.immutable, Some(true));
        assert_eq!(cm.metadata.namespace.as_deref(), Some("db"));
        assert_eq!(cm.metadata.labels.as_ref().expect("labels")["app.kubernetes.io/component"], "node");
        let owner = &cm.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!((owner.kind.as_str(), owner.controller), ("DpuKvCluster", Some(true)));
        let data = cm.data.clone().expect("data");
        let keys: Vec<&str> = data.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "DPUKV_BACKUP_INDEX",
                "DPUKV_CLUSTER",
                "DPUKV_CONTROL_LISTEN",
                "DPUKV_ETCD",
                "DPUKV_FSYNC",
                "DPUKV_REPLICATION_FACTOR",
                "DPUKV_REPLICATION_LISTEN",
                "DPUKV_ZONE_DIR"
            ],
            "no split keys or OTLP endpoint unless set"
        );
        assert_eq!((data["DPUKV_CLUSTER"].as_str(), data["DPUKV_BACKUP_INDEX"].as_str()), ("db.demo", "send"));
        let s = node_statefulset(&c, false);
        assert_eq!(config_ref(&s), name);
        let host = container(&s, "host");
        let env: Vec<&str> = host.env.as_ref().expect("env").iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            env,
            [
                "POD_NAME",
                "DPUKV_K8S_NODE",
                "DPUKV_NODE_INDEX",
                "DPUKV_ADVERTISE_DEVICE",
                "DPUKV_ADVERTISE_REPLICATION",
                "DPUKV_TLS_CERT",
                "DPUKV_TLS_KEY",
                "DPUKV_TLS_CA",
                "DPUKV_TLS_CLIENT_AUTH"
            ]
        );
        // Set, they are there too.
        let full = cluster(serde_json::json!({
            "nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}}, "fsync": "interval:5",
            "regions": {"splitKeys": ["g", "p"]}, "telemetry": {"otlpEndpoint": "http://otel:4317"}
        }));
        assert_eq!(config_of(&full, "DPUKV_SPLIT_KEYS").as_deref(), Some("g,p"));
        assert_eq!(config_of(&full, "OTEL_EXPORTER_OTLP_ENDPOINT").as_deref(), Some("http://otel:4317"));
        assert_eq!(config_of(&full, "DPUKV_FSYNC").as_deref(), Some("interval:5"));
    }

    /// A changed setting is a new ConfigMap name, so a changed pod template (its `envFrom`): the
    /// controller rolls it out pod by pod like a new version; an unchanged one changes nothing.
    #[test]
    fn a_changed_node_setting_is_a_new_config_map_and_a_changed_pod_template() {
        let c = base("Emulator");
        let s = node_statefulset(&c, false);
        assert_eq!(config_ref(&s), node_config_name(&c));
        assert_eq!(node_config_name(&c), node_config_name(&c.clone()), "stable");
        assert_eq!(pod_template_hash(&s), pod_template_hash(&node_statefulset(&c, false)), "stable");
        let mut changed = c.clone();
        changed.spec.fsync = "never".into();
        let t = node_statefulset(&changed, false);
        assert_ne!(node_config_name(&changed), node_config_name(&c), "a new ConfigMap");
        assert_eq!(config_ref(&t), node_config_name(&changed));
        assert_ne!(pod_template_hash(&t), pod_template_hash(&s), "a new pod template");
        // A change outside the settings (the version) keeps the ConfigMap.
        let mut upgraded = c.clone();
        upgraded.spec.version = "9.9.9".into();
        assert_eq!(node_config_name(&upgraded), node_config_name(&c));
    }

    #[test]
    fn the_device_mode_decides_whether_a_dpu_is_requested() {
        let device = node_statefulset(&base("Device"), false);
        assert_eq!(dpu_limit(container(&device, "device")), Some(&Quantity("1".into())));
        let emulator = node_statefulset(&base("Emulator"), true);
        assert_eq!(dpu_limit(container(&emulator, "device")), None);
        assert!(dpu_limit(container(&node_statefulset(&base("Auto"), true), "device")).is_some());
        assert!(dpu_limit(container(&node_statefulset(&base("Auto"), false), "device")).is_none());
        // The host never asks for the device.
        assert!(dpu_limit(container(&device, "host")).is_none());
        // With a DPU, the device container refuses to start without one.
        assert_eq!(env_of(container(&device, "device"), "DPUKV_REQUIRE_DEVICE"), Some("true"));
        assert_eq!(env_of(container(&emulator, "device"), "DPUKV_REQUIRE_DEVICE"), None);
    }

    /// Every field of the spec reaches the pods: `hotKeys` the device's popularity settings (off:
    /// capacity 0), `regions.count` the hosts' first layout.
    #[test]
    fn hot_keys_and_a_region_count_reach_the_pods() {
        let c = cluster(
            serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"endpoints": ["http://e:2379"]},
            "regions": {"count": 64}, "hotKeys": {"enabled": true, "capacity": 500, "k": 8, "window": 2000}}),
        );
        assert_eq!(config_of(&c, "DPUKV_REGIONS").as_deref(), Some("64"));
        let set = node_statefulset(&c, false);
        let device = container(&set, "device");
        assert_eq!(env_of(device, "DPUKV_POPULAR_CAPACITY"), Some("500"));
        assert_eq!(env_of(device, "DPUKV_POPULAR_K"), Some("8"));
        assert_eq!(env_of(device, "DPUKV_POPULAR_WINDOW"), Some("2000"));
        let off = cluster(
            serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"endpoints": ["http://e:2379"]},
            "hotKeys": {"enabled": false}}),
        );
        assert_eq!(env_of(container(&node_statefulset(&off, false), "device"), "DPUKV_POPULAR_CAPACITY"), Some("0"));
        let none = base("Emulator");
        assert_eq!(
            env_of(container(&node_statefulset(&none, false), "device"), "DPUKV_POPULAR_CAPACITY"),
            Some("0"),
            "off without hotKeys"
        );
        assert_eq!(config_of(&none, "DPUKV_REGIONS"), None);
    }

    /// Zones: the hosts read their Kubernetes node's zone from the zones ConfigMap (mounted,
    /// optional) by the node name the downward API gives; without the resource's own, node pods
    /// prefer distinct hosts and spread over zones.
    #[test]
    fn node_pods_find_their_zone_and_spread_over_zones_by_default() {
        let c = base("Emulator");
        let zones = zones_config_map(&c, BTreeMap::from([("worker-1".to_string(), "zone-a".to_string())]));
        assert_eq!(zones.metadata.name.as_deref(), Some("demo-zones"));
        assert_eq!(zones.data.as_ref().expect("data")["worker-1"], "zone-a");
        assert_eq!(config_of(&c, "DPUKV_ZONE_DIR").as_deref(), Some(ZONES_DIR));
        let s = node_statefulset(&c, false);
        let host = container(&s, "host");
        let node = host.env.as_ref().expect("env").iter().find(|e| e.name == "DPUKV_K8S_NODE").expect("node name");
        let field = node.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).expect("downward API");
        assert_eq!(field.field_path, "spec.nodeName");
        assert!(
            host.volume_mounts
                .as_ref()
                .expect("mounts")
                .iter()
                .any(|m| m.mount_path == ZONES_DIR && m.read_only == Some(true))
        );
        let pod = s.spec.template.spec.as_ref().expect("pod");
        let v = pod.volumes.as_ref().expect("volumes").iter().find(|v| v.name == "zones").expect("zones volume");
        let cm = v.config_map.as_ref().expect("a configMap volume");
        assert_eq!((cm.name.as_str(), cm.optional), ("demo-zones", Some(true)));
        let spread = &pod.topology_spread_constraints.as_ref().expect("spread")[0];
        assert_eq!((spread.topology_key.as_str(), spread.when_unsatisfiable.as_str()), (ZONE_LABEL, "ScheduleAnyway"));
        let anti = pod.affinity.as_ref().and_then(|a| a.pod_anti_affinity.as_ref()).expect("anti-affinity");
        let term = &anti.preferred_during_scheduling_ignored_during_execution.as_ref().expect("preferred")[0];
        assert_eq!(term.pod_affinity_term.topology_key, "kubernetes.io/hostname");
        // The resource's own win.
        let own = cluster(
            serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"endpoints": ["http://e:2379"]},
            "topologySpreadConstraints": [{"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule"}],
            "affinity": {}}),
        );
        let pod = node_statefulset(&own, false).spec.template.spec.expect("pod");
        assert_eq!(pod.topology_spread_constraints.expect("spread")[0].topology_key, "rack");
        assert!(pod.affinity.expect("affinity").pod_anti_affinity.is_none());
    }

    #[test]
    fn node_pods_share_memory_not_processes_and_keep_their_volume() {
        let c = base("Emulator");
        let s = node_statefulset(&c, false);
        let spec = &s.spec;
        assert_eq!(spec.replicas, Some(3));
        assert_eq!(spec.service_name.as_deref(), Some("demo-node"));
        let pod = spec.template.spec.as_ref().expect("pod");
        assert_eq!(pod.share_process_namespace, None, "the device sees none of the host's processes");
        let shm = pod.volumes.as_ref().expect("volumes").iter().find(|v| v.name == "shm").expect("shm");
        assert_eq!(shm.empty_dir.as_ref().and_then(|e| e.medium.as_deref()), Some("Memory"));
        for name in ["host", "device"] {
            let mounts = container(&s, name).volume_mounts.as_ref().expect("mounts");
            assert!(mounts.iter().any(|m| m.name == "shm"), "{name} mounts the shared memory");
        }
        // The device maps the host's levels and log segments at the host's paths, read-only.
        let data = |name| {
            let m = container(&s, name).volume_mounts.as_ref().expect("m");
            m.iter().find(|m| m.name == "data").map(|m| (m.mount_path.clone(), m.read_only))
        };
        assert_eq!(data("host"), Some(("/var/lib/dpukv".to_string(), Some(false))));
        assert_eq!(data("device"), Some(("/var/lib/dpukv".to_string(), Some(true))));
        let claim = &spec.volume_claim_templates.as_ref().expect("claims")[0];
        assert_eq!(claim.spec.as_ref().and_then(|s| s.storage_class_name.as_deref()), Some("fast"));
        let strategy = spec.update_strategy.as_ref().expect("strategy");
        assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
        assert_eq!(strategy.rolling_update.as_ref().and_then(|r| r.partition), Some(3), "every pod held");
        let host = container(&s, "host");
        assert_eq!(env_of(host, "DPUKV_ADVERTISE_DEVICE"), Some("$(POD_NAME).demo-node.db.svc:7070"));
        assert_eq!(config_of(&c, "DPUKV_CLUSTER").as_deref(), Some("db.demo"));
        assert_eq!(config_of(&c, "DPUKV_ETCD").as_deref(), Some("http://etcd:2379"));
        // Owned by the resource, labelled as its node component.
        let owner = &s.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!((owner.kind.as_str(), owner.controller), ("DpuKvCluster", Some(true)));
        assert_eq!(node_pdb(&c).spec.and_then(|s| s.max_unavailable), Some(IntOrString::Int(1)));
    }

    #[test]
    fn a_managed_etcd_is_a_statefulset_of_members_that_know_each_other() {
        assert!(etcd_statefulset(&base("Emulator")).is_none() && etcd_service(&base("Emulator")).is_none());
        let c = cluster(serde_json::json!({
            "nodes": 3, "storage": {"size": "10Gi"}, "etcd": {"managed": {"replicas": 3, "storage": "2Gi"}}
        }));
        let s = etcd_statefulset(&c).expect("managed");
        assert_eq!((s.spec.replicas, s.spec.pod_management_policy.as_deref()), (Some(3), Some("Parallel")));
        assert_eq!(s.spec.service_name.as_deref(), Some("demo-etcd"));
        let etcd = container(&s, "etcd");
        let args = etcd.args.as_ref().expect("args");
        let initial = args.iter().find(|a| a.starts_with("--initial-cluster=")).expect("initial cluster");
        for i in 0..3 {
            assert!(
                initial.contains(&format!("demo-etcd-{i}=https://demo-etcd-{i}.demo-etcd.db.svc:2380")),
                "{initial}"
            );
        }
        assert!(args.contains(&"--name=$(POD_NAME)".to_string()));
        let claim = &s.spec.volume_claim_templates.as_ref().expect("claims")[0];
        let retention = s.spec.persistent_volume_claim_retention_policy.as_ref().expect("a retention policy");
        assert_eq!(retention.when_deleted.as_deref(), Some("Delete"), "a reused name must not revive old metadata");
        let size = claim.spec.as_ref().and_then(|s| s.resources.as_ref()).and_then(|r| r.requests.as_ref());
        assert_eq!(size.and_then(|r| r.get("storage")), Some(&Quantity("2Gi".into())));
        let pod = s.spec.template.spec.as_ref().expect("pod");
        assert_eq!(pod.security_context.as_ref().and_then(|p| p.run_as_non_root), Some(true));
        let svc = etcd_service(&c).expect("service");
        assert_eq!(svc.spec.as_ref().and_then(|s| s.publish_not_ready_addresses), Some(true), "peers find each other");
        // The nodes use it.
        assert_eq!(config_of(&c, "DPUKV_ETCD").as_deref(), Some("https://demo-etcd.db.svc:2379"));
    }

    #[test]
    fn the_gateway_gets_tls_tokens_and_its_service_type() {
        let c = cluster(serde_json::json!({
            "nodes": 5, "storage": {"size": "1Gi"}, "etcd": {"managed": {}},
            "tls": {"clusterSecret": "ctls", "gatewaySecret": "gtls", "operatorSecret": "otls"}, "auth": {"tokensSecret": "tok"},
            "gateway": {"serviceType": "LoadBalancer", "replicas": 3}
        }));
        let d = gateway_deployment(&c);
        let spec = &d.spec;
        assert_eq!(spec.replicas, Some(3));
        let pod = spec.template.spec.as_ref().expect("pod");
        let names: Vec<&str> = pod.volumes.as_ref().expect("volumes").iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["tmp", "tls", "auth"]);
        let seeds =
            pod.containers[0].env.as_ref().expect("env").iter().find(|e| e.name == "DPUKV_SEEDS").expect("seeds");
        assert_eq!(seeds.value.as_deref().map(|v| v.split(',').count()), Some(3));
        // A scale changes nothing in the gateway's pods (they would all restart).
        let mut scaled = c.clone();
        scaled.spec.nodes = 2;
        assert_eq!(gateway_deployment(&scaled).spec, d.spec, "a scale leaves the gateway's template alone");
        let svc = gateway_service(&c);
        assert_eq!(svc.metadata.name.as_deref(), Some("demo"));
        assert_eq!(svc.spec.as_ref().and_then(|s| s.type_.as_deref()), Some("LoadBalancer"));
        let node = node_statefulset(&c, false);
        assert_eq!(config_of(&c, "DPUKV_ETCD").as_deref(), Some("https://demo-etcd.db.svc:2379"));
        assert_eq!(env_of(container(&node, "device"), "DPUKV_TLS_CLIENT_AUTH"), Some("true"));
        assert_eq!(selector_string(&c), "app.kubernetes.io/component=node,app.kubernetes.io/instance=demo");
    }
    /// Issue 26: TLS is on by default — each node process takes its own pair from the node Secret
    /// by its id (`{node}`), and a managed etcd speaks mutual TLS with its own CA, its client
    /// certificate mounted in the host container only.
    #[test]
    fn node_pods_take_their_own_pair_by_node_id_and_reach_etcd_over_mutual_tls() {
        let c = cluster(serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}}}));
        let s = node_statefulset(&c, false);
        for name in ["host", "device"] {
            let ct = container(&s, name);
            assert_eq!(env_of(ct, "DPUKV_TLS_CERT"), Some("/etc/dpukv/tls/node-{node}.crt"), "{name}");
            assert_eq!(env_of(ct, "DPUKV_TLS_KEY"), Some("/etc/dpukv/tls/node-{node}.key"), "{name}");
            assert_eq!(env_of(ct, "DPUKV_TLS_CA"), Some("/etc/dpukv/tls/ca.crt"), "{name}");
            assert_eq!(env_of(ct, "DPUKV_TLS_CLIENT_AUTH"), Some("true"), "{name}");
            assert!(ct.env.as_ref().expect("env").iter().any(|e| e.name == "DPUKV_NODE_INDEX"), "{name}: its id");
        }
        let pod = s.spec.template.spec.as_ref().expect("pod");
        let secret_of = |v: &str| {
            let vol = pod.volumes.as_ref().expect("volumes").iter().find(|x| x.name == v).expect("volume");
            vol.secret.as_ref().and_then(|x| x.secret_name.clone())
        };
        assert_eq!(secret_of("tls").as_deref(), Some("demo-node-tls"));
        assert_eq!(secret_of("etcd-tls").as_deref(), Some("demo-etcd-client"));
        let mounts = |name| -> Vec<String> {
            container(&s, name).volume_mounts.as_ref().expect("m").iter().map(|m| m.name.clone()).collect()
        };
        assert!(mounts("host").contains(&"etcd-tls".to_string()));
        assert!(!mounts("device").contains(&"etcd-tls".to_string()), "the device never talks to etcd");
        for (k, v) in [
            ("DPUKV_ETCD", "https://demo-etcd.db.svc:2379"),
            ("DPUKV_ETCD_CA", "/etc/dpukv/etcd/ca.crt"),
            ("DPUKV_ETCD_CERT", "/etc/dpukv/etcd/tls.crt"),
            ("DPUKV_ETCD_KEY", "/etc/dpukv/etcd/tls.key"),
            ("DPUKV_CONTROL_LISTEN", "0.0.0.0:9103"),
        ] {
            assert_eq!(config_of(&c, k).as_deref(), Some(v), "{k}");
        }
        let etcd = etcd_statefulset(&c).expect("managed");
        let args = container(&etcd, "etcd").args.clone().expect("args");
        for a in [
            "--client-cert-auth",
            "--peer-client-cert-auth",
            "--trusted-ca-file=/etc/etcd/tls/ca.crt",
            "--peer-trusted-ca-file=/etc/etcd/tls/ca.crt",
            "--listen-client-urls=https://0.0.0.0:2379",
            "--listen-peer-urls=https://0.0.0.0:2380",
        ] {
            assert!(args.contains(&a.to_string()), "{a} in {args:?}");
        }
        let epod = etcd.spec.template.spec.as_ref().expect("pod");
        assert_eq!(
            epod.volumes.as_ref().and_then(|v| v[0].secret.as_ref()).and_then(|x| x.secret_name.as_deref()),
            Some("demo-etcd-tls")
        );
        // The gateway's own certificate.
        let g = gateway_deployment(&c);
        let gc = &g.spec.template.spec.as_ref().expect("pod").containers[0];
        assert_eq!(env_of(gc, "DPUKV_TLS_CERT"), Some("/etc/dpukv/tls/tls.crt"));
        assert_eq!(env_of(gc, "DPUKV_TLS_CLIENT_AUTH"), None, "the front ends ask no client certificate");
    }

    /// An external etcd that asks for client certificates (issue 26, item 3): `etcd.clientSecret`
    /// is mounted in the host container only and named in the node configuration; the
    /// endpoints are the user's; no etcd certificate of the operator's is involved.
    #[test]
    fn an_external_etcd_is_reached_over_tls_with_the_client_secret_given() {
        let c = cluster(serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"},
            "etcd": {"endpoints": ["https://etcd.infra.svc:2379"], "clientSecret": "infra-etcd-client"}}));
        assert!(etcd_tls(&c) && !managed_etcd_tls(&c));
        let s = node_statefulset(&c, false);
        let pod = s.spec.template.spec.as_ref().expect("pod");
        let vol = pod.volumes.as_ref().expect("volumes").iter().find(|x| x.name == "etcd-tls").expect("etcd-tls");
        assert_eq!(vol.secret.as_ref().and_then(|x| x.secret_name.as_deref()), Some("infra-etcd-client"));
        let mounts = |name| -> Vec<String> {
            container(&s, name).volume_mounts.as_ref().expect("m").iter().map(|m| m.name.clone()).collect()
        };
        assert!(mounts("host").contains(&"etcd-tls".to_string()));
        assert!(!mounts("device").contains(&"etcd-tls".to_string()), "the device never talks to etcd");
        for (k, v) in [
            ("DPUKV_ETCD", "https://etcd.infra.svc:2379"),
            ("DPUKV_ETCD_CA", "/etc/dpukv/etcd/ca.crt"),
            ("DPUKV_ETCD_CERT", "/etc/dpukv/etcd/tls.crt"),
            ("DPUKV_ETCD_KEY", "/etc/dpukv/etcd/tls.key"),
        ] {
            assert_eq!(config_of(&c, k).as_deref(), Some(v), "{k}");
        }
        assert!(etcd_statefulset(&c).is_none());
        // Without the Secret, plain as before.
        let plain = cluster(serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"},
            "etcd": {"endpoints": ["http://etcd.infra.svc:2379"]}}));
        assert!(!etcd_tls(&plain));
        assert_eq!(config_of(&plain, "DPUKV_ETCD_CA"), None);
    }

    /// Plain text only when asked for: no certificate anywhere, etcd over http.
    #[test]
    fn plain_text_is_an_explicit_opt_in() {
        let c = cluster(serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}},
                                           "tls": {"mode": "Disabled"}}));
        let s = node_statefulset(&c, false);
        assert_eq!(env_of(container(&s, "host"), "DPUKV_TLS_CERT"), None);
        assert_eq!(config_of(&c, "DPUKV_ETCD").as_deref(), Some("http://demo-etcd.db.svc:2379"));
        assert_eq!(config_of(&c, "DPUKV_ETCD_CA"), None);
        let etcd = etcd_statefulset(&c).expect("managed");
        assert!(!container(&etcd, "etcd").args.as_ref().expect("args").contains(&"--client-cert-auth".to_string()));
    }

    /// Issue 26: every pod the operator makes passes Pod Security `restricted` and mounts no
    /// service-account token (scripts/check-pod-security.py checks every control; this the
    /// settings that make them pass).
    #[test]
    fn every_pod_runs_as_non_root_with_nothing_to_escalate_and_no_token() {
        let c = cluster(serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}}}));
        let node = node_statefulset(&c, false).spec.template;
        let gateway = gateway_deployment(&c).spec.template;
        let etcd = etcd_statefulset(&c).expect("etcd").spec.template;
        for t in [node, gateway, etcd] {
            let pod = t.spec.expect("pod");
            assert_eq!(pod.automount_service_account_token, Some(false));
            let sc = pod.security_context.expect("pod security context");
            assert_eq!((sc.run_as_non_root, sc.run_as_user, sc.fs_group), (Some(true), Some(RUN_AS), Some(RUN_AS)));
            assert_eq!(sc.seccomp_profile.map(|p| p.type_).as_deref(), Some("RuntimeDefault"));
            for ct in &pod.containers {
                let sc = ct.security_context.clone().expect("container security context");
                assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", ct.name);
                assert_eq!(sc.read_only_root_filesystem, Some(true), "{}", ct.name);
                assert_eq!(sc.capabilities.and_then(|c| c.drop), Some(vec!["ALL".to_string()]), "{}", ct.name);
            }
        }
        // The admin (metrics) port is on no Service; the headless one carries what peers dial.
        let ports: Vec<i32> =
            node_service(&c).spec.and_then(|s| s.ports).expect("ports").iter().map(|p| p.port).collect();
        assert_eq!(ports, [DEVICE_PORT, REPLICATION_PORT]);
    }

    /// Issue 26: NetworkPolicies (on by default) let in only the cluster's flows.
    #[test]
    fn network_policies_let_in_only_the_cluster_s_flows() {
        let c = cluster(serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}}}));
        let ops = OperatorPods::default();
        let p = network_policies(&c, &ops);
        let names: Vec<&str> = p.iter().filter_map(|p| p.metadata.name.as_deref()).collect();
        assert_eq!(names, ["demo-node", "demo-gateway", "demo-etcd"]);
        let ports = |r: &NetworkPolicyIngressRule| -> Vec<i32> {
            r.ports
                .iter()
                .flatten()
                .filter_map(|p| match p.port {
                    Some(IntOrString::Int(n)) => Some(n),
                    _ => None,
                })
                .collect()
        };
        let node = p[0].spec.clone().expect("spec");
        assert_eq!(node.policy_types, Some(vec!["Ingress".to_string(), "Egress".to_string()]));
        let ingress = node.ingress.expect("ingress");
        let control = ingress.iter().find(|r| ports(r) == [CONTROL_PORT]).expect("a control port rule");
        let from = &control.from.as_ref().expect("from")[0];
        let ns = from.namespace_selector.as_ref().and_then(|s| s.match_labels.as_ref()).expect("namespace");
        assert_eq!(ns["kubernetes.io/metadata.name"], "dpukv-system", "only the operator's namespace");
        assert_eq!(from.pod_selector.as_ref().and_then(|s| s.match_labels.clone()), Some(ops.labels.clone()));
        let metrics = ingress.iter().find(|r| ports(r) == [HOST_ADMIN_PORT, DEVICE_ADMIN_PORT]).expect("metrics");
        let m = &metrics.from.as_ref().expect("from")[0];
        assert_eq!(
            m.namespace_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .map(|l| l["kubernetes.io/metadata.name"].clone()),
            Some("monitoring".to_string())
        );
        // Every ingress rule names who may come: nothing is open to all but the gateway's front ends.
        assert!(ingress.iter().all(|r| r.from.is_some()));
        let gw = p[1].spec.clone().expect("spec").ingress.expect("ingress");
        assert!(gw.iter().any(|r| r.from.is_none() && ports(r) == [7379, 8080, 6379]));
        // Off: none.
        let mut off = c.clone();
        off.spec.network_policy.enabled = false;
        assert!(network_policies(&off, &ops).is_empty());
        // The console: the gateway reaches the hosts' control API (and only with the console on).
        let gateway_pods = pods_of(&c, "gateway");
        assert!(control.from.as_ref().expect("from").contains(&gateway_pods), "the console's gateway reads");
        let out = p[1].spec.clone().expect("spec").egress.expect("egress");
        assert!(out.iter().any(|r| r.ports.iter().flatten().any(|p| p.port == Some(IntOrString::Int(CONTROL_PORT)))));
        let mut quiet = c.clone();
        quiet.spec.gateway.console.enabled = false;
        let p = network_policies(&quiet, &ops);
        let ingress = p[0].spec.clone().expect("spec").ingress.expect("ingress");
        let control = ingress.iter().find(|r| ports(r) == [CONTROL_PORT]).expect("a control port rule");
        assert!(!control.from.as_ref().expect("from").contains(&gateway_pods), "no console: no gateway");
        let out = p[1].spec.clone().expect("spec").egress.expect("egress");
        assert!(!out.iter().any(|r| r.ports.iter().flatten().any(|p| p.port == Some(IntOrString::Int(CONTROL_PORT)))));
    }

    /// Issue 31: the console's control token — the hosts take it as their admin token, the
    /// gateway acts with it; and the console can be turned off.
    #[test]
    fn the_console_s_control_token_reaches_the_hosts_and_the_gateway() {
        let c = cluster(serde_json::json!({
            "nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}},
            "gateway": {"console": {"controlTokenSecret": "ctl"}}, "auth": {"tokensSecret": "tok"}
        }));
        assert_eq!(config_of(&c, "DPUKV_ADMIN_TOKEN_FILE").as_deref(), Some("/etc/dpukv/control/token"));
        let set = node_statefulset(&c, false);
        let host = container(&set, "host");
        assert!(host.volume_mounts.iter().flatten().any(|m| m.name == "control-token" && m.read_only == Some(true)));
        assert!(!container(&set, "device").volume_mounts.iter().flatten().any(|m| m.name == "control-token"));
        let pod = set.spec.template.spec.as_ref().expect("pod");
        let vol = pod.volumes.iter().flatten().find(|v| v.name == "control-token").expect("volume");
        assert_eq!(vol.secret.as_ref().and_then(|s| s.secret_name.as_deref()), Some("ctl"));
        let d = gateway_deployment(&c);
        let gw = &d.spec.template.spec.as_ref().expect("pod").containers[0];
        assert_eq!(
            gw.env.iter().flatten().find(|e| e.name == "DPUKV_CONTROL_TOKEN_FILE").and_then(|e| e.value.as_deref()),
            Some("/etc/dpukv/control/token")
        );
        assert!(!gw.env.iter().flatten().any(|e| e.name == "DPUKV_GATEWAY_NO_CONSOLE"));
        // None: no token anywhere; off: the gateway is told.
        let plain = cluster(serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}}}));
        assert_eq!(config_of(&plain, "DPUKV_ADMIN_TOKEN_FILE"), None);
        let mut off = plain.clone();
        off.spec.gateway.console.enabled = false;
        let d = gateway_deployment(&off);
        let gw = &d.spec.template.spec.as_ref().expect("pod").containers[0];
        assert!(
            gw.env.iter().flatten().any(|e| e.name == "DPUKV_GATEWAY_NO_CONSOLE" && e.value.as_deref() == Some("true"))
        );
    }

    /// `frontDoor` (issue 29): every node's device serves the Redis protocol and HTTP on its
    /// ports — in the container, the node Service and a NetworkPolicy rule open to the clients —,
    /// with TLS a gateway certificate of its own (`front-{node}` in the node Secret) and with
    /// `auth` the gateway's tokens; none of it when absent or disabled.
    #[test]
    fn a_fabric_endpoint_is_served_by_every_device_and_registered_by_its_host() {
        let c = cluster(serde_json::json!({
            "nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}},
            "fabric": {"enabled": true, "provider": "verbs", "rdmaResource": "rdma/hca_shared_devices_a", "lockMemory": true}
        }));
        let set = node_statefulset(&c, false);
        let dev = container(&set, "device");
        assert_eq!(env_of(dev, "DPUKV_FABRIC_LISTEN"), Some("0.0.0.0:7075"));
        assert_eq!(env_of(dev, "DPUKV_FABRIC_PROVIDER"), Some("verbs"));
        assert_eq!(
            env_of(container(&set, "host"), "DPUKV_ADVERTISE_FABRIC"),
            Some("fabric://verbs/$(POD_NAME).demo-node.db.svc:7075"),
            "the host registers its device's endpoint at the pod's stable name"
        );
        assert!(dev.ports.iter().flatten().any(|p| p.name.as_deref() == Some("fabric") && p.container_port == 7075));
        let limits = dev.resources.as_ref().and_then(|r| r.limits.clone()).unwrap_or_default();
        assert_eq!(limits.get("rdma/hca_shared_devices_a").map(|q| q.0.as_str()), Some("1"));
        let caps = dev.security_context.as_ref().and_then(|s| s.capabilities.clone()).expect("capabilities");
        assert_eq!(caps.add, Some(vec!["IPC_LOCK".to_string()]), "registered buffers may be pinned");
        assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
        let host_caps = container(&set, "host").security_context.as_ref().and_then(|s| s.capabilities.clone());
        assert_eq!(host_caps.and_then(|c| c.add), None, "the host gets no capability");
        let svc: Vec<i32> = node_service(&c).spec.and_then(|s| s.ports).into_iter().flatten().map(|p| p.port).collect();
        assert_eq!(svc, [DEVICE_PORT, REPLICATION_PORT, 7075]);
        let node = network_policies(&c, &OperatorPods::default())[0].spec.clone().expect("spec");
        assert!(
            node.ingress.expect("ingress").iter().any(|r| r
                .ports
                .iter()
                .flatten()
                .any(|p| p.port == Some(IntOrString::Int(7075)))),
            "the endpoint is open to clients"
        );
        // The tcp provider: no device to ask for, nothing pinned; absent or disabled: nothing.
        let tcp = cluster(serde_json::json!({
            "nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}},
            "fabric": {"enabled": true, "provider": "tcp", "port": 7080}
        }));
        let set = node_statefulset(&tcp, false);
        let dev = container(&set, "device");
        assert_eq!(env_of(dev, "DPUKV_FABRIC_LISTEN"), Some("0.0.0.0:7080"));
        assert_eq!(dev.security_context, Some(restricted_container()), "restricted without lockMemory");
        assert!(
            dev.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_none_or(|l| l.keys().all(|k| !k.starts_with("rdma/")))
        );
        for spec in [None, Some(serde_json::json!({"enabled": false}))] {
            let mut off = c.clone();
            off.spec.fabric = spec.map(|s| serde_json::from_value(s).expect("fabric"));
            let set = node_statefulset(&off, false);
            assert_eq!(env_of(container(&set, "device"), "DPUKV_FABRIC_LISTEN"), None);
            assert_eq!(env_of(container(&set, "host"), "DPUKV_ADVERTISE_FABRIC"), None);
            assert_eq!(container(&set, "device").security_context, Some(restricted_container()));
            assert_eq!(node_service(&off).spec.and_then(|s| s.ports).map(|p| p.len()), Some(2));
        }
    }

    #[test]
    fn a_front_door_is_served_by_every_device_with_its_own_certificate_and_the_tokens() {
        let c = cluster(serde_json::json!({
            "nodes": 3, "storage": {"size": "1Gi"}, "etcd": {"managed": {}},
            "auth": {"tokensSecret": "tokens"},
            "frontDoor": {"enabled": true, "resp": 6380, "threads": 2}
        }));
        let set = node_statefulset(&c, false);
        let dev = container(&set, "device");
        assert_eq!(env_of(dev, "DPUKV_DEVICE_RESP"), Some("0.0.0.0:6380"));
        assert_eq!(env_of(dev, "DPUKV_DEVICE_HTTP"), Some("0.0.0.0:8080"));
        assert_eq!(env_of(dev, "DPUKV_FRONT_THREADS"), Some("2"));
        assert_eq!(env_of(dev, "DPUKV_FRONT_TLS_CERT"), Some("/etc/dpukv/front-tls/front-{node}.crt"));
        assert_eq!(env_of(dev, "DPUKV_FRONT_TLS_KEY"), Some("/etc/dpukv/front-tls/front-{node}.key"));
        assert_eq!(env_of(dev, "DPUKV_TOKENS_FILE"), Some("/etc/dpukv/auth/tokens"));
        let ports: Vec<(Option<&str>, i32)> =
            dev.ports.iter().flatten().map(|p| (p.name.as_deref(), p.container_port)).collect();
        assert!(ports.contains(&(Some("resp"), 6380)) && ports.contains(&(Some("http"), 8080)), "{ports:?}");
        assert!(dev.volume_mounts.iter().flatten().any(|m| m.name == "auth" && m.mount_path == AUTH_DIR));
        let pod = set.spec.template.spec.as_ref().expect("pod");
        let auth = pod.volumes.iter().flatten().find(|v| v.name == "auth").expect("the tokens' volume");
        assert_eq!(auth.secret.as_ref().and_then(|s| s.secret_name.as_deref()), Some("tokens"));
        assert!(
            container(&set, "host").volume_mounts.iter().flatten().all(|m| m.name != "auth" && m.name != "front-tls"),
            "the host gets neither the tokens nor the front door's gateway identity"
        );
        assert!(dev.volume_mounts.iter().flatten().any(|m| m.name == "front-tls" && m.mount_path == FRONT_TLS_DIR));
        let front = pod.volumes.iter().flatten().find(|v| v.name == "front-tls").expect("the front door's Secret");
        assert_eq!(front.secret.as_ref().and_then(|s| s.secret_name.as_deref()), Some("demo-front-tls"));
        assert_eq!(front.secret.as_ref().and_then(|s| s.optional), Some(true), "the host starts without it");
        let svc: Vec<i32> = node_service(&c).spec.and_then(|s| s.ports).into_iter().flatten().map(|p| p.port).collect();
        assert_eq!(svc, [DEVICE_PORT, REPLICATION_PORT, 6380, 8080]);
        let node = network_policies(&c, &OperatorPods::default())[0].spec.clone().expect("spec");
        let open: Vec<Vec<i32>> = node
            .ingress
            .expect("ingress")
            .iter()
            .filter(|r| r.from.is_none())
            .map(|r| {
                r.ports
                    .iter()
                    .flatten()
                    .filter_map(|p| p.port.clone())
                    .map(|p| match p {
                        IntOrString::Int(n) => n,
                        IntOrString::String(_) => 0,
                    })
                    .collect()
            })
            .collect();
        assert_eq!(open, [vec![6380, 8080]], "only the front door is open to clients");
        // Without TLS: no certificate; absent or disabled: nothing of it.
        let mut plain = c.clone();
        plain.spec.tls = serde_json::from_value(serde_json::json!({"mode": "Disabled"})).expect("tls");
        assert_eq!(env_of(container(&node_statefulset(&plain, false), "device"), "DPUKV_FRONT_TLS_CERT"), None);
        for spec in [None, Some(serde_json::json!({"enabled": false}))] {
            let mut off = c.clone();
            off.spec.front_door = spec.map(|s| serde_json::from_value(s).expect("frontDoor"));
            let set = node_statefulset(&off, false);
            let dev = container(&set, "device");
            assert_eq!(env_of(dev, "DPUKV_DEVICE_RESP"), None);
            assert_eq!(env_of(dev, "DPUKV_TOKENS_FILE"), None);
            assert_eq!(dev.ports.as_ref().map(Vec::len), Some(2));
            assert_eq!(node_service(&off).spec.and_then(|s| s.ports).map(|p| p.len()), Some(2));
            let policy = network_policies(&off, &OperatorPods::default())[0].spec.clone().expect("spec");
            assert!(policy.ingress.expect("ingress").iter().all(|r| r.from.is_some()));
        }
    }
}
