//! The master: elected among the nodes, it lays out the regions once and then keeps applying
//! [`placement::plan`](crate::placement::plan) to what the metadata store says — live nodes
//! (their registrations), regions, drain requests, finished catch-ups. Every change is one
//! transaction that carries the master's fence (it fails once this master is deposed) and the
//! region's mod revision (it fails if anyone changed the region since it was read); a failed
//! transaction is simply planned again from a fresh read.
//!
//! The master acts on registrations that are *gone* — deleted when etcd ended a node's lease —
//! never on missed heartbeats of its own; that is what makes promotion wait out the old
//! primary's lease (docs/cluster.md §4, step 2).

use std::time::Duration;

use dpukv_proto::regionmap::{NodeInfo, RegionInfo, RegionMap};
use tokio_util::sync::CancellationToken;

use crate::election::{Leadership, campaign};
use crate::handoff::{self, HandoffFacts, RegionLoad, Running, Step, Thresholds};
use crate::keys::{ClusterConfig, Keys, id_of};
use crate::meta::{Compare, KeyValue, LeaseId, MetaError, MetaStore, Result, Revision, Txn, TxnOp};
use crate::placement::{self, Change, Facts, Policy};

/// A split or merge running longer than this is aborted (its source serves the range again).
pub const HANDOFF_TIMEOUT: Duration = Duration::from_secs(120);

/// The cluster as read at one revision.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The region map (regions, live nodes) at `map.revision`.
    pub map: RegionMap,
    /// Each region's mod revision (for compare-and-swap), by region id.
    pub region_revs: Vec<(u32, Revision)>,
    /// The configuration, if written.
    pub config: Option<ClusterConfig>,
    /// Drains, catch-ups.
    pub facts: Facts,
    /// Splits and merges: running, reported, requested; regions' loads.
    pub handoffs: HandoffFacts,
    /// Each live node's lease and its registration's mod revision.
    pub node_leases: std::collections::HashMap<u32, (LeaseId, Revision)>,
    /// Primary handovers not released yet: (region, old primary) -> the key's mod revision
    /// (`Keys::handovers`).
    pub handovers: std::collections::BTreeMap<(u32, u32), Revision>,
    /// The master's last completed round: (node, unix ms), if a master marked one under its
    /// current lease (`Keys::master_round`).
    pub master_round: Option<(u32, u64)>,
    /// Backup fences under way, with the primaries' reports (`Keys::fences`).
    pub fences: Vec<crate::fence::Fence>,
    /// Backup jobs under way, with the primaries' parts (`Keys::backup_jobs`).
    pub backup_jobs: Vec<crate::fence::Job>,
    /// The restore under way, if any (`Keys::restore_job`).
    pub restore: Option<crate::restore::Restore>,
    /// The cluster's backup schedule, if set and readable (`Keys::backup_schedule`).
    pub backup_schedule: Option<crate::schedule::BackupSchedule>,
    /// The last backup that finished, if recorded (`Keys::last_backup`).
    pub last_backup: Option<crate::schedule::LastBackup>,
}

/// A node's step-down ([`Snapshot::step_down_progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepDown {
    /// A step-down is requested.
    pub requested: bool,
    /// Regions it leads.
    pub led: usize,
    /// Of those, regions a backup elsewhere could take.
    pub movable: usize,
    /// Requested, nothing movable left, every handover released.
    pub done: bool,
}

/// The cluster at a glance (the admin API's `/cluster/summary`, the operator's status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Health {
    /// The node running the master (0: none elected).
    pub master: u32,
    /// Live (registered) nodes.
    pub nodes: usize,
    /// Regions.
    pub regions: usize,
    /// Regions whose primary is not live (a failover is due or under way).
    pub without_primary: usize,
    /// Regions with fewer live in-sync copies (primary and backups) than the replication factor
    /// allows on the live nodes that are not draining.
    pub under_replicated: usize,
    /// Distinct zones among the live nodes that are not draining (nodes without a zone not
    /// counted).
    pub zones: usize,
    /// Regions with two live copies in one zone (copies on nodes without a zone not counted;
    /// placement never makes one, but a node may come back in another zone).
    pub zone_shared: usize,
    /// Of the under-replicated regions, those placement cannot repair because of zones: nodes
    /// that could take a copy exist, but each is in a zone the region already has (fewer zones
    /// than copies — a zone lost, or never there).
    pub zone_blocked: usize,
    /// Milliseconds since the master last completed a round (by the wall clocks of the master
    /// and the reader; None: no round marked — no master, or one whose loop never ran a round).
    /// A master loop completes a round at least every tick (500 ms on nodes): an age of seconds
    /// means an elected master that is not acting.
    pub master_round_age_ms: Option<u64>,
}

