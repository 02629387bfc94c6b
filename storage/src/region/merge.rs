//! Reads across a region's tables — active L0, frozen L0s, levels — newest first: the first table
//! holding a key decides (a tombstone hides older values). Scans merge the tables' ordered streams
//! in chunks; floor searches skip keys whose newest entry is a tombstone.

use std::collections::VecDeque;
use std::ops::Bound;

use crate::btree::{Entry, Snapshot, Writer};
use crate::error::{Error, Result};
use crate::levels::Level;
use crate::vlog::{Lsn, Record, RecordSource};

/// An owned stored entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored {
    Value(Vec<u8>),
    Pointer { ptr: u64, len: u32 },
    Tombstone,
}

impl Stored {
    pub(crate) fn from_entry(e: Entry<'_>) -> Stored {
        match e {
            Entry::Value(v) => Stored::Value(v.to_vec()),
            Entry::Pointer { ptr, len } => Stored::Pointer { ptr, len },
            Entry::Tombstone => Stored::Tombstone,
        }
    }

    pub(crate) fn as_entry(&self) -> Entry<'_> {
        match self {
            Stored::Value(v) => Entry::Value(v),
            Stored::Pointer { ptr, len } => Entry::Pointer { ptr: *ptr, len: *len },
            Stored::Tombstone => Entry::Tombstone,
        }
    }
}

/// One table of a region.
pub(crate) enum Src<'a> {
    /// An L0 read through its writer (the region's own reads).
    Writer(&'a Writer),
    /// An L0 read through a pinned snapshot (another thread or process).
    Snap(&'a Snapshot<'a>),
    /// A level.
    Level(&'a Level),
}

/// Entries fetched per table per round of a merged scan.
const CHUNK: usize = 128;

impl Src<'_> {
    /// The entry (borrowed from the table) and its version; an arena snapshot's descent starts
    /// where `hint` says, if it is valid.
    pub(crate) fn get_entry(
        &self,
        key: &[u8],
        hint: Option<&crate::btree::StartHint<'_>>,
    ) -> Result<Option<(Entry<'_>, u64)>> {
        Ok(match (self, hint) {
            (Src::Snap(s), Some(h)) => s.get_versioned_hinted(key, h)?.0,
            (Src::Snap(s), None) => s.get_versioned(key)?,
            (Src::Writer(w), _) => w.get_versioned(key)?,
            (Src::Level(l), _) => l.get(key)?.map(|(v, e)| (e, v)),
        })
    }

    /// Up to `n` entries (key, version, entry) with keys after `from` (inclusive or not) and
    /// `<= hi`. L0 entries report version 0 (an L0 keeps per-node, not per-item, versions).
    /// An arena snapshot's descent starts where `hint` says, if it is valid.
    pub(crate) fn chunk_from(
        &self,
        from: Bound<&[u8]>,
        hi: &[u8],
        n: usize,
        hint: Option<&crate::btree::StartHint<'_>>,
    ) -> Result<Vec<(Vec<u8>, u64, Stored)>> {
        let mut out = Vec::with_capacity(n);
        let (lo, skip): (&[u8], Option<&[u8]>) = match from {
            Bound::Included(k) => (k, None),
            Bound::Excluded(k) => (k, Some(k)),
            Bound::Unbounded => (&[], None),
        };
        let want = n + skip.is_some() as usize;
        let mut push = |k: &[u8], v: u64, e: Entry<'_>| {
            if skip != Some(k) && out.len() < n {
                out.push((k.to_vec(), v, Stored::from_entry(e)));
            }
        };
        match self {
            Src::Writer(w) => {
                w.scan_entries(lo, hi, want, |k, e| push(k, 0, e))?;
            }
            Src::Snap(s) => match hint {
                Some(h) => {
                    s.scan_entries_hinted(lo, hi, want, h, |k, e| push(k, 0, e))?;
                }
                None => {
                    s.scan_entries(lo, hi, want, |k, e| push(k, 0, e))?;
                }
            },
            Src::Level(l) => {
                let mut taken = 0;
                l.scan_from(lo, |k, v, e| {
                    if k > hi {
                        return Ok(false);
                    }
                    push(k, v, e);
                    taken += 1;
                    Ok(taken < want)
                })?;
            }
        }
        Ok(out)
    }

    pub(crate) fn floor(&self, key: &[u8], strict: bool) -> Result<Option<(Vec<u8>, Stored)>> {
        Ok(match self {
            Src::Writer(w) => w.floor_entry(key, strict)?.map(|(k, e)| (k.to_vec(), Stored::from_entry(e))),
            Src::Snap(s) => s.floor_entry(key, strict)?.map(|(k, e)| (k.to_vec(), Stored::from_entry(e))),
            Src::Level(l) => l.floor(key, strict)?.map(|(k, _, e)| (k.to_vec(), Stored::from_entry(e))),
        })
    }
}

