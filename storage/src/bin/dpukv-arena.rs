//! `dpukv-arena`: inspect an arena, read it from another process, check the bank invariant, and
//! run the engine demo (load keys, read them from separate reader processes, print figures).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dpukv_storage::workload::Bank;
use dpukv_storage::{ArenaConfig, BatchOp, Reader, Writer};

const USAGE: &str = "usage:
  dpukv-arena stat ARENA
  dpukv-arena get ARENA KEY
  dpukv-arena scan ARENA LO HI [LIMIT]
  dpukv-arena bank-check ARENA --accounts N --initial X --seconds S [--hold-ms H [--hold-until FILE] [--idle]] [--threads T] [--device]
  dpukv-arena read-load ARENA --keys N --seconds S [--threads T]
  dpukv-arena demo [--dir DIR] [--keys N] [--seconds S] [--readers P]";

struct Args(Vec<String>);

impl Args {
    fn flag<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T> {
        match self.0.iter().position(|a| a == name) {
            None => Ok(default),
            Some(i) => {
                let v = self.0.get(i + 1).with_context(|| format!("{name} needs a value"))?;
                v.parse().map_err(|_| anyhow::anyhow!("bad value for {name}: {v}"))
            }
        }
    }
    fn pos(&self, i: usize) -> Result<&str> {
        self.0.get(i).map(String::as_str).with_context(|| USAGE.to_string())
    }
}

fn main() -> Result<()> {
    let args = Args(std::env::args().skip(1).collect());
    match args.pos(0)? {
        "stat" => stat(args.pos(1)?),
        "get" => {
            let mut r = Reader::open(args.pos(1)?)?;
            let s = r.snapshot()?;
            match s.get(args.pos(2)?.as_bytes())? {
                Some(v) => println!("{}", String::from_utf8_lossy(v)),
                None => std::process::exit(1),
            }
            Ok(())
        }
        "scan" => {
            let mut r = Reader::open(args.pos(1)?)?;
            let s = r.snapshot()?;
            let limit = args.0.get(4).map(|l| l.parse()).transpose()?.unwrap_or(usize::MAX);
            for (k, v) in s.scan(args.pos(2)?.as_bytes(), args.pos(3)?.as_bytes(), limit)? {
                println!("{}\t{}", String::from_utf8_lossy(k), String::from_utf8_lossy(v));
            }
            Ok(())
        }
        "bank-check" => bank_check(&args),
        "read-load" => read_load(&args),
        "demo" => demo(&args),
        _ => bail!("{USAGE}"),
    }
}

fn stat(path: &str) -> Result<()> {
    let r = Reader::open(path)?;
    let l = r.layout();
    let s = r.shared_stats();
    println!("generation      {:#x}", l.generation);
    println!("node size       {}", l.node_size);
    println!("capacity        {}", l.capacity);
    println!("write version   {}", s.write_version);
    println!("height          {}", s.height);
    println!("allocated bytes {}", s.allocated_bytes);
    println!("garbage bytes   {}", s.garbage_bytes);
    Ok(())
}

