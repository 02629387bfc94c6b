//! The cluster's event log (docs/cluster.md §12): what the master saw happen — nodes joining and
//! lost, failovers with their duration, primary handovers, splits, merges, drains, step-downs,
//! backups, restores — kept in the metadata store under `events/<seq>` for the console and
//! operators.
//!
//! The master derives events by comparing each round's snapshot with the previous round's
//! ([`Recorder::observe`], a pure function, model-tested), so no decision path has to remember
//! to log, and a change made by anyone (a node's lease ending, an operator's request) is seen.
//! A master that takes over seeds its recorder from the stored log: sequence numbers go on, and
//! a node the old master recorded lost keeps its loss time, so the failover that follows still
//! has its duration.
//!
//! A failover's duration runs from the round in which the master first saw the primary's
//! registration gone (its lease ended: at most the lease TTL after the node died) to the round
//! in which it saw another node lead the region. The outage clients saw is at most the lease TTL
//! longer (docs/cluster.md §5).
//!
//! Bounds: about [`KEEP`] events are stored (writing event `n` deletes the events up to
//! `n - KEEP`, those dropped unwritten too, in transactions of at most [`MAX_TXN_OPS`]
//! operations fenced by the master's key; a write cut short leaves at most that many more); an
//! event is at most a few hundred bytes (a split's key is cut to [`MAX_KEY_SHOWN`] bytes); a
//! master that cannot write keeps at most [`KEEP`] unwritten events and drops the oldest past
//! that. Writing events is best effort: it never fails a round.
//!
//! Keys and backup locations are kept out of an event's `detail` (in `key_hex`, `location`):
//! who may see them is the reader's grant (the console shows them per token).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::keys::Keys;
use crate::master::Snapshot;
use crate::meta::{Compare, MetaStore, Result, Txn, TxnOp};

/// Events kept in the store.
pub const KEEP: u64 = 256;

/// The most bytes of a split's key an event keeps.
pub const MAX_KEY_SHOWN: usize = 48;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The first regions were laid out.
    Layout,
    /// A node registered (`node`).
    NodeJoined,
    /// A node's registration ended (`node`): it died, or its lease ran out.
    NodeLost,
    /// A region (`region`) whose primary (`node`) was lost is led by another node (`to`), after
    /// `duration_ms`.
    Failover,
    /// A region's (`region`) primary moved from a live node (`node`) to another (`to`): a
    /// drain, a step-down, a rebalance.
    Handover,
    /// A region (`region`) gave the upper part of its range to a new region (`to`).
    Split,
    /// A region (`region`) was merged into its left neighbour (`to`).
    Merge,
    /// A node (`node`) was asked to drain.
    DrainRequested,
    /// A node's (`node`) drain ended (done, or cancelled).
    DrainEnded,
    /// A node (`node`) was asked to step down.
    StepDownRequested,
    /// A node's (`node`) step-down ended.
    StepDownEnded,
    /// A backup finished (`duration_ms` from its cut to its manifest).
    Backup,
    /// A restore began.
    RestoreStarted,
    /// The restore under way ended (finished or abandoned).
    RestoreEnded,
    /// A kind this build does not know (written by a newer master).
    #[serde(other)]
    Other,
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Its number: larger is later (never reused within a cluster's log).
    pub seq: u64,
    /// When the master saw it (Unix milliseconds, the master's clock).
    pub unix_ms: u64,
    /// What happened.
    pub kind: Kind,
    /// The node it is about, if one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// The region it is about, if one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<u32>,
    /// Where something went: the new primary (failover, handover), the new region (split), the
    /// region merged into (merge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<u32>,
    /// How long it took (failover: from the primary seen lost to another node leading; backup:
    /// cut to manifest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// A split's key, in hex (kept out of `detail`: who may see a key is the reader's grant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_hex: Option<String>,
    /// A backup's location (kept out of `detail`: for administrators).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// A sentence for people, naming no key and no location.
    pub detail: String,
}

