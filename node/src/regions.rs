//! The region map a node routes and checks requests by: the cluster's map
//! (`dpukv_proto::regionmap`) and which node this is — a region is *served* here when this node
//! is its primary. The host publishes it in the shared directory (module `pod`); the device reads
//! it from there, so both route keys alike and both check a request's region and epoch against
//! it. A node that is not part of a cluster serves every region of a static map (node 1).

use std::ops::Range;

use anyhow::{Context, Result, bail};
use dpukv_proto::regionmap::{self, NodeInfo, RegionInfo};
use dpukv_proto::{ErrorCode, Op, Request};

/// A region's id and range (`end` None: unbounded), what a data directory is pinned to.
type Range3 = (u32, Vec<u8>, Option<Vec<u8>>);

/// The node id of a node that is not part of a cluster.
pub const STANDALONE_NODE: u32 = 1;

/// The cluster's regions in key order, and this node's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionMap {
    map: regionmap::RegionMap,
    node: u32,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        bail!("odd-length hex {s:?}");
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).context("bad hex")).collect()
}

impl RegionMap {
    /// A standalone node's map: regions split at `keys` (ascending), ids 1..=keys.len() + 1,
    /// all served here (node 1), epoch 1.
    pub fn split_at(keys: &[Vec<u8>]) -> Result<RegionMap> {
        if keys.windows(2).any(|w| w[0] >= w[1]) || keys.iter().any(Vec::is_empty) {
            bail!("split keys must be non-empty and strictly ascending");
        }
        let regions = RegionInfo::split(keys, STANDALONE_NODE);
        let node = NodeInfo {
            id: STANDALONE_NODE,
            device: String::new(),
            replication: String::new(),
            admin: String::new(),
            zone: String::new(),
            fabric: String::new(),
        };
        RegionMap::new(regionmap::RegionMap { revision: 0, master: 0, regions, nodes: vec![node] }, STANDALONE_NODE)
    }

    /// The map of a cluster, as node `node` serves it.
    pub fn new(map: regionmap::RegionMap, node: u32) -> Result<RegionMap> {
        map.validate().context("an invalid region map")?;
        Ok(RegionMap { map, node })
    }

    /// The cluster's map.
    pub fn cluster(&self) -> &regionmap::RegionMap {
        &self.map
    }

    /// This node's id.
    pub fn node(&self) -> u32 {
        self.node
    }

    /// The regions, in key order.
    pub fn regions(&self) -> &[RegionInfo] {
        &self.map.regions
    }

    /// Whether this node serves (leads) the region at index `i`.
    pub fn serves(&self, i: usize) -> bool {
        self.map.regions.get(i).is_some_and(|r| r.primary == self.node)
    }

    /// Index of the region holding `key`.
    pub fn route(&self, key: &[u8]) -> usize {
        self.map.route(key)
    }

    /// Indexes of the regions that may hold keys in `[lo, hi]`.
    pub fn overlapping(&self, lo: &[u8], hi: &[u8]) -> Range<usize> {
        self.map.overlapping(lo, hi)
    }

