//! The region store against a `BTreeMap` model, across many flushes, compactions and reopens.
#![allow(clippy::map_entry)] // the model reads clearer with explicit checks

use std::collections::BTreeMap;

use dpukv_storage::region::{Region, RegionConfig, RegionReader};
use dpukv_storage::vlog::{FsyncPolicy, VlogConfig};
use dpukv_storage::{ArenaConfig, BatchOp, Error};
use proptest::prelude::*;

use crate::support_model::{Model, batch_ops, model_batch, model_floor_scan, model_scan};

pub fn small_config(dir: &std::path::Path) -> RegionConfig {
    RegionConfig {
        arena: ArenaConfig { capacity: 8 << 20, ..ArenaConfig::small_nodes(512) },
        vlog: VlogConfig { segment_size: 16384, fsync: FsyncPolicy::Never, ..VlogConfig::default() },
        l0_budget: 8 << 10,
        growth_factor: 3,
        level_node_size: 512,
        level_segment_size: 4096,
        ..RegionConfig::new(dir.join("data"), dir.join("shm"))
    }
}

/// A batch's (op, key, value) items: op 0 put, 1 insert, 2 update, 3 delete.
type Items = Vec<(u8, Vec<u8>, Vec<u8>)>;

#[derive(Debug, Clone)]
enum Op {
    Put(Vec<u8>, Vec<u8>),
    Insert(Vec<u8>, Vec<u8>),
    Update(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
    Batch(Items),
    Group(Vec<Items>),
    Get(Vec<u8>),
    Scan(Vec<u8>, Vec<u8>, usize),
    FloorScan(Vec<u8>, Vec<u8>, usize),
    Flush,
    Reopen,
    Gc,
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => proptest::collection::vec(0u8..4, 1..5).prop_map(|v| v.into_iter().map(|b| b'a' + b).collect()),
        1 => proptest::collection::vec(any::<u8>(), 1..=30),
    ]
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..30),
        1 => proptest::collection::vec(any::<u8>(), 41..500),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (key(), value()).prop_map(|(k, v)| Op::Put(k, v)),
        1 => (key(), value()).prop_map(|(k, v)| Op::Insert(k, v)),
        1 => (key(), value()).prop_map(|(k, v)| Op::Update(k, v)),
        4 => key().prop_map(Op::Delete),
        1 => proptest::collection::vec((0u8..4, key(), value()), 1..6).prop_map(Op::Batch),
        1 => proptest::collection::vec(proptest::collection::vec((0u8..4, key(), value()), 1..4), 1..5).prop_map(Op::Group),
        2 => key().prop_map(Op::Get),
        2 => (key(), key(), 0usize..30).prop_map(|(a, b, n)| Op::Scan(a, b, n)),
        1 => (key(), key(), 0usize..30).prop_map(|(a, b, n)| Op::FloorScan(a, b, n)),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
        2 => Just(Op::Gc),
    ]
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(dir.path());
    let mut r = Region::open(cfg.clone()).expect("open").0;
    let mut m: Model = BTreeMap::new();
    for op in ops {
        match op {
            Op::Put(k, v) => {
                r.put(&k, &v).expect("put");
                m.insert(k, v);
            }
            Op::Insert(k, v) => {
                let res = r.write_batch(&[BatchOp::Insert(&k, &v)]);
                if m.contains_key(&k) {
                    prop_assert!(matches!(res, Err(Error::KeyExists)), "{res:?}");
                } else {
                    res.expect("insert");
                    m.insert(k, v);
                }
            }
            Op::Update(k, v) => {
                let res = r.write_batch(&[BatchOp::Update(&k, &v)]);
                if m.contains_key(&k) {
                    res.expect("update");
                    m.insert(k, v);
                } else {
                    prop_assert!(matches!(res, Err(Error::KeyNotFound)), "{res:?}");
                }
            }
            Op::Delete(k) => {
                r.delete(&k).expect("delete");
                m.remove(&k);
            }
            Op::Batch(items) => {
                let ops = batch_ops(&items);
                let next = model_batch(&m, &items);
                let res = r.write_batch(&ops);
                if let Some(m2) = next {
                    res.expect("batch");
                    m = m2;
                } else {
                    prop_assert!(res.is_err());
                }
            }
            Op::Group(batches) => {
                let owned: Vec<Vec<BatchOp>> = batches.iter().map(|items| batch_ops(items)).collect();
                let refs: Vec<&[BatchOp]> = owned.iter().map(Vec::as_slice).collect();
                let before = r.version();
                let results = r.write_group(&refs);
                prop_assert_eq!(results.len(), batches.len());
                let mut next_version = before;
                for (items, res) in batches.iter().zip(results) {
                    match model_batch(&m, items) {
                        Some(m2) => {
                            next_version += 1;
                            prop_assert_eq!(res.expect("batch of a group").version, next_version);
                            m = m2;
                        }
                        None => prop_assert!(res.is_err(), "a batch whose precondition fails is skipped"),
                    }
                }
            }
            Op::Get(k) => prop_assert_eq!(r.get(&k).expect("get"), m.get(&k).cloned()),
            Op::Scan(a, b, n) => prop_assert_eq!(r.scan(&a, &b, n).expect("scan"), model_scan(&m, &a, &b, n)),
            Op::FloorScan(a, b, n) => {
                prop_assert_eq!(r.floor_scan(&a, &b, n).expect("floor scan"), model_floor_scan(&m, &a, &b, n))
            }
            Op::Flush => r.flush_now().expect("flush"),
            Op::Gc => {
                r.gc_step(16).expect("gc step");
            }
            Op::Reopen => {
                drop(r);
                r = Region::open(cfg.clone()).expect("reopen").0;
            }
        }
    }
    let all = r.scan(&[], &[0xff; 40], usize::MAX).expect("scan");
    prop_assert_eq!(&all, &model_scan(&m, &[], &[0xff; 40], usize::MAX));
    // A reader in another thread (as the device would be) sees the same.
    let mut reader = RegionReader::open(dir.path().join("shm")).expect("reader");
    prop_assert_eq!(reader.scan(&[], &[0xff; 40], usize::MAX).expect("reader scan"), all);
    drop(r);
    let r = Region::open(cfg).expect("final reopen").0;
    prop_assert_eq!(r.scan(&[], &[0xff; 40], usize::MAX).expect("scan"), model_scan(&m, &[], &[0xff; 40], usize::MAX));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn region_matches_model(ops in proptest::collection::vec(op(), 1..300)) {
        run(ops)?;
    }
}

