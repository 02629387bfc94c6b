//! Value-log tests.

use std::process::Command;
use std::time::{Duration, Instant};

use dpukv_storage::Error;
use dpukv_storage::vlog::{FsyncPolicy, Lsn, Record, ValueLog, VlogConfig};

use crate::sigkill::Killer;

const TOOL: &str = env!("CARGO_BIN_EXE_dpukv-store");

fn cfg(fsync: FsyncPolicy) -> VlogConfig {
    VlogConfig { segment_size: 8192, fsync, ..VlogConfig::default() }
}

fn value(i: u64) -> Vec<u8> {
    (0..(i * 37 % 700) as usize).map(|j| (i as usize ^ j) as u8).collect()
}

fn must_fill(dir: &std::path::Path, n: u64) -> Vec<(Lsn, u64)> {
    let (mut log, _) = ValueLog::open(dir, cfg(FsyncPolicy::Never)).expect("open");
    let mut ptrs = Vec::new();
    for i in 0..n {
        let key = format!("key{i}");
        let v = value(i);
        let rec = if i % 11 == 5 { Record::delete(i, key.as_bytes()) } else { Record::put(i, key.as_bytes(), &v) };
        ptrs.push((log.append(&rec).expect("append"), i));
        if i % 3 == 0 {
            log.commit().expect("commit");
        }
    }
    log.commit().expect("commit");
    ptrs
}

fn must_replay(dir: &std::path::Path) -> Vec<(Lsn, u64, bool, Vec<u8>)> {
    let (log, _) = ValueLog::open(dir, cfg(FsyncPolicy::Never)).expect("reopen");
    let mut out = Vec::new();
    log.replay(Lsn(0), |at, r| {
        out.push((at, r.version, r.tombstone, r.value.to_vec()));
        Ok(())
    })
    .expect("replay");
    out
}

#[test]
fn round_trip_across_segments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ptrs = must_fill(dir.path(), 300);
    let (log, report) = ValueLog::open(dir.path(), cfg(FsyncPolicy::Never)).expect("reopen");
    assert_eq!(report.truncated_bytes, 0);
    assert!(log.segments().len() > 5, "records should span many segments");
    for (ptr, i) in &ptrs {
        let r = log.read(*ptr).expect("read");
        assert_eq!(r.version, *i);
        assert_eq!(r.key.as_ref(), format!("key{i}").as_bytes());
        if i % 11 == 5 {
            assert!(r.tombstone);
        } else {
            assert_eq!(r.value.as_ref(), value(*i).as_slice());
        }
    }
    let all = must_replay(dir.path());
    assert_eq!(all.iter().map(|r| r.1).collect::<Vec<_>>(), (0..300).collect::<Vec<_>>());
    assert_eq!(all.iter().map(|r| r.0).collect::<Vec<_>>(), ptrs.iter().map(|p| p.0).collect::<Vec<_>>());
    // Replay from the middle starts exactly there.
    let mid = ptrs[150].0;
    let mut first = None;
    log.replay(mid, |at, _| {
        first.get_or_insert(at);
        Ok(())
    })
    .expect("replay");
    assert_eq!(first, Some(mid));
    // A record too large for a segment is a typed error.
    let (mut log, _) = ValueLog::open(dir.path(), cfg(FsyncPolicy::Never)).expect("reopen");
    assert!(matches!(log.append(&Record::put(1, b"k", &[0; 9000])), Err(Error::BatchTooLarge { .. })));
}

fn last_segment(dir: &std::path::Path) -> std::path::PathBuf {
    let mut v: Vec<_> = std::fs::read_dir(dir).expect("dir").map(|e| e.expect("entry").path()).collect();
    v.sort();
    v.pop().expect("a segment")
}

