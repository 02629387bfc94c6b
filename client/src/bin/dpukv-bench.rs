//! `dpukv-bench`: YCSB A–F and Honeycomb's cloud-storage workload against a dpukv endpoint, or
//! the same workload against Redis (`--target redis://host:port`: GET/SET for point operations,
//! one sorted set with ZRANGEBYLEX (+ MGET) for scans, INCRBY for fetch_add). Each connection
//! keeps `--depth` requests in flight. Prints throughput and p50/p99/p99.9 latency; `--json`
//! prints one JSON object instead.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dpukv_client::Client;
use dpukv_client::proto::WriteOp;
use dpukv_client::workload::{Chooser, Histogram, Kind, Rng, Workload, key, value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

#[derive(Parser, Clone)]
#[command(name = "dpukv-bench", about = "YCSB and cloud-storage workloads against dpukv or Redis")]
struct Args {
    /// dpukv endpoint (device or gateway).
    #[arg(long, default_value = "127.0.0.1:7070")]
    endpoint: String,
    /// Run against another system instead: redis://HOST:PORT.
    #[arg(long)]
    target: Option<String>,
    /// Workload: a, b, c, d, e, f, cloud, counter.
    #[arg(long, default_value = "c")]
    workload: String,
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
    /// Connections (one worker each).
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Requests in flight per connection (client-side batching depth).
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
}

/// One connection to the system under test.
enum Conn {
    Dpukv(Client),
    Redis(Redis),
}

impl Conn {
    async fn open(a: &Args) -> Result<Conn> {
        Ok(match &a.target {
            None => Conn::Dpukv(Client::connect(&a.endpoint, 1).await.context("connecting to dpukv")?),
            Some(t) => match t.strip_prefix("redis://") {
                Some(addr) => Conn::Redis(Redis::connect(addr).await?),
                None => bail!("--target takes redis://HOST:PORT"),
            },
        })
    }
    fn name(a: &Args) -> &'static str {
        if a.target.is_some() { "redis" } else { "dpukv" }
    }
}

/// A minimal pipelined RESP client.
struct Redis {
    w: tokio::net::tcp::OwnedWriteHalf,
    r: BufReader<tokio::net::tcp::OwnedReadHalf>,
}

enum Resp {
    Ok,
    Int,
    Bulk(Option<Vec<u8>>),
    Array(Vec<Resp>),
}

impl Redis {
    async fn connect(addr: &str) -> Result<Redis> {
        let s = TcpStream::connect(addr).await.with_context(|| format!("connecting to redis at {addr}"))?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok(Redis { w, r: BufReader::new(r) })
    }

    fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
        out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
    }

    async fn send(&mut self, cmds: &[Vec<Vec<u8>>]) -> Result<Vec<Resp>> {
        let mut out = Vec::new();
        for c in cmds {
            Self::encode(&mut out, &c.iter().map(Vec::as_slice).collect::<Vec<_>>());
        }
        self.w.write_all(&out).await?;
        let mut replies = Vec::with_capacity(cmds.len());
        for _ in cmds {
            replies.push(self.read().await?);
        }
        Ok(replies)
    }

    fn read(&mut self) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Resp>> + Send + '_>> {
        Box::pin(async move {
            let mut line = Vec::new();
            self.r.read_until(b'\n', &mut line).await?;
            if line.len() < 3 {
                bail!("redis closed the connection");
            }
            let body = std::str::from_utf8(&line[1..line.len() - 2]).context("redis reply")?;
            Ok(match line[0] {
                b'+' => Resp::Ok,
                b'-' => bail!("redis error: {body}"),
                b':' => {
                    body.parse::<i64>()?;
                    Resp::Int
                }
                b'$' => {
                    let n: i64 = body.parse()?;
                    if n < 0 {
                        Resp::Bulk(None)
                    } else {
                        let mut v = vec![0; n as usize + 2];
                        self.r.read_exact(&mut v).await?;
                        v.truncate(n as usize);
                        Resp::Bulk(Some(v))
                    }
                }
                b'*' => {
                    let n: i64 = body.parse()?;
                    let mut items = Vec::new();
                    for _ in 0..n.max(0) {
                        items.push(self.read().await?);
                    }
                    Resp::Array(items)
                }
                _ => bail!("unexpected redis reply"),
            })
        })
    }
}

