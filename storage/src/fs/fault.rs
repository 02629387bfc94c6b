//! [`FaultFs`]: a file layer that remembers what the disk would hold, for crash and fault tests.
//!
//! Every operation is done on the real files too (so readers, mappings and other processes see
//! what they would see from the page cache), and mirrored in a model per file: the bytes the
//! *disk* holds (as of the last successful sync) and the bytes the *cache* holds, with the pages
//! written since. Directory operations (create, rename, remove) are durable only once their
//! directory is synced.
//!
//! A simulated power loss ([`FaultFs::crash`], or [`FaultFs::crash_after`] a number of
//! operations) makes every later operation fail with EIO; [`FaultFs::materialize`] then rewrites
//! the real files to one state the disk could be in: the synced bytes, plus a random subset of the
//! unsynced pages (torn at 4 KiB page boundaries), the old or the new length, and a random prefix
//! of each directory's unsynced operations. Faults: a sync can fail (and, as Linux does, the
//! dirty pages are then dropped without reaching the disk — the cached copy is replaced by the
//! disk's, as after an eviction), a write can fail, and a space limit turns growth beyond it into
//! ENOSPC. All choices come from a seeded generator, so a failing seed reproduces.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Fs, FsFile, RealFs};

const PAGE: usize = 4096;
const EIO: i32 = 5;
const ENOSPC: i32 = 28;

/// What a [`FaultFs`] has seen and done.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FaultStats {
    /// Successful writes.
    pub writes: u64,
    /// Successful syncs (of files and directories).
    pub syncs: u64,
    /// Syncs failed on purpose.
    pub failed_syncs: u64,
    /// Writes failed on purpose.
    pub failed_writes: u64,
    /// Operations refused with ENOSPC.
    pub no_space: u64,
    /// Mutating operations so far (what [`FaultFs::crash_after`] counts).
    pub ops: u64,
    /// Syncs of a file begun while another sync of it was in flight.
    pub overlapping_syncs: u64,
}

#[derive(Debug, Default)]
struct Model {
    disk: Vec<u8>,
    cache: Vec<u8>,
    dirty: BTreeSet<usize>,
    len_dirty: bool,
}

#[derive(Debug, Clone)]
enum DirOp {
    Set(OsString, u64),
    Remove(OsString),
    Rename(OsString, OsString, u64),
}

#[derive(Debug, Default)]
struct Dir {
    durable: BTreeMap<OsString, u64>,
    current: BTreeMap<OsString, u64>,
    pending: Vec<DirOp>,
}

#[derive(Debug)]
struct State {
    rng: u64,
    crashed: bool,
    ops_left: Option<u64>,
    files: HashMap<u64, Model>,
    dirs: HashMap<PathBuf, Dir>,
    next_ino: u64,
    /// Fail the n-th sync from now (1 = the next) with this errno.
    sync_fault: Option<(u64, i32)>,
    /// Fail the n-th write from now.
    write_fault: Option<(u64, i32)>,
    /// Per-million chance that any sync / write fails.
    sync_fail_ppm: u32,
    write_fail_ppm: u32,
    space_limit: Option<u64>,
    stats: FaultStats,
    /// How long every file sync takes at least (outside the lock: syncs may overlap).
    sync_delay: std::time::Duration,
    /// Syncs in flight, per file.
    syncing: HashMap<u64, u32>,
}

/// See the module documentation. Cheap to clone (a shared handle).
#[derive(Debug, Clone)]
pub struct FaultFs {
    st: Arc<Mutex<State>>,
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

fn split(path: &Path) -> (PathBuf, OsString) {
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    let name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    (dir, name)
}

impl State {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.next() % 1_000_000 < ppm as u64
    }

    /// Counts a mutating operation; fails it if the power is (or just went) out.
    fn tick(&mut self) -> io::Result<()> {
        if self.crashed {
            return Err(errno(EIO));
        }
        self.stats.ops += 1;
        if let Some(left) = &mut self.ops_left {
            if *left == 0 {
                self.crashed = true;
                return Err(errno(EIO));
            }
            *left -= 1;
        }
        Ok(())
    }

    fn used(&self) -> u64 {
        self.files.values().map(|m| m.cache.len() as u64).sum()
    }

