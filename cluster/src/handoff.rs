//! Splits and merges: when the master starts one, and how it ends (docs/cluster.md §9). Pure
//! functions from the regions, the live nodes and what nodes reported to the next steps; the
//! master applies each step as one fenced transaction.
//!
//! A *handoff* moves the range `[start, end)` from a source region to a target region on the
//! same nodes: a split gives the source's upper part to a new region (placed like the source), a
//! merge gives the whole source to its left neighbour (only when both are placed alike: same
//! primary, same backups). While it runs, the source refuses writes to the range (retryable), its
//! primary copies the range and the source's exactly-once sessions into the target (through the
//! target's replicated write path) and reports; then one transaction narrows or removes the
//! source and creates or widens the target, bumping their epochs.
//!
//! Rules, in order:
//! 1. A running handoff whose copy is reported (for this very handoff: the report names the
//!    handoff key's create revision) **commits**.
//! 2. One whose source or target is gone, whose replicas are not all live, or that ran past its
//!    timeout **aborts**: the source serves the range again (its epoch bumped). Placement leaves
//!    every region of a running handoff alone, so a dead primary is first aborted, then promoted.
//! 3. **Requests** (`dpukv cluster split|merge`) start a handoff once the regions are at rest
//!    (serving, nothing joining, every replica live); an impossible request is refused.
//! 4. **By size or load**: a region whose primary reports more bytes than `split_bytes` (or more
//!    writes per second than `split_writes_per_sec`) splits at the middle key it reported;
//!    neighbours both smaller than `merge_bytes`, together under half of `split_bytes`, quiet and
//!    placed alike merge.
//!
//! At most `max_running` handoffs run at once; region ids are never reused.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use dpukv_proto::regionmap::{Handoff, HandoffKind, RegionInfo, RegionState};

use crate::keys::{hex, unhex};
use crate::meta::Revision;

/// A handoff as stored, with the revisions that name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    /// The record.
    pub handoff: Handoff,
    /// Its key's create revision (names this handoff: reports carry it).
    pub create: Revision,
    /// Its key's mod revision (for compare-and-swap).
    pub modrev: Revision,
}

/// What a region's primary reports about it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegionLoad {
    /// Estimated bytes of live data.
    pub bytes: u64,
    /// Writes per second, lately.
    pub writes_per_sec: u64,
    /// A key near the middle of its data (where it would split), if it has two keys or more.
    pub middle: Option<Vec<u8>>,
}

impl RegionLoad {
    /// Encodes as `key=value` lines (the middle key in hex).
    pub fn encode(&self) -> Vec<u8> {
        let middle = self.middle.as_deref().map(hex).unwrap_or_default();
        format!("bytes={}\nwrites_per_sec={}\nmiddle={middle}\n", self.bytes, self.writes_per_sec).into_bytes()
    }

    /// Decodes what [`RegionLoad::encode`] wrote (None if malformed: a report is only advice).
    pub fn decode(b: &[u8]) -> Option<RegionLoad> {
        let mut l = RegionLoad::default();
        for line in std::str::from_utf8(b).ok()?.lines() {
            let (k, v) = line.split_once('=')?;
            match k {
                "bytes" => l.bytes = v.parse().ok()?,
                "writes_per_sec" => l.writes_per_sec = v.parse().ok()?,
                "middle" if v.is_empty() => {}
                "middle" => l.middle = Some(unhex(v).filter(|k| k.len() <= dpukv_proto::limits::MAX_KEY)?),
                _ => {}
            }
        }
        Some(l)
    }
}

/// What the master knows about handoffs beyond the map.
#[derive(Debug, Clone, Default)]
pub struct HandoffFacts {
    /// Running handoffs.
    pub running: Vec<Running>,
    /// Copies reported done: source region -> the handoff's create revision.
    pub done: HashMap<u32, Revision>,
    /// Regions' reported sizes and loads.
    pub load: HashMap<u32, RegionLoad>,
    /// Requested splits: region -> key.
    pub split_requests: BTreeMap<u32, Vec<u8>>,
    /// Requested merges (of the region into its left neighbour).
    pub merge_requests: BTreeSet<u32>,
    /// The largest region id ever given, and its key's mod revision (None: never written).
    pub last_region_id: Option<(u32, Revision)>,
}

