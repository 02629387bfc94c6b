//! Backup fences (docs/backup.md §2): a consistent cut across every region, taken through the
//! metadata store while the cluster serves.
//!
//! 1. The coordinator ([`take_cut`]) reads the map and writes `fences/<id>` under a lease of its
//!    own: every region with its epoch, and how long a primary holds ([`FenceSpec`]).
//! 2. Each primary sees it in its map poll (within ~50 ms), takes its log's written end as the
//!    region's cut, holds back every acknowledgement and read past it (the node's
//!    `replication::Acks::fence`: the log, its sync and the streams to backups go on), and
//!    reports `<epoch> <position>` under `fences/<id>/<region>` ([`report_txn`]: only while the
//!    fence key it saw exists).
//! 3. Once every region reported at its epoch, the coordinator commits with one transaction:
//!    the fence key is the one it created, and no region key changed since the map it read
//!    ([`Compare::UnchangedSince`]: no failover, repair, split or merge in between). The commit's
//!    only change is deleting the fence key.
//! 4. A primary lifts its hold once the fence key is gone — committed, aborted, or its
//!    coordinator's lease ended: in every case nothing can commit any more. Past the fence's
//!    hold time it deletes the key itself first ([`break_txn`]): the commit's compare then
//!    fails, so a fence whose hold ran out can never commit.
//!
//! Why the cut is consistent (the argument in full: docs/backup.md §2): a primary holds from its
//! report until it sees the key gone, and the key goes with the commit or before it can happen;
//! so every write past a cut completes after the commit, while every write in a cut was invoked
//! before its primary saw the fence, hence before the commit. No clock decides validity — the
//! hold time only bounds how long acknowledgements wait. Without the metadata store a primary
//! cannot lift (it cannot see the key gone, nor delete it): its writes stop as they would anyway
//! once its lease runs out.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dpukv_proto::regionmap::RegionMap;

use crate::keys::Keys;
use crate::master;
use crate::meta::{Compare, KeyValue, LeaseId, MetaError, MetaStore, Revision, Txn, TxnOp};

/// How long a primary holds a fence by default before it breaks it.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(2);
/// How often the coordinator looks for the primaries' reports.
const REPORT_POLL: Duration = Duration::from_millis(10);
/// The most regions a fence names (a bound on the fence key's size and on the reports read).
pub const MAX_FENCE_REGIONS: usize = 100_000;

/// What a fence asks of the primaries (the fence key's value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceSpec {
    /// How long a primary holds before it breaks the fence.
    pub hold: Duration,
    /// Every region of the map, with its epoch: only the primary at that epoch reports.
    pub regions: Vec<(u32, u64)>,
    /// Whether the primaries say if their region holds a live key (a restore's cut asks; a
    /// backup's does not: the look costs a scan over whatever deleted keys lie before the
    /// first live one).
    pub check_empty: bool,
}

impl FenceSpec {
    /// `hold_ms=<n>\nregions=<region>:<epoch>,...\n[check_empty=1\n]`.
    pub fn encode(&self) -> Vec<u8> {
        let regions: Vec<String> = self.regions.iter().map(|(r, e)| format!("{r}:{e}")).collect();
        let mut v = format!("hold_ms={}\nregions={}\n", self.hold.as_millis(), regions.join(","));
        if self.check_empty {
            v.push_str("check_empty=1\n");
        }
        v.into_bytes()
    }

