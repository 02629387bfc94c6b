//! The backup custom resources (`dpukv.io/v1alpha1`, namespaced) and their reconcilers
//! (docs/backup.md §7), each asking the cluster's control API — where the cluster's last
//! reconcile found it (`Context::endpoint`); one on a cluster not reconciled yet waits
//! (`Pending`):
//!
//! - `DpuKvBackup`: one backup of a cluster to a location. Started once (`POST
//!   /cluster/backups/...`, the job and the node coordinating it kept in the status), followed
//!   at that node until `Done` (the backup's id, its bytes) or `Failed` — a coordinator that
//!   restarted or cannot be reached took the job with it (no manifest was written: nothing
//!   partial exists). Its spec cannot change; deleting it deletes nothing at the location.
//! - `DpuKvBackupSchedule`: the cluster's backup schedule (an interval or a cron expression,
//!   and a retention), set on the cluster — whose master runs it — at every reconcile, its status
//!   the last finished backup; deleted, its finalizer `dpukv.io/backup-schedule` stops the
//!   schedule first (if it is still this one's).
//! - `DpuKvRestore`: a restore of a backup (by id, the latest before a time, or the latest)
//!   into a cluster that holds no key. Begun once (`Running`), followed until the cluster says
//!   none is under way (`Done`); refused by the cluster (not empty, no such backup, a location it
//!   cannot use) it is `Failed` with the cluster's reason. Its spec cannot change.

// kube's `printcolumn(...)` arguments repeat `type_ = ...` across columns, which clippy takes for
// duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use std::sync::Arc;
use std::time::Duration;

use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{self, finalizer};
use kube::{CustomResource, KubeSchema, ResourceExt};
use serde::{Deserialize, Serialize};

use crate::admin::{self, AdminError, Endpoint};
use crate::controller::{Context, Error, apply_status};
use crate::crd::DpuKvCluster;

/// How soon something under way is looked at again.
const RUNNING_EVERY: Duration = Duration::from_secs(5);
/// How soon a schedule's status (its last backup) is refreshed.
const SCHEDULE_EVERY: Duration = Duration::from_secs(30);

/// One backup of a cluster.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "dpukv.io",
    version = "v1alpha1",
    kind = "DpuKvBackup",
    namespaced,
    status = "DpuKvBackupStatus",
    shortname = "dpukvbackup",
    category = "dpukv",
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.cluster"),
    printcolumn(name = "Backup", type_ = "string", json_path = ".status.backup"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("a backup cannot change: delete it and create another"))]
#[serde(rename_all = "camelCase")]
pub struct DpuKvBackupSpec {
    /// The `DpuKvCluster`, in the backup's namespace.
    pub cluster: String,
    /// The location: `file:///dir` or `s3://bucket/prefix` (the node pods' `AWS_*` variables,
    /// from the cluster's `backup.credentialsSecret`, reach it).
    #[x_kube(validation = Rule::new("self.startsWith('file:///') || self.startsWith('s3://')").message("to is file:///dir or s3://bucket/prefix"))]
    pub to: String,
}

/// How far a backup is.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DpuKvBackupStatus {
    /// `Pending`, `Running`, `Done` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What the phase means now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The backup's id at the location (what a `DpuKvRestore` names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
    /// The job's number at its coordinator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<u64>,
    /// The control API address of the node coordinating it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<String>,
    /// Bytes the backup holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Bytes it uploaded (what the location lacked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded_bytes: Option<u64>,
}