#[test]
fn many_compactions_keep_every_key() {
    for background in [true, false] {
        many_compactions(background);
    }
}

fn many_compactions(background: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = RegionConfig { background_compaction: background, ..small_config(dir.path()) };
    let mut r = Region::open(cfg.clone()).expect("open").0;
    let mut m: Model = BTreeMap::new();
    let mut x = 1u64;
    for i in 0..6000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = format!("key{:05}", x % 3000).into_bytes();
        if i % 7 == 3 {
            r.delete(&k).expect("delete");
            m.remove(&k);
        } else {
            let v = vec![(i % 251) as u8; (x % 120) as usize];
            r.put(&k, &v).expect("put");
            m.insert(k, v);
        }
    }
    let s = r.stats();
    assert!(s.flushes > 20 && s.compactions > 3, "{s:?}");
    assert!(r.manifest().levels.len() >= 2, "{:?}", r.manifest());
    assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
    let log_start = r.manifest().log_start;
    drop(r);
    let (r, rec) = Region::open(cfg).expect("reopen");
    assert!(log_start > 0, "compactions moved the log start");
    assert!(r.manifest().log_start >= log_start, "the manifest survives the reopen (a compaction may finish on close)");
    // Recovery replays only the tail the levels do not cover, not the history.
    assert!(rec.replayed < 1000, "replayed {} of 6000 writes", rec.replayed);
    assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
}

