//! The static region map of a node (until the cluster issue brings one from etcd): contiguous key
//! ranges with ids. The host publishes it as `REGIONS` in the shared directory; the device reads
//! it from there, so both route keys alike.

use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result, bail};

/// One region: keys in `[start, end)` (`end` None = unbounded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// Region id (also its directory name: `region-<id>`).
    pub id: u32,
    /// First key.
    pub start: Vec<u8>,
    /// First key after the region (None: the last region).
    pub end: Option<Vec<u8>>,
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
            regions.push(RegionSpec { id: i as u32 + 1, start, end: Some(k.clone()) });
            start = k.clone();
        }
        regions.push(RegionSpec { id: keys.len() as u32 + 1, start, end: None });
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

    /// Text form: one `id<TAB>hex start<TAB>hex end or -` line per region.
    pub fn encode(&self) -> String {
        self.regions
            .iter()
            .map(|r| format!("{}\t{}\t{}\n", r.id, hex(&r.start), r.end.as_deref().map_or("-".to_string(), hex)))
            .collect()
    }

    /// Parses [`RegionMap::encode`]'s output, checking the regions are contiguous.
    pub fn decode(s: &str) -> Result<RegionMap> {
        let mut regions = Vec::new();
        for line in s.lines().filter(|l| !l.trim().is_empty()) {
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() != 3 {
                bail!("bad region line {line:?}");
            }
            let end = if f[2] == "-" { None } else { Some(unhex(f[2])?) };
            regions.push(RegionSpec { id: f[0].parse()?, start: unhex(f[1])?, end });
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

    /// Writes `dir/REGIONS` (atomically).
    pub fn store(&self, dir: &Path) -> Result<()> {
        let tmp = dir.join("REGIONS.tmp");
        std::fs::write(&tmp, self.encode()).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, dir.join("REGIONS")).context("publishing REGIONS")?;
        Ok(())
    }

    /// Reads `dir/REGIONS`.
    pub fn load(dir: &Path) -> Result<RegionMap> {
        let p = dir.join("REGIONS");
        RegionMap::decode(&std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?)
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
        assert!(RegionMap::decode("1\t\t61\n").is_err());
    }
}
