//! A device's statistics ([`crate::Op::Stats`], docs/protocol.md §5): its counters by name and,
//! per region it leads, the gets it served and its most read popular keys — what the gateway's
//! console shows of where reads are served (docs/console.md).
//!
//! Encoding (little-endian): `u8` counters, each `u8` name length, name (ASCII), `u64` value;
//! `u16` regions, each `u32` id, `u64` gets, `u32` popular-set capacity, `u32` popular keys now,
//! `u32` distinct keys read in the popularity window, `u8` keys listed, each `u16` key length, key, `u32` reads in the popularity window. Bounded:
//! [`MAX_COUNTERS`], [`MAX_REGIONS`], [`MAX_TOP`] keys a region, keys at most `MAX_KEY`.

use crate::limits::MAX_KEY;

/// The most counters a reply holds.
pub const MAX_COUNTERS: usize = 64;
/// The most regions a reply describes.
pub const MAX_REGIONS: usize = 1024;
/// The most popular keys listed for a region.
pub const MAX_TOP: usize = 8;
/// The longest counter name.
pub const MAX_NAME: usize = 64;
/// The most bytes of popular keys a reply lists (all regions together; a device lists keys
/// until this is reached).
pub const MAX_TOP_BYTES: usize = 64 << 10;

/// See the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Counters by name (names documented in docs/protocol.md §5: `reads_served`,
    /// `replica_reads`, `reads_forwarded`, `node_visits`, `uptime_ms`, `cpu_ms`, `rss_bytes`...).
    pub counters: Vec<(String, u64)>,
    /// The regions this device leads (at most [`MAX_REGIONS`]).
    pub regions: Vec<RegionStats>,
}

/// One region's reads on its primary's device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegionStats {
    /// The region.
    pub region: u32,
    /// Gets served from it since the device started (or since the region's slot was given to
    /// it).
    pub gets: u64,
    /// How many keys its popular set may hold (0: hot keys off, or no backups to copy to).
    pub capacity: u32,
    /// Keys popular now.
    pub popular: u32,
    /// Distinct keys read in the popularity window (the keys competing for the set).
    pub distinct: u32,
    /// The most read popular keys (at most [`MAX_TOP`]), each with its reads in the
    /// popularity window, most read first.
    pub top: Vec<(Vec<u8>, u32)>,
}

/// Why bytes are not a [`DeviceStats`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid device statistics: {0}")]
pub struct StatsError(pub &'static str);

impl DeviceStats {
    /// Appends the encoding to `out` (entries past the bounds are left out).
    pub fn encode(&self, out: &mut Vec<u8>) {
        let counters: Vec<_> =
            self.counters.iter().filter(|(n, _)| n.len() <= MAX_NAME && n.is_ascii()).take(MAX_COUNTERS).collect();
        out.push(counters.len() as u8);
        for (name, v) in counters {
            out.push(name.len() as u8);
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&v.to_le_bytes());
        }
        let regions = &self.regions[..self.regions.len().min(MAX_REGIONS)];
        out.extend_from_slice(&(regions.len() as u16).to_le_bytes());
        for r in regions {
            out.extend_from_slice(&r.region.to_le_bytes());
            out.extend_from_slice(&r.gets.to_le_bytes());
            out.extend_from_slice(&r.capacity.to_le_bytes());
            out.extend_from_slice(&r.popular.to_le_bytes());
            out.extend_from_slice(&r.distinct.to_le_bytes());
            let top: Vec<_> = r.top.iter().filter(|(k, _)| k.len() <= MAX_KEY).take(MAX_TOP).collect();
            out.push(top.len() as u8);
            for (k, n) in top {
                out.extend_from_slice(&(k.len() as u16).to_le_bytes());
                out.extend_from_slice(k);
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
    }

    /// Decodes what [`DeviceStats::encode`] wrote (all of `b`, within the bounds).
    pub fn decode(b: &[u8]) -> Result<DeviceStats, StatsError> {
        let mut r = Reader(b);
        let mut s = DeviceStats::default();
        let n = r.u8()? as usize;
        if n > MAX_COUNTERS {
            return Err(StatsError("too many counters"));
        }
        for _ in 0..n {
            let len = r.u8()? as usize;
            if len > MAX_NAME {
                return Err(StatsError("a counter name too long"));
            }
            let name = std::str::from_utf8(r.take(len)?).map_err(|_| StatsError("a counter name not UTF-8"))?;
            s.counters.push((name.to_string(), r.u64()?));
        }
        let n = r.u16()? as usize;
        if n > MAX_REGIONS {
            return Err(StatsError("too many regions"));
        }
        for _ in 0..n {
            let (region, gets, capacity, popular, distinct) = (r.u32()?, r.u64()?, r.u32()?, r.u32()?, r.u32()?);
            let k = r.u8()? as usize;
            if k > MAX_TOP {
                return Err(StatsError("too many popular keys"));
            }
            let mut top = Vec::with_capacity(k);
            for _ in 0..k {
                let len = r.u16()? as usize;
                if len > MAX_KEY {
                    return Err(StatsError("a key too long"));
                }
                top.push((r.take(len)?.to_vec(), r.u32()?));
            }
            s.regions.push(RegionStats { region, gets, capacity, popular, distinct, top });
        }
        if !r.0.is_empty() {
            return Err(StatsError("bytes after the end"));
        }
        Ok(s)
    }

    /// The counter `name`, if present.
    pub fn counter(&self, name: &str) -> Option<u64> {
        self.counters.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StatsError> {
        if self.0.len() < n {
            return Err(StatsError("cut short"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, StatsError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, StatsError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().map_err(|_| StatsError("cut short"))?))
    }
    fn u32(&mut self) -> Result<u32, StatsError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| StatsError("cut short"))?))
    }
    fn u64(&mut self) -> Result<u64, StatsError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| StatsError("cut short"))?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stats() -> impl Strategy<Value = DeviceStats> {
        let counters = proptest::collection::vec(("[a-z_]{1,64}", any::<u64>()), 0..MAX_COUNTERS);
        let top = proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..40), any::<u32>()), 0..=MAX_TOP);
        let region = (any::<u32>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>(), top).prop_map(
            |(region, gets, capacity, popular, distinct, top)| RegionStats {
                region,
                gets,
                capacity,
                popular,
                distinct,
                top,
            },
        );
        (counters, proptest::collection::vec(region, 0..20))
            .prop_map(|(counters, regions)| DeviceStats { counters, regions })
    }

    proptest! {
        #[test]
        fn stats_round_trip_and_every_cut_is_refused(s in stats()) {
            let mut b = Vec::new();
            s.encode(&mut b);
            prop_assert_eq!(DeviceStats::decode(&b), Ok(s));
            for cut in 0..b.len() {
                prop_assert!(DeviceStats::decode(&b[..cut]).is_err());
            }
        }

        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = DeviceStats::decode(&b);
        }
    }

    #[test]
    fn bounds_are_kept_when_encoding() {
        let s = DeviceStats {
            counters: (0..100).map(|i| (format!("c{i}"), i)).collect(),
            regions: vec![RegionStats { region: 1, top: vec![(vec![1], 1); 20], ..RegionStats::default() }],
        };
        let mut b = Vec::new();
        s.encode(&mut b);
        let d = DeviceStats::decode(&b).expect("decodes");
        assert_eq!((d.counters.len(), d.regions[0].top.len()), (MAX_COUNTERS, MAX_TOP));
    }
}
