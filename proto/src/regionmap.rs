//! The cluster's region map as it is stored (in etcd) and sent (to clients and gateways): nodes,
//! regions with their primary, backups and epoch, and the routing of keys to regions — the one
//! routing implementation every client, gateway and node uses.
//!
//! Encodings are binary, each starting with its format byte ([`MAP_FORMAT`]); decoding checks
//! every length against the limits here and returns a typed [`MapError`], never panics.
//! A [`RegionMap`] is valid when its regions are in key order and cover every key exactly once
//! (first start empty, each end the next start, last end unbounded).

use std::ops::Range;

/// Format of every encoding in this module.
pub const MAP_FORMAT: u8 = 1;
/// Format 1 with each node's fabric endpoint after its zone ([`NodeInfo::fabric`]): what a node
/// record, or a map, is written in when a node has one (decoders read both).
pub const MAP_FORMAT_FABRIC: u8 = 2;
/// Most regions in a map.
pub const MAX_REGIONS: usize = 1 << 16;
/// Most nodes in a map.
pub const MAX_NODES: usize = 4096;
/// Most backups of a region (replication factor - 1).
pub const MAX_BACKUPS: usize = 8;
/// Longest address or zone name.
pub const MAX_ADDR: usize = 256;

/// Why bytes are not a valid node, region or map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// The bytes end early or carry extra bytes.
    #[error("truncated or padded region-map encoding")]
    Length,
    /// A format this version does not know.
    #[error("unknown region-map format {0}")]
    Format(u8),
    /// A field is out of its limits or inconsistent.
    #[error("invalid region map: {0}")]
    Invalid(String),
}

impl MapError {
    /// A stable code naming the error.
    pub fn code(&self) -> &'static str {
        match self {
            MapError::Length => "map_length",
            MapError::Format(_) => "map_format",
            MapError::Invalid(_) => "map_invalid",
        }
    }
}

type Result<T> = std::result::Result<T, MapError>;

/// A node of the cluster, as it registers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its id (unique in the cluster, never 0).
    pub id: u32,
    /// Where clients reach its device (reads and writes).
    pub device: String,
    /// Where primaries stream replication to its host.
    pub replication: String,
    /// Its host's control API (`/cluster/*`: what `dpukv cluster` calls), or — for a host
    /// without one — its admin endpoint (metrics, health).
    pub admin: String,
    /// Its failure domain ("" = none given).
    pub zone: String,
    /// Where clients reach its device over libfabric (`fabric://PROVIDER/HOST:PORT`; "" = none).
    pub fabric: String,
}

/// What is happening to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionState {
    /// Served by its primary, replicated to its backups.
    Serving = 1,
    /// Its primary is being handed to another node (drain, rebalance): writes are refused
    /// (retryable) until the new primary serves.
    Moving = 2,
    /// Handing the upper part of its range to a new region (a split, docs/cluster.md §9):
    /// writes to that part are refused (retryable) while it is copied.
    Splitting = 3,
    /// Handing its whole range to its left neighbour (a merge): its writes are refused
    /// (retryable) while it is copied.
    Merging = 4,
}

impl RegionState {
    fn from_u8(b: u8) -> Result<RegionState> {
        Ok(match b {
            1 => RegionState::Serving,
            2 => RegionState::Moving,
            3 => RegionState::Splitting,
            4 => RegionState::Merging,
            _ => return Err(MapError::Invalid(format!("region state {b}"))),
        })
    }

    /// Its name, as printed.
    pub fn name(self) -> &'static str {
        match self {
            RegionState::Serving => "serving",
            RegionState::Moving => "moving",
            RegionState::Splitting => "splitting",
            RegionState::Merging => "merging",
        }
    }
}

