//! `dpukv-store`: drives and inspects the durable store — the writer side of the crash tests
//! (it prints each acknowledged write, so a test can SIGKILL it and check nothing acknowledged
//! was lost) and a checker for value-log directories.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dpukv_storage::vlog::{FsyncPolicy, Lsn, Record, ValueLog, VlogConfig};

const USAGE: &str = "usage:
  dpukv-store vlog-writer DIR [--segment-size N] [--fsync always|never|interval:MS] [--batch N]
  dpukv-store vlog-check DIR";

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

fn fsync_policy(s: &str) -> Result<FsyncPolicy> {
    Ok(match s {
        "always" => FsyncPolicy::Always,
        "never" => FsyncPolicy::Never,
        s => match s.strip_prefix("interval:") {
            Some(ms) => FsyncPolicy::Interval(Duration::from_millis(ms.parse()?)),
            None => bail!("bad --fsync {s}"),
        },
    })
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
                log.wait_durable(end);
                let mut o = out.lock();
                writeln!(o, "ack {first} {}", next - 1)?;
                o.flush()?;
            }
        }
        Some("vlog-check") => {
            let (log, report) = ValueLog::open(dir, VlogConfig { segment_size: 64 << 10, fsync: FsyncPolicy::Never })?;
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
        _ => bail!("{USAGE}"),
    }
}
