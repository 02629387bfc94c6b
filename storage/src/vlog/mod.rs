//! The value log (Tebis §2, docs/architecture.md): the write-ahead log and home of large values.
//!
//! Records go to fixed-size segment files (2 MiB by default) in one directory. A record's pointer
//! is its log sequence number: `segment id << 32 | offset`, so pointers and positions are the same
//! monotonic numbers. Appends are buffered and written with one `write(2)` per
//! [`ValueLog::commit`] (group commit); a per-log flusher thread makes them durable on demand
//! (module `durability`), and a write is acknowledged by [`ValueLog::wait_durable`] only under the
//! [`FsyncPolicy`]'s rule. Every read checks the record's CRC32C.
//!
//! # Layout
//! - `record`: the record format, encoding and checked decoding.
//! - `segment`: segment files: naming, header, the recovery scan.
//! - `durability`: written / synced / acknowledged positions, the flusher, failure and repair.
//! - `reader`: [`VlogReader`], reads by pointer from any thread or process.
//! - this module: [`ValueLog`], the writer: appends, commits, rotation, recovery, replay.
//!
//! # Invariants
//! - A batch of records never spans segments, and every segment before the active one is sealed
//!   and synced.
//! - Recovery keeps every record before the largest durable hint (or names the file and offset
//!   of the damage) and the valid chain after it; it zeroes what follows, so stale bytes can never
//!   continue the chain later.
//! - Nothing after a failed sync is acknowledged until a repair made it durable.

mod durability;
mod mapped;
mod reader;
mod record;
mod segment;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use durability::Durability;
pub use durability::{SyncCounts, SyncHook};
pub use mapped::MappedLog;
pub use reader::VlogReader;
pub(crate) use record::RECORD_HEADER;
use record::{COMMIT_RECORD, SEAL_RECORD, decode_record};
pub use record::{Record, RecordRef};
use segment::SEGMENT_HEADER;
pub(crate) use segment::new_salt;

use crate::error::{Error, Result};
use crate::fs::{self, Fs, FsFile};

/// Default segment size, as in Tebis/Kreon.
pub const DEFAULT_SEGMENT_SIZE: u32 = 2 << 20;
/// Largest segment size: recovery holds one segment in memory at a time.
pub const MAX_SEGMENT_SIZE: u32 = 64 << 20;

/// When appended records become durable, and when a write is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// A write is acknowledged once it is synced (`fdatasync`): every acknowledged write
    /// survives a power loss. One sync serves every write that arrived during the previous one.
    Always,
    /// A write is acknowledged once written to the OS (it survives a crash of the process); the
    /// flusher syncs it within the interval, so a power loss loses at most the last interval of
    /// acknowledged writes (like Redis's `appendfsync everysec`, with a configurable period).
    Interval(Duration),
    /// A write is acknowledged once written to the OS; syncs happen only when a segment is sealed
    /// or a compaction needs the log durable.
    Never,
}

impl FsyncPolicy {
    /// Parses `always`, `never` or `interval:MS` (MS >= 1).
    pub fn parse(s: &str) -> Result<FsyncPolicy> {
        match s {
            "always" => Ok(FsyncPolicy::Always),
            "never" => Ok(FsyncPolicy::Never),
            _ => match s.strip_prefix("interval:").and_then(|ms| ms.parse::<u64>().ok()) {
                Some(ms) if ms >= 1 => Ok(FsyncPolicy::Interval(Duration::from_millis(ms))),
                _ => Err(Error::Config(format!("fsync policy {s:?}: use always, never or interval:MS with MS >= 1"))),
            },
        }
    }
}

/// Value-log configuration.
#[derive(Debug, Clone)]
pub struct VlogConfig {
    /// Bytes per segment file (records never span segments), 4 KiB..=64 MiB.
    pub segment_size: u32,
    /// Durability policy.
    pub fsync: FsyncPolicy,
    /// The file layer writes go through.
    pub fs: Arc<dyn Fs>,
}