/// A region: keys in `[start, end)`, its primary and backups, and its epoch (bumped by every
/// change to its range or placement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Its id (never 0).
    pub id: u32,
    /// First key ("" for the first region).
    pub start: Vec<u8>,
    /// First key after it (None: the last region).
    pub end: Option<Vec<u8>>,
    /// The node that serves it (0: none yet).
    pub primary: u32,
    /// The nodes that hold copies (every acknowledged write is on each of them).
    pub backups: Vec<u32>,
    /// Nodes copying the region to become backups (catching up; not yet counted on for
    /// acknowledgements or promotion).
    pub joining: Vec<u32>,
    /// Bumped by every change (never 0).
    pub epoch: u64,
    /// What is happening to it.
    pub state: RegionState,
}

impl RegionInfo {
    /// Regions covering every key, split at `keys` (ascending): ids 1..=keys.len() + 1, led by
    /// `primary`, no backups, epoch 1, serving.
    pub fn split(keys: &[Vec<u8>], primary: u32) -> Vec<RegionInfo> {
        let mut regions = Vec::with_capacity(keys.len() + 1);
        let mut start = Vec::new();
        for (i, end) in keys.iter().map(Some).chain([None]).enumerate() {
            regions.push(RegionInfo {
                id: i as u32 + 1,
                start: std::mem::take(&mut start),
                end: end.cloned(),
                primary,
                backups: vec![],
                joining: vec![],
                epoch: 1,
                state: RegionState::Serving,
            });
            if let Some(e) = end {
                start = e.clone();
            }
        }
        regions
    }

    /// Whether `key` is in the region.
    pub fn contains(&self, key: &[u8]) -> bool {
        self.start.as_slice() <= key && self.end.as_deref().is_none_or(|e| key < e)
    }

    /// The largest key in the region (None: unbounded above), for inclusive scan bounds.
    pub fn last_key(&self) -> Option<Vec<u8>> {
        self.end.as_deref().map(key_before)
    }

    /// Every node holding the region or copying it, primary first.
    pub fn replicas(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.primary).chain(self.backups.iter().copied()).chain(self.joining.iter().copied())
    }
}

/// The largest key strictly before `end` (keys are at most [`MAX_KEY`](crate::limits::MAX_KEY)
/// bytes, so there is one): `end` without its last byte if that byte is 0, else `end` with its
/// last byte decremented and filled up with 0xff. Empty for an empty `end` (nothing is before it;
/// callers bound with it only after checking `end` is not empty).
pub fn key_before(end: &[u8]) -> Vec<u8> {
    let Some((&last, head)) = end.split_last() else { return Vec::new() };
    let mut k = head.to_vec();
    if last > 0 {
        k.push(last - 1);
        k.resize(crate::limits::MAX_KEY.max(k.len()), 0xff);
    }
    k
}

/// The key right after `k` in byte order: `k` followed by a zero byte.
pub fn key_after(k: &[u8]) -> Vec<u8> {
    let mut s = Vec::with_capacity(k.len() + 1);
    s.extend_from_slice(k);
    s.push(0);
    s
}

/// What a handoff does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffKind {
    /// The source's upper part goes to a new region.
    Split = 1,
    /// The whole source goes to its left neighbour.
    Merge = 2,
}

/// A range moving from one region to another while it runs (stored under `handoffs/<source>`,
/// docs/cluster.md §9): the source's primary refuses writes to `[start, end)`, copies it and the
/// source's exactly-once sessions into `target` (a new region, or the left neighbour), and
/// reports; the master then narrows (or removes) the source and widens (or creates) the target
/// in one transaction — or aborts, and the source serves the range again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The region giving the range.
    pub source: u32,
    /// The region receiving it.
    pub target: u32,
    /// First key moving.
    pub start: Vec<u8>,
    /// First key after it (None: unbounded).
    pub end: Option<Vec<u8>>,
    /// Split or merge.
    pub kind: HandoffKind,
    /// When the master started it (ms since the Unix epoch; it aborts one that takes too long).
    pub started_ms: u64,
}

impl Handoff {
    /// Whether `key` is in the moving range.
    pub fn contains(&self, key: &[u8]) -> bool {
        self.start.as_slice() <= key && self.end.as_deref().is_none_or(|e| key < e)
    }

