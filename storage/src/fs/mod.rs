//! The file layer every durable write goes through: value-log segments, level segments, the
//! manifest and backup copies are created, written, synced, renamed and removed through an
//! [`Fs`], so a test can put a [`FaultFs`] underneath and simulate what `kill -9` never shows —
//! a power loss that keeps only synced data and a random subset of the rest, a failed `fsync`
//! that drops dirty pages, a full disk.
//!
//! Reads do not go through the layer: they use the files directly (or map them), as other
//! processes do. Under a [`FaultFs`] the real files always hold what a process would read from
//! the page cache; the simulated crash rewrites them to what the disk would hold.
//!
//! # Layout
//! - this module: the [`Fs`] and [`FsFile`] traits and [`RealFs`], the operating system's files.
//! - `fault`: [`FaultFs`], the fault-injecting implementation for tests and fuzzing.
//! - `journal`: [`JournalFs`], which keeps the power-loss model in an undo journal on disk so it
//!   outlives killed processes, and [`power_cut`], which applies it.

mod fault;
mod journal;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use fault::{FaultFs, FaultStats};
pub use journal::{EntryCut, FileCut, JOURNAL_DIR, JournalFs, PowerCutReport, power_cut};

/// A file opened for durable writes.
pub trait FsFile: Send + Sync + std::fmt::Debug {
    /// Writes `buf` at `off`; may write less than all of it (returns the count).
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<usize>;
    /// Reads into `buf` from `off`; returns the count (0 at the end).
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize>;
    /// Sets the file's length (shrinking discards, growing adds zeros).
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Reserves disk space for `[0, len)` and makes the file at least `len` long, so later
    /// writes inside it cannot fail for lack of space (`fallocate`).
    fn allocate(&self, len: u64) -> io::Result<()>;
    /// Makes the data (and the length) durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
    /// The file's length in bytes.
    fn size(&self) -> io::Result<u64>;

    /// Writes all of `buf` at `off`.
    fn write_all_at(&self, mut buf: &[u8], mut off: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.write_at(buf, off) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote 0 bytes")),
                Ok(n) => {
                    buf = &buf[n..];
                    off += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Fills `buf` from `off`; an error if the file ends first.
    fn read_exact_at(&self, mut buf: &mut [u8], mut off: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.read_at(buf, off) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "file ends early")),
                Ok(n) => {
                    buf = &mut buf[n..];
                    off += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Where durable files are created, renamed and removed.
pub trait Fs: Send + Sync + std::fmt::Debug {
    /// Creates a new file (an error if it exists), open for reading and writing.
    fn create(&self, path: &Path) -> io::Result<Arc<dyn FsFile>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, path: &Path) -> io::Result<Arc<dyn FsFile>>;
    /// Renames `from` to `to`, replacing `to` (durable only after [`Fs::sync_dir`]).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file (durable only after [`Fs::sync_dir`]).
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Makes the directory's entries durable: files created, renamed or removed in it.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Creates a directory and its parents (each made durable in its parent).
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
}

/// The operating system's files.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFs;

/// The default file layer, shared.
pub fn real() -> Arc<dyn Fs> {
    Arc::new(RealFs)
}

#[derive(Debug)]
struct RealFile(File);

impl FsFile for RealFile {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<usize> {
        self.0.write_at(buf, off)
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        self.0.read_at(buf, off)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn allocate(&self, len: u64) -> io::Result<()> {
        match rustix::fs::fallocate(&self.0, rustix::fs::FallocateFlags::empty(), 0, len) {
            Ok(()) => Ok(()),
            Err(rustix::io::Errno::OPNOTSUPP) | Err(rustix::io::Errno::NOSYS) => {
                // No fallocate here: write the zeros, which allocates them just as well.
                let have = self.0.metadata()?.len();
                let zeros = vec![0u8; 64 << 10];
                let mut at = have;
                while at < len {
                    let n = (len - at).min(zeros.len() as u64) as usize;
                    self.0.write_all_at(&zeros[..n], at)?;
                    at += n as u64;
                }
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
}

impl Fs for RealFs {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn FsFile>> {
        let f = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        Ok(Arc::new(RealFile(f)))
    }
    fn open(&self, path: &Path) -> io::Result<Arc<dyn FsFile>> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Arc::new(RealFile(f)))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        if dir.is_dir() {
            return Ok(());
        }
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            self.create_dir_all(parent)?;
        }
        match std::fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
            Err(e) => return Err(e),
        }
        match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => self.sync_dir(parent),
            None => Ok(()),
        }
    }
}

/// The error kind of a full disk (ENOSPC), told apart from other I/O errors.
pub fn is_no_space(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(28)
}

/// Writes `bytes` to `path` durably and atomically: a temporary file beside it, synced, renamed
/// over `path`, and the directory synced.
pub fn write_atomic(fs: &dyn Fs, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = tmp_path(path);
    let _ = fs.remove(&tmp);
    let f = fs.create(&tmp)?;
    let r = f.write_all_at(bytes, 0).and_then(|()| f.sync_data());
    drop(f);
    if let Err(e) = r {
        let _ = fs.remove(&tmp);
        return Err(e);
    }
    fs.rename(&tmp, path)?;
    fs.sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// `path` with `.tmp` appended: where [`write_atomic`] stages a file.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(".tmp");
    PathBuf::from(s)
}
