//! Reader slots: how readers in any process take part in epoch-based reclamation — of an arena's
//! buffers (the pinned value is a read version) or of a region's files (a table-set generation).
//!
//! A slot is 64 bytes: a **state word**, then the owner's pid, process start time, pid namespace
//! and a heartbeat (milliseconds since the epoch, stored at every pin). The state word packs a
//! 16-bit **generation**, a 2-bit kind (`FREE`, `IDLE`, `PINNED`) and a 46-bit value (the pinned
//! value modulo 2^46; the reclaimer rebuilds it from the current value, which is never 2^45 ahead
//! of a live pin). Every transition is a compare-and-swap on the whole word, and claiming a slot
//! bumps its generation, so an owner whose slot was taken from it (its pin revoked, or the slot
//! reclaimed and claimed by another) can never change it again: its next pin or unpin fails and it
//! claims a new slot.
//!
//! **Liveness.** The reclaimer frees garbage a pinned value still protects only once it knows the
//! owner is dead: in the same pid namespace, by pid and process start time (exact — a live reader,
//! even a stopped one, is never revoked); in another namespace, once its heartbeat is older than
//! [`FOREIGN_LEASE`]. Slots of dead owners that are *idle* are reclaimed too (by the reclaimer,
//! and by a reader that finds no free slot), so a reader in a crash loop cannot exhaust them.
//! A revoked reader notices at its next pin, unpin or validity check and discards what it read.

use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::Mapping;
use super::layout::SLOT_SIZE;
use crate::error::{Error, Result};

const S_STATE: u64 = 0;
const S_PID: u64 = 8;
const S_START: u64 = 16;
const S_PIDNS: u64 = 24;
const S_HEARTBEAT: u64 = 32;

const KIND_FREE: u64 = 0;
const KIND_IDLE: u64 = 1;
const KIND_PINNED: u64 = 2;
const VALUE_BITS: u32 = 46;
const VALUE_MASK: u64 = (1 << VALUE_BITS) - 1;

/// How long a reader in a foreign pid namespace may go without a heartbeat before its slot is
/// taken (a pinned one only once it also holds reclamation back).
pub(crate) const FOREIGN_LEASE: Duration = Duration::from_secs(30);
/// How often the reclaimer looks for idle slots of dead owners.
const IDLE_SWEEP: Duration = Duration::from_secs(1);
/// How long a pinned slot may hold back reclamation before the reclaimer checks its owner.
const SUSPECT_AFTER: Duration = Duration::from_millis(100);

fn pack(generation: u16, kind: u64, value: u64) -> u64 {
    (generation as u64) << 48 | kind << VALUE_BITS | (value & VALUE_MASK)
}

fn unpack(w: u64) -> (u16, u64, u64) {
    ((w >> 48) as u16, (w >> VALUE_BITS) & 3, w & VALUE_MASK)
}

/// The full value a pinned slot's 46 bits stand for, given the current value. A pin newer than
/// `current` (pinned after the caller loaded it) holds nothing below `current`: it counts as
/// `current`.
fn rebuild(current: u64, low: u64) -> u64 {
    let behind = current.wrapping_sub(low) & VALUE_MASK;
    if behind > VALUE_MASK / 2 || behind > current { current } else { current - behind }
}

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

/// A claimed slot: where it is and the generation it was claimed at. Set aside once revoked.
#[derive(Debug)]
pub(crate) struct Slot {
    off: u64,
    generation: u16,
}

/// The slots of one arena or control block.
#[derive(Clone, Copy)]
pub(crate) struct SlotTable<'m> {
    pub(crate) map: &'m Mapping,
    pub(crate) off: u64,
    pub(crate) count: u32,
}

static PIDNS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
static CLAIMS: AtomicU32 = AtomicU32::new(0);

fn pidns() -> u64 {
    *PIDNS.get_or_init(own_pidns)
}

