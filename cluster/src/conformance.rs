//! What every [`MetaStore`] must do, as one suite run against each implementation (the in-memory
//! store in unit tests, a real etcd in the cluster's tests). Each check panics with what broke.
//!
//! [`must_conform`] runs them all under a prefix no one else uses, with leases of `ttl` (etcd
//! refuses leases shorter than its minimum TTL; the in-memory store takes any).

use std::time::Duration;

use crate::election::{campaign, leader, resign};
use crate::meta::{Compare, MetaError, MetaStore, Txn, TxnOp, WatchEvent};

fn k(prefix: &[u8], s: &str) -> Vec<u8> {
    let mut key = prefix.to_vec();
    key.extend_from_slice(s.as_bytes());
    key
}

/// Runs every check.
pub async fn must_conform<S: MetaStore>(s: &S, prefix: &[u8], ttl: Duration) {
    must_keep_revisions(s, &k(prefix, "rev/")).await;
    must_range_except(s, &k(prefix, "except/")).await;
    must_apply_transactions_whole(s, &k(prefix, "txn/")).await;
    must_end_leases(s, &k(prefix, "lease/"), ttl).await;
    must_watch_in_order(s, &k(prefix, "watch/")).await;
    must_delete_prefixes(s, &k(prefix, "prefix/"), ttl).await;
    must_elect_one_leader(s, &k(prefix, "elect"), ttl).await;
}

/// Puts, gets, ranges: revisions grow; an update keeps its create revision; ranges stay in their
/// prefix, in key order.
pub async fn must_keep_revisions<S: MetaStore>(s: &S, p: &[u8]) {
    let r1 = s.put(&k(p, "b"), b"1", None).await.expect("put");
    let r2 = s.put(&k(p, "a"), b"2", None).await.expect("put");
    assert!(r2 > r1, "revisions grow: {r1} then {r2}");
    let r3 = s.put(&k(p, "b"), b"3", None).await.expect("put");
    let b = s.get(&k(p, "b")).await.expect("get").expect("b exists");
    assert_eq!((b.value.as_slice(), b.create_revision, b.mod_revision), (&b"3"[..], r1, r3));
    s.put(&k(p, "c/x"), b"4", None).await.expect("put");
    let mut outside = p.to_vec();
    outside.pop();
    outside.extend_from_slice(b"~");
    s.put(&outside, b"out", None).await.expect("put outside the prefix");
    let (kvs, rev) = s.range(p).await.expect("range");
    let keys: Vec<Vec<u8>> = kvs.iter().map(|kv| kv.key.clone()).collect();
    assert_eq!(keys, vec![k(p, "a"), k(p, "b"), k(p, "c/x")], "a range holds its prefix, in order");
    assert!(rev >= r3);
    let rd = s.delete(&k(p, "a")).await.expect("delete");
    assert!(rd > rev);
    assert_eq!(s.get(&k(p, "a")).await.expect("get"), None);
    let again = s.put(&k(p, "a"), b"5", None).await.expect("put");
    let a = s.get(&k(p, "a")).await.expect("get").expect("a exists");
    assert_eq!(a.create_revision, again, "a key created again has a new create revision");
    s.delete(&outside).await.expect("delete");
}

/// A range that leaves a sub-prefix out: the keys around it (before, after, and one that only
/// starts like it), in order, at the store's revision; an excepted prefix outside the range is
/// refused.
pub async fn must_range_except<S: MetaStore>(s: &S, p: &[u8]) {
    for key in ["a", "events/1", "events/2", "eventsx", "event", "z/1"] {
        s.put(&k(p, key), key.as_bytes(), None).await.expect("put");
    }
    let last = s.put(&k(p, "events/3"), b"e", None).await.expect("put");
    let (kvs, rev) = s.range_except(p, &k(p, "events/")).await.expect("range_except");
    let keys: Vec<Vec<u8>> = kvs.iter().map(|kv| kv.key.clone()).collect();
    assert_eq!(keys, vec![k(p, "a"), k(p, "event"), k(p, "eventsx"), k(p, "z/1")], "the excepted prefix is left out");
    assert!(kvs.iter().all(|kv| kv.value == kv.key[p.len()..]), "values come with their keys");
    assert!(rev >= last, "read at the store's revision: {rev} < {last}");
    assert!(
        matches!(s.range_except(p, b"/elsewhere/").await, Err(MetaError::Invalid(_))),
        "an excepted prefix outside the range is refused"
    );
    assert!(matches!(s.range_except(p, p).await, Err(MetaError::Invalid(_))), "excepting the whole range is refused");
}

