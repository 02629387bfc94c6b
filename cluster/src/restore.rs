//! Restoring a backup into an empty cluster (docs/backup.md §5): the metadata side.
//!
//! 1. The restore begins with a cut ([`crate::fence::take_cut`] with a [`RestorePlan`]): every
//!    primary fences its region and says whether it holds a live key; the cut commits only if
//!    none does, and its one transaction replaces every region of the map by the backup's
//!    regions ([`commit`]: new ids, the backup's key ranges, one primary each, no copies yet),
//!    writes the job (`restore-job`) and each new region's part (`restores/<region>`). A write
//!    the fence held back is never acknowledged: its region is gone when the hold lifts.
//! 2. Each new region's primary fetches its part from the location (every object checked),
//!    opens it — ordinary recovery replays its log to the backup's cut — and reports
//!    `opened` under `restores/<region>/<node>` ([`report_txn`]); the master's usual repair
//!    copies it to backups meanwhile. No region of a restore is served (no read, no write)
//!    until the restore ends, so nothing is acknowledged on a copy that may be thrown away.
//! 3. The master ([`step`]) ends the restore once every region is open at its primary and
//!    has its copies: one transaction deletes the job and the regions' keys; the primaries
//!    serve from then on. Before that, a region whose primary died before any copy caught up
//!    is given to another live node, which fetches the part again: nothing of it was ever
//!    served, so no acknowledged write is lost by starting over.
//!
//! A restore outlives whoever began it (the keys are bound to no lease): a node killed while
//! fetching starts over from its region's marker, a new master ends it. [`abort_txn`] gives the
//! cluster back empty (the master then lays out fresh regions).

use std::collections::{BTreeMap, BTreeSet};

use dpukv_proto::regionmap::{RegionInfo, RegionState};

use crate::fence::FenceError;
use crate::keys::Keys;
use crate::master::Snapshot;
use crate::meta::{Compare, KeyValue, MetaError, Revision, Txn, TxnOp};

/// The longest location URL or backup id a job holds.
pub const MAX_FIELD: usize = 1000;

/// What a restore restores: the `restore-job` key's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreJob {
    /// The location's URL (`file:///dir`, `s3://bucket/prefix`).
    pub from: String,
    /// The backup's id there.
    pub backup: String,
}

impl RestoreJob {
    /// `from=<url>\nbackup=<id>\n` (neither holds a line break).
    pub fn encode(&self) -> Vec<u8> {
        format!("from={}\nbackup={}\n", self.from, self.backup).into_bytes()
    }

    /// Parses [`RestoreJob::encode`]'s form.
    pub fn decode(v: &[u8]) -> Result<RestoreJob, MetaError> {
        let bad = |m: &str| MetaError::Invalid(format!("restore job: {m}"));
        let text = std::str::from_utf8(v).map_err(|_| bad("not UTF-8"))?;
        let (mut from, mut backup) = (None, None);
        for line in text.lines() {
            match line.split_once('=') {
                Some(("from", f)) => from = Some(f.to_string()),
                Some(("backup", b)) => backup = Some(b.to_string()),
                _ => {}
            }
        }
        match (from, backup) {
            (Some(from), Some(backup)) if valid_field(&from) && valid_field(&backup) => Ok(RestoreJob { from, backup }),
            _ => Err(bad("from and backup")),
        }
    }
}

fn valid_field(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_FIELD && !s.contains(['\n', '\r'])
}

/// One region of a backup: its id there and its key range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartRange {
    /// The region's id in the backup (its part's name).
    pub part: u32,
    /// First key.
    pub start: Vec<u8>,
    /// First key after it (None: the last region).
    pub end: Option<Vec<u8>>,
}

/// A restore to begin: the job and the backup's regions in key order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestorePlan {
    /// Where from, which backup.
    pub job: RestoreJob,
    /// The backup's regions, covering every key once, in order.
    pub parts: Vec<PartRange>,
}

/// A node's report on a region it restores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreReport {
    /// Fetched (or promoted from a copy) and open: it holds the region at the backup's cut.
    Opened,
    /// Fetching failed (the node tries again): why, with the error's code first.
    Failed(String),
}