/// Value-log garbage collection: after many overwrites of large values, collecting in bounded
/// steps deletes segments and every value stays readable, also after reopening.
#[test]
fn gc_reclaims_dead_values_and_keeps_live_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(dir.path());
    let mut r = Region::open(cfg.clone()).expect("open").0;
    let mut m: Model = BTreeMap::new();
    for round in 0..12u64 {
        for i in 0..120u64 {
            let k = format!("big{i:04}").into_bytes();
            let v = vec![(i + round) as u8; 100 + (i as usize % 50)];
            r.put(&k, &v).expect("put");
            m.insert(k, v);
        }
    }
    r.flush_now().expect("flush");
    let before = r.vlog().disk_bytes();
    let segments_before = r.vlog().segments().len();
    let mut steps = 0;
    let (mut deleted, mut relocated) = (0, 0);
    loop {
        let s = r.gc_step(64).expect("gc step");
        deleted += s.deleted;
        relocated += s.relocated;
        steps += 1;
        // Every value stays readable between steps.
        if steps % 5 == 0 {
            assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
        }
        if !s.more {
            break;
        }
        assert!(steps < 1000, "garbage collection did not finish");
    }
    let after = r.vlog().disk_bytes();
    assert!(deleted > 0 && relocated > 0, "deleted {deleted}, relocated {relocated}");
    assert!(
        after * 2 < before,
        "the log should shrink: {before} -> {after} bytes ({segments_before} -> {} segments)",
        r.vlog().segments().len()
    );
    assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
    drop(r);
    let r = Region::open(cfg).expect("reopen").0;
    assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
}

/// Regression (issue 7, item 3): when L0 filled up while a batch was applied — here during
/// replay into a smaller arena — the frozen L0 claimed to cover the whole log, so the compaction's
/// manifest skipped the batches that went into the next L0, and the next restart lost them.
#[test]
fn a_freeze_when_l0_fills_covers_only_what_that_l0_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = |capacity: u64| {
        let mut c = small_config(dir.path());
        c.arena.capacity = capacity;
        c.l0_budget = u64::MAX; // only a full arena freezes
        c
    };
    let mut m: Model = BTreeMap::new();
    let mut r = Region::open(cfg(64 << 20)).expect("open").0;
    let mut x = 7u64;
    for i in 0..30_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = format!("key{:05}", x % 20_000).into_bytes();
        let v = vec![(i % 251) as u8; 8 + (x % 30) as usize];
        r.put(&k, &v).expect("put");
        m.insert(k, v);
    }
    assert_eq!(r.stats().flushes, 0, "everything stays in the log and one L0");
    drop(r);
    // Replay into an arena too small for all of it: L0 fills and freezes mid-replay.
    let (r, _) = Region::open(cfg(1 << 20)).expect("reopen small");
    assert!(r.stats().flushes > 0, "the replay froze a full L0");
    drop(r);
    let (r, _) = Region::open(cfg(1 << 20)).expect("reopen again");
    assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// Issue 7, item 5: garbage collection runs in the background (`Region::maintain`) and keeps