    /// The region a split creates from `source`: the moving range, placed like the source,
    /// epoch 1, serving (what its primary leads while copying and what the commit writes).
    pub fn new_region(&self, source: &RegionInfo) -> RegionInfo {
        RegionInfo {
            id: self.target,
            start: self.start.clone(),
            end: self.end.clone(),
            primary: source.primary,
            backups: source.backups.clone(),
            joining: vec![],
            epoch: 1,
            state: RegionState::Serving,
        }
    }

    /// Encodes the record.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![MAP_FORMAT];
        out.extend_from_slice(&self.source.to_le_bytes());
        out.extend_from_slice(&self.target.to_le_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&self.started_ms.to_le_bytes());
        put_bytes(&mut out, &self.start);
        match &self.end {
            None => out.push(0),
            Some(e) => {
                out.push(1);
                put_bytes(&mut out, e);
            }
        }
        out
    }

    /// Decodes and checks a record.
    pub fn decode(b: &[u8]) -> Result<Handoff> {
        let mut r = Reader::new(b)?;
        let (source, target) = (r.u32()?, r.u32()?);
        let kind = match r.u8()? {
            1 => HandoffKind::Split,
            2 => HandoffKind::Merge,
            k => return Err(MapError::Invalid(format!("handoff kind {k}"))),
        };
        let started_ms = r.u64()?;
        let start = r.bytes(crate::limits::MAX_KEY)?;
        let end = match r.u8()? {
            0 => None,
            1 => Some(r.bytes(crate::limits::MAX_KEY)?),
            b => return Err(MapError::Invalid(format!("end marker {b}"))),
        };
        r.done()?;
        let h = Handoff { source, target, start, end, kind, started_ms };
        if source == 0 || target == 0 || source == target {
            return Err(MapError::Invalid(format!("handoff from region {source} to region {target}")));
        }
        if h.end.as_ref().is_some_and(|e| e.as_slice() <= h.start.as_slice()) {
            return Err(MapError::Invalid("a handoff's end is not after its start".into()));
        }
        Ok(h)
    }
}

/// The regions and the nodes serving them, read at one metadata revision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegionMap {
    /// The metadata revision it was read at (a newer map has a larger one).
    pub revision: u64,
    /// The node running the master (0: none known).
    pub master: u32,
    /// Regions in key order.
    pub regions: Vec<RegionInfo>,
    /// Live nodes, by id.
    pub nodes: Vec<NodeInfo>,
}

impl RegionMap {
    /// Checks that the regions cover every key once, in order, with valid fields.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(MapError::Invalid(m));
        let Some(first) = self.regions.first() else { return bad("no regions".into()) };
        if !first.start.is_empty() {
            return bad("the first region does not start at the empty key".into());
        }
        for w in self.regions.windows(2) {
            if w[0].end.as_deref() != Some(w[1].start.as_slice()) {
                return bad(format!("region {} does not end where region {} starts", w[0].id, w[1].id));
            }
        }
        let last = self.regions.last().expect("non-empty");
        if last.end.is_some() {
            return bad(format!("the last region ({}) is bounded", last.id));
        }
        let mut ids: Vec<u32> = self.regions.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return bad("two regions share an id".into());
        }
        for r in &self.regions {
            r.check()?;
        }
        Ok(())
    }

    /// Index of the region holding `key` (in a valid map).
    pub fn route(&self, key: &[u8]) -> usize {
        self.regions.partition_point(|r| r.start.as_slice() <= key).saturating_sub(1)
    }

    /// The region holding `key`.
    pub fn region_of(&self, key: &[u8]) -> Option<&RegionInfo> {
        self.regions.get(self.route(key))
    }

    /// Indexes of the regions that may hold keys in `[lo, hi]`.
    pub fn overlapping(&self, lo: &[u8], hi: &[u8]) -> Range<usize> {
        if lo > hi || self.regions.is_empty() {
            return 0..0;
        }
        self.route(lo)..self.route(hi) + 1
    }

    /// The region with this id.
    pub fn region(&self, id: u32) -> Option<&RegionInfo> {
        self.regions.iter().find(|r| r.id == id)
    }

    /// The node with this id.
    pub fn node(&self, id: u32) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// Encodes the map (regions and nodes): format 1, or 2 when a node has a fabric endpoint.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let format = if self.nodes.iter().any(|n| !n.fabric.is_empty()) { MAP_FORMAT_FABRIC } else { MAP_FORMAT };
        out.push(format);
        out.extend_from_slice(&self.revision.to_le_bytes());
        out.extend_from_slice(&self.master.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            r.encode_body(out);
        }
        out.extend_from_slice(&(self.nodes.len() as u32).to_le_bytes());
        for n in &self.nodes {
            n.encode_body(out, format);
        }
    }

    /// Decodes and validates a map.
    pub fn decode(b: &[u8]) -> Result<RegionMap> {
        let mut r = Reader::new(b)?;
        let revision = r.u64()?;
        let master = r.u32()?;
        let n = r.count(MAX_REGIONS)?;
        let regions = (0..n).map(|_| RegionInfo::decode_body(&mut r)).collect::<Result<Vec<_>>>()?;
        let n = r.count(MAX_NODES)?;
        let nodes = (0..n).map(|_| NodeInfo::decode_body(&mut r)).collect::<Result<Vec<_>>>()?;
        r.done()?;
        let map = RegionMap { revision, master, regions, nodes };
        map.validate()?;
        Ok(map)
    }
}

