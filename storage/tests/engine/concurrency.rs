//! One writer and several reader threads: the writer moves amounts between accounts in atomic
//! batches (and inserts/deletes filler keys so leaves split and merge under the readers); every
//! reader snapshot must see every account and exactly the total, and versions never go back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dpukv_storage::workload::Bank;
use dpukv_storage::{ArenaConfig, Reader};

use crate::common::{Rng, must_writer};

/// Runs the bank workload: `transfers` batches by the writer while `readers` threads check.
/// Returns the number of checks done.
pub fn must_run_bank(cfg: &ArenaConfig, bank: Bank, transfers: u32, readers: usize) -> u64 {
    run_bank(cfg, bank, transfers, readers, false)
}

/// The bank workload with readers in CPU mode (the arena's page table) or device mode (their own
/// page-table copy fed by the command ring).
fn run_bank(cfg: &ArenaConfig, bank: Bank, transfers: u32, readers: usize, device: bool) -> u64 {
    let (_dir, path, mut w) = must_writer(cfg);
    bank.init(&mut w).expect("init");
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..readers {
        let mut r =
            if device { Reader::open_device(&path).expect("device reader") } else { w.reader().expect("reader") };
        let stop = stop.clone();
        handles.push(std::thread::spawn(move || {
            let mut last = 0;
            let mut checks = 0u64;
            loop {
                // Check once more after the writer stops, so even a fast writer meets a reader.
                let done = stop.load(Ordering::Acquire);
                let snap = r.snapshot().expect("snapshot");
                let c =
                    bank.check(&snap, (checks as u32 * 7 + t as u32) % bank.accounts).unwrap_or_else(|e| panic!("{e}"));
                assert!(c.version >= last, "read version went backwards: {} after {last}", c.version);
                last = c.version;
                checks += 1;
                if done {
                    return checks;
                }
            }
        }));
    }
    let mut rng = Rng(42);
    let mut fillers: Vec<Vec<u8>> = Vec::new();
    for n in 0..transfers {
        let (from, to) = (rng.below(bank.accounts as u64) as u32, rng.below(bank.accounts as u64) as u32);
        let filler;
        let f = if rng.below(2) == 0 || fillers.is_empty() {
            filler = Bank::filler_key(rng.below(bank.accounts as u64) as u32, n);
            fillers.push(filler.clone());
            Some((filler.as_slice(), true))
        } else {
            let i = rng.below(fillers.len() as u64) as usize;
            filler = fillers.swap_remove(i);
            Some((filler.as_slice(), false))
        };
        bank.transfer(&mut w, from, to, rng.below(500), f).expect("transfer");
    }
    stop.store(true, Ordering::Release);
    let checks: u64 = handles.into_iter().map(|h| h.join().expect("reader thread")).sum();
    // The writer sees the invariant too.
    let mut r = w.reader().expect("reader");
    bank.check(&r.snapshot().expect("snapshot"), 0).expect("final check");
    checks
}

#[test]
fn bank_invariant_small_nodes() {
    let checks =
        must_run_bank(&ArenaConfig::small_nodes(512), Bank { accounts: 300, initial: 1000, pad: 0 }, 20_000, 3);
    assert!(checks > 10, "readers ran only {checks} checks");
}

/// Balances in blobs: every transfer retires two blobs; readers check each balance's bytes, so
/// a blob reclaimed (and its pages reused) under a pinned reader is caught.
#[test]
fn bank_invariant_with_blob_values() {
    let checks =
        must_run_bank(&ArenaConfig::small_nodes(512), Bank { accounts: 300, initial: 1000, pad: 700 }, 20_000, 3);
    assert!(checks > 10, "readers ran only {checks} checks");
}

#[test]
fn bank_invariant_default_nodes() {
    let checks = must_run_bank(
        &ArenaConfig { capacity: 256 << 20, ..ArenaConfig::default() },
        Bank { accounts: 2000, initial: 50, pad: 0 },
        20_000,
        2,
    );
    assert!(checks > 10, "readers ran only {checks} checks");
}

#[test]
fn bank_invariant_device_readers() {
    let checks =
        run_bank(&ArenaConfig::small_nodes(512), Bank { accounts: 300, initial: 1000, pad: 0 }, 20_000, 3, true);
    assert!(checks > 10, "readers ran only {checks} checks");
}

/// A device reader that falls more than a whole command ring behind copies the page table again
/// and still reads exactly its snapshot.
#[test]
fn device_reader_resyncs_after_a_ring_overrun() {
    let bank = Bank { accounts: 200, initial: 1000, pad: 0 };
    let (_dir, path, mut w) = must_writer(&ArenaConfig::small_nodes(512));
    bank.init(&mut w).expect("init");
    let mut r = Reader::open_device(&path).expect("device reader");
    bank.check(&r.snapshot().expect("snapshot"), 0).expect("first check");
    let mut rng = Rng(5);
    let mut fillers = 0u32;
    // Plenty of splits, merges and rewrites: far more page-table changes than the ring holds.
    for n in 0..30_000u32 {
        let f = Bank::filler_key(rng.below(200) as u32, n % 64);
        bank.transfer(&mut w, rng.below(200) as u32, rng.below(200) as u32, rng.below(50), Some((&f, n % 3 != 0)))
            .expect("transfer");
        fillers += 1;
    }
    let before = r.stats();
    bank.check(&r.snapshot().expect("snapshot"), 1).expect("check after the overrun");
    let after = r.stats();
    assert!(
        after.resyncs > before.resyncs,
        "the reader should have resynchronized: {before:?} -> {after:?} ({fillers} writes)"
    );
    // Then it keeps up through the ring.
    for n in 0..50u32 {
        bank.transfer(&mut w, n % 200, (n * 7) % 200, 1, None).expect("transfer");
        bank.check(&r.snapshot().expect("snapshot"), n % 200).expect("check");
    }
    let last = r.stats();
    assert_eq!(last.resyncs, after.resyncs, "no further resync while keeping up");
    assert!(last.commands > after.commands, "changes arrive through the ring");
    assert!(last.node_visits > 0);
    assert!(last.cache_hits > after.cache_hits, "interior nodes come from the node cache: {last:?}");
}