/// Where the records of a segment image end (segments are allocated whole: zeros follow).
fn used(bytes: &[u8]) -> usize {
    bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    for e in std::fs::read_dir(from).expect("dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

#[test]
fn torn_tail_is_cut_at_the_last_valid_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ptrs = must_fill(dir.path(), 200);
    let full = must_replay(dir.path());
    let last = last_segment(dir.path());
    let bytes = std::fs::read(&last).expect("read");
    let end = used(&bytes);
    // A cut inside a record halfway through the last segment (a cut at a record boundary would be
    // a clean prefix with nothing torn).
    let last_seg = ptrs.iter().map(|(l, _)| l.segment()).max().expect("records");
    let in_last: Vec<u32> = ptrs.iter().filter(|(l, _)| l.segment() == last_seg).map(|(l, _)| l.offset()).collect();
    let mid = in_last[in_last.len() / 2] as usize + 3;
    for cut in [end - 1, end - 10, mid, 33, 32] {
        let d2 = tempfile::tempdir().expect("tempdir");
        copy_dir(dir.path(), d2.path());
        std::fs::write(d2.path().join(last.file_name().expect("name")), &bytes[..cut]).expect("truncate");
        let (_, report) = ValueLog::open(d2.path(), cfg(FsyncPolicy::Never)).expect("recover");
        let got = must_replay(d2.path());
        assert!(got.len() < full.len() && full[..got.len()] == got[..], "cut at {cut}: a prefix survives");
        // (A tail whose torn bytes are all zero — a cut 1 byte into a record whose first byte is
        // 0 — looks like the never-written rest of the segment: nothing to zero, nothing counted.)
        let torn_bytes_all_zero = used(&bytes[..cut]) <= 32;
        assert!(
            report.truncated_bytes > 0 || torn_bytes_all_zero || got.len() + 1 >= full.len(),
            "cut at {cut}: {report:?}"
        );
        // The log keeps working after recovery, and what it cut stays gone.
        let (mut log, _) = ValueLog::open(d2.path(), cfg(FsyncPolicy::Never)).expect("reopen");
        let p = log.append(&Record::put(999, b"after", b"tear")).expect("append");
        log.commit().expect("commit");
        assert_eq!(log.read(p).expect("read").value.as_ref(), b"tear");
        drop(log);
        let again = must_replay(d2.path());
        assert_eq!(again.len(), got.len() + 1, "cut at {cut}: only the new record follows the survivors");
    }
}

/// Writes groups under fsync `always` (so every commit marker records a durable position) and
/// returns the directory, the records' positions and the durable end of the last full group.
fn must_fill_synced(groups: u64) -> (tempfile::TempDir, Vec<Lsn>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = ValueLog::open(dir.path(), cfg(FsyncPolicy::Always)).expect("open");
    let mut ptrs = Vec::new();
    for g in 0..groups {
        for j in 0..3 {
            let i = g * 3 + j;
            ptrs.push(log.append(&Record::put(i, format!("key{i}").as_bytes(), &value(i % 7))).expect("append"));
        }
        let end = log.commit().expect("commit");
        log.wait_durable(end).expect("durable");
    }
    (dir, ptrs)
}

/// After a power loss the unsynced pages of the last writes reach the disk in any order: an
/// invalid record may be followed by valid ones. Past the last durable position that is a torn
/// tail (recovered); before it, the same damage is corruption of acknowledged data (reported,
/// naming the file and offset).
#[test]
fn a_tear_after_the_durable_position_recovers_one_before_it_is_reported() {
    let (dir, ptrs) = must_fill_synced(12);
    let last = last_segment(dir.path());
    let bytes = std::fs::read(&last).expect("read");
    let in_last: Vec<Lsn> =
        ptrs.iter().copied().filter(|p| p.segment() == ptrs.last().expect("ptr").segment()).collect();
    assert!(in_last.len() >= 9, "the last segment holds several groups");
    // Damage a record of the last group (its marker, written after the previous group's sync,
    // says only what came before it is durable) but leave a valid record after it.
    let victim = in_last[in_last.len() - 2].offset() as usize;
    let d2 = tempfile::tempdir().expect("tempdir");
    copy_dir(dir.path(), d2.path());
    let mut b = bytes.clone();
    b[victim + 30] ^= 0x40;
    std::fs::write(d2.path().join(last.file_name().expect("name")), &b).expect("write");
    let (log, report) = ValueLog::open(d2.path(), cfg(FsyncPolicy::Never)).expect("a torn tail recovers");
    assert!(report.truncated_bytes > 0);
    assert_eq!(log.end(), Lsn::new(in_last[0].segment(), victim as u32), "cut exactly at the damaged record");
    drop(log);
    // Damage a record of the first group of the segment: later markers prove it was durable.
    let victim = in_last[1].offset() as usize;
    let d3 = tempfile::tempdir().expect("tempdir");
    copy_dir(dir.path(), d3.path());
    let mut b = bytes;
    b[victim + 30] ^= 0x40;
    let victim_path = d3.path().join(last.file_name().expect("name"));
    std::fs::write(&victim_path, &b).expect("write");
    match ValueLog::open(d3.path(), cfg(FsyncPolicy::Never)) {
        Err(Error::CorruptFile { path, offset, .. }) => {
            assert_eq!(path, victim_path);
            assert_eq!(offset, victim as u64, "the error names where the damage is");
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("damage inside the durable part must be reported, not cut off"),
    }
}

#[test]
fn corruption_is_reported_or_recovered_never_a_wrong_value() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ptrs = must_fill(dir.path(), 200);
    let files: Vec<_> = {
        let mut v: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").map(|e| e.expect("e").path()).collect();
        v.sort();
        v
    };
    let mut seed = 1u64;
    let mut reported = 0;
    for round in 0..120 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let d2 = tempfile::tempdir().expect("tempdir");
        for f in &files {
            std::fs::copy(f, d2.path().join(f.file_name().expect("name"))).expect("copy");
        }
        let victim = d2.path().join(files[(seed >> 33) as usize % files.len()].file_name().expect("name"));
        let mut b = std::fs::read(&victim).expect("read");
        let at = (seed >> 13) as usize % b.len();
        b[at] ^= 1 << (seed % 8);
        std::fs::write(&victim, &b).expect("write");
        let r = std::panic::catch_unwind(|| match ValueLog::open(d2.path(), cfg(FsyncPolicy::Never)) {
            Err(Error::CorruptFile { path, .. }) => {
                assert_eq!(path, victim, "the error names the damaged file");
                true
            }
            Err(e) => panic!("round {round}: unexpected error {e}"),
            Ok((log, _)) => {
                // Recovered (a tear at the tail): every record that reads back is the one written.
                for (p, i) in &ptrs {
                    if let Ok(r) = log.read(*p) {
                        assert_eq!(r.version, *i, "round {round}: wrong record at {p:?}");
                        if !r.tombstone {
                            assert_eq!(r.value.as_ref(), value(*i).as_slice(), "round {round}");
                        }
                    }
                }
                false
            }
        });
        reported += r.expect("no panic on corrupt value log") as u32;
    }
    assert!(reported > 60, "most flips should be reported, got {reported}");
}