/// When to split and merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Split past this many bytes (0: never).
    pub split_bytes: u64,
    /// Split past this many writes per second (0: never).
    pub split_writes_per_sec: u64,
    /// Merge neighbours smaller than this (0: never by themselves).
    pub merge_bytes: u64,
    /// Most handoffs at once.
    pub max_running: usize,
    /// A handoff running longer is aborted (ms).
    pub timeout_ms: u64,
}

/// A request a step consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `split-requests/<region>`.
    Split(u32),
    /// `merge-requests/<region>`.
    Merge(u32),
}

/// One change the master makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Record `handoff`, put `source` (its epoch bumped, splitting or merging), and for a split
    /// take `handoff.target` as the largest region id; consume `request`.
    Start {
        /// The new handoff.
        handoff: Handoff,
        /// The source as it becomes.
        source: RegionInfo,
        /// The source as it was (for compare-and-swap).
        was: u32,
        /// The request it answers, if any.
        request: Option<Request>,
    },
    /// The copy is done: put `source` (narrowed; None: removed, a merge) and `target` (new, or
    /// widened), remove the handoff and its report.
    Commit {
        /// The handoff.
        running: Running,
        /// The source as it becomes.
        source: Option<RegionInfo>,
        /// The target as it becomes.
        target: RegionInfo,
        /// Whether the target is a new region (a split).
        target_is_new: bool,
    },
    /// Give up: put `source` (serving its whole range again; None: it is gone), remove the
    /// handoff and its report.
    Abort {
        /// The handoff.
        running: Running,
        /// The source as it becomes.
        source: Option<RegionInfo>,
        /// Why.
        why: &'static str,
    },
    /// Before a requested merge: move the source's primary to its left neighbour's primary (on
    /// the same nodes, led by another), the old primary copying the region again as a joining
    /// node (like placement's primary balancing). The request stays until the merge starts.
    Align {
        /// The source as it becomes.
        source: RegionInfo,
    },
    /// Drop an impossible request.
    Refuse {
        /// The request.
        request: Request,
        /// Why.
        why: &'static str,
    },
}

/// Whether two regions are on the same nodes (whoever leads them), nothing joining.
fn same_nodes(a: &RegionInfo, b: &RegionInfo) -> bool {
    let set = |r: &RegionInfo| r.replicas().collect::<BTreeSet<u32>>();
    set(a) == set(b) && a.joining.is_empty() && b.joining.is_empty()
}

fn placed_alike(a: &RegionInfo, b: &RegionInfo) -> bool {
    let set = |r: &RegionInfo| r.backups.iter().copied().collect::<BTreeSet<u32>>();
    a.primary == b.primary && set(a) == set(b) && a.joining.is_empty() && b.joining.is_empty()
}