impl Snapshot {
    /// Whether region `id` is one a restore under way makes (not served until it ends).
    pub fn restoring(&self, id: u32) -> bool {
        self.restore.as_ref().is_some_and(|r| r.regions.contains_key(&id))
    }

    /// The cluster at a glance.
    pub fn health(&self) -> Health {
        let live: std::collections::HashSet<u32> = self.map.nodes.iter().map(|n| n.id).collect();
        let replication = self.config.as_ref().map_or(3, |c| c.replication);
        // As placement counts: a draining node is leaving, so the target is what the others allow.
        let eligible = live.iter().filter(|n| !self.facts.draining.contains(n)).count();
        let target = replication.min(eligible);
        let regions = &self.map.regions;
        let copies = |r: &RegionInfo| {
            std::iter::once(r.primary).chain(r.backups.iter().copied()).filter(|n| live.contains(n)).count()
        };
        let zone: std::collections::HashMap<u32, &str> =
            self.map.nodes.iter().filter(|n| !n.zone.is_empty()).map(|n| (n.id, n.zone.as_str())).collect();
        let zones: std::collections::HashSet<&str> =
            zone.iter().filter(|(n, _)| !self.facts.draining.contains(n)).map(|(_, z)| *z).collect();
        let eligible_nodes: Vec<u32> = live.iter().copied().filter(|n| !self.facts.draining.contains(n)).collect();
        let zone_blocked = |r: &RegionInfo| {
            let held: Vec<u32> = std::iter::once(r.primary).chain(r.backups.iter().copied()).collect();
            let taken: std::collections::HashSet<&str> =
                held.iter().filter(|n| live.contains(n)).filter_map(|n| zone.get(n).copied()).collect();
            let free: Vec<u32> = eligible_nodes.iter().copied().filter(|n| !held.contains(n)).collect();
            !free.is_empty() && free.iter().all(|n| zone.get(n).is_some_and(|z| taken.contains(z)))
        };
        let shares_a_zone = |r: &RegionInfo| {
            let mut seen = std::collections::HashSet::new();
            std::iter::once(r.primary)
                .chain(r.backups.iter().copied())
                .filter_map(|n| zone.get(&n))
                .any(|z| !seen.insert(*z))
        };
        Health {
            master: self.map.master,
            nodes: live.len(),
            regions: regions.len(),
            without_primary: regions.iter().filter(|r| !live.contains(&r.primary)).count(),
            under_replicated: regions.iter().filter(|r| copies(r) < target).count(),
            zones: zones.len(),
            zone_shared: regions.iter().filter(|r| shares_a_zone(r)).count(),
            zone_blocked: regions.iter().filter(|r| copies(r) < target && zone_blocked(r)).count(),
            master_round_age_ms: self.master_round.map(|(_, at)| unix_ms().saturating_sub(at)),
        }
    }

    /// A node's step-down as the metadata has it: requested or not, the regions it leads, those
    /// of them a live backup elsewhere (not draining or stepping down) could take, and whether
    /// a handover from it is still unreleased. Done: requested, nothing movable, all released.
    pub fn step_down_progress(&self, node: u32) -> StepDown {
        let live: std::collections::HashSet<u32> = self.map.nodes.iter().map(|n| n.id).collect();
        let f = &self.facts;
        let takes = |b: u32| live.contains(&b) && !f.draining.contains(&b) && !f.stepping_down.contains(&b);
        let led: Vec<_> = self.map.regions.iter().filter(|r| r.primary == node).collect();
        let movable = led.iter().filter(|r| r.backups.iter().any(|&b| takes(b))).count();
        let unreleased = self.handovers.keys().any(|&(_, n)| n == node);
        let requested = f.stepping_down.contains(&node);
        StepDown { requested, led: led.len(), movable, done: requested && movable == 0 && !unreleased }
    }

    /// Whether a node other than `me` may still serve `region` by an older map: the region's
    /// primary moved away from it while it was alive and it has not said it stopped.
    pub fn unreleased(&self, region: u32, me: u32) -> Option<u32> {
        self.handovers.range((region, 0)..=(region, u32::MAX)).map(|(&(_, n), _)| n).find(|&n| n != me)
    }
}

fn decode_all<T>(
    kvs: &[KeyValue],
    f: impl Fn(&[u8]) -> std::result::Result<T, dpukv_proto::regionmap::MapError>,
) -> Result<Vec<T>> {
    kvs.iter()
        .map(|kv| f(&kv.value).map_err(|e| MetaError::Invalid(format!("{}: {e}", String::from_utf8_lossy(&kv.key)))))
        .collect()
}