/// Transactions: compares against one state, both branches, every op at one revision, and a
/// transaction naming a lease that does not exist changes nothing.
pub async fn must_apply_transactions_whole<S: MetaStore>(s: &S, p: &[u8]) {
    let put = |key: &str, v: &[u8]| TxnOp::Put { key: k(p, key), value: v.to_vec(), lease: None };
    let create =
        Txn { when: vec![Compare::Absent(k(p, "x"))], then: vec![put("x", b"1"), put("y", b"1")], otherwise: vec![] };
    let t = s.txn(create.clone()).await.expect("txn");
    assert!(t.succeeded);
    let (x, y) = (s.get(&k(p, "x")).await.expect("get").expect("x"), s.get(&k(p, "y")).await.expect("get").expect("y"));
    assert_eq!((x.mod_revision, y.mod_revision), (t.revision, t.revision), "one transaction, one revision");
    let t2 = s.txn(create).await.expect("txn");
    assert!(!t2.succeeded, "x exists now");
    assert_eq!(t2.revision, t.revision, "a transaction that changes nothing takes no revision");
    let cas = |rev, v: &[u8]| Txn {
        when: vec![Compare::ModRevision(k(p, "x"), rev)],
        then: vec![put("x", v)],
        otherwise: vec![put("lost", v)],
    };
    assert!(s.txn(cas(x.mod_revision, b"2")).await.expect("txn").succeeded, "compare-and-swap at the current revision");
    assert!(!s.txn(cas(x.mod_revision, b"3")).await.expect("txn").succeeded, "a stale revision loses");
    assert_eq!(s.get(&k(p, "x")).await.expect("get").expect("x").value, b"2");
    assert_eq!(s.get(&k(p, "lost")).await.expect("get").expect("the other branch ran").value, b"3");
    let by_value =
        Txn { when: vec![Compare::Value(k(p, "y"), b"1".to_vec())], then: vec![put("y", b"9")], otherwise: vec![] };
    assert!(s.txn(by_value.clone()).await.expect("txn").succeeded);
    assert!(!s.txn(by_value).await.expect("txn").succeeded, "the value is 9 now");
    let by_create = Txn { when: vec![Compare::CreateRevision(k(p, "y"), y.create_revision)], ..Txn::default() };
    assert!(s.txn(by_create).await.expect("txn").succeeded, "an update keeps the create revision");
    // A prefix unchanged since a revision: not once a key under it changed after it, whether
    // updated or created; a key outside it does not count.
    let (_, seen) = s.range(p).await.expect("range");
    let unchanged =
        |prefix: &str, rev| Txn { when: vec![Compare::UnchangedSince(k(p, prefix), rev)], ..Txn::default() };
    assert!(s.txn(unchanged("", seen)).await.expect("txn").succeeded, "nothing changed since the range");
    s.put(&k(p, "out/side"), b"1", None).await.expect("put");
    assert!(s.txn(unchanged("x", seen)).await.expect("txn").succeeded, "a key outside the prefix changed");
    assert!(!s.txn(unchanged("", seen)).await.expect("txn").succeeded, "a key under it was created");
    let (_, seen) = s.range(p).await.expect("range");
    s.put(&k(p, "x"), b"4", None).await.expect("put");
    assert!(!s.txn(unchanged("x", seen)).await.expect("txn").succeeded, "x was updated");
    assert!(s.txn(unchanged("none/", seen)).await.expect("txn").succeeded, "an empty prefix range holds");
    let before = s.range(p).await.expect("range");
    let bad = Txn {
        then: vec![put("z", b"1"), TxnOp::Put { key: k(p, "w"), value: vec![], lease: Some(0x7fff_0000_0001) }],
        ..Txn::default()
    };
    assert!(s.txn(bad).await.is_err(), "a put under a lease that does not exist is refused");
    assert_eq!(s.range(p).await.expect("range").0, before.0, "a refused transaction changes nothing");
}

