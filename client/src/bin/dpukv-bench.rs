//! `dpukv-bench`: YCSB A–F, Honeycomb's cloud-storage workload and a hot-counter workload against
//! a dpukv endpoint, or the same workloads against Redis (`--target redis://HOST:PORT`) or etcd
//! (`--target etcd://HOST:PORT[,HOST:PORT...]`, with the cargo feature `etcd`). Prints
//! throughput, p50/p99/p99.9 latency and the client's own CPU time per operation; `--json` prints
//! one JSON object instead.
//!
//! # The same client for both systems
//! Only [`Engine`] differs between the systems: the workload mix, the choice of records, key and
//! value sizes, the connections and the requests in flight come from the same code. Each of
//! `--threads` connections is shared by `--depth` streams that run one operation at a time, so
//! every connection keeps `--depth` requests in flight. What the streams queue on a connection
//! goes out in one write — for dpukv one frame (client-side batching, `dpukv_client`'s
//! connection), for Redis a RESP pipeline ([`redis`]) — and replies are read in chunks of 64 KiB,
//! every complete reply in a chunk handled before the next read; for etcd each of the
//! `--threads` connections is one `etcd_client::Client` (one HTTP/2 connection per endpoint)
//! whose `--depth` streams are concurrent gRPC calls multiplexed on it. Latency is measured per
//! operation, from when a stream starts it to when its last reply arrives. Both run on the same
//! tokio runtime: one worker thread per core, or a single thread with `--client-threads 1`
//! (less client CPU per operation, at some throughput on a 2-core machine).
//!
//! The client's own CPU time over the run (user and system, from `/proc/self/stat`, 10 ms
//! resolution) is reported per operation, so a client that steals the servers' cores shows.
//! SIGINT ends a run early, reporting what it did.
//!
//! # Redis as an ordered store
//! Redis has no ordered map with values, so the Redis driver keeps every record twice: as the
//! string `key -> value` and as the member `key\0value` (score 0) of one sorted set,
//! [`redis::ORDERED`]. Members of equal score sort by their bytes, and the NUL right after the
//! key makes them sort by key (keys must not contain NUL; the bench's never do). Every operation
//! takes one round trip:
//! - read: `GET key`;
//! - insert and update (upserts, like dpukv's `put`): `EVALSHA` of [`redis::UPSERT`], a Lua script
//!   that does `SET key value GET`, `ZREM` of the old member and `ZADD` of the new one, atomically.
//!   This is the honest price of Redis emulating an ordered store (a bare `SET` would leave scans
//!   returning stale values);
//! - scan of n records from a key: `ZRANGEBYLEX set [key + LIMIT 0 n`, members split at their
//!   first NUL (keeping only keys in the set would take a second round trip, `MGET`, per scan);
//! - floor scan (cloud workload): `ZREVRANGEBYLEX set (key\x01 - LIMIT 0 1` for the largest key
//!   `<= key` and `ZRANGEBYLEX set [key\x01 + LIMIT 0 n` for the keys after it, pipelined in one
//!   write;
//! - fetch_add: `INCRBY key 1`;
//! - loading: the upsert script with 64 records per call (dpukv: atomic batches of 64 puts).
//!
//! # etcd
//! etcd (v3 API, through `etcd-client`; measured against etcd 3.4) is an ordered store already,
//! so the mapping is direct and every operation but fetch_add takes one gRPC call:
//! - read: `Range` of the key (`get(key)`), linearizable — etcd's default, like dpukv's reads,
//!   which the primary serves; a linearizable etcd read asks the leader for a read index;
//! - insert and update: `Put`;
//! - scan of n records from a key: `Range [key, 0xff...)` with `limit n` (`with_range` +
//!   `with_limit`), the same bounds as dpukv's scan;
//! - floor scan (cloud workload): one `Txn` of two ranges, the largest key `<= key` (a range
//!   from `\0` sorted descending with limit 1 — etcd 3.4 reads that whole range to sort it, so
//!   this is slow on a large store) and up to n keys after it;
//! - fetch_add: a `Range` of the key, then a compare-and-swap `Txn` (`mod_revision(key) == r`
//!   then `Put` of the value + 1, else `Range` of the key to retry with what it returned), values
//!   8-byte little-endian like dpukv's counters: two calls, more on a contended key;
//! - loading: one `Txn` of 64 puts (etcd allows 128 operations per txn by default).
//!
//! `etcd://` takes one endpoint or a comma-separated list (the client balances requests over
//! them). Without the `etcd` feature the binary has no etcd driver and `--target etcd://` fails
//! saying so; `cargo build --workspace` enables it (through `dpukv-e2e`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dpukv_client::Client;
use dpukv_client::proto::WriteOp;
use dpukv_client::workload::{Chooser, Histogram, Kind, Rng, Workload, key, value};

#[derive(Parser, Clone)]
#[command(name = "dpukv-bench", version, about = "YCSB and cloud-storage workloads against dpukv, Redis or etcd")]
struct Args {
    /// dpukv endpoint (device or gateway).
    #[arg(long, default_value = "127.0.0.1:7070")]
    endpoint: String,
    /// A bearer token for a gateway that asks for one.
    #[arg(long, env = "DPUKV_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// TLS to the endpoint.
    #[command(flatten)]
    tls: dpukv_net::tls::ClientTlsArgs,
    /// Run against another system instead: redis://HOST:PORT or etcd://HOST:PORT[,HOST:PORT...]
    /// (etcd needs the cargo feature `etcd`).
    #[arg(long)]
    target: Option<String>,
    /// Workload: a, b, c, d, e, f, cloud, counter, scan (100% scans of --scan-length records).
    #[arg(long, default_value = "c")]
    workload: String,
    /// Records per scan of the scan workload (1..=10000).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    scan_length: u32,
    /// Key distribution: uniform or zipf (theta 0.99).
    #[arg(long, default_value = "uniform")]
    distribution: String,
    /// Records in the store.
    #[arg(long, default_value_t = 100_000)]
    records: u64,
    /// Key size in bytes.
    #[arg(long, default_value_t = 16)]
    key_size: usize,
    /// Value size in bytes.
    #[arg(long, default_value_t = 16)]
    value_size: usize,
    /// Connections.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Requests in flight per connection (streams sharing it; client-side batching depth).
    #[arg(long, default_value_t = 16)]
    depth: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Load the records before running.
    #[arg(long)]
    load: bool,
    /// Only load.
    #[arg(long)]
    load_only: bool,
    /// Keys the counter workload increments.
    #[arg(long, default_value_t = 1)]
    hot_keys: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Threads of the client's runtime (0: one per core; 1: a single-threaded runtime).
    #[arg(long, default_value_t = 0)]
    client_threads: usize,
    /// How dpukv gets may be served: linearizable, bounded:MS, extended, interleaved (hot-key
    /// replicas, docs/hot-keys.md); the result counts gets served by replicas.
    #[arg(long, default_value = "linearizable")]
    consistency: dpukv_client::proto::Consistency,
    /// Tree nodes cached per region for start hints (Fat-B+Tree's fat root; 0: no hints).
    #[arg(long, default_value_t = 0)]
    fat_root: usize,
    /// Record every write of the run to FILE, for a history checker (scripts/check-backup-history.py):
    /// one line per write, `<key hex> <tag> <invoked µs> <completed µs> <ok|err>`, times from the
    /// wall clock (µs since the Unix epoch), written when the run ends. Every value written is
    /// `<record>:<tag>` padded with `x` (the load's tag is 0), so the value found in a store says
    /// which write put it. At most 4M writes are kept (the run fails past them).
    #[arg(long)]
    history: Option<std::path::PathBuf>,
    /// `extended` mode: requests in flight from one connection's client to a primary above which
    /// it is busy and replicated keys' gets go to replicas (default: the client library's, 32).
    #[arg(long)]
    busy_in_flight: Option<usize>,
}

