//! Level segments and the manifest: built levels answer like a sorted map; corruption is
//! reported with the file; the manifest round-trips and is replaced atomically.

use std::collections::BTreeMap;
use std::ops::Bound;

use dpukv_storage::levels::{Level, LevelBuilder, Manifest};
use dpukv_storage::{Entry, Error};
use proptest::prelude::*;

#[derive(Debug, Clone, PartialEq)]
enum V {
    Inline(Vec<u8>),
    Ptr(u64, u32),
    Tomb,
}

fn entry(v: &V) -> Entry<'_> {
    match v {
        V::Inline(b) => Entry::Value(b),
        V::Ptr(p, l) => Entry::Pointer { ptr: *p, len: *l },
        V::Tomb => Entry::Tombstone,
    }
}

fn owned(e: Entry<'_>) -> V {
    match e {
        Entry::Value(b) => V::Inline(b.to_vec()),
        Entry::Pointer { ptr, len } => V::Ptr(ptr, len),
        Entry::Tombstone => V::Tomb,
    }
}

fn must_build(dir: &std::path::Path, m: &BTreeMap<Vec<u8>, (u64, V)>) -> Level {
    let mut b = LevelBuilder::new(dpukv_storage::fs::real(), dir, 1, 512, 4096).expect("builder");
    for (k, (ver, v)) in m {
        b.add(k, *ver, &entry(v)).expect("add");
    }
    let meta = b.finish(1).expect("finish");
    assert_eq!(meta.entries, m.len() as u64);
    Level::open(dir, meta).expect("open level")
}

fn value() -> impl Strategy<Value = V> {
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..60).prop_map(V::Inline),
        2 => (any::<u64>(), any::<u32>()).prop_map(|(p, l)| V::Ptr(p, l)),
        1 => Just(V::Tomb),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn level_answers_like_a_sorted_map(
        m in proptest::collection::btree_map(proptest::collection::vec(0u8..8, 1..10), (any::<u64>(), value()), 0..600),
        probes in proptest::collection::vec(proptest::collection::vec(0u8..8, 1..10), 1..40),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let level = must_build(dir.path(), &m);
        for p in &probes {
            prop_assert_eq!(level.get(p).expect("get").map(|(v, e)| (v, owned(e))), m.get(p).cloned());
            let mut got = Vec::new();
            level.scan_from(p, |k, v, e| { got.push((k.to_vec(), (v, owned(e)))); Ok(got.len() < 25) }).expect("scan");
            let want: Vec<_> = m.range::<[u8], _>((Bound::Included(p.as_slice()), Bound::Unbounded)).take(25).map(|(k, v)| (k.clone(), v.clone())).collect();
            prop_assert_eq!(got, want);
            for strict in [false, true] {
                let upper = if strict { Bound::Excluded(p.as_slice()) } else { Bound::Included(p.as_slice()) };
                let want = m.range::<[u8], _>((Bound::Unbounded, upper)).next_back().map(|(k, v)| (k.clone(), v.clone()));
                let got = level.floor(p, strict).expect("floor").map(|(k, v, e)| (k.to_vec(), (v, owned(e))));
                prop_assert_eq!(got, want);
            }
        }
    }
}

#[test]
fn corrupt_segment_is_reported_with_its_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m: BTreeMap<Vec<u8>, (u64, V)> =
        (0..500u32).map(|i| (format!("k{i:05}").into_bytes(), (i as u64, V::Inline(vec![i as u8; 20])))).collect();
    let meta = {
        let level = must_build(dir.path(), &m);
        level.meta().clone()
    };
    assert!(meta.segments.len() > 2 && meta.height >= 2, "{meta:?}");
    let seg = dir.path().join(format!("{:016}.seg", meta.segments[1]));
    let orig = std::fs::read(&seg).expect("read");
    for at in [0usize, 10, 30, 600, orig.len() - 1] {
        let mut b = orig.clone();
        b[at] ^= 0x40;
        std::fs::write(&seg, &b).expect("write");
        match Level::open(dir.path(), meta.clone()) {
            Err(Error::CorruptFile { path, .. }) => assert_eq!(path, seg),
            other => panic!("flip at {at}: {other:?}"),
        }
    }
    std::fs::write(&seg, &orig[..orig.len() - 512]).expect("truncate");
    assert!(matches!(Level::open(dir.path(), meta.clone()), Err(Error::CorruptFile { .. })));
    std::fs::write(&seg, &orig).expect("restore");
    Level::open(dir.path(), meta).expect("intact level opens");
}

#[test]
fn manifest_round_trips_and_detects_corruption() {
    let dir = tempfile::tempdir().expect("tempdir");
    assert_eq!(Manifest::load(dir.path()).expect("load"), None);
    let m: BTreeMap<Vec<u8>, (u64, V)> =
        (0..50u32).map(|i| (vec![i as u8 + 1], (i as u64, V::Ptr(i as u64, 3)))).collect();
    let level = must_build(dir.path(), &m);
    let man =
        Manifest { generation: 3, levels: vec![level.meta().clone()], log_start: 77, next_segment: 9, max_version: 49 };
    man.store(&dpukv_storage::fs::RealFs, dir.path()).expect("store");
    assert_eq!(Manifest::load(dir.path()).expect("load"), Some(man.clone()));
    let p = dir.path().join("MANIFEST");
    let b = std::fs::read(&p).expect("read");
    for at in 0..b.len() {
        let mut c = b.clone();
        c[at] ^= 1;
        std::fs::write(&p, &c).expect("write");
        assert!(matches!(Manifest::load(dir.path()), Err(Error::CorruptFile { .. })), "flip at {at}");
    }
    std::fs::write(&p, &b[..b.len() - 3]).expect("truncate");
    assert!(matches!(Manifest::load(dir.path()), Err(Error::CorruptFile { .. })));
}
