//! Readers in other processes: the `dpukv-arena` tool maps the arena read-only and checks the
//! bank invariant while this process writes heavily; a reader killed mid-read (SIGKILL) must not
//! stop reclamation, and memory must stay bounded.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dpukv_storage::workload::Bank;
use dpukv_storage::{ArenaConfig, Writer};

use crate::common::{Rng, must_writer};

const TOOL: &str = env!("CARGO_BIN_EXE_dpukv-arena");

/// Kills and reaps the child when dropped, so a failing test leaks no process.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn must_spawn_checker(path: &Path, bank: Bank, extra: &[&str]) -> Reaped {
    let mut cmd = Command::new(TOOL);
    cmd.arg("bank-check").arg(path);
    cmd.args(["--accounts", &bank.accounts.to_string(), "--initial", &bank.initial.to_string()]);
    cmd.args(["--pad", &bank.pad.to_string()]);
    cmd.args(extra).stdout(Stdio::piped()).stderr(Stdio::piped());
    Reaped(cmd.spawn().expect("spawn dpukv-arena"))
}

fn transfer_round(w: &mut Writer, bank: Bank, rng: &mut Rng, n: u32) {
    let (from, to) = (rng.below(bank.accounts as u64) as u32, rng.below(bank.accounts as u64) as u32);
    // A bounded filler key space, so live data reaches a steady state.
    let filler = Bank::filler_key(rng.below(bank.accounts as u64) as u32, n % 4);
    let put = rng.below(2) == 0;
    bank.transfer(w, from, to, rng.below(100), Some((&filler, put))).expect("transfer");
}