impl Default for VlogConfig {
    fn default() -> Self {
        VlogConfig { segment_size: DEFAULT_SEGMENT_SIZE, fsync: FsyncPolicy::Always, fs: fs::real() }
    }
}

/// A position in the log, and the pointer of the record that starts there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The position `offset` in segment `segment`.
    pub fn new(segment: u64, offset: u32) -> Lsn {
        Lsn(segment << 32 | offset as u64)
    }
    /// Segment id.
    pub fn segment(self) -> u64 {
        self.0 >> 32
    }
    /// Offset within the segment.
    pub fn offset(self) -> u32 {
        self.0 as u32
    }
}

/// Something that reads records by pointer: a [`VlogReader`] (system calls) or a [`MappedLog`]
/// (mappings, as the device reads).
pub trait RecordSource {
    /// Reads and checks the record at `ptr`.
    fn read_record(&self, ptr: Lsn) -> Result<Record<'static>>;
    /// Reads and checks the record at `ptr` and calls `f` with it — borrowed from where it lies
    /// when the source can (a mapping: nothing copied), else read as [`RecordSource::read_record`].
    fn with_record(&self, ptr: Lsn, f: &mut dyn FnMut(&Record<'_>)) -> Result<()> {
        f(&self.read_record(ptr)?);
        Ok(())
    }
    /// The file holding the record at `at` (for errors).
    fn path_of(&self, at: Lsn) -> PathBuf;
}

impl RecordSource for VlogReader {
    fn read_record(&self, ptr: Lsn) -> Result<Record<'static>> {
        self.read(ptr)
    }
    fn path_of(&self, at: Lsn) -> PathBuf {
        self.segment_path(at)
    }
}

/// What recovery found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments found.
    pub segments: usize,
    /// Bytes after the last valid record of the active segment that were not zero: writes that
    /// were never synced (a torn tail), cut off.
    pub truncated_bytes: u64,
    /// The largest version of any valid record seen, including cut-off ones (versions continue
    /// above it, so none is ever reused).
    pub max_version: u64,
}

/// The value log of one region: a single writer appends and commits; reads may come from any
/// thread holding a [`VlogReader`]; durability is shared through [`DurabilityWaiter`]s.
pub struct ValueLog {
    dir: PathBuf,
    cfg: VlogConfig,
    sealed: BTreeSet<u64>,
    active: u64,
    salt: u64,
    /// Bytes of the active segment's file.
    capacity: u32,
    /// Encoded records not yet written.
    buf: Vec<u8>,
    /// Offset in the active segment after `buf`.
    tail: u32,
    dur: Arc<Durability>,
    flusher: Option<JoinHandle<()>>,
    reader: VlogReader,
}