/// Leases: kept alive they outlive their TTL; left alone they end and delete their keys (a watch
/// sees the deletion); revoked they end at once; an ended lease cannot be kept alive.
pub async fn must_end_leases<S: MetaStore>(s: &S, p: &[u8], ttl: Duration) {
    let kept = s.grant(ttl).await.expect("grant");
    let left = s.grant(ttl).await.expect("grant");
    s.put(&k(p, "kept"), b"1", Some(kept)).await.expect("put");
    let rev = s.put(&k(p, "left"), b"1", Some(left)).await.expect("put");
    let mut w = s.watch(p, rev + 1).await.expect("watch");
    let start = std::time::Instant::now();
    while start.elapsed() < ttl * 3 {
        s.keep_alive(kept).await.expect("keep alive");
        tokio::time::sleep(ttl / 4).await;
    }
    assert!(s.get(&k(p, "kept")).await.expect("get").is_some(), "a lease kept alive outlives its TTL");
    assert_eq!(s.get(&k(p, "left")).await.expect("get"), None, "a lease left alone ends with its keys");
    match tokio::time::timeout(Duration::from_secs(10), w.next()).await {
        Ok(Some(Ok(WatchEvent::Delete { key, .. }))) => assert_eq!(key, k(p, "left")),
        other => panic!("the lease's deletion should be watched: {other:?}"),
    }
    let ended = s.keep_alive(left).await;
    assert!(matches!(ended, Err(MetaError::LeaseNotFound(_))), "an ended lease stays ended: {ended:?}");
    s.revoke(kept).await.expect("revoke");
    assert_eq!(s.get(&k(p, "kept")).await.expect("get"), None, "revoking deletes the lease's keys");
}

/// Deleting a prefix: every key under it (a lease's too) and nothing else — not a key that
/// merely starts with the same characters — at one revision, counted; nothing there, nothing
/// deleted; an empty prefix refused.
pub async fn must_delete_prefixes<S: MetaStore>(s: &S, p: &[u8], ttl: Duration) {
    let lease = s.grant(ttl * 100).await.expect("grant");
    let under = [k(p, "c1/config"), k(p, "c1/nodes/1"), k(p, "c1/regions/0000000001")];
    for key in &under {
        s.put(key, b"v", None).await.expect("put");
    }
    s.put(&k(p, "c1/leased"), b"v", Some(lease)).await.expect("put under a lease");
    let kept = [k(p, "c1"), k(p, "c10/config"), k(p, "c2/config")];
    let mut last = 0;
    for key in &kept {
        last = s.put(key, b"v", None).await.expect("put");
    }
    let mut w = s.watch(p, last + 1).await.expect("watch");
    assert_eq!(s.delete_prefix(&k(p, "c1/")).await.expect("delete the prefix"), 4, "four keys under it");
    let (left, rev) = s.range(p).await.expect("range");
    let left: Vec<Vec<u8>> = left.into_iter().map(|kv| kv.key).collect();
    assert_eq!(left, kept.to_vec(), "only the keys under the prefix are gone");
    let mut deleted = Vec::new();
    while deleted.len() < 4 {
        match tokio::time::timeout(Duration::from_secs(10), w.next()).await {
            Ok(Some(Ok(WatchEvent::Delete { key, revision }))) => deleted.push((key, revision)),
            other => panic!("the deletions should be watched: {other:?}"),
        }
    }
    assert!(deleted.iter().all(|(_, r)| *r == rev), "one revision for them all: {deleted:?} at {rev}");
    assert_eq!(s.delete_prefix(&k(p, "c1/")).await.expect("delete again"), 0, "nothing left to delete");
    assert_eq!(s.range(p).await.expect("range").1, rev, "deleting nothing takes no revision");
    assert!(matches!(s.delete_prefix(b"").await, Err(MetaError::Invalid(_))), "an empty prefix is refused");
    s.revoke(lease).await.expect("the lease outlives its key");
    for key in &kept {
        s.delete(key).await.expect("delete");
    }
}

