//! [`JournalFs`]: a file layer whose notion of "what the disk holds" survives the death of the
//! process, so real processes can be SIGKILLed and then put through a simulated power loss
//! ([`power_cut`]).
//!
//! Every operation is done on the real files at once (other processes read and map them: they
//! hold what the page cache would). Before a change that is not yet durable, the layer appends to
//! an **undo journal** on disk what it takes to roll the change back — with a plain `write`, no
//! sync: only the process dies, the kernel keeps what was written. A record is written (to the
//! kernel) before the change it undoes, so a kill at any instruction leaves either the change
//! undone-able or not made; a torn last record (the process died inside the `write`) belongs to a
//! change that was never made and is ignored.
//!
//! The model is [`FaultFs`](super::FaultFs)'s: a file's data and length are durable once
//! `sync_data` returns; a directory entry created, renamed or removed is durable once its
//! directory is synced; after a power loss each page (4 KiB) written since its file's last sync
//! holds its old or its new bytes (a write spanning pages may be torn at page boundaries), a file
//! whose length changed has its old or its new length, and each directory keeps a prefix of its
//! unsynced entry changes.
//!
//! # The journal (`<data dir>/fault-journal/`)
//! - `c-<dev>-<ino>-<btime s>-<btime ns>` (hex), one per file (inode; the birth time tells a
//!   reused inode number apart): the file's length before its first change since its last sync
//!   (`Len`), and before the first change of each page since then, that page's bytes (`Page`).
//!   The earliest record of a page (or of the length) is what the disk holds. A sync marks the
//!   journal's end, syncs the file, then drops the records before the mark (truncating the file,
//!   or rewriting what was appended during the sync to a new file renamed over it): records never
//!   outlive a completed sync, and a journal holds at most one copy of each page per sync (plus
//!   one per process restart without a power cut).
//! - `d-<dev>-<ino>-<btime s>-<btime ns>`, one per directory (by identity too): its path, then
//!   each entry change since its last sync (`Add`, `Remove`, `Rename`), cleared when the
//!   directory is synced.
//! - `trash/`: a removed (or replaced) file is first hard-linked here, so undoing the removal can
//!   put it back; deleted when its directory is synced.
//! - `VOLATILE`: directories (tmpfs, the pod's shared memory) a power cut empties.
//!
//! Each journal file starts with the 8-byte magic `DKVJRN01` and holds records framed as
//! `len: u32 LE | crc32c(payload): u32 LE | payload`; a payload is a kind byte and its fields
//! (integers u64 LE, byte strings `u32 LE length | bytes`). The byte layout is in
//! docs/storage-format.md §10.3.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::fs::{AtFlags, StatxFlags};

use super::{Fs, FsFile, RealFile, RealFs};
use crate::error::{Error, Result};

/// The journal's directory under the data directory.
pub const JOURNAL_DIR: &str = "fault-journal";
const TRASH: &str = "trash";
const VOLATILE: &str = "VOLATILE";
const MAGIC: &[u8; 8] = b"DKVJRN01";
const PAGE: u64 = 4096;

const K_LEN: u8 = 1;
const K_PAGE: u8 = 2;
const K_DIR: u8 = 3;
const K_ADD: u8 = 4;
const K_REMOVE: u8 = 5;
const K_RENAME: u8 = 6;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A file's identity: device, inode and birth time (an inode number can be reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct FileId {
    dev: u64,
    ino: u64,
    bsec: i64,
    bnsec: u32,
}

impl FileId {
    fn of(st: &rustix::fs::Statx) -> FileId {
        let dev = ((st.stx_dev_major as u64) << 32) | st.stx_dev_minor as u64;
        let born = StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::BTIME);
        let (bsec, bnsec) = if born { (st.stx_btime.tv_sec, st.stx_btime.tv_nsec) } else { (0, 0) };
        FileId { dev, ino: st.stx_ino, bsec, bnsec }
    }

    /// `<kind>-<dev>-<ino>-<btime s>-<btime ns>`: the journal of a file (`c`) or directory (`d`).
    fn journal_name(&self, kind: &str) -> String {
        format!("{kind}-{:x}-{:x}-{:x}-{:x}", self.dev, self.ino, self.bsec as u64, self.bnsec)
    }

    fn parse(kind: &str, name: &str) -> Option<FileId> {
        let mut it = name.strip_prefix(kind)?.strip_prefix('-')?.split('-').map(|x| u64::from_str_radix(x, 16));
        let (dev, ino, bsec, bnsec) = (it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?);
        if it.next().is_some() {
            return None;
        }
        Some(FileId { dev, ino, bsec: bsec as i64, bnsec: u32::try_from(bnsec).ok()? })
    }
}

fn statx_path(p: &Path) -> io::Result<rustix::fs::Statx> {
    let mask = StatxFlags::INO | StatxFlags::BTIME | StatxFlags::NLINK | StatxFlags::TYPE;
    Ok(rustix::fs::statx(rustix::fs::CWD, p, AtFlags::SYMLINK_NOFOLLOW, mask)?)
}

fn statx_file(f: &File) -> io::Result<rustix::fs::Statx> {
    let mask = StatxFlags::INO | StatxFlags::BTIME | StatxFlags::NLINK;
    Ok(rustix::fs::statx(f, "", AtFlags::EMPTY_PATH, mask)?)
}