    /// Parses [`FenceSpec::encode`]'s form.
    pub fn decode(v: &[u8]) -> Result<FenceSpec, MetaError> {
        let bad = |m: &str| MetaError::Invalid(format!("fence: {m}"));
        let text = std::str::from_utf8(v).map_err(|_| bad("not UTF-8"))?;
        let (mut hold, mut regions, mut check_empty) = (None, None, false);
        for line in text.lines() {
            match line.split_once('=') {
                Some(("check_empty", v)) => check_empty = v == "1",
                Some(("hold_ms", n)) => hold = Some(Duration::from_millis(n.parse().map_err(|_| bad("hold_ms"))?)),
                Some(("regions", list)) => {
                    let parsed: Result<Vec<(u32, u64)>, MetaError> = list
                        .split(',')
                        .filter(|s| !s.is_empty())
                        .take(MAX_FENCE_REGIONS + 1)
                        .map(|p| {
                            let (r, e) = p.split_once(':').ok_or_else(|| bad("region:epoch"))?;
                            Ok((r.parse().map_err(|_| bad("region"))?, e.parse().map_err(|_| bad("epoch"))?))
                        })
                        .collect();
                    regions = Some(parsed?);
                }
                _ => {}
            }
        }
        let (Some(hold), Some(regions)) = (hold, regions) else { return Err(bad("hold_ms and regions")) };
        if regions.len() > MAX_FENCE_REGIONS {
            return Err(bad("too many regions"));
        }
        Ok(FenceSpec { hold, regions, check_empty })
    }

    /// The epoch a region is fenced at, if the fence names it.
    pub fn epoch_of(&self, region: u32) -> Option<u64> {
        self.regions.iter().find(|(r, _)| *r == region).map(|(_, e)| *e)
    }
}

/// A fence as a map poll sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// Its id (the key's name).
    pub id: u64,
    /// The fence key's create revision: a report or a break applies to this key only.
    pub create: Revision,
    /// The coordinator's lease (the reports are bound to it too).
    pub lease: Option<LeaseId>,
    /// What it asks.
    pub spec: FenceSpec,
    /// The reports so far: region -> (epoch, cut position).
    pub reported: BTreeMap<u32, (u64, u64)>,
}

/// The keys under `prefix` by id: the head `<prefix><id>` (if there) and its
/// `<prefix><id>/<region>` keys. A key that does not parse is left out: nothing a fence or job
/// key holds may stop a map poll.
type Grouped<'a> = BTreeMap<u64, Group<'a>>;
/// One id's head key and its keys by region.
type Group<'a> = (Option<&'a KeyValue>, Vec<(u32, &'a KeyValue)>);

pub(crate) fn grouped<'a>(kvs: &'a [KeyValue], prefix: &[u8]) -> Grouped<'a> {
    let mut out = Grouped::new();
    for kv in kvs.iter().filter(|kv| kv.key.starts_with(prefix)) {
        let Ok(rest) = std::str::from_utf8(&kv.key[prefix.len()..]) else { continue };
        let (id, region) = match rest.split_once('/') {
            None => (rest, None),
            Some((id, region)) => (id, Some(region)),
        };
        let Ok(id) = id.parse::<u64>() else { continue };
        match region {
            None => out.entry(id).or_default().0 = Some(kv),
            Some(r) => {
                if let Ok(r) = r.parse() {
                    out.entry(id).or_default().1.push((r, kv));
                }
            }
        }
    }
    out
}

/// The fences among a cluster's keys (`kvs` from a range of its root).
pub fn fences_in(kvs: &[KeyValue], keys: &Keys) -> Vec<Fence> {
    let fence = |(id, (head, reports)): (u64, Group<'_>)| {
        let head = head?;
        let spec = FenceSpec::decode(&head.value).ok()?;
        let reported = reports
            .into_iter()
            .filter_map(|(region, kv)| parse_report(&kv.value).map(|r| (region, (r.epoch, r.position))))
            .collect();
        Some(Fence { id, create: head.create_revision, lease: head.lease, spec, reported })
    };
    grouped(kvs, &keys.fences()).into_iter().filter_map(fence).collect()
}

/// A primary's report of its cut, as written under `fences/<id>/<region>`:
/// `<epoch> <position>[ <lease>][ empty]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The region's epoch the primary fenced at.
    pub epoch: u64,
    /// Its cut position.
    pub position: u64,
    /// The primary's registration lease, when it said.
    pub reporter: Option<LeaseId>,
    /// The region held no live key at the cut (what a restore asks: docs/backup.md §5).
    pub empty: bool,
}