/// Watches: every change under the prefix from the start revision, in order, none outside it.
pub async fn must_watch_in_order<S: MetaStore>(s: &S, p: &[u8]) {
    let first = s.put(&k(p, "a"), b"0", None).await.expect("put");
    for i in 1..50u32 {
        s.put(&k(p, &format!("k{}", i % 7)), &i.to_le_bytes(), None).await.expect("put");
        if i % 10 == 0 {
            s.delete(&k(p, &format!("k{}", i % 7))).await.expect("delete");
        }
    }
    let mut outside = p.to_vec();
    outside.pop();
    outside.extend_from_slice(b"~");
    s.put(&outside, b"x", None).await.expect("put outside");
    let last = s.put(&k(p, "z"), b"end", None).await.expect("put");
    // From the past: the whole history, in order.
    let mut w = s.watch(p, first).await.expect("watch");
    let mut seen = Vec::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), w.next()).await.expect("an event in time");
        let ev = ev.expect("the watch goes on").expect("no error");
        assert!(ev.key().starts_with(p), "an event outside the prefix: {ev:?}");
        let r = ev.revision();
        seen.push(r);
        if r == last {
            break;
        }
    }
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "events in revision order: {seen:?}");
    assert_eq!(seen.len(), 50 + 4 + 1, "every change: 50 puts, 4 deletes, the last put: {first}..={last}: {seen:?}");
    // Live: a watch from now sees the next change.
    let mut live = s.watch(p, 0).await.expect("watch");
    let r = s.put(&k(p, "live"), b"1", None).await.expect("put");
    let ev =
        tokio::time::timeout(Duration::from_secs(10), live.next()).await.expect("in time").expect("open").expect("ok");
    assert_eq!(ev.revision(), r);
    s.delete(&outside).await.expect("delete");
}

