//! Send Index and Build Index: a backup fed the primary's log segments and its shipped compaction
//! outputs answers every get and scan exactly as the primary does; so does a backup that builds
//! its own index from the same log.

use std::collections::BTreeMap;

use dpukv_storage::BatchOp;
use dpukv_storage::region::{Backup, Region, RegionConfig, ShippedIndex, adopt_built_index, build_dir, build_index};
use dpukv_storage::vlog::{FsyncPolicy, Lsn};
use proptest::prelude::*;

fn cfg(dir: &std::path::Path, name: &str) -> RegionConfig {
    RegionConfig::tiny(dir.join(name), dir.join(format!("{name}-shm")), FsyncPolicy::Never)
}

/// How the log reaches the backup: whole segments, or streamed in chunks of at most `chunk`
/// bytes from where the backup is (`pos`), as the replication stream does.
#[derive(Debug, Clone, Copy)]
enum Shipping {
    Whole,
    Stream { chunk: usize },
}

fn must_ship(primary: &mut Region, backup: &mut Backup, how: Shipping, pos: &mut Option<Lsn>) {
    match how {
        Shipping::Whole => {
            for (id, bytes) in primary.log_segments().expect("log segments") {
                backup.receive_log_segment(id, &bytes).expect("receive log");
            }
        }
        Shipping::Stream { chunk } => {
            let tail = primary.vlog().tail();
            let mut at = pos.unwrap_or_else(|| Lsn::new(primary.vlog().segments()[0], 0));
            while let Some(c) = tail.chunk(at, chunk).expect("chunk") {
                at = backup.append_log(&c).expect("append");
            }
            *pos = Some(at);
        }
    }
    for export in primary.take_exports() {
        backup.apply_send_index(&export).expect("send index");
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("dir") {
        let e = e.expect("entry");
        if e.path().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, Vec<u8>),
    Delete(u8),
    Batch(Vec<(u8, Vec<u8>)>),
    Ship,
    Promote,
    /// The backup restarts (its process): it reopens its directory and resumes the stream.
    Reopen,
    /// A new backup joins: the whole log streamed, the whole index shipped (through the wire
    /// encoding), then promoted: it answers like the primary.
    Join,
}

fn op() -> impl Strategy<Value = Op> {
    let value =
        prop_oneof![proptest::collection::vec(any::<u8>(), 0..30), proptest::collection::vec(any::<u8>(), 41..300)];
    prop_oneof![
        8 => (any::<u8>(), value.clone()).prop_map(|(k, v)| Op::Put(k, v)),
        3 => any::<u8>().prop_map(Op::Delete),
        1 => proptest::collection::vec((any::<u8>(), value), 1..5).prop_map(Op::Batch),
        2 => Just(Op::Ship),
        1 => Just(Op::Promote),
        1 => Just(Op::Reopen),
        1 => Just(Op::Join),
    ]
}

fn key(k: u8) -> Vec<u8> {
    format!("key{:03}", k % 200).into_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn backup_answers_like_the_primary(
        ops in proptest::collection::vec(op(), 1..250),
        how in prop_oneof![Just(Shipping::Whole), (1usize..4000).prop_map(|chunk| Shipping::Stream { chunk })],
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut primary = Region::open(cfg(dir.path(), "primary")).expect("primary").0;
        primary.capture_exports();
        let mut backup = Backup::create(dir.path().join("backup")).expect("backup");
        let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let mut promotions = 0;
        let mut pos = None;
        for op in ops {
            match op {
                Op::Put(k, v) => {
                    primary.put(&key(k), &v).expect("put");
                    model.insert(key(k), v);
                }
                Op::Delete(k) => {
                    primary.delete(&key(k)).expect("delete");
                    model.remove(&key(k));
                }
                Op::Batch(items) => {
                    let keys: Vec<Vec<u8>> = items.iter().map(|(k, _)| key(*k)).collect();
                    let ops: Vec<BatchOp> = keys.iter().zip(&items).map(|(k, (_, v))| BatchOp::Put(k, v)).collect();
                    primary.write_batch(&ops).expect("batch");
                    for (k, (_, v)) in keys.into_iter().zip(items) {
                        model.insert(k, v);
                    }
                }
                Op::Ship => must_ship(&mut primary, &mut backup, how, &mut pos),
                Op::Join => {
                    promotions += 1;
                    let jdir = dir.path().join(format!("joined{promotions}"));
                    let mut joined = Backup::create(&jdir).expect("backup");
                    let tail = primary.vlog().tail();
                    let mut at = Lsn::new(primary.vlog().segments()[0], 0);
                    while let Some(c) = tail.chunk(at, 64 << 10).expect("chunk") {
                        at = joined.append_log(&c).expect("append");
                    }
                    if let Some(e) = primary.export_all().expect("export") {
                        // As a connection installs it: the metadata through its wire encoding,
                        // then one segment at a time.
                        let shipped = ShippedIndex::from_parts(e.parts()).expect("the wire encoding round-trips");
                        let mut inst = joined.begin_index(shipped).expect("begin");
                        for id in e.levels.iter().flat_map(|l| l.segments.clone()) {
                            joined.install_segment(&mut inst, id, &e.read_segment(id).expect("pinned")).expect("segment");
                        }
                        joined.finish_index(inst).expect("install the whole index");
                    }
                    drop(joined);
                    let promoted = Region::open(RegionConfig::tiny(&jdir, dir.path().join(format!("joined{promotions}-shm")), FsyncPolicy::Never)).expect("promote").0;
                    prop_assert_eq!(promoted.scan(b"", b"\xff", usize::MAX).expect("scan"), primary.scan(b"", b"\xff", usize::MAX).expect("scan"));
                }
                Op::Reopen => {
                    backup = Backup::open_with(dir.path().join("backup"), dpukv_storage::fs::real()).expect("reopen");
                    if matches!(how, Shipping::Stream { .. }) {
                        pos = backup.resume_from();
                    }
                }
                Op::Promote => {
                    // Promote a copy of the backup: it replays the log tail its levels do not cover.
                    must_ship(&mut primary, &mut backup, how, &mut pos);
                    promotions += 1;
                    let copy = dir.path().join(format!("promoted{promotions}"));
                    copy_dir(backup.dir(), &copy);
                    let promoted = Region::open(RegionConfig::tiny(&copy, dir.path().join(format!("promoted{promotions}-shm")), FsyncPolicy::Never)).expect("promote").0;
                    prop_assert_eq!(promoted.scan(b"", b"\xff", usize::MAX).expect("scan"), primary.scan(b"", b"\xff", usize::MAX).expect("scan"));
                }
            }
        }
        // Final: everything compacted on the primary and shipped; the backup's levels alone
        // (no replay: the manifest's log start is the end of the log) answer like the primary.
        primary.flush_now().expect("flush");
        must_ship(&mut primary, &mut backup, how, &mut pos);
        prop_assert_eq!(backup.manifest().levels.len(), primary.manifest().levels.len());
        let (promoted, rec) = Region::open(cfg(dir.path(), "backup")).expect("open backup");
        prop_assert_eq!(rec.replayed, 0, "the shipped index covers the whole log");
        let want: Vec<(Vec<u8>, Vec<u8>)> = model.into_iter().collect();
        prop_assert_eq!(&promoted.scan(b"", b"\xff", usize::MAX).expect("scan"), &want);
        for (k, v) in &want {
            prop_assert_eq!(promoted.get(k).expect("get"), Some(v.clone()));
        }
        // Build Index: a backup that replays the same log and compacts itself agrees too.
        let build = dir.path().join("build");
        std::fs::create_dir_all(build.join("vlog")).expect("mkdir");
        let mut b2 = Backup::create(&build).expect("backup");
        for (id, bytes) in primary.log_segments().expect("log") {
            b2.receive_log_segment(id, &bytes).expect("receive");
        }
        let built = Region::open(cfg(dir.path(), "build")).expect("build index").0;
        prop_assert_eq!(&built.scan(b"", b"\xff", usize::MAX).expect("scan"), &want);
    }
}

/// A shipped level segment is input from another machine: one whose checksums are right but
/// whose nodes lie (entry offsets and key lengths pointing anywhere) is refused with an error,
/// never a panic or an out-of-bounds read.
#[test]
fn a_crafted_shipped_segment_is_refused_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut primary = Region::open(cfg(dir.path(), "primary")).expect("open").0;
    primary.capture_exports();
    for i in 0..400u32 {
        let key = format!("key{i:05}").into_bytes();
        primary.put(&key, &vec![i as u8; 1 + (i % 50) as usize]).expect("put");
    }
    primary.flush_now().expect("flush");
    let exports = primary.take_exports();
    let (export, meta) =
        exports.iter().find_map(|e| e.levels.first().map(|l| (e, l.clone()))).expect("a shipped level");
    let segments: Vec<(u64, Vec<u8>)> =
        meta.segments.iter().map(|&id| (id, export.read_segment(id).expect("pinned"))).collect();
    let ns = meta.node_size as usize;
    let fix_checksums = |b: &mut Vec<u8>| {
        let body = crc32c::crc32c(&b[ns..]);
        b[24..28].copy_from_slice(&body.to_le_bytes());
        let head = crc32c::crc32c(&b[..28]);
        b[28..32].copy_from_slice(&head.to_le_bytes());
    };
    let (seg_id, good) = segments[0].clone();
    let nodes = good.len() / ns - 1;
    let count_of = |n: usize| u16::from_le_bytes([good[n * ns + 2], good[n * ns + 3]]) as usize;
    let full: Vec<usize> = (1..=nodes).filter(|&n| count_of(n) > 0).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut refused = 0;
    for round in 0..400 {
        let mut bad = good.clone();
        // Half of the lies in the last node with entries, where an offset past the node may be
        // past the segment.
        let node = if round % 2 == 0 { full[full.len() - 1] } else { full[round % full.len()] };
        let base = node * ns;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Lie in the entry offset table (past the node), or in a key length, or anywhere.
        let at = match round % 3 {
            0 => base + 32 + 2 * ((x as usize >> 8) % count_of(node)),
            1 => base + 32 + 16 + (x as usize >> 16) % (ns - 50),
            _ => base + (x as usize >> 24) % (ns - 2),
        };
        bad[at..at + 2].copy_from_slice(&(0xff00u16 | (x as u16 & 0xff)).to_le_bytes());
        fix_checksums(&mut bad);
        let mut backup = Backup::create(dir.path().join(format!("backup-{round}"))).expect("backup");
        for (id, bytes) in primary.log_segments().expect("log") {
            backup.receive_log_segment(id, &bytes).expect("receive log");
        }
        let mut shipped = ShippedIndex::from(export);
        shipped.levels = vec![meta.clone()];
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> dpukv_storage::Result<()> {
            let mut inst = backup.begin_index(shipped.clone())?;
            for (id, bytes) in &segments {
                backup.install_segment(&mut inst, *id, if *id == seg_id { &bad } else { bytes })?;
            }
            backup.finish_index(inst)
        }));
        match out {
            Ok(Err(_)) => refused += 1,
            Ok(Ok(_)) => {} // the lie landed where nothing reads it
            Err(_) => panic!("a crafted segment (round {round}, byte {at}) panicked the backup"),
        }
    }
    assert!(refused > 100, "only {refused} of 400 crafted segments were refused");
}