#[test]
fn readers_in_other_processes_see_consistent_snapshots() {
    // Balances in blobs (past the inline threshold): blob pages are retired and reused under
    // the other processes' snapshots.
    let bank = Bank { accounts: 400, initial: 1000, pad: 600 };
    let (_dir, path, mut w) = must_writer(&ArenaConfig::small_nodes(512));
    bank.init(&mut w).expect("init");
    // One checker reads like the host's CPU, one like the device (page-table copy, node cache).
    let mut checkers: Vec<Reaped> = vec![
        must_spawn_checker(&path, bank, &["--seconds", "3", "--threads", "2"]),
        must_spawn_checker(&path, bank, &["--seconds", "3", "--threads", "2", "--device"]),
    ];
    let mut rng = Rng(9);
    let start = Instant::now();
    let mut n = 0;
    while checkers.iter_mut().any(|c| c.0.try_wait().expect("try_wait").is_none()) {
        transfer_round(&mut w, bank, &mut rng, n);
        n += 1;
        assert!(start.elapsed() < Duration::from_secs(60), "checkers did not finish");
    }
    assert!(n > 1000, "writer made only {n} transfers");
    for c in checkers.iter_mut() {
        let out = std::mem::replace(&mut c.0, Command::new("true").spawn().expect("true"))
            .wait_with_output()
            .expect("output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "checker failed: {stdout} {}", String::from_utf8_lossy(&out.stderr));
        let checks: u64 = stdout
            .trim()
            .strip_prefix("checks=")
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        assert!(checks > 10, "checker ran only {checks} checks: {stdout}");
    }
}

#[test]
fn killed_reader_does_not_block_reclamation() {
    let bank = Bank { accounts: 200, initial: 1000, pad: 0 };
    let (_dir, path, mut w) = must_writer(&ArenaConfig::small_nodes(512));
    bank.init(&mut w).expect("init");
    let mut rng = Rng(11);
    for n in 0..10_000 {
        transfer_round(&mut w, bank, &mut rng, n);
    }
    w.reclaim().expect("reclaim");
    let baseline = w.stats().allocated_bytes;

    // A reader that pins a snapshot and is killed while holding it (as if mid-read), and one
    // killed at a random moment of its read loop.
    let mut holder = must_spawn_checker(&path, bank, &["--hold-ms", "600000"]);
    let mut line = String::new();
    BufReader::new(holder.0.stdout.as_mut().expect("stdout")).read_line(&mut line).expect("read");
    assert!(line.starts_with("pinned"), "holder said {line:?}");
    let looper = must_spawn_checker(&path, bank, &["--seconds", "600"]);
    std::thread::sleep(Duration::from_millis(300));

    // While the holder lives, garbage accumulates: reclamation must wait for it.
    for n in 0..3000 {
        transfer_round(&mut w, bank, &mut rng, n);
    }
    w.reclaim().expect("reclaim");
    let held = w.stats();
    assert!(held.garbage_bytes > 20 * 512, "a pinned reader should hold garbage back: {held:?}");

    drop(holder); // SIGKILL + reap
    drop(looper);
    // After the kill, the writer notices the dead slots and reclaims.
    let deadline = Instant::now() + Duration::from_secs(20);
    for n in 0.. {
        transfer_round(&mut w, bank, &mut rng, n);
        if n % 100 == 0 {
            w.reclaim().expect("reclaim");
            let s = w.stats();
            if s.dead_slots_cleared >= 1 && s.garbage_bytes < 64 * 512 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "reclamation still blocked: {:?}", w.stats());
    }
    // And memory stays bounded from then on.
    for n in 0..20_000 {
        transfer_round(&mut w, bank, &mut rng, n);
    }
    w.reclaim().expect("reclaim");
    let s = w.stats();
    assert!(s.garbage_bytes < 64 * 512, "{s:?}");
    assert!(s.allocated_bytes < baseline * 2, "memory grew from {baseline} to {}: {s:?}", s.allocated_bytes);
    let mut r = w.reader().expect("reader");
    bank.check(&r.snapshot().expect("snapshot"), 1).expect("final check");
}

/// Issue 8, item 1.2: a reader in another pid namespace that stalls while pinned (so it sends no
/// heartbeat) is judged dead after its lease and its slot taken; when it wakes it must learn it
/// was revoked instead of reading memory the writer reused, and its stale unpin must not touch
/// the slot's new owner. (Before: the lease cleared the slot, and the old owner's unpin then
/// cleared the new owner's pin, letting the writer free memory under it.)
#[test]
fn a_revoked_foreign_reader_is_told_and_cannot_touch_the_slots_next_owner() {
    if !Command::new("unshare").args(["--pid", "--fork", "true"]).status().is_ok_and(|s| s.success()) {
        assert!(std::env::var("CI").is_err(), "CI must be able to run a reader in its own pid namespace");
        eprintln!("skipping: cannot unshare a pid namespace here");
        return;
    }
    let bank = Bank { accounts: 100, initial: 1000, pad: 0 };
    let cfg = ArenaConfig { reader_slots: 1, ..ArenaConfig::small_nodes(512) };
    let (_dir, path, mut w) = must_writer(&cfg);
    w.set_reader_lease(Duration::from_millis(300));
    bank.init(&mut w).expect("init");
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", TOOL, "bank-check"]).arg(&path);
    // The reader holds its pin until told to wake (below, once its slot has a new owner).
    let wake = path.with_extension("wake");
    cmd.args(["--accounts", "100", "--initial", "1000", "--hold-ms", "60000", "--hold-until"]).arg(&wake);
    cmd.stdout(Stdio::piped());
    let mut child = Reaped(cmd.spawn().expect("spawn a reader in its own pid namespace"));
    let mut out = BufReader::new(child.0.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    assert!(line.starts_with("pinned"), "the reader said {line:?}");
    // The reader sleeps holding its pin; the writer retires garbage and, once the lease is over,
    // takes the slot.
    let mut rng = Rng(5);
    let deadline = Instant::now() + Duration::from_secs(10);
    for n in 0.. {
        transfer_round(&mut w, bank, &mut rng, n);
        if n % 50 == 0 {
            w.reclaim().expect("reclaim");
            if w.stats().dead_slots_cleared >= 1 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the stalled reader's slot was never taken: {:?}", w.stats());
    }
    // A new owner takes the only slot and pins.
    let mut mine = w.reader().expect("the freed slot is claimable");
    let snap = mine.snapshot().expect("snapshot");
    let version = snap.version();
    std::fs::write(&wake, b"").expect("wake the stalled reader");
    let rest: Vec<String> = out.lines().map(|l| l.expect("line")).collect();
    assert!(rest.iter().any(|l| l == "after-hold revoked"), "the woken reader must learn it was revoked: {rest:?}");
    assert!(rest.iter().any(|l| l.starts_with("repin failed")), "no slot is free for it now: {rest:?}");
    // The stale owner's unpin left the new owner's pin alone: still valid, still protecting its
    // version while the writer goes on.
    for n in 0..3000 {
        transfer_round(&mut w, bank, &mut rng, n);
    }
    w.reclaim().expect("reclaim");
    assert!(snap.valid(), "the new owner's pin survived the old owner's unpin");
    assert_eq!(snap.version(), version);
    bank.check(&snap, 1).expect("the pinned snapshot still reads a consistent bank");
}

/// Issue 8, item 1.3: readers killed between operations (a device in a crash loop) used to keep
/// their slots forever; after as many deaths as slots, every new reader got `NoReaderSlot`.
#[test]
fn readers_killed_while_idle_do_not_exhaust_the_slots() {
    let cfg = ArenaConfig { reader_slots: 4, ..ArenaConfig::small_nodes(512) };
    let (_dir, path, mut w) = must_writer(&cfg);
    w.put(b"k", b"v").expect("put");
    for i in 0..12 {
        let mut cmd = Command::new(TOOL);
        cmd.arg("bank-check").arg(&path).args(["--hold-ms", "60000", "--idle"]).stdout(Stdio::piped());
        let mut child = Reaped(cmd.spawn().expect("spawn"));
        let mut line = String::new();
        BufReader::new(child.0.stdout.as_mut().expect("stdout")).read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "ready", "reader {i} could not claim a slot: {line:?}");
        drop(child); // SIGKILL while idle
    }
    let mut r = dpukv_storage::Reader::open(&path).expect("a slot for a new reader");
    assert_eq!(r.snapshot().expect("snapshot").get(b"k").expect("get"), Some(&b"v"[..]));
    // The writer's sweep frees the remaining dead slots too.
    let deadline = Instant::now() + Duration::from_secs(20);
    while w.stats().dead_slots_cleared < 3 {
        w.put(b"k", b"v").expect("put");
        w.reclaim().expect("reclaim");
        assert!(Instant::now() < deadline, "idle slots of dead readers were not swept: {:?}", w.stats());
        std::thread::sleep(Duration::from_millis(50));
    }
}