    /// Binary form for the pod's announcement: this node's id, then the cluster map.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.node.to_le_bytes().to_vec();
        self.map.encode(&mut out);
        out
    }

    /// Parses [`RegionMap::encode`]'s output (the map is validated).
    pub fn decode(b: &[u8]) -> Result<RegionMap> {
        if b.len() < 4 {
            bail!("a region map announcement of {} bytes", b.len());
        }
        let node = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
        let map = regionmap::RegionMap::decode(&b[4..]).context("decoding the region map")?;
        RegionMap::new(map, node)
    }

    /// The ranges as text (`id<TAB>hex start<TAB>hex end or -` per line), what [`pin_to`]
    /// records.
    ///
    /// [`pin_to`]: RegionMap::pin_to
    fn ranges_text(&self) -> String {
        self.map
            .regions
            .iter()
            .map(|r| {
                let end = r.end.as_deref().map_or("-".to_string(), hex);
                format!("{}\t{}\t{}\n", r.id, hex(&r.start), end)
            })
            .collect()
    }

    fn parse_ranges(s: &str) -> Result<Vec<Range3>> {
        s.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|line| {
                let f: Vec<&str> = line.split('\t').collect();
                // Files written before epochs moved out of them have four fields (id, epoch,
                // start, end).
                let (id, start, end) = match f[..] {
                    [id, start, end] | [id, _, start, end] => (id, start, end),
                    _ => bail!("bad region line {line:?}"),
                };
                let end = if end == "-" { None } else { Some(unhex(end)?) };
                Ok((id.parse()?, unhex(start)?, end))
            })
            .collect()
    }

    fn ranges(&self) -> Vec<Range3> {
        self.map.regions.iter().map(|r| (r.id, r.start.clone(), r.end.clone())).collect()
    }

    /// Checks `self`'s ranges against those recorded in `data_dir` (`REGIONS`), recording them
    /// if the directory has none yet: a host must not reopen its regions' data under other ranges
    /// (keys of a region would become unreachable). Changing the ranges takes a region split or
    /// merge, which the cluster does.
    pub fn pin_to(&self, data_dir: &std::path::Path) -> Result<()> {
        let path = data_dir.join("REGIONS");
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                let recorded = RegionMap::parse_ranges(&s).with_context(|| format!("reading {}", path.display()))?;
                if recorded != self.ranges() {
                    let keys = |r: &[Range3]| {
                        r[1..].iter().map(|(_, s, _)| String::from_utf8_lossy(s).into_owned()).collect::<Vec<_>>()
                    };
                    bail!(
                        "{} was created with other regions (split keys {:?}, asked for {:?}); start with the \
                         same --split-keys, or use a new data directory",
                        data_dir.display(),
                        keys(&recorded),
                        keys(&self.ranges())
                    );
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
                dpukv_storage::fs::write_atomic(&dpukv_storage::fs::RealFs, &path, self.ranges_text().as_bytes())
                    .with_context(|| format!("writing {}", path.display()))
            }
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// The region a request addresses (index into the map), checked against the region and
    /// epoch the request names: `WrongRegion` if it names another region (or a batch spans
    /// regions) or this node does not serve the region, `StaleEpoch` if it knows another epoch
    /// of this one.
    pub fn check(&self, req: &Request) -> Result<usize, (ErrorCode, &'static str)> {
        let i = self.route(req.op.key());
        if matches!(req.op, Op::Batch { .. } | Op::AddTexts { .. }) && req.op.keys().any(|k| self.route(k) != i) {
            return Err((ErrorCode::WrongRegion, "a batch (or add_texts) must stay within one region"));
        }
        self.check_at(i, req.region, req.epoch)
    }

    /// [`RegionMap::check`] of a request on `key` naming `region` and `epoch` (0: any).
    pub fn check_key(&self, key: &[u8], region: u32, epoch: u64) -> Result<usize, (ErrorCode, &'static str)> {
        self.check_at(self.route(key), region, epoch)
    }

    fn check_at(&self, i: usize, region: u32, epoch: u64) -> Result<usize, (ErrorCode, &'static str)> {
        let spec = &self.map.regions[i];
        if region != 0 && region != spec.id {
            return Err((ErrorCode::WrongRegion, "the key is not in the region the request names"));
        }
        if epoch != 0 && epoch != spec.epoch {
            return Err((ErrorCode::StaleEpoch, "the region's epoch differs: refresh the region map"));
        }
        if spec.primary != self.node {
            return Err((ErrorCode::WrongRegion, "this node does not serve the region: refresh the region map"));
        }
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dpukv_proto::WriteOp;

    #[test]
    fn routes_and_round_trips() {
        let m = RegionMap::split_at(&[b"g".to_vec(), b"p".to_vec()]).expect("map");
        assert_eq!(m.route(b""), 0);
        assert_eq!(m.route(b"a"), 0);
        assert_eq!(m.route(b"g"), 1);
        assert_eq!(m.route(b"zz"), 2);
        assert_eq!(m.overlapping(b"a", b"h"), 0..2);
        assert_eq!(m.overlapping(b"z", b"a"), 0..0);
        assert_eq!(RegionMap::decode(&m.encode()).expect("decode"), m);
        assert!(RegionMap::decode(&[1, 0, 0, 0, 1]).is_err());
        let mut r = Request::new(1, Op::Get { key: b"h".to_vec() });
        assert_eq!(m.check(&r), Ok(1));
        r.region = 1;
        assert_eq!(m.check(&r).map_err(|e| e.0), Err(ErrorCode::WrongRegion));
        r.region = 2;
        r.epoch = 7;
        assert_eq!(m.check(&r).map_err(|e| e.0), Err(ErrorCode::StaleEpoch));
        r.epoch = 1;
        assert_eq!(m.check(&r), Ok(1));
        let b = Op::Batch { ops: vec![WriteOp::Delete { key: b"a".to_vec() }, WriteOp::Delete { key: b"z".to_vec() }] };
        assert_eq!(m.check(&Request::new(2, b)).map_err(|e| e.0), Err(ErrorCode::WrongRegion));
        let adds = |keys: &[&[u8]]| Op::AddTexts { adds: keys.iter().map(|k| (k.to_vec(), vec![1])).collect() };
        assert_eq!(m.check(&Request::new(2, adds(&[b"h", b"a"]))).map_err(|e| e.0), Err(ErrorCode::WrongRegion));
        assert_eq!(m.check(&Request::new(2, adds(&[b"h", b"i"]))), Ok(1), "an add_texts within one region");
        // A region another node leads is not served here.
        let mut cluster = m.cluster().clone();
        cluster.regions[1].primary = 2;
        let other = RegionMap::new(cluster, 1).expect("map");
        assert_eq!(
            other.check(&Request::new(3, Op::Get { key: b"h".to_vec() })).map_err(|e| e.0),
            Err(ErrorCode::WrongRegion)
        );
        assert_eq!(other.check(&Request::new(4, Op::Get { key: b"a".to_vec() })), Ok(0));
    }

    #[test]
    fn a_data_directory_keeps_its_regions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = RegionMap::split_at(&[b"g".to_vec()]).expect("map");
        m.pin_to(dir.path()).expect("first start records the map");
        m.pin_to(dir.path()).expect("the same map again");
        let other = RegionMap::split_at(&[b"m".to_vec()]).expect("map");
        let e = other.pin_to(dir.path()).expect_err("other split keys on the same data");
        assert!(e.to_string().contains("other regions"), "{e}");
        // Files from before (id, epoch, start, end) still pin.
        let old = tempfile::tempdir().expect("tempdir");
        std::fs::write(old.path().join("REGIONS"), "1\t1\t\t67\n2\t1\t67\t-\n").expect("write");
        m.pin_to(old.path()).expect("an old REGIONS file with the same ranges");
    }
}