#[test]
fn interval_policy_acknowledges_at_once_and_syncs_soon() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = ValueLog::open(dir.path(), cfg(FsyncPolicy::Interval(Duration::from_millis(5)))).expect("open");
    let start = log.synced_lsn();
    log.append(&Record::put(1, b"k", b"v")).expect("append");
    let end = log.commit().expect("commit");
    assert!(end > start);
    log.wait_durable(end).expect("acknowledged once written");
    let t = Instant::now();
    while log.synced_lsn() < end {
        assert!(t.elapsed() < Duration::from_secs(5), "the flusher syncs within the interval");
        std::thread::sleep(Duration::from_millis(1));
    }
    // From another thread too.
    let waiter = log.durability();
    log.append(&Record::put(2, b"k2", b"v")).expect("append");
    let end = log.commit().expect("commit");
    std::thread::spawn(move || waiter.sync_to(end)).join().expect("waiter").expect("synced");
    assert!(log.synced_lsn() >= end);
    // A stream of writes (a write wakes the flusher only when it is the first unsynced one): each
    // is synced within the interval of the first unsynced write before it, the last one too.
    for i in 0..200u32 {
        log.append(&Record::put(3, &i.to_be_bytes(), b"v")).expect("append");
        let end = log.commit().expect("commit");
        log.wait_durable(end).expect("acknowledged once written");
        if i % 50 == 49 {
            let t = Instant::now();
            while log.synced_lsn() < end {
                assert!(t.elapsed() < Duration::from_secs(5), "write {i} was never synced");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    assert!(matches!(ValueLog::open(dir.path(), cfg(FsyncPolicy::Interval(Duration::ZERO))), Err(Error::Config(_))));
}

/// A child process appends with fsync=always and prints each acknowledged batch; it is killed
/// with SIGKILL at random moments. Every acknowledged record must survive, in order.
#[test]
fn sigkill_loses_no_acknowledged_record() {
    let iterations: u32 = std::env::var("DPUKV_CRASH_ITERATIONS").ok().and_then(|s| s.parse().ok()).unwrap_or(25);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut acked: i64 = -1;
    let mut killer = Killer::new(7);
    let mut it = 0;
    while it < iterations || (acked <= 50 && it < iterations * 4) {
        let mut cmd = Command::new(TOOL);
        cmd.args(["vlog-writer", dir.path().to_str().expect("utf8"), "--segment-size", "16384", "--batch", "3"]);
        let last = killer.run(&mut cmd, 20, 150, |line| line.split(' ').nth(2).and_then(|s| s.parse().ok()));
        acked = acked.max(last);
        let out = Command::new(TOOL).args(["vlog-check", dir.path().to_str().expect("utf8")]).output().expect("check");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "iteration {it}: {text} {}", String::from_utf8_lossy(&out.stderr));
        let records: i64 = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("records="))
            .and_then(|s| s.parse().ok())
            .expect("records");
        assert!(records > acked, "iteration {it}: {records} records survive but {} were acknowledged", acked + 1);
        it += 1;
    }
    assert!(acked > 50, "the writer acknowledged only {acked} records");
}

