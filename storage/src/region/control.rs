//! The region control block: a small shared-memory file, `region.ctl` in the region's shared
//! directory, through which the host tells readers (the device) which table set is current, and
//! readers tell the host which table sets they may still be using.
//!
//! ```text
//! 0       magic "DPUKVRC1"
//! 8       u32 layout version (1) | u32 reader slots
//! 16      u64 incarnation (random; a new file per host start)
//! 24      u32 CRC32C of bytes 0..24
//! 64      u64 state (atomic): 1 ready, 2 closed (a newer host took over: reopen the file)
//! 72      u64 current table-set generation (atomic)
//! 4096    reader slots, 64 bytes each (`arena::slots`: the pinned value is a generation)
//! ```
//!
//! Table sets are immutable files `tables-<generation>` beside it. A reader pins the current
//! generation for each operation (the same handshake as an arena's read version) and reads only
//! files that set names; the host *retires* a file (a frozen arena, a replaced level segment, a
//! collected log segment, an old table-set file) at the first generation that no longer names it
//! and deletes it only once no pin is older than that generation. So a reader never finds a file
//! missing and never waits or retries because the host published a new set, and the host learns
//! when it may delete from the slots alone.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{Ordering, fence};

use crate::arena::{Mapping, Slot, SlotTable, SlotWatch};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"DPUKVRC1";
const VERSION: u32 = 1;
const C_STATE: u64 = 64;
const C_CURRENT: u64 = 72;
const SLOTS_OFF: u64 = 4096;
const SLOTS: u32 = 256;
const SLOT_BYTES: u64 = 64;
const STATE_READY: u64 = 1;
const STATE_CLOSED: u64 = 2;
/// The control file's name in the region's shared directory.
pub(crate) const FILE: &str = "region.ctl";

fn file_len() -> u64 {
    SLOTS_OFF + SLOTS as u64 * SLOT_BYTES
}

/// Path of the table-set file of `generation`.
pub(crate) fn tables_path(shm: &Path, generation: u64) -> PathBuf {
    shm.join(format!("tables-{generation:016}"))
}

/// Something readers of an older table set may still use, deleted once none can.
#[derive(Debug)]
pub(crate) enum Retired {
    /// A file in the shared directory (an arena, a table-set file).
    Shared(PathBuf),
    /// A durable file (a level or log segment), removed through the region's file layer.
    Durable(PathBuf),
}

/// The host's side.
pub(crate) struct HostControl {
    map: Mapping,
    /// Until the first table set is published the file waits under a temporary name, so no
    /// reader ever finds a control block without a table set.
    staged: Option<(PathBuf, PathBuf)>,
    current: u64,
    watch: SlotWatch,
    /// (generation at which it was retired, what) in retirement order.
    retired: VecDeque<(u64, Retired)>,
}

fn encode_header(incarnation: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(28);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&SLOTS.to_le_bytes());
    h.extend_from_slice(&incarnation.to_le_bytes());
    let crc = crc32c::crc32c(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    h
}

fn check_header(p: &Path, h: &[u8]) -> Result<()> {
    if h.len() < 28 || &h[..8] != MAGIC {
        return Err(Error::corrupt_file(p, 0, "not a region control file"));
    }
    if crc32c::crc32c(&h[..24]) != u32::from_le_bytes(h[24..28].try_into().expect("4 bytes")) {
        return Err(Error::corrupt_file(p, 24, "region control header checksum mismatch"));
    }
    if u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) != VERSION
        || u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")) != SLOTS
    {
        return Err(Error::corrupt_file(p, 8, "unsupported region control layout"));
    }
    Ok(())
}

