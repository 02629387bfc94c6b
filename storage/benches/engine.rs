//! `cargo bench -p dpukv-storage --bench engine`: the engine against `BTreeMap` behind a
//! `parking_lot::RwLock` and `crossbeam_skiplist::SkipMap`, same workloads, same run.
//!
//! 1M keys of 16 B and values of 16 B, inserted in random key order. Benchmark ids are
//! `engine/<workload>_<distribution>/<system>`; throughput is in elements (operations, or items
//! for scans). Set `DPUKV_BENCH_KEYS` for a smaller key count (e.g. in CI smoke runs).
//!
//! The `hints` group is the device's side of a get with and without a Fat-B+Tree start hint: a
//! device-mode reader (its own page-table copy and interior-node cache, as the device process
//! reads) getting each key from the root, or from the leaf a fat root names (the hint's checks —
//! the arena's nonce, the page-table entry, the version, the fences — included; finding the hint
//! is the client's work and is done beforehand). Ids `hints/get_<distribution>/<start>`.

#[path = "support/keys.rs"]
mod keys;
use keys::{key, mix};

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use crossbeam_skiplist::SkipMap;
use dpukv_storage::{ArenaConfig, Reader, StartHint, TopNode, Writer};
use parking_lot::{Mutex, RwLock};
use std::hint::black_box;

// ---- keys and distributions -------------------------------------------------------------------

fn value(i: u64, round: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v[8..].copy_from_slice(&round.to_le_bytes());
    v
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// YCSB's scrambled Zipfian generator (Gray et al.), theta 0.99.
struct Zipf {
    n: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
}

impl Zipf {
    fn new(n: u64, theta: f64) -> Zipf {
        let zeta = |n: u64| (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zetan = zeta(n);
        let zeta2 = zeta(2);
        let alpha = 1.0 / (1.0 - theta);
        let eta = (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan);
        Zipf { n, theta, alpha, zetan, eta }
    }
    fn sample(&self, rng: &mut Rng) -> u64 {
        let u = rng.unit();
        let uz = u * self.zetan;
        let rank = if uz < 1.0 {
            0
        } else if uz < 1.0 + 0.5f64.powf(self.theta) {
            1
        } else {
            ((self.n as f64) * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64
        };
        mix(rank.min(self.n - 1) ^ 0x5bd1e995) % self.n
    }
}

/// A precomputed sequence of key indices for one distribution.
fn sequence(n: u64, zipf: Option<&Zipf>, len: usize, seed: u64) -> Vec<u64> {
    let mut rng = Rng(seed);
    (0..len)
        .map(|_| match zipf {
            Some(z) => z.sample(&mut rng),
            None => rng.next() % n,
        })
        .collect()
}

// ---- the systems --------------------------------------------------------------------------------

trait ReadHandle: Send {
    fn get(&mut self, k: &[u8]) -> usize;
    fn scan(&mut self, lo: &[u8], n: usize) -> usize;
}

trait System: Sync + Send {
    fn name(&self) -> &'static str;
    fn reader(&self) -> Box<dyn ReadHandle + '_>;
    fn put(&self, k: &[u8], v: &[u8]);
}

struct Dpukv {
    writer: Mutex<Writer>,
    _dir: tempfile::TempDir,
}

struct DpukvReader(Reader);

impl ReadHandle for DpukvReader {
    fn get(&mut self, k: &[u8]) -> usize {
        let s = self.0.snapshot().expect("snapshot");
        s.get(k).expect("get").map_or(0, |v| v.len())
    }
    fn scan(&mut self, lo: &[u8], n: usize) -> usize {
        let s = self.0.snapshot().expect("snapshot");
        let mut bytes = 0;
        s.scan_with(lo, &[0xff; 16], n, |k, v| bytes += k.len() + v.len()).expect("scan");
        bytes
    }
}

impl System for Dpukv {
    fn name(&self) -> &'static str {
        "dpukv"
    }
    fn reader(&self) -> Box<dyn ReadHandle + '_> {
        Box::new(DpukvReader(self.writer.lock().reader().expect("reader")))
    }
    fn put(&self, k: &[u8], v: &[u8]) {
        self.writer.lock().put(k, v).expect("put");
    }
}

struct Locked(RwLock<BTreeMap<Vec<u8>, Vec<u8>>>);

struct LockedReader<'a>(&'a Locked);

impl ReadHandle for LockedReader<'_> {
    fn get(&mut self, k: &[u8]) -> usize {
        self.0.0.read().get(k).map_or(0, |v| v.len())
    }
    fn scan(&mut self, lo: &[u8], n: usize) -> usize {
        let m = self.0.0.read();
        m.range::<[u8], _>((Bound::Included(lo), Bound::Unbounded)).take(n).map(|(k, v)| k.len() + v.len()).sum()
    }
}

impl System for Locked {
    fn name(&self) -> &'static str {
        "btreemap"
    }
    fn reader(&self) -> Box<dyn ReadHandle + '_> {
        Box::new(LockedReader(self))
    }
    fn put(&self, k: &[u8], v: &[u8]) {
        self.0.write().insert(k.to_vec(), v.to_vec());
    }
}

