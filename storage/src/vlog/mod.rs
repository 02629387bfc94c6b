//! The value log (Tebis §2, ARCHITECTURE.md §4): the write-ahead log and home of large values.
//!
//! Records go to fixed-size segment files (2 MiB by default) in one directory. A record's pointer
//! is its log sequence number: `segment id << 32 | offset`, so pointers and positions are the same
//! monotonic numbers. Appends are buffered and written with one `write(2)` per [`ValueLog::commit`]
//! (group commit); durability follows the [`FsyncPolicy`]. Every read checks the record's CRC32C.
//!
//! # Layout
//! - `record`: the record format, encoding and checked decoding.
//! - `segment`: segment files: naming, header, scanning and torn-tail recovery.
//! - this module: [`ValueLog`], the writer, reader and background flusher.

mod record;
mod segment;

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub(crate) use record::{RECORD_HEADER, decode_record};
pub use record::{Record, RecordRef};
pub use segment::RecoveryReport;
use segment::{SEGMENT_HEADER, Segment};

use crate::error::{Error, Result};

/// Records of one segment with the offset to continue from (None at its end).
pub type SegmentRecords = (Vec<(Lsn, Record<'static>)>, Option<u32>);

/// Default segment size, as in Tebis/Kreon.
pub const DEFAULT_SEGMENT_SIZE: u32 = 2 << 20;

/// When appended records become durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// `commit` returns after `fdatasync`: a committed record survives a machine crash.
    Always,
    /// A background thread syncs every interval; [`ValueLog::wait_durable`] waits for it.
    Interval(Duration),
    /// Never sync explicitly: committed records are in the OS page cache (they survive a process
    /// crash, not a machine crash). `wait_durable` returns at once.
    Never,
}

/// Value-log configuration.
#[derive(Debug, Clone)]
pub struct VlogConfig {
    /// Bytes per segment file (records never span segments).
    pub segment_size: u32,
    /// Durability policy.
    pub fsync: FsyncPolicy,
}

impl Default for VlogConfig {
    fn default() -> Self {
        VlogConfig { segment_size: DEFAULT_SEGMENT_SIZE, fsync: FsyncPolicy::Always }
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

struct Durable {
    lsn: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
    /// The active segment file and the position written to it, for the flusher.
    current: Mutex<(Arc<File>, u64)>,
    /// An fsync error seen by the flusher, reported to the next caller.
    failed: AtomicBool,
}

impl Durable {
    fn advance(&self, lsn: u64) {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if lsn > self.lsn.load(Ordering::Acquire) {
            self.lsn.store(lsn, Ordering::Release);
        }
        self.cv.notify_all();
    }
}

/// The value log of one region: a single writer appends and commits; reads may come from any
/// thread holding a [`VlogReader`].
pub struct ValueLog {
    dir: PathBuf,
    cfg: VlogConfig,
    /// Sealed segments: id -> length.
    sealed: BTreeMap<u64, u32>,
    active: Segment,
    buf: Vec<u8>,
    /// Offset in the active segment up to which `buf` has been accounted (written + buffered).
    tail: u32,
    durable: Arc<Durable>,
    stop: Arc<AtomicBool>,
    flusher: Option<JoinHandle<()>>,
    reader: VlogReader,
}

impl ValueLog {
    /// Opens (or creates) the log in `dir`, recovering the tail: a torn last record is cut off at
    /// the last valid record; corruption before the tail is an error naming file and offset.
    pub fn open(dir: impl AsRef<Path>, cfg: VlogConfig) -> Result<(ValueLog, RecoveryReport)> {
        let dir = dir.as_ref().to_path_buf();
        if cfg.segment_size < 4096 || cfg.segment_size > 1 << 30 {
            return Err(Error::Config("segment_size must be in 4 KiB..=1 GiB".into()));
        }
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let ids = segment::list(&dir)?;
        let mut sealed = BTreeMap::new();
        let mut report = RecoveryReport::default();
        let active = match ids.last() {
            None => Segment::create(&dir, 1)?,
            Some(&last) => {
                for &id in &ids[..ids.len() - 1] {
                    let len = segment::check_sealed(&dir, id, cfg.segment_size)?;
                    sealed.insert(id, len);
                }
                let (seg, r) = Segment::recover(&dir, last, cfg.segment_size)?;
                report = r;
                seg
            }
        };
        report.segments = ids.len().max(1);
        let tail = active.len;
        let start = Lsn::new(active.id, tail).0;
        let durable = Arc::new(Durable {
            lsn: AtomicU64::new(start),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            current: Mutex::new((active.file.clone(), start)),
            failed: AtomicBool::new(false),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let flusher = match cfg.fsync {
            FsyncPolicy::Interval(every) => Some(spawn_flusher(durable.clone(), stop.clone(), every)),
            _ => None,
        };
        let reader = VlogReader { dir: dir.clone(), files: Arc::new(Mutex::new(BTreeMap::new())) };
        let log = ValueLog {
            dir,
            cfg,
            sealed,
            active,
            buf: Vec::with_capacity(1 << 16),
            tail,
            durable,
            stop,
            flusher,
            reader,
        };
        Ok((log, report))
    }

    /// The directory holding the segments.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Buffers a record; returns its pointer. Nothing is written until [`ValueLog::commit`].
    pub fn append(&mut self, rec: &Record<'_>) -> Result<Lsn> {
        let size = rec.encoded_len();
        if size > (self.cfg.segment_size - SEGMENT_HEADER) as usize {
            return Err(Error::ValueTooLarge { len: rec.value.len(), max: self.max_value_len(rec.key.len()) });
        }
        if self.tail as usize + size > self.cfg.segment_size as usize {
            self.rotate()?;
        }
        let at = Lsn::new(self.active.id, self.tail);
        rec.encode(&mut self.buf);
        self.tail += size as u32;
        Ok(at)
    }

    /// Makes sure the next `bytes` of records land in one segment (rotating now if needed), so a
    /// batch never spans segments and a crash can only tear the tail of the last one.
    pub fn ensure_room(&mut self, bytes: usize) -> Result<()> {
        if bytes > (self.cfg.segment_size - SEGMENT_HEADER) as usize {
            return Err(Error::ValueTooLarge { len: bytes, max: (self.cfg.segment_size - SEGMENT_HEADER) as usize });
        }
        if self.tail as usize + bytes > self.cfg.segment_size as usize {
            self.rotate()?;
        }
        Ok(())
    }

    /// Cuts the active segment back to `at` (recovery: drops an incomplete trailing batch).
    pub fn truncate_tail(&mut self, at: Lsn) -> Result<()> {
        if at.segment() != self.active.id
            || at.offset() > self.active.len
            || at.offset() < SEGMENT_HEADER
            || !self.buf.is_empty()
        {
            return Err(Error::Config("truncate_tail: position outside the active segment".into()));
        }
        self.active.file.set_len(at.offset() as u64).map_err(|e| Error::io(&self.active.path, e))?;
        self.active.file.sync_all().map_err(|e| Error::io(&self.active.path, e))?;
        self.active.len = at.offset();
        self.tail = at.offset();
        Ok(())
    }

    /// Largest value a record with a `key_len`-byte key can hold.
    pub fn max_value_len(&self, key_len: usize) -> usize {
        (self.cfg.segment_size - SEGMENT_HEADER) as usize - RECORD_HEADER - key_len
    }

    /// Writes everything appended so far with one `write(2)`, syncing under `Always`. Returns the
    /// end position: every record before it is durable once [`ValueLog::durable_lsn`] reaches it.
    pub fn commit(&mut self) -> Result<Lsn> {
        if !self.buf.is_empty() {
            let off = self.active.len as u64;
            self.active.file.write_all_at(&self.buf, off).map_err(|e| Error::io(&self.active.path, e))?;
            self.active.len += self.buf.len() as u32;
            self.buf.clear();
        }
        let end = Lsn::new(self.active.id, self.active.len);
        match self.cfg.fsync {
            FsyncPolicy::Always => {
                self.active.file.sync_data().map_err(|e| Error::io(&self.active.path, e))?;
                self.durable.advance(end.0);
            }
            FsyncPolicy::Interval(_) => {
                *self.durable.current.lock().unwrap_or_else(|e| e.into_inner()) = (self.active.file.clone(), end.0);
            }
            FsyncPolicy::Never => self.durable.advance(end.0),
        }
        if self.durable.failed.load(Ordering::Acquire) {
            return Err(Error::io(&self.active.path, std::io::Error::other("background fsync failed")));
        }
        Ok(end)
    }

    /// Seals the active segment (written and synced) and starts the next one.
    fn rotate(&mut self) -> Result<()> {
        self.commit()?;
        self.active.file.sync_data().map_err(|e| Error::io(&self.active.path, e))?;
        self.sealed.insert(self.active.id, self.active.len);
        let next = Segment::create(&self.dir, self.active.id + 1)?;
        segment::sync_dir(&self.dir)?;
        let start = Lsn::new(next.id, next.len).0;
        self.active = next;
        self.tail = self.active.len;
        *self.durable.current.lock().unwrap_or_else(|e| e.into_inner()) = (self.active.file.clone(), start);
        self.durable.advance(start);
        Ok(())
    }

    /// Everything before this position is durable under the policy.
    pub fn durable_lsn(&self) -> Lsn {
        Lsn(self.durable.lsn.load(Ordering::Acquire))
    }

    /// Blocks until `lsn` is durable (at once under `Always` and `Never`).
    pub fn wait_durable(&self, lsn: Lsn) {
        wait(&self.durable, lsn)
    }

    /// A handle that waits for durability from another thread.
    pub fn durability(&self) -> DurabilityWaiter {
        DurabilityWaiter(self.durable.clone())
    }

    /// The end of the log (after the last committed record).
    pub fn end(&self) -> Lsn {
        Lsn::new(self.active.id, self.active.len)
    }

    /// A reader for this log (cheap to clone, usable from any thread).
    pub fn reader(&self) -> VlogReader {
        self.reader.clone()
    }

    /// Reads and checks the record at `ptr`.
    pub fn read(&self, ptr: Lsn) -> Result<Record<'static>> {
        if ptr.segment() == self.active.id && ptr.offset() >= self.active.len {
            return Err(Error::corrupt(ptr.0, "value pointer beyond the end of the log"));
        }
        self.reader.read(ptr)
    }

    /// Segment ids in order, sealed then active.
    pub fn segments(&self) -> Vec<u64> {
        self.sealed.keys().copied().chain(std::iter::once(self.active.id)).collect()
    }

    /// Calls `f` for every committed record at or after `from`, in log order.
    pub fn replay(&self, from: Lsn, mut f: impl FnMut(Lsn, RecordRef<'_>) -> Result<()>) -> Result<()> {
        for id in self.segments() {
            if id < from.segment() {
                continue;
            }
            let start = if id == from.segment() { from.offset().max(SEGMENT_HEADER) } else { SEGMENT_HEADER };
            let bytes = segment::read_all(&self.dir, id)?;
            let end = if id == self.active.id { self.active.len as usize } else { bytes.len() };
            let mut pos = start as usize;
            while pos < end {
                let (rec, next) = decode_record(&bytes[..end], pos)
                    .map_err(|what| Error::corrupt_file(&segment::path(&self.dir, id), pos as u64, what))?;
                f(Lsn::new(id, pos as u32), rec)?;
                pos = next;
            }
        }
        Ok(())
    }

    /// Up to `max` committed records of segment `id` starting at `from` (an offset; 0 = start).
    /// Returns them with the offset to continue from (None at the segment's end).
    pub fn segment_records(&self, id: u64, from: u32, max: usize) -> Result<SegmentRecords> {
        let len = if id == self.active.id {
            self.active.len
        } else {
            *self.sealed.get(&id).ok_or_else(|| Error::Config(format!("no value-log segment {id}")))?
        };
        let bytes = segment::read_all(&self.dir, id)?;
        let end = (len as usize).min(bytes.len());
        let mut pos = from.max(SEGMENT_HEADER) as usize;
        let mut out = Vec::new();
        while pos < end && out.len() < max {
            let (rec, next) = decode_record(&bytes[..end], pos)
                .map_err(|what| Error::corrupt_file(&segment::path(&self.dir, id), pos as u64, what))?;
            out.push((Lsn::new(id, pos as u32), rec.to_owned()));
            pos = next;
        }
        Ok((out, (pos < end).then_some(pos as u32)))
    }

    /// Deletes one sealed segment (its records are no longer referenced).
    pub fn remove_segment(&mut self, id: u64) -> Result<()> {
        if self.sealed.remove(&id).is_none() {
            return Err(Error::Config(format!("value-log segment {id} is not sealed")));
        }
        self.reader.forget(id);
        let p = segment::path(&self.dir, id);
        std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        segment::sync_dir(&self.dir)
    }

    /// Bytes in all segments.
    pub fn disk_bytes(&self) -> u64 {
        self.sealed.values().map(|&l| l as u64).sum::<u64>() + self.active.len as u64
    }
}

impl Drop for ValueLog {
    fn drop(&mut self) {
        let _ = self.commit();
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.flusher.take() {
            let _ = h.join();
        }
    }
}

fn wait(d: &Durable, lsn: Lsn) {
    let mut g = d.lock.lock().unwrap_or_else(|e| e.into_inner());
    while d.lsn.load(Ordering::Acquire) < lsn.0 && !d.failed.load(Ordering::Acquire) {
        g = d.cv.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

/// Waits for durability from another thread.
#[derive(Clone)]
pub struct DurabilityWaiter(Arc<Durable>);

impl DurabilityWaiter {
    /// Blocks until `lsn` is durable.
    pub fn wait(&self, lsn: Lsn) {
        wait(&self.0, lsn)
    }
    /// Everything before this position is durable.
    pub fn durable_lsn(&self) -> Lsn {
        Lsn(self.0.lsn.load(Ordering::Acquire))
    }
}

fn spawn_flusher(d: Arc<Durable>, stop: Arc<AtomicBool>, every: Duration) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name("dpukv-vlog-flush".into())
        .spawn(move || {
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(every);
                let (file, lsn) = d.current.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if lsn > d.lsn.load(Ordering::Acquire) {
                    if file.sync_data().is_err() {
                        d.failed.store(true, Ordering::Release);
                        d.cv.notify_all();
                        return;
                    }
                    d.advance(lsn);
                }
            }
            // Final sync so a clean shutdown leaves everything durable.
            let (file, lsn) = d.current.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if file.sync_data().is_ok() {
                d.advance(lsn);
            }
        })
        .expect("spawning the value-log flusher thread")
}

/// Reads records by pointer; shareable across threads (and usable by another process that
/// opens the same directory).
#[derive(Clone)]
pub struct VlogReader {
    dir: PathBuf,
    files: Arc<Mutex<BTreeMap<u64, Arc<File>>>>,
}

impl VlogReader {
    /// A reader of the log in `dir` (for a process other than the writer's).
    pub fn open(dir: impl AsRef<Path>) -> VlogReader {
        VlogReader { dir: dir.as_ref().to_path_buf(), files: Arc::new(Mutex::new(BTreeMap::new())) }
    }

    fn file(&self, id: u64) -> Result<Arc<File>> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = files.get(&id) {
            return Ok(f.clone());
        }
        let p = segment::path(&self.dir, id);
        let f = Arc::new(File::open(&p).map_err(|e| Error::io(&p, e))?);
        if files.len() >= 256 {
            files.pop_first();
        }
        files.insert(id, f.clone());
        Ok(f)
    }

    /// The file holding the record at `at`.
    pub fn segment_path(&self, at: Lsn) -> PathBuf {
        segment::path(&self.dir, at.segment())
    }

    fn forget(&self, id: u64) {
        self.files.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    }

    /// Reads and checks the record at `ptr`: CRC, lengths, and that it lies inside its segment.
    pub fn read(&self, ptr: Lsn) -> Result<Record<'static>> {
        let f = self.file(ptr.segment())?;
        let p = || segment::path(&self.dir, ptr.segment());
        let mut head = [0u8; RECORD_HEADER];
        f.read_exact_at(&mut head, ptr.offset() as u64)
            .map_err(|_| Error::corrupt_file(&p(), ptr.offset() as u64, "value pointer beyond the segment"))?;
        let body = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
        if body > 1 << 30 {
            return Err(Error::corrupt_file(&p(), ptr.offset() as u64, "record length out of range"));
        }
        let mut buf = vec![0u8; 8 + body];
        f.read_exact_at(&mut buf, ptr.offset() as u64)
            .map_err(|_| Error::corrupt_file(&p(), ptr.offset() as u64, "record runs past the segment end"))?;
        let (rec, _) = decode_record(&buf, 0).map_err(|what| Error::corrupt_file(&p(), ptr.offset() as u64, what))?;
        Ok(rec.to_owned())
    }
}
