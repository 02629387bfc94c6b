//! Random operation sequences against a `BTreeMap` model, with small nodes so splits, log merges,
//! node merges and root growth/collapse happen constantly; plus MVCC snapshots held across them.

use std::collections::BTreeMap;
use std::ops::Bound;

use dpukv_storage::{ArenaConfig, BatchOp, Error};
use proptest::prelude::*;

use crate::common::{Rng, must_writer, owned};
use crate::support_model::{batch_ops, model_batch, model_floor_scan, model_scan};

#[derive(Debug, Clone)]
enum Op {
    Put(Vec<u8>, Vec<u8>),
    Insert(Vec<u8>, Vec<u8>),
    Update(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
    Batch(Vec<(u8, Vec<u8>, Vec<u8>)>),
    Get(Vec<u8>),
    Scan(Vec<u8>, Vec<u8>, usize),
    FloorScan(Vec<u8>, Vec<u8>, usize),
    Snapshot,
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => proptest::collection::vec(0u8..4, 1..5).prop_map(|v| v.into_iter().map(|b| b'a' + b).collect()),
        1 => proptest::collection::vec(any::<u8>(), 1..=30),
    ]
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => proptest::collection::vec(any::<u8>(), 0..24),
        1 => proptest::collection::vec(any::<u8>(), 40..600),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (key(), value()).prop_map(|(k, v)| Op::Put(k, v)),
        1 => (key(), value()).prop_map(|(k, v)| Op::Insert(k, v)),
        1 => (key(), value()).prop_map(|(k, v)| Op::Update(k, v)),
        4 => key().prop_map(Op::Delete),
        1 => proptest::collection::vec((0u8..4, key(), value()), 1..6).prop_map(Op::Batch),
        2 => key().prop_map(Op::Get),
        2 => (key(), key(), 0usize..40).prop_map(|(a, b, n)| Op::Scan(a, b, n)),
        1 => (key(), key(), 0usize..40).prop_map(|(a, b, n)| Op::FloorScan(a, b, n)),
        1 => Just(Op::Snapshot),
    ]
}

/// Most snapshots one run holds pinned.
const PINNED: usize = 4;

