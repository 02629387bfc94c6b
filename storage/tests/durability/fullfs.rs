//! A real full disk: the region's files on a small tmpfs (root mounts it; the test is skipped
//! when it cannot, except under `CI`, where it must run). Writes on a full disk get a typed,
//! retryable error and change nothing; once the file system grows (`mount -o remount,size=`) the
//! same region takes writes again, without a restart, and every acknowledged write is there. An
//! arena on a full tmpfs gives `ArenaFull`, not SIGBUS.

use dpukv_storage::region::{Region, RegionConfig};
use dpukv_storage::vlog::FsyncPolicy;
use dpukv_storage::{ArenaConfig, Error, Writer};

use crate::support_tmpfs::Tmpfs;

#[test]
fn a_full_disk_refuses_writes_cleanly_and_takes_them_again_once_it_grows() {
    let Some(fs) = Tmpfs::mount(1 << 20) else { return };
    let shm = tempfile::tempdir().expect("tempdir");
    let cfg = RegionConfig::tiny(fs.path().join("data"), shm.path(), FsyncPolicy::Always);
    let mut r = Region::open(cfg.clone()).expect("open").0;
    let mut acked = Vec::new();
    let mut refused = 0;
    let value = vec![5u8; 200];
    for i in 0..20_000u64 {
        let k = format!("key{i:06}");
        match r.put(k.as_bytes(), &value) {
            Ok(ack) => {
                r.wait_durable(ack.end).expect("a written batch becomes durable");
                acked.push(k);
            }
            Err(e) => {
                assert!(
                    matches!(e, Error::NoSpace { .. } | Error::ArenaFull { .. }),
                    "a full disk is a typed error: {e}"
                );
                assert!(e.is_retryable() && !e.outcome_unknown(), "{e}: retry later, nothing was written");
                assert_eq!(r.get(k.as_bytes()).expect("get"), None, "a refused write changed nothing");
                refused += 1;
                if refused > 20 {
                    break;
                }
            }
        }
    }
    assert!(refused > 0 && acked.len() > 100, "{} acknowledged before the disk filled, {refused} refused", acked.len());
    // More space: the same region takes writes again by itself.
    fs.resize(64 << 20);
    for i in 0..500u64 {
        let k = format!("more{i:06}");
        let ack = r.put(k.as_bytes(), &value).unwrap_or_else(|e| panic!("write {i} after the disk grew: {e}"));
        r.wait_durable(ack.end).expect("durable");
        acked.push(k);
    }
    for k in &acked {
        assert_eq!(r.get(k.as_bytes()).expect("get").as_deref(), Some(value.as_slice()), "{k}");
    }
    drop(r);
    let r = Region::open(cfg).expect("reopen").0;
    for k in &acked {
        assert_eq!(r.get(k.as_bytes()).expect("get").as_deref(), Some(value.as_slice()), "{k} after a restart");
    }
}

#[test]
fn an_arena_on_a_full_tmpfs_is_arena_full_not_sigbus() {
    let Some(fs) = Tmpfs::mount(2 << 20) else { return };
    // The arena's capacity is far beyond what the tmpfs holds (the file is sparse).
    let cfg = ArenaConfig { capacity: 64 << 20, ..ArenaConfig::small_nodes(512) };
    let mut w = Writer::create(fs.path().join("a.arena"), &cfg).expect("create");
    let value = vec![1u8; 30];
    let mut n = 0u64;
    loop {
        match w.put(format!("key{n:08}").as_bytes(), &value) {
            Ok(_) => n += 1,
            Err(Error::ArenaFull { .. }) => break,
            Err(e) => panic!("after {n} puts: {e}"),
        }
        assert!(n < 10_000_000, "the tmpfs never filled");
    }
    assert!(n > 1000, "{n} puts before the tmpfs filled");
    // Still usable: what is there reads back, and freeing room lets writes in again.
    assert_eq!(w.get(b"key00000000").expect("get"), Some(&value[..]));
    fs.resize(16 << 20);
    w.put(b"after", b"growth").expect("room again");
}

