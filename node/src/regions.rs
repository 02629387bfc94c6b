//! The static region map of a node (until the cluster brings one from etcd): contiguous key
//! ranges with ids and epochs. The host publishes it in the shared directory (module `pod`); the
//! device reads it from there, so both route keys alike, and both check a request's region and
//! epoch against it.

use std::ops::Range;

use anyhow::{Context, Result, bail};
use dpukv_proto::{ErrorCode, Op, Request, WriteOp};

/// One region: keys in `[start, end)` (`end` None = unbounded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// Region id (also its directory name: `region-<id>`).
    pub id: u32,
    /// First key.
    pub start: Vec<u8>,
    /// First key after the region (None: the last region).
    pub end: Option<Vec<u8>>,
    /// Bumped whenever the region's range or placement changes (1 for a static map).
    pub epoch: u64,
}

/// Regions in key order, covering every key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionMap {
    regions: Vec<RegionSpec>,
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
    /// Regions split at `keys` (ascending): ids 1..=keys.len() + 1.
    pub fn split_at(keys: &[Vec<u8>]) -> Result<RegionMap> {
        if keys.windows(2).any(|w| w[0] >= w[1]) || keys.iter().any(Vec::is_empty) {
            bail!("split keys must be non-empty and strictly ascending");
        }
        let mut regions = Vec::new();
        let mut start = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            regions.push(RegionSpec { id: i as u32 + 1, start, end: Some(k.clone()), epoch: 1 });
            start = k.clone();
        }
        regions.push(RegionSpec { id: keys.len() as u32 + 1, start, end: None, epoch: 1 });
        Ok(RegionMap { regions })
    }

    /// The regions.
    pub fn regions(&self) -> &[RegionSpec] {
        &self.regions
    }

    /// Index of the region holding `key`.
    pub fn route(&self, key: &[u8]) -> usize {
        self.regions.partition_point(|r| r.start.as_slice() <= key).saturating_sub(1)
    }

    /// Indexes of the regions that may hold keys in `[lo, hi]`.
    pub fn overlapping(&self, lo: &[u8], hi: &[u8]) -> Range<usize> {
        if lo > hi {
            return 0..0;
        }
        self.route(lo)..self.route(hi) + 1
    }

    /// Text form: one `id<TAB>epoch<TAB>hex start<TAB>hex end or -` line per region.
    pub fn encode(&self) -> String {
        self.regions
            .iter()
            .map(|r| {
                let end = r.end.as_deref().map_or("-".to_string(), hex);
                format!("{}\t{}\t{}\t{}\n", r.id, r.epoch, hex(&r.start), end)
            })
            .collect()
    }

    /// Parses [`RegionMap::encode`]'s output, checking the regions are contiguous.
    pub fn decode(s: &str) -> Result<RegionMap> {
        let mut regions = Vec::new();
        for line in s.lines().filter(|l| !l.trim().is_empty()) {
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() != 4 {
                bail!("bad region line {line:?}");
            }
            let end = if f[3] == "-" { None } else { Some(unhex(f[3])?) };
            regions.push(RegionSpec { id: f[0].parse()?, epoch: f[1].parse()?, start: unhex(f[2])?, end });
        }
        let ok = !regions.is_empty()
            && regions[0].start.is_empty()
            && regions.last().is_some_and(|r| r.end.is_none())
            && regions.windows(2).all(|w| w[0].end.as_ref() == Some(&w[1].start) && w[0].start < w[1].start);
        if !ok {
            bail!("regions must be contiguous and cover every key");
        }
        Ok(RegionMap { regions })
    }

    /// Checks `self` against the map recorded in `data_dir` (`REGIONS`), recording it there if
    /// the directory has none yet: a host must not reopen its regions' data under other ranges
    /// (keys of a region would become unreachable). Changing the ranges takes a region split or
    /// merge, which the cluster does.
    pub fn pin_to(&self, data_dir: &std::path::Path) -> Result<()> {
        let path = data_dir.join("REGIONS");
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                let recorded = RegionMap::decode(&s).with_context(|| format!("reading {}", path.display()))?;
                if recorded != *self {
                    bail!(
                        "{} was created with other regions (split keys {:?}, asked for {:?}); start with the \
                         same --split-keys, or use a new data directory",
                        data_dir.display(),
                        recorded.split_keys(),
                        self.split_keys()
                    );
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
                dpukv_storage::fs::write_atomic(&dpukv_storage::fs::RealFs, &path, self.encode().as_bytes())
                    .with_context(|| format!("writing {}", path.display()))
            }
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// The split keys (each region's start but the first's), lossily as text.
    pub fn split_keys(&self) -> Vec<String> {
        self.regions[1..].iter().map(|r| String::from_utf8_lossy(&r.start).into_owned()).collect()
    }

    /// The region a request addresses (index into the map), checked against the region and
    /// epoch the request names: `WrongRegion` if it names another region (or a batch spans
    /// regions), `StaleEpoch` if it knows another epoch of this one.
    pub fn check(&self, req: &Request) -> Result<usize, (ErrorCode, &'static str)> {
        let i = self.route(req.op.key());
        if let Op::Batch { ops } = &req.op
            && ops.iter().any(|o| self.route(WriteOp::key(o)) != i)
        {
            return Err((ErrorCode::WrongRegion, "a batch must stay within one region"));
        }
        let spec = &self.regions[i];
        if req.region != 0 && req.region != spec.id {
            return Err((ErrorCode::WrongRegion, "the key is not in the region the request names"));
        }
        if req.epoch != 0 && req.epoch != spec.epoch {
            return Err((ErrorCode::StaleEpoch, "the region's epoch differs: refresh the region map"));
        }
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(RegionMap::decode("1\t1\t\t61\n").is_err());
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
    }
}
