//! The reconciler: makes a cluster's children what `render` says (server-side apply, one field
//! manager, forced), and reports status (`patch_status`). Errors are retried per object with
//! exponential backoff (1 s doubling to 5 min; a success resets it).
//!
//! **Scale-in never loses data**: when `spec.nodes` is below the running replicas, the pods that
//! would go (the highest ordinals) are drained through the cluster's master first (`admin`), the
//! `Draining` condition reports how far, and the StatefulSet shrinks only once every one of them
//! leads and holds nothing. A drain call that fails leaves the StatefulSet as it is (the error is
//! retried). A scale-out asks the master to stop draining the ordinals that come back.
//!
//! **Status from the cluster itself**: once a node pod is ready, the cluster's summary (its admin
//! API) gives `regions`, `master` (the pod running it) and the `Degraded` condition — regions
//! without a live primary, or short of copies; `Unknown` when it cannot be read.
//!
//! **Events** (`events`) say what happened — drains, scaling, restarts, transitions of
//! `Degraded`, failures — on the resource; publishing one never fails a reconcile.
//!
//! **A finalizer only for state outside Kubernetes** (`etcd_keys`): a cluster whose keys live in
//! an external etcd carries `dpukv.io/etcd-keys`; deleted, its node pods are stopped (a running
//! node writes under its keys), then the keys deleted, then the finalizer removed. Everything
//! else goes with the resource through owner references.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use kube::runtime::finalizer::{self, finalizer};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::admin::Endpoint;
use crate::crd::TlsSource;
use crate::crd::{DeviceMode, DpuKvCluster, DpuKvClusterStatus};
use crate::etcd_keys::{self, KeyCleaner};
use crate::events::{self, normal, warning};
use crate::metrics::{ClusterMetrics, Progress};
use crate::operation::{Held, OperationAction};
use crate::render::OperatorPods;
use crate::tls::{self, OperatorCerts};
use crate::{admin, claims, render};

/// The field manager of everything the operator applies.
pub const MANAGER: &str = "dpukv-operator";

