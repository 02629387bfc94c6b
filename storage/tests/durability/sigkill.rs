//! Killing a writer process at a random moment of its work: the child prints a line per
//! acknowledged write; the kill comes a random delay after its *first* acknowledgement (so every
//! round does work, however slow the machine is to start the process and recover), or — one
//! round in four — a random delay after the spawn, to also kill it during recovery.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A deterministic sequence of kill delays and moments.
pub struct Killer {
    seed: u64,
    round: u32,
}

impl Killer {
    pub fn new(seed: u64) -> Killer {
        Killer { seed, round: 0 }
    }

    /// Runs `cmd` and kills it (SIGKILL) after a delay in `min..min+spread` milliseconds; returns
    /// the highest number `acked` found in its output lines (-1 if none).
    pub fn run(&mut self, cmd: &mut Command, min: u64, spread: u64, acked: fn(&str) -> Option<i64>) -> i64 {
        self.seed = self.seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.round += 1;
        let delay = Duration::from_millis(min + (self.seed >> 33) % spread);
        let from_spawn = self.round.is_multiple_of(4);
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawn");
        let stdout = child.stdout.take().expect("stdout");
        let (first_tx, first) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut last = -1i64;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(n) = acked(&line) {
                    if last < 0 {
                        let _ = first_tx.send(());
                    }
                    last = n;
                }
            }
            last
        });
        if !from_spawn {
            // A writer that never acknowledges anything ends the wait with its output.
            let _ = first.recv_timeout(Duration::from_secs(60));
        }
        std::thread::sleep(delay);
        child.kill().expect("kill");
        child.wait().expect("reap");
        reader.join().expect("reader")
    }
}