impl Report {
    fn encode(&self) -> Vec<u8> {
        let mut v = format!("{} {}", self.epoch, self.position);
        if let Some(r) = self.reporter {
            v.push_str(&format!(" {r}"));
        }
        if self.empty {
            v.push_str(" empty");
        }
        v.into_bytes()
    }
}

fn parse_report(value: &[u8]) -> Option<Report> {
    let mut parts = std::str::from_utf8(value).ok()?.split(' ');
    let (epoch, position) = (parts.next()?.parse().ok()?, parts.next()?.parse().ok()?);
    let mut report = Report { epoch, position, reporter: None, empty: false };
    for p in parts {
        match p {
            "empty" => report.empty = true,
            l if report.reporter.is_none() && !report.empty => report.reporter = Some(l.parse().ok()?),
            _ => return None,
        }
    }
    Some(report)
}

/// A primary's report of its cut for `region` at `epoch` to fence `id`: written only while the
/// fence key it saw (created at `create`) exists, bound to the coordinator's lease; `reporter`
/// is the primary's registration lease (a backup job fails if the primary registers anew — a
/// restart — before its part is in: its snapshot went with the process).
pub fn report_txn(
    keys: &Keys,
    (id, create, lease): (u64, Revision, Option<LeaseId>),
    region: u32,
    report: Report,
) -> Txn {
    Txn {
        when: vec![Compare::CreateRevision(keys.fence(id), create)],
        then: vec![TxnOp::Put { key: keys.fence_report(id, region), value: report.encode(), lease }],
        otherwise: vec![],
    }
}

/// A primary breaks fence `id` (created at `create`) whose hold ran out: the key goes, so the
/// commit can no longer happen. Whatever the outcome (the key was already gone: committed or
/// aborted), the primary may lift once this is applied.
pub fn break_txn(keys: &Keys, id: u64, create: Revision) -> Txn {
    Txn {
        when: vec![Compare::CreateRevision(keys.fence(id), create)],
        then: vec![TxnOp::Delete { key: keys.fence(id) }],
        otherwise: vec![],
    }
}

/// A primary's side of the fences: which regions it holds for which fence, and what to do at
/// each map poll ([`FenceHolder::poll`]). The node carries the steps out (its regions'
/// `Acks::fence` and `lift`, and the transactions); the decisions are here, in one place the
/// tests drive too.
#[derive(Debug, Default)]
pub struct FenceHolder {
    holds: BTreeMap<(u64, u32), Hold>,
    /// The node's registration lease now, said in its reports ([`FenceHolder::set_reporter`]).
    reporter: Option<LeaseId>,
}

#[derive(Debug, Clone)]
struct Hold {
    create: Revision,
    lease: Option<LeaseId>,
    epoch: u64,
    position: u64,
    until: Instant,
    reported: bool,
    reporter: Option<LeaseId>,
    empty: bool,
}

/// What a primary does after a map poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceStep {
    /// Fence the region now — hold back everything past its log's written end — then call
    /// [`FenceHolder::fenced`] with that position and run the report it returns.
    Fence {
        /// The fence.
        fence: Fence,
        /// The region (this node leads it at `epoch`).
        region: u32,
        /// Its epoch.
        epoch: u64,
    },
    /// Write this report again (an earlier try failed), then call [`FenceHolder::reported`].
    Report {
        /// The fence's id.
        id: u64,
        /// The region.
        region: u32,
        /// The report's transaction.
        txn: Txn,
    },
    /// The fence's hold ran out: run this transaction (it breaks the fence); the lift follows
    /// at the next poll, which sees the key gone.
    Break {
        /// The fence's id.
        id: u64,
        /// The transaction.
        txn: Txn,
    },
    /// The fence key is gone (committed, aborted, broken, or its lease ended): lift the
    /// region's hold.
    Lift {
        /// The fence's id.
        id: u64,
        /// The region.
        region: u32,
    },
}