fn run(ops: Vec<Op>, node_size: u32) -> Result<(), TestCaseError> {
    let cfg = ArenaConfig::small_nodes(node_size);
    let (_dir, _path, mut w) = must_writer(&cfg);
    let mut m: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    // Readers made up front, so snapshots borrowing them can be held across the writes below.
    let mut readers: Vec<_> = (0..PINNED).map(|_| w.reader().expect("reader")).collect();
    let mut free_readers = readers.iter_mut();
    let mut snaps = Vec::new();
    for op in ops {
        match op {
            Op::Put(k, v) => {
                w.put(&k, &v).expect("put");
                m.insert(k, v);
            }
            Op::Insert(k, v) => {
                let r = w.insert(&k, &v);
                if let std::collections::btree_map::Entry::Vacant(e) = m.entry(k) {
                    r.expect("insert");
                    e.insert(v);
                } else {
                    prop_assert!(matches!(r, Err(Error::KeyExists)), "insert of a present key: {r:?}");
                }
            }
            Op::Update(k, v) => {
                let r = w.update(&k, &v);
                if let std::collections::btree_map::Entry::Occupied(mut e) = m.entry(k) {
                    r.expect("update");
                    e.insert(v);
                } else {
                    prop_assert!(matches!(r, Err(Error::KeyNotFound)), "update of an absent key: {r:?}");
                }
            }
            Op::Delete(k) => {
                let r = w.delete(&k).expect("delete");
                prop_assert_eq!(r.is_some(), m.remove(&k).is_some());
            }
            Op::Batch(items) => {
                let ops = batch_ops(&items);
                // Apply to a copy of the model; keep it only if every precondition held.
                let next = model_batch(&m, &items);
                let before = w.version();
                let r = w.write_batch(&ops);
                if let Some(m2) = next {
                    prop_assert_eq!(r.expect("batch"), before + 1, "a batch takes exactly one version");
                    m = m2;
                } else {
                    prop_assert!(r.is_err(), "batch with a failed precondition applied");
                    prop_assert_eq!(w.version(), before);
                }
            }
            Op::Get(k) => prop_assert_eq!(w.get(&k).expect("get"), m.get(&k).map(|v| v.as_slice())),
            Op::Scan(a, b, n) => prop_assert_eq!(owned(w.scan(&a, &b, n).expect("scan")), model_scan(&m, &a, &b, n)),
            Op::FloorScan(a, b, n) => {
                prop_assert_eq!(owned(w.floor_scan(&a, &b, n).expect("floor scan")), model_floor_scan(&m, &a, &b, n))
            }
            Op::Snapshot => {
                // Pin a snapshot with the model as of now; it is compared after every later
                // write (below) and at the end.
                if let Some(r) = free_readers.next() {
                    let s = r.snapshot().expect("snapshot");
                    prop_assert_eq!(s.version(), w.version());
                    snaps.push((s, m.clone()));
                }
            }
        }
        // Every pinned snapshot still sees exactly its version (one key probed per step).
        for (s, at) in &snaps {
            if let Some((k, v)) = at.iter().nth(m.len() % at.len().max(1)) {
                prop_assert_eq!(s.get(k).expect("get"), Some(v.as_slice()), "a pinned snapshot changed");
            }
        }
    }
    // Full-range comparisons: the writer's latest state and every pinned snapshot's.
    let all = owned(w.scan(&[0], &[0xff; 40], usize::MAX).expect("full scan"));
    prop_assert_eq!(all, model_scan(&m, &[0], &[0xff; 40], usize::MAX));
    for (s, at) in &snaps {
        let pinned = owned(s.scan(&[0], &[0xff; 40], usize::MAX).expect("snapshot scan"));
        prop_assert_eq!(pinned, model_scan(at, &[0], &[0xff; 40], usize::MAX), "a pinned snapshot changed");
    }
    drop(snaps);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn model_512(ops in proptest::collection::vec(op(), 1..400)) {
        run(ops, 512)?;
    }

    #[test]
    fn model_1k(ops in proptest::collection::vec(op(), 1..400)) {
        run(ops, 1024)?;
    }
}

