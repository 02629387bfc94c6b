//! Leader election over a `coordination.k8s.io/v1` Lease, so two operator replicas can run and
//! only one reconciles: a replica takes the Lease when it is absent, already its own, or expired
//! — by create or by replace with the Lease's `resourceVersion` (an optimistic write: of two
//! replicas racing, the apiserver lets one win and answers the other 409 Conflict).
//!
//! **Expiry is judged on this replica's own monotonic clock, never by comparing the holder's
//! `renewTime` with the local wall clock** (as client-go's leader election does): a replica
//! remembers when it first saw the Lease's current record (holder, renew time, resource
//! version), and takes it over only once that record has not changed for the lease's duration.
//! A holder whose wall clock runs ahead or behind therefore cannot be robbed early or keep the
//! Lease for ever. The leader renews every `renew_every` and gives up (`Leadership::lost` fires)
//! once it could not renew for `duration - renew_every` by its own monotonic clock: before any
//! other replica, which waits a whole `duration` from seeing that last renewal, may take over.
//! The margin (`renew_every`) holds while the replicas' clocks run at the same rate.

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

/// A replica's view of the Lease between attempts: the record it last saw and when (its own
/// monotonic clock).
#[derive(Debug, Default)]
pub struct Elector {
    observed: Option<(String, std::time::Instant)>,
}

impl Elector {
    /// A replica that has seen nothing yet (it waits a whole duration before taking a held Lease).
    pub fn new() -> Elector {
        Elector::default()
    }

    /// One attempt at taking or renewing the Lease, at wall time `now` (written as the renew
    /// time) and monotonic time `mono` (what expiry is judged by): whether this replica holds it.
    pub async fn try_acquire(
        &mut self,
        api: &Api<Lease>,
        cfg: &LeaseConfig,
        now: Timestamp,
        mono: std::time::Instant,
    ) -> Result<bool, kube::Error> {
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
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let ours = holder == cfg.identity;
        // The record as last written: any renewal changes it.
        let record = format!(
            "{holder}\n{:?}\n{}",
            spec.renew_time.as_ref().map(|t| t.0.to_string()),
            current.metadata.resource_version.clone().unwrap_or_default()
        );
        let seen_at = match &self.observed {
            Some((r, at)) if *r == record => *at,
            _ => {
                self.observed = Some((record, mono));
                mono
            }
        };
        let held_for = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
        let expired = holder.is_empty() || mono.saturating_duration_since(seen_at) > held_for;
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
}

/// Held leadership: `lost` fires when it ends (renewals failed for a lease's duration, or
/// another replica holds the Lease).
pub struct Leadership {
    /// Cancelled when leadership is lost or `stop` fires.
    pub lost: CancellationToken,
}

/// Waits until this replica leads (or `stop`: None), then keeps renewing in the background.
pub async fn lead(api: Api<Lease>, cfg: LeaseConfig, stop: CancellationToken) -> Option<Leadership> {
    let mut elector = Elector::new();
    let acquired = loop {
        let sent = tokio::time::Instant::now();
        match elector.try_acquire(&api, &cfg, Timestamp::now(), std::time::Instant::now()).await {
            Ok(true) => break sent,
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "leader election: the Lease could not be read or written"),
        }
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(cfg.renew_every) => {}
        }
    };
    tracing::info!(lease = %cfg.name, identity = %cfg.identity, "leading");
    let lost = stop.child_token();
    let l = lost.clone();
    tokio::spawn(async move {
        let mut last = acquired;
        loop {
            tokio::select! {
                _ = l.cancelled() => return,
                _ = tokio::time::sleep(cfg.renew_every) => {}
            }
            // Counted from before the write: a follower sees the renewal no earlier.
            let sent = tokio::time::Instant::now();
            match elector.try_acquire(&api, &cfg, Timestamp::now(), std::time::Instant::now()).await {
                Ok(true) => last = sent,
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
