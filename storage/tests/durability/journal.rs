//! `JournalFs` under real SIGKILLs, then `power_cut`: a `dpukv-store journal-writer` process does
//! random file operations (writes, truncations, syncs, creates, renames over files, removes,
//! directory syncs), printing each before doing it and `ok` after; it is killed at a random
//! moment (sometimes restarted on the same journal without a power cut, as a supervisor would),
//! and after the cut every file must hold what the model says a disk may hold: the names of the
//! last directory sync plus a prefix of the later entry changes, each file at its synced or its
//! cached length, each page its synced or its cached bytes — and across the rounds some unsynced
//! pages and entries are lost (the layer bites) and some are kept.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const PAGE: usize = 4096;

#[derive(Debug, Clone, Default)]
struct Inode {
    synced: Vec<u8>,
    cache: Vec<u8>,
}

#[derive(Debug, Clone)]
enum DirOp {
    Set(String, usize),
    Remove(String),
    Rename(String, String, usize),
}

/// What the disk and the page cache hold, as the writer's completed operations say.
#[derive(Debug, Clone, Default)]
struct Model {
    inodes: Vec<Inode>,
    durable: BTreeMap<String, usize>,
    current: BTreeMap<String, usize>,
    pending: Vec<DirOp>,
}

impl Model {
    /// Everything in `dir` (but the journal) as durable.
    fn load(dir: &Path) -> Model {
        let mut m = Model::default();
        for e in std::fs::read_dir(dir).expect("ls").flatten() {
            let name = e.file_name().into_string().expect("utf-8");
            if is_data(&name) {
                let bytes = std::fs::read(e.path()).expect("read");
                m.inodes.push(Inode { synced: bytes.clone(), cache: bytes });
                m.durable.insert(name.clone(), m.inodes.len() - 1);
                m.current.insert(name, m.inodes.len() - 1);
            }
        }
        m
    }

    fn apply(&mut self, line: &str) {
        let w: Vec<&str> = line.split(' ').collect();
        let num = |i: usize| w[i].parse::<usize>().expect("number");
        let ino = |m: &Model, name: &str| *m.current.get(name).unwrap_or_else(|| panic!("{name} exists for {line}"));
        match w[0] {
            "write" => {
                let i = ino(self, w[1]);
                let (off, len, byte) = (num(2), num(3), num(4) as u8);
                let c = &mut self.inodes[i].cache;
                if c.len() < off + len {
                    c.resize(off + len, 0);
                }
                c[off..off + len].fill(byte);
            }
            "setlen" => {
                let i = ino(self, w[1]);
                self.inodes[i].cache.resize(num(2), 0);
            }
            "sync" => {
                let i = ino(self, w[1]);
                self.inodes[i].synced = self.inodes[i].cache.clone();
            }
            "create" => {
                self.inodes.push(Inode::default());
                let i = self.inodes.len() - 1;
                self.current.insert(w[1].into(), i);
                self.pending.push(DirOp::Set(w[1].into(), i));
            }
            "rename" => {
                let i = self.current.remove(w[1]).expect("renamed file exists");
                self.current.insert(w[2].into(), i);
                self.pending.push(DirOp::Rename(w[1].into(), w[2].into(), i));
            }
            "remove" => {
                self.current.remove(w[1]);
                self.pending.push(DirOp::Remove(w[1].into()));
            }
            "syncdir" => {
                self.durable = self.current.clone();
                self.pending.clear();
            }
            other => panic!("unknown operation {other}"),
        }
    }

    /// The names a disk may show: the durable ones and the first `k` pending changes.
    fn names(&self, k: usize) -> BTreeMap<String, usize> {
        let mut n = self.durable.clone();
        for op in &self.pending[..k] {
            match op {
                DirOp::Set(a, i) => {
                    n.insert(a.clone(), *i);
                }
                DirOp::Remove(a) => {
                    n.remove(a);
                }
                DirOp::Rename(a, b, i) => {
                    n.remove(a);
                    n.insert(b.clone(), *i);
                }
            }
        }
        n
    }

    /// Whether `got` is a state the disk may hold, and the cut had journaled every page that
    /// differs from its synced bytes (`cut`: per file name, pages journaled and the synced length
    /// it found); counts what was lost and kept.
    fn allows(&self, got: &BTreeMap<String, Vec<u8>>, cut: &BTreeMap<String, (u64, u64)>, tally: &mut Tally) -> bool {
        (0..=self.pending.len()).rev().any(|k| {
            let names = self.names(k);
            if !names.keys().eq(got.keys()) {
                return false;
            }
            let mut t = Tally { entries_lost: (k < self.pending.len()) as u64, ..Tally::default() };
            let ok = names.iter().all(|(name, &i)| {
                let ino = &self.inodes[i];
                let journaled = match cut.get(name) {
                    Some(&(pages, synced_len)) => synced_len == ino.synced.len() as u64 && pages >= ino.dirty_pages(),
                    None => ino.dirty_pages() == 0 && ino.synced.len() == ino.cache.len(),
                };
                journaled && page_ok(ino, &got[name], &mut t)
            });
            if ok {
                tally.add(&t);
            }
            ok
        })
    }
}

impl Inode {
    /// Pages whose cached bytes differ from the synced ones.
    fn dirty_pages(&self) -> u64 {
        let at = |v: &[u8], i: usize| v.get(i).copied().unwrap_or(0);
        let len = self.synced.len().max(self.cache.len());
        (0..len.div_ceil(PAGE))
            .filter(|p| (p * PAGE..((p + 1) * PAGE).min(len)).any(|i| at(&self.synced, i) != at(&self.cache, i)))
            .count() as u64
    }
}

