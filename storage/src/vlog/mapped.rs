//! Reading records through read-only mappings of the segment files: how the device reads the log
//! — memory regions the host exposes (the page cache of its log files), named by the table set —
//! never calling into the host or reading its files through system calls per record.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::record::{RECORD_HEADER, Record, claimed_len, decode_record};
use super::segment::{self, SEGMENT_HEADER};
use super::{Lsn, RecordSource};
use crate::arena::Mapping;
use crate::error::{Error, Result};

/// Segments a reader keeps mapped.
const MAPPED: usize = 256;

/// See the module documentation. One per reader thread.
pub struct MappedLog {
    dir: PathBuf,
    maps: RefCell<BTreeMap<u64, Arc<(Mapping, u64)>>>,
}

impl MappedLog {
    /// A reader of the log in `dir`.
    pub fn open(dir: impl AsRef<Path>) -> MappedLog {
        MappedLog { dir: dir.as_ref().to_path_buf(), maps: RefCell::new(BTreeMap::new()) }
    }

    /// Drops every mapping (the host replaced a segment file: map it again when needed).
    pub fn forget_all(&self) {
        self.maps.borrow_mut().clear();
    }

    /// Drops the mappings of segments `live` rejects (deleted by garbage collection: a mapping
    /// would keep a deleted file's blocks allocated).
    pub fn retain(&self, live: impl Fn(u64) -> bool) {
        self.maps.borrow_mut().retain(|&id, _| live(id));
    }

    /// Segments mapped now.
    pub fn mapped(&self) -> usize {
        self.maps.borrow().len()
    }

    fn segment(&self, id: u64) -> Result<Arc<(Mapping, u64)>> {
        if let Some(m) = self.maps.borrow().get(&id) {
            return Ok(m.clone());
        }
        let p = segment::path(&self.dir, id);
        let f = File::open(&p).map_err(|e| Error::io(&p, e))?;
        let len = f.metadata().map_err(|e| Error::io(&p, e))?.len();
        if len < SEGMENT_HEADER as u64 {
            return Err(Error::corrupt_file(&p, 0, "value-log segment shorter than its header"));
        }
        let map = Mapping::map_ro(&f, len, 0, 0, &p)?;
        let (hid, salt) = segment::decode_header(&p, &read_header(&map, &p)?)?;
        if hid != id {
            return Err(Error::corrupt_file(&p, 8, "segment id differs from its file name"));
        }
        let entry = Arc::new((map, salt));
        let mut maps = self.maps.borrow_mut();
        if maps.len() >= MAPPED {
            maps.pop_first();
        }
        maps.insert(id, entry.clone());
        Ok(entry)
    }
}

#[allow(unsafe_code)]
fn read_header(map: &Mapping, p: &Path) -> Result<Vec<u8>> {
    // SAFETY: a segment's header is written and synced before the segment is renamed into place
    // (it is never written again), so it is immutable for as long as any reader can map it.
    let h = unsafe { map.bytes(0, SEGMENT_HEADER as usize) }.map_err(|_| Error::corrupt_file(p, 0, "short header"))?;
    Ok(h.to_vec())
}

impl RecordSource for MappedLog {
    fn read_record(&self, ptr: Lsn) -> Result<Record<'static>> {
        let mut out = None;
        self.with_record(ptr, &mut |rec| out = Some(rec.to_owned()))?;
        out.ok_or_else(|| Error::corrupt_file(&self.path_of(ptr), ptr.offset() as u64, "record not decoded"))
    }

    #[allow(unsafe_code)]
    fn with_record(&self, ptr: Lsn, f: &mut dyn FnMut(&Record<'_>)) -> Result<()> {
        let seg = self.segment(ptr.segment())?;
        let (map, salt) = (&seg.0, seg.1);
        let p = || segment::path(&self.dir, ptr.segment());
        let off = ptr.offset() as u64;
        // SAFETY: `ptr` comes from an index entry this reader reached under its pins (table set
        // and arena): the record it names was written in whole before the entry was published,
        // and written log bytes are never rewritten in place (a repair writes a new file;
        // recovery zeroes only bytes after the last valid record). The range is bounds-checked.
        let head = unsafe { map.bytes(off, RECORD_HEADER) }
            .map_err(|_| Error::corrupt_file(&p(), off, "value pointer beyond the segment"))?;
        let total = claimed_len(head, 0).ok_or_else(|| Error::corrupt_file(&p(), off, "malformed record header"))?;
        // SAFETY: as above, for the whole record.
        let bytes = unsafe { map.bytes(off, total) }
            .map_err(|_| Error::corrupt_file(&p(), off, "record runs past the segment end"))?;
        let (rec, _) = decode_record(bytes, 0, salt).map_err(|what| Error::corrupt_file(&p(), off, what))?;
        f(&rec);
        Ok(())
    }

    fn path_of(&self, at: Lsn) -> PathBuf {
        segment::path(&self.dir, at.segment())
    }
}