struct Skip(SkipMap<Vec<u8>, Vec<u8>>);

struct SkipReader<'a>(&'a Skip);

impl ReadHandle for SkipReader<'_> {
    fn get(&mut self, k: &[u8]) -> usize {
        self.0.0.get(k).map_or(0, |e| e.value().len())
    }
    fn scan(&mut self, lo: &[u8], n: usize) -> usize {
        self.0
            .0
            .range::<[u8], _>((Bound::Included(lo), Bound::Unbounded))
            .take(n)
            .map(|e| e.key().len() + e.value().len())
            .sum()
    }
}

impl System for Skip {
    fn name(&self) -> &'static str {
        "skipmap"
    }
    fn reader(&self) -> Box<dyn ReadHandle + '_> {
        Box::new(SkipReader(self))
    }
    fn put(&self, k: &[u8], v: &[u8]) {
        self.0.insert(k.to_vec(), v.to_vec());
    }
}

fn build(n: u64) -> Vec<Box<dyn System>> {
    let dir = tempfile::Builder::new()
        .prefix("dpukv-bench")
        .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" })
        .expect("tempdir");
    let cfg = ArenaConfig { capacity: (n * 256).max(256 << 20), ..ArenaConfig::default() };
    let mut w = Writer::create(dir.path().join("bench.arena"), &cfg).expect("arena");
    let t = Instant::now();
    for i in 0..n {
        w.put(&key(i), &value(i, 0)).expect("load");
    }
    let load = t.elapsed();
    w.reclaim().expect("reclaim");
    let s = w.stats();
    eprintln!(
        "dpukv: loaded {n} keys in random key order in {:.2}s ({:.0}/s); height {}; arena footprint {} B = {:.3}x the {} raw key+value bytes",
        load.as_secs_f64(),
        n as f64 / load.as_secs_f64(),
        s.height,
        s.footprint_bytes,
        s.footprint_bytes as f64 / (n * 32) as f64,
        n * 32
    );
    let locked = Locked(RwLock::new((0..n).map(|i| (key(i).to_vec(), value(i, 0).to_vec())).collect()));
    let skip = Skip((0..n).map(|i| (key(i).to_vec(), value(i, 0).to_vec())).collect());
    vec![Box::new(Dpukv { writer: Mutex::new(w), _dir: dir }), Box::new(locked), Box::new(skip)]
}

// ---- workloads ---------------------------------------------------------------------------------

const SEQ: usize = 1 << 16;

/// Runs `iters` gets split across `threads` reader threads (with an optional writer thread
/// updating random keys flat out) and returns the wall time.
fn threaded_gets(sys: &dyn System, seq: &[u64], iters: u64, threads: usize, writer: bool) -> Duration {
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let wh = writer.then(|| {
            let stop = stop.clone();
            s.spawn(move || {
                let mut r = Rng(99);
                let n = seq.len() as u64;
                let mut round = 1;
                while !stop.load(Ordering::Relaxed) {
                    let i = seq[(r.next() % n) as usize];
                    sys.put(&key(i), &value(i, round));
                    round += 1;
                }
            })
        });
        let per = iters.div_ceil(threads as u64);
        let start = Instant::now();
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut h = sys.reader();
                    for j in (t * 7919..).take(per as usize) {
                        black_box(h.get(&key(seq[j % SEQ])));
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().expect("reader");
        }
        let d = start.elapsed();
        stop.store(true, Ordering::Relaxed);
        if let Some(w) = wh {
            w.join().expect("writer");
        }
        d
    })
}