fn exists(p: &Path) -> bool {
    p.symlink_metadata().is_ok()
}

fn ignore_missing(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// A directory entry change, as journaled (names within the directory; trash names within
/// `trash/`; an empty `replaced`: nothing was replaced).
#[derive(Debug, Clone, PartialEq, Eq)]
enum DirRec {
    /// `name` was created (or renamed in from another directory, replacing the file now at
    /// `trash/replaced`).
    Add { name: OsString, replaced: OsString },
    /// `name` was removed (or renamed away to another directory); its file is at `trash/trash`.
    Remove { name: OsString, trash: OsString },
    /// `from` was renamed to `to`, replacing the file now at `trash/replaced`.
    Rename { from: OsString, to: OsString, replaced: OsString },
}

impl fmt::Display for DirRec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DirRec::Add { name, .. } => write!(f, "create {}", name.to_string_lossy()),
            DirRec::Remove { name, .. } => write!(f, "remove {}", name.to_string_lossy()),
            DirRec::Rename { from, to, .. } => {
                write!(f, "rename {} -> {}", from.to_string_lossy(), to.to_string_lossy())
            }
        }
    }
}

/// One journal record.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rec {
    Len(u64),
    Page(u64, Vec<u8>),
    Dir(PathBuf),
    Entry(DirRec),
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

impl Rec {
    fn encode(&self, out: &mut Vec<u8>) {
        let mut p = Vec::new();
        match self {
            Rec::Len(n) => {
                p.push(K_LEN);
                p.extend_from_slice(&n.to_le_bytes());
            }
            Rec::Page(i, b) => {
                p.push(K_PAGE);
                p.extend_from_slice(&i.to_le_bytes());
                put_bytes(&mut p, b);
            }
            Rec::Dir(d) => {
                p.push(K_DIR);
                put_bytes(&mut p, d.as_os_str().as_bytes());
            }
            Rec::Entry(DirRec::Add { name, replaced }) => {
                p.push(K_ADD);
                put_bytes(&mut p, name.as_bytes());
                put_bytes(&mut p, replaced.as_bytes());
            }
            Rec::Entry(DirRec::Remove { name, trash }) => {
                p.push(K_REMOVE);
                put_bytes(&mut p, name.as_bytes());
                put_bytes(&mut p, trash.as_bytes());
            }
            Rec::Entry(DirRec::Rename { from, to, replaced }) => {
                p.push(K_RENAME);
                put_bytes(&mut p, from.as_bytes());
                put_bytes(&mut p, to.as_bytes());
                put_bytes(&mut p, replaced.as_bytes());
            }
        }
        out.extend_from_slice(&(p.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&p).to_le_bytes());
        out.extend_from_slice(&p);
    }

    fn decode(p: &[u8]) -> Option<Rec> {
        let mut at = 1usize;
        let u64_at = |at: &mut usize| -> Option<u64> {
            let b = p.get(*at..*at + 8)?;
            *at += 8;
            Some(u64::from_le_bytes(b.try_into().ok()?))
        };
        let bytes_at = |at: &mut usize| -> Option<Vec<u8>> {
            let n = u32::from_le_bytes(p.get(*at..*at + 4)?.try_into().ok()?) as usize;
            let b = p.get(*at + 4..*at + 4 + n)?.to_vec();
            *at += 4 + n;
            Some(b)
        };
        let os = |b: Vec<u8>| OsString::from_vec(b);
        let rec = match *p.first()? {
            K_LEN => Rec::Len(u64_at(&mut at)?),
            K_PAGE => Rec::Page(u64_at(&mut at)?, bytes_at(&mut at)?),
            K_DIR => Rec::Dir(PathBuf::from(os(bytes_at(&mut at)?))),
            K_ADD => Rec::Entry(DirRec::Add { name: os(bytes_at(&mut at)?), replaced: os(bytes_at(&mut at)?) }),
            K_REMOVE => Rec::Entry(DirRec::Remove { name: os(bytes_at(&mut at)?), trash: os(bytes_at(&mut at)?) }),
            K_RENAME => Rec::Entry(DirRec::Rename {
                from: os(bytes_at(&mut at)?),
                to: os(bytes_at(&mut at)?),
                replaced: os(bytes_at(&mut at)?),
            }),
            _ => return None,
        };
        (at == p.len()).then_some(rec)
    }
}

/// The records of a journal file's bytes, up to the first torn or damaged one (only the last
/// can be: the process died inside its `write`, before the change it would undo).
fn parse(bytes: &[u8]) -> Vec<Rec> {
    let mut out = Vec::new();
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return out;
    }
    let mut at = MAGIC.len();
    while let Some(h) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(h[4..].try_into().expect("4 bytes"));
        let Some(p) = bytes.get(at + 8..at + 8 + len) else { break };
        if crc32c::crc32c(p) != crc {
            break;
        }
        let Some(r) = Rec::decode(p) else { break };
        out.push(r);
        at += 8 + len;
    }
    out
}

/// An append-only journal file, created on first use.
#[derive(Debug)]
struct Appender {
    path: PathBuf,
    file: Option<File>,
    /// Bytes in the file (0: not created yet).
    len: u64,
}

impl Appender {
    fn new(path: PathBuf) -> Appender {
        let len = std::fs::metadata(&path).map_or(0, |m| m.len());
        Appender { path, file: None, len }
    }