impl RestoreReport {
    /// `opened` or `failed <why>`.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            RestoreReport::Opened => b"opened".to_vec(),
            RestoreReport::Failed(why) => format!("failed {why}").into_bytes(),
        }
    }

    /// Parses [`RestoreReport::encode`]'s form.
    pub fn decode(v: &[u8]) -> Option<RestoreReport> {
        let s = std::str::from_utf8(v).ok()?;
        match s {
            "opened" => Some(RestoreReport::Opened),
            _ => s.strip_prefix("failed ").map(|w| RestoreReport::Failed(w.to_string())),
        }
    }
}

/// A region being restored, as a poll sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionRestore {
    /// The backup's region whose part it is.
    pub part: u32,
    /// The node the region was given to after its primary died with the only copy: it fetches
    /// the part even if it holds a copy (a joining one, partial).
    pub fetch_by: Option<u32>,
    /// The nodes' reports.
    pub reports: BTreeMap<u32, RestoreReport>,
}

/// A restore under way, as a poll sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    /// What it restores.
    pub job: RestoreJob,
    /// The job key's create revision (reports and the end apply to this restore only).
    pub create: Revision,
    /// Its regions, by id.
    pub regions: BTreeMap<u32, RegionRestore>,
}

impl Restore {
    /// The region's restore, if it is one of this restore's.
    pub fn region(&self, id: u32) -> Option<&RegionRestore> {
        self.regions.get(&id)
    }
}

/// The restore among a cluster's keys (`kvs` from a range of its root), if one is under way.
/// Keys that do not parse are left out.
pub fn restore_in(kvs: &[KeyValue], keys: &Keys) -> Option<Restore> {
    let head = kvs.iter().find(|kv| kv.key == keys.restore_job())?;
    let job = RestoreJob::decode(&head.value).ok()?;
    let mut regions = BTreeMap::new();
    for (id, (head, reports)) in crate::fence::grouped(kvs, &keys.restores()) {
        let (Some(head), Ok(id)) = (head, u32::try_from(id)) else { continue };
        let Some((part, fetch_by)) = std::str::from_utf8(&head.value).ok().and_then(parse_head) else { continue };
        let reports = reports.into_iter().filter_map(|(n, kv)| Some((n, RestoreReport::decode(&kv.value)?))).collect();
        regions.insert(id, RegionRestore { part, fetch_by, reports });
    }
    Some(Restore { job, create: head.create_revision, regions })
}

/// A region's head: `<part>[ <node that must fetch it>]`.
fn parse_head(v: &str) -> Option<(u32, Option<u32>)> {
    let mut it = v.split(' ');
    let part = it.next()?.parse().ok()?;
    let by = match it.next() {
        Some(n) => Some(n.parse().ok()?),
        None => None,
    };
    it.next().is_none().then_some((part, by))
}

/// Whether `plan` can begin on the cluster `snap` shows: no restore under way, a job that
/// fits its key, parts that cover every key once in order, and a node to place them on.
pub fn check(snap: &Snapshot, plan: &RestorePlan) -> Result<(), FenceError> {
    let refuse = |m: String| Err(FenceError::Refused(m));
    if let Some(r) = &snap.restore {
        return refuse(format!(
            "restore_running: a restore of backup {} from {} is under way (run it again to follow it, or abort it)",
            r.job.backup, r.job.from
        ));
    }
    if !valid_field(&plan.job.from) || !valid_field(&plan.job.backup) {
        return refuse(
            "restore_refused: the location or the backup id is empty, too long or holds a line break".into(),
        );
    }
    if plan.parts.is_empty() || plan.parts.len() > crate::fence::MAX_FENCE_REGIONS {
        return refuse(format!("restore_refused: a backup of {} regions", plan.parts.len()));
    }
    let mut next: Option<&[u8]> = Some(b"");
    for p in &plan.parts {
        if next != Some(p.start.as_slice()) || p.end.as_deref().is_some_and(|e| e <= p.start.as_slice()) {
            return refuse(format!(
                "restore_refused: the backup's region {} does not follow the one before it",
                p.part
            ));
        }
        next = p.end.as_deref();
    }
    if next.is_some() {
        return refuse("restore_refused: the backup's regions do not reach the end of the key space".into());
    }
    if eligible(snap).is_empty() {
        return Err(FenceError::Busy("no live node to restore onto".into()));
    }
    Ok(())
}

