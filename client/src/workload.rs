//! Benchmark workloads: YCSB A–F and Honeycomb's cloud-storage scan workload, key choosers
//! (uniform, scrambled Zipfian) and a bounded latency histogram. Used by `dpukv-bench`.

/// SplitMix64.
pub struct Rng(pub u64);

impl Rng {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// SplitMix64's finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Chooses record numbers.
pub enum Chooser {
    /// Uniform over [0, n).
    Uniform(u64),
    /// YCSB's scrambled Zipfian (Gray et al.).
    Zipf {
        /// Items.
        n: u64,
        /// Skew.
        theta: f64,
        /// 1 / (1 - theta).
        alpha: f64,
        /// zeta(n).
        zetan: f64,
        /// YCSB's eta.
        eta: f64,
    },
}

impl Chooser {
    /// A Zipfian chooser over `n` items with skew `theta` (0.99 in YCSB).
    pub fn zipf(n: u64, theta: f64) -> Chooser {
        let zeta = |n: u64| (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zetan = zeta(n);
        let eta = (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta(2) / zetan);
        Chooser::Zipf { n, theta, alpha: 1.0 / (1.0 - theta), zetan, eta }
    }

    /// The next record number.
    pub fn pick(&self, rng: &mut Rng) -> u64 {
        match *self {
            Chooser::Uniform(n) => rng.next_u64() % n.max(1),
            Chooser::Zipf { n, theta, alpha, zetan, eta } => {
                let u = rng.unit();
                let uz = u * zetan;
                let rank = if uz < 1.0 {
                    0
                } else if uz < 1.0 + 0.5f64.powf(theta) {
                    1
                } else {
                    ((n as f64) * (eta * u - eta + 1.0).powf(alpha)) as u64
                };
                mix(rank.min(n - 1) ^ 0x5bd1_e995) % n
            }
        }
    }
}

/// The key of record `i`: `user` + a hash of `i`, padded or cut to `size` bytes. Keys of
/// consecutive records are far apart, as in YCSB. One allocation.
pub fn key(i: u64, size: usize) -> Vec<u8> {
    use std::io::Write;
    let size = size.max(8);
    let mut k = Vec::with_capacity(size.max(24));
    write!(k, "user{:020}", mix(i) % 10u64.pow(19)).expect("writing to a Vec cannot fail");
    k.resize(size, b'0');
    k
}

/// A value of `size` bytes for record `i`: `i:round`, cut to `size`, padded with `x`. One
/// allocation.
pub fn value(i: u64, size: usize, round: u64) -> Vec<u8> {
    use std::io::Write;
    let mut v = Vec::with_capacity(size.max(41));
    write!(v, "{i}:{round}").expect("writing to a Vec cannot fail");
    v.resize(size, b'x');
    v
}

/// One operation of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Read a record.
    Read,
    /// Overwrite a record.
    Update,
    /// Insert a new record.
    Insert,
    /// Scan `n` records from a record.
    Scan(u32),
    /// Honeycomb's SCAN from a record (floor scan).
    FloorScan(u32),
    /// Read, then write back.
    ReadModifyWrite,
    /// Increment a counter.
    FetchAdd,
}

/// A workload's operation mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// 50% read, 50% update.
    A,
    /// 95% read, 5% update.
    B,
    /// 100% read.
    C,
    /// 95% read (latest records), 5% insert.
    D,
    /// 95% scan (1–100 records), 5% insert.
    E,
    /// 50% read, 50% read-modify-write.
    F,
    /// Honeycomb's cloud storage: 85% floor scans of 1–10 records, 10% reads, 5% updates.
    Cloud,
    /// 100% fetch_add on `hot` keys (the atomics benchmark).
    Counter,
    /// 100% scans of exactly this many records (long scans: the gateway's sub-range reads).
    Scans(u32),
}

impl Workload {
    /// Parses a, b, c, d, e, f, cloud, counter, scan (of 10,000 records).
    pub fn parse(s: &str) -> Option<Workload> {
        Some(match s.to_ascii_lowercase().as_str() {
            "a" => Workload::A,
            "b" => Workload::B,
            "c" => Workload::C,
            "d" => Workload::D,
            "e" => Workload::E,
            "f" => Workload::F,
            "cloud" => Workload::Cloud,
            "counter" => Workload::Counter,
            "scan" => Workload::Scans(10_000),
            _ => return None,
        })
    }