/// Records per load request (one atomic batch for dpukv, one script call for Redis, one txn for
/// etcd).
const LOAD_BATCH: u64 = 64;

/// One connection to the system under test, shared by the streams of one worker.
#[derive(Clone)]
enum Engine {
    Dpukv(Client),
    Redis(redis::Conn),
    Etcd(etcd::Conn),
}

impl Engine {
    async fn connect(a: &Args) -> Result<Engine> {
        Ok(match &a.target {
            None => {
                let opts = dpukv_client::Options {
                    pool: 1,
                    token: a.token.as_deref().map(|t| std::sync::Arc::from(t.as_bytes())),
                    tls: a.tls.client().map_err(anyhow::Error::msg)?,
                    consistency: a.consistency,
                    fat_root: Some(a.fat_root),
                    busy_in_flight: a.busy_in_flight,
                    ..Default::default()
                };
                Engine::Dpukv(Client::connect_with(&a.endpoint, opts).await.context("connecting to dpukv")?)
            }
            Some(t) => {
                if let Some(addr) = t.strip_prefix("redis://") {
                    Engine::Redis(redis::Conn::connect(addr).await?)
                } else if let Some(addrs) = t.strip_prefix("etcd://") {
                    Engine::Etcd(etcd::Conn::connect(addrs).await?)
                } else {
                    bail!("--target takes redis://HOST:PORT or etcd://HOST:PORT[,HOST:PORT...]")
                }
            }
        })
    }

    fn name(a: &Args) -> &'static str {
        match a.target.as_deref() {
            None => "dpukv",
            Some(t) if t.starts_with("etcd://") => "etcd",
            Some(_) => "redis",
        }
    }

    async fn read(&self, key: Vec<u8>) -> Result<()> {
        match self {
            Engine::Dpukv(c) => {
                c.get(&key).await?;
            }
            Engine::Redis(r) => {
                r.call(redis::Cmd::Get(key)).await?;
            }
            Engine::Etcd(e) => e.get(key).await?,
        }
        Ok(())
    }

    /// Insert or update.
    async fn upsert(&self, key: Vec<u8>, value: Vec<u8>) -> Result<()> {
        match self {
            Engine::Dpukv(c) => {
                c.put(&key, &value).await?;
            }
            Engine::Redis(r) => {
                r.call(redis::Cmd::Upsert(key, value)).await?;
            }
            Engine::Etcd(e) => e.put(key, value).await?,
        }
        Ok(())
    }

    /// Up to `n` records from the first key `>= start` (`floor`: from the largest key `<= start`).
    async fn scan(&self, start: Vec<u8>, n: u32, floor: bool) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        Ok(match self {
            Engine::Dpukv(c) if floor => c.floor_scan(&start, &[0xff; 64], n as usize).await?,
            Engine::Dpukv(c) => c.scan(&start, &[0xff; 64], n as usize).await?,
            Engine::Redis(r) if floor => redis::floor_records(r.call(redis::Cmd::FloorScan(start, n)).await?, n)?,
            Engine::Redis(r) => redis::records(r.call(redis::Cmd::Scan(start, n)).await?)?,
            Engine::Etcd(e) if floor => e.floor_scan(start, n).await?,
            Engine::Etcd(e) => e.scan(start, n).await?,
        })
    }

    async fn fetch_add(&self, key: Vec<u8>) -> Result<()> {
        match self {
            Engine::Dpukv(c) => {
                c.fetch_add(&key, 1).await?;
            }
            Engine::Redis(r) => {
                r.call(redis::Cmd::IncrBy(key, 1)).await?;
            }
            Engine::Etcd(e) => {
                e.fetch_add(key, 1).await?;
            }
        }
        Ok(())
    }

    /// Writes `records` in one request (dpukv: one atomic batch per region they fall in).
    async fn load(&self, records: Vec<(Vec<u8>, Vec<u8>)>) -> Result<()> {
        match self {
            Engine::Dpukv(c) => {
                c.batch_across_regions(records.into_iter().map(|(key, value)| WriteOp::Put { key, value }).collect())
                    .await?;
            }
            Engine::Redis(r) => {
                r.call(redis::Cmd::UpsertMany(records)).await?;
            }
            Engine::Etcd(e) => e.put_many(records).await?,
        }
        Ok(())
    }
}

struct Shared {
    args: Args,
    workload: Workload,
    chooser: Chooser,
    inserted: AtomicU64,
    errors: AtomicU64,
    deadline: Instant,
    /// Set on SIGINT: the streams stop after their operation in flight.
    stop: std::sync::atomic::AtomicBool,
    /// Writes recorded for `--history`, over every stream (bounded by [`MAX_HISTORY`]).
    recorded: AtomicU64,
    /// This run's number (24 bits, never 0), the top of every value's tag: runs that draw the
    /// same keys in the same order still write values that say which run wrote them.
    run: u64,
}

/// The most writes `--history` keeps.
const MAX_HISTORY: u64 = 4_000_000;

/// One write of `--history`: the key, its value's tag, when it was invoked and completed (µs
/// since the Unix epoch), and whether it was acknowledged.
struct Written {
    key: Vec<u8>,
    tag: u64,
    invoked: u64,
    completed: u64,
    ok: bool,
}