/// Live nodes not draining, ascending.
fn eligible(snap: &Snapshot) -> Vec<u32> {
    let mut n: Vec<u32> = snap.map.nodes.iter().map(|n| n.id).filter(|id| !snap.facts.draining.contains(id)).collect();
    n.sort_unstable();
    n
}

/// The regions a restore lays out on the cluster `snap` shows: ids after every id used so far,
/// the parts' ranges, the primaries spread evenly, no copies yet (the master repairs them).
pub fn layout(snap: &Snapshot, plan: &RestorePlan) -> Vec<RegionInfo> {
    let first =
        snap.map.regions.iter().map(|r| r.id).chain(snap.handoffs.last_region_id.map(|(id, _)| id)).max().unwrap_or(0)
            + 1;
    let nodes = eligible(snap);
    plan.parts
        .iter()
        .enumerate()
        .map(|(i, p)| RegionInfo {
            id: first + i as u32,
            start: p.start.clone(),
            end: p.end.clone(),
            primary: nodes[i % nodes.len().max(1)],
            backups: vec![],
            joining: vec![],
            epoch: 1,
            state: RegionState::Serving,
        })
        .collect()
}

/// What the restore's cut adds to its commit: no restore began meanwhile and the region-id
/// counter is the one read; every region of the map deleted, the backup's written
/// ([`layout`]), the counter past them, the job and each region's part.
pub fn commit(keys: &Keys, snap: &Snapshot, plan: &RestorePlan) -> Result<(Vec<Compare>, Vec<TxnOp>), FenceError> {
    check(snap, plan)?;
    let regions = layout(snap, plan);
    let last = regions.last().map_or(0, |r| r.id);
    let mut when = vec![Compare::Absent(keys.restore_job())];
    when.push(match snap.handoffs.last_region_id {
        Some((_, rev)) => Compare::ModRevision(keys.last_region_id(), rev),
        None => Compare::Absent(keys.last_region_id()),
    });
    let mut then: Vec<TxnOp> = snap.map.regions.iter().map(|r| TxnOp::Delete { key: keys.region(r.id) }).collect();
    then.push(TxnOp::Put { key: keys.last_region_id(), value: last.to_string().into_bytes(), lease: None });
    then.push(TxnOp::Put { key: keys.restore_job(), value: plan.job.encode(), lease: None });
    for (r, p) in regions.iter().zip(&plan.parts) {
        then.push(TxnOp::Put { key: keys.region(r.id), value: r.encode(), lease: None });
        then.push(TxnOp::Put { key: keys.restore_region(r.id), value: p.part.to_string().into_bytes(), lease: None });
    }
    Ok((when, then))
}

/// A node's report on `region` of `restore`: written only while that restore's job exists,
/// bound to the node's lease (it goes with the node).
pub fn report_txn(
    keys: &Keys,
    restore: &Restore,
    region: u32,
    node: u32,
    report: &RestoreReport,
    lease: crate::meta::LeaseId,
) -> Txn {
    Txn {
        when: vec![Compare::CreateRevision(keys.restore_job(), restore.create)],
        then: vec![TxnOp::Put { key: keys.restore_report(region, node), value: report.encode(), lease: Some(lease) }],
        otherwise: vec![],
    }
}

/// What the master does for a restore under way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Every region is open at its primary and copied: end the restore.
    End,
    /// This region's primary died before any copy caught up: give it to another node (it
    /// fetches the part again).
    Reassign(RegionInfo),
}

/// Regions a restore still waits for, and why, in region order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waiting {
    /// Not open at its primary yet (fetching, or failing: its reports say).
    Opening(u32),
    /// Open, with fewer copies than the cluster's replication (on the nodes alive).
    Copying(u32),
}

/// The restore's progress on the cluster `snap` shows: what it waits for (empty: it can end).
pub fn waiting(snap: &Snapshot, restore: &Restore) -> Vec<Waiting> {
    let target = snap.config.as_ref().map_or(1, |c| c.replication).min(eligible(snap).len()).max(1);
    let mut out = Vec::new();
    for (&id, rr) in &restore.regions {
        let Some(r) = snap.map.region(id) else { continue };
        if rr.reports.get(&r.primary) != Some(&RestoreReport::Opened) {
            out.push(Waiting::Opening(id));
        } else if r.backups.len() + 1 < target || !r.joining.is_empty() {
            out.push(Waiting::Copying(id));
        }
    }
    out
}