/// A stream resumed at an earlier position re-sends bytes the backup holds: they are skipped,
/// and the copy ends byte-identical to a clean one; a chunk past what the backup holds (a gap)
/// is refused, and so is a segment streamed from its middle.
#[test]
fn a_resent_chunk_is_skipped_and_a_gap_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut primary = Region::open(cfg(dir.path(), "primary")).expect("primary").0;
    for i in 0..400u32 {
        primary.put(format!("k{i:05}").as_bytes(), &[i as u8; 100]).expect("put");
    }
    let tail = primary.vlog().tail();
    let first = Lsn::new(primary.vlog().segments()[0], 0);
    let mut clean = Backup::create(dir.path().join("clean")).expect("backup");
    let mut twice = Backup::create(dir.path().join("twice")).expect("backup");
    let (mut a, mut b) = (first, first);
    while let Some(c) = tail.chunk(a, 777).expect("chunk") {
        a = clean.append_log(&c).expect("append");
    }
    let mut prev: Option<dpukv_storage::vlog::LogChunk> = None;
    while let Some(c) = tail.chunk(b, 500).expect("chunk") {
        if let Some(p) = &prev
            && p.segment == c.segment
        {
            // Re-send the previous chunk and this one from the previous one's start.
            twice.append_log(p).expect("a re-sent chunk");
            let overlap = tail.chunk(Lsn::new(p.segment, p.offset), 900).expect("chunk").expect("bytes");
            twice.append_log(&overlap).expect("an overlapping chunk");
        }
        b = twice.append_log(&c).expect("append");
        prev = Some(c);
    }
    assert_eq!(a, b);
    for (id, _) in primary.log_segments().expect("segments") {
        let (l1, l2) = (clean.log_map()[&id], twice.log_map()[&id]);
        let read = |d: &str, l: u64| {
            std::fs::read(dpukv_storage::vlog::segment_path(&dir.path().join(d).join("vlog"), l)).expect("copy")
        };
        assert!(read("clean", l1) == read("twice", l2), "segment {id}: the copies are identical");
    }
    let gap = tail.chunk(first, 100).expect("chunk").expect("bytes");
    let mut fresh = Backup::create(dir.path().join("fresh")).expect("backup");
    let mid = dpukv_storage::vlog::LogChunk { offset: 200, ..gap.clone() };
    assert!(fresh.append_log(&mid).is_err(), "a segment cannot start in its middle");
    fresh.append_log(&gap).expect("the start");
    let far = dpukv_storage::vlog::LogChunk { offset: 5000, ..gap };
    assert!(fresh.append_log(&far).is_err(), "a gap is refused");
}