    fn open(&mut self) -> io::Result<&File> {
        if self.file.is_none() {
            let f = OpenOptions::new().read(true).append(true).create(true).open(&self.path)?;
            let have = f.metadata()?.len();
            if have < MAGIC.len() as u64 {
                // New, or a creation the process did not live to finish.
                f.set_len(0)?;
                (&f).write_all_std(MAGIC)?;
                self.len = MAGIC.len() as u64;
            } else {
                self.len = have;
            }
            self.file = Some(f);
        }
        Ok(self.file.as_ref().expect("opened above"))
    }

    /// Appends records (one `write` where the kernel allows; a kill inside it tears only the
    /// last record, which then never took effect).
    fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let r = self.open()?.write_all_std(bytes);
        match r {
            Ok(()) => {
                self.len += bytes.len() as u64;
                Ok(())
            }
            Err(e) => {
                self.len = self.file.as_ref().and_then(|f| f.metadata().ok()).map_or(self.len, |m| m.len());
                Err(e)
            }
        }
    }

    /// Cuts the file to its first `len` bytes (its header), if it is longer.
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        if self.len <= len {
            return Ok(());
        }
        match &self.file {
            Some(f) => f.set_len(len)?,
            None => OpenOptions::new().write(true).open(&self.path)?.set_len(len)?,
        }
        self.len = len;
        Ok(())
    }

    /// Drops the records before byte `mark`: truncates the file when nothing follows the mark,
    /// or writes what follows to a new file renamed over this one (atomic for a process kill).
    fn drop_before(&mut self, mark: u64) -> io::Result<()> {
        let head = MAGIC.len() as u64;
        if mark <= head || self.len <= head {
            return Ok(());
        }
        if self.len <= mark {
            return self.truncate(head);
        }
        let mut tail = vec![0u8; (self.len - mark) as usize];
        self.open()?.read_exact_at(&mut tail, mark)?;
        let tmp = super::tmp_path(&self.path);
        let _ = std::fs::remove_file(&tmp);
        let mut all = MAGIC.to_vec();
        all.extend_from_slice(&tail);
        std::fs::write(&tmp, &all)?;
        std::fs::rename(&tmp, &self.path)?;
        self.file = None;
        self.len = all.len() as u64;
        Ok(())
    }
}

/// `write_all` on a shared `&File` (appends: the file is opened with O_APPEND).
trait WriteAllStd {
    fn write_all_std(self, b: &[u8]) -> io::Result<()>;
}

impl WriteAllStd for &File {
    fn write_all_std(mut self, b: &[u8]) -> io::Result<()> {
        io::Write::write_all(&mut self, b)
    }
}

/// What the layer knows of one file since its last sync.
#[derive(Debug)]
struct FileState {
    journal: Appender,
    /// Pages whose old bytes are journaled since the last sync.
    saved: HashSet<u64>,
    /// Whether the old length is journaled since the last sync.
    len_saved: bool,
}

#[derive(Debug)]
struct FileJournal {
    st: Mutex<FileState>,
    /// One sync at a time per file.
    sync: Mutex<()>,
}

#[derive(Debug)]
struct DirState {
    journal: Appender,
    /// Bytes of the journal's header (magic and path): what a sync truncates it to.
    header: u64,
    /// Trash entries of this directory's journaled changes (deleted once they are durable).
    trash: Vec<OsString>,
}

#[derive(Debug)]
struct DirJournal {
    path: PathBuf,
    st: Mutex<DirState>,
}

#[derive(Debug)]
struct Inner {
    /// The data directory (canonical): every file the layer handles lies under it.
    data: PathBuf,
    /// `data/fault-journal`.
    root: PathBuf,
    files: Mutex<HashMap<FileId, Arc<FileJournal>>>,
    dirs: Mutex<HashMap<FileId, Arc<DirJournal>>>,
    next_trash: AtomicU64,
}

/// See the module documentation. Cheap to clone (a shared handle). One per data directory and
/// process; the journal outlives the process (a restarted process appends to it).
#[derive(Debug, Clone)]
pub struct JournalFs {
    inner: Arc<Inner>,
}

fn split(path: &Path) -> (PathBuf, OsString) {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    (dir, path.file_name().map(OsStr::to_os_string).unwrap_or_default())
}

impl JournalFs {
    /// A journaled layer for the files under `data_dir` (created if missing), keeping its journal
    /// in `data_dir/fault-journal` (appending to one a previous process left).
    pub fn open(data_dir: &Path) -> io::Result<JournalFs> {
        RealFs.create_dir_all(data_dir)?;
        let data = std::fs::canonicalize(data_dir)?;
        let root = data.join(JOURNAL_DIR);
        RealFs.create_dir_all(&root.join(TRASH))?;
        Ok(JournalFs {
            inner: Arc::new(Inner {
                data,
                root,
                files: Mutex::default(),
                dirs: Mutex::default(),
                next_trash: AtomicU64::new(0),
            }),
        })
    }

