//! A region's snapshot at a backup's cut (docs/backup.md §1): restored into an empty directory,
//! the region holds exactly what it held at the cut — however many compactions and collections
//! ran on the original after it.

use std::collections::BTreeMap;

use dpukv_storage::region::{Region, RegionConfig, RegionSnapshot, RestoreDir};
use dpukv_storage::vlog::FsyncPolicy;

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

fn config(dir: &std::path::Path, name: &str) -> RegionConfig {
    let mut cfg = RegionConfig::tiny(dir.join(name), dir.join(format!("{name}-shm")), FsyncPolicy::Always);
    cfg.l0_budget = 64 << 10;
    cfg.gc_min_garbage = 0.0;
    cfg.vlog.segment_size = 64 << 10;
    cfg
}

/// One round of overwrites and deletes of 300 keys, values of 100–400 bytes (the larger ones
/// live in the log); returns the log segments collected meanwhile.
fn round(r: &mut Region, m: &mut Model, n: u64) -> u64 {
    let mut collected = 0;
    for k in 0..300u64 {
        let key = format!("key{k:04}").into_bytes();
        if (k + n).is_multiple_of(11) {
            r.delete(&key).expect("delete");
            m.remove(&key);
        } else {
            let v = vec![(k + n) as u8; 100 + ((k * 7 + n * 13) % 300) as usize];
            r.put(&key, &v).expect("put");
            m.insert(key, v);
        }
        if k.is_multiple_of(50) {
            collected += r.maintain().expect("maintain").gc.deleted;
        }
    }
    collected
}

fn restore(snap: &RegionSnapshot, dir: &std::path::Path) {
    let rd = RestoreDir::create(dir).expect("an empty directory");
    if let Some(ix) = &snap.index {
        for id in ix.levels.iter().flat_map(|l| l.segments.iter().copied()) {
            rd.level_segment(id, &ix.read_segment(id).expect("level segment")).expect("write");
        }
    }
    for f in &snap.log {
        let bytes = std::fs::read(&f.path).expect("log segment");
        rd.log_segment(f.id, &bytes[..f.len as usize], f.size).expect("write");
    }
    rd.finish(snap.index.as_ref().map(|ix| (&ix.manifest, ix.sessions.as_slice()))).expect("finish");
}

fn contents(r: &Region) -> Model {
    r.scan(b"", b"\xff", usize::MAX).expect("scan").into_iter().collect()
}

#[test]
fn a_region_restored_from_its_snapshot_holds_exactly_what_it_held_at_the_cut() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = Region::open(config(dir.path(), "data")).expect("open").0;
    let mut m = Model::new();
    for n in 0..10 {
        round(&mut r, &mut m, n);
    }
    let snap = r.snapshot().expect("snapshot");
    assert!(snap.index.is_some(), "the levels hold part of the region at the cut");
    assert!(snap.log.len() > 1 && snap.bytes() > 0, "{snap:?}");
    assert_eq!(snap.log.last().map(|f| f.id), Some(snap.cut.segment()));
    let at_cut = m.clone();
    // After the cut: compactions and collections take the files the snapshot pinned.
    let mut collected = 0;
    for n in 10..40 {
        collected += round(&mut r, &mut m, n);
    }
    assert!(collected > 0, "no log segment was collected after the cut");
    assert_ne!(contents(&r), at_cut, "the writes after the cut changed the region");
    restore(&snap, &dir.path().join("restored"));
    let restored = Region::open(config(dir.path(), "restored")).expect("open the restored region").0;
    assert_eq!(contents(&restored), at_cut, "exactly the region at the cut");
    drop(restored);
    let e = RestoreDir::create(dir.path().join("restored")).expect_err("a region is there");
    assert!(e.to_string().contains("already holds a region"), "{e}");
    // The original goes on, whole.
    assert_eq!(contents(&r), m);
}

/// A region never compacted: the snapshot is its log alone, cut at the cut.
#[test]
fn a_snapshot_of_a_region_never_compacted_is_its_log_up_to_the_cut() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut r = Region::open(config(dir.path(), "data")).expect("open").0;
    r.put(b"a", b"1").expect("put");
    r.put(b"b", &[7u8; 300]).expect("put");
    let snap = r.snapshot().expect("snapshot");
    assert!(snap.index.is_none());
    r.put(b"c", b"3").expect("put after the cut");
    r.delete(b"a").expect("delete after the cut");
    restore(&snap, &dir.path().join("restored"));
    let restored = Region::open(config(dir.path(), "restored")).expect("open").0;
    let want: Model = [(b"a".to_vec(), b"1".to_vec()), (b"b".to_vec(), vec![7u8; 300])].into_iter().collect();
    assert_eq!(contents(&restored), want);
}