/// Where a backup may resume: every segment from its position to the end is here, and its
/// position lies within its segment. A copy that reaches past a sealed segment's end (its
/// primary lost the end of that segment in a power loss, then sealed it shorter) cannot be
/// continued: the sender once read past the segment's end on every connection, forever.
#[test]
fn a_tail_continues_only_from_positions_inside_its_log() {
    use dpukv_storage::region::{Region, RegionConfig};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = Region::open(RegionConfig::tiny(dir.path().join("d"), dir.path().join("s"), FsyncPolicy::Never))
        .expect("open")
        .0;
    while r.vlog().segments().len() < 3 {
        r.put(b"k", &[7u8; 200]).expect("put");
    }
    let tail = r.vlog().tail();
    let (first, end) = (r.vlog().segments()[0], tail.end());
    assert!(tail.continues_from(Lsn::new(first, 0)).expect("check"));
    assert!(tail.continues_from(end).expect("check"));
    assert!(!tail.continues_from(Lsn(end.0 + 1)).expect("check"), "past the end");
    assert!(!tail.continues_from(Lsn::new(first, u32::MAX >> 1)).expect("check"), "past its sealed segment's end");
    assert!(!tail.continues_from(Lsn::new(first - 1, 0)).expect("check"), "a segment that is not here");
}