impl ValueLog {
    /// Opens (or creates) the log in `dir` and recovers it (see the module invariants): every
    /// segment but the last must be sealed and whole; the last is cut at the end of its valid
    /// chain unless that lies before its durable hint, which is corruption.
    pub fn open(dir: impl AsRef<Path>, cfg: VlogConfig) -> Result<(ValueLog, RecoveryReport)> {
        let dir = dir.as_ref().to_path_buf();
        if !(4 << 10..=MAX_SEGMENT_SIZE).contains(&cfg.segment_size) {
            return Err(Error::Config("segment_size must be in 4 KiB..=64 MiB".into()));
        }
        if let FsyncPolicy::Interval(d) = cfg.fsync
            && d < Duration::from_millis(1)
        {
            return Err(Error::Config("an fsync interval must be at least 1 ms".into()));
        }
        let fs = cfg.fs.clone();
        fs.create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let (ids, leftovers) = segment::list(&dir)?;
        for p in &leftovers {
            fs.remove(p).map_err(|e| Error::io(p, e))?;
        }
        if !leftovers.is_empty() {
            fs.sync_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        }
        let reader = VlogReader::open(&dir);
        let mut report = RecoveryReport { segments: ids.len().max(1), ..RecoveryReport::default() };
        let mut sealed = BTreeSet::new();
        let (active, salt, file, end, is_sealed, capacity) = match ids.split_last() {
            None => {
                let (file, salt) = stage(fs.as_ref(), &dir, 1, cfg.segment_size)?;
                install(fs.as_ref(), &dir, 1)?;
                (1, salt, file, SEGMENT_HEADER, false, cfg.segment_size)
            }
            Some((&last, older)) => {
                for &id in older {
                    let p = segment::path(&dir, id);
                    let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
                    let (hid, salt) = segment::decode_header(&p, &bytes)?;
                    if hid != id {
                        return Err(Error::corrupt_file(&p, 8, "segment id differs from its file name"));
                    }
                    let s = segment::scan(&bytes, id, salt);
                    if !s.sealed {
                        return Err(Error::corrupt_file(&p, s.end as u64, "damaged record in a sealed segment"));
                    }
                    report.max_version = report.max_version.max(s.max_version);
                    sealed.insert(id);
                }
                let p = segment::path(&dir, last);
                let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
                let (hid, salt) = segment::decode_header(&p, &bytes)?;
                if hid != last {
                    return Err(Error::corrupt_file(&p, 8, "segment id differs from its file name"));
                }
                let s = segment::scan(&bytes, last, salt);
                if s.end < s.durable {
                    return Err(Error::corrupt_file(
                        &p,
                        s.end as u64,
                        "damaged record inside the durable part of the log",
                    ));
                }
                report.max_version = report.max_version.max(s.max_version);
                let file = fs.open(&p).map_err(|e| Error::io(&p, e))?;
                if s.dirty_end > s.end {
                    // Stale bytes of writes that never became durable: zero them so that no later
                    // append can ever make them look like a continuation of the chain.
                    report.truncated_bytes = (s.dirty_end - s.end) as u64;
                    file.write_all_at(&vec![0u8; (s.dirty_end - s.end) as usize], s.end as u64)
                        .map_err(|e| Error::io(&p, e))?;
                }
                // What recovery keeps is made durable before anything is served from it.
                file.sync_data().map_err(|e| Error::io(&p, e))?;
                (last, salt, file, s.end, s.sealed, bytes.len() as u32)
            }
        };
        let tail = durability::Tail { seg: active, file, end: Lsn::new(active, end), sealed: is_sealed };
        let dur = Arc::new(Durability::new(cfg.fsync, fs.clone(), dir.clone(), reader.clone(), tail));
        let d = dur.clone();
        let flusher = std::thread::Builder::new()
            .name("dpukv-vlog-flush".into())
            .spawn(move || d.run_flusher())
            .map_err(|e| Error::io(&dir, e))?;
        let log = ValueLog {
            dir,
            cfg,
            sealed,
            active,
            salt,
            capacity,
            buf: Vec::with_capacity(1 << 16),
            tail: end,
            dur,
            flusher: Some(flusher),
            reader,
        };
        Ok((log, report))
    }

    /// The directory holding the segments.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The policy in force.
    pub fn policy(&self) -> FsyncPolicy {
        self.cfg.fsync
    }

    /// Largest batch (sum of its records' encoded sizes) one segment can take.
    pub fn max_batch_bytes(&self) -> usize {
        (self.cfg.segment_size - SEGMENT_HEADER) as usize - COMMIT_RECORD - SEAL_RECORD
    }

    /// Largest value a record with a `key_len`-byte key can hold.
    pub fn max_value_len(&self, key_len: usize) -> usize {
        self.max_batch_bytes() - RECORD_HEADER - key_len
    }

    /// Whether `bytes` more of records would need a new segment.
    pub fn needs_rotation(&self, bytes: usize) -> bool {
        let marker = if self.buf.is_empty() { COMMIT_RECORD } else { 0 };
        self.tail as usize + marker + bytes + SEAL_RECORD > self.capacity as usize || self.dur.lock().sealed
    }

    /// Makes sure the next `bytes` of records land in one segment (rotating now if needed), so a
    /// batch never spans segments. A rotation first writes what is buffered.
    pub fn ensure_room(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.max_batch_bytes() {
            return Err(Error::BatchTooLarge { bytes, max: self.max_batch_bytes() });
        }
        if self.needs_rotation(bytes) {
            self.rotate()?;
        }
        Ok(())
    }