    /// Loads the real directory's files as durable, once.
    fn dir(&mut self, dir: &Path) -> &mut Dir {
        if !self.dirs.contains_key(dir) {
            let mut d = Dir::default();
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_file()) {
                        let bytes = std::fs::read(e.path()).unwrap_or_default();
                        let ino = self.next_ino;
                        self.next_ino += 1;
                        self.files.insert(ino, Model { disk: bytes.clone(), cache: bytes, ..Model::default() });
                        d.durable.insert(e.file_name(), ino);
                        d.current.insert(e.file_name(), ino);
                    }
                }
            }
            self.dirs.insert(dir.to_path_buf(), d);
        }
        self.dirs.get_mut(dir).expect("inserted above")
    }

    fn lookup(&mut self, path: &Path) -> Option<u64> {
        let (dir, name) = split(path);
        self.dir(&dir).current.get(&name).copied()
    }

    /// A crash image of file `ino`: the disk's bytes, a random subset of the unsynced pages,
    /// and the old or the new length.
    fn crash_image(&mut self, ino: u64) -> Vec<u8> {
        let Some(m) = self.files.get(&ino) else { return Vec::new() };
        let (mut out, cache, dirty, len_dirty) = (m.disk.clone(), m.cache.clone(), m.dirty.clone(), m.len_dirty);
        let disk_len = out.len();
        for p in dirty {
            if self.next().is_multiple_of(2) {
                continue;
            }
            let (start, end) = (p * PAGE, ((p + 1) * PAGE).min(cache.len()));
            if start >= end {
                continue;
            }
            if out.len() < end {
                out.resize(end, 0);
            }
            out[start..end].copy_from_slice(&cache[start..end]);
        }
        let len = if len_dirty && self.next().is_multiple_of(2) { cache.len() } else { disk_len };
        out.resize(len, 0);
        out
    }
}

impl Default for FaultFs {
    fn default() -> Self {
        FaultFs::new(1)
    }
}