impl HostControl {
    /// Takes over the region's shared directory: tells the readers of a previous host's control
    /// file to reopen (state closed), then publishes a fresh one.
    pub(crate) fn create(shm: &Path) -> Result<HostControl> {
        let path = shm.join(FILE);
        if let Ok(f) = OpenOptions::new().read(true).write(true).open(&path)
            && f.metadata().is_ok_and(|m| m.len() >= file_len())
            && let Ok(old) = Mapping::map_rw(&f, file_len(), &path)
        {
            old.word(C_STATE)?.store(STATE_CLOSED, Ordering::SeqCst);
        }
        let tmp = shm.join(format!("{FILE}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        let f =
            OpenOptions::new().read(true).write(true).create_new(true).open(&tmp).map_err(|e| Error::io(&tmp, e))?;
        f.set_len(file_len()).map_err(|e| Error::io(&tmp, e))?;
        crate::arena::reserve_memory(&f, 0, file_len()).map_err(|e| Error::io(&tmp, e))?;
        let map = Mapping::map_rw(&f, file_len(), &tmp)?;
        let header = encode_header(crate::vlog::new_salt());
        use std::os::unix::fs::FileExt;
        f.write_all_at(&header, 0).map_err(|e| Error::io(&tmp, e))?;
        map.word(C_STATE)?.store(STATE_READY, Ordering::SeqCst);
        Ok(HostControl {
            map,
            staged: Some((tmp, path)),
            current: 0,
            watch: SlotWatch::new(),
            retired: VecDeque::new(),
        })
    }

    /// Makes generation `generation`, whose table-set file is written, the current one; the
    /// previous generation's file is retired.
    pub(crate) fn publish(&mut self, shm: &Path, generation: u64) -> Result<()> {
        self.map.word(C_CURRENT)?.store(generation, Ordering::SeqCst);
        if let Some((tmp, path)) = self.staged.take() {
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        }
        if self.current > 0 {
            let old = tables_path(shm, self.current);
            self.retired.push_back((generation, Retired::Shared(old)));
        }
        self.current = generation;
        Ok(())
    }

    /// `what` is not named by the current table set (nor will it be again).
    pub(crate) fn retire(&mut self, what: Retired) {
        self.retired.push_back((self.current, what));
    }

    /// What no reader can reach any more: each item is handed back once.
    pub(crate) fn collect(&mut self) -> Result<Vec<Retired>> {
        let Some(&(oldest, _)) = self.retired.front() else { return Ok(Vec::new()) };
        let current = self.map.load(C_CURRENT, Ordering::SeqCst)?;
        let table = SlotTable { map: &self.map, off: SLOTS_OFF, count: SLOTS };
        let min = self.watch.min_pinned(&table, current, oldest)?;
        let mut out = Vec::new();
        while self.retired.front().is_some_and(|(g, _)| *g <= min) {
            out.push(self.retired.pop_front().expect("front exists").1);
        }
        Ok(out)
    }

    /// Items retired and not yet handed back.
    pub(crate) fn pending(&self) -> usize {
        self.retired.len()
    }

    /// Dead readers' slots taken back so far.
    pub(crate) fn dead_slots_cleared(&self) -> u64 {
        self.watch.cleared
    }
}

/// A reader's side: its mapping of the control file and its slot.
pub(crate) struct ReaderControl {
    map: Mapping,
    slot: Slot,
    revoked: bool,
}

impl ReaderControl {
    /// Maps the control file of the region in `shm` and claims a slot.
    pub(crate) fn open(shm: &Path) -> Result<ReaderControl> {
        let path = shm.join(FILE);
        let mut f = OpenOptions::new().read(true).write(true).open(&path).map_err(|e| Error::io(&path, e))?;
        let len = f.metadata().map_err(|e| Error::io(&path, e))?.len();
        if len < file_len() {
            return Err(Error::corrupt_file(&path, len, "region control file too short"));
        }
        let mut h = [0u8; 28];
        f.read_exact(&mut h).map_err(|e| Error::io(&path, e))?;
        check_header(&path, &h)?;
        let map = Mapping::map_ro(&f, file_len(), SLOTS_OFF, SLOTS as u64 * SLOT_BYTES, &path)?;
        let slot = SlotTable { map: &map, off: SLOTS_OFF, count: SLOTS }.claim()?;
        Ok(ReaderControl { map, slot, revoked: false })
    }

    fn slots(&self) -> SlotTable<'_> {
        SlotTable { map: &self.map, off: SLOTS_OFF, count: SLOTS }
    }

    /// Whether a newer host took over (reopen the file).
    pub(crate) fn closed(&self) -> bool {
        self.map.load(C_STATE, Ordering::Acquire).is_ok_and(|s| s == STATE_CLOSED)
    }

    /// Pins the current generation; returns (generation, the value to unpin with).
    pub(crate) fn pin(&mut self) -> Result<(u64, u64)> {
        loop {
            if self.revoked {
                self.slot = self.slots().claim()?;
                self.revoked = false;
            }
            let guess = self.map.load(C_CURRENT, Ordering::Relaxed)?;
            if self.slots().pin(&self.slot, guess)? {
                fence(Ordering::SeqCst);
                return Ok((self.map.load(C_CURRENT, Ordering::Acquire)?, guess));
            }
            self.revoked = true;
        }
    }

    /// Ends a pin; false if it was revoked meanwhile (what was read under it is not to be
    /// trusted).
    pub(crate) fn unpin(&mut self, value: u64) -> bool {
        let ok = self.slots().unpin(&self.slot, value);
        if !ok {
            self.revoked = true;
        }
        ok
    }
}

impl Drop for ReaderControl {
    fn drop(&mut self) {
        if !self.revoked {
            self.slots().release(&self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file retired at a generation is handed back only once no reader pins an older one;
    /// readers always find the set they pinned.
    #[test]
    fn retired_files_wait_for_readers_of_older_sets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut host = HostControl::create(dir.path()).expect("host");
        host.publish(dir.path(), 1).expect("publish");
        let mut reader = ReaderControl::open(dir.path()).expect("reader");
        let (g, pinned) = reader.pin().expect("pin");
        assert_eq!(g, 1);
        host.publish(dir.path(), 2).expect("publish");
        host.retire(Retired::Shared(dir.path().join("old-arena")));
        assert!(host.collect().expect("collect").is_empty(), "the reader pins generation 1");
        assert!(reader.unpin(pinned));
        let (g, pinned) = reader.pin().expect("pin");
        assert_eq!(g, 2, "a new pin sees the newest set");
        assert_eq!(host.collect().expect("collect").len(), 2, "the old set's file and the arena");
        assert!(reader.unpin(pinned));
        // A newer host marks the control block closed for readers of the old one, and puts its
        // own in place once it has a table set to name.
        let mut host2 = HostControl::create(dir.path()).expect("second host");
        assert!(reader.closed());
        host2.publish(dir.path(), 1).expect("publish");
        assert!(!ReaderControl::open(dir.path()).expect("reopen").closed());
    }
}