/// `<prefix><region>/<node>` -> (region, node).
fn region_node(key: &[u8], prefix: &[u8]) -> Option<(u32, u32)> {
    let rest = std::str::from_utf8(key.strip_prefix(prefix)?).ok()?;
    let (r, n) = rest.split_once('/')?;
    Some((r.parse().ok()?, n.parse().ok()?))
}

/// How long a promotion waits for the dead primary's live backups to report how far their logs
/// reach (they report within a map poll, about 50 ms); past it, the backups that did not report
/// rank last.
pub const PROMOTION_WAIT: Duration = Duration::from_millis(500);

/// What the master remembers between rounds: since when (on its own clock) each region's
/// primary has been seen dead, by (region, epoch).
#[derive(Debug, Default)]
pub struct Waits {
    dead_since: std::collections::HashMap<(u32, u64), std::time::Instant>,
}

impl Waits {
    /// Regions whose promotion waits for position reports, and when to look again.
    fn awaiting(&mut self, snap: &Snapshot) -> (std::collections::BTreeSet<u32>, Option<Duration>) {
        let live: std::collections::HashSet<u32> = snap.map.nodes.iter().map(|n| n.id).collect();
        let now = std::time::Instant::now();
        let mut waiting = std::collections::BTreeSet::new();
        let mut recheck: Option<Duration> = None;
        let mut seen = std::collections::HashSet::new();
        for r in snap.map.regions.iter().filter(|r| !live.contains(&r.primary)) {
            seen.insert((r.id, r.epoch));
            let since = *self.dead_since.entry((r.id, r.epoch)).or_insert(now);
            let unreported =
                r.backups.iter().any(|b| live.contains(b) && !snap.facts.progress.contains_key(&(r.id, *b)));
            let left = PROMOTION_WAIT.saturating_sub(now - since);
            if unreported && !left.is_zero() {
                waiting.insert(r.id);
                recheck = Some(recheck.map_or(left, |x| x.min(left)));
            }
        }
        self.dead_since.retain(|k, _| seen.contains(k));
        (waiting, recheck)
    }
}