/// A backup that followed primary A holds bytes A wrote that the new primary B (promoted from
/// an earlier copy) never had; following B cuts them at B's base, B's own bytes take their place,
/// and a promoted copy of the backup answers like B — never with A's unacknowledged writes.
#[test]
fn a_backup_following_a_new_primary_drops_what_the_old_one_wrote_past_its_base() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = Region::open(cfg(dir.path(), "a")).expect("a").0;
    for i in 0..100u32 {
        a.put(format!("k{i:03}").as_bytes(), b"from a").expect("put");
    }
    let stream = |from: &Region, to: &mut Backup, at: Option<Lsn>| -> Lsn {
        let tail = from.vlog().tail();
        let mut at = at.unwrap_or_else(|| Lsn::new(from.vlog().segments()[0], 0));
        while let Some(c) = tail.chunk(at, 1000).expect("chunk") {
            at = to.append_log(&c).expect("append");
        }
        at
    };
    let mut x = Backup::create(dir.path().join("x")).expect("x");
    x.follow(1, 0, Lsn(0)).expect("follow a");
    stream(&a, &mut x, None);
    // y is behind: it got only the first part of a's log.
    let mut y = Backup::create(dir.path().join("y")).expect("y");
    y.follow(1, 0, Lsn(0)).expect("follow a");
    let first = Lsn::new(a.vlog().segments()[0], 0);
    let c = a.vlog().tail().chunk(first, 500).expect("chunk").expect("bytes");
    let y_end = y.append_log(&c).expect("append");
    // B is promoted from a copy of x as it is now.
    copy_dir(x.dir(), &dir.path().join("b"));
    let mut b = Region::open(cfg(dir.path(), "b")).expect("b").0;
    let base = b.vlog().end();
    // A goes on (it does not know yet) and x still gets its bytes; B writes other values.
    for i in 100..150u32 {
        a.put(format!("k{i:03}").as_bytes(), b"lost with a").expect("put");
    }
    stream(&a, &mut x, Some(base));
    for i in 100..120u32 {
        b.put(format!("k{i:03}").as_bytes(), b"from b").expect("put");
    }
    x.follow(2, 0, base).expect("follow b");
    let from = x.resume_from();
    assert!(from.is_some_and(|f| f <= b.vlog().end()), "x resumes within b's log: {from:?}");
    stream(&b, &mut x, from);
    drop(x);
    let promoted = Region::open(cfg(dir.path(), "x")).expect("promote x").0;
    assert_eq!(promoted.scan(b"", b"\xff", usize::MAX).expect("scan"), b.scan(b"", b"\xff", usize::MAX).expect("scan"));
    assert_eq!(promoted.get(b"k140").expect("get"), None, "a's unacknowledged write is gone");
    // A copy behind the base goes on from its own end, not from the base (no gap of zeros).
    y.follow(2, 0, base).expect("follow b");
    assert_eq!(y.resume_from(), Some(y_end), "y resumes where its copy ends");
    stream(&b, &mut y, Some(y_end));
    drop(y);
    let promoted = Region::open(cfg(dir.path(), "y")).expect("promote y").0;
    assert_eq!(promoted.scan(b"", b"\xff", usize::MAX).expect("scan"), b.scan(b"", b"\xff", usize::MAX).expect("scan"));
}