fn page_ok(ino: &Inode, got: &[u8], t: &mut Tally) -> bool {
    if got.len() != ino.synced.len() && got.len() != ino.cache.len() {
        return false;
    }
    let at = |v: &[u8], i: usize| v.get(i).copied().unwrap_or(0);
    for start in (0..got.len()).step_by(PAGE) {
        let end = (start + PAGE).min(got.len());
        let page = &got[start..end];
        let old = (start..end).all(|i| at(&ino.synced, i) == page[i - start]);
        let new = (start..end).all(|i| at(&ino.cache, i) == page[i - start]);
        if !old && !new {
            return false;
        }
        let differ = (start..end).any(|i| at(&ino.synced, i) != at(&ino.cache, i));
        if differ {
            if new {
                t.pages_kept += 1;
            } else {
                t.pages_lost += 1;
            }
        }
    }
    true
}

#[derive(Debug, Default)]
struct Tally {
    pages_lost: u64,
    pages_kept: u64,
    entries_lost: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.pages_lost += o.pages_lost;
        self.pages_kept += o.pages_kept;
        self.entries_lost += o.entries_lost;
    }
}

/// The writer's files are `f0`..`f3` (not the journal).
fn is_data(name: &str) -> bool {
    name.len() == 2 && name.starts_with('f')
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("ls")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            is_data(&name).then(|| (name, std::fs::read(e.path()).expect("read")))
        })
        .collect()
}

/// Runs the writer until its `min_ok`-th completed operation (or its end), kills it a little
/// later, and returns its lines.
fn run_writer(dir: &Path, seed: u64, min_ok: usize, extra_ms: u64) -> Vec<String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dpukv-store"))
        .arg("journal-writer")
        .arg(dir)
        .args(["--seed", &seed.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        let mut oks = 0;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line == "ok" {
                oks += 1;
                if oks == min_ok {
                    let _ = tx.send(());
                }
            }
            lines.push(line);
        }
        lines
    });
    let _ = rx.recv_timeout(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(extra_ms));
    child.kill().expect("kill");
    child.wait().expect("reap");
    reader.join().expect("reader")
}

#[test]
fn a_power_cut_after_sigkill_leaves_what_a_disk_may_hold() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("data");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut model = Model::default();
    let mut tally = Tally::default();
    let mut rng = 0x5eed_u64;
    let mut next = move |n: u64| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    let (mut cuts, mut restarts) = (0, 0);
    for round in 0..40u64 {
        let lines = run_writer(&dir, round + 1, 1 + next(40) as usize, next(15));
        // Completed operations, and the one in flight when the kill came (done or not).
        let mut in_flight = None;
        for l in &lines {
            if l == "ok" {
                model.apply(in_flight.take().expect("an operation before its ok"));
            } else {
                in_flight = Some(l.as_str());
            }
        }
        let candidates: Vec<Model> = match in_flight {
            None => vec![model.clone()],
            Some(l) => {
                // A write the kill interrupted may have copied a prefix of its pages.
                let mut partial = vec![l.to_string()];
                if let ["write", name, off, len, byte] = l.split(' ').collect::<Vec<_>>()[..] {
                    let (off, len): (usize, usize) = (off.parse().expect("off"), len.parse().expect("len"));
                    let cuts = (off / PAGE + 1..).map(|p| p * PAGE).take_while(|&c| c < off + len);
                    partial.extend(cuts.map(|c| format!("write {name} {off} {} {byte}", c - off)));
                }
                let mut all = vec![model.clone()];
                for l in &partial {
                    let mut done = model.clone();
                    done.apply(l);
                    all.push(done);
                }
                all
            }
        };
        if round % 4 == 3 {
            // Killed and restarted without a power cut: the page cache (the real files) tells
            // whether (how much of) the operation in flight happened; a sync in flight counts as
            // not done.
            restarts += 1;
            let now = files(&dir);
            let shows = |m: &Model| {
                m.current.keys().eq(now.keys()) && m.current.iter().all(|(n, &i)| m.inodes[i].cache == now[n])
            };
            model = candidates.iter().find(|m| shows(m)).cloned().expect("the page cache shows a candidate");
            continue;
        }
        let report = dpukv_storage::fs::power_cut(&dir, round).expect("power cut");
        cuts += 1;
        let got = files(&dir);
        let cut: BTreeMap<String, (u64, u64)> = report
            .files
            .iter()
            .map(|f| {
                let name = f.path.file_name().expect("a name").to_string_lossy().into_owned();
                (name, (f.pages_dropped + f.pages_kept, f.synced_len))
            })
            .collect();
        assert!(
            candidates.iter().any(|m| m.allows(&got, &cut, &mut tally)),
            "round {round}: the files after the cut are no state a disk may hold\n{report}\nlast operations: {:?}",
            &lines[lines.len().saturating_sub(12)..]
        );
        assert!(!dir.join(dpukv_storage::fs::JOURNAL_DIR).exists(), "the cut removes the journal");
        model = Model::load(&dir);
    }
    eprintln!("{cuts} cuts, {restarts} restarts: {tally:?}");
    assert!(cuts > 0 && restarts > 0);
    assert!(tally.pages_lost > 0, "no unsynced page was ever lost: the layer does not bite ({tally:?})");
    assert!(tally.pages_kept > 0, "no unsynced page was ever kept ({tally:?})");
    assert!(tally.entries_lost > 0, "no unsynced entry change was ever lost ({tally:?})");
}