    /// Buffers a record; returns its pointer. Nothing is written until [`ValueLog::commit`].
    pub fn append(&mut self, rec: &Record<'_>) -> Result<Lsn> {
        let size = rec.encoded_len();
        self.ensure_room(size)?;
        if self.buf.is_empty() {
            let hint = self.dur.lock().synced;
            Record::commit_marker(hint).encode(self.salt, &mut self.buf);
            self.tail += COMMIT_RECORD as u32;
        }
        let at = Lsn::new(self.active, self.tail);
        rec.encode(self.salt, &mut self.buf);
        self.tail += size as u32;
        Ok(at)
    }

    /// Recovery only, before any append: ends the log at `at`, zeroing what follows (an
    /// incomplete batch its owner found at the end of the log, which must not stay in front of
    /// the next writes).
    pub fn cut_tail(&mut self, at: Lsn) -> Result<()> {
        if !self.buf.is_empty() {
            return Err(Error::Config("cut_tail after appends".into()));
        }
        self.dur.cut(at)?;
        self.tail = at.offset();
        Ok(())
    }

    /// Drops what was appended since the last commit (a group that will not be written).
    pub fn discard(&mut self) {
        self.tail -= self.buf.len() as u32;
        self.buf.clear();
    }

    /// Writes everything appended so far with one `write(2)`. Returns the end position: every
    /// record before it may be acknowledged once [`ValueLog::wait_durable`] returns for it.
    /// On an error nothing of the group may be acknowledged (the log is failed and repairs
    /// itself; whether the records survive a crash before the repair is unknown).
    pub fn commit(&mut self) -> Result<Lsn> {
        if self.buf.is_empty() {
            return Ok(self.end());
        }
        let r = self.dur.write(&self.buf);
        self.tail -= self.buf.len() as u32;
        self.buf.clear();
        let end = r?;
        self.tail = end.offset();
        Ok(end)
    }

    /// Seals the active segment and starts the next one. The next segment is prepared first
    /// (so a full disk fails here, cleanly, with nothing written), then the seal is written and
    /// synced, then the new segment is renamed into place.
    fn rotate(&mut self) -> Result<()> {
        self.commit()?;
        let next = self.active + 1;
        let (file, salt) = stage(self.cfg.fs.as_ref(), &self.dir, next, self.cfg.segment_size)?;
        let r = (|| {
            if !self.dur.lock().sealed {
                let mut b = Vec::with_capacity(SEAL_RECORD);
                Record::seal().encode(self.salt, &mut b);
                self.dur.seal(&b)?;
            }
            let end = self.end();
            self.dur.sync_to(end)?;
            install(self.cfg.fs.as_ref(), &self.dir, next)
        })();
        if let Err(e) = r {
            let _ = self.cfg.fs.remove(&segment::staging_path(&self.dir, next));
            return Err(e);
        }
        self.dur.switch(next, file);
        self.sealed.insert(self.active);
        self.active = next;
        self.salt = salt;
        self.capacity = self.cfg.segment_size;
        self.tail = SEGMENT_HEADER;
        Ok(())
    }

    /// Everything before this position is on disk.
    pub fn synced_lsn(&self) -> Lsn {
        Lsn(self.dur.lock().synced)
    }

    /// Blocks until `lsn` may be acknowledged under the policy; an error if the log failed under
    /// it (the write's outcome is then unknown).
    pub fn wait_durable(&self, lsn: Lsn) -> Result<()> {
        self.dur.wait_ack(lsn)
    }

    /// Makes everything before `lsn` durable now, whatever the policy.
    pub fn sync_to(&self, lsn: Lsn) -> Result<()> {
        self.dur.sync_to(lsn)
    }

    /// Under `Always`: the caller (the log's writer) will sync what it writes from now on
    /// itself ([`ValueLog::sync_held`]) or hand it to the flusher ([`ValueLog::unhold_sync`]);
    /// meanwhile its writes do not wake the flusher, which leaves them alone. No effect under
    /// the other policies.
    pub fn hold_sync(&self) {
        self.dur.hold();
    }