/// the log's disk use bounded under a steady overwrite workload; without it the log grows with
/// every write. Values are above the inline threshold, so they live in the log.
#[test]
fn disk_use_stays_bounded_under_steady_overwrites() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = small_config(dir.path());
    cfg.l0_budget = 64 << 10;
    let data = cfg.dir.clone();
    let mut r = Region::open(cfg.clone()).expect("open").0;
    // A device reader maps log segments as it reads: collected segments must not stay mapped
    // (a deleted file's blocks stay allocated while it is mapped).
    let mut device = RegionReader::open_device(&cfg.shm_dir).expect("device reader");
    let mut m: Model = BTreeMap::new();
    let (keys, rounds) = (200u64, 150u64);
    let mut peak_late = 0;
    let mut collected = 0;
    let mut most_deleted_mapped = 0;
    for round in 0..rounds {
        for k in 0..keys {
            let key = format!("key{k:04}").into_bytes();
            let v = vec![(round + k) as u8; 200];
            r.put(&key, &v).expect("put");
            m.insert(key, v);
            if k % 50 == 0 {
                let step = r.maintain().expect("maintain");
                collected += step.gc.deleted;
                let probe = format!("key{:04}", (k + round * 7) % keys).into_bytes();
                device.get(&probe).expect("device get");
                most_deleted_mapped = most_deleted_mapped.max(deleted_mappings_under(&data));
            }
        }
        if round >= rounds / 2 {
            peak_late = peak_late.max(dir_bytes(&data.join("vlog")) + dir_bytes(&data.join("levels")));
        }
    }
    let written = keys * rounds * 230;
    eprintln!("peak {peak_late} B on disk over the second half; {collected} segments collected; {written} B written");
    let live = keys * 230;
    assert!(collected > 10, "{collected} segments collected");
    assert!(most_deleted_mapped <= 2, "up to {most_deleted_mapped} deleted files stayed mapped");
    assert!(
        peak_late < 40 * live && peak_late * 10 < written,
        "disk use should stay bounded: peak {peak_late} B over the second half, {live} B live, {written} B written"
    );
    assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
    drop(r);
    let r = Region::open(cfg).expect("reopen").0;
    assert_eq!(r.scan(b"", b"\xff", usize::MAX).expect("scan"), model_scan(&m, b"", b"\xff", usize::MAX));
}

/// Mappings in this process of files under `dir` that have been deleted.
fn deleted_mappings_under(dir: &std::path::Path) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    let dir = dir.canonicalize().expect("canonical path");
    let dir = dir.to_string_lossy();
    let mut files: Vec<&str> = maps.lines().filter(|l| l.contains(dir.as_ref()) && l.ends_with("(deleted)")).collect();
    files.sort_by_key(|l| l.split_whitespace().nth(5));
    files.dedup_by_key(|l| l.split_whitespace().nth(5));
    files.len()
}

/// Regression: a torn write that kept a valid prefix of a batch (records without the batch-end
/// one) was dropped by replay but left in the log, and the next writes followed it — so the next
/// restart found "records of one batch carry different versions" and the region would not open.
#[test]
fn a_torn_partial_batch_is_cut_so_later_writes_survive_the_next_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(dir.path());
    let mut r = Region::open(cfg.clone()).expect("open").0;
    r.put(b"before", b"1").expect("put");
    let ack =
        r.write_batch(&[BatchOp::Put(b"a", b"x"), BatchOp::Put(b"b", b"y"), BatchOp::Put(b"c", b"z")]).expect("batch");
    let end = ack.end;
    drop(r);
    // Tear the batch's last record: the first two stay valid, the batch-end one does not.
    let seg = cfg.dir.join("vlog").join(format!("{:016}.vlog", end.segment()));
    let mut bytes = std::fs::read(&seg).expect("read");
    let last = end.offset() as usize - 1;
    bytes[last - 3] ^= 0xff;
    std::fs::write(&seg, &bytes).expect("write");
    let (mut r, rec) = Region::open(cfg.clone()).expect("recover");
    assert_eq!(rec.dropped, 2, "the batch's surviving records are dropped: {rec:?}");
    assert_eq!(r.get(b"a").expect("get"), None, "nothing of the torn batch is visible");
    r.put(b"after", b"2").expect("put after recovery");
    drop(r);
    let (r, _) = Region::open(cfg).expect("the next restart opens");
    assert_eq!(r.get(b"before").expect("get"), Some(b"1".to_vec()));
    assert_eq!(r.get(b"after").expect("get"), Some(b"2".to_vec()));
    assert_eq!(r.get(b"b").expect("get"), None);
}

/// One owner per region: a second open of the same directory (another host started by mistake)
/// is refused while the first is open, before it touches anything; once closed, it opens.
#[test]
fn a_region_has_one_owner() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(dir.path());
    let mut r = Region::open(cfg.clone()).expect("open").0;
    r.put(b"k", b"v").expect("put");
    let second = Region::open(RegionConfig { shm_dir: dir.path().join("other-shm"), ..cfg.clone() });
    assert!(matches!(second, Err(Error::RegionBusy(_))), "{:?}", second.err());
    assert_eq!(r.get(b"k").expect("get"), Some(b"v".to_vec()), "the owner is untouched");
    r.put(b"k2", b"v2").expect("the owner still writes");
    drop(r);
    let r = Region::open(cfg).expect("reopen once closed").0;
    assert_eq!(r.get(b"k2").expect("get"), Some(b"v2".to_vec()));
}