/// A long deterministic run: grow to thousands of keys, then delete most of them so leaves and
/// interior nodes merge and the root collapses, checking against the model throughout, while
/// pinned snapshots keep seeing exactly their version.
#[test]
fn grow_shrink_with_pinned_snapshots() {
    let seed = std::env::var("DPUKV_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
    let mut rng = Rng(seed);
    let cfg = ArenaConfig::small_nodes(512);
    let (_dir, _path, mut w) = must_writer(&cfg);
    let mut m: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let key = |i: u64| format!("k{:06}", i).into_bytes();
    for round in 0..3 {
        for _ in 0..4000 {
            let k = key(rng.below(5000));
            let max = if rng.below(10) == 0 { 200 } else { 20 };
            let v = rng.bytes_upto(max);
            w.put(&k, &v).expect("put");
            m.insert(k, v);
        }
        let grown = w.stats();
        assert!(grown.height >= 3, "tree should be at least 3 levels: {grown:?}");
        // Pin a snapshot with its expected contents, across the deletes and the merges.
        let mut r = w.reader().expect("reader");
        let snap = r.snapshot().expect("pin");
        let before = model_scan(&m, b"k", b"l", usize::MAX);
        let keys: Vec<Vec<u8>> = m.keys().cloned().collect();
        for k in keys.iter().filter(|_| rng.below(100) < 97) {
            assert!(w.delete(k).expect("delete").is_some());
            m.remove(k);
        }
        let all = owned(w.scan(b"k", b"l", usize::MAX).expect("scan"));
        assert_eq!(all, model_scan(&m, b"k", b"l", usize::MAX), "round {round}");
        w.reclaim().expect("reclaim under the pinned snapshot");
        assert_eq!(
            owned(snap.scan(b"k", b"l", usize::MAX).expect("scan")),
            before,
            "round {round}: the pinned snapshot"
        );
        drop(snap);
        drop(r);
        // Underfull nodes merge (lazily, when their log is next merged): memory shrinks.
        w.reclaim().expect("reclaim");
        let now = w.stats();
        assert!(now.height <= grown.height, "round {round}: {grown:?} -> {now:?}");
        assert!(now.allocated_bytes * 3 < grown.allocated_bytes, "round {round}: {grown:?} -> {now:?}");
        for (i, k) in keys.iter().enumerate().step_by(37) {
            assert_eq!(w.get(k).expect("get"), m.get(k).map(|v| v.as_slice()), "key {i}");
        }
    }
    // Everything retired is reclaimable once no reader is pinned.
    w.reclaim().expect("reclaim");
    let s = w.stats();
    assert_eq!(s.garbage_bytes, 0, "{s:?}");
    assert!(s.allocated_bytes < 200 * 512, "memory returns after deletes: {s:?}");
}

/// A snapshot pinned before many writes keeps seeing exactly its version while the writer
/// splits, merges and rewrites every node under it.
#[test]
fn pinned_snapshot_is_stable_across_restructuring() {
    let mut rng = Rng(7);
    let cfg = ArenaConfig::small_nodes(512);
    let (_dir, _path, mut w) = must_writer(&cfg);
    let mut m: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for i in 0..2000u64 {
        let k = format!("{:05}", i * 7 % 2000).into_bytes();
        let v = rng.bytes(8);
        w.put(&k, &v).expect("put");
        m.insert(k, v);
    }
    let mut r = w.reader().expect("reader");
    let snap = r.snapshot().expect("snapshot");
    let expected = model_scan(&m, b"0", b"9", usize::MAX);
    for round in 0..4 {
        for i in 0..2000u64 {
            let k = format!("{:05}", (i * 13 + round) % 2600).into_bytes();
            if rng.below(3) == 0 {
                w.delete(&k).expect("delete");
            } else {
                let v = rng.bytes_upto(60);
                w.put(&k, &v).expect("put");
            }
        }
        assert_eq!(owned(snap.scan(b"0", b"9", usize::MAX).expect("scan")), expected, "round {round}");
        assert_eq!(snap.get(b"00007").expect("get"), m.get(b"00007".as_slice()).map(|v| v.as_slice()));
    }
    // The pinned snapshot holds garbage back; once released, it is reclaimed.
    let held = w.stats().garbage_bytes;
    assert!(held > 0);
    drop(snap);
    w.reclaim().expect("reclaim");
    assert_eq!(w.stats().garbage_bytes, 0);
}

#[test]
fn size_limits_are_typed_errors() {
    let cfg = ArenaConfig::default();
    let (_dir, _path, mut w) = must_writer(&ArenaConfig { capacity: 64 << 20, ..cfg });
    assert!(matches!(w.put(b"", b"v"), Err(Error::KeySize { len: 0, .. })));
    assert!(matches!(w.put(&[1; 1025], b"v"), Err(Error::KeySize { len: 1025, .. })));
    w.put(&[1; 1024], b"v").expect("1 KiB key");
    assert!(matches!(w.put(b"k", &vec![0; (1 << 20) + 1]), Err(Error::ValueTooLarge { .. })));
    let big = vec![7u8; 1 << 20];
    w.put(b"big", &big).expect("1 MiB value");
    assert_eq!(w.get(b"big").expect("get"), Some(big.as_slice()));
    w.put(b"empty", b"").expect("empty value");
    assert_eq!(w.get(b"empty").expect("get"), Some(&b""[..]));
    // Filling the arena gives a retryable ArenaFull and changes nothing.
    let mut n = 0;
    let err = loop {
        match w.put(format!("fill{n}").as_bytes(), &big) {
            Ok(_) => n += 1,
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::ArenaFull { .. }) && err.is_retryable(), "{err:?}");
    assert_eq!(w.get(format!("fill{n}").as_bytes()).expect("get"), None);
    assert_eq!(w.get(b"fill0").expect("get").map(|v| v.len()), Some(1 << 20));
    // Deleting frees the space again.
    for i in 0..n {
        w.delete(format!("fill{i}").as_bytes()).expect("delete");
    }
    w.reclaim().expect("reclaim");
    w.put(format!("fill{n}").as_bytes(), &big).expect("space is back");
}

/// Regression (issue 7, item 8): a batch whose blob found no contiguous run on a fragmented heap
/// published its earlier operations under a version the next batch reused, and leaked the blob
/// pages it had taken. A failed batch must change nothing visible and leak nothing.
#[test]
fn a_batch_that_fails_for_room_changes_nothing_and_leaks_nothing() {
    let cfg = ArenaConfig { capacity: 1 << 20, ..ArenaConfig::small_nodes(512) };
    let (_dir, path, mut w) = must_writer(&cfg);
    // Fill the heap with 2-page blobs, then free every other one: plenty of free pages, but no
    // long run of them.
    let big = vec![7u8; 600];
    let mut n = 0u32;
    while w.put(format!("blob{n:05}").as_bytes(), &big).is_ok() {
        n += 1;
    }
    assert!(n > 100, "{n} blobs fit");
    for i in (0..n).step_by(2) {
        w.delete(format!("blob{i:05}").as_bytes()).expect("delete");
    }
    w.reclaim().expect("reclaim");
    let before = w.stats();
    let version = w.version();
    let huge = vec![9u8; 64 << 10];
    let r = w.write_batch(&[BatchOp::Put(b"aaa", b"small"), BatchOp::Put(b"zzz", &huge)]);
    assert!(matches!(r, Err(Error::ArenaFull { .. })), "{r:?}");
    assert_eq!(w.version(), version, "no version taken");
    assert_eq!(w.get(b"aaa").expect("get"), None, "nothing of the batch applied");
    let mut reader = dpukv_storage::Reader::open(&path).expect("reader");
    assert_eq!(reader.snapshot().expect("snapshot").get(b"aaa").expect("get"), None, "nor visible to readers");
    assert_eq!(w.stats().allocated_bytes, before.allocated_bytes, "no page leaked");
    // The next batch gets the next version and works.
    assert_eq!(w.put(b"aaa", b"small").expect("put"), version + 1);
    assert_eq!(w.get(b"aaa").expect("get"), Some(&b"small"[..]));
}

#[test]
fn one_writer_per_arena() {
    let (_dir, path, w) = must_writer(&ArenaConfig::small_nodes(512));
    // A second writer on a live arena is refused; once the first is gone, a new one may replace it.
    let second = dpukv_storage::Writer::create(&path, &ArenaConfig::small_nodes(512));
    assert!(matches!(second, Err(Error::WriterBusy(_))), "{:?}", second.err());
    drop(w);
    let w = dpukv_storage::Writer::create(&path, &ArenaConfig::small_nodes(512)).expect("replace a closed arena");
    // The config validation rejects impossible geometry with a typed error.
    let bad = ArenaConfig { node_size: 1000, ..ArenaConfig::default() };
    assert!(matches!(dpukv_storage::Writer::create(path.with_extension("x"), &bad), Err(Error::Config(_))));
    let bad = ArenaConfig { max_key_len: 1024, ..ArenaConfig::small_nodes(512) };
    assert!(matches!(bad.validate(), Err(Error::Config(_))));
    drop(w);
}

/// Model of an L0 arena: values, external pointers and kept tombstones.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stored {
    Value(Vec<u8>),
    Pointer(u64, u32),
    Tombstone,
}