/// The next handoff steps (see the module's rules).
pub fn plan(regions: &[RegionInfo], live: &BTreeSet<u32>, f: &HandoffFacts, t: Thresholds, now_ms: u64) -> Vec<Step> {
    let find = |id: u32| regions.iter().find(|r| r.id == id);
    let all_live = |r: &RegionInfo| r.replicas().all(|n| live.contains(&n));
    let mut out = Vec::new();
    let mut busy: BTreeSet<u32> = BTreeSet::new();
    for run in &f.running {
        let h = &run.handoff;
        busy.extend([h.source, h.target]);
        let Some(s) = find(h.source) else {
            out.push(Step::Abort { running: run.clone(), source: None, why: "its source region is gone" });
            continue;
        };
        let serving = RegionInfo { state: RegionState::Serving, epoch: s.epoch + 1, ..s.clone() };
        let target = if h.kind == HandoffKind::Merge { find(h.target) } else { None };
        let abort = |why| Step::Abort { running: run.clone(), source: Some(serving.clone()), why };
        if h.kind == HandoffKind::Merge && target.is_none() {
            out.push(abort("its target region is gone"));
            continue;
        }
        if f.done.get(&h.source) == Some(&run.create) {
            out.push(match target {
                None => Step::Commit {
                    running: run.clone(),
                    source: Some(RegionInfo { end: Some(h.start.clone()), ..serving.clone() }),
                    target: h.new_region(s),
                    target_is_new: true,
                },
                Some(l) => Step::Commit {
                    running: run.clone(),
                    source: None,
                    target: RegionInfo { end: s.end.clone(), epoch: l.epoch + 1, ..l.clone() },
                    target_is_new: false,
                },
            });
            continue;
        }
        if !all_live(s) || target.is_some_and(|l| !all_live(l)) {
            out.push(abort("a replica's node is gone"));
        } else if now_ms.saturating_sub(h.started_ms) > t.timeout_ms {
            out.push(abort("it ran past its timeout"));
        }
    }
    let mut running = f.running.len();
    let mut next_id = regions
        .iter()
        .map(|r| r.id)
        .chain(f.running.iter().map(|r| r.handoff.target))
        .chain(f.last_region_id.map(|(id, _)| id))
        .max()
        .unwrap_or(0);
    let at_rest = |r: &RegionInfo, busy: &BTreeSet<u32>| {
        r.state == RegionState::Serving && r.joining.is_empty() && !busy.contains(&r.id) && all_live(r)
    };
    let inside = |r: &RegionInfo, k: &[u8]| r.start.as_slice() < k && r.contains(k);
    let split = |s: &RegionInfo, key: Vec<u8>, request, out: &mut Vec<Step>, next_id: &mut u32| {
        *next_id += 1;
        let handoff = Handoff {
            source: s.id,
            target: *next_id,
            start: key,
            end: s.end.clone(),
            kind: HandoffKind::Split,
            started_ms: now_ms,
        };
        let source = RegionInfo { state: RegionState::Splitting, epoch: s.epoch + 1, ..s.clone() };
        out.push(Step::Start { handoff, source, was: s.id, request });
    };
    let merge = |l: &RegionInfo, s: &RegionInfo, request, out: &mut Vec<Step>| {
        let handoff = Handoff {
            source: s.id,
            target: l.id,
            start: s.start.clone(),
            end: s.end.clone(),
            kind: HandoffKind::Merge,
            started_ms: now_ms,
        };
        let source = RegionInfo { state: RegionState::Merging, epoch: s.epoch + 1, ..s.clone() };
        out.push(Step::Start { handoff, source, was: s.id, request });
    };
    // 3. Requests.
    for (&id, key) in &f.split_requests {
        let request = Request::Split(id);
        match find(id) {
            None => out.push(Step::Refuse { request, why: "no such region" }),
            Some(s) if !inside(s, key) => {
                out.push(Step::Refuse { request, why: "the key is not strictly inside the region" })
            }
            Some(s) if running < t.max_running && at_rest(s, &busy) => {
                busy.insert(s.id);
                running += 1;
                split(s, key.clone(), Some(request), &mut out, &mut next_id);
            }
            Some(_) => {} // wait until it is at rest
        }
    }
    for &id in &f.merge_requests {
        let request = Request::Merge(id);
        let i = regions.iter().position(|r| r.id == id);
        match i {
            None => out.push(Step::Refuse { request, why: "no such region" }),
            Some(0) => out.push(Step::Refuse { request, why: "the first region has no left neighbour" }),
            Some(i)
                if !placed_alike(&regions[i - 1], &regions[i])
                    && same_nodes(&regions[i - 1], &regions[i])
                    && at_rest(&regions[i], &busy)
                    && at_rest(&regions[i - 1], &busy) =>
            {
                let (l, s) = (&regions[i - 1], &regions[i]);
                let mut next = s.clone();
                next.backups.retain(|&b| b != l.primary);
                next.joining.push(s.primary);
                next.primary = l.primary;
                next.epoch = s.epoch + 1;
                busy.insert(s.id);
                out.push(Step::Align { source: next });
            }
            // Joining nodes: wait for them (a region being aligned gets its old primary back as
            // a backup once that copy is done).
            Some(i) if !regions[i].joining.is_empty() || !regions[i - 1].joining.is_empty() => {}
            Some(i) if !same_nodes(&regions[i - 1], &regions[i]) => {
                out.push(Step::Refuse { request, why: "the region and its left neighbour are on different nodes" })
            }
            Some(i) if running < t.max_running && at_rest(&regions[i], &busy) && at_rest(&regions[i - 1], &busy) => {
                busy.extend([regions[i].id, regions[i - 1].id]);
                running += 1;
                merge(&regions[i - 1], &regions[i], Some(request), &mut out);
            }
            Some(_) => {}
        }
    }
    // 4. By size or load.
    for s in regions {
        if running >= t.max_running {
            break;
        }
        let Some(load) = f.load.get(&s.id) else { continue };
        let big = t.split_bytes > 0 && load.bytes >= t.split_bytes;
        let hot = t.split_writes_per_sec > 0 && load.writes_per_sec >= t.split_writes_per_sec;
        if let Some(key) = load.middle.as_ref().filter(|k| (big || hot) && inside(s, k))
            && at_rest(s, &busy)
        {
            busy.insert(s.id);
            running += 1;
            split(s, key.clone(), None, &mut out, &mut next_id);
        }
    }
    if t.merge_bytes > 0 {
        for w in regions.windows(2) {
            if running >= t.max_running {
                break;
            }
            let (l, s) = (&w[0], &w[1]);
            let (Some(ll), Some(sl)) = (f.load.get(&l.id), f.load.get(&s.id)) else { continue };
            let small = ll.bytes < t.merge_bytes
                && sl.bytes < t.merge_bytes
                && (t.split_bytes == 0 || ll.bytes + sl.bytes < t.split_bytes / 2);
            let quiet =
                t.split_writes_per_sec == 0 || ll.writes_per_sec + sl.writes_per_sec < t.split_writes_per_sec / 2;
            if small && quiet && placed_alike(l, s) && at_rest(l, &busy) && at_rest(s, &busy) {
                busy.extend([l.id, s.id]);
                running += 1;
                merge(l, s, None, &mut out);
            }
        }
    }
    out
}

