//! Value-log records: `crc | len | flags | version | key_len | value_len | key | value`.
//!
//! The CRC32C covers the segment's random salt and then every byte after the CRC field, so a
//! record is only valid in the segment that wrote it: bytes a user stored inside a value can never
//! pass for a record when recovery scans past a torn write.
//!
//! Meta records (flag `META`, empty key) carry the log's own bookkeeping in their value: a
//! *commit* marker opens every group commit and records the position known durable when the group
//! was written; a *seal* ends a full segment; an *annotation* travels inside a batch (same
//! version) with data its writer wants back on replay.

use std::borrow::Cow;

/// Bytes before the key.
pub(crate) const RECORD_HEADER: usize = 23;
const FLAG_TOMBSTONE: u8 = 1;
const FLAG_BATCH_END: u8 = 2;
const FLAG_META: u8 = 4;

/// Meta record kinds (the first byte of a meta record's value).
pub(crate) const META_COMMIT: u8 = 1;
pub(crate) const META_SEAL: u8 = 2;
pub(crate) const META_ANNOTATION: u8 = 3;

/// Bytes of a commit marker record.
pub(crate) const COMMIT_RECORD: usize = RECORD_HEADER + 9;
/// Bytes of a seal record.
pub(crate) const SEAL_RECORD: usize = RECORD_HEADER + 1;

/// A record to append (borrowed) or one read back (owned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'a> {
    /// Write version (0 for commit markers and seals).
    pub version: u64,
    /// A delete marker (the value is empty).
    pub tombstone: bool,
    /// The last record of an atomic batch (recovery drops a trailing batch without one).
    pub batch_end: bool,
    /// A meta record: the key is empty and the value's first byte says which kind.
    pub meta: bool,
    /// Key.
    pub key: Cow<'a, [u8]>,
    /// Value.
    pub value: Cow<'a, [u8]>,
}

/// A record decoded in place.
pub type RecordRef<'a> = Record<'a>;

impl<'a> Record<'a> {
    /// This record with its batch-end flag set to `end` (records of a batch but the last: false).
    pub fn in_batch(mut self, end: bool) -> Record<'a> {
        self.batch_end = end;
        self
    }

    /// A put record.
    pub fn put(version: u64, key: &'a [u8], value: &'a [u8]) -> Record<'a> {
        Record {
            version,
            tombstone: false,
            batch_end: true,
            meta: false,
            key: Cow::Borrowed(key),
            value: Cow::Borrowed(value),
        }
    }

    /// A delete record.
    pub fn delete(version: u64, key: &'a [u8]) -> Record<'a> {
        Record {
            version,
            tombstone: true,
            batch_end: true,
            meta: false,
            key: Cow::Borrowed(key),
            value: Cow::Borrowed(&[]),
        }
    }

    /// An annotation of the batch at `version` (kept with the batch, handed back on replay).
    pub fn annotation(version: u64, data: &[u8]) -> Record<'static> {
        let mut v = Vec::with_capacity(1 + data.len());
        v.push(META_ANNOTATION);
        v.extend_from_slice(data);
        Record {
            version,
            tombstone: false,
            batch_end: false,
            meta: true,
            key: Cow::Borrowed(&[]),
            value: Cow::Owned(v),
        }
    }

    pub(crate) fn commit_marker(durable_hint: u64) -> Record<'static> {
        let mut v = vec![META_COMMIT];
        v.extend_from_slice(&durable_hint.to_le_bytes());
        Record { version: 0, tombstone: false, batch_end: true, meta: true, key: Cow::Borrowed(&[]), value: v.into() }
    }

    pub(crate) fn seal() -> Record<'static> {
        Record {
            version: 0,
            tombstone: false,
            batch_end: true,
            meta: true,
            key: Cow::Borrowed(&[]),
            value: Cow::Owned(vec![META_SEAL]),
        }
    }

    /// The meta kind of a meta record (None for data records and malformed meta records).
    pub(crate) fn meta_kind(&self) -> Option<u8> {
        if self.meta { self.value.first().copied() } else { None }
    }

    /// A commit marker's durable hint.
    pub(crate) fn commit_hint(&self) -> Option<u64> {
        (self.meta_kind() == Some(META_COMMIT) && self.value.len() == 9)
            .then(|| u64::from_le_bytes(self.value[1..9].try_into().expect("8 bytes")))
    }

    /// An annotation's data.
    pub fn annotation_data(&self) -> Option<&[u8]> {
        (self.meta_kind() == Some(META_ANNOTATION)).then(|| &self.value[1..])
    }

    /// Encoded size.
    pub fn encoded_len(&self) -> usize {
        RECORD_HEADER + self.key.len() + self.value.len()
    }

    /// Appends the encoding to `out`, checksummed with the segment's `salt`.
    pub(crate) fn encode(&self, salt: u64, out: &mut Vec<u8>) {
        let start = out.len();
        let body = (self.encoded_len() - 8) as u32;
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&body.to_le_bytes());
        let mut flags = 0;
        if self.tombstone {
            flags |= FLAG_TOMBSTONE;
        }
        if self.batch_end {
            flags |= FLAG_BATCH_END;
        }
        if self.meta {
            flags |= FLAG_META;
        }
        out.push(flags);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.key.len() as u16).to_le_bytes());
        out.extend_from_slice(&(self.value.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.key);
        out.extend_from_slice(&self.value);
        let crc = checksum(salt, &out[start + 4..]);
        out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// An owned copy.
    pub fn to_owned(&self) -> Record<'static> {
        Record {
            version: self.version,
            tombstone: self.tombstone,
            batch_end: self.batch_end,
            meta: self.meta,
            key: Cow::Owned(self.key.to_vec()),
            value: Cow::Owned(self.value.to_vec()),
        }
    }
}