/// A region whose arenas sit on a full tmpfs: the batch that no longer fits is refused before
/// it is logged (retryable, nothing written, outcome known), the region is not poisoned, and
/// once the tmpfs grows the same region takes writes again with every acknowledged one there.
#[test]
fn a_full_tmpfs_refuses_writes_before_they_are_logged() {
    let Some(shm) = Tmpfs::mount(3 << 20) else { return };
    let data = tempfile::tempdir().expect("tempdir");
    let mut cfg = RegionConfig::tiny(data.path().join("data"), shm.path(), FsyncPolicy::Never);
    cfg.arena = ArenaConfig { capacity: 64 << 20, ..ArenaConfig::small_nodes(512) };
    cfg.l0_budget = 32 << 20;
    cfg.max_log_tail = 1 << 30;
    let mut r = Region::open(cfg).expect("open").0;
    let value = vec![7u8; 24];
    let (mut acked, mut refused) = (Vec::new(), None);
    for n in 0..1_000_000u64 {
        let key = format!("key{n:08}").into_bytes();
        match r.put(&key, &value) {
            Ok(_) => acked.push(key),
            Err(e) => {
                assert!(e.is_retryable() && !e.outcome_unknown(), "{e}: retry later, nothing was written");
                refused = Some(key);
                break;
            }
        }
    }
    let refused = refused.expect("the tmpfs filled");
    assert!(acked.len() > 1000, "{} writes before the tmpfs filled", acked.len());
    assert_eq!(r.get(&refused).expect("get"), None, "the refused write is nowhere");
    assert!(r.unavailable().is_none(), "not poisoned: {:?}", r.unavailable());
    shm.resize(64 << 20);
    r.put(&refused, &value).expect("writes again once the tmpfs grew");
    acked.push(refused);
    for k in acked.iter().step_by(97).chain(acked.last()) {
        assert_eq!(r.get(k).expect("get"), Some(value.clone()), "{}", String::from_utf8_lossy(k));
    }
}

/// A group whose log write fails once answered a batch of it from a batch that was never
/// written: `[put k, insert k]` — the insert was checked against the put (the group's overlay)
/// and refused as `KeyExists`, then the put's write failed; the answer revealed a key that does
/// not exist (found by the nemesis: a disk-full primary answered an insert "exists" and then
/// every read said the key was absent). Now a failed group's precondition answers are
/// withdrawn: they are refused as unavailable (retryable), as the writes are.
#[test]
fn a_group_whose_log_write_fails_answers_no_precondition_from_it() {
    use dpukv_storage::BatchOp;
    use dpukv_storage::fs::FaultFs;
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = FaultFs::new(7);
    let cfg =
        RegionConfig::tiny(dir.path().join("data"), dir.path().join("shm"), FsyncPolicy::Always).with_fs(fs.as_fs());
    let mut r = Region::open(cfg).expect("open").0;
    let before = r.put(b"other", b"1").expect("put");
    r.wait_durable(before.end).expect("durable");
    fs.fail_write(1);
    let (put, insert, update) =
        ([BatchOp::Put(b"k", b"v")], [BatchOp::Insert(b"k", b"w")], [BatchOp::Update(b"k", b"x")]);
    let out = r.write_group(&[&put, &insert, &update]);
    assert!(out[0].is_err(), "the put's write failed: {:?}", out[0]);
    for (name, res) in [("insert", &out[1]), ("update", &out[2])] {
        match res {
            Err(Error::KeyExists) => panic!("the {name} was answered \"exists\" from a write that failed"),
            Err(e) => assert!(e.is_retryable(), "the {name}: {e} (retryable, like the failed put)"),
            Ok(a) => panic!("the {name} was acknowledged in a failed group: {a:?}"),
        }
    }
    assert_eq!(r.get(b"k").expect("get"), None, "nothing of the group is there");
}
