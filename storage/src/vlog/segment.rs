//! Value-log segment files: `NNNNNNNNNNNNNNNN.vlog`, a 16-byte header (magic, segment id), then
//! records. Recovery of the last segment cuts a torn tail; anything else invalid is corruption.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::record::{RECORD_HEADER, decode_record};
use crate::error::{Error, Result};

/// Bytes of the segment header.
pub(crate) const SEGMENT_HEADER: u32 = 16;
const MAGIC: &[u8; 8] = b"DPUKVLG1";

/// What recovery found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments found.
    pub segments: usize,
    /// Bytes cut off the end of the last segment (a torn write).
    pub truncated_bytes: u64,
}

pub(crate) struct Segment {
    pub(crate) id: u64,
    pub(crate) path: PathBuf,
    pub(crate) file: Arc<File>,
    /// Bytes written (header included).
    pub(crate) len: u32,
}

pub(crate) fn path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016}.vlog"))
}

/// Segment ids in the directory, ascending.
pub(crate) fn list(dir: &Path) -> Result<Vec<u64>> {
    let mut ids = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if let Some(id) = name.strip_suffix(".vlog").and_then(|s| s.parse::<u64>().ok()) {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))
}

pub(crate) fn read_all(dir: &Path, id: u64) -> Result<Vec<u8>> {
    let p = path(dir, id);
    std::fs::read(&p).map_err(|e| Error::io(&p, e))
}

fn check_header(p: &Path, bytes: &[u8], id: u64) -> Result<()> {
    if bytes.len() < SEGMENT_HEADER as usize || &bytes[..8] != MAGIC {
        return Err(Error::corrupt_file(p, 0, "bad value-log segment header"));
    }
    if u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")) != id {
        return Err(Error::corrupt_file(p, 8, "segment id differs from its file name"));
    }
    Ok(())
}

/// Validates a sealed segment completely; returns its length.
pub(crate) fn check_sealed(dir: &Path, id: u64, segment_size: u32) -> Result<u32> {
    let p = path(dir, id);
    let bytes = read_all(dir, id)?;
    check_header(&p, &bytes, id)?;
    if bytes.len() > segment_size as usize {
        return Err(Error::corrupt_file(&p, segment_size as u64, "segment longer than the segment size"));
    }
    let mut pos = SEGMENT_HEADER as usize;
    while pos < bytes.len() {
        pos = decode_record(&bytes, pos).map_err(|what| Error::corrupt_file(&p, pos as u64, what))?.1;
    }
    Ok(bytes.len() as u32)
}

impl Segment {
    pub(crate) fn create(dir: &Path, id: u64) -> Result<Segment> {
        let p = path(dir, id);
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&p).map_err(|e| Error::io(&p, e))?;
        let mut h = [0u8; SEGMENT_HEADER as usize];
        h[..8].copy_from_slice(MAGIC);
        h[8..].copy_from_slice(&id.to_le_bytes());
        file.write_all_at(&h, 0).map_err(|e| Error::io(&p, e))?;
        file.sync_data().map_err(|e| Error::io(&p, e))?;
        Ok(Segment { id, path: p, file: Arc::new(file), len: SEGMENT_HEADER })
    }

    /// Opens the last segment, cutting a torn tail. A torn write only ever loses a suffix of the
    /// last group commit, so an invalid record followed by a valid one is corruption, not a tear.
    pub(crate) fn recover(dir: &Path, id: u64, segment_size: u32) -> Result<(Segment, RecoveryReport)> {
        let p = path(dir, id);
        let file = OpenOptions::new().read(true).write(true).open(&p).map_err(|e| Error::io(&p, e))?;
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        if bytes.len() < SEGMENT_HEADER as usize {
            // A crash while creating the segment: rewrite its header.
            drop(file);
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
            let seg = Segment::create(dir, id)?;
            return Ok((seg, RecoveryReport { segments: 0, truncated_bytes: bytes.len() as u64 }));
        }
        check_header(&p, &bytes, id)?;
        if bytes.len() > segment_size as usize {
            return Err(Error::corrupt_file(&p, segment_size as u64, "segment longer than the segment size"));
        }
        let mut pos = SEGMENT_HEADER as usize;
        while pos < bytes.len() {
            match decode_record(&bytes, pos) {
                Ok((_, next)) => pos = next,
                Err(what) => {
                    if find_valid_record(&bytes, pos + 1).is_some() {
                        return Err(Error::corrupt_file(&p, pos as u64, what));
                    }
                    break;
                }
            }
        }
        let truncated = (bytes.len() - pos) as u64;
        if truncated > 0 {
            file.set_len(pos as u64).map_err(|e| Error::io(&p, e))?;
            file.sync_all().map_err(|e| Error::io(&p, e))?;
        }
        Ok((
            Segment { id, path: p, file: Arc::new(file), len: pos as u32 },
            RecoveryReport { segments: 0, truncated_bytes: truncated },
        ))
    }
}

/// The first offset at or after `from` where a complete, checksummed record starts.
fn find_valid_record(bytes: &[u8], from: usize) -> Option<usize> {
    (from..bytes.len().saturating_sub(RECORD_HEADER)).find(|&p| decode_record(bytes, p).is_ok())
}