/// What a reconcile can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API refused or failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The resource has no namespace (it is namespaced).
    #[error("the DpuKvCluster has no namespace")]
    NoNamespace,
    /// The cluster's admin API could not be asked (a drain, a step-down, the summary).
    #[error("the cluster's admin API: {0}")]
    Admin(#[from] admin::AdminError),
    /// The cluster's keys in its external etcd could not be deleted (the finalizer stays).
    #[error("deleting the cluster's keys in etcd: {0}")]
    EtcdCleanup(#[from] dpukv_cluster::MetaError),
    /// Adding or removing the finalizer failed.
    #[error("the finalizer: {0}")]
    Finalizer(#[source] Box<finalizer::Error<Error>>),
    /// The cluster's certificates could not be kept (issued, read, written).
    #[error("the cluster's certificates: {0}")]
    Tls(#[from] tls::TlsError),
    /// Not a failure: the cleanup waits for something (retried soon, without backoff).
    #[error("waiting for {0}")]
    Waiting(String),
}

impl Error {
    /// Whether this is a failure (backed off, counted, a `ReconcileFailed` event), not a wait.
    pub fn is_failure(&self) -> bool {
        !matches!(self, Error::Waiting(_))
    }
}

/// How long what is under way (a rollout step, a drain, pods getting ready) may stay the same
/// before the cluster is `Stalled` (a condition and a warning event: a rollout waiting on a pod
/// that never gets ready, a drain that cannot move a region, a pod Pending for a DPU).
pub const STALL_AFTER: Duration = Duration::from_secs(15 * 60);

/// What is under way, as the status says it (phase, the rollout's and the drain's messages):
/// its change is progress.
fn progress_of(phase: Option<&str>, conditions: &[Condition]) -> String {
    let message = |t: &str| conditions.iter().find(|c| c.type_ == t).map_or("", |c| c.message.as_str()).to_string();
    format!("{}|{}|{}", phase.unwrap_or(""), message("Progressing"), message("Draining"))
}

/// How soon a cluster whose cleanup waits is looked at again.
pub const WAIT: Duration = Duration::from_secs(5);

/// Where the operator reaches a cluster's admin API (`host:port`, or several comma-separated:
/// tried in order, see `admin`).
pub type AdminAddr = Box<dyn Fn(&DpuKvCluster) -> String + Send + Sync>;

/// The control API endpoints (port 9103) of the cluster's first three node pods, pod 0 first
/// (the first pods never go in a scale-in; the others answer while an upgrade restarts pod 0),
/// by the DNS names their certificates carry. Plain HTTP only with TLS `Disabled`; the admin
/// port (9100) serves no `/cluster/*`.
pub fn first_pod_admin(c: &DpuKvCluster) -> String {
    (0..3)
        .map(|i| format!("{}:{}", render::pod_host(c, &format!("{}-{i}", render::node_name(c))), render::CONTROL_PORT))
        .collect::<Vec<_>>()
        .join(",")
}

/// What reconciles share.
pub struct Context {
    /// The API.
    pub client: Client,
    /// Where a cluster's admin API is.
    pub admin: AdminAddr,
    /// Kubernetes events on the clusters (`events`).
    pub recorder: Recorder,
    /// Deletes a cluster's keys in its external etcd (the finalizer's cleanup).
    pub etcd_keys: KeyCleaner,
    /// Where the operator's own pods run (the NetworkPolicies let them reach the control port).
    pub operator_pods: OperatorPods,
    /// The operator's certificates, per cluster (made in memory from each cluster's CA).
    pub operator_certs: OperatorCerts,
    /// The Kubernetes nodes' zones (`topology.kubernetes.io/zone`), by node name, kept by a
    /// watch of the nodes (`run`): what each cluster's zones ConfigMap says. Empty: no zones.
    pub zones: Arc<std::sync::RwLock<std::collections::BTreeMap<String, String>>>,
    /// The operator's pods the scheduler cannot place, kept by a watch of them (`run`).
    pub unscheduled: Unscheduled,
    /// Per-cluster metrics (registered by `run`; unregistered, they count for nothing).
    pub metrics: ClusterMetrics,
    /// The nodes `DpuKvOperation`s hold (kept by a watch of them, `run`): what the cluster's
    /// reconcile must not take back.
    pub held: Held,
    /// Each cluster's control API, as its last reconcile reached it (what operations use).
    endpoints: Mutex<HashMap<String, Endpoint>>,
    /// Consecutive failures per cluster (namespace/name), for the backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    /// A context over `client`, reaching clusters at their first pod's admin endpoint.
    pub fn new(client: Client) -> Arc<Context> {
        Context::with_admin(client, Box::new(first_pod_admin))
    }

    /// A context reaching clusters' admin APIs where `admin` says.
    pub fn with_admin(client: Client, admin: AdminAddr) -> Arc<Context> {
        Context::with(client, admin, etcd_keys::etcd_cleaner())
    }

    /// A context reaching clusters' admin APIs where `admin` says and deleting their keys in
    /// etcd with `etcd_keys`.
    pub fn with(client: Client, admin: AdminAddr, etcd_keys: KeyCleaner) -> Arc<Context> {
        Context::full(client, admin, etcd_keys, OperatorPods::default(), ClusterMetrics::default())
    }

    /// A context with everything given.
    pub fn full(
        client: Client,
        admin: AdminAddr,
        etcd_keys: KeyCleaner,
        operator_pods: OperatorPods,
        metrics: ClusterMetrics,
    ) -> Arc<Context> {
        let recorder = events::recorder(client.clone());
        Arc::new(Context {
            client,
            admin,
            recorder,
            etcd_keys,
            operator_pods,
            operator_certs: OperatorCerts::default(),
            zones: Arc::default(),
            unscheduled: Arc::default(),
            metrics,
            held: Arc::new(std::sync::RwLock::new(Some(Default::default()))),
            endpoints: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
        })
    }
}

fn key(c: &DpuKvCluster) -> String {
    format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any())
}

impl Context {
    /// Where `c`'s control API was reached last (None: not reconciled yet by this operator).
    pub fn endpoint(&self, c: &DpuKvCluster) -> Option<Endpoint> {
        self.endpoints.lock().unwrap_or_else(|e| e.into_inner()).get(&key(c)).cloned()
    }

    /// The nodes of `c` that operations hold (None: the operations are not listed yet).
    fn held_for(&self, c: &DpuKvCluster) -> Option<BTreeSet<(OperationAction, u32)>> {
        let all = self.held.read().unwrap_or_else(|e| e.into_inner());
        all.as_ref().map(|m| m.get(&key(c)).cloned().unwrap_or_default())
    }
}

/// The operator's pods the scheduler could not place (their `PodScheduled` condition False), by
/// cluster (`namespace/name`, from the pods' `app.kubernetes.io/instance` label): each pod's
/// name and the scheduler's message (`0/3 nodes are available: 3 Insufficient dpukv.io/dpu.`).
pub type Unscheduled = Arc<std::sync::RwLock<std::collections::BTreeMap<String, Vec<(String, String)>>>>;

/// What `pods` (the operator's, as a watch keeps them) says cannot be scheduled, by cluster.
pub fn unscheduled_of(pods: &[Arc<Pod>]) -> std::collections::BTreeMap<String, Vec<(String, String)>> {
    let mut out: std::collections::BTreeMap<String, Vec<(String, String)>> = Default::default();
    for p in pods {
        let unschedulable = p.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|cs| {
            cs.iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                .map(|c| c.message.clone().unwrap_or_default())
        });
        let (Some(why), Some(cluster)) = (unschedulable, p.labels().get("app.kubernetes.io/instance")) else {
            continue;
        };
        let k = format!("{}/{cluster}", p.namespace().unwrap_or_default());
        out.entry(k).or_default().push((p.name_any(), why));
    }
    out
}

/// `ZonesSpread`: whether every region's copies are in distinct zones (True, or no node has a
/// zone), or why not — regions short of a copy that placement cannot give them because every
/// node that could take one is in a zone they have (fewer zones than copies: add nodes in other
/// zones), or regions with two copies in one zone (a node came back in another zone).
fn zone_condition(c: &DpuKvCluster, summary: &Result<admin::Summary, String>, generation: Option<i64>) -> Condition {
    let copies = c.spec.replication_factor.max(1);
    match summary {
        Err(why) => Condition {
            status: "Unknown".into(),
            ..condition("ZonesSpread", false, "SummaryUnavailable", why, generation)
        },
        Ok(s) if s.zones == 0 => condition("ZonesSpread", true, "NoZones", "no node has a zone label", generation),
        Ok(s) if s.zone_blocked > 0 => condition(
            "ZonesSpread",
            false,
            "FewerZonesThanCopies",
            &format!(
                "{} of {} regions are short of a copy that no node can take: each is in a zone the region has \
                 ({} zones for {copies} copies per region; add nodes in other zones)",
                s.zone_blocked, s.regions, s.zones
            ),
            generation,
        ),
        Ok(s) if s.zone_shared > 0 => condition(
            "ZonesSpread",
            false,
            "SharedZones",
            &format!("{} of {} regions have two copies in one zone", s.zone_shared, s.regions),
            generation,
        ),
        Ok(s) => condition(
            "ZonesSpread",
            true,
            "DistinctZones",
            &format!("every region's copies are in distinct zones ({} zones)", s.zones),
            generation,
        ),
    }
}

/// `PodsScheduled`: every pod of the cluster placed by the scheduler, or which are not and why
/// (a pod Pending for a DPU no node has free is otherwise invisible: it only never gets ready).
fn scheduling_condition(c: &DpuKvCluster, ctx: &Context, generation: Option<i64>) -> Condition {
    let all = ctx.unscheduled.read().unwrap_or_else(|e| e.into_inner());
    let pods = all.get(&key(c)).cloned().unwrap_or_default();
    let message = pods.iter().map(|(p, why)| format!("{p}: {why}")).collect::<Vec<_>>().join("; ");
    condition(
        "PodsScheduled",
        pods.is_empty(),
        if pods.is_empty() { "AllScheduled" } else { "Unschedulable" },
        &message,
        generation,
    )
}

/// The wait before retrying a cluster that failed `n` times in a row.
pub fn backoff(n: u32) -> Duration {
    Duration::from_secs(1u64 << n.min(9).saturating_sub(1)).min(Duration::from_secs(300))
}

/// Whether the Kubernetes nodes advertise at least `wanted` of `resource` in all (allocatable):
/// `Auto` mode's choice for a new cluster. (Allocatable, not free: a DPU other pods hold is
/// still counted — the scheduler then keeps a pod Pending, which the status shows.)
async fn dpus_advertised(client: &Client, resource: &str, wanted: i32) -> Result<bool, Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes.list(&ListParams::default()).await?;
    let total: i64 = list
        .items
        .iter()
        .filter_map(|n| n.status.as_ref()?.allocatable.as_ref()?.get(resource)?.0.parse::<i64>().ok())
        .sum();
    Ok(total >= i64::from(wanted.max(1)))
}

/// The name `status.deviceMode` gives a decision.
fn mode_name(dpu: bool) -> &'static str {
    if dpu { "Device" } else { "Emulator" }
}