/// Microseconds since the Unix epoch.
fn wall_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// Draws and runs one operation of the workload; for a write, its key and its value's tag
/// (unique to the write: the run's number, the stream's, and the stream's count of operations).
async fn op(
    e: &Engine,
    s: &Shared,
    rng: &mut Rng,
    stream: u64,
    round: &mut u64,
) -> (Result<()>, Option<(Vec<u8>, u64)>) {
    let a = &s.args;
    let kind = s.workload.next(rng);
    let rec = match kind {
        Kind::Insert => s.inserted.fetch_add(1, Ordering::Relaxed),
        Kind::Read if s.workload == Workload::D => {
            let latest = s.inserted.load(Ordering::Relaxed);
            latest.saturating_sub(1 + s.chooser.pick(rng) % latest.max(1))
        }
        Kind::FetchAdd => rng.next_u64() % a.hot_keys.max(1),
        _ => s.chooser.pick(rng),
    };
    let k = if kind == Kind::FetchAdd { format!("counter{rec}").into_bytes() } else { key(rec, a.key_size) };
    *round += 1;
    let tag = s.run << 40 | (stream & 0xffff) << 24 | (*round & 0xff_ffff);
    let v = || value(rec, a.value_size, tag);
    let written = matches!(kind, Kind::Update | Kind::Insert | Kind::ReadModifyWrite).then(|| (k.clone(), tag));
    let r = match kind {
        Kind::Read => e.read(k).await,
        Kind::Update | Kind::Insert => e.upsert(k, v()).await,
        Kind::ReadModifyWrite => match e.read(k.clone()).await {
            Ok(()) => e.upsert(k, v()).await,
            // Not written at all.
            Err(err) => return (Err(err), None),
        },
        Kind::Scan(n) => e.scan(k, n, false).await.map(drop),
        Kind::FloorScan(n) => e.scan(k, n, true).await.map(drop),
        Kind::FetchAdd => e.fetch_add(k).await,
    };
    (r, written)
}