/// A primary that lost power comes back with a shorter log than its backup received (bytes it
/// streamed but had not synced; never acknowledged) and writes on from its shorter end. The
/// backup's copy of the lost tail must go: had it been kept (the same node, so "its own
/// bytes"), the new bytes would have been stitched onto it past the old end and a promoted copy
/// would hold records the primary never had, in place of ones it acknowledged.
#[test]
fn a_backup_following_a_primary_s_new_life_drops_the_tail_the_primary_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = Region::open(cfg(dir.path(), "a")).expect("a").0;
    for i in 0..100u32 {
        a.put(format!("k{i:03}").as_bytes(), b"synced").expect("put");
    }
    // What a's disk holds when the power goes: this much.
    copy_dir(&dir.path().join("a"), &dir.path().join("a2"));
    for i in 100..150u32 {
        a.put(format!("k{i:03}").as_bytes(), b"lost with the power").expect("put");
    }
    let stream = |from: &Region, to: &mut Backup, at: Option<Lsn>| -> Lsn {
        let tail = from.vlog().tail();
        let mut at = at.unwrap_or_else(|| Lsn::new(from.vlog().segments()[0], 0));
        while let Some(c) = tail.chunk(at, 1000).expect("chunk") {
            at = to.append_log(&c).expect("append");
        }
        at
    };
    let mut x = Backup::create(dir.path().join("x")).expect("x");
    x.follow(1, 7, Lsn(0)).expect("follow a's first life");
    let held = stream(&a, &mut x, None);
    drop(a);
    // a comes back (node 1 still) with its synced log only, in a new life, and writes on.
    let mut a2 = Region::open(cfg(dir.path(), "a2")).expect("a again").0;
    let base = a2.vlog().end();
    assert!(base < held, "the backup holds more of the log than the restarted primary");
    for i in 100..130u32 {
        a2.put(format!("k{i:03}").as_bytes(), b"after the restart").expect("put");
    }
    x.follow(1, 8, base).expect("follow a's second life");
    let from = x.resume_from();
    assert!(from.is_some_and(|f| f <= base), "x resumes within the restarted primary's log: {from:?}");
    stream(&a2, &mut x, from);
    drop(x);
    let promoted = Region::open(cfg(dir.path(), "x")).expect("promote x").0;
    assert_eq!(
        promoted.scan(b"", b"\xff", usize::MAX).expect("scan"),
        a2.scan(b"", b"\xff", usize::MAX).expect("scan"),
        "the promoted copy answers like the restarted primary"
    );
    assert_eq!(promoted.get(b"k140").expect("get"), None, "the lost, unacknowledged tail is gone");
}