    /// Records `dir` as volatile (a tmpfs: the pod's shared memory): [`power_cut`] empties it.
    pub fn add_volatile(&self, dir: &Path) -> io::Result<()> {
        let p = self.inner.root.join(VOLATILE);
        let dir = std::path::absolute(dir)?;
        let have = std::fs::read(&p).unwrap_or_default();
        if have.split(|&b| b == b'\n').any(|l| l == dir.as_os_str().as_bytes()) {
            return Ok(());
        }
        let mut line = dir.into_os_string().into_vec();
        line.push(b'\n');
        (&OpenOptions::new().append(true).create(true).open(&p)?).write_all_std(&line)
    }

    /// The journal's directory.
    pub fn journal_dir(&self) -> &Path {
        &self.inner.root
    }

    fn trash_name(&self) -> OsString {
        let n = self.inner.next_trash.fetch_add(1, Ordering::Relaxed);
        OsString::from(format!("{}-{n}", std::process::id()))
    }

    fn trash_path(&self, name: &OsStr) -> PathBuf {
        self.inner.root.join(TRASH).join(name)
    }

    fn dir_journal(&self, dir: &Path) -> io::Result<Arc<DirJournal>> {
        // By identity, not by path: a directory removed (a region that left the node) and made
        // again is another directory, where its predecessor's changes must not be undone.
        let id = FileId::of(&statx_path(dir)?);
        let mut dirs = lock(&self.inner.dirs);
        if let Some(d) = dirs.get(&id) {
            return Ok(d.clone());
        }
        let canon = std::fs::canonicalize(dir)?;
        if !canon.starts_with(&self.inner.data) || canon.starts_with(&self.inner.root) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not under the journaled directory {}", canon.display(), self.inner.data.display()),
            ));
        }
        let jp = self.inner.root.join(id.journal_name("d"));
        let mut journal = Appender::new(jp.clone());
        let mut trash = Vec::new();
        let recs = parse(&std::fs::read(&jp).unwrap_or_default());
        let header = match recs.first() {
            Some(Rec::Dir(p)) => {
                // A previous process's journal of this directory: its trash is still pending.
                let mut h = Vec::new();
                Rec::Dir(p.clone()).encode(&mut h);
                for r in &recs[1..] {
                    if let Rec::Entry(
                        DirRec::Remove { trash: t, .. }
                        | DirRec::Add { replaced: t, .. }
                        | DirRec::Rename { replaced: t, .. },
                    ) = r
                        && !t.is_empty()
                    {
                        trash.push(t.clone());
                    }
                }
                (MAGIC.len() + h.len()) as u64
            }
            _ => {
                // New (or its header never completed: then nothing follows it).
                let _ = std::fs::remove_file(&jp);
                journal = Appender::new(jp);
                let mut h = Vec::new();
                Rec::Dir(canon.clone()).encode(&mut h);
                journal.append(&h)?;
                journal.len
            }
        };
        let d = Arc::new(DirJournal { path: canon, st: Mutex::new(DirState { journal, header, trash }) });
        dirs.insert(id, d.clone());
        Ok(d)
    }

    fn file_journal(&self, f: &File) -> io::Result<Arc<FileJournal>> {
        let id = FileId::of(&statx_file(f)?);
        let mut files = lock(&self.inner.files);
        Ok(files
            .entry(id)
            .or_insert_with(|| {
                Arc::new(FileJournal {
                    st: Mutex::new(FileState {
                        journal: Appender::new(self.inner.root.join(id.journal_name("c"))),
                        saved: HashSet::new(),
                        len_saved: false,
                    }),
                    sync: Mutex::new(()),
                })
            })
            .clone())
    }

    fn wrap(&self, f: File) -> io::Result<Arc<dyn FsFile>> {
        let j = self.file_journal(&f)?;
        Ok(Arc::new(JournalFile { real: RealFile(f), j }))
    }

    /// A trash entry whose removal is durable goes; with it, if that was the file's last name,
    /// the file's content journal.
    fn drop_trash(&self, name: &OsStr) {
        let p = self.trash_path(name);
        if let Ok(st) = statx_path(&p)
            && st.stx_nlink <= 1
        {
            let id = FileId::of(&st);
            lock(&self.inner.files).remove(&id);
            let _ = std::fs::remove_file(self.inner.root.join(id.journal_name("c")));
        }
        let _ = std::fs::remove_file(&p);
    }
}

fn append_entry(st: &mut DirState, r: DirRec) -> io::Result<()> {
    let mut b = Vec::new();
    Rec::Entry(r).encode(&mut b);
    st.journal.append(&b)
}