/// A cluster's backup schedule.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "dpukv.io",
    version = "v1alpha1",
    kind = "DpuKvBackupSchedule",
    namespaced,
    status = "DpuKvBackupScheduleStatus",
    shortname = "dpukvbackupschedule",
    category = "dpukv",
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.cluster"),
    printcolumn(name = "Schedule", type_ = "string", json_path = ".spec.schedule"),
    printcolumn(name = "Every", type_ = "integer", json_path = ".spec.everySeconds"),
    printcolumn(name = "Last backup", type_ = "string", json_path = ".status.lastBackup"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase")
)]
#[x_kube(validation = Rule::new("has(self.schedule) != has(self.everySeconds)").message("give schedule (cron) or everySeconds, not both"))]
#[serde(rename_all = "camelCase")]
pub struct DpuKvBackupScheduleSpec {
    /// The `DpuKvCluster`, in the schedule's namespace (one schedule per cluster).
    pub cluster: String,
    /// The location: `file:///dir` or `s3://bucket/prefix`.
    #[x_kube(validation = Rule::new("self.startsWith('file:///') || self.startsWith('s3://')").message("to is file:///dir or s3://bucket/prefix"))]
    pub to: String,
    /// A 5-field cron expression (UTC): a backup at each time it names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// A backup every this many seconds (each one a restore point: docs/backup.md §4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("everySeconds is at least 1"))]
    pub every_seconds: Option<u32>,
    /// Keep the newest this many backups (with `keepWithinSeconds`: those either keeps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_last: Option<u32>,
    /// Keep the backups taken within this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_within_seconds: Option<u64>,
}

/// A schedule's state.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DpuKvBackupScheduleStatus {
    /// `Pending`, `Active` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What the phase means now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The cluster's last finished backup's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_backup: Option<String>,
    /// When its cut committed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_backup_time: Option<String>,
    /// Bytes it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_backup_bytes: Option<u64>,
    /// Bytes it uploaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_backup_uploaded_bytes: Option<u64>,
}

/// A restore of a backup into a cluster that holds no key.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "dpukv.io",
    version = "v1alpha1",
    kind = "DpuKvRestore",
    namespaced,
    status = "DpuKvRestoreStatus",
    shortname = "dpukvrestore",
    category = "dpukv",
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.cluster"),
    printcolumn(name = "Backup", type_ = "string", json_path = ".status.backup"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("a restore cannot change: delete it and create another"))]
#[x_kube(validation = Rule::new("!(has(self.backup) && has(self.at))").message("give backup or at, not both"))]
#[serde(rename_all = "camelCase")]
pub struct DpuKvRestoreSpec {
    /// The `DpuKvCluster` restored into, in the restore's namespace; it must hold no key.
    pub cluster: String,
    /// The location: `file:///dir` or `s3://bucket/prefix`.
    #[x_kube(validation = Rule::new("self.startsWith('file:///') || self.startsWith('s3://')").message("from is file:///dir or s3://bucket/prefix"))]
    pub from: String,
    /// The backup's id (without it and `at`: the latest there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[0-9A-Za-z-]{1,64}$')").message("backup is a backup id"))]
    pub backup: Option<String>,
    /// Restore to this moment (RFC 3339): the latest backup taken at or before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
}

/// How far a restore is.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DpuKvRestoreStatus {
    /// `Pending`, `Running`, `Done` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What the phase means now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The backup restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
    /// Regions the restore makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regions: Option<u32>,
    /// Of those, open at their primaries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opened: Option<u32>,
    /// Of those, open and copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copied: Option<u32>,
}

/// The schedule's finalizer: the cluster's schedule stops before the resource goes.
pub const SCHEDULE_FINALIZER: &str = "dpukv.io/backup-schedule";

/// The control API of cluster `name` in `ns`, or why not yet (`Pending`'s message), or None if
/// the cluster does not exist.
async fn endpoint(ns: &str, name: &str, ctx: &Context) -> Result<Result<Endpoint, String>, Error> {
    let clusters: Api<DpuKvCluster> = Api::namespaced(ctx.client.clone(), ns);
    let Some(c) = clusters.get_opt(name).await? else {
        return Ok(Err(format!("no DpuKvCluster {name:?} in {ns}")));
    };
    Ok(ctx.endpoint(&c).ok_or_else(|| format!("the operator has not reached {name}'s control API yet")))
}

/// A refusal the cluster will repeat (a 4xx but 409 `backup_running`): nothing to retry.
fn final_refusal(e: &AdminError) -> bool {
    e.status().is_some_and(|s| (400..500).contains(&s)) && !e.body().starts_with("backup_running")
}

fn pending<S: Default>(set: impl FnOnce(&mut S, String, String), why: String) -> S {
    let mut s = S::default();
    set(&mut s, "Pending".into(), why);
    s
}