    /// Ends [`ValueLog::hold_sync`] by syncing everything written, on this thread (nothing
    /// without a hold: under the other policies).
    pub fn sync_held(&self) {
        self.dur.sync_held();
    }

    /// Ends [`ValueLog::hold_sync`]: the flusher syncs what was written under it.
    pub fn unhold_sync(&self) {
        self.dur.unhold();
    }

    /// The syncs made so far, by thread.
    pub fn sync_counts(&self) -> SyncCounts {
        self.dur.lock().syncs
    }

    /// A handle that waits for durability from another thread.
    pub fn durability(&self) -> DurabilityWaiter {
        DurabilityWaiter(self.dur.clone())
    }

    /// Registers the hook the flusher calls with every new synced position under `Always`.
    pub fn set_sync_hook(&self, hook: Option<SyncHook>) {
        self.dur.set_hook(hook);
    }

    /// Why the log is failed (a sync or write failed and the repair has not succeeded yet).
    pub fn failure(&self) -> Option<String> {
        self.dur.failed()
    }

    /// Segments rewritten after a failed sync or write so far.
    pub fn repairs(&self) -> u64 {
        self.dur.lock().repairs
    }

    /// The end of the log (after the last written record).
    pub fn end(&self) -> Lsn {
        Lsn(self.dur.lock().written)
    }

    /// A handle that reads the log's bytes as written, for replication (usable from any thread).
    pub fn tail(&self) -> LogTail {
        LogTail { dir: self.dir.clone(), fs: self.cfg.fs.clone(), dur: self.dur.clone() }
    }

    /// A reader for this log (cheap to clone, usable from any thread).
    pub fn reader(&self) -> VlogReader {
        self.reader.clone()
    }

    /// Reads and checks the record at `ptr`.
    pub fn read(&self, ptr: Lsn) -> Result<Record<'static>> {
        if ptr.segment() == self.active && ptr >= self.end() {
            return Err(Error::corrupt(ptr.0, "value pointer beyond the end of the log"));
        }
        self.reader.read(ptr)
    }

    /// Segment ids in order, sealed then active.
    pub fn segments(&self) -> Vec<u64> {
        self.sealed.iter().copied().chain(std::iter::once(self.active)).collect()
    }

    /// The id of the active segment.
    pub fn active_segment(&self) -> u64 {
        self.active
    }

    /// Bytes of one segment file.
    pub fn segment_size(&self) -> u32 {
        self.cfg.segment_size
    }

    fn segment_bytes(&self, id: u64) -> Result<(Vec<u8>, u64, usize)> {
        let p = segment::path(&self.dir, id);
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        let (_, salt) = segment::decode_header(&p, &bytes)?;
        let end = if id == self.active { self.end().offset() as usize } else { bytes.len() };
        let end = end.min(bytes.len());
        Ok((bytes, salt, end))
    }

    /// A cursor over every data record and annotation at or after `from`, in log order. It owns
    /// what it needs (the caller may change the store between records) and holds one segment in
    /// memory at a time.
    pub fn cursor(&self, from: Lsn) -> LogCursor {
        LogCursor {
            dir: self.dir.clone(),
            todo: self.segments().into_iter().filter(|&id| id >= from.segment()).collect(),
            active: self.active,
            active_end: self.end().offset(),
            from,
            cur: None,
        }
    }

    /// Calls `f` for every data record and annotation at or after `from`, in log order.
    pub fn replay(&self, from: Lsn, mut f: impl FnMut(Lsn, RecordRef<'_>) -> Result<()>) -> Result<()> {
        let mut c = self.cursor(from);
        while let Some((at, rec)) = c.next()? {
            f(at, rec)?;
        }
        Ok(())
    }

    /// Up to `max` data records of segment `id` starting at `from` (an offset; 0 = start), with
    /// the offset to continue from (None at the segment's end).
    pub fn segment_records(&self, id: u64, from: u32, max: usize) -> Result<SegmentRecords> {
        if id != self.active && !self.sealed.contains(&id) {
            return Err(Error::Config(format!("no value-log segment {id}")));
        }
        let (bytes, salt, end) = self.segment_bytes(id)?;
        let mut pos = from.max(SEGMENT_HEADER) as usize;
        let mut out = Vec::new();
        while pos < end && out.len() < max {
            let (rec, next) = decode_record(&bytes[..end], pos, salt)
                .map_err(|what| Error::corrupt_file(&segment::path(&self.dir, id), pos as u64, what))?;
            if rec.meta_kind() == Some(record::META_SEAL) {
                pos = end;
                break;
            }
            if !rec.meta {
                out.push((Lsn::new(id, pos as u32), rec.to_owned()));
            }
            pos = next;
        }
        Ok((out, (pos < end).then_some(pos as u32)))
    }

    /// Takes a sealed segment out of the log (no index needs its records any more) and returns
    /// its file, which the caller deletes once no reader can reach it.
    pub fn detach_segment(&mut self, id: u64) -> Result<PathBuf> {
        if !self.sealed.remove(&id) {
            return Err(Error::Config(format!("value-log segment {id} is not sealed")));
        }
        self.reader.forget(id);
        Ok(segment::path(&self.dir, id))
    }

    /// Bytes the log's segments take on disk (they are allocated whole; detached segments not
    /// deleted yet are not counted).
    pub fn disk_bytes(&self) -> u64 {
        (self.sealed.len() as u64 + 1) * self.cfg.segment_size as u64
    }
}