/// Whether the node pods get a DPU. `Device` and `Emulator` say so; `Auto` is decided once and
/// kept: from `status.deviceMode`, else from the live StatefulSet's template (a cluster created
/// before the status had the field, or whose first status write failed), else — a new cluster —
/// from what the nodes advertise. Re-deciding on every reconcile flipped running clusters: a DPU
/// node joining, or allocatable dropping to 0 while the device plugin restarts, changed the pod
/// template and restarted every pod.
pub async fn device_mode(c: &DpuKvCluster, live: Option<&StatefulSet>, client: &Client) -> Result<bool, Error> {
    match c.spec.device.mode {
        DeviceMode::Device => return Ok(true),
        DeviceMode::Emulator => return Ok(false),
        DeviceMode::Auto => {}
    }
    if let Some(m) = c.status.as_ref().and_then(|s| s.device_mode.as_deref()) {
        return Ok(m == "Device");
    }
    if let Some(l) = live {
        return Ok(render::requests_device(l, &c.spec.device.resource_name));
    }
    dpus_advertised(client, &c.spec.device.resource_name, c.spec.nodes).await
}

async fn apply<K>(api: &Api<K>, obj: &K) -> Result<K, Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    Ok(api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(obj)).await?)
}

/// What the console shows of the resource: its name, phase and conditions — messages cut, and
/// dropped if need be, so that the whole stays within the control API's
/// `dpukv_proto::control::MAX_K8S_STATUS`.
fn mirror_of(c: &DpuKvCluster, status: &DpuKvClusterStatus) -> serde_json::Value {
    let cut = |m: &str| m.chars().take(200).collect::<String>();
    let conditions: Vec<serde_json::Value> = status
        .conditions
        .iter()
        .take(16)
        .map(|x| serde_json::json!({"type": x.type_, "status": x.status, "reason": cut(&x.reason), "message": cut(&x.message)}))
        .collect();
    let observed_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let mut v = serde_json::json!({
        "resource": key(c),
        "phase": status.phase,
        "observed_ms": observed_ms,
        "conditions": conditions,
    });
    if v.to_string().len() > dpukv_proto::control::MAX_K8S_STATUS {
        for x in v["conditions"].as_array_mut().into_iter().flatten() {
            x["message"] = serde_json::json!("");
        }
    }
    v
}

fn condition(type_: &str, ok: bool, reason: &str, message: &str, generation: Option<i64>) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    }
}

/// `StorageResized`: whether every claim has the size the spec asks for (True), or why not —
/// a shrink refused (volumes never shrink), or an expansion not done yet or refused.
fn storage_condition(resizes: &[(&str, claims::Resize)], generation: Option<i64>) -> Condition {
    let mut why = Vec::new();
    let mut reason = "AsSpecified";
    for (field, r) in resizes {
        match r {
            claims::Resize::Done => {}
            claims::Resize::ShrinkRefused { from, to } => {
                reason = "ShrinkRefused";
                why.push(format!(
                    "{field}: {to} is smaller than the volumes' {from}; volumes never shrink (set it back)"
                ));
            }
            claims::Resize::Pending(m) => {
                if reason == "AsSpecified" {
                    reason = "Expanding";
                }
                why.push(format!("{field}: {m}"));
            }
        }
    }
    condition("StorageResized", why.is_empty(), reason, &why.join("; "), generation)
}

/// A condition's `lastTransitionTime` says when its status last changed: kept from `before`
/// for every condition whose status did not.
fn keep_transition_times(now: &mut [Condition], before: &[Condition]) {
    for c in now {
        if let Some(old) = before.iter().find(|o| o.type_ == c.type_ && o.status == c.status) {
            c.last_transition_time = old.last_transition_time.clone();
        }
    }
}

/// What this reconcile does to a rolling upgrade: the node StatefulSet's partition (pods from it
/// up may run the new revision), and what the upgrade waits for (None: no upgrade under way).
struct Step {
    partition: i32,
    upgrading: Option<String>,
    /// The ordinal this step restarts (the partition lowered to it).
    restarting: Option<i32>,
}

/// The partition the live StatefulSet holds (all its pods when it had none: `OnDelete`).
fn held(l: &StatefulSet) -> i32 {
    let replicas = l.spec.replicas.unwrap_or(0);
    l.spec
        .update_strategy
        .as_ref()
        .and_then(|u| u.rolling_update.as_ref())
        .and_then(|r| r.partition)
        .unwrap_or(replicas)
}

/// Whether some pod runs an older revision than the template's (a rollout under way), as the
/// StatefulSet's status says; and what it says about it.
fn rolling_message(l: &StatefulSet) -> Option<String> {
    let st = l.status.as_ref()?;
    let (current, update) = (st.current_revision.as_deref()?, st.update_revision.as_deref()?);
    let updated = st.updated_replicas.unwrap_or(0);
    // (A rollout reverted mid-way has current = update again, with pods still on the other one.)
    (current != update || updated < st.replicas)
        .then(|| format!("upgrading: {updated} of {} pods on the new revision", st.replicas))
}

/// A node pod as a rollout sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodState {
    /// The StatefulSet revision it runs (`controller-revision-hash`).
    revision: String,
    /// Ready (its `Ready` condition True), and not being deleted.
    ready: bool,
}

/// The node pods by ordinal (pods being deleted count as not ready).
async fn node_pods(c: &DpuKvCluster, client: &Client) -> Result<HashMap<i32, PodState>, Error> {
    let ns = c.namespace().ok_or(Error::NoNamespace)?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let list = pods.list(&ListParams::default().labels(&render::selector_string(c))).await?;
    let prefix = format!("{}-", render::node_name(c));
    Ok(list
        .items
        .into_iter()
        .filter_map(|p| {
            let ordinal = p.metadata.name.as_deref()?.strip_prefix(&prefix)?.parse().ok()?;
            let revision = p.labels().get("controller-revision-hash").cloned().unwrap_or_default();
            let ready = p.metadata.deletion_timestamp.is_none()
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            Some((ordinal, PodState { revision, ready }))
        })
        .collect())
}