/// Election: one leader at a time, in campaign order; a resignation or a lease's end hands over;
/// the old leader's fence fails once it is deposed.
pub async fn must_elect_one_leader<S: MetaStore>(s: &S, name: &[u8], ttl: Duration) {
    let (la, lb) = (s.grant(ttl * 20).await.expect("grant"), s.grant(ttl * 20).await.expect("grant"));
    let a = campaign(s, name, la, b"a").await.expect("the first candidate leads");
    assert_eq!(leader(s, name).await.expect("leader").expect("a leader").value, b"a");
    let b = {
        let (s, name) = (s.clone(), name.to_vec());
        tokio::spawn(async move { campaign(&s, &name, lb, b"b").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!b.is_finished(), "a second candidate waits while the first leads");
    let fenced = Txn { when: vec![a.fence()], ..Txn::default() };
    assert!(s.txn(fenced.clone()).await.expect("txn").succeeded, "the leader's fence holds");
    resign(s, &a).await.expect("resign");
    let b = tokio::time::timeout(Duration::from_secs(10), b)
        .await
        .expect("handed over in time")
        .expect("task")
        .expect("b leads");
    assert_eq!(leader(s, name).await.expect("leader").expect("a leader").value, b"b");
    assert!(!s.txn(fenced).await.expect("txn").succeeded, "a deposed leader's fence fails");
    // A leader whose lease ends is replaced.
    let lc = s.grant(ttl * 20).await.expect("grant");
    let c = {
        let (s, name) = (s.clone(), name.to_vec());
        tokio::spawn(async move { campaign(&s, &name, lc, b"c").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!c.is_finished());
    s.revoke(b.lease).await.expect("revoke the leader's lease");
    let c = tokio::time::timeout(Duration::from_secs(10), c).await.expect("in time").expect("task").expect("c leads");
    assert_eq!(leader(s, name).await.expect("leader").expect("a leader").key, c.key);
    s.revoke(lc).await.expect("revoke");
    assert_eq!(leader(s, name).await.expect("leader"), None);
}

/// The cluster's control loop on this store: three nodes register and run for master; the
/// master lays out three regions with three replicas; when the node leading region 1 crashes
/// (its keep-alives stop, nothing is revoked), a backup is promoted with the epoch bumped — and
/// only after the crashed node's authority had run out (the fencing rule), then a replacement
/// is not possible (three nodes) so the region runs with two copies. `ttl` is the node lease TTL.
pub async fn must_fail_over<S: MetaStore>(s: &S, cluster: &str, ttl: Duration) {
    use crate::keys::{ClusterConfig, Keys};
    use crate::master;
    use crate::membership::{Timing, register};
    use dpukv_proto::regionmap::NodeInfo;
    use tokio_util::sync::CancellationToken;

    let keys = Keys::new(cluster).expect("name");
    let config = ClusterConfig::new(3, vec![b"g".to_vec(), b"p".to_vec()]);
    master::bootstrap_config(s, &keys, &config).await.expect("config");
    let timing = Timing { ttl, drift: 0.01, margin: Duration::from_millis(50) };
    let cancel = CancellationToken::new();
    let mut nodes = Vec::new();
    for id in 1..=3u32 {
        let info = NodeInfo {
            id,
            device: format!("d{id}"),
            replication: format!("r{id}"),
            admin: format!("a{id}"),
            zone: String::new(),
            fabric: String::new(),
        };
        let m = register(s, &keys, &info, timing).await.expect("register");
        assert!(m.authority.valid(), "a registered node has authority");
        assert!(register(s, &keys, &info, timing).await.is_err(), "a second node with the same id is refused");
        let authority = m.authority.clone();
        let (s1, s2, k2, c1, c2) = (s.clone(), s.clone(), keys.clone(), cancel.clone(), cancel.clone());
        let lease = m.lease;
        let keeper = tokio::spawn(async move { m.keep_alive(&s1, timing, c1).await });
        let master = tokio::spawn(async move {
            master::run(&s2, &k2, lease, &info, Duration::from_millis(200), c2, Default::default()).await
        });
        nodes.push((authority, keeper, master));
    }
    let laid_out = async {
        loop {
            let snap = master::read(s, &keys).await.expect("read");
            if snap.map.regions.len() == 3 {
                return snap;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let snap = tokio::time::timeout(Duration::from_secs(10), laid_out).await.expect("laid out in time");
    snap.map.validate().expect("a valid map");
    assert!((1..=3).contains(&snap.map.master), "the map names the master: {}", snap.map.master);
    for r in &snap.map.regions {
        assert_eq!((r.backups.len(), r.epoch), (2, 1), "three replicas, epoch 1: {r:?}");
    }
    let victim = snap.map.regions[0].primary;
    let (authority, keeper, master) = &nodes[victim as usize - 1];
    keeper.abort();
    master.abort();
    let promoted = async {
        loop {
            let snap = master::read(s, &keys).await.expect("read");
            if snap.map.regions.iter().all(|r| r.primary != victim && r.epoch >= 2) {
                return (snap, std::time::Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let (after, seen) = tokio::time::timeout(ttl * 10, promoted).await.expect("promoted in time");
    let until = authority.until().expect("it had authority");
    assert!(!authority.valid(), "the crashed node's authority has run out");
    assert!(until < seen, "promotion came only after the old primary's authority ended ({until:?} vs {seen:?})");
    for (r, before) in after.map.regions.iter().zip(&snap.map.regions) {
        assert!(!r.replicas().any(|n| n == victim), "the dead node holds nothing: {r:?}");
        if before.primary == victim {
            assert!(before.backups.contains(&r.primary), "a backup was promoted: {before:?} -> {r:?}");
        }
    }
    cancel.cancel();
    for (_, keeper, master) in nodes {
        let _ = keeper.await;
        let _ = master.await;
    }
}