    /// Draws the next operation.
    pub fn next(self, rng: &mut Rng) -> Kind {
        let p = rng.next_u64() % 100;
        match self {
            Workload::A => {
                if p < 50 {
                    Kind::Read
                } else {
                    Kind::Update
                }
            }
            Workload::B => {
                if p < 95 {
                    Kind::Read
                } else {
                    Kind::Update
                }
            }
            Workload::C => Kind::Read,
            Workload::D => {
                if p < 95 {
                    Kind::Read
                } else {
                    Kind::Insert
                }
            }
            Workload::E => {
                if p < 95 {
                    Kind::Scan(1 + (rng.next_u64() % 100) as u32)
                } else {
                    Kind::Insert
                }
            }
            Workload::F => {
                if p < 50 {
                    Kind::Read
                } else {
                    Kind::ReadModifyWrite
                }
            }
            Workload::Cloud => {
                if p < 85 {
                    Kind::FloorScan(1 + (rng.next_u64() % 10) as u32)
                } else if p < 95 {
                    Kind::Read
                } else {
                    Kind::Update
                }
            }
            Workload::Counter => Kind::FetchAdd,
            Workload::Scans(n) => Kind::Scan(n),
        }
    }
}

/// A latency histogram in microseconds with bounded memory: 16 sub-buckets per power of two
/// (values within about 6%).
#[derive(Clone)]
pub struct Histogram {
    buckets: Vec<u64>,
    /// Samples recorded.
    pub count: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: vec![0; 64 * 16], count: 0 }
    }
}

impl Histogram {
    fn index(us: u64) -> usize {
        if us < 16 {
            return us as usize;
        }
        let exp = 63 - us.leading_zeros() as usize; // >= 4
        let mant = ((us >> (exp - 4)) & 15) as usize;
        (exp - 3) * 16 + mant
    }

    fn lower(i: usize) -> u64 {
        if i < 16 {
            return i as u64;
        }
        let (exp, mant) = (i / 16 + 3, (i % 16) as u64);
        (16 + mant) << (exp - 4)
    }

    /// Records one latency.
    pub fn record(&mut self, us: u64) {
        self.buckets[Self::index(us).min(64 * 16 - 1)] += 1;
        self.count += 1;
    }

    /// Adds another histogram.
    pub fn merge(&mut self, o: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.count += o.count;
    }

    /// The `q` quantile (0..=1) in microseconds.
    pub fn quantile(&self, q: f64) -> u64 {
        let target = ((self.count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= target {
                return Self::lower(i);
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_keep_their_format() {
        assert_eq!(key(7, 16), format!("user{:020}", mix(7) % 10u64.pow(19)).as_bytes()[..16]);
        assert_eq!(key(7, 30), [&format!("user{:020}", mix(7) % 10u64.pow(19)).into_bytes()[..], b"000000"].concat());
        assert_eq!(key(7, 1).len(), 8);
        assert_eq!(value(12, 8, 345), b"12:345xx");
        assert_eq!(value(12, 4, 345), b"12:3");
        assert_eq!(value(1, 0, 0), b"");
        assert_eq!(value(u64::MAX, 64, u64::MAX).len(), 64);
    }

    #[test]
    fn histogram_quantiles_are_close() {
        let mut h = Histogram::default();
        for us in 1..=10_000u64 {
            h.record(us);
        }
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 - 5000.0).abs() / 5000.0 < 0.07, "p50 {p50}");
        assert!((p99 - 9900.0).abs() / 9900.0 < 0.07, "p99 {p99}");
    }

    #[test]
    fn zipf_is_skewed_and_in_range() {
        let z = Chooser::zipf(10_000, 0.99);
        let mut rng = Rng(1);
        let mut counts = std::collections::HashMap::new();
        for _ in 0..100_000 {
            let x = z.pick(&mut rng);
            assert!(x < 10_000);
            *counts.entry(x).or_insert(0u32) += 1;
        }
        let top = counts.values().max().copied().unwrap_or(0);
        assert!(top > 1000, "the hottest key should take a few percent of accesses, got {top}");
    }
}