impl Event {
    /// The stored form (JSON: readable with `etcdctl get --prefix`).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The event stored as `b`, if it is one.
    pub fn decode(b: &[u8]) -> Option<Event> {
        serde_json::from_slice(b).ok()
    }
}

/// A region as the recorder compares it: (start, end, primary).
type Span = (Vec<u8>, Option<Vec<u8>>, u32);

/// The most operations one write transaction holds (etcd refuses more than 128 by default,
/// `--max-txn-ops`; the fence is a compare, not an operation).
pub const MAX_TXN_OPS: usize = 120;

/// What the recorder compares between rounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct View {
    nodes: BTreeSet<u32>,
    /// Each live node's lease: a new one means the node re-registered (it was lost in between).
    leases: BTreeMap<u32, i64>,
    /// id -> (start, end, primary)
    regions: BTreeMap<u32, Span>,
    draining: BTreeSet<u32>,
    stepping_down: BTreeSet<u32>,
    last_backup: Option<String>,
    restoring: bool,
}

impl View {
    fn of(snap: &Snapshot) -> View {
        View {
            nodes: snap.map.nodes.iter().map(|n| n.id).collect(),
            leases: snap.node_leases.iter().map(|(n, (l, _))| (*n, *l)).collect(),
            regions: snap.map.regions.iter().map(|r| (r.id, (r.start.clone(), r.end.clone(), r.primary))).collect(),
            draining: snap.facts.draining.clone(),
            stepping_down: snap.facts.stepping_down.clone(),
            last_backup: snap.last_backup.as_ref().map(|b| b.id.clone()),
            restoring: snap.restore.is_some(),
        }
    }
}

/// The region whose range holds `key` past its own start (a split's parent before it, a merged
/// region's neighbour after it).
fn strictly_inside(regions: &BTreeMap<u32, Span>, key: &[u8]) -> Option<u32> {
    regions.iter().find(|(_, (s, e, _))| s.as_slice() < key && e.as_deref().is_none_or(|e| key < e)).map(|(id, _)| *id)
}

/// Derives events from the master's successive snapshots (see the module's summary).
#[derive(Debug, Default)]
pub struct Recorder {
    prev: Option<View>,
    /// Nodes seen lost and not back: when (Unix ms).
    lost_at: HashMap<u32, u64>,
    next_seq: u64,
    seeded: bool,
    /// Events observed and not stored yet (at most [`KEEP`]).
    unwritten: Vec<Event>,
    /// Every event numbered below this is deleted (or never was stored).
    trimmed: u64,
}

impl Recorder {
    /// Whether [`Recorder::seed`] ran (the master observes only after it: sequence numbers go on
    /// from the stored log's).
    pub fn seeded(&self) -> bool {
        self.seeded
    }

    /// Takes up the stored log (oldest first): numbers continue after its last, and nodes it
    /// last recorded lost (and not back) keep their loss times.
    pub fn seed(&mut self, stored: &[Event]) {
        self.trimmed = stored.first().map_or(0, |e| e.seq);
        for e in stored {
            self.next_seq = self.next_seq.max(e.seq + 1);
            match (e.kind, e.node) {
                (Kind::NodeLost, Some(n)) => {
                    self.lost_at.insert(n, e.unix_ms);
                }
                (Kind::NodeJoined, Some(n)) => {
                    self.lost_at.remove(&n);
                }
                _ => {}
            }
        }
        self.seeded = true;
    }

    fn push(&mut self, out: &mut Vec<Event>, now_ms: u64, kind: Kind, detail: String) -> usize {
        out.push(Event {
            seq: self.next_seq,
            unix_ms: now_ms,
            kind,
            node: None,
            region: None,
            to: None,
            duration_ms: None,
            key_hex: None,
            location: None,
            detail,
        });
        self.next_seq += 1;
        out.len() - 1
    }