/// Reads the cluster's state (one read over its root but the event log, so everything is at one
/// revision).
pub async fn read<S: MetaStore>(s: &S, keys: &Keys) -> Result<Snapshot> {
    // Everything but the event log (up to ~256 events, tens of KB, which no round decides from
    // and which every member loop would otherwise read 20 times a second).
    let (kvs, revision) = s.range_except(keys.root(), &keys.events()).await?;
    let under = |p: Vec<u8>| kvs.iter().filter(move |kv| kv.key.starts_with(&p)).cloned().collect::<Vec<_>>();
    let node_kvs = under(keys.nodes());
    let nodes = decode_all(&node_kvs, NodeInfo::decode)?;
    let node_leases =
        nodes.iter().zip(&node_kvs).filter_map(|(n, kv)| Some((n.id, (kv.lease?, kv.mod_revision)))).collect();
    let handovers = under(keys.handovers())
        .iter()
        .filter_map(|kv| Some((region_node(&kv.key, &keys.handovers())?, kv.mod_revision)))
        .collect();
    let region_kvs = under(keys.regions());
    let mut regions = decode_all(&region_kvs, RegionInfo::decode)?;
    let mut region_revs: Vec<(u32, Revision)> =
        regions.iter().zip(&region_kvs).map(|(r, kv)| (r.id, kv.mod_revision)).collect();
    regions.sort_by(|a, b| a.start.cmp(&b.start));
    region_revs.sort_unstable();
    let config =
        kvs.iter().find(|kv| kv.key == keys.config()).map(|kv| ClusterConfig::decode(&kv.value)).transpose()?;
    let mut facts = Facts::default();
    for kv in under(keys.drains()) {
        if let Some(id) = id_of(&kv.key, &keys.drains()) {
            facts.draining.insert(id);
        }
    }
    for kv in under(keys.step_downs()) {
        if let Some(id) = id_of(&kv.key, &keys.step_downs()) {
            facts.stepping_down.insert(id);
        }
    }
    for kv in under(keys.caught_up()) {
        let epoch = std::str::from_utf8(&kv.value).ok().and_then(|s| s.parse().ok());
        if let (Some((r, n)), Some(epoch)) = (region_node(&kv.key, &keys.caught_up()), epoch) {
            facts.caught_up.insert((r, n, epoch));
        }
    }
    // Backups' positions, counted only under the epoch they were reported at.
    for kv in under(keys.positions()) {
        let value = std::str::from_utf8(&kv.value).ok().and_then(|s| s.split_once(' '));
        let parsed = value.and_then(|(e, p)| Some((e.parse::<u64>().ok()?, p.parse::<u64>().ok()?)));
        if let (Some((r, n)), Some((epoch, position))) = (region_node(&kv.key, &keys.positions()), parsed)
            && regions.iter().any(|x| x.id == r && x.epoch == epoch)
        {
            facts.progress.insert((r, n), position);
        }
    }
    // Stalled streams, counted only under the epoch they were reported at.
    for kv in under(keys.stalled()) {
        let epoch = std::str::from_utf8(&kv.value).ok().and_then(|s| s.parse::<u64>().ok());
        if let (Some((r, n)), Some(epoch)) = (region_node(&kv.key, &keys.stalled()), epoch)
            && regions.iter().any(|x| x.id == r && x.epoch == epoch)
        {
            facts.stalled.insert((r, n, epoch));
        }
    }
    let mut handoffs = HandoffFacts::default();
    for kv in under(keys.handoffs()) {
        let h = dpukv_proto::regionmap::Handoff::decode(&kv.value)
            .map_err(|e| MetaError::Invalid(format!("{}: {e}", String::from_utf8_lossy(&kv.key))))?;
        handoffs.running.push(Running { handoff: h, create: kv.create_revision, modrev: kv.mod_revision });
    }
    facts.frozen = handoff::frozen(&handoffs);
    let num = |b: &[u8]| std::str::from_utf8(b).ok().and_then(|s| s.parse::<i64>().ok());
    for kv in under(keys.handoffs_done()) {
        if let (Some(id), Some(create)) = (id_of(&kv.key, &keys.handoffs_done()), num(&kv.value)) {
            handoffs.done.insert(id, create);
        }
    }
    for kv in under(keys.region_stats()) {
        if let (Some(id), Some(load)) = (id_of(&kv.key, &keys.region_stats()), RegionLoad::decode(&kv.value)) {
            handoffs.load.insert(id, load);
        }
    }
    for kv in under(keys.split_requests()) {
        if let Some(id) = id_of(&kv.key, &keys.split_requests()) {
            handoffs.split_requests.insert(id, kv.value.clone());
        }
    }
    for kv in under(keys.merge_requests()) {
        if let Some(id) = id_of(&kv.key, &keys.merge_requests()) {
            handoffs.merge_requests.insert(id);
        }
    }
    if let Some(kv) = kvs.iter().find(|kv| kv.key == keys.last_region_id())
        && let Some(id) = num(&kv.value)
    {
        handoffs.last_region_id = Some((id as u32, kv.mod_revision));
    }
    facts.pinned = handoff::pinned(&regions, &handoffs);
    // The master: the election candidate with the oldest key.
    let mut candidates = keys.master();
    candidates.push(b'/');
    let master = under(candidates)
        .iter()
        .min_by_key(|kv| kv.create_revision)
        .and_then(|kv| NodeInfo::decode(&kv.value).ok())
        .map_or(0, |n| n.id);
    let master_round = kvs.iter().find(|kv| kv.key == keys.master_round()).and_then(|kv| {
        let (node, at) = std::str::from_utf8(&kv.value).ok()?.split_once(' ')?;
        Some((node.parse().ok()?, at.parse().ok()?))
    });
    Ok(Snapshot {
        map: RegionMap { revision: revision as u64, master, regions, nodes },
        region_revs,
        config,
        facts,
        handoffs,
        node_leases,
        handovers,
        master_round,
        fences: crate::fence::fences_in(&kvs, keys),
        backup_jobs: crate::fence::jobs_in(&kvs, keys),
        restore: crate::restore::restore_in(&kvs, keys),
        backup_schedule: kvs
            .iter()
            .find(|kv| kv.key == keys.backup_schedule())
            .and_then(|kv| crate::schedule::BackupSchedule::decode(&kv.value).ok()),
        last_backup: kvs
            .iter()
            .find(|kv| kv.key == keys.last_backup())
            .and_then(|kv| crate::schedule::LastBackup::decode(&kv.value).ok()),
    })
}

/// Writes the configuration if none is written yet; returns the one in force.
pub async fn bootstrap_config<S: MetaStore>(s: &S, keys: &Keys, config: &ClusterConfig) -> Result<ClusterConfig> {
    s.txn(Txn {
        when: vec![Compare::Absent(keys.config())],
        then: vec![TxnOp::Put { key: keys.config(), value: config.encode(), lease: None }],
        otherwise: vec![],
    })
    .await?;
    let kv = s.get(&keys.config()).await?.ok_or_else(|| MetaError::Unavailable("the config vanished".into()))?;
    ClusterConfig::decode(&kv.value)
}

/// What a round changed.
#[derive(Debug, Default)]
pub struct Applied {
    /// Split and merge steps taken.
    pub handoff_steps: usize,
    /// Placement changes applied.
    pub changes: Vec<Change>,
    /// Look again after this even if nothing changes (a promotion waiting for reports).
    pub recheck: Option<Duration>,
    /// A restore's step taken (its end, or a region given to another node).
    pub restore_step: Option<crate::restore::Step>,
}

