//! The `DpuKvOperation` custom resource (`dpukv.io/v1alpha1`, namespaced) and its reconciler:
//! a day-2 operation on one node pod of a cluster, asked of the cluster's master through its
//! control API — `Drain` (move every primary and copy off the node) or `StepDown` (move its
//! primaries to backups elsewhere, keeping its copies: a planned failover). The operation **holds
//! while the resource exists**: its status follows the master's progress (`Running`, then
//! `Holding` once done), it is asked again every reconcile (so nothing the operator does for a
//! cluster — taking back drains a scale-in no longer needs, lifting step-downs at a rollout's
//! end — undoes it: those skip the nodes an operation holds), and deleting the resource lifts it
//! (its finalizer `dpukv.io/operation` undrains or steps the node up first). Its spec cannot
//! change (a CEL rule): delete it and create another.
//!
//! The cluster's control API is reached where its last reconcile found it (`Context::endpoint`):
//! an operation on a cluster the operator has not reconciled yet waits (`Pending`).

// kube's `printcolumn(...)` arguments repeat `type_ = ...` across columns, which clippy takes for
// duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{self, finalizer};
use kube::{CustomResource, KubeSchema, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::admin;
use crate::controller::{Context, Error, apply_status};
use crate::crd::DpuKvCluster;
use crate::render;

/// A day-2 operation on one node pod of a cluster, held while the resource exists.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "dpukv.io",
    version = "v1alpha1",
    kind = "DpuKvOperation",
    namespaced,
    status = "DpuKvOperationStatus",
    shortname = "dpukvop",
    category = "dpukv",
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.cluster"),
    printcolumn(name = "Action", type_ = "string", json_path = ".spec.action"),
    printcolumn(name = "Pod", type_ = "string", json_path = ".spec.pod"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("an operation cannot change: delete it and create another"))]
#[x_kube(validation = Rule::new("self.pod.startsWith(self.cluster + '-node-') && self.pod.matches('-node-(0|[1-9][0-9]{0,4})$')").message("pod must be a node pod of the cluster (CLUSTER-node-N)"))]
#[serde(rename_all = "camelCase")]
pub struct DpuKvOperationSpec {
    /// The `DpuKvCluster`, in the operation's namespace.
    pub cluster: String,
    /// `Drain` or `StepDown`.
    pub action: OperationAction,
    /// The node pod (`CLUSTER-node-N`).
    pub pod: String,
}

/// What an operation asks of a node.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum OperationAction {
    /// Every primary and copy off the node (as before a scale-in); lifted: the node takes copies
    /// again.
    Drain,
    /// Its primaries to backups elsewhere, its copies kept (a planned failover); lifted: it may
    /// lead again.
    StepDown,
}

/// How far an operation is.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DpuKvOperationStatus {
    /// `Pending` (the cluster, or its control API, not reachable yet), `Running` (regions still
    /// to move), `Holding` (done, and held while the resource exists) or `Failed` (it cannot be
    /// done as written: the message says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What the phase means now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The node's id in the cluster (the pod's ordinal + 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// Regions the node still leads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regions_led: Option<u32>,
    /// Regions it still holds a copy of (`Drain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regions_held: Option<u32>,
}

/// The finalizer that lifts an operation before its resource goes.
pub const FINALIZER: &str = "dpukv.io/operation";

/// How soon an operation under way is asked again; one holding, to re-assert it.
const RUNNING_EVERY: Duration = Duration::from_secs(5);
const HOLDING_EVERY: Duration = Duration::from_secs(60);

/// The nodes live operations hold, by cluster (`namespace/name`): (action, node id). `None`
/// until the operator's watch of the operations has listed them (then nothing may be taken back:
/// an operation not seen yet could hold it).
pub type Held = Arc<std::sync::RwLock<Option<BTreeMap<String, BTreeSet<(OperationAction, u32)>>>>>;