/// One step of an upgrade (docs/kubernetes.md "Upgrades"): pods restart one at a time, highest
/// ordinal first, each only after its primaries moved to backups elsewhere
/// (`/cluster/step-down/{node}`) and the cluster is whole again (no region without a live
/// primary or short of copies); the pods restarted so far must be ready on the new revision
/// first — a new version whose pods never get ready stops the rollout there. Reverting
/// `version` (or any template change) recovers such a rollout by itself: the next pod not on
/// the new revision and not ready — the one the failed version broke — is restarted at once
/// (its step-down asked, not awaited: it serves nothing); a pod already on the new revision is
/// passed over without a restart. (The StatefulSet controller restarts only pods from the
/// partition up; a broken pod below it would wait for ever — Kubernetes documents this as
/// needing a manual pod deletion under `OrderedReady`.)
async fn upgrade_step(
    c: &DpuKvCluster,
    ep: &Endpoint,
    l: &StatefulSet,
    client: &Client,
    operations: &BTreeSet<(OperationAction, u32)>,
) -> Result<Step, Error> {
    let replicas = l.spec.replicas.unwrap_or(0);
    let partition = held(l).min(replicas);
    // A node a `StepDown` operation holds stays stepped down.
    let step_up = |ordinal: i32| {
        let id = ordinal as u32 + 1;
        let keep = operations.contains(&(OperationAction::StepDown, id));
        async move { if keep { Ok(()) } else { admin::step_up(ep, id).await.map(|_| ()) } }
    };
    let Some(message) = rolling_message(l) else {
        if partition < replicas {
            // A rollout ended: every pod may lead again (the last one restarted included).
            for ordinal in 0..replicas {
                step_up(ordinal).await?;
            }
        }
        // Settled: hold every pod, so a changed template restarts none by itself.
        return Ok(Step { partition: replicas, upgrading: None, restarting: None });
    };
    let update = l.status.as_ref().and_then(|s| s.update_revision.clone()).unwrap_or_default();
    let pods = node_pods(c, client).await?;
    let name = render::node_name(c);
    let hold = |why: String| Ok(Step { partition, upgrading: Some(format!("{message}; {why}")), restarting: None });
    let on_update = |o: i32| pods.get(&o).is_some_and(|p| p.revision == update);
    let ready = |o: i32| pods.get(&o).is_some_and(|p| p.ready);
    // The pods restarted so far: ready on the new revision.
    if let Some(o) = (partition..replicas).rev().find(|&o| !(on_update(o) && ready(o))) {
        return hold(format!("waiting for {name}-{o} to be ready on the new revision"));
    }
    let addr = ep;
    if partition < replicas {
        // The pod just restarted on the new revision may lead again.
        step_up(partition).await?;
    }
    if partition == 0 {
        return Ok(Step { partition: 0, upgrading: Some(format!("{message}; every pod restarted")), restarting: None });
    }
    let next = partition - 1;
    if on_update(next) && ready(next) {
        // Already on the new revision (a rollout reverted): nothing restarts it.
        return Ok(Step {
            partition: next,
            upgrading: Some(format!("{message}; {name}-{next} already on it")),
            restarting: None,
        });
    }
    if !on_update(next) && !ready(next) {
        // Broken by the revision it runs (a failed upgrade, reverted): restarted at once.
        if let Err(e) = admin::step_down(addr, next as u32 + 1).await {
            tracing::debug!(cluster = %key(c), error = %e, "step-down of a pod that is not ready");
        }
        return Ok(Step {
            partition: next,
            upgrading: Some(format!("{message}; restarting {name}-{next}, not ready on the revision it runs")),
            restarting: Some(next),
        });
    }
    // Every other pod ready before one more goes.
    if let Some(o) = (0..next).find(|&o| !ready(o)) {
        return hold(format!("waiting for {name}-{o} to be ready"));
    }
    let s = admin::summary(addr).await?;
    if s.without_primary > 0 || s.under_replicated > 0 {
        return hold(format!(
            "waiting for the cluster to be whole again ({} regions without a primary, {} short of copies)",
            s.without_primary, s.under_replicated
        ));
    }
    let st = admin::step_down(addr, next as u32 + 1).await?;
    if !st.done {
        return hold(format!(
            "moving the primaries of {name}-{next} ({} regions led, {} movable)",
            st.regions_led, st.movable
        ));
    }
    Ok(Step {
        partition: next,
        upgrading: Some(format!("{message}; restarting {name}-{next}")),
        restarting: Some(next),
    })
}

/// Reconciles one cluster: with its keys in an external etcd, through the finalizer
/// (`etcd_keys::FINALIZER`: added first, then the cluster reconciled; once the resource is
/// deleted, its keys deleted before the finalizer is removed); else the cluster alone. A failure
/// is also a `ReconcileFailed` event on it (a failed cleanup is its own `CleanupFailed`).
pub async fn reconcile(c: Arc<DpuKvCluster>, ctx: Arc<Context>) -> Result<Action, Error> {
    let r = if etcd_keys::needs_finalizer(&c) || etcd_keys::has_finalizer(&c) {
        let ns = c.namespace().ok_or(Error::NoNamespace)?;
        let api: Api<DpuKvCluster> = Api::namespaced(ctx.client.clone(), &ns);
        let ctx = &*ctx;
        finalizer(&api, etcd_keys::FINALIZER, c.clone(), |event| async move {
            match event {
                finalizer::Event::Apply(c) => reconcile_cluster(&c, ctx).await,
                finalizer::Event::Cleanup(c) => {
                    report_deleting(&c, ctx, "stopping the node pods, then deleting the cluster's keys in etcd").await;
                    cleanup(&c, ctx).await
                }
            }
        })
        .await
        .map_err(|e| match e {
            finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e,
            other => Error::Finalizer(Box::new(other)),
        })
    } else if c.metadata.deletion_timestamp.is_some() {
        // Going, and nothing of it outside Kubernetes: the garbage collector takes its children
        // (in a foreground deletion the resource stays until they are gone: it says so).
        report_deleting(&c, &ctx, "the garbage collector deletes the cluster's objects").await;
        Ok(Action::await_change())
    } else {
        reconcile_cluster(&c, &ctx).await
    };
    if let Err(e) = &r
        && e.is_failure()
        && !matches!(e, Error::EtcdCleanup(_))
    {
        events::publish(&ctx.recorder, &c, warning(events::RECONCILE_FAILED, "Reconcile", e.to_string())).await;
        report_failure(&c, &ctx, e).await;
    }
    r
}

/// A failed reconcile says so in the status too (a status written only after a success showed
/// a cluster whose every reconcile failed — an edit the API server refuses — as healthy): the
/// last status, with `Reconciled` False carrying the error and the generation that failed. Best
/// effort: a status that cannot be written is logged (the event says it too).
async fn report_failure(c: &DpuKvCluster, ctx: &Context, e: &Error) {
    let Some(ns) = c.namespace() else { return };
    let failed = condition("Reconciled", false, "ReconcileFailed", &e.to_string(), c.metadata.generation);
    if let Err(e) = write_status(&ctx.client, &ns, c, &last_status_with(c, failed)).await {
        tracing::warn!(cluster = %key(c), error = %e, "the failure could not be written to the status");
    }
}

/// A cluster being deleted says so: phase `Deleting`, `Progressing` True saying what is waited
/// for. Best effort, as [`report_failure`].
async fn report_deleting(c: &DpuKvCluster, ctx: &Context, what: &str) {
    let Some(ns) = c.namespace() else { return };
    let mut status = last_status_with(c, condition("Progressing", true, "Deleting", what, c.metadata.generation));
    status.phase = Some("Deleting".into());
    if c.status.as_ref() == Some(&status) {
        return;
    }
    if let Err(e) = write_status(&ctx.client, &ns, c, &status).await {
        tracing::debug!(cluster = %key(c), error = %e, "the deletion could not be written to the status");
    }
}