impl Applied {
    /// Whether the round changed nothing.
    pub fn is_empty(&self) -> bool {
        self.handoff_steps == 0 && self.changes.is_empty() && self.restore_step.is_none()
    }
}

/// One round: lays the regions out if there are none (and enough nodes), else takes the split
/// and merge steps due and, if there were none, applies the planned placement changes.
pub async fn round<S: MetaStore>(s: &S, keys: &Keys, fence: &Compare, waits: &mut Waits) -> Result<Applied> {
    let snap = read(s, keys).await?;
    apply(s, keys, fence, waits, snap).await
}

/// The second half of [`round`]: plans from `snap` (read earlier: the world may have moved
/// since, which every transaction checks) and applies.
pub async fn apply<S: MetaStore>(
    s: &S,
    keys: &Keys,
    fence: &Compare,
    waits: &mut Waits,
    mut snap: Snapshot,
) -> Result<Applied> {
    let Some(config) = snap.config.clone() else { return Ok(Applied::default()) };
    if snap.map.regions.is_empty() {
        let mut nodes = snap.map.nodes.clone();
        nodes.sort_by_key(|n| n.id);
        let Ok(mut regions) = placement::initial(&nodes, &config.split_keys, config.replication) else {
            return Ok(Applied::default()); // wait for enough nodes
        };
        // After ids used before (a restore abandoned): a node back from an outage must not
        // take an old region's files for a new one's.
        let base = snap.handoffs.last_region_id.map_or(0, |(id, _)| id);
        for r in &mut regions {
            r.id += base;
        }
        let mut when = vec![fence.clone()];
        when.extend(regions.iter().map(|r| Compare::Absent(keys.region(r.id))));
        let then =
            regions.iter().map(|r| TxnOp::Put { key: keys.region(r.id), value: r.encode(), lease: None }).collect();
        let t = s.txn(Txn { when, then, otherwise: vec![] }).await?;
        if t.succeeded {
            tracing::info!(regions = regions.len(), nodes = nodes.len(), "laid out the regions");
        }
        return Ok(Applied::default());
    }
    // A restore's end, or its region whose primary died with the only copy (docs/backup.md §5).
    if let Some((step, txn)) = crate::restore::step(keys, &snap, fence)
        && s.txn(txn).await?.succeeded
    {
        tracing::info!(step = ?step, "restore step");
        return Ok(Applied { restore_step: Some(step), ..Applied::default() });
    }
    let rev_of = |id: u32| snap.region_revs.iter().find(|(r, _)| *r == id).map(|(_, r)| *r).unwrap_or(0);
    // Splits and merges first: an abort unfreezes a region placement must then heal.
    let live = snap.map.nodes.iter().map(|n| n.id).collect();
    let thresholds = Thresholds {
        split_bytes: config.split_bytes,
        split_writes_per_sec: config.split_writes_per_sec,
        merge_bytes: config.merge_bytes,
        max_running: config.max_moves.max(1),
        timeout_ms: HANDOFF_TIMEOUT.as_millis() as u64,
    };
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let steps = handoff::plan(&snap.map.regions, &live, &snap.handoffs, thresholds, now_ms);
    let mut handed = false;
    for step in steps {
        let txn = handoff_txn(keys, fence, &step, &rev_of, &snap.handoffs);
        if s.txn(txn).await?.succeeded {
            tracing::info!(step = ?step, "split/merge step");
            handed = true;
        }
    }
    if handed {
        // Placement plans from the map these steps left (the caller runs a round again at once).
        return Ok(Applied { handoff_steps: 1, ..Applied::default() });
    }
    let policy = Policy { replication: config.replication, max_moves: config.max_moves };
    let (awaiting, recheck) = waits.awaiting(&snap);
    snap.facts.awaiting = awaiting;
    let changes = placement::plan(&snap.map.regions, &snap.map.nodes, &snap.facts, policy);
    let mut applied = Vec::new();
    for c in changes {
        let rev = rev_of(c.region.id);
        let key = keys.region(c.region.id);
        let mut then = vec![TxnOp::Put { key: key.clone(), value: c.region.encode(), lease: None }];
        let mut when = vec![fence.clone(), Compare::ModRevision(key, rev)];
        if let Some(old) = snap.map.region(c.region.id)
            && old.primary != c.region.primary
        {
            match snap.node_leases.get(&old.primary) {
                // The old primary is alive: until it says its device stopped serving the region
                // (it deletes this key; or its lease ends and takes the key along), the new
                // primary does not serve (docs/cluster.md §4, step 5).
                Some(&(lease, registered)) => {
                    let epoch = c.region.epoch.to_string().into_bytes();
                    then.push(TxnOp::Put { key: keys.handover(old.id, old.primary), value: epoch, lease: Some(lease) });
                    when.push(Compare::ModRevision(keys.node(old.primary), registered));
                }
                // A promotion: the old primary was planned dead and must still be (registered
                // again since, it may be serving the region under a new lease).
                None => when.push(Compare::Absent(keys.node(old.primary))),
            }
            if c.reason == placement::Reason::DemoteStalled {
                then.extend(old.backups.iter().map(|&b| TxnOp::Delete { key: keys.stalled_of(old.id, b) }));
            }
            if c.reason == placement::Reason::Promote {
                // The reports served this promotion.
                then.extend(old.backups.iter().map(|&b| TxnOp::Delete { key: keys.position_of(old.id, b) }));
            }
        }
        let t = s.txn(Txn { when, then, otherwise: vec![] }).await?;
        if t.succeeded {
            tracing::info!(region = c.region.id, reason = ?c.reason, epoch = c.region.epoch, primary = c.region.primary,
                backups = ?c.region.backups, joining = ?c.region.joining, "region changed");
            applied.push(c);
        }
    }
    Ok(Applied { handoff_steps: 0, changes: applied, recheck, restore_step: None })
}