fn checksum(salt: u64, rest: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&salt.to_le_bytes()), rest)
}

/// The length a record at `pos` of `b` claims, if its header is in `b` and well formed (a cheap
/// pre-check before the checksum).
pub(crate) fn claimed_len(b: &[u8], pos: usize) -> Option<usize> {
    let h = b.get(pos..pos + RECORD_HEADER)?;
    let body = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
    let flags = h[8];
    let klen = u16::from_le_bytes(h[17..19].try_into().expect("2 bytes")) as usize;
    let vlen = u32::from_le_bytes(h[19..23].try_into().expect("4 bytes")) as usize;
    let meta = flags & FLAG_META != 0;
    let ok = body == RECORD_HEADER - 8 + klen + vlen
        && flags & !(FLAG_TOMBSTONE | FLAG_BATCH_END | FLAG_META) == 0
        && (klen == 0) == meta
        && (!meta || (vlen >= 1 && flags & FLAG_TOMBSTONE == 0));
    ok.then_some(8 + body)
}

/// Decodes and checks the record at `pos` of `b`; returns it and the next position.
pub(crate) fn decode_record(b: &[u8], pos: usize, salt: u64) -> Result<(Record<'_>, usize), &'static str> {
    let total = claimed_len(b, pos).ok_or("malformed record header")?;
    let all = b.get(pos..pos + total).ok_or("record runs past the end")?;
    let crc = u32::from_le_bytes(all[0..4].try_into().expect("4 bytes"));
    if checksum(salt, &all[4..]) != crc {
        return Err("record checksum mismatch");
    }
    let flags = all[8];
    let version = u64::from_le_bytes(all[9..17].try_into().expect("8 bytes"));
    let klen = u16::from_le_bytes(all[17..19].try_into().expect("2 bytes")) as usize;
    let key = &all[RECORD_HEADER..RECORD_HEADER + klen];
    let value = &all[RECORD_HEADER + klen..];
    let rec = Record {
        version,
        tombstone: flags & FLAG_TOMBSTONE != 0,
        batch_end: flags & FLAG_BATCH_END != 0,
        meta: flags & FLAG_META != 0,
        key: key.into(),
        value: value.into(),
    };
    Ok((rec, pos + total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_only_under_their_salt() {
        let mut b = Vec::new();
        Record::put(7, b"k", b"v").in_batch(false).encode(42, &mut b);
        Record::delete(7, b"k").encode(42, &mut b);
        Record::commit_marker(99).encode(42, &mut b);
        let (r, next) = decode_record(&b, 0, 42).expect("valid");
        assert_eq!((r.version, r.batch_end, r.key.as_ref()), (7, false, &b"k"[..]));
        let (r, next) = decode_record(&b, next, 42).expect("valid");
        assert!(r.tombstone && r.batch_end);
        let (r, _) = decode_record(&b, next, 42).expect("valid");
        assert_eq!(r.commit_hint(), Some(99));
        assert!(decode_record(&b, 0, 43).is_err(), "another segment's salt");
    }

    #[test]
    fn a_record_inside_a_value_does_not_decode_at_its_offset_in_another_segment() {
        let mut inner = Vec::new();
        Record::put(1, b"x", b"y").encode(5, &mut inner);
        let mut b = Vec::new();
        Record::put(2, b"k", &inner).encode(6, &mut b);
        let at = b.len() - inner.len();
        assert!(decode_record(&b, at, 6).is_err());
    }
}
