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
    let bank = Bank { accounts: 400, initial: 1000 };
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
    let bank = Bank { accounts: 200, initial: 1000 };
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