#[derive(Debug, Clone)]
enum TOp {
    Put(Vec<u8>, Vec<u8>),
    Pointer(Vec<u8>, u64, u32),
    Delete(Vec<u8>),
    Get(Vec<u8>),
    Scan(Vec<u8>, Vec<u8>, usize),
    Floor(Vec<u8>, bool),
}

fn top() -> impl Strategy<Value = TOp> {
    prop_oneof![
        4 => (key(), value()).prop_map(|(k, v)| TOp::Put(k, v)),
        2 => (key(), any::<u64>(), 0u32..=(1 << 20)).prop_map(|(k, p, l)| TOp::Pointer(k, p, l)),
        3 => key().prop_map(TOp::Delete),
        2 => key().prop_map(TOp::Get),
        2 => (key(), key(), 0usize..40).prop_map(|(a, b, n)| TOp::Scan(a, b, n)),
        1 => (key(), any::<bool>()).prop_map(|(k, s)| TOp::Floor(k, s)),
    ]
}

fn stored(e: dpukv_storage::Entry<'_>) -> Stored {
    match e {
        dpukv_storage::Entry::Value(v) => Stored::Value(v.to_vec()),
        dpukv_storage::Entry::Pointer { ptr, len } => Stored::Pointer(ptr, len),
        dpukv_storage::Entry::Tombstone => Stored::Tombstone,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// With `keep_tombstones`, every delete leaves a tombstone that survives log merges, splits
    /// and node merges, and pointers are kept as written.
    #[test]
    fn model_tombstones_and_pointers(ops in proptest::collection::vec(top(), 1..400)) {
        let cfg = ArenaConfig { keep_tombstones: true, ..ArenaConfig::small_nodes(512) };
        let (_dir, _path, mut w) = must_writer(&cfg);
        let mut m: BTreeMap<Vec<u8>, Stored> = BTreeMap::new();
        for op in ops {
            match op {
                TOp::Put(k, v) => {
                    w.put(&k, &v).expect("put");
                    m.insert(k, Stored::Value(v));
                }
                TOp::Pointer(k, p, l) => {
                    let too_big = w.write_batch(&[BatchOp::PutPointer(&k, p, (1 << 20) + 1)]);
                    prop_assert!(matches!(too_big, Err(Error::ValueTooLarge { .. })), "{:?}", too_big);
                    w.write_batch(&[BatchOp::PutPointer(&k, p, l)]).expect("pointer");
                    m.insert(k, Stored::Pointer(p, l));
                }
                TOp::Delete(k) => {
                    prop_assert!(w.delete(&k).expect("delete").is_some(), "a tombstone is always written");
                    m.insert(k, Stored::Tombstone);
                }
                TOp::Get(k) => {
                    prop_assert_eq!(w.get_entry(&k).expect("get").map(stored), m.get(&k).cloned());
                    let plain = w.get(&k);
                    match m.get(&k) {
                        Some(Stored::Value(v)) => prop_assert_eq!(plain.expect("get"), Some(v.as_slice())),
                        None | Some(Stored::Tombstone) => prop_assert_eq!(plain.expect("get"), None),
                        Some(Stored::Pointer(..)) => prop_assert!(plain.is_err(), "get of a pointer value is an error"),
                    }
                }
                TOp::Scan(a, b, n) => {
                    let mut r = w.reader().expect("reader");
                    let s = r.snapshot().expect("snapshot");
                    let mut got = Vec::new();
                    s.scan_entries(&a, &b, n, |k, e| got.push((k.to_vec(), stored(e)))).expect("scan");
                    let want: Vec<(Vec<u8>, Stored)> = if a > b { Vec::new() } else {
                        m.range::<[u8], _>((Bound::Included(a.as_slice()), Bound::Included(b.as_slice()))).take(n).map(|(k, v)| (k.clone(), v.clone())).collect()
                    };
                    prop_assert_eq!(got, want);
                }
                TOp::Floor(k, strict) => {
                    let mut r = w.reader().expect("reader");
                    let s = r.snapshot().expect("snapshot");
                    let got = s.floor_entry(&k, strict).expect("floor").map(|(k, e)| (k.to_vec(), stored(e)));
                    let upper = if strict { Bound::Excluded(k.as_slice()) } else { Bound::Included(k.as_slice()) };
                    let want = m.range::<[u8], _>((Bound::Unbounded, upper)).next_back().map(|(k, v)| (k.clone(), v.clone()));
                    prop_assert_eq!(got, want);
                }
            }
        }
    }
}