impl RegionInfo {
    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(MapError::Invalid(format!("region {}: {m}", self.id)));
        if self.id == 0 || self.epoch == 0 {
            return bad("id and epoch must not be 0".into());
        }
        if self.start.len() > crate::limits::MAX_KEY
            || self.end.as_ref().is_some_and(|e| e.len() > crate::limits::MAX_KEY)
        {
            return bad("a bound is longer than a key may be".into());
        }
        if self.end.as_ref().is_some_and(|e| e.as_slice() <= self.start.as_slice()) {
            return bad("its end is not after its start".into());
        }
        if self.backups.len() > MAX_BACKUPS || self.joining.len() > MAX_BACKUPS {
            return bad(format!("more than {MAX_BACKUPS} backups or joining nodes"));
        }
        let mut all: Vec<u32> = self.backups.iter().chain(&self.joining).copied().collect();
        if self.primary != 0 {
            all.push(self.primary);
        }
        if all.contains(&0) {
            return bad("a backup or joining node is node 0".into());
        }
        all.sort_unstable();
        if all.windows(2).any(|w| w[0] == w[1]) {
            return bad("a node holds two of its replicas".into());
        }
        Ok(())
    }

    fn encode_body(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.push(self.state as u8);
        put_bytes(out, &self.start);
        match &self.end {
            None => out.push(0),
            Some(e) => {
                out.push(1);
                put_bytes(out, e);
            }
        }
        out.extend_from_slice(&self.primary.to_le_bytes());
        for set in [&self.backups, &self.joining] {
            out.push(set.len() as u8);
            for b in set {
                out.extend_from_slice(&b.to_le_bytes());
            }
        }
    }

    fn decode_body(r: &mut Reader<'_>) -> Result<RegionInfo> {
        let id = r.u32()?;
        let epoch = r.u64()?;
        let state = RegionState::from_u8(r.u8()?)?;
        let start = r.bytes(crate::limits::MAX_KEY)?;
        let end = match r.u8()? {
            0 => None,
            1 => Some(r.bytes(crate::limits::MAX_KEY)?),
            b => return Err(MapError::Invalid(format!("end marker {b}"))),
        };
        let primary = r.u32()?;
        let mut set = || {
            let n = r.u8()? as usize;
            if n > MAX_BACKUPS {
                return Err(MapError::Invalid(format!("a set of {n} nodes (at most {MAX_BACKUPS})")));
            }
            (0..n).map(|_| r.u32()).collect::<Result<Vec<_>>>()
        };
        let (backups, joining) = (set()?, set()?);
        let region = RegionInfo { id, start, end, primary, backups, joining, epoch, state };
        region.check()?;
        Ok(region)
    }

    /// Encodes one region (as stored under `regions/<id>`).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![MAP_FORMAT];
        self.encode_body(&mut out);
        out
    }

    /// Decodes and checks one region.
    pub fn decode(b: &[u8]) -> Result<RegionInfo> {
        let mut r = Reader::new(b)?;
        let region = RegionInfo::decode_body(&mut r)?;
        r.done()?;
        Ok(region)
    }
}

