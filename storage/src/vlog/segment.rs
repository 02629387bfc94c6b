//! Value-log segment files: `NNNNNNNNNNNNNNNN.vlog`, allocated to their full size when created
//! (so appends never run out of space and a reader may map the whole file), a 32-byte header
//! (magic, segment id, random salt, header checksum), then records; the rest is zeros. A full
//! segment ends with a seal record.
//!
//! Recovery scans a segment twice: first the chain of valid records from the header (it ends at
//! the first invalid record or at the seal), then everything after the chain for valid records
//! that could only have been written later. Every commit marker holds the position that was known
//! durable when its group was written, so the largest hint found anywhere is a position the disk
//! is known to hold: a chain that breaks before it is corruption; a chain that breaks after it is
//! a torn tail of writes that were never synced.

use std::path::{Path, PathBuf};

use super::record::{META_SEAL, claimed_len, decode_record};
use crate::error::{Error, Result};

/// Bytes of the segment header.
pub(crate) const SEGMENT_HEADER: u32 = 32;
const MAGIC: &[u8; 8] = b"DPUKVLG2";
const OLD_MAGIC: &[u8; 8] = b"DPUKVLG1";

pub(crate) fn path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016}.vlog"))
}

/// The id of a segment file's name (`<16 digits>.vlog`), if it is one.
pub(crate) fn parse_name(name: &str) -> Option<u64> {
    let id = name.strip_suffix(".vlog")?;
    (id.len() == 16).then(|| id.parse().ok()).flatten()
}

/// Where a new segment is prepared before it is renamed into place.
pub(crate) fn staging_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016}.vlog.new"))
}

/// Where a segment is rewritten after a failed sync before it replaces the original.
pub(crate) fn repair_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016}.vlog.repair"))
}

/// Segment ids in the directory, ascending; leftovers of interrupted creations and repairs are
/// returned separately.
pub(crate) fn list(dir: &Path) -> Result<(Vec<u64>, Vec<PathBuf>)> {
    let mut ids = Vec::new();
    let mut leftovers = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if let Some(id) = name.strip_suffix(".vlog").and_then(|s| s.parse::<u64>().ok()) {
            ids.push(id);
        } else if name.ends_with(".vlog.new") || name.ends_with(".vlog.repair") {
            leftovers.push(e.path());
        }
    }
    ids.sort_unstable();
    Ok((ids, leftovers))
}

/// The header of segment `id` with `salt`.
pub(crate) fn encode_header(id: u64, salt: u64) -> [u8; SEGMENT_HEADER as usize] {
    let mut h = [0u8; SEGMENT_HEADER as usize];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&id.to_le_bytes());
    h[16..24].copy_from_slice(&salt.to_le_bytes());
    let crc = crc32c::crc32c(&h[..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a segment header; returns the segment's id and salt.
pub(crate) fn decode_header(p: &Path, bytes: &[u8]) -> Result<(u64, u64)> {
    if bytes.len() >= 8 && &bytes[..8] == OLD_MAGIC {
        return Err(Error::corrupt_file(p, 0, "value-log format 1: this version reads format 2 only"));
    }
    if bytes.len() < SEGMENT_HEADER as usize || &bytes[..8] != MAGIC {
        return Err(Error::corrupt_file(p, 0, "bad value-log segment header"));
    }
    if crc32c::crc32c(&bytes[..24]) != u32::from_le_bytes(bytes[24..28].try_into().expect("4 bytes")) {
        return Err(Error::corrupt_file(p, 24, "value-log segment header checksum mismatch"));
    }
    let id = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let salt = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    Ok((id, salt))
}

/// A fresh random salt (from the standard library's randomly keyed hasher).
pub(crate) fn new_salt() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    h.finish()
}

/// What a scan of one segment found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scan {
    /// Where the chain of valid records from the header ends (after the seal, if sealed).
    pub(crate) end: u32,
    /// The chain ends with a seal record.
    pub(crate) sealed: bool,
    /// The largest durable hint of a commit marker anywhere in the segment (an offset here).
    pub(crate) durable: u32,
    /// The largest version of any valid record anywhere in the segment.
    pub(crate) max_version: u64,
    /// Where the last byte that is not zero ends (everything after is the allocation's zeros).
    pub(crate) dirty_end: u32,
}