/// Where the chain of valid records of a segment image ends, and where its last byte that is not
/// zero ends (what lies between is a torn tail of writes that never became durable). For a copy
/// of a segment received from another node (a backup's), checked against the id and salt of its
/// header.
pub(crate) fn valid_end(name: &Path, bytes: &[u8]) -> Result<(u32, u32)> {
    let (id, salt) = segment::decode_header(name, bytes)?;
    let s = segment::scan(bytes, id, salt);
    Ok((s.end, s.dirty_end.max(s.end)))
}

/// Path of segment `id` of the log in `dir`.
pub fn segment_path(dir: &Path, id: u64) -> PathBuf {
    segment::path(dir, id)
}

/// Checks the header of a segment image (`name` names it in errors); returns its id and salt.
pub fn segment_header(name: &Path, bytes: &[u8]) -> Result<(u64, u64)> {
    segment::decode_header(name, bytes)
}

/// The header of segment `id` with `salt` (a backup renumbers the segments it copies).
pub fn encode_segment_header(id: u64, salt: u64) -> Vec<u8> {
    segment::encode_header(id, salt).to_vec()
}

/// A piece of a log's bytes as a backup receives them: the bytes of segment `segment` from
/// `offset` on, exactly as the primary wrote them (so every record keeps its offset, and value
/// pointers their meaning, once the backup maps the segment id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogChunk {
    /// The primary's segment id.
    pub segment: u64,
    /// Where `bytes` start in the segment (0: with the segment's header).
    pub offset: u32,
    /// The bytes.
    pub bytes: Vec<u8>,
    /// The segment file's size (a backup allocates the same).
    pub segment_size: u32,
    /// Whether these bytes end the segment (it is sealed and the backup may sync it).
    pub sealed: bool,
}

impl LogChunk {
    /// Where the next chunk starts.
    pub fn next(&self) -> Lsn {
        if self.sealed {
            Lsn::new(self.segment + 1, 0)
        } else {
            Lsn::new(self.segment, self.offset + self.bytes.len() as u32)
        }
    }
}

/// Reads a log's written bytes from any thread ([`ValueLog::tail`]): what a primary streams to
/// its backups. Only bytes before the log's written end are read, so a chunk never holds a
/// record in the making.
#[derive(Clone)]
pub struct LogTail {
    dir: PathBuf,
    fs: Arc<dyn Fs>,
    dur: Arc<Durability>,
}