/// The cluster's last status with `cond` in place of its condition of that type (its transition
/// time kept while its status holds).
fn last_status_with(c: &DpuKvCluster, cond: Condition) -> DpuKvClusterStatus {
    let before = c.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let mut status = c.status.clone().unwrap_or_default();
    status.conditions.retain(|x| x.type_ != cond.type_);
    status.conditions.push(cond);
    keep_transition_times(&mut status.conditions, before);
    status
}

/// Writes `status` as the cluster's whole status.
async fn write_status(
    client: &Client,
    ns: &str,
    c: &DpuKvCluster,
    status: &DpuKvClusterStatus,
) -> Result<(), kube::Error> {
    apply_status(&Api::<DpuKvCluster>::namespaced(client.clone(), ns), &c.name_any(), status).await
}

/// Writes `status` as a resource's whole status (server-side apply on the status subresource,
/// the operator's field manager, forced): the clusters' and the operations'.
pub(crate) async fn apply_status<K>(api: &Api<K>, name: &str, status: &impl Serialize) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let patch = serde_json::json!({"apiVersion": K::api_version(&()), "kind": K::kind(&()), "status": status});
    api.patch_status(name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(patch)).await?;
    Ok(())
}

/// The finalizer's cleanup of a deleted cluster: its keys in the external etcd, once no node pod
/// runs (a running node writes under them: the node StatefulSet is scaled to none first — its
/// data goes with the cluster anyway). Unless the resource asks to skip it. An error keeps the
/// finalizer (retried with backoff).
async fn cleanup(c: &DpuKvCluster, ctx: &Context) -> Result<Action, Error> {
    let Some(endpoints) = etcd_keys::external_endpoints(c) else { return Ok(Action::await_change()) };
    let prefix = etcd_keys::prefix(c)?;
    let shown = String::from_utf8_lossy(&prefix).into_owned();
    let at = endpoints.join(",");
    if etcd_keys::skip_requested(c) {
        let note = format!("{} is \"true\": the keys under {shown} in etcd {at} are left", etcd_keys::SKIP_ANNOTATION);
        events::publish(&ctx.recorder, c, warning(events::ETCD_CLEANUP_SKIPPED, "Cleanup", note)).await;
        return Ok(Action::await_change());
    }
    if let Some(left) = stop_nodes(c, ctx).await? {
        return Err(Error::Waiting(format!("{left} node pods to stop before the keys under {shown} are deleted")));
    }
    let tls = tls::external_etcd_tls(&ctx.client, c).await?;
    match (ctx.etcd_keys)(etcd_keys::EtcdTarget { endpoints, tls }, prefix).await {
        Ok(n) => {
            let note = format!("deleted the cluster's {n} keys under {shown} in etcd {at}");
            events::publish(&ctx.recorder, c, normal(events::ETCD_KEYS_DELETED, "Cleanup", note)).await;
            Ok(Action::await_change())
        }
        Err(e) => {
            let note = format!(
                "the keys under {shown} in etcd {at} could not be deleted ({e}); the deletion waits and is retried \
                 (annotate {}=true to leave them)",
                etcd_keys::SKIP_ANNOTATION
            );
            events::publish(&ctx.recorder, c, warning(events::CLEANUP_FAILED, "Cleanup", note)).await;
            Err(Error::EtcdCleanup(e))
        }
    }
}

/// Scales the node StatefulSet of a deleted cluster to none; the pods still there (None: none).
async fn stop_nodes(c: &DpuKvCluster, ctx: &Context) -> Result<Option<i32>, Error> {
    let ns = c.namespace().ok_or(Error::NoNamespace)?;
    let sets: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), &ns);
    let name = render::node_name(c);
    let Some(live) = sets.get_opt(&name).await? else { return Ok(None) };
    let status = live.status.as_ref();
    let pods = status.map_or(0, |s| s.replicas);
    if live.spec.replicas != Some(0) {
        let pp = PatchParams { field_manager: Some(MANAGER.into()), ..PatchParams::default() };
        sets.patch(&name, &pp, &Patch::Merge(serde_json::json!({"spec": {"replicas": 0}}))).await?;
        let note = format!("stopping the {pods} node pods before the cluster's keys in etcd are deleted");
        events::publish(&ctx.recorder, c, normal(events::STOPPING_NODES, "Cleanup", note)).await;
        return Ok(Some(pods.max(1)));
    }
    // The StatefulSet's status must have seen the scale before its count of pods says anything.
    let seen = status.and_then(|s| s.observed_generation) >= live.metadata.generation;
    Ok((!seen || pods > 0).then_some(pods.max(1)))
}

/// The node StatefulSet's annotation naming (comma-separated) the node ConfigMaps that pods of
/// an earlier pod template may still read: each is deleted once the rollout ended (every pod on
/// the current template, which names the current ConfigMap).
pub const PREVIOUS_CONFIGS_ANNOTATION: &str = "dpukv.io/previous-node-configs";

/// The ConfigMaps a live node StatefulSet remembers ([`PREVIOUS_CONFIGS_ANNOTATION`]).
fn previous_configs(l: &StatefulSet) -> BTreeSet<String> {
    let names = l.annotations().get(PREVIOUS_CONFIGS_ANNOTATION).map_or("", String::as_str);
    names.split(',').filter(|n| !n.is_empty()).map(String::from).collect()
}

/// The ConfigMap a live node StatefulSet's template has its host container read.
fn config_of(l: &StatefulSet) -> Option<String> {
    let pod = l.spec.template.spec.as_ref()?;
    let host = pod.containers.iter().find(|c| c.name == "host")?;
    host.env_from.as_ref()?.iter().find_map(|f| f.config_map_ref.as_ref()).map(|r| r.name.clone())
}

/// Whether a live StatefulSet's status describes its current spec (the StatefulSet controller
/// saw the last template change: its revisions say which pods run which template).
fn status_current(l: &StatefulSet) -> bool {
    l.status.as_ref().and_then(|s| s.observed_generation) >= l.metadata.generation
}

/// A 404 is no error (a deletion of something already gone).
fn not_found(e: kube::Error) -> Result<(), kube::Error> {
    match e {
        kube::Error::Api(s) if s.code == 404 => Ok(()),
        e => Err(e),
    }
}

/// The status a condition of the cluster's last status had ("" when it had none).
fn previous<'a>(c: &'a DpuKvCluster, type_: &str) -> &'a str {
    let conditions = c.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    conditions.iter().find(|x| x.type_ == type_).map_or("", |x| x.status.as_str())
}

