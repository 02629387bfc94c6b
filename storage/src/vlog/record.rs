//! Value-log records: `crc | len | flags | version | key_len | value_len | key | value`.

use std::borrow::Cow;

/// Bytes before the key.
pub(crate) const RECORD_HEADER: usize = 23;
const FLAG_TOMBSTONE: u8 = 1;
const FLAG_BATCH_END: u8 = 2;

/// A record to append (borrowed) or one read back (owned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'a> {
    /// Write version.
    pub version: u64,
    /// A delete marker (the value is empty).
    pub tombstone: bool,
    /// The last record of an atomic batch (recovery drops a trailing batch without one).
    pub batch_end: bool,
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
        Record { version, tombstone: false, batch_end: true, key: Cow::Borrowed(key), value: Cow::Borrowed(value) }
    }

    /// A delete record.
    pub fn delete(version: u64, key: &'a [u8]) -> Record<'a> {
        Record { version, tombstone: true, batch_end: true, key: Cow::Borrowed(key), value: Cow::Borrowed(&[]) }
    }

    /// Encoded size.
    pub fn encoded_len(&self) -> usize {
        RECORD_HEADER + self.key.len() + self.value.len()
    }

    /// Appends the encoding to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let body = (self.encoded_len() - 8) as u32;
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&body.to_le_bytes());
        out.push(if self.tombstone { FLAG_TOMBSTONE } else { 0 } | if self.batch_end { FLAG_BATCH_END } else { 0 });
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.key.len() as u16).to_le_bytes());
        out.extend_from_slice(&(self.value.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.key);
        out.extend_from_slice(&self.value);
        let crc = crc32c::crc32c(&out[start + 4..]);
        out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// An owned copy.
    pub fn to_owned(&self) -> Record<'static> {
        Record {
            version: self.version,
            tombstone: self.tombstone,
            batch_end: self.batch_end,
            key: Cow::Owned(self.key.to_vec()),
            value: Cow::Owned(self.value.to_vec()),
        }
    }
}

/// Decodes and checks the record at `pos` of `b`; returns it and the next position.
pub(crate) fn decode_record(b: &[u8], pos: usize) -> Result<(Record<'_>, usize), &'static str> {
    let h = b.get(pos..pos + RECORD_HEADER).ok_or("record header runs past the end")?;
    let crc = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    let body = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
    let flags = h[8];
    let version = u64::from_le_bytes(h[9..17].try_into().expect("8 bytes"));
    let klen = u16::from_le_bytes(h[17..19].try_into().expect("2 bytes")) as usize;
    let vlen = u32::from_le_bytes(h[19..23].try_into().expect("4 bytes")) as usize;
    if body != RECORD_HEADER - 8 + klen + vlen || flags & !(FLAG_TOMBSTONE | FLAG_BATCH_END) != 0 || klen == 0 {
        return Err("malformed record header");
    }
    let end = pos + 8 + body;
    let all = b.get(pos..end).ok_or("record runs past the end")?;
    if crc32c::crc32c(&all[4..]) != crc {
        return Err("record checksum mismatch");
    }
    let key = &all[RECORD_HEADER..RECORD_HEADER + klen];
    let value = &all[RECORD_HEADER + klen..];
    let (tombstone, batch_end) = (flags & FLAG_TOMBSTONE != 0, flags & FLAG_BATCH_END != 0);
    Ok((Record { version, tombstone, batch_end, key: key.into(), value: value.into() }, end))
}