/// Resolves a stored value to its bytes (reading the value log for a pointer, and checking the
/// record there is the key's).
pub(crate) fn resolve(vlog: &dyn RecordSource, key: &[u8], s: Stored) -> Result<Option<Vec<u8>>> {
    match s {
        Stored::Value(v) => Ok(Some(v)),
        Stored::Tombstone => Ok(None),
        Stored::Pointer { ptr, len } => Ok(Some(pointed(vlog, key, ptr, len)?.value.into_owned())),
    }
}

/// Appends the bytes of a value as stored to `out` (reading the value log for a pointer, as
/// [`resolve`]); its length, or None for a tombstone.
pub(crate) fn resolve_into(
    vlog: &dyn RecordSource,
    key: &[u8],
    e: Entry<'_>,
    out: &mut Vec<u8>,
) -> Result<Option<usize>> {
    match e {
        Entry::Value(v) => {
            out.extend_from_slice(v);
            Ok(Some(v.len()))
        }
        Entry::Tombstone => Ok(None),
        Entry::Pointer { ptr, len } => {
            // Copied from where the record lies (a mapping: nothing else is copied).
            let mut matches = false;
            vlog.with_record(Lsn(ptr), &mut |rec| {
                matches = is_value_of(rec, key, len);
                if matches {
                    out.extend_from_slice(&rec.value);
                }
            })?;
            if !matches {
                return Err(not_the_value(vlog, ptr));
            }
            Ok(Some(len as usize))
        }
    }
}

/// Whether `rec` is `key`'s value of `len` bytes (what a value pointer must lead to).
fn is_value_of(rec: &Record<'_>, key: &[u8], len: u32) -> bool {
    rec.key.as_ref() == key && rec.value.len() == len as usize && !rec.tombstone
}

fn not_the_value(vlog: &dyn RecordSource, ptr: u64) -> Error {
    let at = Lsn(ptr);
    Error::corrupt_file(&vlog.path_of(at), at.offset() as u64, "value pointer leads to another record")
}

/// The value-log record a value pointer leads to, checked to be `key`'s value of `len` bytes.
fn pointed(vlog: &dyn RecordSource, key: &[u8], ptr: u64, len: u32) -> Result<Record<'static>> {
    let rec = vlog.read_record(Lsn(ptr))?;
    if !is_value_of(&rec, key, len) {
        return Err(not_the_value(vlog, ptr));
    }
    Ok(rec)
}

/// The newest entry of `key` across the tables.
pub(crate) fn get(srcs: &[Src<'_>], key: &[u8]) -> Result<Option<Stored>> {
    Ok(get_versioned(srcs, key, None)?.map(|(s, _)| s))
}

/// The newest entry of `key` across the tables, with its version.
pub(crate) fn get_versioned(
    srcs: &[Src<'_>],
    key: &[u8],
    hint: Option<&crate::btree::StartHint<'_>>,
) -> Result<Option<(Stored, u64)>> {
    Ok(get_entry(srcs, key, hint)?.map(|(e, v)| (Stored::from_entry(e), v)))
}

/// Like [`get_versioned`], the entry borrowed from its table (nothing copied).
pub(crate) fn get_entry<'s>(
    srcs: &'s [Src<'_>],
    key: &[u8],
    hint: Option<&crate::btree::StartHint<'_>>,
) -> Result<Option<(Entry<'s>, u64)>> {
    for (i, s) in srcs.iter().enumerate() {
        // A start hint is for the first table's (the active arena's) tree.
        let e = s.get_entry(key, hint.filter(|_| i == 0))?;
        if e.is_some() {
            return Ok(e);
        }
    }
    Ok(None)
}

/// One merged entry: (key, version, entry, index of the table it came from).
pub(crate) type Merged = (Vec<u8>, u64, Stored, usize);

/// A merged, chunked cursor over the tables: yields each key once with its newest entry
/// (tombstones included), in ascending order, up to `hi`.
pub(crate) struct MergeCursor<'s, 'a> {
    srcs: &'s [Src<'a>],
    hi: Vec<u8>,
    bufs: Vec<VecDeque<(Vec<u8>, u64, Stored)>>,
    /// Per table: the last key fetched (the next chunk starts after it), or None when exhausted.
    next_from: Vec<Option<Option<Vec<u8>>>>,
    lo: Vec<u8>,
    chunk: usize,
    /// Where the first table's (the active arena's) first descent may start.
    hint: Option<crate::btree::StartHint<'s>>,
}