impl SlotTable<'_> {
    fn slot_off(&self, i: u32) -> u64 {
        self.off + i as u64 * SLOT_SIZE
    }

    fn state(&self, off: u64) -> Result<u64> {
        self.map.load(off + S_STATE, Ordering::Acquire)
    }

    /// Claims a slot: a free one, else one whose owner is dead. Bounded: two passes.
    pub(crate) fn claim(&self) -> Result<Slot> {
        // Start at a different slot per claim so concurrent claimers rarely collide.
        let first = CLAIMS.fetch_add(1, Ordering::Relaxed) % self.count.max(1);
        for pass in 0..2 {
            for k in 0..self.count {
                let off = self.slot_off((first + k) % self.count);
                let w = self.state(off)?;
                let (generation, kind, _) = unpack(w);
                let takeable = match kind {
                    KIND_FREE => true,
                    KIND_IDLE if pass == 1 => !self.owner_alive(off, FOREIGN_LEASE)?,
                    _ => false,
                };
                if !takeable {
                    continue;
                }
                let g = generation.wrapping_add(1);
                let word = self.map.slot_word(off + S_STATE)?;
                if word.compare_exchange(w, pack(g, KIND_IDLE, 0), Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                    let pid = std::process::id();
                    self.map.slot_word(off + S_PID)?.store(pid as u64, Ordering::Relaxed);
                    self.map.slot_word(off + S_START)?.store(proc_start_time(pid).unwrap_or(0), Ordering::Relaxed);
                    self.map.slot_word(off + S_PIDNS)?.store(pidns(), Ordering::Relaxed);
                    self.map.slot_word(off + S_HEARTBEAT)?.store(now_ms(), Ordering::Release);
                    return Ok(Slot { off, generation: g });
                }
            }
        }
        Err(Error::NoReaderSlot(self.count))
    }

    /// Gives a slot back (if it is still ours).
    pub(crate) fn release(&self, slot: &Slot) {
        if let Ok(word) = self.map.slot_word(slot.off + S_STATE) {
            let idle = pack(slot.generation, KIND_IDLE, 0);
            let _ =
                word.compare_exchange(idle, pack(slot.generation, KIND_FREE, 0), Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// Pins `value` in `slot`: false if the slot is no longer ours (revoked).
    #[inline]
    pub(crate) fn pin(&self, slot: &Slot, value: u64) -> Result<bool> {
        let word = self.map.slot_word(slot.off + S_STATE)?;
        let (idle, pinned) = (pack(slot.generation, KIND_IDLE, 0), pack(slot.generation, KIND_PINNED, value));
        if word.compare_exchange(idle, pinned, Ordering::SeqCst, Ordering::Relaxed).is_err() {
            return Ok(false);
        }
        self.map.slot_word(slot.off + S_HEARTBEAT)?.store(now_ms(), Ordering::Relaxed);
        Ok(true)
    }

    /// Ends the pin of `value`: false if the slot was revoked meanwhile (what was read under the
    /// pin cannot be trusted).
    #[inline]
    pub(crate) fn unpin(&self, slot: &Slot, value: u64) -> bool {
        let Ok(word) = self.map.slot_word(slot.off + S_STATE) else { return false };
        let (idle, pinned) = (pack(slot.generation, KIND_IDLE, 0), pack(slot.generation, KIND_PINNED, value));
        word.compare_exchange(pinned, idle, Ordering::Release, Ordering::Relaxed).is_ok()
    }

    /// Whether `slot` still pins `value` (one load).
    #[inline]
    pub(crate) fn still_pinned(&self, slot: &Slot, value: u64) -> bool {
        self.map
            .slot_word(slot.off + S_STATE)
            .is_ok_and(|w| w.load(Ordering::Acquire) == pack(slot.generation, KIND_PINNED, value))
    }

    /// Whether the owner of the slot at `off` is alive: by pid and start time in our pid
    /// namespace, else by a heartbeat younger than `lease`.
    fn owner_alive(&self, off: u64, lease: Duration) -> Result<bool> {
        let pid = self.map.load(off + S_PID, Ordering::Relaxed)? as u32;
        let start = self.map.load(off + S_START, Ordering::Relaxed)?;
        let ns = self.map.load(off + S_PIDNS, Ordering::Relaxed)?;
        if ns != 0 && ns == pidns() {
            return Ok(pid == 0 || start == 0 || proc_start_time(pid) == Some(start));
        }
        let beat = self.map.load(off + S_HEARTBEAT, Ordering::Relaxed)?;
        Ok(now_ms().saturating_sub(beat) < lease.as_millis() as u64)
    }
}

/// The reclaimer's bookkeeping for slots that hold reclamation back.
pub(crate) struct SlotWatch {
    /// How long a reader in a foreign pid namespace may go without a heartbeat.
    pub(crate) lease: Duration,
    /// (slot offset, state word, since when it holds reclamation back).
    suspects: Vec<(u64, u64, Instant)>,
    /// When idle slots were last checked for dead owners.
    last_sweep: Option<Instant>,
    /// Slots of dead owners taken back so far.
    pub(crate) cleared: u64,
}

impl SlotWatch {
    pub(crate) fn new() -> Self {
        SlotWatch { lease: FOREIGN_LEASE, suspects: Vec::new(), last_sweep: None, cleared: 0 }
    }

    /// The oldest value any live reader may be using, capped by `current` — which the caller
    /// loaded *before* calling (see `read version` in docs/storage-format.md: only a value read
    /// before this fence is one every later pin is sure to see). Slots pinned below `wanted` for
    /// a while have their owner checked; dead owners' slots are freed, pinned or idle.
    pub(crate) fn min_pinned(&mut self, table: &SlotTable<'_>, current: u64, wanted: u64) -> Result<u64> {
        fence(Ordering::SeqCst);
        let mut min = current;
        let now = Instant::now();
        // Idle slots cost a look at /proc each: check them about once a second.
        let sweep = self.last_sweep.is_none_or(|t| now.duration_since(t) >= IDLE_SWEEP);
        if sweep {
            self.last_sweep = Some(now);
        }
        for i in 0..table.count {
            let off = table.slot_off(i);
            let w = table.map.slot_word(off + S_STATE)?.load(Ordering::SeqCst);
            let (generation, kind, low) = unpack(w);
            if kind != KIND_PINNED {
                if kind == KIND_IDLE && sweep && !table.owner_alive(off, self.lease)? {
                    // An idle slot whose owner died between operations.
                    self.take(table, off, w, generation)?;
                }
                continue;
            }
            let pinned = rebuild(current, low);
            if pinned >= wanted {
                min = min.min(pinned);
                continue;
            }
            let stuck = now.duration_since(self.started(off, w, now));
            if stuck >= SUSPECT_AFTER && !table.owner_alive(off, self.lease)? {
                self.take(table, off, w, generation)?;
                continue;
            }
            min = min.min(pinned);
        }
        Ok(min)
    }

    /// Since when the slot at `off` has been in state `w` (as far as this watch has seen).
    fn started(&mut self, off: u64, w: u64, now: Instant) -> Instant {
        match self.suspects.iter_mut().find(|s| s.0 == off) {
            Some(s) if s.1 == w => s.2,
            Some(s) => {
                *s = (off, w, now);
                now
            }
            None => {
                self.suspects.push((off, w, now));
                now
            }
        }
    }

    /// Frees a dead owner's slot, if it is still in the state we judged.
    fn take(&mut self, table: &SlotTable<'_>, off: u64, w: u64, generation: u16) -> Result<()> {
        let word = table.map.slot_word(off + S_STATE)?;
        if word.compare_exchange(w, pack(generation, KIND_FREE, 0), Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            self.cleared += 1;
        }
        self.suspects.retain(|s| s.0 != off);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_rebuild_from_their_low_bits() {
        for (current, pinned) in [(5, 5), (5, 0), (1 << 50, (1 << 50) - 3), (u64::MAX / 2, u64::MAX / 2 - (1 << 40))] {
            assert_eq!(rebuild(current, pinned & VALUE_MASK), pinned);
        }
        assert_eq!(rebuild(5, 7), 5, "a pin newer than the reclaimer's view holds nothing back");
        assert_eq!(rebuild(0, 3), 0);
        let w = pack(7, KIND_PINNED, 1 << 50 | 9);
        assert_eq!(unpack(w), (7, KIND_PINNED, 9));
    }
}