impl Fs for JournalFs {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn FsFile>> {
        let (dir, name) = split(path);
        let d = self.dir_journal(&dir)?;
        let mut st = lock(&d.st);
        if exists(path) {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        append_entry(&mut st, DirRec::Add { name, replaced: OsString::new() })?;
        let f = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        drop(st);
        self.wrap(f)
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn FsFile>> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        self.wrap(f)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let ((fdir, fname), (tdir, tname)) = (split(from), split(to));
        let (fd, td) = (self.dir_journal(&fdir)?, self.dir_journal(&tdir)?);
        from.symlink_metadata()?;
        let replaced = if exists(to) { self.trash_name() } else { OsString::new() };
        if Arc::ptr_eq(&fd, &td) {
            let mut st = lock(&fd.st);
            append_entry(&mut st, DirRec::Rename { from: fname, to: tname, replaced: replaced.clone() })?;
            if !replaced.is_empty() {
                std::fs::hard_link(to, self.trash_path(&replaced))?;
                st.trash.push(replaced);
            }
            return std::fs::rename(from, to);
        }
        // Across directories: an entry added in one and removed from the other, each durable
        // with its own directory (as FaultFs models it).
        let (mut a, mut b) = if fd.path < td.path {
            let a = lock(&fd.st);
            (a, lock(&td.st))
        } else {
            let b = lock(&td.st);
            (lock(&fd.st), b)
        };
        append_entry(&mut b, DirRec::Add { name: tname, replaced: replaced.clone() })?;
        if !replaced.is_empty() {
            std::fs::hard_link(to, self.trash_path(&replaced))?;
            b.trash.push(replaced);
        }
        let gone = self.trash_name();
        append_entry(&mut a, DirRec::Remove { name: fname, trash: gone.clone() })?;
        std::fs::hard_link(from, self.trash_path(&gone))?;
        a.trash.push(gone);
        std::fs::rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let (dir, name) = split(path);
        let d = self.dir_journal(&dir)?;
        let mut st = lock(&d.st);
        path.symlink_metadata()?;
        let trash = self.trash_name();
        append_entry(&mut st, DirRec::Remove { name, trash: trash.clone() })?;
        std::fs::hard_link(path, self.trash_path(&trash))?;
        st.trash.push(trash);
        std::fs::remove_file(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let d = self.dir_journal(dir)?;
        let mut st = lock(&d.st);
        RealFs.sync_dir(dir)?;
        // Durable now: the journal goes first, then the trash (a kill in between leaves trash
        // no record names, which the power cut discards).
        let header = st.header;
        st.journal.truncate(header)?;
        for t in std::mem::take(&mut st.trash) {
            self.drop_trash(&t);
        }
        Ok(())
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        // Directories themselves are not modelled (as in FaultFs): created durably at once.
        RealFs.create_dir_all(dir)
    }
}

#[derive(Debug)]
struct JournalFile {
    real: RealFile,
    j: Arc<FileJournal>,
}

impl JournalFile {
    /// Journals the old length (once per sync) and the old bytes of pages `pages` not journaled
    /// yet, for a file now `len` bytes long.
    fn save(&self, st: &mut FileState, len: u64, pages: std::ops::Range<u64>) -> io::Result<()> {
        let mut rec = Vec::new();
        if !st.len_saved {
            Rec::Len(len).encode(&mut rec);
        }
        let mut new = Vec::new();
        for p in pages {
            if st.saved.contains(&p) {
                continue;
            }
            let start = p * PAGE;
            let n = len.saturating_sub(start).min(PAGE) as usize;
            let mut old = vec![0u8; n];
            if n > 0 {
                self.real.0.read_exact_at(&mut old, start)?;
            }
            Rec::Page(p, old).encode(&mut rec);
            new.push(p);
        }
        st.journal.append(&rec)?;
        st.len_saved = true;
        st.saved.extend(new);
        Ok(())
    }
}

impl FsFile for JournalFile {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<usize> {
        if buf.is_empty() {
            return self.real.write_at(buf, off);
        }
        let mut st = lock(&self.j.st);
        let len = self.real.size()?;
        let end = off + buf.len() as u64;
        self.save(&mut st, len, off / PAGE..end.div_ceil(PAGE))?;
        self.real.write_at(buf, off)
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        self.real.read_at(buf, off)
    }

    fn set_len(&self, new: u64) -> io::Result<()> {
        let mut st = lock(&self.j.st);
        let len = self.real.size()?;
        if new != len {
            // Shrinking cuts bytes: journal the pages they are in.
            let cut = if new < len { new / PAGE..len.div_ceil(PAGE) } else { 0..0 };
            self.save(&mut st, len, cut)?;
        }
        self.real.set_len(new)
    }

    fn allocate(&self, new: u64) -> io::Result<()> {
        let mut st = lock(&self.j.st);
        let len = self.real.size()?;
        if new > len {
            self.save(&mut st, len, 0..0)?;
        }
        self.real.allocate(new)
    }

    fn sync_data(&self) -> io::Result<()> {
        let _one = lock(&self.j.sync);
        let mark = {
            let mut st = lock(&self.j.st);
            // Changes from here on are journaled again: the sync may not cover them.
            st.saved.clear();
            st.len_saved = false;
            st.journal.len
        };
        self.real.sync_data()?;
        lock(&self.j.st).journal.drop_before(mark)
    }

    fn size(&self) -> io::Result<u64> {
        self.real.size()
    }
}

/// What one file went through in a [`power_cut`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileCut {
    /// Where the file is after the cut.
    pub path: PathBuf,
    /// Its length as of its last sync, and in the page cache when the power went.
    pub synced_len: u64,
    /// Its length in the page cache when the power went.
    pub cached_len: u64,
    /// The length the disk kept.
    pub len: u64,
    /// Pages written since the last sync that went back to their synced bytes.
    pub pages_dropped: u64,
    /// Pages written since the last sync that the disk kept.
    pub pages_kept: u64,
}

/// A directory entry change that was not durable, and whether the disk kept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryCut {
    /// The directory.
    pub dir: PathBuf,
    /// The change (`create NAME`, `remove NAME`, `rename A -> B`).
    pub change: String,
    /// Whether the disk kept it.
    pub kept: bool,
}