/// Checks the bank invariant on fresh snapshots until the time is up. With `--hold-ms` it pins
/// one snapshot, says "pinned", and holds it (so a test can kill it mid-read) for H ms, or until
/// the file named by `--hold-until` exists (H ms at most).
fn bank_check(args: &Args) -> Result<()> {
    let bank = Bank {
        accounts: args.flag("--accounts", 100)?,
        initial: args.flag("--initial", 1000)?,
        pad: args.flag("--pad", 0)?,
    };
    let seconds: f64 = args.flag("--seconds", 2.0)?;
    let hold: u64 = args.flag("--hold-ms", 0)?;
    let threads: usize = args.flag("--threads", 1)?;
    // --device: read as the device does (own page-table copy via the command ring, node cache).
    let mut reader = if args.0.iter().any(|a| a == "--device") {
        Reader::open_device(args.pos(1)?)?
    } else {
        Reader::open(args.pos(1)?)?
    };
    if args.0.iter().any(|a| a == "--idle") {
        // Hold a slot without pinning (a reader between operations), until killed.
        println!("ready");
        std::thread::sleep(Duration::from_millis(hold.max(1)));
        return Ok(());
    }
    if hold > 0 {
        let snap = reader.snapshot()?;
        bank.check(&snap, 0)?;
        println!("pinned {}", snap.version());
        let until = Instant::now() + Duration::from_millis(hold);
        match args.0.iter().position(|a| a == "--hold-until").and_then(|i| args.0.get(i + 1)) {
            Some(wake) => {
                while Instant::now() < until && !std::path::Path::new(wake).exists() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            None => std::thread::sleep(Duration::from_millis(hold)),
        }
        // Read again under the same pin: a reader whose pin was revoked while it slept must be
        // told so, never read what the writer reused.
        match bank.check(&snap, 0) {
            Ok(_) => println!("after-hold ok"),
            Err(dpukv_storage::workload::CheckError::Engine(dpukv_storage::Error::ReaderRevoked)) => {
                println!("after-hold revoked")
            }
            Err(e) => println!("after-hold error {e}"),
        }
        drop(snap);
        match reader.snapshot() {
            Ok(s) => println!("repinned {}", bank.check(&s, 0).is_ok()),
            Err(e) => println!("repin failed {}", e.code()),
        }
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut handles = Vec::new();
    for t in 0..threads {
        let mut r = reader.try_clone()?;
        handles.push(std::thread::spawn(move || -> Result<(u64, u64, u64)> {
            let (mut checks, mut first, mut last) = (0u64, u64::MAX, 0u64);
            while Instant::now() < deadline {
                let snap = r.snapshot()?;
                let c = bank.check(&snap, (checks as u32 + t as u32) % bank.accounts)?;
                if c.version < last {
                    bail!("read version went backwards: {} after {}", c.version, last);
                }
                first = first.min(c.version);
                last = c.version;
                checks += 1;
            }
            Ok((checks, first, last))
        }));
    }
    let _ = reader.snapshot()?;
    let mut total = 0;
    let (mut lo, mut hi) = (u64::MAX, 0);
    for h in handles {
        let (c, f, l) = h.join().map_err(|_| anyhow::anyhow!("checker thread panicked"))??;
        total += c;
        lo = lo.min(f);
        hi = hi.max(l);
    }
    println!("checks={total} versions={lo}..{hi}");
    Ok(())
}

fn demo_key(i: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k.copy_from_slice(format!("{i:016}").as_bytes());
    k
}

fn demo_value(i: u64, round: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v[8..].copy_from_slice(&round.to_le_bytes());
    v
}

/// Random gets (90%) and 10-item scans (10%) over the demo keys from reader threads; verifies
/// every value belongs to its key. Prints one line of figures.
fn read_load(args: &Args) -> Result<()> {
    let keys: u64 = args.flag("--keys", 1_000_000)?;
    let seconds: f64 = args.flag("--seconds", 3.0)?;
    let threads: usize = args.flag("--threads", 1)?;
    let reader = Reader::open(args.pos(1)?)?;
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut handles = Vec::new();
    for t in 0..threads {
        let mut r = reader.try_clone()?;
        handles.push(std::thread::spawn(move || -> Result<(u64, u64)> {
            let mut x = 0x9E37_79B9u64 ^ (t as u64 + 1) << 32 ^ std::process::id() as u64;
            let (mut gets, mut scans) = (0u64, 0u64);
            while Instant::now() < deadline {
                for _ in 0..256 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let i = x % keys;
                    let snap = r.snapshot()?;
                    if x.is_multiple_of(10) {
                        let n = snap.scan_with(&demo_key(i), &[b'9'; 16], 10, |_, _| {})?;
                        if n == 0 && i + 1 < keys {
                            bail!("scan from key {i} returned nothing");
                        }
                        scans += 1;
                    } else {
                        let v = snap.get(&demo_key(i))?.with_context(|| format!("key {i} missing"))?;
                        if v.len() != 16 || v[..8] != i.to_le_bytes() {
                            bail!("key {i} has a value that is not its own");
                        }
                        gets += 1;
                    }
                }
            }
            Ok((gets, scans))
        }));
    }
    let (mut gets, mut scans) = (0, 0);
    for h in handles {
        let (g, s) = h.join().map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
        gets += g;
        scans += s;
    }
    println!(
        "reader pid {}: {threads} threads, {:.0} gets/s, {:.0} scans/s (10 items), all values verified",
        std::process::id(),
        gets as f64 / seconds,
        scans as f64 / seconds
    );
    Ok(())
}

/// The engine demo: load keys, start reader processes on the same arena, keep writing, report.
fn demo(args: &Args) -> Result<()> {
    let keys: u64 = args.flag("--keys", 1_000_000)?;
    let seconds: f64 = args.flag("--seconds", 5.0)?;
    let readers: usize = args.flag("--readers", 1)?;
    let default_dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
    let dir: PathBuf = args.flag("--dir", PathBuf::from(default_dir))?;
    let path = dir.join(format!("dpukv-demo-{}.arena", std::process::id()));
    let cfg = ArenaConfig { capacity: (keys * 200).max(64 << 20), ..ArenaConfig::default() };
    let mut w = Writer::create(&path, &cfg)?;
    let _cleanup = RemoveOnDrop(path.clone());
    println!("arena {} (node size {} B)", path.display(), cfg.node_size);

    let t = Instant::now();
    let batch = 256;
    for start in (0..keys).step_by(batch) {
        let ks: Vec<[u8; 16]> = (start..(start + batch as u64).min(keys)).map(demo_key).collect();
        let vs: Vec<[u8; 16]> = (start..(start + batch as u64).min(keys)).map(|i| demo_value(i, 0)).collect();
        let ops: Vec<BatchOp> = ks.iter().zip(&vs).map(|(k, v)| BatchOp::Put(k, v)).collect();
        w.write_batch(&ops)?;
    }
    let load = t.elapsed();
    w.reclaim()?;
    let s = w.stats();
    println!(
        "loaded {keys} keys (16 B keys, 16 B values) in {:.2}s: {:.0} keys/s, tree height {}, arena {:.1} MiB = {:.2}x the raw key+value bytes",
        load.as_secs_f64(),
        keys as f64 / load.as_secs_f64(),
        s.height,
        s.footprint_bytes as f64 / (1 << 20) as f64,
        s.footprint_bytes as f64 / (keys * 32) as f64
    );

    let exe = std::env::current_exe()?;
    let mut children: Vec<Child> = Vec::new();
    for _ in 0..readers {
        children.push(
            Command::new(&exe)
                .args([
                    "read-load",
                    path.to_str().context("path")?,
                    "--keys",
                    &keys.to_string(),
                    "--seconds",
                    &seconds.to_string(),
                ])
                .stdout(Stdio::inherit())
                .spawn()?,
        );
    }
    // Keep updating random keys while the readers run.
    let t = Instant::now();
    let mut x = 88172645463325252u64;
    let mut writes = 0u64;
    while t.elapsed().as_secs_f64() < seconds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = x % keys;
        w.put(&demo_key(i), &demo_value(i, writes))?;
        writes += 1;
    }
    let elapsed = t.elapsed().as_secs_f64();
    for mut c in children {
        let st = c.wait()?;
        if !st.success() {
            bail!("reader process failed: {st}");
        }
    }
    let s = w.stats();
    println!(
        "writer: {:.0} puts/s during the reads; {} MiB allocated, {} KiB awaiting reclamation",
        writes as f64 / elapsed,
        s.allocated_bytes >> 20,
        s.garbage_bytes >> 10
    );
    Ok(())
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