    /// The events between the previous snapshot observed and `snap`, seen at `now_ms`. The
    /// first snapshot yields only the losses it shows (primaries not registered that no stored
    /// event recorded lost) — what a master that died with them could not record.
    pub fn observe(&mut self, snap: &Snapshot, now_ms: u64) -> Vec<Event> {
        let now = View::of(snap);
        let mut out = Vec::new();
        let Some(prev) = self.prev.take() else {
            let dead: BTreeSet<u32> = now
                .regions
                .values()
                .map(|r| r.2)
                .filter(|p| *p != 0 && !now.nodes.contains(p) && !self.lost_at.contains_key(p))
                .collect();
            for n in dead {
                let i = self.push(
                    &mut out,
                    now_ms,
                    Kind::NodeLost,
                    format!("node {n} is not registered (it leads regions)"),
                );
                out[i].node = Some(n);
                self.lost_at.insert(n, now_ms);
            }
            self.prev = Some(now);
            return out;
        };
        if prev.regions.is_empty() && !now.regions.is_empty() {
            let text = format!("{} regions laid out on {} nodes", now.regions.len(), now.nodes.len());
            self.push(&mut out, now_ms, Kind::Layout, text);
        }
        // Nodes that registered again under a new lease since the last snapshot were lost in
        // between, unseen: recorded lost now, then back.
        let relived: Vec<u32> = now
            .leases
            .iter()
            .filter(|(n, l)| prev.leases.get(n).is_some_and(|p| p != *l) && prev.nodes.contains(n))
            .map(|(n, _)| *n)
            .collect();
        for &n in prev.nodes.difference(&now.nodes).chain(&relived) {
            let i = self.push(&mut out, now_ms, Kind::NodeLost, format!("node {n}'s registration ended"));
            out[i].node = Some(n);
            self.lost_at.insert(n, now_ms);
        }
        // Who was lost before this snapshot's rejoins: a primary that moved away from one is a
        // failover even if the node is back by now.
        let lost_before = self.lost_at.clone();
        for &n in now.nodes.difference(&prev.nodes).chain(&relived) {
            let back = self.lost_at.remove(&n).map(|t| format!(" ({} ms after it was lost)", now_ms.saturating_sub(t)));
            let text = format!("node {n} registered{}", back.unwrap_or_default());
            let i = self.push(&mut out, now_ms, Kind::NodeJoined, text);
            out[i].node = Some(n);
        }
        // Primaries that changed, in region order.
        for (id, (_, _, primary)) in &now.regions {
            let Some((_, _, old)) = prev.regions.get(id) else { continue };
            if old == primary || *primary == 0 {
                continue;
            }
            let i = if *old != 0 && (!now.nodes.contains(old) || lost_before.contains_key(old)) {
                let took = lost_before.get(old).map(|t| now_ms.saturating_sub(*t));
                let text = match took {
                    Some(ms) => format!("region {id}: node {primary} leads, {ms} ms after node {old} was lost"),
                    None => format!("region {id}: node {primary} leads (node {old} was lost)"),
                };
                let i = self.push(&mut out, now_ms, Kind::Failover, text);
                out[i].duration_ms = took;
                i
            } else {
                self.push(
                    &mut out,
                    now_ms,
                    Kind::Handover,
                    format!("region {id}: primary moved from node {old} to node {primary}"),
                )
            };
            out[i].node = Some(*old).filter(|o| *o != 0);
            out[i].region = Some(*id);
            out[i].to = Some(*primary);
        }
        // New regions inside an old one's range: splits; regions gone: merges.
        for (id, (start, _, _)) in now.regions.range(..).filter(|(id, _)| !prev.regions.contains_key(id)) {
            if prev.regions.is_empty() {
                break; // the first layout
            }
            let parent = strictly_inside(&prev.regions, start);
            let text = match parent {
                Some(p) => format!("region {p} split: the upper part of its range is region {id}"),
                None => format!("region {id} appeared"),
            };
            let i = self.push(&mut out, now_ms, Kind::Split, text);
            out[i].region = parent;
            out[i].to = Some(*id);
            out[i].key_hex = Some(crate::keys::hex(&start[..start.len().min(MAX_KEY_SHOWN)]));
        }
        for (id, (start, _, _)) in prev.regions.iter().filter(|(id, _)| !now.regions.contains_key(id)) {
            if now.regions.is_empty() {
                break;
            }
            // Merged into its left neighbour: the region that now holds its start.
            let into = strictly_inside(&now.regions, start);
            let text = match into {
                Some(n) => format!("region {id} merged into region {n}"),
                None => format!("region {id} is gone"),
            };
            let i = self.push(&mut out, now_ms, Kind::Merge, text);
            out[i].region = Some(*id);
            out[i].to = into;
        }
        let sets = [
            (&prev.draining, &now.draining, Kind::DrainRequested, Kind::DrainEnded, "drain"),
            (&prev.stepping_down, &now.stepping_down, Kind::StepDownRequested, Kind::StepDownEnded, "step-down"),
        ];
        for (before, after, started, ended, what) in sets {
            for &n in after.difference(before) {
                let i = self.push(&mut out, now_ms, started, format!("node {n}: {what} requested"));
                out[i].node = Some(n);
            }
            for &n in before.difference(after) {
                let i = self.push(&mut out, now_ms, ended, format!("node {n}: {what} ended"));
                out[i].node = Some(n);
            }
        }
        if now.last_backup != prev.last_backup
            && let Some(b) = &snap.last_backup
        {
            let text = format!("backup {}: {} bytes, {} uploaded", b.id, b.bytes, b.uploaded);
            let i = self.push(&mut out, now_ms, Kind::Backup, text);
            out[i].duration_ms = Some(b.took_ms);
            out[i].location = Some(b.to.chars().take(256).collect());
        }
        if now.restoring != prev.restoring {
            let (kind, text) = if now.restoring {
                (Kind::RestoreStarted, "a restore began: the cluster serves none of its regions until it ends")
            } else {
                (Kind::RestoreEnded, "the restore ended")
            };
            self.push(&mut out, now_ms, kind, text.to_string());
        }
        self.prev = Some(now);
        out
    }

