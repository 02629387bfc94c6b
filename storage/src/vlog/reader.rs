//! Reading records by pointer, from any thread or process: segment files are opened on first use
//! (with their salt, read from the header) and kept in a bounded cache.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::Lsn;
use super::record::{RECORD_HEADER, Record, decode_record};
use super::segment::{self, SEGMENT_HEADER};
use crate::error::{Error, Result};

/// Open segment files a reader keeps.
const OPEN_FILES: usize = 256;

/// Open segment files by id, with their salts.
type OpenSegments = BTreeMap<u64, (Arc<File>, u64)>;

/// Reads records by pointer; shareable across threads (and usable by another process that
/// opens the same directory).
#[derive(Clone)]
pub struct VlogReader {
    dir: PathBuf,
    files: Arc<Mutex<OpenSegments>>,
}

impl VlogReader {
    /// A reader of the log in `dir` (for a process other than the writer's).
    pub fn open(dir: impl AsRef<Path>) -> VlogReader {
        VlogReader { dir: dir.as_ref().to_path_buf(), files: Arc::new(Mutex::new(BTreeMap::new())) }
    }

    fn file(&self, id: u64) -> Result<(Arc<File>, u64)> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = files.get(&id) {
            return Ok(f.clone());
        }
        let p = segment::path(&self.dir, id);
        let f = File::open(&p).map_err(|e| Error::io(&p, e))?;
        let mut h = [0u8; SEGMENT_HEADER as usize];
        f.read_exact_at(&mut h, 0)
            .map_err(|_| Error::corrupt_file(&p, 0, "value-log segment shorter than its header"))?;
        let (hid, salt) = segment::decode_header(&p, &h)?;
        if hid != id {
            return Err(Error::corrupt_file(&p, 8, "segment id differs from its file name"));
        }
        if files.len() >= OPEN_FILES {
            files.pop_first();
        }
        let entry = (Arc::new(f), salt);
        files.insert(id, entry.clone());
        Ok(entry)
    }

    /// The file holding the record at `at`.
    pub fn segment_path(&self, at: Lsn) -> PathBuf {
        segment::path(&self.dir, at.segment())
    }

    /// Drops the cached file of segment `id` (deleted or replaced).
    pub(crate) fn forget(&self, id: u64) {
        self.files.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    }

    /// Drops every cached file (after the writer may have replaced some).
    pub fn forget_all(&self) {
        self.files.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Reads and checks the record at `ptr`: CRC, lengths, and that it lies inside its segment.
    pub fn read(&self, ptr: Lsn) -> Result<Record<'static>> {
        let (f, salt) = self.file(ptr.segment())?;
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
        let (rec, _) =
            decode_record(&buf, 0, salt).map_err(|what| Error::corrupt_file(&p(), ptr.offset() as u64, what))?;
        Ok(rec.to_owned())
    }
}