impl<'s, 'a> MergeCursor<'s, 'a> {
    pub(crate) fn new(srcs: &'s [Src<'a>], lo: &[u8], hi: &[u8]) -> MergeCursor<'s, 'a> {
        MergeCursor::with_chunk(srcs, lo, hi, CHUNK)
    }

    /// A cursor fetching `chunk` entries per table at a time (a short scan needs few).
    pub(crate) fn with_chunk(srcs: &'s [Src<'a>], lo: &[u8], hi: &[u8], chunk: usize) -> MergeCursor<'s, 'a> {
        MergeCursor {
            chunk: chunk.clamp(1, CHUNK),
            srcs,
            hi: hi.to_vec(),
            bufs: srcs.iter().map(|_| VecDeque::new()).collect(),
            next_from: srcs.iter().map(|_| Some(None)).collect(),
            lo: lo.to_vec(),
            hint: None,
        }
    }

    fn refill(&mut self, i: usize) -> Result<()> {
        if !self.bufs[i].is_empty() {
            return Ok(());
        }
        let Some(from) = self.next_from[i].take() else { return Ok(()) };
        let bound = match &from {
            None => Bound::Included(self.lo.as_slice()),
            Some(k) => Bound::Excluded(k.as_slice()),
        };
        // Only the first chunk of the first table: later ones start past its key range anyway.
        let hint = if i == 0 && from.is_none() { self.hint.take() } else { None };
        let got = self.srcs[i].chunk_from(bound, &self.hi, self.chunk, hint.as_ref())?;
        if got.len() == self.chunk {
            self.next_from[i] = Some(Some(got[self.chunk - 1].0.clone()));
        }
        self.bufs[i].extend(got);
        Ok(())
    }

    /// The next key with its newest entry.
    pub(crate) fn next(&mut self) -> Result<Option<Merged>> {
        for i in 0..self.srcs.len() {
            self.refill(i)?;
        }
        // The smallest key; among equal keys the first table's (the newest) wins.
        let mut best: Option<usize> = None;
        for (i, b) in self.bufs.iter().enumerate() {
            if let Some(e) = b.front()
                && best.is_none_or(|j| self.bufs[j].front().is_some_and(|f| e.0 < f.0))
            {
                best = Some(i);
            }
        }
        let Some(i) = best else { return Ok(None) };
        let (key, v, s) = self.bufs[i].pop_front().expect("front exists");
        // Older tables' entries for the same key are hidden by it.
        for b in self.bufs.iter_mut().skip(i + 1) {
            if b.front().is_some_and(|e| e.0 == key) {
                b.pop_front();
            }
        }
        Ok(Some((key, v, s, i)))
    }
}

/// Up to `limit` live items in `[lo, hi]`, stopping once their keys and values reach
/// `max_bytes` (the item that reaches it is included, so a scan always makes progress). Values are
/// resolved from the log one by one, so the budget bounds what is read, not only what is returned.
pub(crate) fn scan<'s>(
    srcs: &'s [Src<'_>],
    vlog: &dyn RecordSource,
    lo: &[u8],
    hi: &[u8],
    limit: usize,
    max_bytes: usize,
    hint: Option<crate::btree::StartHint<'s>>,
) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    if lo > hi || limit == 0 {
        return Ok(out);
    }
    // Tombstones may hide some of the first chunk: ask for a little more than the limit.
    let mut cur = MergeCursor::with_chunk(srcs, lo, hi, limit.saturating_add(limit / 4 + 4));
    cur.hint = hint;
    let mut bytes = 0usize;
    while let Some((k, _, s, _)) = cur.next()? {
        if let Some(v) = resolve(vlog, &k, s)? {
            bytes += k.len() + v.len();
            out.push((k, v));
            if out.len() == limit || bytes >= max_bytes {
                break;
            }
        }
    }
    Ok(out)
}

/// About `want` keys inside `(lo, hi)` (`hi` empty: unbounded), ascending, that cut the range
/// into parts holding similar shares of the region: the tables' separator keys (`pivots` of
/// each tree and level), merged and thinned evenly. Fewer, or none, in a small region. Reads
/// interior nodes only.
pub(crate) fn pivots(srcs: &[Src<'_>], lo: &[u8], hi: &[u8], want: usize) -> Result<Vec<Vec<u8>>> {
    if want == 0 {
        return Ok(Vec::new());
    }
    let mut all: Vec<Vec<u8>> = Vec::new();
    for src in srcs {
        let keys = match src {
            Src::Writer(w) => w.pivots(lo, hi, want)?,
            Src::Snap(s) => s.pivots(lo, hi, want)?,
            Src::Level(l) => l.pivots(lo, hi, want)?,
        };
        all.extend(keys.into_iter().map(<[u8]>::to_vec));
    }
    all.sort_unstable();
    all.dedup();
    if all.len() <= want {
        return Ok(all);
    }
    // Every (len / want)-th key, from the middle of each stride.
    let n = all.len();
    Ok((0..want).map(|i| std::mem::take(&mut all[(2 * i + 1) * n / (2 * want)])).collect())
}

/// The largest live key `<= key`.
pub(crate) fn floor_key(srcs: &[Src<'_>], key: &[u8]) -> Result<Option<Vec<u8>>> {
    let (mut target, mut strict) = (key.to_vec(), false);
    loop {
        let mut best: Option<Vec<u8>> = None;
        for s in srcs {
            if let Some((k, _)) = s.floor(&target, strict)?
                && best.as_ref().is_none_or(|b| k > *b)
            {
                best = Some(k);
            }
        }
        let Some(k) = best else { return Ok(None) };
        match get(srcs, &k)? {
            Some(Stored::Tombstone) | None => (target, strict) = (k, true),
            Some(_) => return Ok(Some(k)),
        }
    }
}