impl NodeInfo {
    fn encode_body(&self, out: &mut Vec<u8>, format: u8) {
        out.extend_from_slice(&self.id.to_le_bytes());
        for s in [&self.device, &self.replication, &self.admin, &self.zone] {
            put_bytes(out, s.as_bytes());
        }
        if format >= MAP_FORMAT_FABRIC {
            put_bytes(out, self.fabric.as_bytes());
        }
    }

    fn decode_body(r: &mut Reader<'_>) -> Result<NodeInfo> {
        let id = r.u32()?;
        if id == 0 {
            return Err(MapError::Invalid("node id 0".into()));
        }
        let format = r.format;
        let mut s =
            || String::from_utf8(r.bytes(MAX_ADDR)?).map_err(|_| MapError::Invalid("an address is not UTF-8".into()));
        let (device, replication, admin, zone) = (s()?, s()?, s()?, s()?);
        let fabric = if format >= MAP_FORMAT_FABRIC { s()? } else { String::new() };
        Ok(NodeInfo { id, device, replication, admin, zone, fabric })
    }

    /// Encodes one node (as stored under `nodes/<id>`): format 1, or 2 with a fabric endpoint.
    pub fn encode(&self) -> Vec<u8> {
        let format = if self.fabric.is_empty() { MAP_FORMAT } else { MAP_FORMAT_FABRIC };
        let mut out = vec![format];
        self.encode_body(&mut out, format);
        out
    }