/// Loads the records over the same connections and streams as a run; returns the seconds taken.
async fn load(a: &Args) -> Result<f64> {
    let start = Instant::now();
    let streams = (a.threads * a.depth).max(1) as u64;
    let per = a.records.div_ceil(streams);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..a.threads.max(1) as u64 {
        let engine = Engine::connect(a).await?;
        for d in 0..a.depth.max(1) as u64 {
            let (a, engine) = (a.clone(), engine.clone());
            let part = t * a.depth.max(1) as u64 + d;
            tasks.spawn(async move {
                let (lo, hi) = ((part * per).min(a.records), ((part + 1) * per).min(a.records));
                let mut i = lo;
                while i < hi {
                    let end = (i + LOAD_BATCH).min(hi);
                    engine.load((i..end).map(|j| (key(j, a.key_size), value(j, a.value_size, 0))).collect()).await?;
                    i = end;
                }
                anyhow::Ok(())
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Writes `--history`'s lines.
fn write_history(path: &std::path::Path, history: &[Written]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for w in history {
        for b in &w.key {
            write!(f, "{b:02x}")?;
        }
        writeln!(f, " {} {} {} {}", w.tag, w.invoked, w.completed, if w.ok { "ok" } else { "err" })?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// The process's user and system CPU seconds so far, from `/proc/self/stat` (None where there is
/// none). Counted in clock ticks of 10 ms (Linux's USER_HZ is 100).
fn cpu_times() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, from the third (state); utime and stime are the 14th and
    // 15th.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().collect();
    let secs = |i: usize| fields.get(i)?.parse::<f64>().ok().map(|t| t / 100.0);
    Some((secs(11)?, secs(12)?))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let mut rt = match a.client_threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if n > 1 {
                b.worker_threads(n);
            }
            b
        }
    };
    rt.enable_all().build().context("starting the runtime")?.block_on(run(a))
}

async fn run(a: Args) -> Result<()> {
    let workload =
        match Workload::parse(&a.workload).context("--workload must be a, b, c, d, e, f, cloud, counter or scan")? {
            Workload::Scans(_) => Workload::Scans(a.scan_length),
            w => w,
        };
    let chooser = match a.distribution.as_str() {
        "uniform" => Chooser::Uniform(a.records),
        "zipf" => Chooser::zipf(a.records, 0.99),
        d => bail!("--distribution must be uniform or zipf, not {d}"),
    };
    let load_secs = if a.load || a.load_only { Some(load(&a).await?) } else { None };
    if a.load_only {
        let secs = load_secs.unwrap_or(0.0);
        println!("loaded {} records in {secs:.2}s ({:.0}/s)", a.records, a.records as f64 / secs);
        return Ok(());
    }
    let mut engines = Vec::new();
    for _ in 0..a.threads.max(1) {
        engines.push(Engine::connect(&a).await?);
    }
    let shared = Arc::new(Shared {
        args: a.clone(),
        workload,
        chooser,
        inserted: AtomicU64::new(a.records),
        errors: AtomicU64::new(0),
        deadline: Instant::now() + Duration::from_secs_f64(a.duration),
        stop: std::sync::atomic::AtomicBool::new(false),
        recorded: AtomicU64::new(0),
        run: (wall_us() ^ u64::from(std::process::id()) << 8) % 0xff_ffff + 1,
    });
    {
        let s = shared.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                s.stop.store(true, Ordering::Relaxed);
            }
        });
    }
    // Gets served by primaries and replicas (dpukv), counted from here.
    let read_counts = |engines: &[Engine]| {
        engines.iter().fold((0, 0), |(p, r), e| match e {
            Engine::Dpukv(c) => {
                let (p1, r1) = c.read_counts().get();
                (p + p1, r + r1)
            }
            _ => (p, r),
        })
    };
    let counted = engines.clone();
    let reads_before = read_counts(&counted);
    let cpu_start = cpu_times();
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (t, engine) in engines.into_iter().enumerate() {
        // `depth` streams share the connection; each runs one operation at a time.
        for d in 0..a.depth.max(1) {
            let (s, engine) = (shared.clone(), engine.clone());
            tasks.spawn(async move {
                let stream = (t * 1000 + d) as u64;
                let mut rng = Rng(stream + 1);
                let mut hist = Histogram::default();
                let mut round = 0;
                let mut history = Vec::new();
                let recording = s.args.history.is_some();
                // One clock read per operation: its end is the next one's start.
                let mut t0 = Instant::now();
                while t0 < s.deadline && !s.stop.load(Ordering::Relaxed) {
                    let invoked = if recording { wall_us() } else { 0 };
                    let (r, written) = op(&engine, &s, &mut rng, stream, &mut round).await;
                    let ok = r.is_ok();
                    let t1 = Instant::now();
                    if ok {
                        hist.record(t1.duration_since(t0).as_micros() as u64);
                    } else {
                        s.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    if recording && let Some((key, tag)) = written {
                        if round > 0xff_ffff {
                            anyhow::bail!("--history tags a stream's writes with 24 bits: run shorter");
                        }
                        if s.recorded.fetch_add(1, Ordering::Relaxed) >= MAX_HISTORY {
                            anyhow::bail!("--history keeps at most {MAX_HISTORY} writes: run shorter");
                        }
                        history.push(Written { key, tag, invoked, completed: wall_us(), ok });
                    }
                    t0 = t1;
                }
                anyhow::Ok((hist, history))
            });
        }
    }
    let mut hist = Histogram::default();
    let mut history = Vec::new();
    while let Some(h) = tasks.join_next().await {
        let (h, written) = h??;
        hist.merge(&h);
        history.extend(written);
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(path) = &a.history {
        write_history(path, &history).with_context(|| format!("writing the history to {}", path.display()))?;
    }
    // The client's CPU time over the run, and per operation.
    let (user, sys) = match (cpu_start, cpu_times()) {
        (Some((u0, s0)), Some((u1, s1))) => (u1 - u0, s1 - s0),
        _ => (f64::NAN, f64::NAN),
    };
    let cpu_us_per_op = (user + sys) * 1e6 / hist.count.max(1) as f64;
    let reads_after = read_counts(&counted);
    let (primary_reads, replica_reads) = (reads_after.0 - reads_before.0, reads_after.1 - reads_before.1);
    let replica_share = replica_reads as f64 / (primary_reads + replica_reads).max(1) as f64;
    let errors = shared.errors.load(Ordering::Relaxed);
    let tput = hist.count as f64 / secs;
    let (p50, p99, p999) = (hist.quantile(0.5), hist.quantile(0.99), hist.quantile(0.999));
    if a.json {
        let num = |x: f64| if x.is_finite() { format!("{x:.3}") } else { "null".to_string() };
        println!(
            "{{\"system\":\"{}\",\"workload\":\"{}\",\"distribution\":\"{}\",\"records\":{},\"threads\":{},\"depth\":{},\"seconds\":{secs:.3},\"ops\":{},\"throughput_ops\":{tput:.1},\"p50_us\":{p50},\"p99_us\":{p99},\"p999_us\":{p999},\"errors\":{errors},\"client_user_s\":{},\"client_sys_s\":{},\"client_cpu_us_per_op\":{},\"consistency\":\"{}\",\"primary_reads\":{primary_reads},\"replica_reads\":{replica_reads},\"replica_share\":{replica_share:.4}}}",
            Engine::name(&a),
            a.workload,
            a.distribution,
            a.records,
            a.threads,
            a.depth,
            hist.count,
            num(user),
            num(sys),
            num(cpu_us_per_op),
            a.consistency.name(),
        );
    } else {
        if let Some(l) = load_secs {
            println!("load: {} records in {l:.2}s ({:.0}/s)", a.records, a.records as f64 / l);
        }
        println!(
            "{} workload {} ({}), {} connections x depth {}: {tput:.0} ops/s, p50 {p50} us, p99 {p99} us, p99.9 {p999} us, {errors} errors; client CPU {cpu_us_per_op:.2} us/op ({user:.2}s user, {sys:.2}s sys)",
            Engine::name(&a),
            a.workload,
            a.distribution,
            a.threads,
            a.depth
        );
        if replica_reads > 0 || a.consistency != dpukv_client::proto::Consistency::Linearizable {
            println!(
                "gets ({}): {primary_reads} by primaries, {replica_reads} by replicas ({:.1}%)",
                a.consistency.name(),
                replica_share * 100.0
            );
        }
    }
    Ok(())
}

/// The etcd driver: the operations of the bench on etcd's KV service (the mapping is in the
/// documentation at the top of this file).
#[cfg(feature = "etcd")]
mod etcd {
    use std::sync::Arc;
    use std::time::Duration;

    use anyhow::{Context, Result, anyhow};
    use etcd_client::{
        Client, Compare, CompareOp, ConnectOptions, GetOptions, KvClient, SortOrder, SortTarget, Txn, TxnOp,
        TxnOpResponse,
    };

    /// The end of every scan (exclusive), as dpukv's scans use.
    const SCAN_END: [u8; 64] = [0xff; 64];
    /// Deadline of one call, and of connecting.
    const TIMEOUT: Duration = Duration::from_secs(10);

    /// One `etcd_client::Client` (an HTTP/2 connection per endpoint, shared by concurrent calls;
    /// each call clones the KV service's handle).
    #[derive(Clone)]
    pub struct Conn(Arc<Inner>);

    struct Inner {
        kv: KvClient,
        /// Keeps the client's endpoint list (the balanced channel's discovery) alive.
        _client: Client,
    }

    fn pairs(kvs: &[etcd_client::KeyValue]) -> Vec<(Vec<u8>, Vec<u8>)> {
        kvs.iter().map(|kv| (kv.key().to_vec(), kv.value().to_vec())).collect()
    }

    impl Conn {
        /// Connects to `HOST:PORT[,HOST:PORT...]` and reads once, so an unreachable etcd is an
        /// error here.
        pub async fn connect(addrs: &str) -> Result<Conn> {
            let endpoints: Vec<String> = addrs.split(',').map(|a| format!("http://{}", a.trim())).collect();
            let opts = ConnectOptions::new().with_timeout(TIMEOUT).with_connect_timeout(TIMEOUT);
            let client = Client::connect(&endpoints, Some(opts))
                .await
                .with_context(|| format!("connecting to etcd at {addrs}"))?;
            let conn = Conn(Arc::new(Inner { kv: client.kv_client(), _client: client }));
            conn.get(b"dpukv-bench-probe".to_vec()).await.with_context(|| format!("reading from etcd at {addrs}"))?;
            Ok(conn)
        }

        pub async fn get(&self, key: Vec<u8>) -> Result<()> {
            self.0.kv.clone().get(key, None).await?;
            Ok(())
        }

        pub async fn put(&self, key: Vec<u8>, value: Vec<u8>) -> Result<()> {
            self.0.kv.clone().put(key, value, None).await?;
            Ok(())
        }

        /// Puts every record in one txn (etcd refuses a txn that names a key twice).
        pub async fn put_many(&self, records: Vec<(Vec<u8>, Vec<u8>)>) -> Result<()> {
            let ops: Vec<TxnOp> = records.into_iter().map(|(k, v)| TxnOp::put(k, v, None)).collect();
            self.0.kv.clone().txn(Txn::new().and_then(ops)).await?;
            Ok(())
        }

        /// Up to `n` records from the first key `>= start`.
        pub async fn scan(&self, start: Vec<u8>, n: u32) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
            let opts = GetOptions::new().with_range(SCAN_END).with_limit(i64::from(n));
            Ok(pairs(self.0.kv.clone().get(start, Some(opts)).await?.kvs()))
        }

        /// The largest record `<= start` and up to `n` after it, at most `n` in all, in one txn.
        pub async fn floor_scan(&self, start: Vec<u8>, n: u32) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
            let after = [&start[..], b"\0"].concat();
            let floor = GetOptions::new().with_range(after.clone()).with_sort(SortTarget::Key, SortOrder::Descend);
            let txn = Txn::new().and_then([
                TxnOp::get(vec![0u8], Some(floor.with_limit(1))),
                TxnOp::get(after, Some(GetOptions::new().with_range(SCAN_END).with_limit(i64::from(n)))),
            ]);
            let mut out = Vec::new();
            for r in self.0.kv.clone().txn(txn).await?.op_responses() {
                let TxnOpResponse::Get(g) = r else { return Err(anyhow!("etcd answered a range with {r:?}")) };
                out.extend(pairs(g.kvs()));
            }
            out.truncate(n as usize);
            Ok(out)
        }

        /// Adds `delta` to the 8-byte little-endian counter at `key` (absent: 0) by
        /// compare-and-swap on its mod revision; returns the old value.
        pub async fn fetch_add(&self, key: Vec<u8>, delta: u64) -> Result<u64> {
            let mut kv = self.0.kv.clone();
            let counter =
                |v: &[u8]| v.try_into().map(u64::from_le_bytes).map_err(|_| anyhow!("a counter of {} bytes", v.len()));
            // An absent key has mod revision 0 in etcd's compares.
            let (mut old, mut rev) = match kv.get(key.clone(), None).await?.kvs().first() {
                Some(found) => (counter(found.value())?, found.mod_revision()),
                None => (0, 0),
            };
            loop {
                let txn = Txn::new()
                    .when([Compare::mod_revision(key.clone(), CompareOp::Equal, rev)])
                    .and_then([TxnOp::put(key.clone(), old.wrapping_add(delta).to_le_bytes(), None)])
                    .or_else([TxnOp::get(key.clone(), None)]);
                let r = kv.txn(txn).await?;
                if r.succeeded() {
                    return Ok(old);
                }
                (old, rev) = match r.op_responses().first() {
                    Some(TxnOpResponse::Get(g)) => match g.kvs().first() {
                        Some(found) => (counter(found.value())?, found.mod_revision()),
                        None => (0, 0),
                    },
                    other => return Err(anyhow!("etcd answered a failed compare with {other:?}")),
                };
            }
        }
    }
}

/// Without the `etcd` feature: no driver, and connecting says why.
#[cfg(not(feature = "etcd"))]
mod etcd {
    use anyhow::{Result, bail};

    /// No value of this type exists.
    #[derive(Clone)]
    pub enum Conn {}

    type Records = Vec<(Vec<u8>, Vec<u8>)>;

    impl Conn {
        pub async fn connect(_addrs: &str) -> Result<Conn> {
            bail!(
                "this dpukv-bench was built without the `etcd` feature; rebuild with `cargo build --release -p dpukv-client --features etcd` (or `cargo build --release --workspace`)"
            )
        }
        pub async fn get(&self, _key: Vec<u8>) -> Result<()> {
            match *self {}
        }
        pub async fn put(&self, _key: Vec<u8>, _value: Vec<u8>) -> Result<()> {
            match *self {}
        }
        pub async fn put_many(&self, _records: Records) -> Result<()> {
            match *self {}
        }
        pub async fn scan(&self, _start: Vec<u8>, _n: u32) -> Result<Records> {
            match *self {}
        }
        pub async fn floor_scan(&self, _start: Vec<u8>, _n: u32) -> Result<Records> {
            match *self {}
        }
        pub async fn fetch_add(&self, _key: Vec<u8>, _delta: u64) -> Result<u64> {
            match *self {}
        }
    }
}

/// A pipelined RESP client with the structure of `dpukv_client`'s connection, and the commands
/// the bench sends (the data model is in the documentation at the top of this file).
mod redis {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use anyhow::{Context, Result, anyhow, bail, ensure};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
    use tokio::sync::{Notify, mpsc, oneshot};

    /// The sorted set that holds every record as the member `key\0value`, score 0.
    pub const ORDERED: &[u8] = b"dpukv:ordered";

    /// Upserts records and keeps [`ORDERED`] consistent, atomically. `KEYS[1]` is the set;
    /// `KEYS[i + 1]` and `ARGV[i]` are record i's key and new value. Returns the records written.
    pub const UPSERT: &str = r"
local set = KEYS[1]
for i = 1, #ARGV do
  local key, value = KEYS[i + 1], ARGV[i]
  local old = redis.call('SET', key, value, 'GET')
  if old then
    redis.call('ZREM', set, key .. '\0' .. old)
  end
  redis.call('ZADD', set, 0, key .. '\0' .. value)
end
return #ARGV
";

    /// Most operations queued on one connection, and most written and not yet answered.
    const MAX_IN_FLIGHT: usize = 4096;
    /// The reader asks the socket for at least this many bytes per `read`.
    const READ_CHUNK: usize = 64 << 10;
    /// The writer stops adding commands to a write beyond this many bytes.
    const MAX_WRITE: usize = 4 << 20;
    /// The longest bulk string accepted in a reply.
    const MAX_BULK: usize = 64 << 20;
    /// The most elements accepted in one reply array.
    const MAX_ARRAY: usize = 1 << 20;
    /// The deepest nesting of arrays accepted in a reply.
    const MAX_DEPTH: usize = 8;

    /// An operation of the bench; it expands to [`Cmd::commands`] RESP commands written together.
    #[derive(Debug)]
    pub enum Cmd {
        /// `GET key`.
        Get(Vec<u8>),
        /// The upsert script for one record.
        Upsert(Vec<u8>, Vec<u8>),
        /// The upsert script for many records.
        UpsertMany(Vec<(Vec<u8>, Vec<u8>)>),
        /// Up to n members from the key.
        Scan(Vec<u8>, u32),
        /// The largest member `<=` the key and up to n after it (two commands).
        FloorScan(Vec<u8>, u32),
        /// `INCRBY key delta`.
        IncrBy(Vec<u8>, u64),
    }

    impl Cmd {
        /// RESP commands (and so replies) the operation takes.
        fn commands(&self) -> usize {
            match self {
                Cmd::FloorScan(..) => 2,
                _ => 1,
            }
        }

        /// Appends the RESP encoding to `out`; `sha` is the upsert script's digest.
        fn encode(&self, sha: &[u8], out: &mut Vec<u8>) {
            match self {
                Cmd::Get(key) => command(out, &[b"GET", key]),
                Cmd::Upsert(key, value) => command(out, &[b"EVALSHA", sha, b"2", ORDERED, key, value]),
                Cmd::UpsertMany(records) => {
                    header(out, b'*', 4 + 2 * records.len());
                    bulk(out, &[b"EVALSHA"]);
                    bulk(out, &[sha]);
                    bulk(out, &[decimal(records.len() as u64 + 1).as_slice()]);
                    bulk(out, &[ORDERED]);
                    for (key, _) in records {
                        bulk(out, &[key]);
                    }
                    for (_, value) in records {
                        bulk(out, &[value]);
                    }
                }
                Cmd::Scan(start, n) => range(out, b"ZRANGEBYLEX", &[b"[", start], b"+", *n),
                Cmd::FloorScan(start, n) => {
                    range(out, b"ZREVRANGEBYLEX", &[b"(", start, b"\x01"], b"-", 1);
                    range(out, b"ZRANGEBYLEX", &[b"[", start, b"\x01"], b"+", *n);
                }
                Cmd::IncrBy(key, delta) => command(out, &[b"INCRBY", key, decimal(*delta).as_slice()]),
            }
        }
    }

    /// `CMD ORDERED <first bound, given as parts> <other bound> LIMIT 0 n`.
    fn range(out: &mut Vec<u8>, cmd: &[u8], first: &[&[u8]], other: &[u8], n: u32) {
        header(out, b'*', 7);
        bulk(out, &[cmd]);
        bulk(out, &[ORDERED]);
        bulk(out, first);
        bulk(out, &[other]);
        bulk(out, &[b"LIMIT"]);
        bulk(out, &[b"0"]);
        bulk(out, &[decimal(n.into()).as_slice()]);
    }

    /// A command of bulk-string arguments.
    pub fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
        header(out, b'*', args.len());
        for a in args {
            bulk(out, &[a]);
        }
    }

    fn header(out: &mut Vec<u8>, kind: u8, n: usize) {
        out.push(kind);
        out.extend_from_slice(decimal(n as u64).as_slice());
        out.extend_from_slice(b"\r\n");
    }

    /// One bulk string, the concatenation of `parts`.
    fn bulk(out: &mut Vec<u8>, parts: &[&[u8]]) {
        header(out, b'$', parts.iter().map(|p| p.len()).sum());
        for p in parts {
            out.extend_from_slice(p);
        }
        out.extend_from_slice(b"\r\n");
    }

    /// `n` in decimal digits, without allocating.
    fn decimal(mut n: u64) -> Digits {
        let mut d = Digits { buf: [0; 20], start: 20 };
        loop {
            d.start -= 1;
            d.buf[d.start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                return d;
            }
        }
    }

    struct Digits {
        buf: [u8; 20],
        start: usize,
    }

    impl Digits {
        fn as_slice(&self) -> &[u8] {
            &self.buf[self.start..]
        }
    }

    /// A RESP2 reply.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Reply {
        /// `+...`
        Status(Vec<u8>),
        /// `-...`
        Error(String),
        /// `:n`
        Int(i64),
        /// `$-1` or `*-1`.
        Nil,
        /// `$n` and n bytes.
        Bulk(Vec<u8>),
        /// `*n` and n replies; also the replies of an operation of several commands.
        Array(Vec<Reply>),
    }

    /// Parses the reply at the start of `buf`: None while it is incomplete, else the reply and
    /// the bytes it took.
    pub fn parse(buf: &[u8]) -> Result<Option<(Reply, usize)>> {
        parse_at(buf, 0, 0)
    }

    fn parse_at(buf: &[u8], at: usize, depth: usize) -> Result<Option<(Reply, usize)>> {
        let Some(&kind) = buf.get(at) else { return Ok(None) };
        // The line after the type byte, without its CRLF.
        let start = at + 1;
        let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') else { return Ok(None) };
        let end = start + nl;
        ensure!(end > start && buf[end - 1] == b'\r', "redis reply line without CRLF");
        let (line, next) = (&buf[start..end - 1], end + 1);
        let int = || -> Result<i64> {
            std::str::from_utf8(line).ok().and_then(|s| s.parse().ok()).context("redis reply: not an integer")
        };
        Ok(Some(match kind {
            b'+' => (Reply::Status(line.to_vec()), next),
            b'-' => (Reply::Error(String::from_utf8_lossy(line).into_owned()), next),
            b':' => (Reply::Int(int()?), next),
            b'$' => match usize::try_from(int()?) {
                Err(_) => (Reply::Nil, next),
                Ok(n) => {
                    ensure!(n <= MAX_BULK, "redis bulk reply of {n} bytes");
                    if buf.len() < next + n + 2 {
                        return Ok(None);
                    }
                    ensure!(&buf[next + n..next + n + 2] == b"\r\n", "redis bulk reply without CRLF");
                    (Reply::Bulk(buf[next..next + n].to_vec()), next + n + 2)
                }
            },
            b'*' => match usize::try_from(int()?) {
                Err(_) => (Reply::Nil, next),
                Ok(n) => {
                    ensure!(n <= MAX_ARRAY && depth < MAX_DEPTH, "redis array reply too large or too deep");
                    let mut items = Vec::with_capacity(n.min(1024));
                    let mut p = next;
                    for _ in 0..n {
                        let Some((item, q)) = parse_at(buf, p, depth + 1)? else { return Ok(None) };
                        items.push(item);
                        p = q;
                    }
                    (Reply::Array(items), p)
                }
            },
            other => bail!("redis reply of unknown type {other:#04x}"),
        }))
    }

    /// Parses every complete reply at the start of `buf` into `out`; returns the bytes they took.
    pub fn take_replies(buf: &[u8], out: &mut Vec<Reply>) -> Result<usize> {
        let mut pos = 0;
        while let Some((reply, n)) = parse(&buf[pos..])? {
            out.push(reply);
            pos += n;
        }
        Ok(pos)
    }

    /// A member `key\0value` as the record (key, value).
    pub fn split_member(mut member: Vec<u8>) -> Result<(Vec<u8>, Vec<u8>)> {
        let nul = member.iter().position(|&b| b == 0).context("a sorted-set member without a NUL")?;
        let value = member.split_off(nul + 1);
        member.truncate(nul);
        Ok((member, value))
    }

    /// The records of a scan's reply (an array of members).
    pub fn records(reply: Reply) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let Reply::Array(members) = reply else { bail!("a scan answered {reply:?}") };
        members
            .into_iter()
            .map(|m| match m {
                Reply::Bulk(m) => split_member(m),
                other => bail!("a scan answered the member {other:?}"),
            })
            .collect()
    }

    /// The records of a floor scan's two replies (the floor, then the members after it), at most
    /// `n`.
    pub fn floor_records(reply: Reply, n: u32) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let Reply::Array(mut parts) = reply else { bail!("a floor scan answered {reply:?}") };
        ensure!(parts.len() == 2, "a floor scan takes two replies, not {}", parts.len());
        let after = parts.pop().expect("two replies");
        let mut out = records(parts.pop().expect("two replies"))?;
        out.extend(records(after)?);
        out.truncate(n as usize);
        Ok(out)
    }

    type Queued = (Cmd, oneshot::Sender<Reply>);

    /// A caller waiting for the replies of its commands, in the order the commands were written.
    struct Pending {
        commands: usize,
        done: oneshot::Sender<Reply>,
    }

    #[derive(Default)]
    struct State {
        fifo: VecDeque<Pending>,
        closed: bool,
    }

    /// What the writer and the reader share.
    #[derive(Default)]
    struct Shared {
        state: Mutex<State>,
        /// Signalled by the reader when it completed callers (the writer may be waiting for room).
        room: Notify,
    }

    impl Shared {
        fn lock(&self) -> std::sync::MutexGuard<'_, State> {
            self.state.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// Whether the writer must wait for replies before writing more.
        fn full(&self) -> bool {
            let st = self.lock();
            st.fifo.len() >= MAX_IN_FLIGHT && !st.closed
        }

        /// Fails every caller in flight and refuses new ones.
        fn close(&self) {
            let mut st = self.lock();
            st.closed = true;
            st.fifo.clear();
            drop(st);
            self.room.notify_one();
        }
    }

    /// One pipelined connection: callers queue operations on a bounded channel; a writer task
    /// yields once (so the callers woken by the same replies queue theirs), encodes everything
    /// queued and writes it with one write, registering the callers in a FIFO; a reader task reads
    /// 64 KiB chunks, parses every complete reply and completes the callers in order. The writer
    /// takes nothing from the channel while [`MAX_IN_FLIGHT`] callers wait for replies.
    #[derive(Clone)]
    pub struct Conn {
        tx: mpsc::Sender<Queued>,
    }

    impl Conn {
        /// Connects and loads the upsert script.
        pub async fn connect(addr: &str) -> Result<Conn> {
            let mut s = TcpStream::connect(addr).await.with_context(|| format!("connecting to redis at {addr}"))?;
            s.set_nodelay(true)?;
            let mut out = Vec::new();
            command(&mut out, &[b"SCRIPT", b"LOAD", UPSERT.as_bytes()]);
            s.write_all(&out).await?;
            let mut buf = Vec::with_capacity(1024);
            let sha = loop {
                if let Some((reply, _)) = parse(&buf)? {
                    break reply;
                }
                ensure!(s.read_buf(&mut buf).await? > 0, "redis closed the connection");
            };
            let Reply::Bulk(sha) = sha else { bail!("SCRIPT LOAD answered {sha:?}") };
            let (r, w) = s.into_split();
            let shared = Arc::new(Shared::default());
            let (tx, rx) = mpsc::channel(MAX_IN_FLIGHT);
            tokio::spawn(write_loop(w, rx, shared.clone(), sha));
            tokio::spawn(async move {
                read_loop(r, &shared).await;
                shared.close();
            });
            Ok(Conn { tx })
        }

        /// Sends `cmd` and waits for its reply (an error reply is an error).
        pub async fn call(&self, cmd: Cmd) -> Result<Reply> {
            let (done, wait) = oneshot::channel();
            self.tx.send((cmd, done)).await.map_err(|_| anyhow!("redis connection closed"))?;
            match wait.await.map_err(|_| anyhow!("redis connection closed with the command in flight"))? {
                Reply::Error(e) => bail!("redis: {e}"),
                reply => Ok(reply),
            }
        }
    }

    async fn write_loop(mut w: OwnedWriteHalf, mut rx: mpsc::Receiver<Queued>, shared: Arc<Shared>, sha: Vec<u8>) {
        let mut buf = Vec::with_capacity(64 << 10);
        while let Some(first) = rx.recv().await {
            tokio::task::yield_now().await;
            while shared.full() {
                shared.room.notified().await;
            }
            buf.clear();
            {
                let mut st = shared.lock();
                if st.closed {
                    break;
                }
                let mut next = Some(first);
                while let Some((cmd, done)) = next.take() {
                    cmd.encode(&sha, &mut buf);
                    st.fifo.push_back(Pending { commands: cmd.commands(), done });
                    if buf.len() < MAX_WRITE {
                        next = rx.try_recv().ok();
                    }
                }
            }
            if w.write_all(&buf).await.is_err() {
                break;
            }
            if buf.capacity() > MAX_WRITE {
                buf = Vec::with_capacity(64 << 10);
            }
        }
        // Replies to what was written can no longer be matched reliably: fail every caller.
        shared.close();
    }

    /// Reads until the connection closes or fails, or a reply cannot be parsed or matched.
    async fn read_loop(mut r: OwnedReadHalf, shared: &Shared) {
        let mut buf = Vec::with_capacity(2 * READ_CHUNK);
        let mut replies = Vec::with_capacity(256);
        // The replies so far of an operation of several commands.
        let mut partial = Vec::new();
        loop {
            buf.reserve(READ_CHUNK);
            match r.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let Ok(used) = take_replies(&buf, &mut replies) else { return };
            if !replies.is_empty() {
                let mut st = shared.lock();
                for reply in replies.drain(..) {
                    let Some(front) = st.fifo.front() else { return };
                    let reply = if front.commands == 1 {
                        reply
                    } else {
                        partial.push(reply);
                        if partial.len() < front.commands {
                            continue;
                        }
                        Reply::Array(std::mem::take(&mut partial))
                    };
                    let p = st.fifo.pop_front().expect("the front checked above");
                    let _ = p.done.send(reply);
                }
                drop(st);
                shared.room.notify_one();
            }
            buf.drain(..used);
            if buf.is_empty() && buf.capacity() > MAX_WRITE {
                buf = Vec::with_capacity(2 * READ_CHUNK);
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn pipelined_replies_parse_in_order_and_prefixes_wait_for_more() {
            let bytes: &[u8] = b"+OK\r\n:42\r\n$3\r\nabc\r\n$-1\r\n*2\r\n$7\r\nk1\0val1\r\n$0\r\n\r\n-NOSCRIPT no\r\n*-1\r\n$2\r\n\r\n\r\n";
            let mut out = Vec::new();
            assert_eq!(take_replies(bytes, &mut out).expect("valid replies"), bytes.len());
            assert_eq!(
                out,
                [
                    Reply::Status(b"OK".to_vec()),
                    Reply::Int(42),
                    Reply::Bulk(b"abc".to_vec()),
                    Reply::Nil,
                    Reply::Array(vec![Reply::Bulk(b"k1\0val1".to_vec()), Reply::Bulk(Vec::new())]),
                    Reply::Error("NOSCRIPT no".to_string()),
                    Reply::Nil,
                    Reply::Bulk(b"\r\n".to_vec()),
                ]
            );
            // Any cut takes the complete replies before it and leaves the rest.
            let ends: Vec<usize> = {
                let mut p = 0;
                out.iter()
                    .map(|_| {
                        p += parse(&bytes[p..]).expect("valid").expect("complete").1;
                        p
                    })
                    .collect()
            };
            for cut in 0..bytes.len() {
                let mut got = Vec::new();
                let used = take_replies(&bytes[..cut], &mut got).expect("a valid prefix");
                let complete = ends.iter().filter(|&&e| e <= cut).count();
                assert_eq!(got.len(), complete, "cut {cut}");
                assert_eq!(used, if complete == 0 { 0 } else { ends[complete - 1] }, "cut {cut}");
            }
        }

        #[test]
        fn malformed_replies_are_errors() {
            for bad in [&b"?x\r\n"[..], b"+OK\n", b":x\r\n", b"$3\r\nabcd\r\n", b"$99999999999\r\n"] {
                assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
            }
            let deep = "*1\r\n".repeat(MAX_DEPTH + 1) + ":1\r\n";
            assert!(parse(deep.as_bytes()).is_err());
        }

        #[test]
        fn members_split_at_the_first_nul() {
            assert_eq!(
                split_member(b"key\0va\0lue".to_vec()).expect("has a NUL"),
                (b"key".to_vec(), b"va\0lue".to_vec())
            );
            assert_eq!(split_member(b"k\0".to_vec()).expect("has a NUL"), (b"k".to_vec(), Vec::new()));
            assert!(split_member(b"no-nul".to_vec()).is_err());
            let floor = Reply::Array(vec![
                Reply::Array(vec![Reply::Bulk(b"a\x001".to_vec())]),
                Reply::Array(vec![Reply::Bulk(b"b\x002".to_vec()), Reply::Bulk(b"c\x003".to_vec())]),
            ]);
            assert_eq!(
                floor_records(floor, 2).expect("two replies"),
                [(b"a".to_vec(), b"1".to_vec()), (b"b".to_vec(), b"2".to_vec())]
            );
        }

        /// A fake Redis that answers `SCRIPT LOAD`, `GET k` with `k`, and each range query with
        /// one member made of its bound, writing every other batch of replies a byte at a time.
        #[tokio::test]
        async fn pipelined_callers_get_their_own_replies() {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a local port");
            let addr = listener.local_addr().expect("bound").to_string();
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.expect("one client");
                s.set_nodelay(true).expect("nodelay");
                let (mut buf, mut round) = (Vec::new(), 0);
                loop {
                    let mut chunk = [0u8; 4096];
                    let n = s.read(&mut chunk).await.expect("read");
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let mut cmds = Vec::new();
                    let used = take_replies(&buf, &mut cmds).expect("commands are RESP arrays");
                    buf.drain(..used);
                    let mut out = Vec::new();
                    for cmd in cmds {
                        let Reply::Array(args) = cmd else { panic!("a command is an array") };
                        let args: Vec<Vec<u8>> =
                            args.into_iter().map(|a| if let Reply::Bulk(b) = a { b } else { panic!("bulk") }).collect();
                        match &args[0][..] {
                            b"SCRIPT" => out.extend_from_slice(b"$3\r\nsha\r\n"),
                            b"GET" => bulk(&mut out, &[&args[1]]),
                            _ => {
                                header(&mut out, b'*', 1);
                                bulk(&mut out, &[&args[2], b"\0v"]);
                            }
                        }
                    }
                    round += 1;
                    if round % 2 == 1 {
                        for b in out {
                            s.write_all(&[b]).await.expect("write");
                        }
                    } else {
                        s.write_all(&out).await.expect("write");
                    }
                }
            });
            let conn = Conn::connect(&addr).await.expect("connect");
            let mut calls = tokio::task::JoinSet::new();
            for i in 0..100u32 {
                let conn = conn.clone();
                calls.spawn(async move {
                    let key = format!("key{i}").into_bytes();
                    if i % 3 == 0 {
                        let got = conn.call(Cmd::FloorScan(key.clone(), 10)).await.expect("answered");
                        let floor = [b"(", &key[..], b"\x01"].concat();
                        let after = [b"[", &key[..], b"\x01"].concat();
                        assert_eq!(
                            floor_records(got, 10).expect("two replies"),
                            [(floor, b"v".to_vec()), (after, b"v".to_vec())]
                        );
                    } else {
                        assert_eq!(conn.call(Cmd::Get(key.clone())).await.expect("answered"), Reply::Bulk(key));
                    }
                });
            }
            while let Some(r) = calls.join_next().await {
                r.expect("call task");
            }
        }

        #[test]
        fn commands_encode_as_resp_arrays() {
            let mut out = Vec::new();
            Cmd::Get(b"k".to_vec()).encode(b"sha", &mut out);
            Cmd::Upsert(b"k".to_vec(), b"v".to_vec()).encode(b"sha", &mut out);
            assert_eq!(
                out,
                b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*6\r\n$7\r\nEVALSHA\r\n$3\r\nsha\r\n$1\r\n2\r\n$13\r\ndpukv:ordered\r\n$1\r\nk\r\n$1\r\nv\r\n"
            );
            out.clear();
            Cmd::UpsertMany(vec![(b"a".to_vec(), b"1".to_vec()), (b"b".to_vec(), b"2".to_vec())])
                .encode(b"s", &mut out);
            assert_eq!(
                out,
                b"*8\r\n$7\r\nEVALSHA\r\n$1\r\ns\r\n$1\r\n3\r\n$13\r\ndpukv:ordered\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\n1\r\n$1\r\n2\r\n"
            );
            out.clear();
            Cmd::FloorScan(b"k".to_vec(), 10).encode(b"s", &mut out);
            assert_eq!(
                out,
                b"*7\r\n$14\r\nZREVRANGEBYLEX\r\n$13\r\ndpukv:ordered\r\n$3\r\n(k\x01\r\n$1\r\n-\r\n$5\r\nLIMIT\r\n$1\r\n0\r\n$1\r\n1\r\n\
*7\r\n$11\r\nZRANGEBYLEX\r\n$13\r\ndpukv:ordered\r\n$3\r\n[k\x01\r\n$1\r\n+\r\n$5\r\nLIMIT\r\n$1\r\n0\r\n$2\r\n10\r\n"
            );
            let mut replies = Vec::new();
            assert_eq!(take_replies(&out, &mut replies).expect("commands are RESP arrays too"), out.len());
            assert_eq!(replies.len(), 2);
        }
    }
}