/// Writes a status (unchanged: nothing written).
async fn write_status<K, S>(api: &Api<K>, name: &str, old: Option<&S>, status: S) -> Result<(), Error>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: Serialize + PartialEq,
{
    if old == Some(&status) {
        return Ok(());
    }
    Ok(apply_status(api, name, &status).await?)
}

/// Reconciles a `DpuKvBackup`: started once, followed at its coordinator until it ends.
pub async fn reconcile_backup(b: Arc<DpuKvBackup>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = b.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<DpuKvBackup> = Api::namespaced(ctx.client.clone(), &ns);
    let old = b.status.clone().unwrap_or_default();
    if matches!(old.phase.as_deref(), Some("Done" | "Failed")) {
        return Ok(Action::await_change());
    }
    let ep = match endpoint(&ns, &b.spec.cluster, &ctx).await? {
        Ok(ep) => ep,
        Err(why) => {
            let st = pending(|s: &mut DpuKvBackupStatus, p, m| (s.phase, s.message) = (Some(p), Some(m)), why);
            write_status(&api, &b.name_any(), b.status.as_ref(), st).await?;
            return Ok(Action::requeue(RUNNING_EVERY));
        }
    };
    let (job, at) = match (old.job, old.coordinator.clone()) {
        (Some(job), Some(at)) => {
            let there = Endpoint { addrs: at.clone(), tls: ep.tls.clone() };
            match admin::backup_job(&there, job).await {
                Ok(j) => (j, at),
                // The coordinator restarted (the job is not there) or went: the job went with
                // it, and no manifest was written.
                Err(e) => {
                    let st = DpuKvBackupStatus {
                        phase: Some("Failed".into()),
                        message: Some(format!(
                            "the node coordinating it ({at}) lost the job ({}): no backup was written; create another",
                            e.body()
                        )),
                        ..old.clone()
                    };
                    write_status(&api, &b.name_any(), b.status.as_ref(), st).await?;
                    return Ok(Action::await_change());
                }
            }
        }
        _ => match admin::start_backup(&ep, &b.spec.to).await {
            Ok(started) => started,
            Err(e) if final_refusal(&e) => {
                let st = DpuKvBackupStatus {
                    phase: Some("Failed".into()),
                    message: Some(format!("the cluster refused it: {}", e.body())),
                    ..DpuKvBackupStatus::default()
                };
                write_status(&api, &b.name_any(), b.status.as_ref(), st).await?;
                return Ok(Action::await_change());
            }
            Err(e) => return Err(e.into()),
        },
    };
    let (phase, message) = match job.state.as_str() {
        "done" => ("Done", format!("backup {} written", job.backup.clone().unwrap_or_default())),
        "failed" => ("Failed", format!("the backup failed: {}", job.error.clone().unwrap_or_default())),
        _ => ("Running", format!("{} of {} regions uploaded", job.parts, job.regions)),
    };
    let st = DpuKvBackupStatus {
        phase: Some(phase.into()),
        message: Some(message),
        backup: job.backup.clone(),
        job: Some(job.job),
        coordinator: Some(at),
        bytes: (phase == "Done").then_some(job.bytes),
        uploaded_bytes: (phase == "Done").then_some(job.uploaded_bytes),
    };
    write_status(&api, &b.name_any(), b.status.as_ref(), st).await?;
    Ok(if phase == "Running" { Action::requeue(RUNNING_EVERY) } else { Action::await_change() })
}

/// The schedule as the cluster stores it (`key=value` lines).
pub fn schedule_spec(s: &DpuKvBackupScheduleSpec) -> String {
    let mut out = format!("to={}\n", s.to);
    match (&s.schedule, s.every_seconds) {
        (Some(cron), _) => out += &format!("cron={cron}\n"),
        (None, Some(n)) => out += &format!("every_ms={}\n", u64::from(n) * 1000),
        (None, None) => {}
    }
    if let Some(n) = s.keep_last {
        out += &format!("keep_last={n}\n");
    }
    if let Some(n) = s.keep_within_seconds {
        out += &format!("keep_within_ms={}\n", n.saturating_mul(1000));
    }
    out
}