/// What a split needs from a region: a middle key that halves its data by bytes (never its first
/// key; none with one key), a size estimate that follows the data through flushes and
/// compactions (small values in L0, large ones in the log, both in levels), key-only scans that
/// skip deleted keys, and every exactly-once entry for the new region.
#[test]
fn a_region_tells_its_middle_key_its_size_and_its_sessions() {
    use dpukv_storage::region::SessionEntry;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = RegionConfig::tiny(dir.path().join("r"), dir.path().join("shm"), FsyncPolicy::Never);
    cfg.l0_budget = 1 << 20; // everything stays in L0 first
    let (mut r, _) = Region::open(cfg).expect("open");
    let middle = |r: &Region, lo: &[u8], hi: &[u8]| {
        let m = r.middle_key(lo, hi).expect("middle");
        (m.live_bytes, m.key)
    };
    assert_eq!(r.middle_key(b"", b"").expect("middle").live_keys, 0);
    assert_eq!(middle(&r, b"", b""), (0, None), "empty");
    r.put(b"a", b"1").expect("put");
    assert_eq!(middle(&r, b"", b""), (2, None), "one key cannot split");
    let small = r.estimated_bytes();
    // 100 keys of 600-byte values (above the inline threshold: their bytes are in the log).
    for i in 0..100u32 {
        r.put(format!("k{i:03}").as_bytes(), &[b'v'; 600]).expect("put");
    }
    let l0 = r.estimated_bytes();
    assert!(l0 >= small + 100 * 600, "L0's log values count: {small} -> {l0}");
    assert_eq!(r.middle_key(b"", b"").expect("middle").live_keys, 101);
    let (live, m) = middle(&r, b"", b"");
    let m = m.expect("a middle key");
    assert_eq!(live, 2 + 100 * (4 + 600), "live bytes: keys and values");
    assert!(
        m.as_slice() >= b"k045".as_slice() && m.as_slice() <= b"k055".as_slice(),
        "{:?}",
        String::from_utf8_lossy(&m)
    );
    // Within a range: only its keys count (a split's source still holding the half it gave away).
    let (live, m) = middle(&r, b"k", b"k049");
    assert_eq!(live, 50 * (4 + 600));
    let m = m.expect("a middle key in the range");
    assert!(
        m.as_slice() >= b"k020".as_slice() && m.as_slice() <= b"k030".as_slice(),
        "{:?}",
        String::from_utf8_lossy(&m)
    );
    // Deleted keys are skipped by key scans and do not pull the middle.
    r.write_batch(
        &(0..50u32)
            .map(|i| format!("k{i:03}").into_bytes())
            .collect::<Vec<_>>()
            .iter()
            .map(|k| BatchOp::Delete(k))
            .collect::<Vec<_>>(),
    )
    .expect("deletes");
    let keys = r.scan_keys(b"k", b"k~", 1000).expect("keys");
    assert_eq!(keys.len(), 50);
    assert_eq!(keys[0], b"k050".to_vec());
    assert_eq!(r.middle_key(b"", b"").expect("middle").live_keys, 51, "deleted keys are not live");
    let (live, m) = middle(&r, b"", b"");
    assert_eq!(live, 2 + 50 * (4 + 600), "deleted keys are not live");
    let m = m.expect("a middle key");
    assert!(
        m.as_slice() >= b"k070".as_slice() && m.as_slice() <= b"k080".as_slice(),
        "{:?}",
        String::from_utf8_lossy(&m)
    );
    // Through flushes and compactions, the estimate stays in the data's order of magnitude.
    r.flush_now().expect("flush");
    let levels = r.estimated_bytes();
    assert!((50 * 600..20 * 100 * 600).contains(&levels), "after a flush: {levels}");
    // Sessions: every entry, for every client.
    let entries = |c: u64, s: u64| SessionEntry { client: c, seq: s, reply: vec![c as u8] };
    let ops = [BatchOp::Put(b"x", b"1")];
    r.write_group_tagged(&[(&ops, &[entries(7, 1), entries(9, 4)])]).pop().expect("one").expect("write");
    r.write_group_tagged(&[(&ops, &[entries(7, 2)])]).pop().expect("one").expect("write");
    assert_eq!(r.sessions().entries(), vec![entries(7, 1), entries(7, 2), entries(9, 4)]);
}