/// What a [`power_cut`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PowerCutReport {
    /// The seed of the choices.
    pub seed: u64,
    /// Files with changes since their last sync.
    pub files: Vec<FileCut>,
    /// Directory entry changes since their directory's last sync, in order per directory.
    pub entries: Vec<EntryCut>,
    /// Volatile directories emptied (shared memory).
    pub volatile: Vec<PathBuf>,
}

impl PowerCutReport {
    /// Pages that lost their unsynced bytes, over all files.
    pub fn pages_dropped(&self) -> u64 {
        self.files.iter().map(|f| f.pages_dropped).sum()
    }

    /// Directory entry changes undone.
    pub fn entries_undone(&self) -> usize {
        self.entries.iter().filter(|e| !e.kept).count()
    }
}

impl fmt::Display for PowerCutReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "power cut (seed {}): {} files with unsynced changes, {} pages dropped, {} of {} entry changes undone",
            self.seed,
            self.files.len(),
            self.pages_dropped(),
            self.entries_undone(),
            self.entries.len()
        )?;
        for c in &self.files {
            writeln!(
                f,
                "file {}: {} pages dropped, {} kept; length {} (synced {}, cached {})",
                c.path.display(),
                c.pages_dropped,
                c.pages_kept,
                c.len,
                c.synced_len,
                c.cached_len
            )?;
        }
        for e in &self.entries {
            writeln!(f, "entry {}: {} {}", e.dir.display(), e.change, if e.kept { "kept" } else { "undone" })?;
        }
        for v in &self.volatile {
            writeln!(f, "volatile {}: emptied", v.display())?;
        }
        Ok(())
    }
}

/// The power cut's choices (xorshift64*, as FaultFs).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// Simulates a power loss of the machine holding `dir` (a data directory a [`JournalFs`] wrote
/// under), to be run once every process using it is dead: each directory keeps a random prefix of
/// its unsynced entry changes (the rest are undone, newest first), each file gets its synced
/// bytes back except a random subset of the pages written since its last sync, and its synced or
/// its cached length; the volatile directories are emptied; the journal is removed. The same
/// journal and seed give the same result.
pub fn power_cut(dir: &Path, seed: u64) -> Result<PowerCutReport> {
    let root = dir.join(JOURNAL_DIR);
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |e| Error::io(&p, e)
    };
    if !root.is_dir() {
        return Err(Error::io(&root, io::Error::new(io::ErrorKind::NotFound, "no fault journal here")));
    }
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut report = PowerCutReport { seed, ..PowerCutReport::default() };
    let mut dirs = Vec::new();
    let mut contents = Vec::new();
    for e in std::fs::read_dir(&root).map_err(io(&root))? {
        let e = e.map_err(io(&root))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".tmp") {
            continue;
        }
        if let Some(id) = FileId::parse("d", &name) {
            dirs.push((id, e.path()));
        } else if let Some(id) = FileId::parse("c", &name) {
            contents.push((id, e.path()));
        }
    }
    dirs.sort();
    contents.sort();
    let trash = root.join(TRASH);

    // Directory entries first: undone changes put removed files back (whose bytes are then
    // rolled back like any other's) and take created ones away. Directories are found by
    // identity (one removed outside the layer is gone, with its changes).
    let (mut files_at, mut dirs_at) = (HashMap::new(), HashMap::new());
    index(dir, &root, &mut files_at, &mut dirs_at).map_err(io(dir))?;
    for (id, jp) in dirs {
        let recs = parse(&std::fs::read(&jp).map_err(io(&jp))?);
        let (Some(Rec::Dir(_)), Some(d)) = (recs.first(), dirs_at.get(&id)) else { continue };
        let ops: Vec<&DirRec> = recs[1..]
            .iter()
            .filter_map(|r| match r {
                Rec::Entry(e) => Some(e),
                _ => None,
            })
            .collect();
        let keep = rng.below(ops.len() as u64 + 1) as usize;
        for (i, op) in ops.iter().enumerate() {
            report.entries.push(EntryCut { dir: d.clone(), change: op.to_string(), kept: i < keep });
        }
        for op in ops[keep..].iter().rev() {
            undo_entry(d, &trash, op).map_err(io(d))?;
        }
    }

    // Then the bytes: find each journaled file by its identity.
    files_at.clear();
    index(dir, &root, &mut files_at, &mut dirs_at).map_err(io(dir))?;
    for (id, jp) in contents {
        let recs = parse(&std::fs::read(&jp).map_err(io(&jp))?);
        if recs.is_empty() {
            continue;
        }
        let Some(path) = files_at.get(&id) else { continue };
        let cut = cut_file(path, &recs, &mut rng).map_err(io(path))?;
        report.files.push(cut);
    }

    // Shared memory does not survive a power loss.
    let vp = root.join(VOLATILE);
    let listed = match std::fs::read(&vp) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(Error::io(&vp, e)),
    };
    for line in listed.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let v = PathBuf::from(OsStr::from_bytes(line));
        if let Ok(rd) = std::fs::read_dir(&v) {
            for e in rd.flatten() {
                let p = e.path();
                let r = if e.file_type().is_ok_and(|t| t.is_dir()) {
                    std::fs::remove_dir_all(&p)
                } else {
                    std::fs::remove_file(&p)
                };
                ignore_missing(r).map_err(io(&p))?;
            }
            report.volatile.push(v);
        }
    }
    std::fs::remove_dir_all(&root).map_err(io(&root))?;
    RealFs.sync_dir(dir).map_err(io(dir))?;
    Ok(report)
}