/// Scans a segment image (see the module documentation).
pub(crate) fn scan(bytes: &[u8], id: u64, salt: u64) -> Scan {
    let mut s = Scan { end: SEGMENT_HEADER, sealed: false, durable: SEGMENT_HEADER, max_version: 0, dirty_end: 0 };
    let hint_here = |h: u64| (h >> 32 == id).then_some(h as u32);
    let mut pos = SEGMENT_HEADER as usize;
    while let Ok((rec, next)) = decode_record(bytes, pos, salt) {
        s.max_version = s.max_version.max(rec.version);
        if let Some(h) = rec.commit_hint().and_then(hint_here) {
            s.durable = s.durable.max(h);
        }
        pos = next;
        if rec.meta_kind() == Some(META_SEAL) {
            s.sealed = true;
            break;
        }
    }
    s.end = pos as u32;
    // Beyond the chain: valid records that a later write left on pages that reached the disk.
    let mut p = pos + 1;
    while p + super::record::RECORD_HEADER <= bytes.len() {
        if claimed_len(bytes, p).is_some()
            && let Ok((rec, next)) = decode_record(bytes, p, salt)
        {
            s.max_version = s.max_version.max(rec.version);
            if let Some(h) = rec.commit_hint().and_then(hint_here) {
                s.durable = s.durable.max(h);
            }
            p = next;
            continue;
        }
        p += 1;
    }
    s.dirty_end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i as u32 + 1).max(SEGMENT_HEADER);
    s
}

#[cfg(test)]
mod tests {
    use super::super::record::Record;
    use super::*;

    fn image(records: &[Record<'_>], salt: u64, size: usize) -> Vec<u8> {
        let mut b = encode_header(3, salt).to_vec();
        for r in records {
            r.encode(salt, &mut b);
        }
        b.resize(size, 0);
        b
    }

    #[test]
    fn a_chain_that_breaks_before_a_later_hint_is_corruption_after_it_a_torn_tail() {
        let salt = 9;
        let groups = [
            Record::commit_marker(0),
            Record::put(1, b"a", b"1"),
            Record::commit_marker(0),
            Record::put(2, b"b", b"2"),
        ];
        let put_b = SEGMENT_HEADER as usize + groups[..3].iter().map(Record::encoded_len).sum::<usize>();
        let end2 = put_b + groups[3].encoded_len();
        // A third group, written once the first two were known durable.
        let third = [Record::commit_marker(3 << 32 | end2 as u64), Record::put(3, b"c", b"3")];
        let put_c = end2 + third[0].encoded_len();
        let all: Vec<Record<'_>> = groups.iter().chain(&third).cloned().collect();
        let intact = image(&all, salt, 4096);
        let s = scan(&intact, 3, salt);
        assert_eq!((s.end as usize, s.durable as usize, s.max_version), (put_c + third[1].encoded_len(), end2, 3));
        assert!(!s.sealed);
        // A damaged record the disk was known to hold: the chain stops before the hint.
        let mut b = intact.clone();
        b[put_b + 5] ^= 0xff;
        let s = scan(&b, 3, salt);
        assert_eq!((s.end as usize, s.durable as usize), (put_b, end2), "end < durable: corruption");
        // The last group torn: the chain stops after every hint.
        let mut b = intact;
        b[put_c + 5] ^= 0xff;
        let s = scan(&b, 3, salt);
        assert_eq!((s.end as usize, s.durable as usize), (put_c, end2), "end >= durable: a torn tail");
    }
}
