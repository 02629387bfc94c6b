//! Reader slots in the arena: how readers in any process take part in epoch-based reclamation.
//!
//! Each reader thread owns one 64-byte slot. While it runs an operation the slot holds the read
//! version it pinned (plus one; zero means idle). The writer frees garbage retired at version `v`
//! only when every pinned slot holds a version `>= v`. A slot whose owner process died is detected
//! by pid + process start time (same pid namespace) or by an expired heartbeat lease (a reader in
//! another pid namespace), and cleared, so a killed reader cannot block reclamation forever.

use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::Arena;
use super::layout::{SB_READ_VERSION, SLOT_SIZE};
use crate::error::{Error, Result};

const S_OWNER: u64 = 0;
const S_EPOCH: u64 = 8;
const S_START: u64 = 16;
const S_PIDNS: u64 = 24;
const S_HEARTBEAT: u64 = 32;

/// How long a reader in a foreign pid namespace may hold one pinned version.
pub(crate) const FOREIGN_LEASE: Duration = Duration::from_secs(30);
/// How long a pinned slot may hold back reclamation before the writer checks its owner is alive.
const SUSPECT_AFTER: Duration = Duration::from_millis(100);

static CLAIMS: AtomicU32 = AtomicU32::new(1);

/// Start time of process `pid` in clock ticks since boot (field 22 of /proc/PID/stat).
pub(crate) fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    // Fields after the command start at field 3 (state); start time is field 22.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Inode of this process's pid namespace (0 if unknown).
pub(crate) fn own_pidns() -> u64 {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|p| {
            let s = p.to_string_lossy().into_owned();
            s.trim_start_matches("pid:[").trim_end_matches(']').parse().ok()
        })
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A claimed reader slot.
#[derive(Debug)]
pub(crate) struct Slot {
    off: u64,
    owner: u64,
}

impl Arena {
    fn slot_off(&self, i: u32) -> u64 {
        self.layout.slots_off + i as u64 * SLOT_SIZE
    }

    /// Claims a free slot for the calling thread. Bounded: one pass over the slot array.
    pub(crate) fn claim_slot(&self) -> Result<Slot> {
        let pid = std::process::id();
        let owner = (pid as u64) << 32 | CLAIMS.fetch_add(1, Ordering::Relaxed).max(1) as u64;
        let start = proc_start_time(pid).unwrap_or(0);
        for i in 0..self.layout.slots_count {
            let off = self.slot_off(i);
            let w = self.map.slot_word(off + S_OWNER)?;
            if w.load(Ordering::Relaxed) == 0
                && w.compare_exchange(0, owner, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                self.map.slot_word(off + S_EPOCH)?.store(0, Ordering::Relaxed);
                self.map.slot_word(off + S_START)?.store(start, Ordering::Relaxed);
                self.map.slot_word(off + S_PIDNS)?.store(own_pidns(), Ordering::Relaxed);
                self.map.slot_word(off + S_HEARTBEAT)?.store(now_ms(), Ordering::Release);
                return Ok(Slot { off, owner });
            }
        }
        Err(Error::NoReaderSlot(self.layout.slots_count))
    }

    /// Gives a slot back.
    pub(crate) fn release_slot(&self, slot: &Slot) {
        if let (Ok(e), Ok(o)) = (self.map.slot_word(slot.off + S_EPOCH), self.map.slot_word(slot.off + S_OWNER)) {
            e.store(0, Ordering::Release);
            // Only clear the owner if the writer did not already reclaim the slot as dead.
            let _ = o.compare_exchange(slot.owner, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// Pins the current read version in `slot` and returns it. Wait-free: two loads, one store,
    /// one fence.
    #[inline]
    pub(crate) fn pin(&self, slot: &Slot) -> Result<u64> {
        let rv_word = self.map.word(SB_READ_VERSION)?;
        let guess = rv_word.load(Ordering::Acquire);
        self.map.slot_word(slot.off + S_EPOCH)?.store(guess + 1, Ordering::Relaxed);
        // Dekker-style handshake with `min_pinned`: either the writer sees our pin, or we see
        // every version it released before scanning (so we never reach what it frees).
        fence(Ordering::SeqCst);
        Ok(rv_word.load(Ordering::Acquire))
    }

    /// Ends the operation pinned in `slot`.
    #[inline]
    pub(crate) fn unpin(&self, slot: &Slot) {
        if let Ok(w) = self.map.slot_word(slot.off + S_EPOCH) {
            w.store(0, Ordering::Release);
        }
    }
}

/// Writer-side bookkeeping for slots that hold reclamation back.
#[derive(Default)]
pub(crate) struct SlotWatch {
    suspects: Vec<(u64, u64, Instant)>,
    pidns: u64,
    /// Dead slots cleared so far.
    pub(crate) cleared: u64,
}

impl SlotWatch {
    pub(crate) fn new() -> Self {
        SlotWatch { suspects: Vec::new(), pidns: own_pidns(), cleared: 0 }
    }

    /// The oldest version any live reader may be using, capped by the current read version.
    /// Slots pinned below `wanted` for a while have their owner checked; dead owners are cleared.
    pub(crate) fn min_pinned(&mut self, arena: &Arena, wanted: u64) -> Result<u64> {
        // The read version is loaded *before* the fence: it may have been published by another
        // thread, and only a value read before the fence is one every reader that pins after the
        // fence is guaranteed to see (or a newer one) when this scan misses its pin.
        let mut min = arena.map.word(SB_READ_VERSION)?.load(Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let now = Instant::now();
        for i in 0..arena.layout.slots_count {
            let off = arena.slot_off(i);
            let epoch = arena.map.word(off + S_EPOCH)?.load(Ordering::SeqCst);
            if epoch == 0 {
                continue;
            }
            let pinned = epoch - 1;
            if pinned >= wanted {
                min = min.min(pinned);
                continue;
            }
            let owner = arena.map.word(off + S_OWNER)?.load(Ordering::Acquire);
            let since = match self.suspects.iter_mut().find(|s| s.0 == off) {
                Some(s) if s.1 == epoch ^ owner => s.2,
                Some(s) => {
                    *s = (off, epoch ^ owner, now);
                    now
                }
                None => {
                    self.suspects.push((off, epoch ^ owner, now));
                    now
                }
            };
            let stuck = now.duration_since(since);
            if stuck >= SUSPECT_AFTER && !self.owner_alive(arena, off, owner, stuck)? {
                // Clear the epoch first, then free the slot for a new owner.
                arena.map.word(off + S_EPOCH)?.store(0, Ordering::Release);
                let _ = arena.map.word(off + S_OWNER)?.compare_exchange(owner, 0, Ordering::AcqRel, Ordering::Relaxed);
                self.suspects.retain(|s| s.0 != off);
                self.cleared += 1;
                continue;
            }
            min = min.min(pinned);
        }
        Ok(min)
    }

    fn owner_alive(&self, arena: &Arena, off: u64, owner: u64, stuck: Duration) -> Result<bool> {
        if owner == 0 {
            return Ok(true);
        }
        let pid = (owner >> 32) as u32;
        let start = arena.map.word(off + S_START)?.load(Ordering::Relaxed);
        let ns = arena.map.word(off + S_PIDNS)?.load(Ordering::Relaxed);
        if ns != 0 && ns == self.pidns {
            // Same namespace: the pid must exist and be the same process (not a reused pid).
            return Ok(start == 0 || proc_start_time(pid) == Some(start));
        }
        // Another namespace: its pids mean nothing here; fall back to the lease.
        Ok(stuck < FOREIGN_LEASE)
    }
}