impl std::fmt::Debug for LogTail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogTail").field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl LogTail {
    /// The end of what is written.
    pub fn end(&self) -> Lsn {
        Lsn(self.dur.lock().written)
    }

    /// Where the log starts now: offset 0 of its oldest segment (older ones were collected).
    pub fn start(&self) -> Result<Lsn> {
        let mut first = self.end().segment();
        for e in std::fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))? {
            let e = e.map_err(|e| Error::io(&self.dir, e))?;
            if let Some(id) = segment::parse_name(&e.file_name().to_string_lossy()) {
                first = first.min(id);
            }
        }
        Ok(Lsn::new(first, 0))
    }

    /// Whether the log from `from` on is all here: its segment and every later one up to the
    /// end (a backup resuming there can be streamed the rest). False once garbage collection
    /// took one of them, or if `from` is past the end — of the log, or of its sealed segment.
    pub fn continues_from(&self, from: Lsn) -> Result<bool> {
        let end = self.end();
        if from > end {
            return Ok(false);
        }
        let have: std::collections::BTreeSet<u64> = self.segments()?.into_iter().collect();
        if !(from.segment()..=end.segment()).all(|s| have.contains(&s)) {
            return Ok(false);
        }
        // A sealed segment ends where its file does: a copy that reaches past that holds bytes
        // this log does not have (a primary that lost power sealed the segment shorter than
        // what its backups had received) and cannot be continued from there.
        if from.segment() < end.segment() {
            let p = segment::path(&self.dir, from.segment());
            let size = self.fs.open(&p).and_then(|f| f.size()).map_err(|e| Error::io(&p, e))?;
            return Ok(u64::from(from.offset()) <= size);
        }
        Ok(true)
    }

    /// The log's segments as their files are now, ascending (a collected segment whose file is
    /// not deleted yet is still named: readers may use it).
    pub fn segments(&self) -> Result<Vec<u64>> {
        let mut ids = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))? {
            let e = e.map_err(|e| Error::io(&self.dir, e))?;
            if let Some(id) = segment::parse_name(&e.file_name().to_string_lossy()) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }

    /// Up to `max` bytes from `from` (None: nothing written there yet). A sealed segment is read
    /// to its file's end, then the next chunk starts at the next segment's offset 0. An error if
    /// the segment is gone (collected: the backup must copy the region again).
    pub fn chunk(&self, from: Lsn, max: usize) -> Result<Option<LogChunk>> {
        let end = self.end();
        if from >= end {
            return Ok(None);
        }
        let p = segment::path(&self.dir, from.segment());
        let file = self.fs.open(&p).map_err(|e| Error::io(&p, e))?;
        let size = file.size().map_err(|e| Error::io(&p, e))?;
        let sealed_segment = from.segment() < end.segment();
        let stop = if sealed_segment { size } else { u64::from(end.offset()).min(size) };
        let start = u64::from(from.offset());
        if start > stop {
            return Err(Error::Config(format!("log position {from:?} is past its segment's end")));
        }
        // A segment's first chunk carries at least its whole header (a backup names its copy by
        // it).
        let least = if start == 0 { SEGMENT_HEADER as usize } else { 1 };
        let n = (stop - start).min(max.max(least) as u64) as usize;
        let mut bytes = vec![0; n];
        file.read_exact_at(&mut bytes, start).map_err(|e| Error::io(&p, e))?;
        Ok(Some(LogChunk {
            segment: from.segment(),
            offset: from.offset(),
            bytes,
            segment_size: size.min(u64::from(MAX_SEGMENT_SIZE)) as u32,
            sealed: sealed_segment && start + n as u64 == stop,
        }))
    }
}

/// See [`ValueLog::cursor`].
pub struct LogCursor {
    dir: PathBuf,
    todo: std::collections::VecDeque<u64>,
    active: u64,
    active_end: u32,
    from: Lsn,
    /// The segment being read: id, bytes, salt, end of its records, next position.
    cur: Option<(u64, Vec<u8>, u64, usize, usize)>,
}