/// Reconciles a `DpuKvBackupSchedule` through its finalizer: the schedule set on the cluster
/// (again at every reconcile) and its last backup in the status; deleted, the schedule stops.
pub async fn reconcile_schedule(s: Arc<DpuKvBackupSchedule>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = s.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<DpuKvBackupSchedule> = Api::namespaced(ctx.client.clone(), &ns);
    let ctx = &*ctx;
    finalizer(&api, SCHEDULE_FINALIZER, s, |event| async move {
        match event {
            finalizer::Event::Apply(s) => apply_schedule(&s, ctx).await,
            finalizer::Event::Cleanup(s) => stop_schedule(&s, ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(Box::new(other)),
    })
}

async fn apply_schedule(s: &DpuKvBackupSchedule, ctx: &Context) -> Result<Action, Error> {
    let ns = s.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<DpuKvBackupSchedule> = Api::namespaced(ctx.client.clone(), &ns);
    let ep = match endpoint(&ns, &s.spec.cluster, ctx).await? {
        Ok(ep) => ep,
        Err(why) => {
            let st =
                pending(|st: &mut DpuKvBackupScheduleStatus, p, m| (st.phase, st.message) = (Some(p), Some(m)), why);
            write_status(&api, &s.name_any(), s.status.as_ref(), st).await?;
            return Ok(Action::requeue(RUNNING_EVERY));
        }
    };
    let st = match admin::set_schedule(&ep, &schedule_spec(&s.spec)).await {
        Ok(now) => {
            let last = now.last_backup.filter(|b| b.to == s.spec.to);
            DpuKvBackupScheduleStatus {
                phase: Some("Active".into()),
                message: Some(match &last {
                    Some(b) => format!("last backup {} ({} bytes, {} uploaded)", b.id, b.bytes, b.uploaded_bytes),
                    None => "no backup finished yet".into(),
                }),
                last_backup_time: last.as_ref().map(|b| rfc3339(b.at_ms)),
                last_backup_bytes: last.as_ref().map(|b| b.bytes),
                last_backup_uploaded_bytes: last.as_ref().map(|b| b.uploaded_bytes),
                last_backup: last.map(|b| b.id),
            }
        }
        Err(e) if final_refusal(&e) => DpuKvBackupScheduleStatus {
            phase: Some("Failed".into()),
            message: Some(format!("the cluster refused it: {}", e.body())),
            ..DpuKvBackupScheduleStatus::default()
        },
        Err(e) => return Err(e.into()),
    };
    write_status(&api, &s.name_any(), s.status.as_ref(), st).await?;
    let every = s.spec.every_seconds.map_or(SCHEDULE_EVERY, |n| Duration::from_secs(u64::from(n)));
    Ok(Action::requeue(every.clamp(RUNNING_EVERY, SCHEDULE_EVERY)))
}

/// The resource is deleted: the cluster's schedule stops, if it is still this one's (another
/// schedule set since is left alone). A cluster that is gone has nothing to stop.
async fn stop_schedule(s: &DpuKvBackupSchedule, ctx: &Context) -> Result<Action, Error> {
    let ns = s.namespace().ok_or(Error::NoNamespace)?;
    let clusters: Api<DpuKvCluster> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(c) = clusters.get_opt(&s.spec.cluster).await? else { return Ok(Action::await_change()) };
    let Some(ep) = ctx.endpoint(&c) else {
        return Err(Error::Waiting(format!("{}'s control API, to stop its backup schedule", c.name_any())));
    };
    let now = admin::schedule(&ep).await?;
    if now.schedule.as_ref().and_then(|v| v["to"].as_str()) == Some(s.spec.to.as_str()) {
        admin::unschedule(&ep).await?;
    }
    Ok(Action::await_change())
}

/// Unix milliseconds as RFC 3339 (UTC).
fn rfc3339(ms: u64) -> String {
    k8s_openapi::jiff::Timestamp::from_millisecond(ms as i64).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

/// Reconciles a `DpuKvRestore`: begun once, followed until the cluster has none under way.
pub async fn reconcile_restore(r: Arc<DpuKvRestore>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = r.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<DpuKvRestore> = Api::namespaced(ctx.client.clone(), &ns);
    let old = r.status.clone().unwrap_or_default();
    if matches!(old.phase.as_deref(), Some("Done" | "Failed")) {
        return Ok(Action::await_change());
    }
    let fail =
        |message: String| DpuKvRestoreStatus { phase: Some("Failed".into()), message: Some(message), ..old.clone() };
    let ep = match endpoint(&ns, &r.spec.cluster, &ctx).await? {
        Ok(ep) => ep,
        Err(why) => {
            let st = pending(|s: &mut DpuKvRestoreStatus, p, m| (s.phase, s.message) = (Some(p), Some(m)), why);
            write_status(&api, &r.name_any(), r.status.as_ref(), st).await?;
            return Ok(Action::requeue(RUNNING_EVERY));
        }
    };
    let progress = if old.phase.as_deref() == Some("Running") {
        admin::restore_progress(&ep).await?
    } else {
        let choice = match (&r.spec.backup, &r.spec.at) {
            (Some(id), _) => Some(id.clone()),
            (None, Some(at)) => match at.parse::<k8s_openapi::jiff::Timestamp>() {
                Ok(t) => Some(format!("at-{}", t.as_millisecond().max(0))),
                Err(e) => {
                    write_status(&api, &r.name_any(), r.status.as_ref(), fail(format!("at {at:?}: {e}"))).await?;
                    return Ok(Action::await_change());
                }
            },
            (None, None) => None,
        };
        match admin::restore(&ep, &r.spec.from, choice.as_deref()).await {
            Ok(p) => p,
            Err(e) if final_refusal(&e) => {
                let st = fail(format!("the cluster refused it: {}", e.body()));
                write_status(&api, &r.name_any(), r.status.as_ref(), st).await?;
                return Ok(Action::await_change());
            }
            Err(e) => return Err(e.into()),
        }
    };
    let st = if progress.state == "none" {
        DpuKvRestoreStatus {
            phase: Some("Done".into()),
            message: Some(format!("backup {} restored", old.backup.clone().unwrap_or_default())),
            copied: old.regions,
            opened: old.regions,
            ..old.clone()
        }
    } else {
        let why = progress.errors.first().map(|e| format!("; {e}")).unwrap_or_default();
        DpuKvRestoreStatus {
            phase: Some("Running".into()),
            message: Some(format!(
                "{} of {} regions open, {} copied{why}",
                progress.opened, progress.regions, progress.copied
            )),
            backup: progress.backup.clone().or(old.backup.clone()),
            regions: Some(progress.regions),
            opened: Some(progress.opened),
            copied: Some(progress.copied),
        }
    };
    let running = st.phase.as_deref() == Some("Running");
    write_status(&api, &r.name_any(), r.status.as_ref(), st).await?;
    Ok(if running { Action::requeue(RUNNING_EVERY) } else { Action::await_change() })
}

/// Retries a failed reconcile of any of these after a while.
pub fn error_policy<K: ResourceExt>(k: Arc<K>, e: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(resource = %format!("{}/{}", k.namespace().unwrap_or_default(), k.name_any()), error = %e, "backup resource reconcile failed");
    Action::requeue(Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_is_stored_as_the_cluster_reads_it() {
        let spec = DpuKvBackupScheduleSpec {
            cluster: "demo".into(),
            to: "s3://b/p".into(),
            schedule: None,
            every_seconds: Some(10),
            keep_last: Some(3),
            keep_within_seconds: Some(3600),
        };
        assert_eq!(schedule_spec(&spec), "to=s3://b/p\nevery_ms=10000\nkeep_last=3\nkeep_within_ms=3600000\n");
        let cron = DpuKvBackupScheduleSpec { schedule: Some("0 3 * * *".into()), every_seconds: None, ..spec };
        assert_eq!(schedule_spec(&cron), "to=s3://b/p\ncron=0 3 * * *\nkeep_last=3\nkeep_within_ms=3600000\n");
        assert_eq!(rfc3339(1_795_778_123_456), "2026-11-27T11:15:23.456Z");
    }
}