/// Undoes one directory entry change (later ones in that directory are undone already). Each
/// step checks how far the change got before the process died.
fn undo_entry(dir: &Path, trash: &Path, op: &DirRec) -> io::Result<()> {
    match op {
        DirRec::Add { name, replaced } => {
            if replaced.is_empty() {
                ignore_missing(std::fs::remove_file(dir.join(name)))
            } else if exists(&trash.join(replaced)) {
                ignore_missing(std::fs::remove_file(dir.join(name)))?;
                std::fs::rename(trash.join(replaced), dir.join(name))
            } else {
                Ok(()) // died before replacing anything
            }
        }
        DirRec::Remove { name, trash: t } => {
            if !exists(&dir.join(name)) && exists(&trash.join(t)) {
                std::fs::rename(trash.join(t), dir.join(name))?;
            }
            Ok(())
        }
        DirRec::Rename { from, to, replaced } => {
            if exists(&dir.join(from)) {
                return Ok(()); // died before renaming
            }
            if exists(&dir.join(to)) {
                std::fs::rename(dir.join(to), dir.join(from))?;
            }
            if !replaced.is_empty() && exists(&trash.join(replaced)) {
                std::fs::rename(trash.join(replaced), dir.join(to))?;
            }
            Ok(())
        }
    }
}

/// Every regular file and directory under `dir` (but the journal), and `dir`, by identity.
fn index(
    dir: &Path,
    skip: &Path,
    files: &mut HashMap<FileId, PathBuf>,
    dirs: &mut HashMap<FileId, PathBuf>,
) -> io::Result<()> {
    dirs.entry(FileId::of(&statx_path(dir)?)).or_insert_with(|| dir.to_path_buf());
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let p = e.path();
        if p == skip {
            continue;
        }
        let t = e.file_type()?;
        if t.is_dir() {
            index(&p, skip, files, dirs)?;
        } else if t.is_file() {
            files.entry(FileId::of(&statx_path(&p)?)).or_insert(p);
        }
    }
    Ok(())
}