fn bench(c: &mut Criterion) {
    let n: u64 = std::env::var("DPUKV_BENCH_KEYS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let systems = build(n);
    let zipf = Zipf::new(n, 0.99);
    let dists: [(&str, Vec<u64>); 2] =
        [("uniform", sequence(n, None, SEQ, 1)), ("zipf", sequence(n, Some(&zipf), SEQ, 2))];
    let mut g = c.benchmark_group("engine");
    g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for (dist, seq) in &dists {
        for sys in &systems {
            let sys = sys.as_ref();
            let mut h = sys.reader();
            let mut j = 0usize;
            g.throughput(Throughput::Elements(1));
            g.bench_function(BenchmarkId::new(format!("get_{dist}"), sys.name()), |b| {
                b.iter(|| {
                    j += 1;
                    black_box(h.get(&key(seq[j % SEQ])))
                })
            });
            for items in [10usize, 100] {
                g.throughput(Throughput::Elements(items as u64));
                g.bench_function(BenchmarkId::new(format!("scan{items}_{dist}"), sys.name()), |b| {
                    b.iter(|| {
                        j += 1;
                        black_box(h.scan(&key(seq[j % SEQ]), items))
                    })
                });
            }
            g.throughput(Throughput::Elements(1));
            let mut round = 1u64;
            g.bench_function(BenchmarkId::new(format!("put_{dist}"), sys.name()), |b| {
                b.iter(|| {
                    j += 1;
                    round += 1;
                    let i = seq[j % SEQ];
                    sys.put(&key(i), &value(i, round))
                })
            });
            g.bench_function(BenchmarkId::new(format!("mix95_{dist}"), sys.name()), |b| {
                b.iter(|| {
                    j += 1;
                    let i = seq[j % SEQ];
                    if j.is_multiple_of(20) {
                        round += 1;
                        sys.put(&key(i), &value(i, round));
                    } else {
                        black_box(h.get(&key(i)));
                    }
                })
            });
            drop(h);
            for threads in [1usize, 2] {
                for writer in [false, true] {
                    let id = format!("readers{threads}{}_{dist}", if writer { "_writer" } else { "" });
                    g.bench_function(BenchmarkId::new(id, sys.name()), |b| {
                        b.iter_custom(|iters| threaded_gets(sys, seq, iters, threads, writer))
                    });
                }
            }
        }
    }
    g.finish();
}

/// Every node of the tree, the root first, then layer by layer.
fn tree_nodes(r: &mut Reader) -> Vec<TopNode> {
    let s = r.snapshot().expect("snapshot");
    let mut all = s.expand(&[]).expect("root").into_iter().map(|(_, n)| n).collect::<Vec<_>>();
    let mut layer = all.clone();
    while !layer.is_empty() {
        layer = s.expand(&layer).expect("expand").into_iter().map(|(_, n)| n).collect();
        all.extend(layer.iter().cloned());
    }
    all
}

fn hints(c: &mut Criterion) {
    let n: u64 = std::env::var("DPUKV_BENCH_KEYS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let dir = tempfile::Builder::new()
        .prefix("dpukv-bench")
        .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" })
        .expect("tempdir");
    let path = dir.path().join("hints.arena");
    let cfg = ArenaConfig { capacity: (n * 256).max(256 << 20), ..ArenaConfig::default() };
    let mut w = Writer::create(&path, &cfg).expect("arena");
    for i in 0..n {
        w.put(&key(i), &value(i, 0)).expect("load");
    }
    w.reclaim().expect("reclaim");
    let mut device = Reader::open_device(&path).expect("device reader");
    let nodes = tree_nodes(&mut device);
    let nonce = device.snapshot().expect("snapshot").arena_nonce();
    let leaves: Vec<&TopNode> = nodes.iter().filter(|t| t.level == 0).collect();
    eprintln!("hints: {n} keys, height {}, {} leaves", w.stats().height, leaves.len());
    let leaf_of = |k: &[u8]| {
        let i = leaves.partition_point(|t| t.lo.as_slice() <= k) - 1;
        leaves[i]
    };
    let zipf = Zipf::new(n, 0.99);
    let dists: [(&str, Vec<u64>); 2] =
        [("uniform", sequence(n, None, SEQ, 1)), ("zipf", sequence(n, Some(&zipf), SEQ, 2))];
    let mut g = c.benchmark_group("hints");
    g.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(1));
    for (dist, seq) in &dists {
        let keys: Vec<[u8; 16]> = seq.iter().map(|&i| key(i)).collect();
        let hinted: Vec<&TopNode> = keys.iter().map(|k| leaf_of(k)).collect();
        // Node visits per get each way (a fixed pass over the sequence, outside the timings).
        let hint_of = |i: usize| {
            let t = hinted[i];
            StartHint { arena: nonce, lid: t.lid, version: t.version, lo: &t.lo, hi: t.hi.as_deref() }
        };
        let v0 = device.stats().node_visits;
        for k in &keys {
            black_box(device.snapshot().expect("snapshot").get_versioned(k).expect("get").is_some());
        }
        let v1 = device.stats().node_visits;
        for (i, k) in keys.iter().enumerate() {
            let s = device.snapshot().expect("snapshot");
            black_box(s.get_versioned_hinted(k, &hint_of(i)).expect("get").0.is_some());
        }
        let v2 = device.stats().node_visits;
        eprintln!(
            "hints/{dist}: node visits per get {:.2} from the root, {:.2} from a leaf hint",
            (v1 - v0) as f64 / SEQ as f64,
            (v2 - v1) as f64 / SEQ as f64
        );
        let mut j = 0usize;
        g.bench_function(BenchmarkId::new(format!("get_{dist}"), "root"), |b| {
            b.iter(|| {
                j += 1;
                let s = device.snapshot().expect("snapshot");
                black_box(s.get_versioned(&keys[j % SEQ]).expect("get").is_some())
            })
        });
        let before = device.stats();
        g.bench_function(BenchmarkId::new(format!("get_{dist}"), "leaf_hint"), |b| {
            b.iter(|| {
                j += 1;
                let hint = hint_of(j % SEQ);
                let s = device.snapshot().expect("snapshot");
                black_box(s.get_versioned_hinted(&keys[j % SEQ], &hint).expect("get").0.is_some())
            })
        });
        let after = device.stats();
        assert_eq!(after.hint_misses, before.hint_misses, "every hint is fresh (no writes)");
    }
    g.finish();
    drop(w);
}

criterion_group!(benches, bench, hints);
criterion_main!(benches);
