//! `dpukv-store`: drives and inspects the durable store — the writer side of the crash tests
//! (it prints each acknowledged write, so a test can SIGKILL it and check nothing acknowledged
//! was lost), a checker for value-log directories, and the power cut of a directory written
//! through a `JournalFs` (with the random file operations its model test SIGKILLs).

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dpukv_storage::BatchOp;
use dpukv_storage::region::{Region, RegionConfig, RegionReader};
use dpukv_storage::vlog::{FsyncPolicy, Lsn, Record, ValueLog, VlogConfig};
use dpukv_storage::workload::Bank;

const USAGE: &str = "usage:
  dpukv-store vlog-writer DIR [--segment-size N] [--fsync always|never|interval:MS] [--batch N]
  dpukv-store vlog-check DIR
  dpukv-store region-writer DATA SHM --start N [--fsync always|never|interval:MS]
  dpukv-store region-bank SHM --accounts N --initial X --seconds S [--stop-file F]
  dpukv-store region-open DATA SHM   (default geometry; prints what recovery replayed and the
                                      process's peak memory)
  dpukv-store power-cut DIR --seed N   (after every process using DIR is dead: the disk state
                                      a power loss leaves, from DIR/fault-journal; prints what
                                      was dropped)
  dpukv-store journal-writer DIR --seed N   (random file operations on DIR/f0..f3 through a
                                      JournalFs, each printed before it is done, then `ok`)";

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

fn fsync_policy(s: &str) -> Result<FsyncPolicy> {
    Ok(FsyncPolicy::parse(s)?)
}

/// The value of key `i` (deterministic, so a checker can verify it): varied lengths.
pub fn crash_value(i: u64) -> Vec<u8> {
    let len = (i * 37 % 300) as usize;
    (0..len).map(|j| (i as usize + j) as u8).collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.get(1).context(USAGE)?;
    match args.first().map(String::as_str) {
        Some("vlog-writer") => {
            let cfg = VlogConfig {
                segment_size: flag(&args, "--segment-size").map(str::parse).transpose()?.unwrap_or(64 << 10),
                fsync: fsync_policy(flag(&args, "--fsync").unwrap_or("always"))?,
                ..VlogConfig::default()
            };
            let batch: u64 = flag(&args, "--batch").map(str::parse).transpose()?.unwrap_or(4);
            let (mut log, _) = ValueLog::open(dir, cfg)?;
            // Continue after what a previous run left.
            let mut next = 0u64;
            log.replay(Lsn(0), |_, r| {
                next = next.max(r.version + 1);
                Ok(())
            })?;
            let out = std::io::stdout();
            loop {
                let first = next;
                for _ in 0..batch {
                    let key = format!("k{next:010}");
                    log.append(&Record::put(next, key.as_bytes(), &crash_value(next)))?;
                    next += 1;
                }
                let end = log.commit()?;
                log.wait_durable(end)?;
                let mut o = out.lock();
                writeln!(o, "ack {first} {}", next - 1)?;
                o.flush()?;
            }
        }
        Some("vlog-check") => {
            let (log, report) = ValueLog::open(
                dir,
                VlogConfig { segment_size: 64 << 10, fsync: FsyncPolicy::Never, ..VlogConfig::default() },
            )?;
            let (mut n, mut wrong) = (0u64, Vec::new());
            log.replay(Lsn(0), |_, r| {
                if r.version != n || (!r.tombstone && r.value.as_ref() != crash_value(r.version).as_slice()) {
                    wrong.push(r.version);
                }
                n += 1;
                Ok(())
            })?;
            if !wrong.is_empty() {
                bail!("records out of sequence or with wrong values: {wrong:?}");
            }
            println!("records={n} truncated={}", report.truncated_bytes);
            Ok(())
        }
        Some("region-writer") => {
            // Batch i puts key i and, every fifth batch, deletes key i - 3; prints "ack i" once
            // the batch is durable. Tiny budgets: flushes and compactions happen constantly.
            let shm = args.get(2).context(USAGE)?;
            let fsync = fsync_policy(flag(&args, "--fsync").unwrap_or("always"))?;
            let start: u64 = flag(&args, "--start").context("--start")?.parse()?;
            let (mut region, _) = Region::open(RegionConfig::tiny(dir, shm, fsync))?;
            let out = std::io::stdout();
            for i in start.. {
                let key = format!("k{i:08}");
                let value = crash_value(i);
                let old = format!("k{:08}", i.wrapping_sub(3));
                let mut ops = vec![BatchOp::Put(key.as_bytes(), &value)];
                if i % 5 == 0 && i >= 3 {
                    ops.push(BatchOp::Delete(old.as_bytes()));
                }
                let ack = region.write_batch(&ops)?;
                region.wait_durable(ack.end)?;
                let mut o = out.lock();
                writeln!(o, "ack {i}")?;
                o.flush()?;
            }
            Ok(())
        }
        Some("region-open") => {
            let shm = args.get(2).context(USAGE)?;
            let (region, rec) = Region::open(RegionConfig::new(dir, shm))?;
            let status = std::fs::read_to_string("/proc/self/status")?;
            let hwm = status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .context("VmHWM")?;
            println!("replayed {} peak_kib {hwm}", rec.replayed);
            drop(region);
            Ok(())
        }
        Some("region-bank") => {
            // A device-side reader: checks the bank invariant on every scan until time is up.
            let bank = Bank {
                accounts: flag(&args, "--accounts").context("--accounts")?.parse()?,
                initial: flag(&args, "--initial").context("--initial")?.parse()?,
                pad: flag(&args, "--pad").unwrap_or("0").parse()?,
            };
            let seconds: f64 = flag(&args, "--seconds").unwrap_or("2").parse()?;
            // With --stop-file, the reader runs until that file exists (--seconds at most).
            let stop = flag(&args, "--stop-file").map(std::path::PathBuf::from);
            let mut reader = RegionReader::open(dir)?;
            let deadline = std::time::Instant::now() + Duration::from_secs_f64(seconds);
            let mut checks = 0u64;
            while std::time::Instant::now() < deadline && !stop.as_ref().is_some_and(|f| f.exists()) {
                let items = reader.scan(b"acct/", b"acct/\xff", usize::MAX)?;
                bank.check_pairs(&items)?;
                let probe = Bank::account_key((checks % bank.accounts as u64) as u32);
                if reader.get(&probe)?.is_none() {
                    bail!("account {} missing on get", checks % bank.accounts as u64);
                }
                checks += 1;
            }
            println!("checks={checks} reloads={}", reader.reloads);
            Ok(())
        }
        Some("power-cut") => {
            let seed: u64 = flag(&args, "--seed").context("--seed")?.parse()?;
            let report = dpukv_storage::fs::power_cut(std::path::Path::new(dir), seed)?;
            print!("{report}");
            Ok(())
        }
        Some("journal-writer") => {
            journal_writer(std::path::Path::new(dir), flag(&args, "--seed").unwrap_or("1").parse()?)
        }
        _ => bail!("{USAGE}"),
    }
}

/// Random file operations through a `JournalFs` until killed: each is printed (`write NAME OFF
/// LEN BYTE`, `setlen NAME LEN`, `sync NAME`, `create NAME`, `rename FROM TO`, `remove NAME`,
/// `syncdir`) before it is done and followed by `ok` once done, so a test that SIGKILLs this
/// process knows every completed operation and the one that may have been in flight.
fn journal_writer(dir: &std::path::Path, seed: u64) -> Result<()> {
    use dpukv_storage::fs::{Fs, JournalFs};
    let fs = JournalFs::open(dir)?;
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut below = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let names = ["f0", "f1", "f2", "f3"];
    let out = std::io::stdout();
    let say = |line: &str| -> Result<()> {
        let mut o = out.lock();
        writeln!(o, "{line}")?;
        o.flush()?;
        Ok(())
    };
    for n in 1u64.. {
        let name = names[below(4) as usize];
        let path = dir.join(name);
        let present = path.exists();
        let pick = below(100);
        match pick {
            _ if !present && pick < 80 => {
                say(&format!("create {name}"))?;
                fs.create(&path)?;
            }
            0..40 => {
                let off = below(5 * 4096) + if below(2) == 0 { 0 } else { 4096 - below(64) };
                let len = 1 + below(2 * 4096);
                let byte = (n % 251 + 1) as u8;
                say(&format!("write {name} {off} {len} {byte}"))?;
                fs.open(&path)?.write_all_at(&vec![byte; len as usize], off)?;
            }
            40..55 => {
                say(&format!("sync {name}"))?;
                fs.open(&path)?.sync_data()?;
            }
            55..60 => {
                let len = below(6 * 4096);
                say(&format!("setlen {name} {len}"))?;
                fs.open(&path)?.set_len(len)?;
            }
            60..70 => {
                let to = names[below(4) as usize];
                if to == name {
                    continue;
                }
                say(&format!("rename {name} {to}"))?;
                fs.rename(&path, &dir.join(to))?;
            }
            70..75 => {
                say(&format!("remove {name}"))?;
                fs.remove(&path)?;
            }
            _ => {
                say("syncdir")?;
                fs.sync_dir(dir)?;
            }
        }
        say("ok")?;
    }
    Ok(())
}