    /// Queues `events` to be written (dropping the oldest unwritten past [`KEEP`]).
    pub fn queue(&mut self, events: Vec<Event>) {
        self.unwritten.extend(events);
        let over = self.unwritten.len().saturating_sub(KEEP as usize);
        self.unwritten.drain(..over);
    }

    /// Writes the queued events under the master's `fence`, oldest first, in transactions of at
    /// most [`MAX_TXN_OPS`] operations, deleting every event [`KEEP`] or more before the newest
    /// written (events dropped from the queue too); what the store refuses or does not answer
    /// stays queued.
    pub async fn write<S: MetaStore>(&mut self, s: &S, keys: &Keys, fence: &Compare) -> Result<()> {
        while !self.unwritten.is_empty() {
            let mut then = Vec::new();
            let mut took = 0;
            let mut trimmed = self.trimmed;
            for e in &self.unwritten {
                if then.len() >= MAX_TXN_OPS {
                    break;
                }
                then.push(TxnOp::Put { key: keys.event(e.seq), value: e.encode(), lease: None });
                took += 1;
                // The deletes its number makes due (as many as fit; the rest with the next).
                while trimmed + KEEP <= e.seq && then.len() < MAX_TXN_OPS {
                    then.push(TxnOp::Delete { key: keys.event(trimmed) });
                    trimmed += 1;
                }
            }
            let t = s.txn(Txn { when: vec![fence.clone()], then, otherwise: vec![] }).await?;
            if !t.succeeded {
                return Ok(()); // not master any more: whoever is goes on
            }
            self.unwritten.drain(..took);
            self.trimmed = trimmed;
        }
        Ok(())
    }
}