/// Checks pivots of `(lo, hi)`: ascending, unique, strictly inside, at most `want`, and cutting
/// the keys of `keys` in range into parts none of which holds more than `slack` times its share.
fn check_pivots(pivots: &[Vec<u8>], keys: &[Vec<u8>], lo: &[u8], hi: &[u8], want: usize, slack: usize) {
    assert!(pivots.len() <= want, "{} pivots for {want}", pivots.len());
    assert!(pivots.windows(2).all(|w| w[0] < w[1]), "ascending and unique");
    assert!(pivots.iter().all(|p| p.as_slice() > lo && p.as_slice() < hi), "inside the range");
    let inside: Vec<&Vec<u8>> = keys.iter().filter(|k| k.as_slice() >= lo && k.as_slice() < hi).collect();
    let mut parts = vec![0usize; pivots.len() + 1];
    for k in &inside {
        parts[pivots.partition_point(|p| p <= *k)] += 1;
    }
    let share = inside.len() / parts.len();
    assert!(parts.iter().all(|&n| n <= slack * share.max(1)), "parts {parts:?} for {} keys", inside.len());
}

/// Pivots cut a range into parts of similar size from interior nodes only: in L0 (a tree of
/// 512-byte nodes) and once the keys were compacted into levels, through the region and through
/// a reader of its shared memory (what the device asks); a small range gets few or none.
#[test]
fn pivots_cut_a_range_into_similar_parts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = small_config(dir.path());
    cfg.l0_budget = 4 << 20; // all in L0 first
    let mut r = Region::open(cfg.clone()).expect("open").0;
    let keys: Vec<Vec<u8>> = (0..20_000u32).map(|i| format!("key{i:06}").into_bytes()).collect();
    for k in &keys {
        r.put(k, b"value-of-twenty-bytes").expect("put");
    }
    let (lo, hi) = (b"key002000".as_slice(), b"key018000".as_slice());
    let p = r.pivots(lo, hi, 16).expect("pivots");
    assert!(p.len() >= 8, "a 16,000-key range of a 20,000-key tree has pivots: {}", p.len());
    check_pivots(&p, &keys, lo, hi, 16, 3);
    assert!(r.pivots(b"key000010", b"key000012", 16).expect("pivots").is_empty(), "two keys: nothing to cut");
    assert!(r.pivots(lo, hi, 0).expect("pivots").is_empty());
    let mut reader = RegionReader::open(&cfg.shm_dir).expect("reader");
    check_pivots(&reader.pivots(lo, hi, 16).expect("pivots"), &keys, lo, hi, 16, 3);
    // Unbounded above.
    check_pivots(&r.pivots(b"key010000", b"", 8).expect("pivots"), &keys, b"key010000", b"\xff", 8, 3);
    drop(reader);
    drop(r);
    // The same keys in levels (small L0: flushes and compactions).
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(dir.path());
    let mut r = Region::open(cfg.clone()).expect("open").0;
    for k in &keys {
        r.put(k, b"value-of-twenty-bytes").expect("put");
    }
    assert!(!r.manifest().levels.is_empty(), "compacted into levels");
    let p = r.pivots(lo, hi, 16).expect("pivots");
    assert!(p.len() >= 8, "{}", p.len());
    check_pivots(&p, &keys, lo, hi, 16, 3);
    let mut reader = RegionReader::open_device(&cfg.shm_dir).expect("device reader");
    check_pivots(&reader.pivots(lo, hi, 16).expect("pivots"), &keys, lo, hi, 16, 3);
}