impl LogCursor {
    /// The next record, or None at the end of the log.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<(Lsn, Record<'static>)>> {
        loop {
            if self.cur.is_none() {
                let Some(id) = self.todo.pop_front() else { return Ok(None) };
                let p = segment::path(&self.dir, id);
                let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
                let (_, salt) = segment::decode_header(&p, &bytes)?;
                let pos =
                    if id == self.from.segment() { self.from.offset().max(SEGMENT_HEADER) } else { SEGMENT_HEADER };
                let end = if id == self.active {
                    (self.active_end as usize).min(bytes.len())
                } else if pos > SEGMENT_HEADER {
                    // Starting inside a sealed segment, maybe at its end (after its seal: a log
                    // whose last segment was sealed ended there): read only its chain of records.
                    segment::scan(&bytes, id, salt).end as usize
                } else {
                    bytes.len()
                };
                self.cur = Some((id, bytes, salt, end, pos as usize));
            }
            let (id, bytes, salt, end, pos) = self.cur.as_mut().expect("loaded above");
            if *pos >= *end {
                self.cur = None;
                continue;
            }
            let at = *pos;
            let (rec, next) = decode_record(&bytes[..*end], at, *salt)
                .map_err(|what| Error::corrupt_file(&segment::path(&self.dir, *id), at as u64, what))?;
            *pos = next;
            if rec.meta_kind() == Some(record::META_SEAL) {
                *pos = *end;
                continue;
            }
            if rec.meta && rec.annotation_data().is_none() {
                continue;
            }
            return Ok(Some((Lsn::new(*id, at as u32), rec.to_owned())));
        }
    }
}

/// Records of one segment with the offset to continue from (None at its end).
pub type SegmentRecords = (Vec<(Lsn, Record<'static>)>, Option<u32>);

impl Drop for ValueLog {
    fn drop(&mut self) {
        if self.dur.failed().is_none() {
            let _ = self.commit();
        }
        self.dur.stop();
        if let Some(h) = self.flusher.take() {
            let _ = h.join();
        }
    }
}

/// Creates segment `id` under its staging name: allocated whole, header written and synced.
fn stage(fs: &dyn Fs, dir: &Path, id: u64, size: u32) -> Result<(Arc<dyn FsFile>, u64)> {
    let p = segment::staging_path(dir, id);
    let _ = fs.remove(&p);
    let salt = segment::new_salt();
    let r = (|| {
        let f = fs.create(&p)?;
        f.allocate(size as u64)?;
        f.write_all_at(&segment::encode_header(id, salt), 0)?;
        f.sync_data()?;
        Ok(f)
    })();
    match r {
        Ok(f) => Ok((f, salt)),
        Err(e) => {
            let _ = fs.remove(&p);
            Err(Error::io(&p, e))
        }
    }
}

/// Renames a staged segment into place, durably.
fn install(fs: &dyn Fs, dir: &Path, id: u64) -> Result<()> {
    let (from, to) = (segment::staging_path(dir, id), segment::path(dir, id));
    fs.rename(&from, &to).map_err(|e| Error::io(&to, e))?;
    fs.sync_dir(dir).map_err(|e| Error::io(dir, e))
}

/// Waits for durability from another thread.
#[derive(Clone)]
pub struct DurabilityWaiter(Arc<Durability>);

impl DurabilityWaiter {
    /// Blocks until `lsn` may be acknowledged; an error if the log failed under it.
    pub fn wait(&self, lsn: Lsn) -> Result<()> {
        self.0.wait_ack(lsn)
    }
    /// Makes everything before `lsn` durable now and waits for it.
    pub fn sync_to(&self, lsn: Lsn) -> Result<()> {
        self.0.sync_to(lsn)
    }
    /// The syncs made so far, by thread.
    pub fn sync_counts(&self) -> SyncCounts {
        self.0.lock().syncs
    }
    /// Whether `lsn` may be acknowledged now (what [`DurabilityWaiter::wait`] would answer at
    /// once with `Ok`), without waiting.
    pub fn acknowledged(&self, lsn: Lsn) -> bool {
        self.0.lock().ack >= lsn.0
    }
    /// Everything before this position is on disk.
    pub fn synced_lsn(&self) -> Lsn {
        Lsn(self.0.lock().synced)
    }
}