impl FenceHolder {
    /// What to do now, given the fences of a map poll and the regions this node leads (region
    /// -> epoch).
    pub fn poll(
        &mut self,
        keys: &Keys,
        fences: &[Fence],
        leads: impl Fn(u32) -> Option<u64>,
        now: Instant,
    ) -> Vec<FenceStep> {
        let mut steps = Vec::new();
        // Lift what no fence key holds any more (the same key: a fence's id with another create
        // revision is another fence).
        let gone: Vec<(u64, u32)> = self
            .holds
            .iter()
            .filter(|((id, _), h)| !fences.iter().any(|f| f.id == *id && f.create == h.create))
            .map(|(k, _)| *k)
            .collect();
        for (id, region) in gone {
            self.holds.remove(&(id, region));
            steps.push(FenceStep::Lift { id, region });
        }
        let mut breaking = std::collections::BTreeSet::new();
        for f in fences {
            for &(region, epoch) in &f.spec.regions {
                if leads(region) != Some(epoch) || self.holds.contains_key(&(f.id, region)) {
                    continue;
                }
                if f.reported.contains_key(&region) {
                    // An earlier life of this node reported, and this one has not held since:
                    // it may have acknowledged past that cut, so the fence must not commit.
                    if breaking.insert(f.id) {
                        steps.push(FenceStep::Break { id: f.id, txn: break_txn(keys, f.id, f.create) });
                    }
                } else {
                    steps.push(FenceStep::Fence { fence: f.clone(), region, epoch });
                }
            }
        }
        for (&(id, region), h) in &self.holds {
            if now >= h.until {
                if breaking.insert(id) {
                    steps.push(FenceStep::Break { id, txn: break_txn(keys, id, h.create) });
                }
            } else if !h.reported {
                let report = Report { epoch: h.epoch, position: h.position, reporter: h.reporter, empty: h.empty };
                let txn = report_txn(keys, (id, h.create, h.lease), region, report);
                steps.push(FenceStep::Report { id, region, txn });
            }
        }
        steps
    }

    /// The region is fenced at `position` (from `now` on, for the fence's hold), holding no
    /// live key if `empty`: the report to write.
    pub fn fenced(
        &mut self,
        keys: &Keys,
        f: &Fence,
        region: u32,
        (epoch, position, empty): (u64, u64, bool),
        now: Instant,
    ) -> Txn {
        let reporter = self.reporter;
        let until = now + f.spec.hold;
        let hold = Hold { create: f.create, lease: f.lease, epoch, position, until, reported: false, reporter, empty };
        self.holds.insert((f.id, region), hold);
        report_txn(keys, (f.id, f.create, f.lease), region, Report { epoch, position, reporter, empty })
    }

    /// The node's registration lease, said in the reports from now on.
    pub fn set_reporter(&mut self, lease: LeaseId) {
        self.reporter = Some(lease);
    }

    /// The region may be fenced, at a cut not known (its writer did not answer in time): held
    /// without a report — the fence cannot commit without one — until the fence key goes.
    pub fn held_unreported(&mut self, f: &Fence, region: u32, epoch: u64, now: Instant) {
        let until = now + f.spec.hold;
        let hold = Hold {
            create: f.create,
            lease: f.lease,
            epoch,
            position: 0,
            until,
            reported: true,
            reporter: None,
            empty: false,
        };
        self.holds.insert((f.id, region), hold);
    }

    /// The region's report for fence `id` was written (or its fence key was gone).
    pub fn reported(&mut self, id: u64, region: u32) {
        if let Some(h) = self.holds.get_mut(&(id, region)) {
            h.reported = true;
        }
    }