/// Regions placement must leave alone: those of running handoffs.
pub fn frozen(f: &HandoffFacts) -> BTreeSet<u32> {
    f.running.iter().flat_map(|r| [r.handoff.source, r.handoff.target]).collect()
}

/// Regions placement must not balance: those a merge was requested for, and their left
/// neighbours (an alignment would be undone).
pub fn pinned(regions: &[RegionInfo], f: &HandoffFacts) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    for &id in &f.merge_requests {
        if let Some(i) = regions.iter().position(|r| r.id == id) {
            out.insert(id);
            if i > 0 {
                out.insert(regions[i - 1].id);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use dpukv_proto::regionmap::RegionMap;

    use super::*;

    const T: Thresholds =
        Thresholds { split_bytes: 1000, split_writes_per_sec: 0, merge_bytes: 100, max_running: 2, timeout_ms: 60_000 };

    fn regions(bounds: &[&str]) -> Vec<RegionInfo> {
        let keys: Vec<Vec<u8>> = bounds.iter().map(|b| b.as_bytes().to_vec()).collect();
        let mut rs = RegionInfo::split(&keys, 1);
        for r in &mut rs {
            r.backups = vec![2, 3];
        }
        rs
    }

    fn live() -> BTreeSet<u32> {
        [1, 2, 3].into()
    }

    /// Applies steps the way the master's transactions do (the map stays valid).
    fn apply(rs: &mut Vec<RegionInfo>, f: &mut HandoffFacts, steps: &[Step], rev: &mut i64) {
        for s in steps {
            *rev += 1;
            match s {
                Step::Start { handoff, source, request, .. } => {
                    *rs.iter_mut().find(|r| r.id == source.id).expect("source") = source.clone();
                    f.running.push(Running { handoff: handoff.clone(), create: *rev, modrev: *rev });
                    if handoff.kind == HandoffKind::Split {
                        f.last_region_id = Some((handoff.target, *rev));
                    }
                    match request {
                        Some(Request::Split(id)) => drop(f.split_requests.remove(id)),
                        Some(Request::Merge(id)) => drop(f.merge_requests.remove(id)),
                        None => {}
                    }
                }
                Step::Commit { running, source, target, target_is_new } => {
                    match source {
                        Some(s) => *rs.iter_mut().find(|r| r.id == s.id).expect("source") = s.clone(),
                        None => rs.retain(|r| r.id != running.handoff.source),
                    }
                    if *target_is_new {
                        rs.push(target.clone());
                    } else {
                        *rs.iter_mut().find(|r| r.id == target.id).expect("target") = target.clone();
                    }
                    rs.sort_by(|a, b| a.start.cmp(&b.start));
                    f.running.retain(|r| r != running);
                    f.done.remove(&running.handoff.source);
                }
                Step::Abort { running, source, .. } => {
                    if let Some(s) = source {
                        *rs.iter_mut().find(|r| r.id == s.id).expect("source") = s.clone();
                    }
                    f.running.retain(|r| r != running);
                }
                Step::Align { source } => *rs.iter_mut().find(|r| r.id == source.id).expect("source") = source.clone(),
                Step::Refuse { request, .. } => match request {
                    Request::Split(id) => drop(f.split_requests.remove(id)),
                    Request::Merge(id) => drop(f.merge_requests.remove(id)),
                },
            }
        }
        RegionMap { revision: 1, master: 0, regions: rs.clone(), nodes: vec![] }.validate().expect("a valid map");
    }

    #[test]
    fn a_big_region_splits_at_its_middle_once_its_copy_is_reported() {
        let mut rs = regions(&["m"]);
        let mut f = HandoffFacts::default();
        f.load.insert(1, RegionLoad { bytes: 5000, writes_per_sec: 0, middle: Some(b"f".to_vec()) });
        let now = 1_000;
        let (mut rev, steps) = (10, plan(&rs, &live(), &f, T, now));
        assert!(matches!(&steps[..], [Step::Start { handoff, .. }] if handoff.target == 3 && handoff.start == b"f"));
        apply(&mut rs, &mut f, &steps, &mut rev);
        assert_eq!((rs[0].state, rs[0].epoch), (RegionState::Splitting, 2));
        // Nothing more happens until the copy is reported (the region is busy).
        assert_eq!(plan(&rs, &live(), &f, T, now), vec![]);
        // A report of another handoff does not count.
        f.done.insert(1, 999);
        assert_eq!(plan(&rs, &live(), &f, T, now), vec![]);
        f.done.insert(1, f.running[0].create);
        let steps = plan(&rs, &live(), &f, T, now);
        apply(&mut rs, &mut f, &steps, &mut rev);
        let ids: Vec<(u32, &[u8], u64)> = rs.iter().map(|r| (r.id, r.start.as_slice(), r.epoch)).collect();
        assert_eq!(ids, vec![(1, &b""[..], 3), (3, &b"f"[..], 1), (2, &b"m"[..], 1)]);
        assert!(f.running.is_empty());
        assert_eq!((rs[1].primary, rs[1].backups.clone()), (1, vec![2, 3]), "placed like its source");
    }

    #[test]
    fn a_dead_replica_or_a_timeout_aborts_and_the_source_serves_again() {
        for (dead, later) in [(true, 0), (false, 60_001)] {
            let mut rs = regions(&[]);
            let mut f = HandoffFacts::default();
            f.split_requests.insert(1, b"k".to_vec());
            let mut rev = 0;
            let steps = plan(&rs, &live(), &f, T, 0);
            apply(&mut rs, &mut f, &steps, &mut rev);
            assert_eq!(rs[0].state, RegionState::Splitting);
            let alive: BTreeSet<u32> = if dead { [1, 2].into() } else { live() };
            let steps = plan(&rs, &alive, &f, T, later);
            assert!(matches!(&steps[..], [Step::Abort { .. }]), "{steps:?}");
            apply(&mut rs, &mut f, &steps, &mut rev);
            assert_eq!((rs.len(), rs[0].state, rs[0].epoch, rs[0].end.clone()), (1, RegionState::Serving, 3, None));
            // The new id stays taken.
            assert_eq!(f.last_region_id.map(|(id, _)| id), Some(2));
        }
    }

    #[test]
    fn requests_are_checked_and_wait_for_regions_at_rest() {
        let mut rs = regions(&["m"]);
        let mut f = HandoffFacts::default();
        f.split_requests.insert(1, b"m".to_vec()); // not inside region 1 ([, m))
        f.split_requests.insert(7, b"a".to_vec());
        f.merge_requests.insert(1);
        let steps = plan(&rs, &live(), &f, T, 0);
        assert_eq!(steps.iter().filter(|s| matches!(s, Step::Refuse { .. })).count(), 3, "{steps:?}");
        // Neighbours on the same nodes led by different ones: the source's primary moves first.
        rs[1].primary = 2;
        rs[1].backups = vec![1, 3];
        let f2 = HandoffFacts { merge_requests: [2].into(), ..HandoffFacts::default() };
        let steps = plan(&rs, &live(), &f2, T, 0);
        assert!(
            matches!(&steps[..], [Step::Align { source }] if source.primary == 1 && source.joining == vec![2] && source.backups == vec![3]),
            "{steps:?}"
        );
        // On other nodes: refused.
        rs[1].backups = vec![3, 4];
        let steps = plan(&rs, &[1, 2, 3, 4].into(), &f2, T, 0);
        assert!(matches!(&steps[..], [Step::Refuse { .. }]), "{steps:?}");
        rs[1].backups = vec![1, 3];
        // One joining node: not at rest, the request waits.
        rs[1] = regions(&["m"])[1].clone();
        rs[1].joining = vec![4];
        let f3 = HandoffFacts { split_requests: [(2, b"x".to_vec())].into(), ..HandoffFacts::default() };
        assert_eq!(plan(&rs, &[1, 2, 3, 4].into(), &f3, T, 0), vec![]);
    }

    #[test]
    fn small_quiet_neighbours_placed_alike_merge_and_the_map_stays_whole() {
        let mut rs = regions(&["g", "p"]);
        let mut f = HandoffFacts::default();
        for id in 1..=3 {
            f.load.insert(id, RegionLoad { bytes: 10, writes_per_sec: 0, middle: None });
        }
        let mut rev = 0;
        let steps = plan(&rs, &live(), &f, T, 0);
        assert_eq!(steps.len(), 1, "a region takes part in one handoff at a time: {steps:?}");
        apply(&mut rs, &mut f, &steps, &mut rev);
        let run = f.running[0].clone();
        assert_eq!((run.handoff.source, run.handoff.target, run.handoff.kind), (2, 1, HandoffKind::Merge));
        f.done.insert(2, run.create);
        let steps = plan(&rs, &live(), &f, T, 0);
        apply(&mut rs, &mut f, &steps, &mut rev);
        assert_eq!(rs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!((rs[0].end.clone(), rs[0].epoch), (Some(b"p".to_vec()), 2));
        // Merges off: nothing.
        let off = Thresholds { merge_bytes: 0, ..T };
        assert_eq!(plan(&rs, &live(), &f, off, 0), vec![]);
    }

    #[test]
    fn loads_round_trip_and_garbage_is_ignored() {
        let l = RegionLoad { bytes: 7, writes_per_sec: 3, middle: Some(vec![0, 255]) };
        assert_eq!(RegionLoad::decode(&l.encode()), Some(l));
        assert_eq!(RegionLoad::decode(b"bytes=x"), None);
        assert_eq!(RegionLoad::decode(b"middle=abc"), None);
    }
}
