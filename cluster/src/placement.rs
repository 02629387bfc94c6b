//! Where replicas go: pure functions from the regions and the live nodes to the next placement.
//! The master applies what [`plan`] returns, one etcd transaction per region, and plans again
//! once the world has moved (a node died or joined, a catch-up finished); nothing here does I/O.
//!
//! Rules, in order (a region gets at most one change per round, and every change bumps its epoch):
//! 1. **Promote**: a dead primary is replaced by the live in-sync backup with the most advanced
//!    log (every acknowledged write is on every in-sync backup; the most advanced one also keeps
//!    the most unacknowledged ones). With no live backup the region waits for its primary.
//! 2. **Drop the dead** from backups and joining nodes (a primary stops waiting for them).
//!    *Demote the stalled* (rule 2b): backups the region's primary reports stalled at the current
//!    epoch (they took no data for a while: a full disk, a one-way partition, a stuck process)
//!    leave the write set and go on as joining nodes; writes go on with fewer copies, and the
//!    node rejoins once it has caught up.
//! 3. **Repair** (at most `max_moves` regions copying at once, but always a region left with one
//!    in-sync copy): while the region has fewer replicas than the target (the replication factor, or
//!    the number of eligible nodes if smaller) on nodes that are not draining, add a joining node:
//!    the eligible node with the fewest replicas that holds none of the region (nor, when zones
//!    are given, a replica in the same zone). A joining node reported stalled does not count, so
//!    a spare node takes its place.
//! 4. **Promote a joiner** whose catch-up has finished to a backup.
//! 5. **Hand over** a draining node's primaries to an in-sync backup once the region has its
//!    target of replicas without it; the old primary leaves the region (its log may hold records
//!    no backup has, so it could not follow the new primary's log).
//!    *Step down* (rule 5b): a primary on a node stepping down (an upgrade restarts it next)
//!    moves to an in-sync backup on a node that is neither draining nor stepping down; the old
//!    primary re-copies as a joining node (its log may hold records the new primary never had)
//!    and keeps its other copies. A region with no such backup keeps its primary (its restart
//!    will be a failover).
//! 6. **Trim**: drop a draining node's backup or joining copy once the region has its target
//!    without it; drop the backup on the most loaded node of a region with more than the target.
//! 7. **Balance** (at most `max_moves` regions catching up at once): move a primary to an in-sync
//!    backup whose node leads at least two fewer regions (the old primary rejoins as a joining
//!    node); copy a backup to an eligible node holding at least two replicas fewer (rule 6 then
//!    trims the surplus). At rest, replica and primary counts differ by at most two (a primary only
//!    moves to a node holding an in-sync copy, and a copy is only moved off a backup).
//!
//! Regions in a running split or merge (`Facts::frozen`) get no change: the handoff planner
//! aborts a handoff whose replicas are not all live before anything else is done to them.
//!
//! Invariants of every plan (checked by the model tests): no node holds two replicas of a
//! region, no region loses its last in-sync copy, a primary is only ever replaced by an in-sync
//! backup, and every changed region's epoch is one more than before.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use dpukv_proto::regionmap::{NodeInfo, RegionInfo, RegionState};

/// Why a layout cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// Fewer nodes than the replication factor.
    #[error("replication factor {need} needs {need} nodes, {have} are registered")]
    NotEnoughNodes {
        /// The replication factor.
        need: usize,
        /// Live nodes.
        have: usize,
    },
    /// Zones are given but fewer than the replication factor.
    #[error("replication factor {need} across zones needs {need} zones, the nodes are in {have}")]
    NotEnoughZones {
        /// The replication factor.
        need: usize,
        /// Distinct zones.
        have: usize,
    },
    /// A replication factor of 0 or above the limit.
    #[error("replication factor {0} is out of range (1..={max})", max = dpukv_proto::regionmap::MAX_BACKUPS + 1)]
    BadFactor(usize),
}

/// What the master knows beyond the map: nodes' logs and catch-ups, and which nodes drain.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// (region, node) -> the node's log position for the region (larger is more advanced);
    /// missing = unknown (ranked last).
    pub progress: HashMap<(u32, u32), u64>,
    /// (region, node, epoch): the node finished copying the region at that epoch.
    pub caught_up: HashSet<(u32, u32, u64)>,
    /// Nodes being drained.
    pub draining: BTreeSet<u32>,
    /// Nodes stepping down: their primaries move away (rule 5b), their copies stay.
    pub stepping_down: BTreeSet<u32>,
    /// Regions in a running split or merge: left alone until it ends (`handoff`).
    pub frozen: BTreeSet<u32>,
    /// Regions a merge waits for: not balanced (rule 7), or their alignment would be undone.
    pub pinned: BTreeSet<u32>,
    /// Regions whose dead primary's backups have not all reported their positions: promotion
    /// waits (the master bounds the wait, `master::PROMOTION_WAIT`).
    pub awaiting: BTreeSet<u32>,
    /// (region, node, epoch): the region's primary reports the node (a backup or joining node)
    /// stalled at that epoch — it took no data for longer than the primary's bound.
    pub stalled: HashSet<(u32, u32, u64)>,
}