    /// Fences held, as (fence id, region).
    pub fn held(&self) -> Vec<(u64, u32)> {
        self.holds.keys().copied().collect()
    }
}

/// A backup job as a map poll sees it: written by a fence's commit (`backup-jobs/<fence id>`),
/// with the primaries' parts so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// The fence's id.
    pub id: u64,
    /// The job key's create revision (a part is written only while this key exists).
    pub create: Revision,
    /// The coordinator's lease (the parts are bound to it).
    pub lease: Option<LeaseId>,
    /// The job's description (the coordinator's: where to upload).
    pub spec: Vec<u8>,
    /// The parts reported, by region (the primaries' reports).
    pub parts: BTreeMap<u32, Vec<u8>>,
}

/// The backup jobs among a cluster's keys (`kvs` from a range of its root, or of one job's key).
pub fn jobs_in(kvs: &[KeyValue], keys: &Keys) -> Vec<Job> {
    let job = |(id, (head, parts)): (u64, Group<'_>)| {
        let head = head?;
        let parts = parts.into_iter().map(|(region, kv)| (region, kv.value.clone())).collect();
        Some(Job { id, create: head.create_revision, lease: head.lease, spec: head.value.clone(), parts })
    };
    grouped(kvs, &keys.backup_jobs()).into_iter().filter_map(job).collect()
}

/// A primary's part of job `job` for `region`: written only while the job key exists, bound to
/// the coordinator's lease.
pub fn part_txn(keys: &Keys, job: &Job, region: u32, value: Vec<u8>) -> Txn {
    Txn {
        when: vec![Compare::CreateRevision(keys.backup_job(job.id), job.create)],
        then: vec![TxnOp::Put { key: keys.backup_part(job.id, region), value, lease: job.lease }],
        otherwise: vec![],
    }
}

/// A consistent cut: the map it was taken on and every region's cut position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    /// The fence's id.
    pub id: u64,
    /// The region map the fence named (regions, epochs, primaries, backups).
    pub map: RegionMap,
    /// Each region's cut: the end of its log's last batch at the fence (what the cut holds of
    /// the region is its log up to there).
    pub positions: BTreeMap<u32, u64>,
    /// Each region's reporter: its primary's registration lease when it fenced (absent if it
    /// did not say). A job whose primary registered anew since has lost that region's snapshot.
    pub reporters: BTreeMap<u32, LeaseId>,
    /// Regions that held no live key at the cut.
    pub empty: std::collections::BTreeSet<u32>,
    /// How long the fence held back acknowledgements, from its key's write to its commit.
    pub held: Duration,
    /// With a job: the coordinator's lease, which the job and the primaries' parts are bound
    /// to — the caller keeps it alive while the job runs, and revokes it at the end.
    pub lease: Option<LeaseId>,
}

/// How to take a cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CutOptions {
    /// How long a primary holds before it breaks the fence (and the coordinator waits for the
    /// reports).
    pub hold: Duration,
    /// Fences tried before giving up.
    pub attempts: u32,
    /// A backup job to start with the commit (`backup-jobs/<fence id>` = this, in the commit's
    /// transaction): the primaries see it as they lift, and upload their snapshots.
    pub job: Option<Vec<u8>>,
    /// A restore to begin with the commit (docs/backup.md §5): the cut commits only if every
    /// region held no live key at it, and its transaction replaces the map by the backup's
    /// regions ([`crate::restore::commit`]). A writer held back by the fence is never
    /// acknowledged: its region is gone when the hold lifts.
    pub restore: Option<crate::restore::RestorePlan>,
}

impl Default for CutOptions {
    fn default() -> CutOptions {
        CutOptions { hold: DEFAULT_HOLD, attempts: 3, job: None, restore: None }
    }
}