/// Rewrites one file to a state the disk could hold: its synced length or its cached one, and
/// per journaled page its synced bytes or its cached ones.
fn cut_file(path: &Path, recs: &[Rec], rng: &mut Rng) -> io::Result<FileCut> {
    let f = OpenOptions::new().read(true).write(true).open(path)?;
    let cached_len = f.metadata()?.len();
    let mut synced_len = None;
    let mut pages: BTreeMap<u64, &[u8]> = BTreeMap::new();
    for r in recs {
        match r {
            Rec::Len(n) => {
                synced_len.get_or_insert(*n);
            }
            Rec::Page(i, b) => {
                pages.entry(*i).or_insert(b);
            }
            _ => {}
        }
    }
    let synced_len = synced_len.unwrap_or(cached_len);
    let len = if synced_len != cached_len && rng.below(2) == 0 { synced_len } else { cached_len };
    f.set_len(len)?;
    let (mut dropped, mut kept) = (0, 0);
    for (&i, old) in &pages {
        if rng.below(2) == 1 {
            kept += 1;
            continue;
        }
        dropped += 1;
        let start = i * PAGE;
        if start >= len {
            continue;
        }
        let mut page = vec![0u8; (len - start).min(PAGE) as usize];
        // The disk holds nothing past the synced length.
        let n = old.len().min(page.len()).min(synced_len.saturating_sub(start) as usize);
        page[..n].copy_from_slice(&old[..n]);
        f.write_all_at(&page, start)?;
    }
    f.sync_data()?;
    Ok(FileCut { path: path.to_path_buf(), synced_len, cached_len, len, pages_dropped: dropped, pages_kept: kept })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_a_torn_tail_is_ignored() {
        let recs = vec![
            Rec::Dir(PathBuf::from("/a/b")),
            Rec::Len(12345),
            Rec::Page(7, vec![1, 2, 3]),
            Rec::Entry(DirRec::Add { name: "x".into(), replaced: "".into() }),
            Rec::Entry(DirRec::Remove { name: "y".into(), trash: "1-2".into() }),
            Rec::Entry(DirRec::Rename { from: "t".into(), to: "m".into(), replaced: "1-3".into() }),
        ];
        let mut b = MAGIC.to_vec();
        for r in &recs {
            r.encode(&mut b);
        }
        assert_eq!(parse(&b), recs);
        for cut in MAGIC.len()..b.len() {
            let got = parse(&b[..cut]);
            assert!(got.len() < recs.len() && got[..] == recs[..got.len()], "a prefix at {cut}");
        }
        let mut bad = b.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(parse(&bad), recs[..recs.len() - 1]);
    }

    #[test]
    fn file_ids_name_their_journals() {
        let id = FileId { dev: 0x803, ino: 99, bsec: 1_700_000_000, bnsec: 123 };
        assert_eq!(FileId::parse("c", &id.journal_name("c")), Some(id));
        assert_eq!(FileId::parse("d", &id.journal_name("d")), Some(id));
        assert_eq!(FileId::parse("c", &id.journal_name("d")), None);
        assert_eq!(FileId::parse("c", "c-00"), None);
    }

    fn read(p: &Path) -> Vec<u8> {
        std::fs::read(p).expect("read")
    }

    #[test]
    fn synced_bytes_and_entries_survive_and_unsynced_ones_can_go() {
        let (mut lost_pages, mut lost_entries, mut kept_pages) = (0, 0, 0);
        for seed in 0..32 {
            let dir = tempfile::tempdir().expect("tempdir");
            let data = dir.path().join("data");
            let fs = JournalFs::open(&data).expect("open");
            let a = fs.create(&data.join("a")).expect("create");
            a.write_all_at(&[1u8; 3 * PAGE as usize], 0).expect("write");
            a.sync_data().expect("sync");
            fs.sync_dir(&data).expect("sync dir");
            a.write_all_at(&[2u8; 2 * PAGE as usize], PAGE).expect("write");
            a.write_all_at(&[3u8; 10], 5 * PAGE).expect("write past the end");
            let b = fs.create(&data.join("b")).expect("create");
            b.write_all_at(b"bbbb", 0).expect("write");
            b.sync_data().expect("sync");
            crate::fs::write_atomic(&fs, &data.join("m"), b"old").expect("atomic");
            crate::fs::write_atomic(&fs, &data.join("m"), b"new").expect("atomic");
            fs.remove(&data.join("m")).expect("remove");
            drop((a, b));
            let r = power_cut(&data, seed).expect("power cut");
            lost_pages += r.pages_dropped();
            kept_pages += r.files.iter().map(|f| f.pages_kept).sum::<u64>();
            lost_entries += r.entries_undone();
            let got = read(&data.join("a"));
            assert!(got.len() == 3 * PAGE as usize || got.len() == 5 * PAGE as usize + 10, "length {}", got.len());
            assert_eq!(&got[..PAGE as usize], &[1u8; PAGE as usize][..], "synced page intact");
            for p in 1..3 {
                let page = &got[p * PAGE as usize..(p + 1) * PAGE as usize];
                assert!(page == [1u8; PAGE as usize] || page == [2u8; PAGE as usize], "a page is old or new");
            }
            if got.len() > 3 * PAGE as usize {
                assert!(got[3 * PAGE as usize..5 * PAGE as usize].iter().all(|&x| x == 0));
                assert!(got[5 * PAGE as usize..] == [0u8; 10] || got[5 * PAGE as usize..] == [3u8; 10]);
            }
            if let Ok(b) = std::fs::read(data.join("b")) {
                assert_eq!(b, b"bbbb", "synced data of a file whose entry survived");
            }
            // m: absent, or whole "old" or "new" (each was synced before its rename).
            if let Ok(m) = std::fs::read(data.join("m")) {
                assert!(m == b"old" || m == b"new", "m holds {m:?}");
            }
            assert!(!data.join(JOURNAL_DIR).exists(), "the journal goes");
            // A synced directory keeps what it had: after write_atomic's sync, "m" was there.
            let names: Vec<_> = std::fs::read_dir(&data).expect("ls").flatten().map(|e| e.file_name()).collect();
            assert!(names.iter().all(|n| ["a", "b", "m", "m.tmp"].contains(&n.to_str().expect("utf-8"))), "{names:?}");
        }
        assert!(
            lost_pages > 0 && kept_pages > 0 && lost_entries > 0,
            "the cuts bite: {lost_pages} {kept_pages} {lost_entries}"
        );
    }

    #[test]
    fn the_same_seed_cuts_the_same_way() {
        let run = |seed| {
            let dir = tempfile::tempdir().expect("tempdir");
            let data = dir.path().join("data");
            let fs = JournalFs::open(&data).expect("open");
            let f = fs.create(&data.join("f")).expect("create");
            for i in 0..16u64 {
                f.write_all_at(&[i as u8 + 1; 100], i * PAGE).expect("write");
            }
            let r = power_cut(&data, seed).expect("cut");
            (std::fs::read(data.join("f")).ok(), r.pages_dropped())
        };
        assert_eq!(run(5), run(5));
    }

    #[test]
    fn a_sync_during_writes_keeps_only_the_records_it_did_not_cover() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let fs = JournalFs::open(&data).expect("open");
        let f = fs.create(&data.join("f")).expect("create");
        fs.sync_dir(&data).expect("sync dir");
        f.write_all_at(&[1u8; 100], 0).expect("write");
        f.sync_data().expect("sync");
        let jp = data.join(JOURNAL_DIR);
        let content: Vec<_> = std::fs::read_dir(&jp)
            .expect("ls")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("c-"))
            .collect();
        assert_eq!(content.len(), 1);
        assert_eq!(read(&content[0].path()), MAGIC, "a sync empties the file's journal");
        f.write_all_at(&[2u8; 100], 50).expect("write");
        assert!(read(&content[0].path()).len() > MAGIC.len());
        drop(f);
        power_cut(&data, 1).expect("cut");
        let got = read(&data.join("f"));
        assert_eq!(&got[..50], &[1u8; 50][..], "synced bytes stay");
        assert!(got.len() == 100 || got.len() == 150, "synced or cached length");
        let mut old = vec![1u8; 100];
        old.resize(got.len(), 0);
        let mut new = [[1u8; 50], [2u8; 50]].concat();
        new.resize(got.len(), 2);
        assert!(got == old || got == new, "the page is old or new: {got:?}");
    }
}