struct Shared {
    args: Args,
    workload: Workload,
    chooser: Chooser,
    inserted: AtomicU64,
    errors: AtomicU64,
    deadline: Instant,
}

/// Runs one operation; returns whether it succeeded.
async fn op(conn: &mut Conn, s: &Shared, rng: &mut Rng, round: &mut u64) -> Result<()> {
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
    match conn {
        Conn::Dpukv(c) => match kind {
            Kind::Read => {
                c.get(&k).await?;
            }
            Kind::Update | Kind::Insert => {
                c.put(&k, &value(rec, a.value_size, *round)).await?;
            }
            Kind::ReadModifyWrite => {
                c.get(&k).await?;
                c.put(&k, &value(rec, a.value_size, *round)).await?;
            }
            Kind::Scan(n) => {
                c.scan(&k, &[0xff; 64], n as usize).await?;
            }
            Kind::FloorScan(n) => {
                c.floor_scan(&k, &[0xff; 64], n as usize).await?;
            }
            Kind::FetchAdd => {
                c.fetch_add(&k, 1).await?;
            }
        },
        Conn::Redis(r) => {
            let v = value(rec, a.value_size, *round);
            match kind {
                Kind::Read => {
                    r.send(&[vec![b"GET".to_vec(), k]]).await?;
                }
                Kind::Update => {
                    r.send(&[vec![b"SET".to_vec(), k, v]]).await?;
                }
                Kind::Insert => {
                    r.send(&[
                        vec![b"SET".to_vec(), k.clone(), v],
                        vec![b"ZADD".to_vec(), b"zkeys".to_vec(), b"0".to_vec(), k],
                    ])
                    .await?;
                }
                Kind::ReadModifyWrite => {
                    r.send(&[vec![b"GET".to_vec(), k.clone()]]).await?;
                    r.send(&[vec![b"SET".to_vec(), k, v]]).await?;
                }
                Kind::Scan(n) | Kind::FloorScan(n) => {
                    let mut start = b"[".to_vec();
                    start.extend_from_slice(&k);
                    let got = r
                        .send(&[vec![
                            b"ZRANGEBYLEX".to_vec(),
                            b"zkeys".to_vec(),
                            start,
                            b"+".to_vec(),
                            b"LIMIT".to_vec(),
                            b"0".to_vec(),
                            n.to_string().into_bytes(),
                        ]])
                        .await?;
                    if let Some(Resp::Array(items)) = got.into_iter().next() {
                        let mut mget = vec![b"MGET".to_vec()];
                        mget.extend(
                            items.into_iter().filter_map(|i| if let Resp::Bulk(Some(b)) = i { Some(b) } else { None }),
                        );
                        if mget.len() > 1 {
                            r.send(&[mget]).await?;
                        }
                    }
                }
                Kind::FetchAdd => {
                    r.send(&[vec![b"INCRBY".to_vec(), k, b"1".to_vec()]]).await?;
                }
            }
        }
    }
    Ok(())
}