/// Why no cut was taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    /// The metadata store failed.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// The map cannot be fenced now: no regions yet, a region without a live primary, or a
    /// split or merge running.
    #[error("the cluster cannot be fenced now: {0}")]
    Busy(String),
    /// These regions' primaries did not report within the hold.
    #[error("regions {0:?} did not report their cut within the fence's hold")]
    NotReported(Vec<u32>),
    /// The fence was broken (a hold ran out) or the map changed before the commit.
    #[error("the fence was broken or the region map changed before it committed")]
    Broken,
    /// A restore's cut found these regions holding keys: a restore goes only into an empty
    /// cluster (not retried).
    #[error("the cluster is not empty: regions {0:?} hold keys (a restore needs a cluster that holds none)")]
    NotEmpty(Vec<u32>),
    /// A restore is under way already, or its layout cannot be made (not retried).
    #[error("{0}")]
    Refused(String),
}

impl FenceError {
    /// A stable code naming the error.
    pub fn code(&self) -> &'static str {
        match self {
            FenceError::Meta(e) => e.code(),
            FenceError::Busy(_) => "fence_busy",
            FenceError::NotReported(_) => "fence_not_reported",
            FenceError::Broken => "fence_broken",
            FenceError::NotEmpty(_) => "restore_cluster_not_empty",
            FenceError::Refused(_) => "restore_refused",
        }
    }
}

/// Takes a consistent cut of every region (up to `opts.attempts` fences, a short backoff
/// between them); the last failure if none committed.
pub async fn take_cut<S: MetaStore>(s: &S, keys: &Keys, opts: CutOptions) -> Result<Cut, FenceError> {
    let mut backoff = crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
    let mut last = FenceError::Busy("no attempt made".into());
    for _ in 0..opts.attempts.max(1) {
        match try_cut(s, keys, &opts).await {
            Ok(cut) => return Ok(cut),
            Err(e @ (FenceError::NotEmpty(_) | FenceError::Refused(_))) => return Err(e),
            Err(e) => {
                tracing::info!(error = %e, "a backup fence did not commit");
                last = e;
            }
        }
        tokio::time::sleep(backoff.wait()).await;
    }
    Err(last)
}

/// One fence: under a lease of its own, revoked at the end however it went (the fence key, if
/// still there, and the reports go with it: every primary lifts).
async fn try_cut<S: MetaStore>(s: &S, keys: &Keys, opts: &CutOptions) -> Result<Cut, FenceError> {
    let snap = master::read(s, keys).await?;
    if let Some(plan) = &opts.restore {
        // Refused before any fence: a restore under way, or a layout that cannot be made.
        crate::restore::check(&snap, plan)?;
    }
    let map = &snap.map;
    if map.regions.is_empty() {
        return Err(FenceError::Busy("the cluster has no regions yet".into()));
    }
    if !snap.handoffs.running.is_empty() {
        return Err(FenceError::Busy("a split or merge is running".into()));
    }
    if let Some(r) = map.regions.iter().find(|r| !map.nodes.iter().any(|n| n.id == r.primary && r.primary != 0)) {
        return Err(FenceError::Busy(format!("region {} has no live primary", r.id)));
    }
    if map.regions.len() > MAX_FENCE_REGIONS {
        return Err(FenceError::Busy(format!("more than {MAX_FENCE_REGIONS} regions")));
    }
    let lease = s.grant(opts.hold * 2 + Duration::from_secs(5)).await?;
    let out = fenced(s, keys, &snap, lease, opts).await;
    // A job's lease lives on with it (the caller's); anything else ends here.
    let kept = matches!(&out, Ok(c) if c.lease.is_some());
    if !kept && let Err(e) = s.revoke(lease).await {
        tracing::debug!(error = %e, "revoking a fence's lease failed (it ends by itself)");
    }
    out
}