/// The placement policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Replicas per region (primary included).
    pub replication: usize,
    /// Most regions catching up at once (a joining node that is not stalled): repairs and
    /// balancing alike, so a node's loss or arrival copies a few regions at a time; a region left
    /// with one in-sync copy is repaired regardless (it is at risk).
    pub max_moves: usize,
}

/// Why a region changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Rule 1.
    Promote,
    /// Rule 2.
    DropDead,
    /// Rule 2b.
    DemoteStalled,
    /// Rule 3.
    Repair,
    /// Rule 4.
    Joined,
    /// Rule 5.
    HandOver,
    /// Rule 5b.
    StepDown,
    /// Rule 6.
    Trim,
    /// Rule 7 (primaries).
    BalancePrimary,
    /// Rule 7 (replicas).
    BalanceReplica,
}

/// One region's next state and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The region as it should be (epoch already bumped).
    pub region: RegionInfo,
    /// The rule that made it.
    pub reason: Reason,
}

fn zones_given(nodes: &[NodeInfo]) -> bool {
    nodes.iter().any(|n| !n.zone.is_empty())
}

fn check_factor(rf: usize) -> Result<(), PlacementError> {
    if rf == 0 || rf > dpukv_proto::regionmap::MAX_BACKUPS + 1 {
        return Err(PlacementError::BadFactor(rf));
    }
    Ok(())
}

/// Replica and primary counts per node.
#[derive(Debug, Default)]
struct Load {
    replicas: BTreeMap<u32, usize>,
    primaries: BTreeMap<u32, usize>,
}

impl Load {
    fn of(regions: &[RegionInfo], nodes: &[NodeInfo]) -> Load {
        let mut l = Load::default();
        for n in nodes {
            l.replicas.insert(n.id, 0);
            l.primaries.insert(n.id, 0);
        }
        for r in regions {
            for n in r.replicas() {
                *l.replicas.entry(n).or_default() += 1;
            }
            *l.primaries.entry(r.primary).or_default() += 1;
        }
        l
    }

    /// Moves the counts from `old`'s placement to `new`'s.
    fn apply(&mut self, old: &RegionInfo, new: &RegionInfo) {
        for n in old.replicas() {
            *self.replicas.entry(n).or_default() -= 1;
        }
        *self.primaries.entry(old.primary).or_default() -= 1;
        for n in new.replicas() {
            *self.replicas.entry(n).or_default() += 1;
        }
        *self.primaries.entry(new.primary).or_default() += 1;
    }

    fn replicas(&self, n: u32) -> usize {
        self.replicas.get(&n).copied().unwrap_or(0)
    }

    fn primaries(&self, n: u32) -> usize {
        self.primaries.get(&n).copied().unwrap_or(0)
    }
}

/// The eligible node with the fewest replicas (then fewest primaries, then lowest id) that holds
/// none of `r` and, with zones, shares no zone with its replicas on `staying` nodes — a replica on
/// a node that is leaving (draining) does not hold its zone against the copy that replaces it (a drain
/// of the only node of a zone holding a region's copy would wait for ever otherwise: found by the
/// operator's scenario, a scale-in with two nodes in one zone).
fn pick_new(
    r: &RegionInfo,
    nodes: &[NodeInfo],
    eligible: &dyn Fn(u32) -> bool,
    staying: &dyn Fn(u32) -> bool,
    load: &Load,
) -> Option<u32> {
    let zone_of = |id: u32| nodes.iter().find(|n| n.id == id).map(|n| n.zone.as_str());
    let taken: Vec<u32> = r.replicas().collect();
    // (`staying`, not `eligible`: a node that may not take one more copy — a loaded one — still
    // holds its zone; only one that is leaving does not.)
    let zones: Vec<&str> =
        taken.iter().filter(|&&id| staying(id)).filter_map(|&id| zone_of(id)).filter(|z| !z.is_empty()).collect();
    nodes
        .iter()
        .filter(|n| {
            eligible(n.id) && !taken.contains(&n.id) && (n.zone.is_empty() || !zones.contains(&n.zone.as_str()))
        })
        .min_by_key(|n| (load.replicas(n.id), load.primaries(n.id), n.id))
        .map(|n| n.id)
}

/// The first layout: regions split at `split_keys` (ascending), each with `rf` replicas on
/// distinct nodes (and zones, when given), primaries and replicas spread evenly; epoch 1.
pub fn initial(nodes: &[NodeInfo], split_keys: &[Vec<u8>], rf: usize) -> Result<Vec<RegionInfo>, PlacementError> {
    check_factor(rf)?;
    if nodes.len() < rf {
        return Err(PlacementError::NotEnoughNodes { need: rf, have: nodes.len() });
    }
    if zones_given(nodes) {
        let zones: BTreeSet<&str> = nodes.iter().map(|n| n.zone.as_str()).collect();
        if zones.len() < rf {
            return Err(PlacementError::NotEnoughZones { need: rf, have: zones.len() });
        }
    }
    let mut regions = RegionInfo::split(split_keys, 0);
    // The load of the regions placed so far, kept up as each one is placed.
    let mut load = Load::of(&[], nodes);
    for r in &mut regions {
        r.primary = nodes
            .iter()
            .min_by_key(|n| (load.primaries(n.id), load.replicas(n.id), n.id))
            .map(|n| n.id)
            .expect("at least rf >= 1 nodes");
        while r.backups.len() + 1 < rf {
            match pick_new(r, nodes, &|_| true, &|_| true, &load) {
                Some(b) => r.backups.push(b),
                None => unreachable!("enough nodes and zones were checked"),
            }
        }
        for n in r.replicas() {
            *load.replicas.entry(n).or_default() += 1;
        }
        *load.primaries.entry(r.primary).or_default() += 1;
    }
    Ok(regions)
}

