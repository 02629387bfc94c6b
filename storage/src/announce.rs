//! An announcement in shared memory: an immutable payload the host publishes for the device (the
//! node's region map), a state word the next host flips to *closed* so that readers of the
//! old one know — with one atomic load, no file-system calls — to open the new one, and a
//! *valid-until* word: the monotonic instant (`CLOCK_MONOTONIC`, nanoseconds, shared by the
//! processes of one machine) until which the host vouches for the payload. A cluster's host
//! keeps extending it while its lease-bound authority lasts; a host that dies stops extending
//! it, and readers stop trusting the payload on their own (`u64::MAX`: forever, a standalone
//! node).
//!
//! ```text
//! 0    magic "DPUKVAN2"
//! 8    u64 state (atomic): 1 open, 2 closed
//! 16   u64 valid until (atomic), monotonic nanoseconds
//! 24   u32 payload length | u32 CRC32C of the payload
//! 32   payload
//! ```

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use crate::arena::Mapping;
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"DPUKVAN2";
const STATE: u64 = 8;
const VALID_UNTIL: u64 = 16;
const HEADER: usize = 32;
const OPEN: u64 = 1;
const CLOSED: u64 = 2;
/// Largest payload.
pub const MAX_PAYLOAD: usize = 1 << 20;

/// See the module documentation.
pub struct Announcement {
    map: Mapping,
    path: PathBuf,
    payload: Vec<u8>,
}

impl Announcement {
    /// Publishes `payload` at `path` (replacing the file atomically), after marking a previous
    /// announcement there closed; readers trust it until `valid_until` (monotonic ns;
    /// `u64::MAX`: forever) — written with the file, so there is no moment in which a new payload
    /// is trusted longer than its publisher meant.
    pub fn publish(path: &Path, payload: &[u8], valid_until: u64) -> Result<Announcement> {
        if payload.len() > MAX_PAYLOAD {
            return Err(Error::Config(format!("announcement payload over {MAX_PAYLOAD} bytes")));
        }
        if let Ok(f) = OpenOptions::new().read(true).write(true).open(path)
            && f.metadata().is_ok_and(|m| m.len() >= HEADER as u64)
            && let Ok(old) = Mapping::map_rw(&f, HEADER as u64, path)
        {
            old.word(STATE)?.store(CLOSED, Ordering::SeqCst);
        }
        let tmp = crate::fs::tmp_path(path);
        let _ = std::fs::remove_file(&tmp);
        let f =
            OpenOptions::new().read(true).write(true).create_new(true).open(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut b = Vec::with_capacity(HEADER + payload.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&OPEN.to_le_bytes());
        b.extend_from_slice(&valid_until.to_le_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        b.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        b.extend_from_slice(payload);
        f.write_all_at(&b, 0).map_err(|e| Error::io(&tmp, e))?;
        let map = Mapping::map_rw(&f, b.len() as u64, &tmp)?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
        Ok(Announcement { map, path: path.to_path_buf(), payload: payload.to_vec() })
    }

    /// Opens the announcement at `path` (read-only) and checks it.
    pub fn open(path: &Path) -> Result<Announcement> {
        let mut f = OpenOptions::new().read(true).open(path).map_err(|e| Error::io(path, e))?;
        let mut b = Vec::new();
        f.read_to_end(&mut b).map_err(|e| Error::io(path, e))?;
        if b.len() < HEADER || &b[..8] != MAGIC {
            return Err(Error::corrupt_file(path, 0, "not an announcement"));
        }
        let len = u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")) as usize;
        let payload = b.get(HEADER..HEADER + len).ok_or_else(|| Error::corrupt_file(path, 24, "payload truncated"))?;
        if crc32c::crc32c(payload) != u32::from_le_bytes(b[28..32].try_into().expect("4 bytes")) {
            return Err(Error::corrupt_file(path, 28, "announcement checksum mismatch"));
        }
        let map = Mapping::map_ro(&f, HEADER as u64, 0, 0, path)?;
        Ok(Announcement { map, path: path.to_path_buf(), payload: payload.to_vec() })
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Whether a newer announcement replaced this one (one atomic load).
    pub fn closed(&self) -> bool {
        self.map.load(STATE, Ordering::Acquire).is_ok_and(|s| s == CLOSED)
    }

    /// Where it lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Until when (monotonic nanoseconds, [`monotonic_ns`]) the publisher vouches for the
    /// payload; 0 if it cannot be read.
    pub fn valid_until(&self) -> u64 {
        self.map.load(VALID_UNTIL, Ordering::Acquire).unwrap_or(0)
    }

    /// Whether the publisher vouches for the payload now.
    pub fn valid_now(&self) -> bool {
        self.valid_until() > monotonic_ns()
    }

    /// Sets until when the payload is vouched for (the publisher only).
    pub fn set_valid_until(&self, ns: u64) -> Result<()> {
        self.map.word(VALID_UNTIL)?.store(ns, Ordering::Release);
        Ok(())
    }
}

/// Nanoseconds of `CLOCK_MONOTONIC`: one clock for every process of the machine (what
/// `std::time::Instant` reads on Linux).
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_trust_the_payload_only_while_the_publisher_vouches_for_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("node.ctl");
        let a = Announcement::publish(&p, b"map", u64::MAX).expect("publish");
        let reader = Announcement::open(&p).expect("open");
        assert!(reader.valid_now(), "a fresh announcement is vouched for until told otherwise");
        a.set_valid_until(monotonic_ns() + 60_000_000_000).expect("extend");
        assert!(reader.valid_now());
        a.set_valid_until(monotonic_ns().saturating_sub(1)).expect("lapse");
        assert!(!reader.valid_now(), "a lapsed announcement is not trusted");
    }

    #[test]
    fn a_new_announcement_closes_the_old_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("node.ctl");
        let _first = Announcement::publish(&p, b"map one", u64::MAX).expect("publish");
        let reader = Announcement::open(&p).expect("open");
        assert_eq!(reader.payload(), b"map one");
        assert!(!reader.closed());
        let _second = Announcement::publish(&p, b"map two", u64::MAX).expect("publish again");
        assert!(reader.closed(), "the old reader learns it from shared memory");
        assert_eq!(Announcement::open(&p).expect("open").payload(), b"map two");
    }
}