/// The transaction of one handoff step: fenced, and compared against what the step was planned
/// from (the regions' and the handoff's mod revisions), so a stale plan changes nothing.
fn handoff_txn(keys: &Keys, fence: &Compare, step: &Step, rev_of: &dyn Fn(u32) -> Revision, f: &HandoffFacts) -> Txn {
    let put = |r: &RegionInfo| TxnOp::Put { key: keys.region(r.id), value: r.encode(), lease: None };
    let request_key = |r: &handoff::Request| match r {
        handoff::Request::Split(id) => keys.split_request(*id),
        handoff::Request::Merge(id) => keys.merge_request(*id),
    };
    let mut when = vec![fence.clone()];
    let mut then = Vec::new();
    match step {
        Step::Start { handoff, source, was, request } => {
            when.push(Compare::ModRevision(keys.region(*was), rev_of(*was)));
            when.push(Compare::Absent(keys.handoff(handoff.source)));
            then.push(put(source));
            then.push(TxnOp::Put { key: keys.handoff(handoff.source), value: handoff.encode(), lease: None });
            if handoff.kind == dpukv_proto::regionmap::HandoffKind::Split {
                when.push(Compare::Absent(keys.region(handoff.target)));
                when.push(match f.last_region_id {
                    Some((_, rev)) => Compare::ModRevision(keys.last_region_id(), rev),
                    None => Compare::Absent(keys.last_region_id()),
                });
                then.push(TxnOp::Put {
                    key: keys.last_region_id(),
                    value: handoff.target.to_string().into_bytes(),
                    lease: None,
                });
            } else {
                when.push(Compare::ModRevision(keys.region(handoff.target), rev_of(handoff.target)));
            }
            if let Some(r) = request {
                then.push(TxnOp::Delete { key: request_key(r) });
            }
        }
        Step::Commit { running, source, target, target_is_new } => {
            let h = &running.handoff;
            when.push(Compare::ModRevision(keys.handoff(h.source), running.modrev));
            when.push(Compare::ModRevision(keys.region(h.source), rev_of(h.source)));
            when.push(if *target_is_new {
                Compare::Absent(keys.region(target.id))
            } else {
                Compare::ModRevision(keys.region(target.id), rev_of(target.id))
            });
            then.push(match source {
                Some(s) => put(s),
                None => TxnOp::Delete { key: keys.region(h.source) },
            });
            then.push(put(target));
            then.push(TxnOp::Delete { key: keys.handoff(h.source) });
            then.push(TxnOp::Delete { key: keys.handoff_done(h.source) });
        }
        Step::Abort { running, source, .. } => {
            let h = &running.handoff;
            when.push(Compare::ModRevision(keys.handoff(h.source), running.modrev));
            if let Some(s) = source {
                when.push(Compare::ModRevision(keys.region(s.id), rev_of(s.id)));
                then.push(put(s));
            }
            then.push(TxnOp::Delete { key: keys.handoff(h.source) });
            then.push(TxnOp::Delete { key: keys.handoff_done(h.source) });
        }
        Step::Align { source } => {
            when.push(Compare::ModRevision(keys.region(source.id), rev_of(source.id)));
            then.push(put(source));
        }
        Step::Refuse { request, .. } => then.push(TxnOp::Delete { key: request_key(request) }),
    }
    Txn { when, then, otherwise: vec![] }
}

/// How often, at most, the master records its last completed round (`Keys::master_round`).
pub const ROUND_MARK_EVERY: Duration = Duration::from_secs(1);

