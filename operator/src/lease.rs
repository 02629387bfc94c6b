//! Leader election over a `coordination.k8s.io/v1` Lease, so two operator replicas can run and
//! only one reconciles: a replica takes the Lease when it is absent, expired (its last renewal
//! older than its duration) or already its own, by create or by replace with the Lease's
//! `resourceVersion` (an optimistic write: of two replicas racing, the apiserver lets one win and
//! answers the other 409 Conflict). The leader renews every `renew_every`; a leader that cannot
//! renew within the lease's duration gives up (`Leadership::lost` fires) before another replica
//! may take over, so two never reconcile at once as long as clocks agree within the margin.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio_util::sync::CancellationToken;

/// Who competes for which Lease, and its timing.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// The Lease's name.
    pub name: String,
    /// This replica's identity (the pod's name).
    pub identity: String,
    /// How long a renewal holds.
    pub duration: Duration,
    /// How often the leader renews (well under `duration`).
    pub renew_every: Duration,
}

fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// One attempt at taking or renewing the Lease at time `now`: whether this replica holds it.
pub async fn try_acquire(api: &Api<Lease>, cfg: &LeaseConfig, now: Timestamp) -> Result<bool, kube::Error> {
    let secs = i32::try_from(cfg.duration.as_secs()).unwrap_or(i32::MAX).max(1);
    let fresh = |acquire: Timestamp, transitions: i32| LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(secs),
        acquire_time: Some(MicroTime(acquire)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(transitions),
        ..Default::default()
    };
    let Some(current) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta { name: Some(cfg.name.clone()), ..Default::default() },
            spec: Some(fresh(now, 0)),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(e) if conflict(&e) => Ok(false),
            Err(e) => Err(e),
        };
    };
    let spec = current.spec.clone().unwrap_or_default();
    let ours = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
    let held_for = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
    let expired = match (&spec.holder_identity, &spec.renew_time) {
        (Some(h), Some(MicroTime(renewed))) if !h.is_empty() => {
            now.duration_since(*renewed).as_secs_f64() > held_for.as_secs_f64()
        }
        _ => true,
    };
    if !ours && !expired {
        return Ok(false);
    }
    let transitions = spec.lease_transitions.unwrap_or(0);
    let next = if ours {
        fresh(spec.acquire_time.map_or(now, |t| t.0), transitions)
    } else {
        fresh(now, transitions.saturating_add(1))
    };
    let lease = Lease { metadata: current.metadata.clone(), spec: Some(next) };
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(e) if conflict(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Held leadership: `lost` fires when it ends (renewals failed for a lease's duration, or
/// another replica holds the Lease).
pub struct Leadership {
    /// Cancelled when leadership is lost or `stop` fires.
    pub lost: CancellationToken,
}

/// Waits until this replica leads (or `stop`: None), then keeps renewing in the background.
pub async fn lead(api: Api<Lease>, cfg: LeaseConfig, stop: CancellationToken) -> Option<Leadership> {
    loop {
        match try_acquire(&api, &cfg, Timestamp::now()).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "leader election: the Lease could not be read or written"),
        }
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(cfg.renew_every) => {}
        }
    }
    tracing::info!(lease = %cfg.name, identity = %cfg.identity, "leading");
    let lost = stop.child_token();
    let l = lost.clone();
    tokio::spawn(async move {
        let mut last = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = l.cancelled() => return,
                _ = tokio::time::sleep(cfg.renew_every) => {}
            }
            match try_acquire(&api, &cfg, Timestamp::now()).await {
                Ok(true) => last = tokio::time::Instant::now(),
                Ok(false) => {
                    tracing::warn!("another replica holds the Lease: no longer leading");
                    l.cancel();
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "renewing the Lease failed"),
            }
            // Give up before the lease can expire for the others.
            if last.elapsed() + cfg.renew_every >= cfg.duration {
                tracing::warn!("the Lease could not be renewed in time: no longer leading");
                l.cancel();
                return;
            }
        }
    });
    Some(Leadership { lost })
}