/// The stored log, oldest first (entries that do not parse are skipped).
pub async fn load<S: MetaStore>(s: &S, keys: &Keys) -> Result<Vec<Event>> {
    let (kvs, _) = s.range(&keys.events()).await?;
    let mut out: Vec<Event> = kvs.iter().filter_map(|kv| Event::decode(&kv.value)).collect();
    out.sort_by_key(|e| e.seq);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dpukv_proto::regionmap::{NodeInfo, RegionInfo, RegionMap};

    fn node(id: u32) -> NodeInfo {
        NodeInfo {
            id,
            device: format!("d{id}"),
            replication: String::new(),
            admin: String::new(),
            zone: String::new(),
            fabric: String::new(),
        }
    }

    fn region(id: u32, start: &[u8], end: Option<&[u8]>, primary: u32) -> RegionInfo {
        RegionInfo {
            id,
            start: start.to_vec(),
            end: end.map(<[u8]>::to_vec),
            primary,
            backups: vec![],
            joining: vec![],
            epoch: 1,
            state: dpukv_proto::regionmap::RegionState::Serving,
        }
    }

    fn snap(nodes: &[u32], regions: Vec<RegionInfo>) -> Snapshot {
        Snapshot {
            map: RegionMap { nodes: nodes.iter().map(|&n| node(n)).collect(), regions, ..RegionMap::default() },
            ..Snapshot::default()
        }
    }

    fn kinds(e: &[Event]) -> Vec<Kind> {
        e.iter().map(|e| e.kind).collect()
    }

    #[test]
    fn a_lost_primary_then_its_successor_is_a_failover_with_its_duration() {
        let mut r = Recorder::default();
        r.seed(&[]);
        let two = vec![region(1, b"", Some(b"m"), 1), region(2, b"m", None, 2)];
        assert!(r.observe(&snap(&[1, 2, 3], two.clone()), 1_000).is_empty());
        let lost = r.observe(&snap(&[2, 3], two), 3_000);
        assert_eq!(kinds(&lost), [Kind::NodeLost]);
        assert_eq!(lost[0].node, Some(1));
        let moved = vec![region(1, b"", Some(b"m"), 3), region(2, b"m", None, 2)];
        let e = r.observe(&snap(&[2, 3], moved.clone()), 3_800);
        assert_eq!(kinds(&e), [Kind::Failover]);
        assert_eq!((e[0].node, e[0].region, e[0].to, e[0].duration_ms), (Some(1), Some(1), Some(3), Some(800)));
        assert_eq!((lost[0].seq, e[0].seq), (0, 1));
        // Nothing changed: nothing to say.
        assert!(r.observe(&snap(&[2, 3], moved.clone()), 4_000).is_empty());
        // The node comes back; then a live primary moves: a handover.
        assert_eq!(kinds(&r.observe(&snap(&[1, 2, 3], moved), 5_000)), [Kind::NodeJoined]);
        let back = vec![region(1, b"", Some(b"m"), 1), region(2, b"m", None, 2)];
        let e = r.observe(&snap(&[1, 2, 3], back), 6_000);
        assert_eq!(kinds(&e), [Kind::Handover]);
        assert_eq!((e[0].node, e[0].to), (Some(3), Some(1)));
    }

    #[test]
    fn a_new_master_records_the_loss_the_old_one_died_with_and_continues_the_numbers() {
        let stored = vec![Event {
            seq: 41,
            unix_ms: 10,
            kind: Kind::NodeJoined,
            node: Some(1),
            region: None,
            to: None,
            duration_ms: None,
            key_hex: None,
            location: None,
            detail: String::new(),
        }];
        let mut r = Recorder::default();
        r.seed(&stored);
        let regions = vec![region(1, b"", None, 1)];
        let e = r.observe(&snap(&[2, 3], regions), 2_000);
        assert_eq!(kinds(&e), [Kind::NodeLost]);
        assert_eq!((e[0].seq, e[0].node), (42, Some(1)));
        let e = r.observe(&snap(&[2, 3], vec![region(1, b"", None, 2)]), 2_500);
        assert_eq!(e[0].duration_ms, Some(500));
        // A loss already in the log keeps its time across masters.
        let lost = Event { seq: 50, unix_ms: 100, kind: Kind::NodeLost, node: Some(7), ..stored[0].clone() };
        let mut r = Recorder::default();
        r.seed(&[lost]);
        assert!(r.observe(&snap(&[2], vec![region(1, b"", None, 7)]), 400).is_empty());
        let e = r.observe(&snap(&[2], vec![region(1, b"", None, 2)]), 900);
        assert_eq!((e[0].kind, e[0].duration_ms, e[0].seq), (Kind::Failover, Some(800), 51));
    }

    #[test]
    fn splits_merges_drains_and_the_layout_are_recorded() {
        let mut r = Recorder::default();
        r.seed(&[]);
        assert!(r.observe(&snap(&[1], vec![]), 0).is_empty());
        assert_eq!(kinds(&r.observe(&snap(&[1], vec![region(1, b"", None, 1)]), 1)), [Kind::Layout]);
        let split = vec![region(1, b"", Some(b"k"), 1), region(2, b"k", None, 1)];
        let e = r.observe(&snap(&[1], split), 2);
        assert_eq!(kinds(&e), [Kind::Split]);
        assert_eq!((e[0].region, e[0].to), (Some(1), Some(2)));
        assert_eq!(e[0].key_hex.as_deref(), Some("6b"), "the key, in hex");
        // A split of the right-hand region: its parent, not a region left of it.
        let again = vec![region(1, b"", Some(b"k"), 1), region(2, b"k", Some(b"t"), 1), region(3, b"t", None, 1)];
        let e = r.observe(&snap(&[1], again), 3);
        assert_eq!((e[0].kind, e[0].region, e[0].to), (Kind::Split, Some(2), Some(3)));
        let e = r.observe(&snap(&[1], vec![region(1, b"", Some(b"k"), 1), region(2, b"k", None, 1)]), 3);
        assert_eq!((e[0].kind, e[0].region, e[0].to), (Kind::Merge, Some(3), Some(2)));
        let e = r.observe(&snap(&[1], vec![region(1, b"", None, 1)]), 3);
        assert_eq!(kinds(&e), [Kind::Merge]);
        assert_eq!((e[0].region, e[0].to), (Some(2), Some(1)));
        let mut s = snap(&[1], vec![region(1, b"", None, 1)]);
        s.facts.draining.insert(1);
        assert_eq!(kinds(&r.observe(&s, 4)), [Kind::DrainRequested]);
        s.facts.draining.clear();
        s.facts.stepping_down.insert(1);
        assert_eq!(kinds(&r.observe(&s, 5)), [Kind::DrainEnded, Kind::StepDownRequested]);
    }

    #[test]
    fn the_queue_is_bounded_and_events_round_trip() {
        let mut r = Recorder::default();
        let e = Event {
            seq: 0,
            unix_ms: 1,
            kind: Kind::Backup,
            node: None,
            region: None,
            to: None,
            duration_ms: Some(5),
            key_hex: None,
            location: None,
            detail: "x".into(),
        };
        r.queue((0..KEEP + 10).map(|i| Event { seq: i, ..e.clone() }).collect());
        assert_eq!(r.unwritten.len(), KEEP as usize);
        assert_eq!(r.unwritten[0].seq, 10);
        assert_eq!(Event::decode(&e.encode()), Some(e.clone()));
        assert_eq!(
            Event::decode(br#"{"seq":1,"unix_ms":2,"kind":"new_kind","detail":""}"#).map(|e| e.kind),
            Some(Kind::Other)
        );
        assert_eq!(Event::decode(b"garbage"), None);
    }

    #[tokio::test]
    async fn the_store_keeps_the_last_events_only() {
        let s = crate::MemStore::new();
        let keys = Keys::new("c").expect("keys");
        s.put(&keys.master(), b"me", None).await.expect("store");
        let fence = Compare::Value(keys.master(), b"me".to_vec());
        let mut r = Recorder::default();
        let e = Event {
            seq: 0,
            unix_ms: 1,
            kind: Kind::Backup,
            node: None,
            region: None,
            to: None,
            duration_ms: None,
            key_hex: None,
            location: None,
            detail: String::new(),
        };
        for batch in 0..3u64 {
            r.queue((0..200).map(|i| Event { seq: batch * 200 + i, ..e.clone() }).collect());
            r.write(&s, &keys, &fence).await.expect("store");
        }
        let stored = load(&s, &keys).await.expect("store");
        assert_eq!(stored.len(), KEEP as usize);
        assert_eq!((stored[0].seq, stored.last().expect("one").seq), (600 - KEEP, 599));
        // Not master any more: nothing written, the events stay queued.
        s.delete(&keys.master()).await.expect("store");
        r.queue(vec![Event { seq: 600, ..e }]);
        r.write(&s, &keys, &fence).await.expect("store");
        assert_eq!(r.unwritten.len(), 1);
        assert_eq!(load(&s, &keys).await.expect("load").len(), KEEP as usize);
    }

    #[test]
    fn a_primary_lost_and_back_by_the_next_snapshot_still_failed_over() {
        let mut r = Recorder::default();
        r.seed(&[]);
        let led = |p| vec![region(1, b"", None, p)];
        let mut s = snap(&[1, 2], led(1));
        s.node_leases.insert(1, (10, 1));
        s.node_leases.insert(2, (20, 1));
        assert!(r.observe(&s, 0).is_empty());
        // Lost, seen lost.
        let mut lost = snap(&[2], led(1));
        lost.node_leases.insert(2, (20, 1));
        assert_eq!(kinds(&r.observe(&lost, 100)), [Kind::NodeLost]);
        // Back under a new lease in the same snapshot that shows the new primary.
        let mut back = snap(&[1, 2], led(2));
        back.node_leases.insert(1, (11, 5));
        back.node_leases.insert(2, (20, 1));
        let e = r.observe(&back, 400);
        assert_eq!(kinds(&e), [Kind::NodeJoined, Kind::Failover], "{e:?}");
        assert_eq!(e[1].duration_ms, Some(300));
        // Lost and back between two snapshots, never seen lost: its new lease tells.
        let mut again = snap(&[1, 2], led(1));
        again.node_leases.insert(1, (11, 5));
        again.node_leases.insert(2, (21, 9));
        let e = r.observe(&again, 900);
        assert_eq!(kinds(&e), [Kind::NodeLost, Kind::NodeJoined, Kind::Failover], "{e:?}");
    }

    #[test]
    fn split_keys_and_backup_locations_stay_out_of_the_text() {
        let mut r = Recorder::default();
        r.seed(&[]);
        assert!(r.observe(&snap(&[1], vec![region(1, b"", None, 1)]), 0).is_empty());
        let e = r.observe(&snap(&[1], vec![region(1, b"", Some(b"secret"), 1), region(2, b"secret", None, 1)]), 1);
        assert_eq!(e[0].key_hex.as_deref(), Some(crate::keys::hex(b"secret").as_str()));
        assert!(!e[0].detail.contains("secret"), "{}", e[0].detail);
    }

    #[tokio::test]
    async fn many_events_are_written_in_transactions_etcd_takes() {
        let s = crate::MemStore::new();
        let keys = Keys::new("c").expect("keys");
        s.put(&keys.master(), b"me", None).await.expect("store");
        let fence = Compare::Value(keys.master(), b"me".to_vec());
        let mut r = Recorder::default();
        r.seed(&[]);
        let e = Event {
            seq: 0,
            unix_ms: 1,
            kind: Kind::NodeLost,
            node: Some(1),
            region: None,
            to: None,
            duration_ms: None,
            key_hex: None,
            location: None,
            detail: String::new(),
        };
        // A node leading 300 regions lost at once, after the log already went round.
        r.queue((0..KEEP).map(|i| Event { seq: i, ..e.clone() }).collect());
        r.write(&s, &keys, &fence).await.expect("write");
        r.queue((KEEP..KEEP + 300).map(|i| Event { seq: i, ..e.clone() }).collect());
        r.write(&s, &keys, &fence).await.expect("every transaction within etcd's limit");
        let stored = load(&s, &keys).await.expect("load");
        assert_eq!(stored.last().map(|e| e.seq), Some(KEEP + 299));
        assert!(stored.len() <= KEEP as usize + MAX_TXN_OPS, "{}", stored.len());
    }
}