async fn load(a: &Args) -> Result<f64> {
    let start = Instant::now();
    // Ranges of records: `threads` connections, and for dpukv 16 streams on each, every stream
    // writing atomic batches of 64 records (one version and one durability wait per batch).
    let streams = if a.target.is_some() { 1 } else { 16 };
    let parts = a.threads as u64 * streams;
    let per = a.records.div_ceil(parts);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..a.threads as u64 {
        let shared = match &a.target {
            None => Some(Client::connect(&a.endpoint, 1).await.context("connecting to dpukv")?),
            Some(_) => None,
        };
        for s in 0..streams {
            let (a, shared) = (a.clone(), shared.clone());
            let part = t * streams + s;
            tasks.spawn(async move {
                let mut conn = match shared {
                    Some(c) => Conn::Dpukv(c),
                    None => Conn::open(&a).await?,
                };
                let (lo, hi) = (part * per, ((part + 1) * per).min(a.records));
                let mut i = lo;
                while i < hi {
                    let end = (i + 64).min(hi);
                    match &mut conn {
                        Conn::Dpukv(c) => {
                            let ops = (i..end)
                                .map(|j| WriteOp::Put { key: key(j, a.key_size), value: value(j, a.value_size, 0) })
                                .collect();
                            c.batch(ops).await?;
                        }
                        Conn::Redis(r) => {
                            let mut cmds = Vec::new();
                            for j in i..end {
                                let k = key(j, a.key_size);
                                cmds.push(vec![b"SET".to_vec(), k.clone(), value(j, a.value_size, 0)]);
                                cmds.push(vec![b"ZADD".to_vec(), b"zkeys".to_vec(), b"0".to_vec(), k]);
                            }
                            r.send(&cmds).await?;
                        }
                    }
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

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let workload = Workload::parse(&a.workload).context("--workload must be a, b, c, d, e, f, cloud or counter")?;
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
    let shared = Arc::new(Shared {
        args: a.clone(),
        workload,
        chooser,
        inserted: AtomicU64::new(a.records),
        errors: AtomicU64::new(0),
        deadline: Instant::now() + Duration::from_secs_f64(a.duration),
    });
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..a.threads {
        // Per connection: `depth` sequential streams share it; the client batches what they queue.
        let mut conns = Vec::new();
        match &a.target {
            None => {
                let c = Client::connect(&a.endpoint, 1).await?;
                conns.extend((0..a.depth).map(|_| Conn::Dpukv(c.clone())));
            }
            Some(_) => {
                for _ in 0..a.depth {
                    conns.push(Conn::open(&a).await?);
                }
            }
        }
        for (d, mut conn) in conns.into_iter().enumerate() {
            let s = shared.clone();
            tasks.spawn(async move {
                let mut rng = Rng((t * 1000 + d) as u64 + 1);
                let mut hist = Histogram::default();
                let mut round = 0;
                while Instant::now() < s.deadline {
                    let t0 = Instant::now();
                    match op(&mut conn, &s, &mut rng, &mut round).await {
                        Ok(()) => hist.record(t0.elapsed().as_micros() as u64),
                        Err(_) => {
                            s.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                hist
            });
        }
    }
    let mut hist = Histogram::default();
    while let Some(h) = tasks.join_next().await {
        hist.merge(&h?);
    }
    let secs = start.elapsed().as_secs_f64();
    let errors = shared.errors.load(Ordering::Relaxed);
    let tput = hist.count as f64 / secs;
    let (p50, p99, p999) = (hist.quantile(0.5), hist.quantile(0.99), hist.quantile(0.999));
    if a.json {
        println!(
            "{{\"system\":\"{}\",\"workload\":\"{}\",\"distribution\":\"{}\",\"records\":{},\"threads\":{},\"depth\":{},\"seconds\":{secs:.3},\"ops\":{},\"throughput_ops\":{tput:.1},\"p50_us\":{p50},\"p99_us\":{p99},\"p999_us\":{p999},\"errors\":{errors}}}",
            Conn::name(&a),
            a.workload,
            a.distribution,
            a.records,
            a.threads,
            a.depth,
            hist.count
        );
    } else {
        if let Some(l) = load_secs {
            println!("load: {} records in {l:.2}s ({:.0}/s)", a.records, a.records as f64 / l);
        }
        println!(
            "{} workload {} ({}), {} connections x depth {}: {tput:.0} ops/s, p50 {p50} us, p99 {p99} us, p99.9 {p999} us, {errors} errors",
            Conn::name(&a),
            a.workload,
            a.distribution,
            a.threads,
            a.depth
        );
    }
    Ok(())
}
