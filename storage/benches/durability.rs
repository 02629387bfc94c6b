//! `cargo bench -p dpukv-storage --bench durability`: write throughput per fsync policy, and the
//! backup-side work of Send Index vs Build Index for the same replicated write stream.
//!
//! Ids: `durability/write/{always,interval_5ms,never}` (16 B keys, 100 B values, one write per
//! batch) and `durability/backup_index/{send_index,build_index}` (throughput in replicated
//! writes). The bench also prints the bytes the backup writes to disk (I/O amplification) for
//! growth factors 4 and 10. `DPUKV_BENCH_WRITES` sets the replicated stream's length.

#[path = "support/keys.rs"]
mod keys;
use keys::key;

use std::path::Path;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use dpukv_storage::ArenaConfig;
use dpukv_storage::region::{Backup, IndexExport, Region, RegionConfig};
use dpukv_storage::vlog::{FsyncPolicy, VlogConfig};

fn value(i: u64) -> [u8; 100] {
    let mut v = [0u8; 100];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v
}

/// The geometry of the replication experiment: KV separation (100 B values live in the log), a
/// 256 KiB L0 (so levels cascade within the stream), 4 KiB level nodes in 2 MiB segments.
fn repl_config(dir: &Path, growth: u64) -> RegionConfig {
    RegionConfig {
        arena: ArenaConfig {
            capacity: 256 << 20,
            inline_threshold: 32,
            keep_tombstones: true,
            ..ArenaConfig::default()
        },
        vlog: VlogConfig { fsync: FsyncPolicy::Never, ..VlogConfig::default() },
        l0_budget: 256 << 10,
        growth_factor: growth,
        // Single-threaded backup-side work: compactions run inline.
        background_compaction: false,
        ..RegionConfig::new(dir.join("data"), dir.join("shm"))
    }
}

struct Stream {
    log: Vec<(u64, Vec<u8>)>,
    exports: Vec<IndexExport>,
    writes: u64,
}

/// Runs the primary: `n` random-key writes with compactions, capturing what a backup receives.
fn primary_stream(n: u64, growth: u64) -> Stream {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut p = Region::open(repl_config(dir.path(), growth)).expect("primary").0;
    p.capture_exports();
    for i in 0..n {
        p.put(&key(i % (n / 2)), &value(i)).expect("put");
    }
    Stream { log: p.log_segments().expect("log"), exports: p.take_exports(), writes: n }
}

fn backup_with_log(dir: &Path, s: &Stream) -> Backup {
    let mut b = Backup::create(dir.join("data")).expect("backup");
    for (id, bytes) in &s.log {
        b.receive_log_segment(*id, bytes).expect("log copy");
    }
    b
}

fn send_index(dir: &Path, s: &Stream) -> u64 {
    let mut b = backup_with_log(dir, s);
    let log_bytes = b.bytes_written;
    for e in &s.exports {
        b.apply_send_index(e).expect("send index");
    }
    b.bytes_written - log_bytes
}

/// Build Index: replays the log copy and compacts. Returns (level bytes written, read).
fn build_index(dir: &Path, growth: u64) -> (u64, u64) {
    let (r, _) = Region::open(repl_config(dir, growth)).expect("build index");
    (r.stats().level_bytes_written, r.stats().level_bytes_read)
}

fn bench(c: &mut Criterion) {
    let writes: u64 = std::env::var("DPUKV_BENCH_WRITES").ok().and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let user_bytes = writes * (16 + 100);

    // I/O amplification at the backup (bytes written and read, over the user bytes replicated),
    // growth factors 4 and 10. Both backups copy the same log; Send Index then writes the
    // rewritten segments and reads nothing, Build Index writes and reads what its compactions do.
    for growth in [4u64, 10] {
        let s = primary_stream(writes, growth);
        let log: u64 = s.log.iter().map(|(_, b)| b.len() as u64).sum();
        let d1 = tempfile::tempdir().expect("tempdir");
        let si = send_index(d1.path(), &s);
        let d2 = tempfile::tempdir().expect("tempdir");
        backup_with_log(d2.path(), &s);
        let (bw, br) = build_index(d2.path(), growth);
        eprintln!(
            "io growth={growth} writes={writes} user_bytes={user_bytes} shipped_outputs={} shipped_bytes={} log_copy={log} \
             send_index: written={} read=0 amplification={:.2}x | build_index: written={} read={br} amplification={:.2}x | build/send={:.2}x",
            s.exports.len(),
            s.exports.iter().map(IndexExport::bytes).sum::<u64>(),
            log + si,
            (log + si) as f64 / user_bytes as f64,
            log + bw,
            (log + bw + br) as f64 / user_bytes as f64,
            (log + bw + br) as f64 / (log + si) as f64
        );
    }

    let mut g = c.benchmark_group("durability");
    g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(4));

    // Backup-side index construction for the same replicated stream (growth factor 4).
    let s = primary_stream(writes, 4);
    g.throughput(Throughput::Elements(s.writes));
    g.bench_function("backup_index/send_index", |b| {
        b.iter_batched(
            || {
                let d = tempfile::tempdir().expect("tempdir");
                let backup = backup_with_log(d.path(), &s);
                (d, backup)
            },
            |(d, mut backup)| {
                for e in &s.exports {
                    backup.apply_send_index(e).expect("send index");
                }
                d
            },
            BatchSize::PerIteration,
        )
    });
    g.bench_function("backup_index/build_index", |b| {
        b.iter_batched(
            || {
                let d = tempfile::tempdir().expect("tempdir");
                backup_with_log(d.path(), &s);
                d
            },
            |d| {
                build_index(d.path(), 4);
                d
            },
            BatchSize::PerIteration,
        )
    });

    // Write throughput per fsync policy (on the disk-backed temp dir, arenas on /dev/shm).
    g.throughput(Throughput::Elements(1));
    for (name, fsync) in [
        ("always", FsyncPolicy::Always),
        ("interval_5ms", FsyncPolicy::Interval(Duration::from_millis(5))),
        ("never", FsyncPolicy::Never),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let shm = tempfile::Builder::new()
            .prefix("dpukv-bench")
            .tempdir_in(if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" })
            .expect("shm");
        let cfg = RegionConfig {
            vlog: VlogConfig { fsync, ..VlogConfig::default() },
            ..RegionConfig::new(dir.path().join("data"), shm.path())
        };
        let mut r = Region::open(cfg).expect("region").0;
        let mut i = 0u64;
        g.bench_function(format!("write/{name}"), |b| {
            b.iter(|| {
                i += 1;
                r.put(&key(i), &value(i)).expect("put")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