/// A backup follows the primary's garbage collection: it drops its copy of a segment the
/// primary collected, but only once its own installed index starts after it (before, a promotion
/// would replay from there); a promoted copy still answers like the primary.
#[test]
fn a_backup_drops_collected_log_copies_only_once_its_index_no_longer_needs_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut primary = Region::open(cfg(dir.path(), "p")).expect("open").0;
    primary.capture_exports();
    let mut backup = Backup::create(dir.path().join("b")).expect("backup");
    let mut pos = None;
    // Overwrites of few keys: many segments, most of them garbage once compacted.
    let mut collected = 0;
    for i in 0..4000u32 {
        primary.put(format!("k{:03}", i % 100).as_bytes(), format!("{i:0>60}").as_bytes()).expect("put");
        if i % 100 == 99 {
            // Stream the log (before the primary collects any of it), but hold the exports
            // back: the backup's index stays behind.
            let tail = primary.vlog().tail();
            let mut at = pos.unwrap_or_else(|| Lsn::new(primary.vlog().segments()[0], 0));
            while let Some(c) = tail.chunk(at, 4096).expect("chunk") {
                at = backup.append_log(&c).expect("append");
            }
            pos = Some(at);
            primary.flush_now().expect("flush");
            collected += primary.maintain().expect("maintain").gc.deleted;
        }
    }
    assert!(collected > 0, "the primary collected segments");
    // As a sender does: the primary's segments first, then the log up to its end (the copies
    // a collection relocated were written before it took a segment out), then the message.
    let live = primary.vlog().tail().segments().expect("segments");
    let tail = primary.vlog().tail();
    let mut at = pos.expect("streamed");
    while let Some(c) = tail.chunk(at, 4096).expect("chunk") {
        at = backup.append_log(&c).expect("append");
    }
    assert!(
        backup.retain_log_segments(&live).expect("retain").is_empty(),
        "nothing goes while the backup's own index still starts before the collected segments"
    );
    for export in primary.take_exports() {
        backup.apply_send_index(&export).expect("send index");
    }
    let gone = backup.retain_log_segments(&live).expect("retain");
    assert!(!gone.is_empty(), "collected copies go once the index moved past them");
    assert!(gone.iter().all(|s| live.binary_search(s).is_err()), "only collected segments go: {gone:?}");
    // A reopened backup remembers (the log map), and a promoted copy answers like the primary.
    let bdir = dir.path().join("b");
    drop(backup);
    let again = Backup::open_with(&bdir, dpukv_storage::fs::real()).expect("reopen");
    assert!(gone.iter().all(|s| !again.log_map().contains_key(s)));
    drop(again);
    let promoted =
        Region::open(RegionConfig::tiny(&bdir, dir.path().join("b-shm"), FsyncPolicy::Never)).expect("promote").0;
    let all = |r: &Region| r.scan(b"", b"\xff", usize::MAX).expect("scan");
    assert_eq!(all(&promoted), all(&primary));
}