/// The annotation that pauses the operator on a cluster (`"true"`): nothing is applied, no drain,
/// step-down or rollout step is taken, until it is removed — for an operator's hands-on repair.
/// The status says so (`Paused`); deleting the cluster still cleans up.
pub const PAUSED_ANNOTATION: &str = "dpukv.io/paused";

fn paused(c: &DpuKvCluster) -> bool {
    c.annotations().get(PAUSED_ANNOTATION).is_some_and(|v| v == "true")
}

/// A paused cluster's status: the last one, with `Paused` True.
async fn report_paused(c: &DpuKvCluster, ctx: &Context) -> Result<Action, Error> {
    let ns = c.namespace().ok_or(Error::NoNamespace)?;
    let note =
        format!("{PAUSED_ANNOTATION} is \"true\": nothing is applied and no drain, step-down or rollout step taken");
    let paused = condition("Paused", true, "PausedByAnnotation", &note, c.metadata.generation);
    write_status(&ctx.client, &ns, c, &last_status_with(c, paused)).await?;
    Ok(Action::await_change())
}

/// Makes one cluster's children what they should be, and reports its status.
async fn reconcile_cluster(c: &DpuKvCluster, ctx: &Context) -> Result<Action, Error> {
    if paused(c) {
        return report_paused(c, ctx).await;
    }
    let ns = c.namespace().ok_or(Error::NoNamespace)?;
    let client = &ctx.client;
    let sets: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    let live = sets.get_opt(&render::node_name(c)).await?;
    let dpu = device_mode(c, live.as_ref(), client).await?;
    let mut set = render::node_statefulset(c, dpu);
    let running = live.as_ref().and_then(|s| s.spec.replicas).unwrap_or(0);
    let desired = c.spec.nodes;
    // The certificates first: every node id the StatefulSet has or is about to have (a scale-out
    // finds its new pods' pairs in the Secret), etcd's before etcd starts.
    let now = time::OffsetDateTime::now_utc();
    let ids = running.max(desired).max(0) as u32;
    let tls = tls::ensure(c, client, &ctx.operator_certs, ids, now).await?;
    let ep = Endpoint { addrs: (ctx.admin)(c), tls: tls.control.clone() };
    ctx.endpoints.lock().unwrap_or_else(|e| e.into_inner()).insert(key(c), ep.clone());
    let operations = ctx.held_for(c);
    // The managed etcd next: the node pods need it to start. (Its claim templates stay as they
    // were made; a larger size goes to its claims: `claims`.)
    let mut resizes = Vec::new();
    if let (Some(svc), Some(mut etcd)) = (render::etcd_service(c), render::etcd_statefulset(c)) {
        apply(&Api::<Service>::namespaced(client.clone(), &ns), &svc).await?;
        let live_etcd = sets.get_opt(&render::etcd_name(c)).await?;
        let members = etcd.spec.replicas.unwrap_or(0);
        resizes.push((
            "etcd.managed.storage",
            claims::keep_and_expand(client, &ns, &mut etcd, live_etcd.as_ref(), members).await?,
        ));
        apply(&sets, &etcd).await?;
    }
    resizes.push((
        "storage.size",
        claims::keep_and_expand(client, &ns, &mut set, live.as_ref(), running.max(desired)).await?,
    ));
    // Scale-in: drain the pods that would go; shrink only when all are drained.
    let mut pending = Vec::new();
    if running > desired {
        for ordinal in desired..running {
            let st = admin::drain(&ep, ordinal as u32 + 1).await?;
            if !st.done {
                pending.push(st);
            }
        }
    }
    if running > desired && previous(c, "Draining") != "True" {
        let nodes: Vec<String> =
            (desired..running).map(|o| format!("node {} ({}-{o})", o + 1, render::node_name(c))).collect();
        let note = format!(
            "draining {} before the node StatefulSet shrinks from {running} to {desired} pods",
            nodes.join(", ")
        );
        events::publish(&ctx.recorder, c, normal(events::DRAIN_STARTED, "Drain", note)).await;
    }
    let waiting_for_drain = !pending.is_empty();
    if waiting_for_drain {
        set.spec.replicas = Some(running);
    }
    // Upgrades: the partition says which pods may run the new revision.
    let template_changed = live.as_ref().is_some_and(|l| {
        let annotation =
            |s: &StatefulSet| s.metadata.annotations.as_ref()?.get(render::POD_TEMPLATE_ANNOTATION).cloned();
        annotation(l) != annotation(&set)
    });
    let rollout = match live.as_ref() {
        // A new StatefulSet: every pod starts on the one revision there is.
        None => Step { partition: 0, upgrading: None, restarting: None },
        // A new pod template (a version, or a revert mid-rollout): hold every pod — applying it
        // with a lower partition would restart pods whose primaries did not step down — and
        // restart them one at a time from the top, from the next reconcile on.
        Some(l) if template_changed => Step {
            partition: l.spec.replicas.unwrap_or(0).max(desired),
            upgrading: Some("upgrading: the pod template changed; every pod held".into()),
            restarting: None,
        },
        Some(l) if running != desired || waiting_for_drain => {
            Step { partition: held(l), upgrading: rolling_message(l), restarting: None }
        }
        Some(l) => upgrade_step(c, &ep, l, client, &operations.clone().unwrap_or_default()).await?,
    };
    if let Some(u) = set.spec.update_strategy.as_mut().and_then(|u| u.rolling_update.as_mut()) {
        u.partition = Some(rollout.partition);
    }
    // The hosts' settings before the pods that read them (a changed one is a new ConfigMap, which
    // the template names: pods restart for it one at a time, as for a new version).
    let configs: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let config = apply(&configs, &render::node_config_map(c)).await?;
    // Where each Kubernetes node is (a host reads its own zone from it at start, before it
    // registers): only when some node has a zone.
    let zones = ctx.zones.read().unwrap_or_else(|e| e.into_inner()).clone();
    if !zones.is_empty() {
        apply(&configs, &render::zones_config_map(c, zones)).await?;
    }
    // The ConfigMaps pods of an earlier template may still read: kept until the rollout ended.
    let current = config.name_any();
    let mut earlier = live.as_ref().map(previous_configs).unwrap_or_default();
    if template_changed && let Some(old) = live.as_ref().and_then(config_of) {
        earlier.insert(old);
    }
    earlier.remove(&current);
    if live.as_ref().is_some_and(|l| !template_changed && rollout.upgrading.is_none() && status_current(l)) {
        // Every pod runs the current template: the ConfigMaps of earlier ones go.
        for name in std::mem::take(&mut earlier) {
            configs.delete(&name, &DeleteParams::default()).await.map(|_| ()).or_else(not_found)?;
        }
    }
    set.annotations_mut().insert(PREVIOUS_CONFIGS_ANNOTATION.into(), earlier.into_iter().collect::<Vec<_>>().join(","));
    let set = apply(&sets, &set).await?;
    if running > desired && !waiting_for_drain {
        let note = format!("the node StatefulSet shrank from {running} to {desired} pods, their nodes drained");
        events::publish(&ctx.recorder, c, normal(events::SCALED_IN, "Scale", note)).await;
    }
    if let Some(o) = rollout.restarting {
        let pod = format!("{}-{o}", render::node_name(c));
        let note = format!("restarting {pod} on the new pod template: its primaries moved to backups elsewhere");
        let mut ev = normal(events::RESTARTING_POD, "Upgrade", note);
        ev.secondary = Some(events::pod_ref(c, pod));
        events::publish(&ctx.recorder, c, ev).await;
    }
    // Scale-out of a running cluster: the ordinals that come back may have been drained before.
    if running > 0 && desired > running {
        let ops = operations.clone().unwrap_or_default();
        for ordinal in running..desired {
            let id = ordinal as u32 + 1;
            if !ops.contains(&(OperationAction::Drain, id)) {
                admin::undrain(&ep, id).await?;
            }
            if !ops.contains(&(OperationAction::StepDown, id)) {
                admin::step_up(&ep, id).await?;
            }
        }
        let note = format!("the node StatefulSet grew from {running} to {desired} pods");
        events::publish(&ctx.recorder, c, normal(events::SCALED_OUT, "Scale", note)).await;
    }
    apply(&Api::<Service>::namespaced(client.clone(), &ns), &render::node_service(c)).await?;
    apply(&Api::<Deployment>::namespaced(client.clone(), &ns), &render::gateway_deployment(c)).await?;
    apply(&Api::<Service>::namespaced(client.clone(), &ns), &render::gateway_service(c)).await?;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    apply(&pdbs, &render::node_pdb(c)).await?;
    apply(&pdbs, &render::gateway_pdb(c)).await?;
    if let Some(p) = render::etcd_pdb(c) {
        apply(&pdbs, &p).await?;
    }
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), &ns);
    for p in render::network_policies(c, &ctx.operator_pods) {
        apply(&policies, &p).await?;
    }

    let ready = set.status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0);
    let generation = c.metadata.generation;
    // Settled: every pod ready, nothing under way (else looked at again soon).
    let settled = ready >= c.spec.nodes && !waiting_for_drain && rollout.upgrading.is_none();
    let upgrading = rollout.upgrading.is_some();
    let phase = if waiting_for_drain {
        "Draining"
    } else if upgrading {
        "Upgrading"
    } else if ready == 0 {
        "Creating"
    } else if ready < c.spec.nodes {
        "Scaling"
    } else {
        "Running"
    };
    // What the cluster's metadata says (through its admin API), once a node pod is ready.
    let summary = if ready > 0 {
        admin::summary(&ep).await.map_err(|e| {
            tracing::debug!(cluster = %key(c), error = %e, "the cluster's summary could not be read");
            e.to_string()
        })
    } else {
        Err("no node pod is ready".to_string())
    };
    // Drains nothing needs any more, taken back on every reconcile (not only on the scale-out
    // edge: a scale-in cancelled midway — 5 to 3 to 5 — left its nodes drained for good, and an
    // un-drain that failed was never tried again). (Step-downs are not: a rollout lifts its own
    // at its end, and a host leaving on SIGTERM asked for its own, which must hold until it is
    // gone.) A failure is retried after the status is written.
    let mut leftover = Ok(());
    if let Ok(s) = &summary {
        leftover = match &operations {
            Some(ops) => take_back_drains(c, ctx, &ep, s, desired, ops).await,
            // The operations not listed yet: one could hold any drain.
            None => Ok(()),
        };
    }
    let degraded = match &summary {
        Ok(s) if s.without_primary > 0 => condition(
            "Degraded",
            true,
            "RegionsWithoutPrimary",
            &format!("{} of {} regions have no live primary (a failover is due)", s.without_primary, s.regions),
            generation,
        ),
        Ok(s) if s.under_replicated > 0 => condition(
            "Degraded",
            true,
            "RegionsUnderReplicated",
            &format!("{} of {} regions are short of copies", s.under_replicated, s.regions),
            generation,
        ),
        Ok(s) => condition(
            "Degraded",
            false,
            "AllRegionsReplicated",
            &format!("{} regions, each with a live primary and its copies", s.regions),
            generation,
        ),
        Err(why) => Condition {
            status: "Unknown".into(),
            ..condition("Degraded", false, "SummaryUnavailable", why, generation)
        },
    };
    // Available: the cluster serves every key — every region has a live primary (the summary
    // says), whatever else is under way: a rolling upgrade or a drain restarts or empties one pod
    // at a time and keeps it so. Without a summary, every pod ready is the best sign there is.
    let available = match &summary {
        Ok(s) if s.without_primary > 0 => condition(
            "Available",
            false,
            "RegionsWithoutPrimary",
            &format!(
                "{} of {} regions have no live primary; {ready} of {} node pods ready",
                s.without_primary, s.regions, c.spec.nodes
            ),
            generation,
        ),
        Ok(s) => condition(
            "Available",
            s.regions > 0,
            if s.regions > 0 { "RegionsServed" } else { "NoRegions" },
            &format!("every region has a live primary; {ready} of {} node pods ready", c.spec.nodes),
            generation,
        ),
        Err(_) => condition(
            "Available",
            settled,
            if settled { "NodesReady" } else { "NodesNotReady" },
            &format!("{ready} of {} node pods ready (the cluster's summary could not be read)", c.spec.nodes),
            generation,
        ),
    };
    // A running cluster short of primaries or copies says so in its phase too; one whose pods
    // cannot all be placed, too.
    let scheduled = scheduling_condition(c, ctx, generation);
    let phase = match phase {
        "Running" if degraded.status == "True" => "Degraded",
        "Creating" | "Scaling" if scheduled.status == "False" => "Pending",
        other => other,
    };
    let drain_message = pending
        .iter()
        .map(|p| format!("node {}: {} regions led, {} held", p.node, p.regions_led, p.regions_held))
        .collect::<Vec<_>>()
        .join("; ");
    let mut status = DpuKvClusterStatus {
        phase: Some(phase.into()),
        conditions: vec![
            available,
            condition("Progressing", !settled, phase, rollout.upgrading.as_deref().unwrap_or(""), generation),
            degraded,
            condition(
                "Draining",
                waiting_for_drain,
                if waiting_for_drain { "DrainInProgress" } else { "NoDrain" },
                &drain_message,
                generation,
            ),
            condition("Secure", tls.secure, tls.reason, &tls.message, generation),
            storage_condition(&resizes, generation),
            scheduled,
            zone_condition(c, &summary, generation),
            condition("Paused", false, "NotPaused", "", generation),
            condition("Reconciled", true, "ReconcileSucceeded", "", generation),
        ],
        ready_nodes: ready,
        nodes: set.status.as_ref().map_or(0, |s| s.replicas),
        regions: summary.as_ref().map_or(0, |s| s.regions as i32),
        master: summary
            .as_ref()
            .ok()
            .filter(|s| s.master > 0)
            .map(|s| format!("{}-{}", render::node_name(c), s.master - 1)),
        observed_generation: generation,
        version: (ready >= c.spec.nodes && !upgrading).then(|| c.spec.version.clone()),
        selector: Some(render::selector_string(c)),
        device_mode: Some(mode_name(dpu).into()),
        last_progress_time: None,
    };
    // Progress: what is under way changed, or nothing is; else, for STALL_AFTER, Stalled.
    let now = k8s_openapi::jiff::Timestamp::now();
    let before = c.status.as_ref();
    let same = before.is_some_and(|b| {
        progress_of(b.phase.as_deref(), &b.conditions) == progress_of(status.phase.as_deref(), &status.conditions)
    });
    status.last_progress_time = match before.and_then(|b| b.last_progress_time.clone()) {
        _ if settled => None,
        Some(t) if same => Some(t),
        _ => Some(Time(now)),
    };
    let still_for = status.last_progress_time.as_ref().map(|t| now.duration_since(t.0).unsigned_abs());
    let stalled = still_for.is_some_and(|d| d >= STALL_AFTER);
    let stall_message = match still_for {
        Some(d) if stalled => format!(
            "no progress for {} min: {}",
            d.as_secs() / 60,
            [status.phase.as_deref().unwrap_or(""), rollout.upgrading.as_deref().unwrap_or(""), drain_message.as_str()]
                .iter()
                .filter(|m| !m.is_empty())
                .copied()
                .collect::<Vec<_>>()
                .join("; ")
        ),
        _ => String::new(),
    };
    status.conditions.insert(
        2,
        condition("Stalled", stalled, if stalled { "NoProgress" } else { "NotStalled" }, &stall_message, generation),
    );
    keep_transition_times(&mut status.conditions, c.status.as_ref().map_or(&[][..], |s| &s.conditions[..]));
    write_status(client, &ns, c, &status).await?;
    // The console shows the resource's status too (the gateway never calls the API server):
    // mirrored into the cluster once a node answers; the host writes it only when it changed.
    if summary.is_ok() {
        let mirrored = mirror_of(c, &status);
        if let Err(e) = admin::mirror_status(&ep, &mirrored).await {
            tracing::debug!(cluster = %key(c), error = %e, "the status could not be mirrored for the console");
        }
    }
    let progress = Progress {
        rollout_pods_left: if upgrading {
            set.status.as_ref().map_or(0, |s| i64::from(s.replicas - s.updated_replicas.unwrap_or(0)).max(0))
        } else {
            0
        },
        drain_regions_left: pending.iter().map(|p| i64::from(p.regions_led) + i64::from(p.regions_held)).sum(),
    };
    ctx.metrics.observe(c, &status, progress);
    // Transitions, against the status the cluster had.
    let degraded = status.conditions.iter().find(|x| x.type_ == "Degraded").expect("a Degraded condition");
    match (previous(c, "Degraded") == "True", degraded.status.as_str()) {
        (false, "True") => {
            let ev = warning(events::DEGRADED, "Health", degraded.message.clone());
            events::publish(&ctx.recorder, c, ev).await;
        }
        (true, "False") => {
            let ev = normal(events::RECOVERED, "Health", degraded.message.clone());
            events::publish(&ctx.recorder, c, ev).await;
        }
        _ => {}
    }
    // Plain text is an explicit choice, and a loud one: a warning each time it is made.
    if c.spec.tls.source() == TlsSource::Disabled && previous(c, "Secure") != "False" {
        let ev = warning(events::PLAINTEXT_OPT_IN, "Security", tls.message.clone());
        events::publish(&ctx.recorder, c, ev).await;
    }
    if stalled && previous(c, "Stalled") != "True" {
        events::publish(&ctx.recorder, c, warning(events::STALLED, "Progress", stall_message.clone())).await;
    }
    let was_upgrading = c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Upgrading");
    if was_upgrading && !upgrading {
        let note = format!("every node pod runs the new pod template (version {})", c.spec.version);
        events::publish(&ctx.recorder, c, normal(events::ROLLOUT_FINISHED, "Upgrade", note)).await;
    }
    leftover?;
    ctx.failures.lock().expect("failures lock").remove(&key(c));
    // Looked at again soon while anything is under way or the cluster is degraded (its status
    // follows the cluster's repair), else within a minute.
    let calm = settled && phase == "Running";
    Ok(Action::requeue(if calm { Duration::from_secs(60) } else { Duration::from_secs(5) }))
}