async fn fenced<S: MetaStore>(
    s: &S,
    keys: &Keys,
    snap: &master::Snapshot,
    lease: LeaseId,
    opts: &CutOptions,
) -> Result<Cut, FenceError> {
    let (map, hold, job) = (snap.map.clone(), opts.hold, opts.job.as_deref());
    let id = crate::backoff::random_id();
    let spec = FenceSpec {
        hold,
        regions: map.regions.iter().map(|r| (r.id, r.epoch)).collect(),
        check_empty: opts.restore.is_some(),
    };
    let key = keys.fence(id);
    let started = Instant::now();
    let t = s
        .txn(Txn {
            when: vec![Compare::Absent(key.clone())],
            then: vec![TxnOp::Put { key: key.clone(), value: spec.encode(), lease: Some(lease) }],
            otherwise: vec![],
        })
        .await?;
    if !t.succeeded {
        return Err(FenceError::Broken);
    }
    let create = t.revision;
    let mut report_prefix = key.clone();
    report_prefix.push(b'/');
    let (positions, reporters, empty) = loop {
        let (kvs, _) = s.range(&report_prefix).await?;
        let (mut positions, mut reporters, mut empty) = (BTreeMap::new(), BTreeMap::new(), BTreeSet::new());
        let reports = grouped(&kvs, &keys.fences()).remove(&id).map(|(_, r)| r).unwrap_or_default();
        for (region, kv) in reports {
            if let Some(r) = parse_report(&kv.value)
                && spec.epoch_of(region) == Some(r.epoch)
            {
                positions.insert(region, r.position);
                if let Some(l) = r.reporter {
                    reporters.insert(region, l);
                }
                if r.empty {
                    empty.insert(region);
                }
            }
        }
        if positions.len() == spec.regions.len() {
            break (positions, reporters, empty);
        }
        if started.elapsed() >= hold {
            let missing = spec.regions.iter().map(|(r, _)| *r).filter(|r| !positions.contains_key(r)).collect();
            return Err(FenceError::NotReported(missing));
        }
        tokio::time::sleep(REPORT_POLL).await;
    };
    let mut commit = commit_txn(keys, id, create, map.revision as Revision);
    if let Some(job) = job {
        commit.then.push(TxnOp::Put { key: keys.backup_job(id), value: job.to_vec(), lease: Some(lease) });
    }
    if let Some(plan) = &opts.restore {
        let full: Vec<u32> = map.regions.iter().map(|r| r.id).filter(|r| !empty.contains(r)).collect();
        if !full.is_empty() {
            return Err(FenceError::NotEmpty(full));
        }
        let (when, then) = crate::restore::commit(keys, snap, plan)?;
        commit.when.extend(when);
        commit.then.extend(then);
    }
    if !s.txn(commit).await?.succeeded {
        return Err(FenceError::Broken);
    }
    Ok(Cut { id, map, positions, reporters, empty, held: started.elapsed(), lease: job.map(|_| lease) })
}

/// The commit of fence `id` (its key created at `create`), taken on the map read at `map`:
/// it applies only if the fence key is still the one written (no primary broke it, its lease
/// lives) and no region key changed since that map; it deletes the fence key, which lifts
/// every hold.
pub fn commit_txn(keys: &Keys, id: u64, create: Revision, map: Revision) -> Txn {
    Txn {
        when: vec![Compare::CreateRevision(keys.fence(id), create), Compare::UnchangedSince(keys.regions(), map)],
        then: vec![TxnOp::Delete { key: keys.fence(id) }],
        otherwise: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_spec_says_whether_the_primaries_look_for_a_key() {
        for check_empty in [false, true] {
            let spec = FenceSpec { hold: Duration::from_millis(1500), regions: vec![(1, 4), (9, 2)], check_empty };
            assert_eq!(FenceSpec::decode(&spec.encode()).expect("decode"), spec);
        }
        // A spec written before the flag existed asks for no look.
        let old = FenceSpec::decode(b"hold_ms=2000\nregions=1:1\n").expect("decode");
        assert!(!old.check_empty);
    }
}