/// Build Index on a streamed copy: the backup indexes its complete log copies itself, while the
/// stream goes on; promoted, it adopts what it built, replays only the rest, and answers like the
/// primary. Building leaves the log copies as received.
#[test]
fn a_build_index_backup_indexes_its_copies_and_a_promoted_one_answers_like_the_primary() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut primary = Region::open(cfg(dir.path(), "p")).expect("open").0;
    let bdir = dir.path().join("b");
    let mut backup = Backup::create(&bdir).expect("backup");
    let mut pos = None;
    let mut built = 0;
    for i in 0..3000u32 {
        primary.put(format!("k{:04}", (i * 7919) % 1500).as_bytes(), format!("v{i}").as_bytes()).expect("put");
        if i % 100 == 99 {
            let tail = primary.vlog().tail();
            let mut at = pos.unwrap_or_else(|| Lsn::new(primary.vlog().segments()[0], 0));
            while let Some(c) = tail.chunk(at, 1000).expect("chunk") {
                at = backup.append_log(&c).expect("append");
            }
            pos = Some(at);
            let geometry = cfg(dir.path(), "unused");
            built += build_index(&bdir, &backup.sealed_segments(), geometry).expect("build");
        }
    }
    assert!(built > 1000, "the backup replayed its copies itself: {built}");
    let sealed = backup.sealed_segments();
    for &id in &sealed {
        let read = |d: &std::path::Path| std::fs::read(dpukv_storage::vlog::segment_path(&d.join("vlog"), id));
        assert_eq!(
            read(&bdir).expect("copy"),
            read(&dir.path().join("p")).expect("primary"),
            "segment {id} as received"
        );
    }
    drop(backup);
    adopt_built_index(&bdir).expect("adopt");
    assert!(!build_dir(&bdir).exists());
    let (promoted, rec) =
        Region::open(RegionConfig::tiny(&bdir, dir.path().join("b-shm"), FsyncPolicy::Never)).expect("promote");
    assert!(rec.replayed < 1000, "only what the built levels do not cover is replayed: {}", rec.replayed);
    let all = |r: &Region| r.scan(b"", b"\xff", usize::MAX).expect("scan");
    assert_eq!(all(&promoted), all(&primary), "the promoted Build Index copy answers like the primary");
}