/// What `ops` (as a watch keeps them) hold, by cluster: the operations not being deleted.
pub fn held_of(ops: &[Arc<DpuKvOperation>]) -> Option<BTreeMap<String, BTreeSet<(OperationAction, u32)>>> {
    let mut out: BTreeMap<String, BTreeSet<(OperationAction, u32)>> = BTreeMap::new();
    for op in ops.iter().filter(|o| o.metadata.deletion_timestamp.is_none()) {
        if let Some(id) = node_id(&op.spec) {
            let k = format!("{}/{}", op.namespace().unwrap_or_default(), op.spec.cluster);
            out.entry(k).or_default().insert((op.spec.action, id));
        }
    }
    Some(out)
}

/// The node id of the operation's pod (`CLUSTER-node-N`: N + 1).
pub fn node_id(spec: &DpuKvOperationSpec) -> Option<u32> {
    let ordinal: u32 = spec.pod.strip_prefix(&format!("{}-node-", spec.cluster))?.parse().ok()?;
    ordinal.checked_add(1)
}

/// Reconciles one operation through its finalizer: added first; then the operation asked of the
/// cluster's master and its status written; once the resource is deleted, lifted before the
/// finalizer goes.
pub async fn reconcile(op: Arc<DpuKvOperation>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = op.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<DpuKvOperation> = Api::namespaced(ctx.client.clone(), &ns);
    let ctx = &*ctx;
    finalizer(&api, FINALIZER, op, |event| async move {
        match event {
            finalizer::Event::Apply(op) => apply(&op, ctx).await,
            finalizer::Event::Cleanup(op) => lift(&op, ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(Box::new(other)),
    })
}

/// Retries a failed operation after a while.
pub fn error_policy(op: Arc<DpuKvOperation>, e: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(operation = %format!("{}/{}", op.namespace().unwrap_or_default(), op.name_any()), error = %e, "operation failed");
    Action::requeue(Duration::from_secs(10))
}

/// Where an operation's node is, or why it cannot be reached (with the status to write).
enum Target {
    /// The node's id, and its cluster's control API.
    Node(u32, admin::Endpoint),
    /// The cluster does not exist.
    NoCluster(DpuKvOperationStatus),
    /// The operator has not reached the cluster's control API yet.
    NotYet(DpuKvOperationStatus),
    /// The pod is not one of the cluster's node pods.
    Failed(DpuKvOperationStatus),
}

/// The cluster of `op`, and where its control API is (one read of the cluster).
async fn target(op: &DpuKvOperation, ctx: &Context) -> Result<Target, Error> {
    let ns = op.namespace().ok_or(Error::NoNamespace)?;
    let clusters: Api<DpuKvCluster> = Api::namespaced(ctx.client.clone(), &ns);
    let status = |phase: &str, message: String| DpuKvOperationStatus {
        phase: Some(phase.into()),
        message: Some(message),
        ..DpuKvOperationStatus::default()
    };
    let Some(c) = clusters.get_opt(&op.spec.cluster).await? else {
        return Ok(Target::NoCluster(status("Pending", format!("no DpuKvCluster {:?} in {ns}", op.spec.cluster))));
    };
    let Some(id) = node_id(&op.spec).filter(|&id| i64::from(id) <= i64::from(c.spec.nodes)) else {
        return Ok(Target::Failed(status(
            "Failed",
            format!("{} is not one of the {} node pods of {}", op.spec.pod, c.spec.nodes, render::node_name(&c)),
        )));
    };
    match ctx.endpoint(&c) {
        Some(ep) => Ok(Target::Node(id, ep)),
        None => Ok(Target::NotYet(status(
            "Pending",
            format!("the operator has not reached {}'s control API yet", c.name_any()),
        ))),
    }
}

/// Asks the operation of the master (again: it holds while the resource exists) and reports.
async fn apply(op: &DpuKvOperation, ctx: &Context) -> Result<Action, Error> {
    let (id, ep) = match target(op, ctx).await? {
        Target::Node(id, ep) => (id, ep),
        Target::NoCluster(status) | Target::NotYet(status) => {
            write_status(op, ctx, status).await?;
            return Ok(Action::requeue(RUNNING_EVERY));
        }
        Target::Failed(status) => {
            write_status(op, ctx, status).await?;
            return Ok(Action::requeue(HOLDING_EVERY));
        }
    };
    let pod = &op.spec.pod;
    let status = match op.spec.action {
        OperationAction::Drain => {
            let d = admin::drain(&ep, id).await?;
            DpuKvOperationStatus {
                phase: Some(if d.done { "Holding" } else { "Running" }.into()),
                message: Some(if d.done {
                    format!("{pod} (node {id}) is drained: it leads and holds nothing; deleting this lifts the drain")
                } else {
                    format!("draining {pod} (node {id}): {} regions led, {} held", d.regions_led, d.regions_held)
                }),
                node: Some(id),
                regions_led: Some(d.regions_led),
                regions_held: Some(d.regions_held),
            }
        }
        OperationAction::StepDown => {
            let s = admin::step_down(&ep, id).await?;
            DpuKvOperationStatus {
                phase: Some(if s.done { "Holding" } else { "Running" }.into()),
                message: Some(if s.done {
                    format!("{pod} (node {id}) leads nothing; deleting this lets it lead again")
                } else {
                    format!(
                        "moving the primaries of {pod} (node {id}): {} regions led, {} movable",
                        s.regions_led, s.movable
                    )
                }),
                node: Some(id),
                regions_led: Some(s.regions_led),
                regions_held: None,
            }
        }
    };
    let holding = status.phase.as_deref() == Some("Holding");
    write_status(op, ctx, status).await?;
    Ok(Action::requeue(if holding { HOLDING_EVERY } else { RUNNING_EVERY }))
}

/// The resource is deleted: the node is undrained (or may lead again) before the finalizer goes.
/// A cluster that is gone, or an operation that never named a node of it, has nothing to lift.
async fn lift(op: &DpuKvOperation, ctx: &Context) -> Result<Action, Error> {
    let (id, ep) = match target(op, ctx).await? {
        Target::Node(id, ep) => (id, ep),
        // The cluster gone, or no node of it named: nothing to lift.
        Target::NoCluster(_) | Target::Failed(_) => return Ok(Action::await_change()),
        // Its control API not known yet: wait for it.
        Target::NotYet(status) => return Err(Error::Waiting(status.message.unwrap_or_default())),
    };
    match op.spec.action {
        OperationAction::Drain => {
            admin::undrain(&ep, id).await?;
        }
        OperationAction::StepDown => {
            admin::step_up(&ep, id).await?;
        }
    }
    Ok(Action::await_change())
}

/// Writes the operation's status (unchanged: nothing written).
async fn write_status(op: &DpuKvOperation, ctx: &Context, status: DpuKvOperationStatus) -> Result<(), Error> {
    if op.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let ns = op.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<DpuKvOperation> = Api::namespaced(ctx.client.clone(), &ns);
    Ok(apply_status(&api, &op.name_any(), &status).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(cluster: &str, pod: &str, action: OperationAction) -> Arc<DpuKvOperation> {
        let mut o = DpuKvOperation::new("op", DpuKvOperationSpec { cluster: cluster.into(), action, pod: pod.into() });
        o.metadata.namespace = Some("db".into());
        Arc::new(o)
    }

    #[test]
    fn an_operation_names_its_node_by_the_pod_s_ordinal_and_holds_it_by_cluster() {
        assert_eq!(node_id(&op("demo", "demo-node-0", OperationAction::Drain).spec), Some(1));
        assert_eq!(node_id(&op("demo", "demo-node-12", OperationAction::Drain).spec), Some(13));
        assert_eq!(node_id(&op("demo", "other-node-1", OperationAction::Drain).spec), None);
        assert_eq!(node_id(&op("demo", "demo-node-x", OperationAction::Drain).spec), None);
        let mut going = (*op("demo", "demo-node-2", OperationAction::Drain)).clone();
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
        let held = held_of(&[
            op("demo", "demo-node-1", OperationAction::Drain),
            op("demo", "demo-node-0", OperationAction::StepDown),
            Arc::new(going),
            op("other", "other-node-0", OperationAction::Drain),
        ])
        .expect("listed");
        assert_eq!(
            held["db/demo"],
            BTreeSet::from([(OperationAction::Drain, 2), (OperationAction::StepDown, 1)]),
            "one being deleted holds nothing"
        );
        assert_eq!(held["db/other"], BTreeSet::from([(OperationAction::Drain, 1)]));
    }
}