/// The master's next step for the restore under way in `snap`, if any, with its transaction
/// (fenced by `fence`, the master's own compare).
pub fn step(keys: &Keys, snap: &Snapshot, fence: &Compare) -> Option<(Step, Txn)> {
    let restore = snap.restore.as_ref()?;
    let live: BTreeSet<u32> = snap.map.nodes.iter().map(|n| n.id).collect();
    let nodes = eligible(snap);
    for (&id, rr) in &restore.regions {
        let Some(r) = snap.map.region(id) else { continue };
        if live.contains(&r.primary) || !r.backups.is_empty() || nodes.is_empty() {
            continue;
        }
        // The live node leading the fewest regions (ties: the lowest id).
        let led = |n: u32| snap.map.regions.iter().filter(|x| x.primary == n).count();
        let to = *nodes.iter().min_by_key(|&&n| (led(n), n)).expect("nodes is not empty");
        let next = RegionInfo { primary: to, backups: vec![], joining: vec![], epoch: r.epoch + 1, ..r.clone() };
        let rev = snap.region_revs.iter().find(|(x, _)| *x == id).map_or(0, |(_, rev)| *rev);
        let txn = Txn {
            when: vec![
                fence.clone(),
                Compare::CreateRevision(keys.restore_job(), restore.create),
                Compare::ModRevision(keys.region(id), rev),
                Compare::Absent(keys.node(r.primary)),
            ],
            then: vec![
                TxnOp::Put { key: keys.region(id), value: next.encode(), lease: None },
                // It fetches the part: a copy it holds was joining, not caught up.
                TxnOp::Put {
                    key: keys.restore_region(id),
                    value: format!("{} {to}", rr.part).into_bytes(),
                    lease: None,
                },
            ],
            otherwise: vec![],
        };
        return Some((Step::Reassign(next), txn));
    }
    let all_there = restore.regions.keys().all(|id| snap.map.region(*id).is_some());
    if !all_there || !waiting(snap, restore).is_empty() {
        return None;
    }
    Some((Step::End, end_txn(keys, restore, vec![fence.clone()])))
}

/// Deletes the restore's keys if it is still the one under way (plus `when`).
fn end_txn(keys: &Keys, restore: &Restore, mut when: Vec<Compare>) -> Txn {
    when.push(Compare::CreateRevision(keys.restore_job(), restore.create));
    let mut then = vec![TxnOp::Delete { key: keys.restore_job() }];
    for (&id, rr) in &restore.regions {
        then.push(TxnOp::Delete { key: keys.restore_region(id) });
        then.extend(rr.reports.keys().map(|&n| TxnOp::Delete { key: keys.restore_report(id, n) }));
    }
    Txn { when, then, otherwise: vec![] }
}

/// Abandons the restore under way in `snap`: its regions and keys go, and the master lays out
/// fresh empty regions — the cluster is as empty as before the restore began. (None of its
/// regions was served: nothing acknowledged is lost.) Applies only while that restore is
/// under way.
pub fn abort_txn(keys: &Keys, snap: &Snapshot) -> Option<Txn> {
    let restore = snap.restore.as_ref()?;
    let mut txn = end_txn(keys, restore, vec![]);
    txn.then.extend(snap.map.regions.iter().map(|r| TxnOp::Delete { key: keys.region(r.id) }));
    Some(txn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_and_reports_read_back_and_bad_ones_are_refused() {
        let job = RestoreJob { from: "s3://b/p".into(), backup: "20261127T000000Z-00ff".into() };
        assert_eq!(RestoreJob::decode(&job.encode()), Ok(job));
        assert!(RestoreJob::decode(b"from=\nbackup=x\n").is_err());
        assert!(RestoreJob::decode(b"backup=x\n").is_err());
        for r in [RestoreReport::Opened, RestoreReport::Failed("backup_object_missing: objects/ab".into())] {
            assert_eq!(RestoreReport::decode(&r.encode()), Some(r));
        }
        assert_eq!(RestoreReport::decode(b"open"), None);
    }
}