/// Takes back the drains of nodes the cluster keeps (ids up to `desired`: a scale-in drains only
/// those above); an event says which.
async fn take_back_drains(
    c: &DpuKvCluster,
    ctx: &Context,
    ep: &Endpoint,
    s: &admin::Summary,
    desired: i32,
    operations: &BTreeSet<(OperationAction, u32)>,
) -> Result<(), Error> {
    // (Not those a `DpuKvOperation` holds: they stay drained while it exists.)
    let drained: Vec<u32> = s
        .draining
        .iter()
        .copied()
        .filter(|n| i64::from(*n) <= i64::from(desired) && !operations.contains(&(OperationAction::Drain, *n)))
        .collect();
    for &n in &drained {
        admin::undrain(ep, n).await?;
        if !operations.contains(&(OperationAction::StepDown, n)) {
            admin::step_up(ep, n).await?;
        }
    }
    if !drained.is_empty() {
        let nodes: Vec<String> =
            drained.iter().map(|n| format!("node {n} ({}-{})", render::node_name(c), n - 1)).collect();
        let note = format!("{} no longer drained: the cluster keeps {desired} node pods", nodes.join(", "));
        events::publish(&ctx.recorder, c, normal(events::UNDRAINED, "Drain", note)).await;
    }
    Ok(())
}

/// Retries a failed cluster after its backoff (one that waits, soon).
pub fn error_policy(c: Arc<DpuKvCluster>, e: &Error, ctx: Arc<Context>) -> Action {
    if !e.is_failure() {
        tracing::debug!(cluster = %key(&c), "{e}");
        return Action::requeue(WAIT);
    }
    let mut failures = ctx.failures.lock().expect("failures lock");
    let n = failures.entry(key(&c)).or_insert(0);
    *n = n.saturating_add(1);
    tracing::warn!(cluster = %key(&c), error = %e, attempt = *n, "reconcile failed");
    Action::requeue(backoff(*n))
}