/// The next changes for `regions` given the live `nodes` and `facts` (see the module's rules).
pub fn plan(regions: &[RegionInfo], nodes: &[NodeInfo], facts: &Facts, policy: Policy) -> Vec<Change> {
    let live: BTreeSet<u32> = nodes.iter().map(|n| n.id).collect();
    let eligible = |n: u32| live.contains(&n) && !facts.draining.contains(&n);
    let eligible_count = nodes.iter().filter(|n| eligible(n.id)).count();
    let target = policy.replication.min(eligible_count).max(1);
    let mut load = Load::of(regions, nodes);
    // Regions copying now: a joining node being fed by a live primary (a stalled joiner copies
    // nothing, nor does one whose region waits for its dead primary to return).
    let mut moves = regions
        .iter()
        .filter(|r| live.contains(&r.primary))
        .filter(|r| r.joining.iter().any(|&j| !facts.stalled.contains(&(r.id, j, r.epoch))))
        .count();
    let mut out = Vec::new();
    for r in regions {
        let change = decide(r, nodes, facts, &live, &eligible, target, policy, &load, &mut moves);
        if let Some((mut next, reason)) = change {
            next.epoch = r.epoch + 1;
            // Later regions of this round see this one's placement.
            load.apply(r, &next);
            out.push(Change { region: next, reason });
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn decide(
    r: &RegionInfo,
    nodes: &[NodeInfo],
    facts: &Facts,
    live: &BTreeSet<u32>,
    eligible: &dyn Fn(u32) -> bool,
    target: usize,
    policy: Policy,
    load: &Load,
    moves: &mut usize,
) -> Option<(RegionInfo, Reason)> {
    if facts.frozen.contains(&r.id) {
        return None;
    }
    let mut next = r.clone();
    let progress = |n: u32| facts.progress.get(&(r.id, n)).copied();
    // 1. Promote (once the backups said how far their logs reach, or the wait ran out).
    if !live.contains(&r.primary) {
        if facts.awaiting.contains(&r.id) {
            return None;
        }
        // A node stepping down (its pod restarts next) only when no other backup is live.
        let best = r.backups.iter().copied().filter(|b| live.contains(b)).max_by_key(|&b| {
            let stays = !facts.stepping_down.contains(&b);
            (stays, progress(b).map_or(0, |p| p + 1), std::cmp::Reverse(load.primaries(b)), std::cmp::Reverse(b))
        })?;
        next.primary = best;
        next.backups.retain(|&b| b != best && live.contains(&b));
        next.joining.retain(|j| live.contains(j));
        next.state = RegionState::Serving;
        return Some((next, Reason::Promote));
    }
    // 2. Drop the dead.
    if r.backups.iter().chain(&r.joining).any(|n| !live.contains(n)) {
        next.backups.retain(|b| live.contains(b));
        next.joining.retain(|j| live.contains(j));
        return Some((next, Reason::DropDead));
    }
    let stalled = |n: u32| facts.stalled.contains(&(r.id, n, r.epoch));
    // 2b. Demote the stalled.
    if r.backups.iter().any(|&b| stalled(b)) {
        let (out, stay): (Vec<u32>, Vec<u32>) = r.backups.iter().partition(|&&b| stalled(b));
        next.backups = stay;
        next.joining.extend(out);
        return Some((next, Reason::DemoteStalled));
    }
    let staying = r.replicas().filter(|&n| eligible(n) && !(r.joining.contains(&n) && stalled(n))).count();
    // 3. Repair (a few regions at a time, but always one left with a single in-sync copy).
    let in_sync_live = std::iter::once(r.primary).chain(r.backups.iter().copied()).filter(|n| live.contains(n)).count();
    if staying < target
        && (*moves < policy.max_moves.max(1) || in_sync_live <= 1)
        && let Some(n) = pick_new(r, nodes, eligible, eligible, load)
    {
        next.joining.push(n);
        *moves += 1;
        return Some((next, Reason::Repair));
    }
    // 4. Joined.
    if let Some(&j) = r.joining.iter().find(|&&j| facts.caught_up.contains(&(r.id, j, r.epoch))) {
        next.joining.retain(|&x| x != j);
        next.backups.push(j);
        return Some((next, Reason::Joined));
    }
    let in_sync_staying = r.backups.iter().filter(|&&b| eligible(b)).count();
    // A region whose copies are all placed on eligible nodes, but some of them are joining
    // nodes its primary cannot feed (stalled): only a new primary may feed them.
    let placed_but_stalled = in_sync_staying >= 1
        && r.replicas().filter(|&n| eligible(n)).count() >= target
        && r.joining.iter().any(|&j| stalled(j));
    // 5. Hand over a draining primary (once the region has its target without it — or, when
    // its own links are what keeps copies from catching up, to an in-sync backup that may feed
    // them: a drain around a backup the primary cannot reach would otherwise wait forever).
    if facts.draining.contains(&r.primary) && (in_sync_staying >= target || placed_but_stalled) {
        let to = r
            .backups
            .iter()
            .copied()
            .filter(|&b| eligible(b))
            .min_by_key(|&b| (facts.stepping_down.contains(&b), load.primaries(b), b))?;
        next.primary = to;
        next.backups.retain(|&b| b != to);
        return Some((next, Reason::HandOver));
    }
    // 5b. Step down.
    if facts.stepping_down.contains(&r.primary)
        && let Some(to) = r
            .backups
            .iter()
            .copied()
            .filter(|&b| eligible(b) && !facts.stepping_down.contains(&b))
            .min_by_key(|&b| (load.primaries(b), b))
    {
        next.backups.retain(|&b| b != to);
        next.joining.push(r.primary);
        next.primary = to;
        return Some((next, Reason::StepDown));
    }
    // 6. Trim.
    if let Some(&d) = r.joining.iter().find(|j| facts.draining.contains(j)) {
        next.joining.retain(|&x| x != d);
        return Some((next, Reason::Trim));
    }
    let serving_staying = usize::from(eligible(r.primary)) + in_sync_staying;
    if let Some(&d) = r.backups.iter().find(|b| facts.draining.contains(b))
        && serving_staying >= target
    {
        next.backups.retain(|&x| x != d);
        return Some((next, Reason::Trim));
    }
    if r.backups.len() + 1 > policy.replication && r.joining.is_empty() {
        let d = r.backups.iter().copied().max_by_key(|&b| (load.replicas(b), b))?;
        next.backups.retain(|&x| x != d);
        return Some((next, Reason::Trim));
    }
    // 7. Balance, a few regions at a time, only regions at rest.
    if *moves >= policy.max_moves
        || !r.joining.is_empty()
        || facts.draining.contains(&r.primary)
        || facts.stepping_down.contains(&r.primary)
        || facts.pinned.contains(&r.id)
    {
        return None;
    }
    // A primary whose node leads at least two more regions than an in-sync backup's node.
    if let Some(to) = r
        .backups
        .iter()
        .copied()
        .filter(|&b| {
            eligible(b) && !facts.stepping_down.contains(&b) && load.primaries(b) + 1 < load.primaries(r.primary)
        })
        .min_by_key(|&b| (load.primaries(b), b))
    {
        next.backups.retain(|&b| b != to);
        next.joining.push(r.primary);
        next.primary = to;
        *moves += 1;
        return Some((next, Reason::BalancePrimary));
    }
    // A backup on a node with at least two replicas more than some eligible node that could
    // take it: copy it there (rule 6 trims the surplus once the copy is done).
    let mut backups = r.backups.clone();
    backups.sort_by_key(|&b| std::cmp::Reverse((load.replicas(b), b)));
    for b in backups {
        let lighter = |n: u32| eligible(n) && load.replicas(n) + 1 < load.replicas(b);
        if let Some(to) = pick_new(r, nodes, &lighter, eligible, load) {
            next.joining.push(to);
            *moves += 1;
            return Some((next, Reason::BalanceReplica));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn node(id: u32, zone: &str) -> NodeInfo {
        NodeInfo {
            id,
            device: format!("d{id}"),
            replication: String::new(),
            admin: String::new(),
            zone: zone.into(),
            fabric: String::new(),
        }
    }

    fn keys(n: usize) -> Vec<Vec<u8>> {
        (1..n).map(|i| vec![i as u8]).collect()
    }

    fn check_map(regions: &[RegionInfo]) {
        let map =
            dpukv_proto::regionmap::RegionMap { revision: 1, master: 0, regions: regions.to_vec(), nodes: vec![] };
        map.validate().expect("a valid map: ranges cover the keys, no node holds two replicas of a region");
    }

    #[test]
    fn the_first_layout_spreads_primaries_and_replicas_evenly() {
        let nodes: Vec<NodeInfo> = (1..=4).map(|i| node(i, "")).collect();
        let regions = initial(&nodes, &keys(8), 3).expect("layout");
        check_map(&regions);
        let load = Load::of(&regions, &nodes);
        assert!(nodes.iter().all(|n| load.primaries(n.id) == 2), "8 primaries over 4 nodes: {load:?}");
        assert!(nodes.iter().all(|n| load.replicas(n.id) == 6), "24 replicas over 4 nodes: {load:?}");
        assert!(regions.iter().all(|r| r.backups.len() == 2 && r.epoch == 1));
    }

    #[test]
    fn zones_keep_a_region_s_replicas_apart() {
        let nodes = vec![node(1, "a"), node(2, "a"), node(3, "b"), node(4, "b"), node(5, "c"), node(6, "c")];
        let regions = initial(&nodes, &keys(12), 3).expect("layout");
        let zone = |id: u32| nodes.iter().find(|n| n.id == id).expect("node").zone.clone();
        for r in &regions {
            let zones: BTreeSet<String> = r.replicas().map(zone).collect();
            assert_eq!(zones.len(), 3, "region {} spans three zones: {r:?}", r.id);
        }
        assert_eq!(
            initial(&nodes[..4], &keys(2), 3),
            Err(PlacementError::NotEnoughZones { need: 3, have: 2 }),
            "two zones cannot hold three replicas apart"
        );
        assert_eq!(initial(&nodes[..2], &keys(2), 3), Err(PlacementError::NotEnoughNodes { need: 3, have: 2 }));
        assert_eq!(initial(&nodes, &keys(2), 0), Err(PlacementError::BadFactor(0)));
    }

    /// Draining a node whose zone holds a region's copy: the copy that replaces it may go to
    /// another node of that zone (the draining one is leaving), and the drain completes.
    #[test]
    fn a_drained_node_s_copy_is_replaced_in_its_own_zone() {
        let nodes = vec![node(1, "a"), node(2, "b"), node(3, "c"), node(4, "a")];
        let r = RegionInfo {
            id: 4,
            primary: 4,
            backups: vec![2],
            epoch: 1,
            ..initial(&nodes, &[], 2).expect("layout")[0].clone()
        };
        let mut facts = Facts::default();
        facts.draining.extend([3, 4]);
        let policy = Policy { replication: 2, max_moves: 2 };
        let mut regions = vec![r];
        for _ in 0..10 {
            let changes = plan(&regions, &nodes, &facts, policy);
            for c in changes {
                regions = vec![c.region];
            }
            // Copies the new node is given are caught up at once here.
            for r in &mut regions {
                r.backups.append(&mut r.joining);
            }
        }
        let r = &regions[0];
        assert!(!r.replicas().any(|n| n == 4 || n == 3), "the drained nodes hold nothing: {r:?}");
        assert_eq!(r.replicas().collect::<BTreeSet<u32>>(), BTreeSet::from([1, 2]), "zones a and b: {r:?}");
    }

    /// A node joins a zone that already holds copies: balancing moves copies to it, but never
    /// into the zone of a region's other copy — however loaded that copy's node is (found by the
    /// operator's scenario under load: a balance move put a region's two copies in one zone).
    #[test]
    fn balancing_onto_a_new_node_keeps_every_region_s_copies_in_distinct_zones() {
        let three = vec![node(1, "a"), node(2, "b"), node(3, "c")];
        let mut regions = initial(&three, &keys(12), 2).expect("layout");
        let nodes = vec![node(1, "a"), node(2, "b"), node(3, "c"), node(4, "a")];
        let zone = |id: u32| nodes.iter().find(|n| n.id == id).expect("node").zone.clone();
        let policy = Policy { replication: 2, max_moves: 2 };
        let mut moved = 0;
        for _ in 0..50 {
            let changes = plan(&regions, &nodes, &Facts::default(), policy);
            if changes.is_empty() {
                break;
            }
            for c in changes {
                moved += 1;
                let all: Vec<u32> = c.region.replicas().chain(c.region.joining.iter().copied()).collect();
                let zones: BTreeSet<String> = all.iter().map(|&n| zone(n)).collect();
                // A copy being trimmed may briefly share a zone with its replacement's others;
                // the region's copies that serve (primary and backups) never do.
                let serving: Vec<u32> = c.region.replicas().collect();
                let serving_zones: BTreeSet<String> = serving.iter().map(|&n| zone(n)).collect();
                assert_eq!(
                    serving_zones.len(),
                    serving.len(),
                    "{:?}: copies in one zone: {:?} ({zones:?})",
                    c.reason,
                    c.region
                );
                let i = regions.iter().position(|r| r.id == c.region.id).expect("region");
                regions[i] = c.region;
            }
            for r in &mut regions {
                r.backups.append(&mut r.joining);
            }
        }
        assert!(moved > 0, "the new node got copies");
        assert!(regions.iter().any(|r| r.replicas().any(|n| n == 4)), "{regions:?}");
    }

    #[test]
    fn a_dead_primary_is_replaced_by_the_backup_with_the_most_advanced_log() {
        let nodes: Vec<NodeInfo> = (1..=4).map(|i| node(i, "")).collect();
        let regions = initial(&nodes, &[], 3).expect("layout");
        let r = &regions[0];
        let (dead, b1, b2) = (r.primary, r.backups[0], r.backups[1]);
        let live: Vec<NodeInfo> = nodes.iter().filter(|n| n.id != dead).cloned().collect();
        let mut facts = Facts::default();
        facts.progress.insert((r.id, b1), 10);
        facts.progress.insert((r.id, b2), 20);
        // While the master waits for the backups' reports, nothing is done to the region.
        facts.awaiting.insert(r.id);
        assert_eq!(plan(&regions, &live, &facts, Policy { replication: 3, max_moves: 2 }), vec![]);
        facts.awaiting.clear();
        let changes = plan(&regions, &live, &facts, Policy { replication: 3, max_moves: 2 });
        assert_eq!(changes.len(), 1);
        let c = &changes[0];
        assert_eq!(
            (c.reason, c.region.primary, c.region.backups.clone(), c.region.epoch),
            (Reason::Promote, b2, vec![b1], 2)
        );
        // Next round: a replacement starts copying.
        let next = vec![c.region.clone()];
        let changes = plan(&next, &live, &facts, Policy { replication: 3, max_moves: 2 });
        assert_eq!(changes[0].reason, Reason::Repair);
        let spare = (1..=4).find(|n| ![dead, b1, b2].contains(n)).expect("a spare");
        assert_eq!((changes[0].region.joining.clone(), changes[0].region.epoch), (vec![spare], 3));
    }

    /// A backup that takes no data (a full disk, a one-way partition) once held every write of
    /// its region up: nothing took it out of the write set while its lease lived.
    #[test]
    fn a_backup_reported_stalled_leaves_the_write_set_and_a_spare_takes_its_place() {
        let nodes: Vec<NodeInfo> = (1..=4).map(|i| node(i, "")).collect();
        let regions = initial(&nodes, &[], 3).expect("layout");
        let r = regions[0].clone();
        let (stuck, ok) = (r.backups[0], r.backups[1]);
        let policy = Policy { replication: 3, max_moves: 2 };
        let mut facts = Facts::default();
        // A report under an older epoch is no longer about this placement.
        facts.stalled.insert((r.id, stuck, r.epoch - 1));
        assert_eq!(plan(&regions, &nodes, &facts, policy), vec![]);
        facts.stalled.insert((r.id, stuck, r.epoch));
        let changes = plan(&regions, &nodes, &facts, policy);
        let c = &changes[0];
        assert_eq!(
            (c.reason, c.region.primary, c.region.backups.clone(), c.region.joining.clone(), c.region.epoch),
            (Reason::DemoteStalled, r.primary, vec![ok], vec![stuck], r.epoch + 1)
        );
        // Still stalled at the new epoch: a spare node copies the region too.
        let next = vec![c.region.clone()];
        facts.stalled.insert((r.id, stuck, c.region.epoch));
        let changes = plan(&next, &nodes, &facts, policy);
        let spare = (1..=4).find(|n| ![r.primary, stuck, ok].contains(n)).expect("a spare");
        assert_eq!((changes[0].reason, changes[0].region.joining.clone()), (Reason::Repair, vec![stuck, spare]));
        // With no spare (three nodes), the stalled node goes on as the region's joining node.
        let three: Vec<NodeInfo> = nodes.iter().filter(|n| n.id != spare).cloned().collect();
        assert_eq!(plan(&next, &three, &facts, policy), vec![]);
    }

    /// A drain of a primary whose packets to a backup are dropped once waited forever: the
    /// backup stalled and was demoted, every other eligible node already held a copy, so the
    /// region never had its target without the draining primary — and only a new primary could
    /// feed the stalled copy.
    #[test]
    fn a_draining_primary_that_cannot_feed_a_copy_hands_over_to_a_backup_that_may() {
        let nodes: Vec<NodeInfo> = (1..=4).map(|i| node(i, "")).collect();
        let policy = Policy { replication: 3, max_moves: 2 };
        // Node 1 leads and drains; node 2 (joining) stalled; 3 and 4 hold it in sync.
        let r = RegionInfo {
            primary: 1,
            backups: vec![3, 4],
            joining: vec![2],
            epoch: 7,
            ..RegionInfo::split(&[], 0)[0].clone()
        };
        let mut facts = Facts::default();
        facts.draining.insert(1);
        assert_eq!(plan(std::slice::from_ref(&r), &nodes, &facts, policy), vec![], "not stalled: it catches up first");
        facts.stalled.insert((r.id, 2, 7));
        let changes = plan(std::slice::from_ref(&r), &nodes, &facts, policy);
        assert_eq!(changes.len(), 1);
        let c = &changes[0];
        assert_eq!(c.reason, Reason::HandOver);
        assert!(
            [3, 4].contains(&c.region.primary) && c.region.joining == vec![2],
            "to an in-sync backup: {:?}",
            c.region
        );
    }

    #[test]
    fn a_stepping_down_primary_moves_to_a_backup_and_keeps_a_copy() {
        let nodes: Vec<NodeInfo> = (1..=3).map(|i| node(i, "")).collect();
        let regions = initial(&nodes, &keys(1), 3).expect("layout");
        let r = &regions[0];
        let p = r.primary;
        let facts = Facts { stepping_down: BTreeSet::from([p]), ..Facts::default() };
        let changes = plan(&regions, &nodes, &facts, Policy { replication: 3, max_moves: 2 });
        assert_eq!(changes.len(), 1, "{changes:?}");
        let c = &changes[0];
        assert_eq!(c.reason, Reason::StepDown);
        assert!(r.backups.contains(&c.region.primary) && c.region.joining == vec![p], "{:?} -> {:?}", r, c.region);
        // With every backup stepping down too, or none, the primary stays.
        let all = Facts { stepping_down: nodes.iter().map(|n| n.id).collect(), ..Facts::default() };
        assert!(plan(&regions, &nodes, &all, Policy { replication: 3, max_moves: 2 }).is_empty());
        // A failover prefers a backup that is not stepping down, however far the other's log.
        let b0 = r.backups[0];
        let mut dead_primary = Facts { stepping_down: BTreeSet::from([b0]), ..Facts::default() };
        dead_primary.progress.insert((r.id, b0), 1_000);
        let live: Vec<NodeInfo> = nodes.iter().filter(|n| n.id != p).cloned().collect();
        let changes = plan(&regions, &live, &dead_primary, Policy { replication: 3, max_moves: 2 });
        assert_eq!((changes[0].reason, changes[0].region.primary), (Reason::Promote, r.backups[1]), "{changes:?}");
        let single = initial(&nodes, &keys(1), 1).expect("layout");
        let alone = Facts { stepping_down: BTreeSet::from([single[0].primary]), ..Facts::default() };
        assert!(plan(&single, &nodes, &alone, Policy { replication: 1, max_moves: 2 }).is_empty());
    }

    #[test]
    fn a_region_whose_every_copy_is_dead_waits_for_its_primary() {
        let nodes: Vec<NodeInfo> = (1..=2).map(|i| node(i, "")).collect();
        let regions = initial(&nodes, &keys(2), 1).expect("layout");
        let live = vec![nodes[1].clone()];
        let changes = plan(&regions, &live, &Facts::default(), Policy { replication: 1, max_moves: 2 });
        assert!(changes.iter().all(|c| c.region.primary != 0 && regions.iter().any(|r| r.primary == c.region.primary)));
        let lost = regions.iter().find(|r| r.primary == 1).expect("node 1 leads one");
        assert!(changes.iter().all(|c| c.region.id != lost.id), "nothing else holds region {}: it waits", lost.id);
    }

    /// A simulated cluster under random joins, deaths, drains and finished catch-ups.
    #[derive(Debug, Clone)]
    enum Event {
        Join,
        Die(usize),
        Drain(usize),
        StepDown(usize),
        Return(usize),
        /// The primary of region i reports one of its backups or joining nodes stalled.
        Stall(usize, usize),
        /// A planning round; bit i of the seed says whether the i-th catch-up finishes first.
        Round(u64),
    }

    fn events() -> impl Strategy<Value = Vec<Event>> {
        let ev = prop_oneof![
            1 => Just(Event::Join),
            1 => any::<usize>().prop_map(Event::Die),
            1 => any::<usize>().prop_map(Event::Drain),
            1 => any::<usize>().prop_map(Event::StepDown),
            1 => any::<usize>().prop_map(Event::Return),
            1 => (any::<usize>(), any::<usize>()).prop_map(|(r, n)| Event::Stall(r, n)),
            6 => any::<u64>().prop_map(Event::Round),
        ];
        prop::collection::vec(ev, 1..60)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// Every round keeps the invariants; once events stop, rounds converge to a placement
        /// with the target replicas on live, non-draining nodes, evenly spread.
        #[test]
        fn plans_keep_every_copy_and_converge(rf in 1usize..4, n in 3u32..6, nregions in 1usize..10, evs in events()) {
            let mut nodes: Vec<NodeInfo> = (1..=n).map(|i| node(i, "")).collect();
            let mut next_id = n + 1;
            let mut dead: Vec<NodeInfo> = Vec::new();
            let mut regions = initial(&nodes, &keys(nregions), rf.min(n as usize)).expect("layout");
            let mut facts = Facts::default();
            let policy = Policy { replication: rf, max_moves: 2 };
            let round = |regions: &mut Vec<RegionInfo>, nodes: &[NodeInfo], facts: &mut Facts, finish: u64| -> Result<usize, TestCaseError> {
                // Some catch-ups finish (all of them once events stop).
                facts.caught_up = regions
                    .iter()
                    .flat_map(|r| r.joining.iter().map(|&j| (r.id, j, r.epoch)))
                    .enumerate()
                    .filter(|(i, _)| finish >> (i % 64) & 1 == 1)
                    .map(|(_, c)| c)
                    .collect();
                let live: BTreeSet<u32> = nodes.iter().map(|n| n.id).collect();
                let changes = plan(regions, nodes, facts, policy);
                for c in &changes {
                    let old = regions.iter().find(|r| r.id == c.region.id).expect("a region").clone();
                    prop_assert_eq!(c.region.epoch, old.epoch + 1);
                    prop_assert_eq!((&c.region.start, &c.region.end), (&old.start, &old.end));
                    if c.region.primary != old.primary {
                        prop_assert!(old.backups.contains(&c.region.primary), "a new primary was an in-sync backup: {:?} -> {:?}", old, c.region);
                    }
                    for b in &c.region.backups {
                        prop_assert!(old.backups.contains(b) || old.primary == *b && c.reason == Reason::Promote
                            || old.joining.contains(b) && facts.caught_up.contains(&(old.id, *b, old.epoch)),
                            "a backup was in sync or finished its catch-up: {:?} -> {:?}", old, c.region);
                    }
                    let in_sync_live = |r: &RegionInfo| std::iter::once(r.primary).chain(r.backups.iter().copied()).any(|x| live.contains(&x));
                    prop_assert!(!in_sync_live(&old) || in_sync_live(&c.region), "a live in-sync copy survives: {:?} -> {:?}", old, c.region);
                    // Planned changes (not deaths, not a primary's move) keep the redundancy
                    // the region had, up to its target.
                    let eligible = nodes.iter().filter(|n| !facts.draining.contains(&n.id)).count();
                    let target = rf.min(eligible).max(1);
                    let copies = |r: &RegionInfo| std::iter::once(r.primary).chain(r.backups.iter().copied()).filter(|x| live.contains(x)).count();
                    let around_stalled = c.reason == Reason::HandOver
                        && old.joining.iter().any(|j| facts.stalled.contains(&(old.id, *j, old.epoch)));
                    if matches!(c.reason, Reason::Trim | Reason::HandOver | Reason::Joined | Reason::Repair | Reason::BalanceReplica)
                        && !around_stalled
                    {
                        prop_assert!(copies(&c.region) >= copies(&old).min(target), "{:?} lowered redundancy: {:?} -> {:?}", c.reason, old, c.region);
                    }
                    *regions.iter_mut().find(|r| r.id == c.region.id).expect("a region") = c.region.clone();
                }
                check_map(regions);
                Ok(changes.len())
            };
            for ev in evs {
                match ev {
                    Event::Join => { nodes.push(node(next_id, "")); next_id += 1; }
                    Event::Die(i) if nodes.len() > 1 => { let d = nodes.remove(i % nodes.len()); dead.push(d); }
                    Event::Drain(i) => { let id = nodes[i % nodes.len()].id; facts.draining.insert(id); }
                    Event::StepDown(i) => { let id = nodes[i % nodes.len()].id; facts.stepping_down.insert(id); }
                    Event::Return(i) if !dead.is_empty() => { let d = dead.remove(i % dead.len()); nodes.push(d); }
                    Event::Stall(ri, ni) => {
                        let r = &regions[ri % regions.len()];
                        let streamed: Vec<u32> = r.backups.iter().chain(&r.joining).copied().collect();
                        if !streamed.is_empty() {
                            facts.stalled.insert((r.id, streamed[ni % streamed.len()], r.epoch));
                        }
                    }
                    Event::Round(finish) => { round(&mut regions, &nodes, &mut facts, finish)?; }
                    _ => {}
                }
            }
            // Converge (stalled nodes took their data again).
            facts.stalled.clear();
            let mut rounds = 0;
            while round(&mut regions, &nodes, &mut facts, u64::MAX)? > 0 {
                rounds += 1;
                prop_assert!(rounds < 200, "no fixpoint after 200 rounds: {:?}", regions);
            }
            let live: BTreeSet<u32> = nodes.iter().map(|n| n.id).collect();
            let eligible: Vec<u32> = live.iter().copied().filter(|n| !facts.draining.contains(n)).collect();
            let target = rf.min(eligible.len()).max(1);
            let load = Load::of(&regions, &nodes);
            for r in &regions {
                let copies: Vec<u32> = std::iter::once(r.primary).chain(r.backups.iter().copied()).collect();
                if !copies.iter().any(|c| live.contains(c)) {
                    continue; // every copy died: it waits, unchanged.
                }
                prop_assert!(r.joining.is_empty(), "catch-ups are done: {:?}", r);
                prop_assert!(live.contains(&r.primary), "a live primary: {:?}", r);
                // A stepping-down node leads only regions no other eligible node holds in sync.
                if facts.stepping_down.contains(&r.primary) {
                    let elsewhere = r.backups.iter().any(|b| eligible.contains(b) && !facts.stepping_down.contains(b));
                    prop_assert!(!elsewhere, "a stepping-down primary with a backup to take over: {:?}", r);
                }
                if !eligible.is_empty() {
                    prop_assert_eq!(copies.len(), target, "the target of copies: {:?} (all {:?})", r, regions);
                    prop_assert!(copies.iter().all(|c| eligible.contains(c)), "only eligible nodes hold it: {:?} (draining {:?})", r, facts.draining);
                }
            }
            if rf >= 2 && eligible.len() >= rf && regions.iter().all(|r| live.contains(&r.primary)) && facts.stepping_down.is_empty() {
                let reps: Vec<usize> = eligible.iter().map(|&n| load.replicas(n)).collect();
                prop_assert!(reps.iter().max().expect("some") - reps.iter().min().expect("some") <= 2, "replicas evenly spread: {:?}", reps);
                let prim: Vec<usize> = eligible.iter().map(|&n| load.primaries(n)).collect();
                // A primary moves only to an in-sync backup, which the least loaded node may not be for
                // any region of the most loaded one: within two.
                prop_assert!(prim.iter().max().expect("some") - prim.iter().min().expect("some") <= 2, "primaries evenly spread: {:?}", prim);
            }
        }
    }
}