    /// Decodes one node.
    pub fn decode(b: &[u8]) -> Result<NodeInfo> {
        let mut r = Reader::new(b)?;
        let node = NodeInfo::decode_body(&mut r)?;
        r.done()?;
        Ok(node)
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

struct Reader<'a> {
    b: &'a [u8],
    /// The encoding's format byte.
    format: u8,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8]) -> Result<Reader<'a>> {
        let mut r = Reader { b, format: 0 };
        match r.u8()? {
            f @ (MAP_FORMAT | MAP_FORMAT_FABRIC) => {
                r.format = f;
                Ok(r)
            }
            f => Err(MapError::Format(f)),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(MapError::Length);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn bytes(&mut self, max: usize) -> Result<Vec<u8>> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as usize;
        if n > max {
            return Err(MapError::Invalid(format!("a field of {n} bytes (at most {max})")));
        }
        Ok(self.take(n)?.to_vec())
    }

    /// A count, checked against `max` and against the bytes left (each item takes at least 4),
    /// so a forged count cannot make the decoder reserve memory.
    fn count(&mut self, max: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(MapError::Invalid(format!("{n} items (at most {max})")));
        }
        if n > self.b.len() / 4 {
            return Err(MapError::Length);
        }
        Ok(n)
    }

    fn done(&self) -> Result<()> {
        if self.b.is_empty() { Ok(()) } else { Err(MapError::Length) }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn arb_map() -> impl Strategy<Value = RegionMap> {
        let bounds = prop::collection::btree_set(prop::collection::vec(any::<u8>(), 1..6), 0..8);
        let nodes = prop::collection::vec(("[a-z0-9.:]{0,20}", "[a-z]{0,4}", any::<bool>()), 1..6);
        (bounds, nodes, any::<u64>(), any::<u64>()).prop_map(|(bounds, nodes, revision, seed)| {
            let nodes: Vec<NodeInfo> = nodes
                .into_iter()
                .enumerate()
                .map(|(i, (addr, zone, fabric))| NodeInfo {
                    id: i as u32 + 1,
                    device: addr.clone(),
                    replication: format!("{addr}r"),
                    admin: format!("{addr}a"),
                    zone,
                    fabric: if fabric { format!("fabric://tcp/{addr}") } else { String::new() },
                })
                .collect();
            let mut starts = vec![Vec::new()];
            starts.extend(bounds);
            let n = nodes.len() as u64;
            let regions = (0..starts.len())
                .map(|i| {
                    let primary = (seed.wrapping_add(i as u64) % n) as u32 + 1;
                    let backups = (1..n.min(3)).map(|k| ((primary as u64 - 1 + k) % n) as u32 + 1).collect();
                    let joining =
                        if n > 3 && i % 2 == 0 { vec![((primary as u64 + 2) % n) as u32 + 1] } else { vec![] };
                    RegionInfo {
                        id: i as u32 + 1,
                        start: starts[i].clone(),
                        end: starts.get(i + 1).cloned(),
                        primary,
                        backups,
                        joining,
                        epoch: seed % 1000 + 1,
                        state: [
                            RegionState::Serving,
                            RegionState::Moving,
                            RegionState::Splitting,
                            RegionState::Merging,
                        ][i % 4],
                    }
                })
                .collect();
            RegionMap { revision, master: (seed % 3) as u32, regions, nodes }
        })
    }

    #[test]
    fn key_before_is_the_largest_key_before() {
        use crate::limits::MAX_KEY;
        assert_eq!(key_before(b"b\x00"), b"b".to_vec());
        let k = key_before(b"b");
        assert_eq!(k.len(), MAX_KEY);
        assert_eq!(k[0], b'a');
        assert!(k[1..].iter().all(|&x| x == 0xff));
        assert!(k.as_slice() < b"b".as_slice() && b"a\xff\xff".as_slice() <= k.as_slice());
        assert!(key_before(b"").is_empty());
    }

    proptest! {
        /// Handoff records round-trip; damaged ones are typed errors.
        #[test]
        fn handoffs_round_trip(source in 1u32..100, target in 1u32..100, start in prop::collection::vec(any::<u8>(), 0..6),
                               tail in prop::option::of(prop::collection::vec(any::<u8>(), 1..4)), merge in any::<bool>(),
                               started_ms in any::<u64>(), cut in any::<prop::sample::Index>()) {
            prop_assume!(source != target);
            let end = tail.map(|t| [start.clone(), t].concat());
            let kind = if merge { HandoffKind::Merge } else { HandoffKind::Split };
            let h = Handoff { source, target, start, end, kind, started_ms };
            let b = h.encode();
            prop_assert_eq!(Handoff::decode(&b).expect("decodes"), h);
            prop_assert!(Handoff::decode(&b[..cut.index(b.len())]).is_err());
        }

        /// `key_before(e)` is below `e`, and no key of at most MAX_KEY bytes lies between them.
        #[test]
        fn nothing_lies_between_key_before_and_its_end(e in prop::collection::vec(any::<u8>(), 1..5), k in prop::collection::vec(any::<u8>(), 0..6)) {
            let b = key_before(&e);
            prop_assert!(b < e);
            prop_assert!(!(b < k && k < e), "{:?} lies between {:?} and {:?}", k, b, e);
        }

        #[test]
        fn maps_round_trip(map in arb_map()) {
            map.validate().expect("generated maps are valid");
            let mut b = Vec::new();
            map.encode(&mut b);
            prop_assert_eq!(RegionMap::decode(&b).expect("decodes"), map.clone());
            // Format 2 only when a node has a fabric endpoint: maps of clusters without one
            // stay readable by format-1 decoders.
            let fabric = map.nodes.iter().any(|n| !n.fabric.is_empty());
            prop_assert_eq!(b[0], if fabric { MAP_FORMAT_FABRIC } else { MAP_FORMAT });
            for r in &map.regions {
                prop_assert_eq!(&RegionInfo::decode(&r.encode()).expect("region decodes"), r);
            }
            for n in &map.nodes {
                prop_assert_eq!(&NodeInfo::decode(&n.encode()).expect("node decodes"), n);
            }
        }

        /// Routing agrees with the obvious model: the one region whose range contains the key.
        #[test]
        fn routing_finds_the_one_region_holding_a_key(map in arb_map(), keys in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..6), 1..20)) {
            // Random keys, and every region's bounds (where an off-by-one would show).
            let bounds = map.regions.iter().flat_map(|r| std::iter::once(r.start.clone()).chain(r.end.clone()));
            for k in keys.iter().cloned().chain(bounds) {
                let k = &k;
                let holding: Vec<u32> = map.regions.iter().filter(|r| r.contains(k)).map(|r| r.id).collect();
                prop_assert_eq!(holding.len(), 1);
                prop_assert_eq!(map.region_of(k).map(|r| r.id), Some(holding[0]));
            }
            let (lo, hi) = (keys.iter().min().expect("a key"), keys.iter().max().expect("a key"));
            let model: Vec<usize> = (0..map.regions.len())
                .filter(|&i| {
                    let r = &map.regions[i];
                    r.end.as_deref().is_none_or(|e| lo.as_slice() < e) && r.start.as_slice() <= hi.as_slice()
                })
                .collect();
            prop_assert_eq!(map.overlapping(lo, hi).collect::<Vec<_>>(), model);
        }

        /// Truncations, flipped bytes and garbage are typed errors, never panics.
        #[test]
        fn damaged_encodings_are_typed_errors(map in arb_map(), cut in any::<prop::sample::Index>(), flip in any::<prop::sample::Index>(), garbage in prop::collection::vec(any::<u8>(), 0..200)) {
            let mut b = Vec::new();
            map.encode(&mut b);
            prop_assert!(RegionMap::decode(&b[..cut.index(b.len())]).is_err(), "a strict prefix never decodes");
            let mut f = b.clone();
            let i = flip.index(f.len());
            f[i] ^= 0x5a;
            if let Ok(m) = RegionMap::decode(&f) {
                m.validate().expect("whatever decodes is valid");
            }
            let _ = RegionMap::decode(&garbage);
            let _ = RegionInfo::decode(&garbage);
            let _ = NodeInfo::decode(&garbage);
        }
    }

    #[test]
    fn invalid_maps_are_refused_with_reasons() {
        let r = |id, start: &[u8], end: Option<&[u8]>| RegionInfo {
            id,
            start: start.to_vec(),
            end: end.map(<[u8]>::to_vec),
            primary: 1,
            backups: vec![2],
            joining: vec![],
            epoch: 1,
            state: RegionState::Serving,
        };
        let map = |regions| RegionMap { revision: 1, master: 0, regions, nodes: vec![] };
        assert!(map(vec![r(1, b"", Some(b"m")), r(2, b"m", None)]).validate().is_ok());
        for (bad, why) in [
            (map(vec![]), "no regions"),
            (map(vec![r(1, b"a", None)]), "does not start"),
            (map(vec![r(1, b"", Some(b"m")), r(2, b"n", None)]), "does not end where"),
            (map(vec![r(1, b"", Some(b"m"))]), "is bounded"),
            (map(vec![r(1, b"", Some(b"m")), r(1, b"m", None)]), "share an id"),
            (map(vec![RegionInfo { backups: vec![1], ..r(1, b"", None) }]), "two of its replicas"),
            (map(vec![RegionInfo { joining: vec![2], ..r(1, b"", None) }]), "two of its replicas"),
            (map(vec![RegionInfo { epoch: 0, ..r(1, b"", None) }]), "must not be 0"),
        ] {
            let e = bad.validate().expect_err(why);
            assert!(e.to_string().contains(why), "{e} should say {why:?}");
            assert_eq!(e.code(), "map_invalid");
        }
        assert_eq!(RegionMap::decode(&[9]), Err(MapError::Format(9)));
        assert_eq!(
            RegionMap::decode(&[MAP_FORMAT, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0]).map_err(|e| e.code()),
            Err("map_length")
        );
    }
}