impl FaultFs {
    /// A fault layer over the real files whose random choices follow `seed`.
    pub fn new(seed: u64) -> FaultFs {
        FaultFs {
            st: Arc::new(Mutex::new(State {
                rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
                crashed: false,
                ops_left: None,
                files: HashMap::new(),
                dirs: HashMap::new(),
                next_ino: 1,
                sync_fault: None,
                write_fault: None,
                sync_fail_ppm: 0,
                write_fail_ppm: 0,
                space_limit: None,
                stats: FaultStats::default(),
                sync_delay: std::time::Duration::ZERO,
                syncing: HashMap::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This handle as the shared file layer a region or log takes.
    pub fn as_fs(&self) -> Arc<dyn Fs> {
        Arc::new(self.clone())
    }

    /// The power goes out now: every later operation fails with EIO.
    pub fn crash(&self) {
        self.lock().crashed = true;
    }

    /// The power goes out after `ops` more mutating operations (writes, syncs, creations,
    /// renames, removals, length changes); the operation that finds it out fails with EIO.
    pub fn crash_after(&self, ops: u64) {
        self.lock().ops_left = Some(ops);
    }

    /// Whether the power is out.
    pub fn crashed(&self) -> bool {
        self.lock().crashed
    }

    /// The `n`-th sync from now (1 = the next) fails with EIO.
    pub fn fail_sync(&self, n: u64) {
        self.lock().sync_fault = Some((n.max(1), EIO));
    }

    /// The `n`-th write from now fails with EIO.
    pub fn fail_write(&self, n: u64) {
        self.lock().write_fault = Some((n.max(1), EIO));
    }

    /// Every sync fails with this chance (per million); every write likewise.
    pub fn set_failure_rates(&self, sync_ppm: u32, write_ppm: u32) {
        let mut st = self.lock();
        st.sync_fail_ppm = sync_ppm;
        st.write_fail_ppm = write_ppm;
    }

    /// Files may hold at most this many bytes in all (None: no limit); growth beyond it fails
    /// with ENOSPC (a write that crosses it writes what fits).
    pub fn set_space_limit(&self, bytes: Option<u64>) {
        self.lock().space_limit = bytes;
    }

    /// Bytes the files hold now.
    pub fn used_bytes(&self) -> u64 {
        self.lock().used()
    }

    /// A slow disk: every file sync takes at least `d`, spent outside this layer's lock, so
    /// that syncs of one file from two threads overlap as they may on a real disk (counted in
    /// [`FaultStats::overlapping_syncs`]).
    pub fn set_sync_delay(&self, d: std::time::Duration) {
        self.lock().sync_delay = d;
    }

    /// Counters.
    pub fn stats(&self) -> FaultStats {
        self.lock().stats
    }

    /// After a crash: rewrites every file and directory this layer touched to one state the disk
    /// could hold (see the module documentation). Files it never touched are left alone.
    pub fn materialize(&self) -> io::Result<()> {
        let mut st = self.lock();
        st.crashed = true;
        let dirs: Vec<PathBuf> = st.dirs.keys().cloned().collect();
        for dir in dirs {
            let d = st.dirs.get(&dir).expect("listed above");
            let (mut names, pending, known): (BTreeMap<OsString, u64>, Vec<DirOp>, BTreeSet<OsString>) =
                (d.durable.clone(), d.pending.clone(), d.durable.keys().chain(d.current.keys()).cloned().collect());
            let keep = if pending.is_empty() { 0 } else { (st.next() % (pending.len() as u64 + 1)) as usize };
            for op in &pending[..keep] {
                match op {
                    DirOp::Set(n, ino) => {
                        names.insert(n.clone(), *ino);
                    }
                    DirOp::Remove(n) => {
                        names.remove(n);
                    }
                    DirOp::Rename(from, to, ino) => {
                        names.remove(from);
                        names.insert(to.clone(), *ino);
                    }
                }
            }
            let mut known = known;
            for op in &pending {
                match op {
                    DirOp::Set(n, _) | DirOp::Remove(n) => {
                        known.insert(n.clone());
                    }
                    DirOp::Rename(a, b, _) => {
                        known.insert(a.clone());
                        known.insert(b.clone());
                    }
                }
            }
            for name in &known {
                let p = dir.join(name);
                match names.get(name) {
                    None => {
                        let _ = std::fs::remove_file(&p);
                    }
                    Some(&ino) => {
                        let image = st.crash_image(ino);
                        let _ = std::fs::remove_file(&p);
                        std::fs::write(&p, &image)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn file(&self, ino: u64, real: Arc<dyn FsFile>) -> Arc<dyn FsFile> {
        Arc::new(FaultFile { ino, real, st: self.st.clone() })
    }
}

impl Fs for FaultFs {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn FsFile>> {
        let mut st = self.lock();
        st.tick()?;
        let real = RealFs.create(path)?;
        let ino = st.next_ino;
        st.next_ino += 1;
        st.files.insert(ino, Model { len_dirty: true, ..Model::default() });
        let (dir, name) = split(path);
        let d = st.dir(&dir);
        d.current.insert(name.clone(), ino);
        d.pending.push(DirOp::Set(name, ino));
        drop(st);
        Ok(self.file(ino, real))
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn FsFile>> {
        let mut st = self.lock();
        if st.crashed {
            return Err(errno(EIO));
        }
        let real = RealFs.open(path)?;
        let ino = match st.lookup(path) {
            Some(ino) => ino,
            None => {
                // Appeared behind our back: take it as durable.
                let bytes = std::fs::read(path)?;
                let ino = st.next_ino;
                st.next_ino += 1;
                st.files.insert(ino, Model { disk: bytes.clone(), cache: bytes, ..Model::default() });
                let (dir, name) = split(path);
                let d = st.dir(&dir);
                d.durable.insert(name.clone(), ino);
                d.current.insert(name, ino);
                ino
            }
        };
        drop(st);
        Ok(self.file(ino, real))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.tick()?;
        let ino = st.lookup(from).ok_or_else(|| errno(2))?;
        RealFs.rename(from, to)?;
        let ((fdir, fname), (tdir, tname)) = (split(from), split(to));
        if fdir == tdir {
            let d = st.dir(&fdir);
            d.current.remove(&fname);
            d.current.insert(tname.clone(), ino);
            d.pending.push(DirOp::Rename(fname, tname, ino));
        } else {
            let d = st.dir(&fdir);
            d.current.remove(&fname);
            d.pending.push(DirOp::Remove(fname));
            let d = st.dir(&tdir);
            d.current.insert(tname.clone(), ino);
            d.pending.push(DirOp::Set(tname, ino));
        }
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.tick()?;
        st.lookup(path);
        RealFs.remove(path)?;
        let (dir, name) = split(path);
        let d = st.dir(&dir);
        d.current.remove(&name);
        d.pending.push(DirOp::Remove(name));
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.tick()?;
        if st.sync_fault_due() {
            return Err(errno(EIO));
        }
        RealFs.sync_dir(dir)?;
        let d = st.dir(dir);
        d.durable = d.current.clone();
        d.pending.clear();
        st.stats.syncs += 1;
        Ok(())
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let st = self.lock();
        if st.crashed {
            return Err(errno(EIO));
        }
        // Directories themselves are not modelled: they are created durably at once.
        RealFs.create_dir_all(dir)
    }
}

impl State {
    fn sync_fault_due(&mut self) -> bool {
        let planned = match &mut self.sync_fault {
            Some((1, _)) => {
                self.sync_fault = None;
                true
            }
            Some((n, _)) => {
                *n -= 1;
                false
            }
            None => false,
        };
        let hit = planned || self.chance(self.sync_fail_ppm);
        if hit {
            self.stats.failed_syncs += 1;
        }
        hit
    }

    fn write_fault_due(&mut self) -> bool {
        let planned = match &mut self.write_fault {
            Some((1, _)) => {
                self.write_fault = None;
                true
            }
            Some((n, _)) => {
                *n -= 1;
                false
            }
            None => false,
        };
        let hit = planned || self.chance(self.write_fail_ppm);
        if hit {
            self.stats.failed_writes += 1;
        }
        hit
    }

    /// How many of `want` new bytes past the end of a file the space limit allows.
    fn room(&self, want: u64) -> u64 {
        match self.space_limit {
            None => want,
            Some(limit) => want.min(limit.saturating_sub(self.used())),
        }
    }
}

#[derive(Debug)]
struct FaultFile {
    ino: u64,
    real: Arc<dyn FsFile>,
    st: Arc<Mutex<State>>,
}

impl FaultFile {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl FsFile for FaultFile {
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<usize> {
        let mut st = self.lock();
        st.tick()?;
        if st.write_fault_due() {
            return Err(errno(EIO));
        }
        let len = st.files.get(&self.ino).map_or(0, |m| m.cache.len()) as u64;
        let end = off + buf.len() as u64;
        let mut n = buf.len();
        if end > len {
            let room = st.room(end - len);
            if room < end - len {
                let fits = (len + room).saturating_sub(off) as usize;
                if fits == 0 {
                    st.stats.no_space += 1;
                    return Err(errno(ENOSPC));
                }
                n = fits.min(buf.len());
            }
        }
        let n = self.real.write_at(&buf[..n], off)?;
        let m = st.files.entry(self.ino).or_default();
        let (start, stop) = (off as usize, off as usize + n);
        if m.cache.len() < stop {
            m.cache.resize(stop, 0);
            m.len_dirty = true;
        }
        m.cache[start..stop].copy_from_slice(&buf[..n]);
        if n > 0 {
            m.dirty.extend(start / PAGE..=(stop - 1) / PAGE);
        }
        st.stats.writes += 1;
        Ok(n)
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        self.real.read_at(buf, off)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.lock();
        st.tick()?;
        let have = st.files.get(&self.ino).map_or(0, |m| m.cache.len()) as u64;
        if len > have && st.room(len - have) < len - have {
            st.stats.no_space += 1;
            return Err(errno(ENOSPC));
        }
        self.real.set_len(len)?;
        let m = st.files.entry(self.ino).or_default();
        m.cache.resize(len as usize, 0);
        m.len_dirty = true;
        Ok(())
    }

    fn allocate(&self, len: u64) -> io::Result<()> {
        let mut st = self.lock();
        st.tick()?;
        let have = st.files.get(&self.ino).map_or(0, |m| m.cache.len()) as u64;
        if len <= have {
            return Ok(());
        }
        if st.room(len - have) < len - have {
            st.stats.no_space += 1;
            return Err(errno(ENOSPC));
        }
        self.real.allocate(len)?;
        let m = st.files.entry(self.ino).or_default();
        m.cache.resize(len as usize, 0);
        m.len_dirty = true;
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let delay = {
            let mut st = self.lock();
            let n = st.syncing.entry(self.ino).or_insert(0);
            *n += 1;
            if *n > 1 {
                st.stats.overlapping_syncs += 1;
            }
            st.sync_delay
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let r = self.sync_now();
        if let Some(n) = self.lock().syncing.get_mut(&self.ino) {
            *n -= 1;
        }
        r
    }

    fn size(&self) -> io::Result<u64> {
        let st = self.lock();
        Ok(st.files.get(&self.ino).map_or(0, |m| m.cache.len()) as u64)
    }
}

impl FaultFile {
    /// A sync once the slow disk's delay is spent (see [`FaultFs::set_sync_delay`]).
    fn sync_now(&self) -> io::Result<()> {
        let mut st = self.lock();
        st.tick()?;
        if st.sync_fault_due() {
            // Linux marks the dirty pages clean although they never reached the disk; once
            // evicted, reads see the disk's bytes. Model the worst: drop them now.
            let m = st.files.entry(self.ino).or_default();
            let pages: Vec<usize> = std::mem::take(&mut m.dirty).into_iter().collect();
            m.len_dirty = false;
            for p in pages {
                let (start, end) = (p * PAGE, ((p + 1) * PAGE).min(m.cache.len()));
                if start >= end {
                    continue;
                }
                let mut page = vec![0u8; end - start];
                if start < m.disk.len() {
                    let have = m.disk.len().min(end) - start;
                    page[..have].copy_from_slice(&m.disk[start..start + have]);
                }
                m.cache[start..end].copy_from_slice(&page);
                let _ = self.real.write_at(&page, start as u64);
            }
            return Err(errno(EIO));
        }
        self.real.sync_data()?;
        let m = st.files.entry(self.ino).or_default();
        m.disk.resize(m.cache.len(), 0);
        for p in std::mem::take(&mut m.dirty) {
            let (start, end) = (p * PAGE, ((p + 1) * PAGE).min(m.cache.len()));
            if start < end {
                m.disk[start..end].copy_from_slice(&m.cache[start..end]);
            }
        }
        m.len_dirty = false;
        st.stats.syncs += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_data_and_entries_can_be_lost_synced_ones_cannot() {
        let dir = tempfile::tempdir().expect("tempdir");
        for seed in 0..64 {
            let sub = dir.path().join(format!("s{seed}"));
            std::fs::create_dir_all(&sub).expect("mkdir");
            let fs = FaultFs::new(seed);
            let a = fs.create(&sub.join("a")).expect("create");
            a.write_all_at(&[1u8; 3 * PAGE], 0).expect("write");
            a.sync_data().expect("sync");
            fs.sync_dir(&sub).expect("sync dir");
            a.write_all_at(&[2u8; 2 * PAGE], PAGE as u64).expect("write");
            let b = fs.create(&sub.join("b")).expect("create");
            b.write_all_at(b"bbbb", 0).expect("write");
            b.sync_data().expect("sync");
            fs.crash();
            fs.materialize().expect("materialize");
            let got = std::fs::read(sub.join("a")).expect("a survives: synced");
            assert_eq!(got.len(), 3 * PAGE);
            assert_eq!(&got[..PAGE], &[1u8; PAGE][..], "synced page intact");
            for p in 1..3 {
                let page = &got[p * PAGE..(p + 1) * PAGE];
                assert!(page == [1u8; PAGE] || page == [2u8; PAGE], "a page is old or new, never mixed");
            }
            // b's entry was never synced: it may or may not exist, but if it does, it is whole.
            if let Ok(b) = std::fs::read(sub.join("b")) {
                assert_eq!(b, b"bbbb");
            }
        }
    }

    #[test]
    fn a_failed_sync_drops_the_dirty_pages() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs = FaultFs::new(7);
        let f = fs.create(&dir.path().join("f")).expect("create");
        f.write_all_at(&[1u8; PAGE], 0).expect("write");
        f.sync_data().expect("sync");
        f.write_all_at(&[2u8; PAGE], 0).expect("write");
        fs.fail_sync(1);
        assert!(f.sync_data().is_err());
        f.sync_data().expect("the next sync succeeds, with nothing to write");
        let mut b = [0u8; PAGE];
        f.read_exact_at(&mut b, 0).expect("read");
        assert_eq!(b, [1u8; PAGE], "the cache now shows what the disk holds");
    }

    #[test]
    fn the_space_limit_gives_enospc_after_a_partial_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs = FaultFs::new(3);
        fs.set_space_limit(Some(100));
        let f = fs.create(&dir.path().join("f")).expect("create");
        assert_eq!(f.write_at(&[0u8; 150], 0).expect("partial"), 100);
        let e = f.write_at(&[0u8; 10], 100).expect_err("full");
        assert!(crate::fs::is_no_space(&e));
        assert!(crate::fs::is_no_space(&f.allocate(200).expect_err("full")));
        fs.set_space_limit(Some(1000));
        f.allocate(200).expect("room again");
    }
}
