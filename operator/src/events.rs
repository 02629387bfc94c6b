//! Kubernetes events on a `DpuKvCluster` — what `kubectl describe dpukv NAME` shows — published
//! through kube's `Recorder` (`events.k8s.io/v1`, reporting controller `dpukv-operator`; the same
//! event again within minutes is one event counted again, a patch of its series). Publishing
//! never fails a reconcile: an event the API server refuses is logged at debug and forgotten.
//!
//! The reasons (docs/kubernetes.md "Events"):
//! - `DrainStarted`: pods that will go in a scale-in are being drained;
//! - `ScaledIn`: they were drained and the node StatefulSet shrank; `ScaledOut`: it grew;
//! - `RestartingPod`: an upgrade step restarts a pod (its primaries moved away first; the pod is
//!   the event's related object); `RolloutFinished`: every pod runs the new pod template;
//! - `Degraded` (Warning) / `Recovered`: the `Degraded` condition turned True / back to False;
//! - `ReconcileFailed` (Warning): a reconcile failed and is retried with backoff;
//! - `PlaintextOptIn` (Warning): the cluster was set to run without TLS (`Secure` turned False);
//! - `StoppingNodes`, `EtcdKeysDeleted`, `CleanupFailed` (Warning), `EtcdCleanupSkipped`
//!   (Warning): the finalizer's cleanup of the cluster's keys in an external etcd (`etcd_keys`).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use crate::crd::DpuKvCluster;

/// The reporting controller of every event.
pub const REPORTER: &str = "dpukv-operator";

/// Pods that will go in a scale-in are being drained.
pub const DRAIN_STARTED: &str = "DrainStarted";
/// Drains the cluster no longer needs were taken back (a scale-in cancelled midway).
pub const UNDRAINED: &str = "Undrained";
/// The drained pods are gone: the node StatefulSet shrank.
pub const SCALED_IN: &str = "ScaledIn";
/// The node StatefulSet grew.
pub const SCALED_OUT: &str = "ScaledOut";
/// An upgrade step restarts a pod.
pub const RESTARTING_POD: &str = "RestartingPod";
/// Every node pod runs the new pod template.
pub const ROLLOUT_FINISHED: &str = "RolloutFinished";
/// A rollout, drain or scale has made no progress for [`crate::controller::STALL_AFTER`].
pub const STALLED: &str = "Stalled";
/// The `Degraded` condition turned True.
pub const DEGRADED: &str = "Degraded";
/// The `Degraded` condition turned False again.
pub const RECOVERED: &str = "Recovered";
/// A reconcile failed.
pub const RECONCILE_FAILED: &str = "ReconcileFailed";
/// The cluster runs without TLS (`tls.mode: Disabled`).
pub const PLAINTEXT_OPT_IN: &str = "PlaintextOptIn";
/// The finalizer stops the node pods of a deleted cluster before deleting its keys.
pub const STOPPING_NODES: &str = "StoppingNodes";
/// The finalizer deleted the cluster's keys in its external etcd.
pub const ETCD_KEYS_DELETED: &str = "EtcdKeysDeleted";
/// The finalizer could not delete them (the deletion waits, retried with backoff).
pub const CLEANUP_FAILED: &str = "CleanupFailed";
/// The finalizer left them, as the resource's annotation asked.
pub const ETCD_CLEANUP_SKIPPED: &str = "EtcdCleanupSkipped";

/// The API server's limit on an event's note.
const MAX_NOTE: usize = 1024;

/// A recorder reporting as `dpukv-operator` from this host (the pod's name in a pod).
pub fn recorder(client: kube::Client) -> Recorder {
    Recorder::new(client, Reporter::from(REPORTER))
}

/// A `Normal` event: `reason` for `action` (a short PascalCase verb), with `note`.
pub fn normal(reason: &str, action: &str, note: impl Into<String>) -> Event {
    event(EventType::Normal, reason, action, note.into())
}

/// A `Warning` event.
pub fn warning(reason: &str, action: &str, note: impl Into<String>) -> Event {
    event(EventType::Warning, reason, action, note.into())
}

fn event(type_: EventType, reason: &str, action: &str, mut note: String) -> Event {
    if note.len() > MAX_NOTE {
        let mut end = MAX_NOTE - 3;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push_str("...");
    }
    Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None }
}

/// A node pod, as an event's related object.
pub fn pod_ref(c: &DpuKvCluster, pod: String) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod),
        namespace: c.meta().namespace.clone(),
        ..Default::default()
    }
}

/// Publishes `ev` on `c`; a failure is logged at debug, never returned.
pub async fn publish(recorder: &Recorder, c: &DpuKvCluster, ev: Event) {
    if let Err(e) = recorder.publish(&ev, &c.object_ref(&())).await {
        tracing::debug!(reason = %ev.reason, error = %e, "an event could not be published");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_note_is_cut_to_what_the_api_server_takes() {
        let ev = warning(RECONCILE_FAILED, "Reconcile", "é".repeat(1000));
        let note = ev.note.expect("note");
        assert!(note.len() <= MAX_NOTE && note.ends_with("..."), "{}", note.len());
        assert_eq!(normal(SCALED_OUT, "Scale", "short").note.as_deref(), Some("short"));
    }
}