/// What a node's master loop is doing, for its metrics and `/cluster/summary`: shared between
/// [`run`] and whoever reports it. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct LoopStatus(std::sync::Arc<LoopState>);

#[derive(Debug, Default)]
struct LoopState {
    running: std::sync::atomic::AtomicBool,
    leading: std::sync::atomic::AtomicBool,
    rounds: std::sync::atomic::AtomicU64,
    errors: std::sync::atomic::AtomicU64,
    /// Unix milliseconds of the last completed round (0: none).
    last_round_ms: std::sync::atomic::AtomicU64,
}

impl LoopStatus {
    /// Whether the loop runs (campaigning or leading).
    pub fn running(&self) -> bool {
        self.0.running.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether it leads.
    pub fn leading(&self) -> bool {
        self.0.leading.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Rounds completed as master.
    pub fn rounds(&self) -> u64 {
        self.0.rounds.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Errors met (each retried).
    pub fn errors(&self) -> u64 {
        self.0.errors.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Unix milliseconds of the last completed round (0: none).
    pub fn last_round_ms(&self) -> u64 {
        self.0.last_round_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set(&self, running: bool, leading: bool) {
        self.0.running.store(running, std::sync::atomic::Ordering::Release);
        self.0.leading.store(leading, std::sync::atomic::Ordering::Release);
    }

    fn error(&self) {
        self.0.errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn round(&self) {
        self.0.rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0.last_round_ms.store(unix_ms(), std::sync::atomic::Ordering::Relaxed);
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Sleeps `d`, or returns false at once when `cancel` fires.
async fn pause(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = cancel.cancelled() => false,
    }
}

/// How a leadership ended.
enum Ended {
    /// Cancelled: resign.
    Cancelled,
    /// The fence no longer holds (the key is gone): campaign again (a lease that ended makes the
    /// campaign end with [`MetaError::LeaseNotFound`]).
    Deposed,
}

/// Campaigns for master under `lease` (the node's own, kept alive by its membership) and, once
/// elected, runs rounds whenever the cluster's keys change (and at least every `tick`) until
/// `cancel` (it resigns) or until its lease has ended (returns [`MetaError::LeaseNotFound`]: the
/// node must register again). Every other error — etcd unreachable, a request timing out, a
/// round failing — is retried with backoff, forever: a master loop never dies while its node
/// lives and leaves a master key with nobody behind it. A deposed master campaigns again.
pub async fn run<S: MetaStore>(
    s: &S,
    keys: &Keys,
    lease: LeaseId,
    me: &NodeInfo,
    tick: Duration,
    cancel: CancellationToken,
    status: LoopStatus,
) -> Result<()> {
    let status = &status;
    let (name, value) = (keys.master(), me.encode());
    let mut backoff = crate::backoff::Backoff::new(Duration::from_millis(50), tick.max(Duration::from_millis(100)) * 4);
    status.set(true, false);
    let out = loop {
        let campaigned = tokio::select! {
            l = campaign(s, &name, lease, &value) => l,
            _ = cancel.cancelled() => break Ok(()),
        };
        let leadership = match campaigned {
            Ok(l) => l,
            Err(e @ MetaError::LeaseNotFound(_)) => break Err(e),
            Err(e) => {
                status.error();
                tracing::warn!(error = %e, "campaigning for master failed; retrying");
                if !pause(backoff.wait(), &cancel).await {
                    break Ok(());
                }
                continue;
            }
        };
        backoff.reset();
        tracing::info!(node = me.id, "elected master");
        status.set(true, true);
        let ended = lead(s, keys, &leadership, me.id, tick, &cancel, status).await;
        status.set(true, false);
        match ended {
            Ended::Cancelled => {
                // Give the role up now rather than when the lease ends (bounded: etcd may be gone).
                let _ = tokio::time::timeout(Duration::from_secs(2), crate::election::resign(s, &leadership)).await;
                break Ok(());
            }
            Ended::Deposed => tracing::warn!(node = me.id, "no longer master; campaigning again"),
        }
    };
    status.set(false, false);
    out
}

/// The longest a round waits to read the stored log or to write its events (they stay queued
/// for the next round): event bookkeeping never holds a round up for long when etcd is slow.
const EVENT_WRITE_WITHIN: Duration = Duration::from_millis(500);

/// How often a master that could not read the stored log tries again.
const EVENT_SEED_EVERY: Duration = Duration::from_secs(5);

/// The master's event recorder, seeded from the stored log once it could be read.
#[derive(Default)]
struct EventLog {
    recorder: crate::events::Recorder,
    tried: Option<std::time::Instant>,
    failed_writes: u64,
}

impl EventLog {
    /// Observes `snap` (after seeding from the stored log, which is read until it could be once,
    /// at most every [`EVENT_SEED_EVERY`]).
    async fn note<S: MetaStore>(&mut self, s: &S, keys: &Keys, snap: &Snapshot) {
        if !self.recorder.seeded() {
            if self.tried.is_some_and(|t| t.elapsed() < EVENT_SEED_EVERY) {
                return;
            }
            self.tried = Some(std::time::Instant::now());
            match tokio::time::timeout(EVENT_WRITE_WITHIN, crate::events::load(s, keys)).await {
                Ok(Ok(stored)) => self.recorder.seed(&stored),
                _ => return,
            }
        }
        let seen = self.recorder.observe(snap, unix_ms());
        for e in &seen {
            tracing::info!(seq = e.seq, kind = ?e.kind, "{}", e.detail);
        }
        self.recorder.queue(seen);
    }

    /// Writes what is queued (bounded in time); a failure is logged now and then.
    async fn write<S: MetaStore>(&mut self, s: &S, keys: &Keys, fence: &Compare) {
        let ok =
            matches!(tokio::time::timeout(EVENT_WRITE_WITHIN, self.recorder.write(s, keys, fence)).await, Ok(Ok(())));
        if !ok {
            self.failed_writes += 1;
            if self.failed_writes.is_power_of_two() {
                tracing::warn!(failures = self.failed_writes, "the master could not write its events (kept queued)");
            }
        }
    }
}

/// The master's rounds under one leadership, until cancelled or deposed. Errors are retried.
async fn lead<S: MetaStore>(
    s: &S,
    keys: &Keys,
    leadership: &Leadership,
    me: u32,
    tick: Duration,
    cancel: &CancellationToken,
    status: &LoopStatus,
) -> Ended {
    let fence = leadership.fence();
    let mut waits = Waits::default();
    let mut backoff = crate::backoff::Backoff::new(Duration::from_millis(50), tick.max(Duration::from_millis(100)) * 4);
    let mut marked: Option<std::time::Instant> = None;
    let mut events = EventLog::default();
    loop {
        if cancel.is_cancelled() {
            return Ended::Cancelled;
        }
        // Still master? (A transaction with only the fence: fails once the key is gone.)
        let rev = match s.txn(Txn { when: vec![fence.clone()], ..Txn::default() }).await {
            Ok(t) if t.succeeded => t.revision,
            Ok(_) => return Ended::Deposed,
            Err(e) => {
                status.error();
                tracing::warn!(error = %e, "the master cannot reach the metadata store; retrying");
                if !pause(backoff.wait(), cancel).await {
                    return Ended::Cancelled;
                }
                continue;
            }
        };
        let wait = match read(s, keys).await {
            Err(e) => Err(e),
            Ok(snap) => {
                events.note(s, keys, &snap).await;
                apply(s, keys, &fence, &mut waits, snap).await
            }
        };
        // The events of the round are written after it (best effort, bounded).
        events.write(s, keys, &fence).await;
        let wait = match wait {
            Ok(applied) => {
                backoff.reset();
                status.round();
                if marked.is_none_or(|t| t.elapsed() >= ROUND_MARK_EVERY) {
                    let mark = TxnOp::Put {
                        key: keys.master_round(),
                        value: format!("{me} {}", unix_ms()).into_bytes(),
                        lease: Some(leadership.lease),
                    };
                    if s.txn(Txn { when: vec![fence.clone()], then: vec![mark], otherwise: vec![] }).await.is_ok() {
                        marked = Some(std::time::Instant::now());
                    }
                }
                if !applied.is_empty() {
                    continue; // plan again at once
                }
                applied.recheck.map_or(tick, |r| r.min(tick))
            }
            Err(e) => {
                status.error();
                tracing::warn!(error = %e, "master round failed; retrying");
                backoff.wait().min(tick)
            }
        };
        // Wait for any change under the cluster's root (but the round mark), or the tick.
        // Without a watch (store unavailable), the tick alone paces the rounds.
        let mut w = s.watch(keys.root(), rev + 1).await.ok();
        let round_key = keys.master_round();
        let events_prefix = keys.events();
        let changed = async {
            let Some(w) = w.as_mut() else { return std::future::pending().await };
            loop {
                match w.next().await {
                    Some(Ok(crate::meta::WatchEvent::Put(kv))) if kv.key == round_key => continue,
                    // The event log changes nothing a round decides from.
                    Some(Ok(crate::meta::WatchEvent::Put(kv))) if kv.key.starts_with(&events_prefix) => continue,
                    Some(Ok(crate::meta::WatchEvent::Delete { key, .. })) if key.starts_with(&events_prefix) => {
                        continue;
                    }
                    other => return other,
                }
            }
        };
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(wait) => {}
            _ = cancel.cancelled() => return Ended::Cancelled,
        }
    }
}
