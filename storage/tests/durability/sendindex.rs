//! Send Index and Build Index: a backup fed the primary's log segments and its shipped compaction
//! outputs answers every get and scan exactly as the primary does; so does a backup that builds
//! its own index from the same log.

use std::collections::BTreeMap;

use dpukv_storage::BatchOp;
use dpukv_storage::region::{Backup, Region, RegionConfig};
use dpukv_storage::vlog::FsyncPolicy;
use proptest::prelude::*;

fn cfg(dir: &std::path::Path, name: &str) -> RegionConfig {
    RegionConfig::tiny(dir.join(name), dir.join(format!("{name}-shm")), FsyncPolicy::Never)
}

fn must_ship(primary: &mut Region, backup: &mut Backup) {
    for (id, bytes) in primary.log_segments().expect("log segments") {
        backup.receive_log_segment(id, &bytes).expect("receive log");
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
    ]
}

fn key(k: u8) -> Vec<u8> {
    format!("key{:03}", k % 200).into_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn backup_answers_like_the_primary(ops in proptest::collection::vec(op(), 1..250)) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut primary = Region::open(cfg(dir.path(), "primary")).expect("primary").0;
        primary.capture_exports();
        let mut backup = Backup::create(dir.path().join("backup")).expect("backup");
        let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let mut promotions = 0;
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
                Op::Ship => must_ship(&mut primary, &mut backup),
                Op::Promote => {
                    // Promote a copy of the backup: it replays the log tail its levels do not cover.
                    must_ship(&mut primary, &mut backup);
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
        must_ship(&mut primary, &mut backup);
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
    let (meta, segments) = exports.iter().flat_map(|e| e.levels.iter()).next().expect("a shipped level").clone();
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
        let mut export = exports[0].clone();
        let mut shipped = segments.clone();
        shipped[0] = (seg_id, bad);
        export.levels = vec![(meta.clone(), shipped)];
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backup.apply_send_index(&export)));
        match out {
            Ok(Err(_)) => refused += 1,
            Ok(Ok(_)) => {} // the lie landed where nothing reads it
            Err(_) => panic!("a crafted segment (round {round}, byte {at}) panicked the backup"),
        }
    }
    assert!(refused > 100, "only {refused} of 400 crafted segments were refused");
}