/// Under `always`, what the writer writes under a sync hold is its own to sync: the flusher
/// leaves it alone (it is not acknowledged meanwhile) until the writer syncs it on its own thread
/// or hands it over.
#[test]
fn held_writes_are_synced_by_the_writer_or_handed_to_the_flusher() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = ValueLog::open(dir.path(), cfg(FsyncPolicy::Always)).expect("open");
    let waiter = log.durability();
    let synced_by = |log: &ValueLog, at: Lsn| {
        let t = Instant::now();
        while log.synced_lsn() < at {
            assert!(t.elapsed() < Duration::from_secs(5), "{at:?} was never synced");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    log.append(&Record::put(1, b"a", b"v")).expect("append");
    let before = log.commit().expect("commit");
    // (A sync covers what the file holds when it starts: wait for it before writing under a hold.)
    synced_by(&log, before);
    log.hold_sync();
    log.append(&Record::put(2, b"b", b"v")).expect("append");
    let held = log.commit().expect("commit");
    std::thread::sleep(Duration::from_millis(50));
    assert!(log.synced_lsn() < held, "the flusher synced a held write");
    assert!(!waiter.acknowledged(held), "a held write was acknowledged unsynced");
    let flusher = log.sync_counts().flusher;
    log.sync_held();
    assert!(log.synced_lsn() >= held && waiter.acknowledged(held), "synced by the writer");
    assert_eq!(log.sync_counts().writer, 1);
    // Handed over instead: the flusher syncs it.
    log.hold_sync();
    log.append(&Record::put(3, b"c", b"v")).expect("append");
    let handed = log.commit().expect("commit");
    std::thread::sleep(Duration::from_millis(20));
    assert!(log.synced_lsn() < handed, "the flusher synced a held write");
    log.unhold_sync();
    log.wait_durable(handed).expect("the flusher syncs what was handed over");
    assert!(log.sync_counts().flusher > flusher);
    assert_eq!(log.sync_counts().writer, 1);
    // Under the other policies a hold changes nothing.
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut log, _) = ValueLog::open(dir.path(), cfg(FsyncPolicy::Interval(Duration::from_millis(2)))).expect("open");
    log.hold_sync();
    log.append(&Record::put(1, b"a", b"v")).expect("append");
    let end = log.commit().expect("commit");
    log.sync_held();
    assert_eq!(log.sync_counts().writer, 0, "no hold, nothing for the writer to sync");
    synced_by(&log, end);
}

/// Syncs of the log never overlap: of two overlapping syncs of one file Linux may report a
/// writeback error to one and success to the other, and the success, seen first, would count
/// pages the failure dropped as synced. Found in review of the writer's own syncs: a writer
/// ending a hold synced while the flusher's sync of what it handed over was still in flight. On a
/// slow disk (every sync 3 ms), a writer hands a group to the flusher and at once syncs the next
/// itself, many times: no sync may begin while another is in flight.
#[test]
fn the_writer_and_the_flusher_never_sync_at_once() {
    use dpukv_storage::fs::FaultFs;
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = FaultFs::new(1);
    fs.set_sync_delay(Duration::from_millis(3));
    let (mut log, _) =
        ValueLog::open(dir.path(), VlogConfig { fs: fs.as_fs(), ..cfg(FsyncPolicy::Always) }).expect("open");
    let mut end = log.end();
    for i in 0..40u64 {
        log.hold_sync();
        log.append(&Record::put(2 * i + 1, b"a", b"v")).expect("append");
        log.commit().expect("commit");
        let began = log.sync_counts().flusher;
        log.unhold_sync();
        // The flusher's sync of it begins (counted as it starts; it takes 3 ms): what is written
        // next it cannot cover, and the writer syncs that itself.
        let t = Instant::now();
        while log.sync_counts().flusher == began {
            assert!(t.elapsed() < Duration::from_secs(5), "the flusher never synced what was handed over");
            std::thread::sleep(Duration::from_micros(100));
        }
        log.hold_sync();
        log.append(&Record::put(2 * i + 2, b"b", b"v")).expect("append");
        end = log.commit().expect("commit");
        log.sync_held();
    }
    log.wait_durable(end).expect("durable");
    let (syncs, stats) = (log.sync_counts(), fs.stats());
    assert!(syncs.writer >= 40 && syncs.flusher >= 40, "both synced, each round: {syncs:?}");
    assert_eq!(stats.overlapping_syncs, 0, "{syncs:?} {stats:?}");
}
