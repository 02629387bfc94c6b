//! Backups on real processes (docs/backup.md): the fence that gives a consistent cut, held by
//! real primaries on a real etcd; backups through the control API to a directory, restored
//! region by region and checked against a client's chained writes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dpukv_backup::{BackupManifest, Location};
use dpukv_client::Client;
use dpukv_cluster::fence::{self, CutOptions, FenceSpec};
use dpukv_cluster::keys::Keys;
use dpukv_cluster::{EtcdOptions, EtcdStore, MetaStore, master};
use dpukv_e2e::cluster::{ClusterNode, must_see_map};
use dpukv_e2e::etcd::Etcd;
use dpukv_storage::region::{Region, RegionConfig};
use dpukv_storage::vlog::FsyncPolicy;

/// A fence written by hand (as the coordinator writes it, but never committed) with a 3 s hold:
/// the primary reports its cut and, from then on, a write is neither acknowledged nor readable
/// — until the hold runs out and the primary breaks the fence, which can then never commit.
/// Then a fence taken by the coordinator, under a writer, commits with the region's cut, and
/// the writer only waited for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_holds_writes_past_its_cut_until_it_commits_or_breaks() {
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "2000", "--replication-factor", "3", "--fsync", "always"];
    let nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "fenced", &etcd.url(), &args).expect("node")).collect();
    let map = must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 1 && m.regions[0].primary != 0 && m.regions[0].backups.len() == 2,
    )
    .await;
    let device = map.node(map.regions[0].primary).expect("primary").device.clone();
    let (c, reader) =
        (Client::connect(&device, 1).await.expect("connect"), Client::connect(&device, 1).await.expect("connect"));
    c.put(b"before", b"1").await.expect("a write before the fence");

    let store = EtcdStore::connect_checked(&EtcdOptions::new([etcd.url()])).await.expect("etcd");
    let keys = Keys::new("fenced").expect("keys");
    let snap = master::read(&store, &keys).await.expect("read");
    let spec = FenceSpec {
        hold: Duration::from_secs(3),
        regions: snap.map.regions.iter().map(|r| (r.id, r.epoch)).collect(),
        check_empty: false,
    };
    let lease = store.grant(Duration::from_secs(60)).await.expect("lease");
    let id = 7;
    let create = store.put(&keys.fence(id), &spec.encode(), Some(lease)).await.expect("the fence");
    let fenced_at = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(20);
    let cut = loop {
        let snap = master::read(&store, &keys).await.expect("read");
        if let Some((_, at)) = snap.fences.first().and_then(|f| f.reported.values().next().copied()) {
            break at;
        }
        assert!(Instant::now() < deadline, "the primary did not report its cut\n{}", logs(&nodes));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(cut > 0, "a cut past the first write");
    let during = tokio::spawn(async move {
        let began = Instant::now();
        c.put(b"during", b"2").await.map(|_| began.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    if fenced_at.elapsed() < Duration::from_millis(2_500) {
        assert!(!during.is_finished(), "a write past the cut was acknowledged while the fence held");
        assert_eq!(reader.get(b"during").await.expect("get"), None, "a write past the cut was readable");
        assert_eq!(reader.get(b"before").await.expect("get").as_deref(), Some(&b"1"[..]), "the cut is readable");
    }
    let waited = during.await.expect("writer").expect("acknowledged once the fence broke");
    assert!(fenced_at.elapsed() >= Duration::from_millis(2_900), "released only by the break");
    eprintln!("a write held by a fence that broke after its 3 s hold waited {waited:?}");
    assert_eq!(reader.get(b"during").await.expect("get").as_deref(), Some(&b"2"[..]));
    assert!(store.get(&keys.fence(id)).await.expect("get").is_none(), "the primary broke the fence");
    let commit = fence::commit_txn(&keys, id, create, snap.map.revision as i64);
    assert!(!store.txn(commit).await.expect("txn").succeeded, "a broken fence never commits");
    store.revoke(lease).await.expect("revoke");

    // The coordinator, under a writer.
    let writer = {
        let device = device.clone();
        tokio::spawn(async move {
            let c = Client::connect(&device, 1).await.expect("connect");
            let (mut n, mut longest, stop) = (0u32, Duration::ZERO, Instant::now() + Duration::from_secs(3));
            while Instant::now() < stop {
                let began = Instant::now();
                c.put(format!("w{n:05}").as_bytes(), b"v").await.expect("every write acknowledged");
                longest = longest.max(began.elapsed());
                n += 1;
            }
            (n, longest)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cut = fence::take_cut(&store, &keys, CutOptions::default()).await.expect("the cut");
    let (n, longest) = writer.await.expect("writer");
    assert_eq!(cut.positions.len(), 1, "{cut:?}");
    assert_eq!(cut.map.regions[0].epoch, map.regions[0].epoch, "taken on the map the writes went to");
    assert!(cut.positions.values().all(|p| *p > 0));
    eprintln!("a cut under a writer: held {:?}; the writer's longest write {longest:?} over {n} writes", cut.held);
    assert!(store.range(&keys.fences()).await.expect("range").0.is_empty(), "nothing of the fence is left");
}

/// Runs `dpukv ARGS` against the cluster (node 1's device, the control API's token).
async fn dpukv(nodes: &[ClusterNode], args: &[&str]) -> std::process::Output {
    let run = tokio::process::Command::new(dpukv_e2e::procs::bin_dir().expect("binaries").join("dpukv"))
        .args(["--endpoint", &nodes[0].device])
        .args(args)
        .env("DPUKV_ADMIN_TOKEN", nodes[0].admin_token())
        .output();
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .unwrap_or_else(|_| panic!("dpukv {args:?} did not finish\n{}", logs(nodes)))
        .expect("run dpukv")
}

fn logs(nodes: &[ClusterNode]) -> String {
    nodes.iter().map(ClusterNode::logs).collect()
}

/// Region parts of a backup restored into directories and opened: every key they hold, with
/// its value.
async fn restored(loc: &Location, m: &BackupManifest, dir: &std::path::Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut all = BTreeMap::new();
    for part in &m.regions {
        let rdir = dir.join(format!("{}-{}", m.id, part.id));
        dpukv_node::backup::restore_region(loc, part, &rdir).await.expect("restore the region's part");
        let shm = dir.join(format!("{}-{}-shm", m.id, part.id));
        let cfg = RegionConfig::tiny(rdir, shm, FsyncPolicy::Never);
        let region = Region::open(cfg).expect("open the restored region").0;
        all.extend(region.scan(b"", b"\xff", usize::MAX).expect("scan"));
    }
    all
}

/// A backup of three regions under a client that chains its writes across them (each write only
/// once the one before was acknowledged, keys going round the regions) and a second client that
/// reads the first one's latest write and then writes `d-<its index>` (a dependency through a
/// read): every region's part restores, and together they hold a prefix of the first client's
/// writes — a consistent cut — that holds every write acknowledged before the backup began, and
/// every `d-i` they hold comes with the write `i` it read. A second backup after more writes
/// restores to its own cut. A bad location is refused at the start; the backups list in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_under_chained_writes_restores_to_a_consistent_cut() {
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "2000", "--replication-factor", "3", "--fsync", "always", "--split-keys", "b-,c-"];
    let nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "backed", &etcd.url(), &args).expect("node")).collect();
    must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 3 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2),
    )
    .await;
    let key = |i: usize| format!("{}-{i:06}", ["a", "b", "c"][i % 3]).into_bytes();
    let acked = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (device, acked, stop) = (nodes[0].device.clone(), acked.clone(), stop.clone());
        tokio::spawn(async move {
            let c = Client::connect(&device, 1).await.expect("connect");
            let mut i = 0;
            while !stop.load(Ordering::Acquire) {
                c.put(&key(i), format!("v{i}").as_bytes()).await.expect("every write acknowledged");
                i += 1;
                acked.store(i, Ordering::Release);
            }
        })
    };
    // Reads the chain's latest write, then writes what it read: `d-<i>` exists only after `i` did.
    let reader = {
        let (device, acked, stop) = (nodes[1].device.clone(), acked.clone(), stop.clone());
        tokio::spawn(async move {
            let c = Client::connect(&device, 1).await.expect("connect");
            let mut deps = 0;
            while !stop.load(Ordering::Acquire) {
                let n = acked.load(Ordering::Acquire);
                if n > 0 && c.get(&key(n - 1)).await.expect("read").is_some() {
                    c.put(format!("d-{:06}", n - 1).as_bytes(), b"dep").await.expect("a dependent write");
                    deps += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            deps
        })
    };
    let wait_for = |n: usize| {
        let acked = acked.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while acked.load(Ordering::Acquire) < n {
                assert!(Instant::now() < deadline, "fewer than {n} writes acknowledged");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("file://{}", dir.path().join("store").display());
    let e = nodes[0].admin_post("/cluster/backups/6674703a2f2f78").expect_err("ftp://x");
    assert!(e.to_string().contains("backup_bad_location"), "{e}");
    wait_for(300).await;
    let mut cuts = Vec::new();
    for round in 0..2 {
        let before = acked.load(Ordering::Acquire);
        let p = tokio::task::block_in_place(|| backup_on(&nodes, 0, &url));
        assert_eq!(p["state"], "done", "{p}\n{}", logs(&nodes));
        assert_eq!((p["regions"].as_u64(), p["parts"].as_u64()), (Some(3), Some(3)), "{p}");
        eprintln!("backup {round}: {p}");
        cuts.push((p["backup"].as_str().expect("id").to_string(), before));
        wait_for(acked.load(Ordering::Acquire) + 300).await;
    }
    stop.store(true, Ordering::Release);
    writer.await.expect("the writer acknowledged every write");
    let deps = reader.await.expect("the reader");
    assert!(deps > 0, "the reader wrote dependent keys");
    let loc = Location::open(&url).expect("location");
    let ids: Vec<String> = cuts.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(loc.list().await.expect("list"), ids, "both backups, in order");
    // The command line: a third backup through `dpukv backup create` (its id on the last line),
    // then list, describe and verify on the location alone.
    let created = dpukv(&nodes, &["backup", "create", "--to", &url]).await;
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let third = String::from_utf8_lossy(&created.stdout).lines().last().unwrap_or_default().to_string();
    assert!(dpukv_backup::store::valid_id(&third), "the last line is the id: {third:?}");
    let listed = dpukv(&nodes, &["backup", "list", "--to", &url]).await;
    let listed: Vec<String> = String::from_utf8_lossy(&listed.stdout).lines().map(String::from).collect();
    let mut all = ids.clone();
    all.push(third.clone());
    assert_eq!(listed, all);
    let described = dpukv(&nodes, &["backup", "describe", &third, "--to", &url]).await;
    let m = BackupManifest::decode(&described.stdout).expect("describe prints the manifest");
    assert_eq!((m.id.as_str(), m.cluster.as_str(), m.regions.len()), (third.as_str(), "backed", 3));
    let verified = dpukv(&nodes, &["backup", "verify", &third, "--to", &url]).await;
    assert!(verified.status.success(), "{}", String::from_utf8_lossy(&verified.stderr));
    for (id, before) in &cuts {
        let m = loc.manifest(id).await.expect("manifest");
        assert_eq!(m.regions.len(), 3);
        // (How much a later backup reuses is tested on a region with sealed segments and
        // compactions, in dpukv-node's `backup` module; here each region is one open segment.)
        assert!(m.uploaded_bytes <= m.bytes(), "{} uploaded of {}", m.uploaded_bytes, m.bytes());
        let mut keys = restored(&loc, &m, dir.path()).await;
        let dependent: Vec<Vec<u8>> = keys.keys().filter(|k| k.starts_with(b"d-")).cloned().collect();
        for d in &dependent {
            keys.remove(d);
            let i: usize = std::str::from_utf8(&d[2..]).expect("utf-8").parse().expect("index");
            assert!(keys.contains_key(&key(i)), "{id}: d-{i} restored without the write {i} it read");
        }
        let n = keys.len();
        assert!(n >= *before, "{id}: {n} keys restored, {before} writes were acknowledged before it began");
        for i in 0..n {
            assert_eq!(
                keys.get(&key(i)).map(Vec::as_slice),
                Some(format!("v{i}").as_bytes()),
                "{id}: write {i} missing from a cut holding {n} writes: not a prefix of the client's writes"
            );
        }
    }
    // A corrupt object (after the restores: objects may be shared): verify says which, and
    // fails.
    let victim = m.regions[1].log[0].object.clone();
    std::fs::write(dir.path().join("store").join(victim.path()), b"bit rot").expect("damage");
    let verified = dpukv(&nodes, &["backup", "verify", &third, "--to", &url]).await;
    assert_eq!(verified.status.code(), Some(1));
    let said = String::from_utf8_lossy(&verified.stderr);
    assert!(said.contains("backup_object_corrupt") && said.contains(&victim.sha256), "{said}");
}

/// Every key of the cluster `nodes` serves, with its value (a scan across its regions).
async fn contents(nodes: &[ClusterNode]) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let c = Client::connect(&nodes[0].device, 1).await.expect("connect");
    c.scan(b"", &[0xff; 8], usize::MAX).await.expect("scan").into_iter().collect()
}

/// Where two key sets differ, for a failing test's message: sizes and the first few keys that
/// are missing, extra, or hold another value.
fn diff(got: &BTreeMap<Vec<u8>, Vec<u8>>, want: &BTreeMap<Vec<u8>, Vec<u8>>) -> String {
    let show = |k: &Vec<u8>| String::from_utf8_lossy(k).into_owned();
    let missing: Vec<String> = want.keys().filter(|k| !got.contains_key(*k)).take(5).map(show).collect();
    let extra: Vec<String> = got.keys().filter(|k| !want.contains_key(*k)).take(5).map(show).collect();
    let changed: Vec<String> =
        want.iter().filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v)).take(5).map(|(k, _)| show(k)).collect();
    format!("{} keys, {} wanted; missing {missing:?}, extra {extra:?}, other values {changed:?}", got.len(), want.len())
}

/// Polls `GET /cluster/restore` on `node` until the restore ends: its last progress.
fn follow_restore(nodes: &[ClusterNode], node: usize) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(body) = nodes[node].admin_get("/cluster/restore") {
            let p: serde_json::Value = serde_json::from_str(&body).expect("json");
            if p["state"] == "none" {
                return p;
            }
            assert!(Instant::now() < deadline, "the restore did not end: {p}\n{}", logs(nodes));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A backup restores into another, empty cluster (docs/backup.md §5): refused while that
/// cluster holds a key (a key written then deleted leaves it empty), then `dpukv restore` lays
/// the backup's regions out — its key ranges, not the cluster's — fetches each at its primary,
/// copies it, and ends: the cluster holds exactly what the source held at the backup (values in
/// the log and inline, deletions included) and takes writes again. A third cluster restores
/// the same backup while the primary of one of its regions is killed mid-restore: the restore
/// still ends with every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_restores_into_an_empty_cluster_even_with_a_node_killed_midway() {
    let etcd = Etcd::start().expect("etcd");
    let args = |splits: &'static str| {
        let mut a = vec!["--lease-ttl-ms", "2000", "--replication-factor", "2", "--fsync", "always"];
        if !splits.is_empty() {
            a.extend(["--split-keys", splits]);
        }
        a
    };
    let start = |cluster: &str, splits: &'static str| -> Vec<ClusterNode> {
        (1..=3).map(|id| ClusterNode::start(id, cluster, &etcd.url(), &args(splits)).expect("node")).collect()
    };
    let copied = |n: usize| {
        move |m: &dpukv_proto::regionmap::RegionMap| {
            m.regions.len() == n && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 1)
        }
    };
    // The source: three regions, keys in each; values inline (100 B) and in the log (600 B);
    // every seventh key deleted again.
    let source = start("source", "b-,c-");
    must_see_map(&source, |_| true, Duration::from_secs(60), copied(3)).await;
    let c = Client::connect(&source[0].device, 1).await.expect("connect");
    for i in 0..300usize {
        let key = format!("{}-{i:04}", ["a", "b", "c"][i % 3]);
        c.put(key.as_bytes(), &vec![b'a' + (i % 26) as u8; if i % 2 == 0 { 100 } else { 600 }]).await.expect("put");
    }
    for i in (0..300usize).step_by(7) {
        c.delete(format!("{}-{i:04}", ["a", "b", "c"][i % 3]).as_bytes()).await.expect("delete");
    }
    let want = contents(&source).await;
    assert_eq!(want.len(), 300 - 300usize.div_ceil(7));
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("file://{}", dir.path().join("store").display());
    let created = dpukv(&source, &["backup", "create", "--to", &url]).await;
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let id = String::from_utf8_lossy(&created.stdout).lines().last().unwrap_or_default().to_string();
    drop(c);
    drop(source);

    // The target: one region, no key — but first one written, so the restore is refused.
    let target = start("target", "");
    must_see_map(&target, |_| true, Duration::from_secs(60), copied(1)).await;
    let c = Client::connect(&target[0].device, 1).await.expect("connect");
    c.put(b"stray", b"x").await.expect("put");
    let refused = dpukv(&target, &["restore", "--from", &url]).await;
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains("restore_cluster_not_empty"), "{said}");
    assert_eq!(contents(&target).await.len(), 1, "a refused restore changes nothing");
    c.delete(b"stray").await.expect("delete");
    let restored = dpukv(&target, &["restore", "--from", &url, "--backup", &id]).await;
    let out = String::from_utf8_lossy(&restored.stdout);
    assert!(restored.status.success(), "{out}{}\n{}", String::from_utf8_lossy(&restored.stderr), logs(&target));
    assert_eq!(out.lines().last(), Some(format!("restored {id}").as_str()), "{out}");
    let map = must_see_map(&target, |_| true, Duration::from_secs(30), copied(3)).await;
    let ranges: Vec<(Vec<u8>, Option<Vec<u8>>)> =
        map.regions.iter().map(|r| (r.start.clone(), r.end.clone())).collect();
    assert_eq!(
        ranges,
        vec![(vec![], Some(b"b-".to_vec())), (b"b-".to_vec(), Some(b"c-".to_vec())), (b"c-".to_vec(), None)]
    );
    assert!(map.regions.iter().all(|r| r.id > 1), "new region ids: {:?}", map.regions);
    let got = contents(&target).await;
    assert!(got == want, "the restored cluster holds exactly the backup: {}\n{}", diff(&got, &want), logs(&target));
    c.put(b"b-after", b"y").await.expect("a write after the restore");
    assert_eq!(c.get(b"b-after").await.expect("get").as_deref(), Some(&b"y"[..]));
    drop(c);
    drop(target);

    // A third cluster restores it while one region's primary is killed: the region is fetched
    // again elsewhere (or promoted from a copy that caught up), and the restore ends.
    let mut third = start("third", "");
    must_see_map(&third, |_| true, Duration::from_secs(60), copied(1)).await;
    let hex: String = url.bytes().map(|b| format!("{b:02x}")).collect();
    let began: serde_json::Value =
        serde_json::from_str(&third[0].admin_post(&format!("/cluster/restore/{hex}/{id}")).expect("begin"))
            .expect("json");
    assert_eq!((began["state"].as_str(), began["regions"].as_u64()), (Some("running"), Some(3)), "{began}");
    let store = EtcdStore::connect_checked(&EtcdOptions::new([etcd.url()])).await.expect("etcd");
    let snap = master::read(&store, &Keys::new("third").expect("keys")).await.expect("read");
    let victim = snap.map.regions.iter().map(|r| r.primary).find(|&p| p != 1).expect("a primary besides node 1");
    third[victim as usize - 1].kill();
    let p = tokio::task::block_in_place(|| follow_restore(&third, 0));
    assert_eq!(p["state"], "none", "{p}");
    let live: Vec<ClusterNode> = third.into_iter().filter(|n| n.id != victim).collect();
    must_see_map(&live, |_| true, Duration::from_secs(30), copied(3)).await;
    let got = contents(&live).await;
    assert!(got == want, "restored with a node killed midway: {}\n{}", diff(&got, &want), logs(&live));
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64
}

/// An RFC 3339 UTC time for `ms` (what `dpukv restore --at` takes).
fn rfc3339(ms: u64) -> String {
    let id = dpukv_backup::manifest::backup_id(ms, 0);
    format!(
        "{}-{}-{}T{}:{}:{}.{:03}Z",
        &id[0..4],
        &id[4..6],
        &id[6..8],
        &id[9..11],
        &id[11..13],
        &id[13..15],
        ms % 1000
    )
}

/// Point-in-time restore (docs/backup.md §4): with the cluster's backup schedule taking a
/// restore point every second, a write every 3 s (each into the other region); restoring to a
/// moment between two writes gives exactly the writes acknowledged before it, none invoked after.
/// Every node exports the last backup; the schedule's retention keeps the last two once asked;
/// stopped, it takes no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_to_a_moment_holds_exactly_the_writes_acknowledged_before_it() {
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "2000", "--replication-factor", "2", "--fsync", "always", "--split-keys", "m"];
    let nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "pitr", &etcd.url(), &args).expect("node")).collect();
    must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 2 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 1),
    )
    .await;
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("file://{}", dir.path().join("store").display());
    let set = dpukv(&nodes, &["backup", "schedule", "--to", &url, "--every-secs", "1"]).await;
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    let c = Client::connect(&nodes[0].device, 1).await.expect("connect");
    // (invoked, acknowledged) of each write, Unix ms.
    let mut writes = Vec::new();
    for i in 0..4usize {
        tokio::time::sleep(Duration::from_millis(3000)).await;
        let key = format!("{}{i}", ["a", "z"][i % 2]);
        let invoked = unix_ms();
        c.put(key.as_bytes(), b"v").await.expect("put");
        writes.push((key, invoked, unix_ms()));
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let off = dpukv(&nodes, &["backup", "schedule", "--off"]).await;
    assert!(off.status.success(), "{}", String::from_utf8_lossy(&off.stderr));
    let loc = Location::open(&url).expect("location");
    let points = loc.list().await.expect("list");
    assert!(points.len() >= 10, "about one restore point a second: {} in ~15 s\n{}", points.len(), logs(&nodes));
    // Every node exports the last backup, whichever node took it.
    for n in &nodes {
        let at = n.metric("dpukv_backup_last_success_timestamp_seconds").expect("metrics");
        assert!(at.is_some_and(|t| t * 1000.0 >= writes[3].2 as f64 - 1000.0), "node {}: {at:?}", n.id);
    }
    // Between write 1's acknowledgement and write 2's invocation.
    let t = (writes[1].2 + writes[2].1) / 2;
    let target = {
        let mut t = Vec::new();
        for id in 1..=3 {
            t.push(ClusterNode::start(id, "pitr-target", &etcd.url(), &args).expect("node"));
        }
        t
    };
    must_see_map(
        &target,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 2 && m.regions.iter().all(|r| r.primary != 0),
    )
    .await;
    let restored = dpukv(&target, &["restore", "--from", &url, "--at", &rfc3339(t)]).await;
    assert!(
        restored.status.success(),
        "{}{}",
        String::from_utf8_lossy(&restored.stdout),
        String::from_utf8_lossy(&restored.stderr)
    );
    let got = contents(&target).await;
    let want: BTreeMap<Vec<u8>, Vec<u8>> =
        writes[..2].iter().map(|(k, _, _)| (k.as_bytes().to_vec(), b"v".to_vec())).collect();
    assert!(got == want, "restored to {}: {}", rfc3339(t), diff(&got, &want));
    // Retention: the last two kept once the schedule asks.
    let before = loc.list().await.expect("list").len();
    let set = dpukv(&nodes, &["backup", "schedule", "--to", &url, "--every-secs", "1", "--keep-last", "2"]).await;
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    let deadline = Instant::now() + Duration::from_secs(30);
    while loc.list().await.expect("list").len() > 2 {
        assert!(Instant::now() < deadline, "retention never applied ({before} backups before)\n{}", logs(&nodes));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let off = dpukv(&nodes, &["backup", "schedule", "--off"]).await;
    assert!(off.status.success());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = loc.list().await.expect("list");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(loc.list().await.expect("list"), after, "no backup once the schedule is off");
}

/// Starts a backup through `node`'s control API and waits for it to end: its last progress.
fn backup_on(nodes: &[ClusterNode], node: usize, url: &str) -> serde_json::Value {
    let hex: String = url.bytes().map(|b| format!("{b:02x}")).collect();
    let started: serde_json::Value =
        serde_json::from_str(&nodes[node].admin_post(&format!("/cluster/backups/{hex}")).expect("start"))
            .expect("json");
    let job = started["job"].as_u64().expect("a job number");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let p: serde_json::Value =
            serde_json::from_str(&nodes[node].admin_get(&format!("/cluster/backups/{job}")).expect("progress"))
                .expect("json");
        if p["state"] != "running" {
            return p;
        }
        assert!(Instant::now() < deadline, "the backup did not end: {p}\n{}", logs(nodes));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Failures during a backup end it cleanly (docs/backup.md §6): uploads capped at 1 MiB/s so
/// each takes seconds; the location's object directory turned into a file midway (the store
/// refusing every put) fails the backup with the store's error; a primary SIGKILLed midway fails
/// it within seconds, naming the node — not after the job's hour-long deadline. Neither leaves a
/// backup at the location (no manifest). Once the region failed over, a backup completes and
/// holds every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_fails_cleanly_when_its_store_fails_or_a_primary_dies_midway() {
    let etcd = Etcd::start().expect("etcd");
    let args = [
        "--lease-ttl-ms",
        "2000",
        "--replication-factor",
        "2",
        "--fsync",
        "never",
        "--split-keys",
        "g,t",
        "--backup-mib-per-sec",
        "1",
    ];
    let mut nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "faulty", &etcd.url(), &args).expect("node")).collect();
    let map = must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 3 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 1),
    )
    .await;
    // About 7 MB in each region: each node's upload takes ~6 s at the cap.
    let c = Client::connect(&nodes[0].device, 1).await.expect("connect");
    let mut want = BTreeMap::new();
    for i in 0..900usize {
        for p in ["a", "h", "u"] {
            let (k, v) = (format!("{p}{i:04}").into_bytes(), vec![b'a' + (i % 26) as u8; 8 << 10]);
            c.put(&k, &v).await.expect("put");
            want.insert(k, v);
        }
    }
    drop(c);
    let dir = tempfile::tempdir().expect("dir");
    let store = dir.path().join("store");
    let url = format!("file://{}", store.display());
    let loc = Location::open(&url).expect("location");

    // The store refusing every put midway.
    let breaker = {
        let objects = store.join("objects");
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !objects.is_dir() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            std::thread::sleep(Duration::from_millis(200));
            let _ = std::fs::remove_dir_all(&objects);
            std::fs::write(&objects, b"not a directory").expect("break the store");
        })
    };
    let p = tokio::task::block_in_place(|| backup_on(&nodes, 0, &url));
    breaker.join().expect("breaker");
    assert_eq!(p["state"], "failed", "{p}");
    let why = p["error"].as_str().unwrap_or_default();
    assert!(why.contains("backup_store_failed") || why.contains("backup_io"), "the store's error: {p}");
    assert!(loc.list().await.expect("list").is_empty(), "no backup is written: {p}");
    std::fs::remove_file(store.join("objects")).expect("repair the store");

    // A primary killed midway (not node 1, which coordinates).
    let victim = map.regions.iter().map(|r| r.primary).find(|&p| p != 1).expect("a primary besides node 1");
    let killer = {
        let (objects, pid) = (store.join("objects"), nodes[victim as usize - 1].host_pid().expect("pid"));
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !objects.is_dir() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            std::thread::sleep(Duration::from_millis(500));
            let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
        })
    };
    let began = Instant::now();
    let p = tokio::task::block_in_place(|| backup_on(&nodes, 0, &url));
    killer.join().expect("killer");
    assert_eq!(p["state"], "failed", "{p}");
    assert!(began.elapsed() < Duration::from_secs(60), "it failed in {:?}", began.elapsed());
    let why = p["error"].as_str().unwrap_or_default();
    assert!(why.contains(&format!("node {victim}")), "names the node: {p}");
    assert!(loc.list().await.expect("list").is_empty(), "no backup is written: {p}");
    nodes[victim as usize - 1].kill();
    // Failed over: a backup completes, and holds every key.
    let live: Vec<ClusterNode> = nodes.into_iter().filter(|n| n.id != victim).collect();
    must_see_map(
        &live,
        |_| true,
        Duration::from_secs(30),
        |m| m.regions.iter().all(|r| r.primary != victim && r.primary != 0),
    )
    .await;
    let p = tokio::task::block_in_place(|| backup_on(&live, 0, &url));
    assert_eq!(p["state"], "done", "{p}\n{}", logs(&live));
    let m = loc.manifest(p["backup"].as_str().expect("id")).await.expect("manifest");
    let got = restored(&loc, &m, dir.path()).await;
    assert!(got == want, "the backup after the failover: {}", diff(&got, &want));
}

/// A backup taken while its primary's disk is full (docs/backup.md §6): the upload only reads
/// (the snapshot is hard links, which take no space), so the backup ends — done, holding every
/// key acknowledged before the fill, or failed with a clear error and no manifest — and never
/// hangs. Needs root (node 1's disk, the region's primary, is a 48 MiB tmpfs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_of_a_primary_whose_disk_is_full_ends_cleanly() {
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "2000", "--replication-factor", "3", "--fsync", "always"];
    let mut nodes = vec![ClusterNode::start_on_small_disk(1, "fullbackup", &etcd.url(), &args, 48).expect("node 1")];
    for id in 2..=3 {
        nodes.push(ClusterNode::start(id, "fullbackup", &etcd.url(), &args).expect("node"));
    }
    let map = must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 1 && m.regions[0].primary != 0 && m.regions[0].backups.len() == 2,
    )
    .await;
    assert_eq!(map.regions[0].primary, 1, "node 1 leads (the first layout leads from the lowest id)");
    let c = Client::connect(&nodes[0].device, 1).await.expect("connect");
    let mut want = BTreeMap::new();
    for i in 0..300usize {
        let (k, v) = (format!("k{i:04}").into_bytes(), vec![b'a' + (i % 26) as u8; 600]);
        c.put(&k, &v).await.expect("put");
        want.insert(k, v);
    }
    let filled = nodes[0].fill_disk().expect("fill the disk");
    eprintln!("filled node 1's disk with {} MiB", filled >> 20);
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("file://{}", dir.path().join("store").display());
    let loc = Location::open(&url).expect("location");
    let began = Instant::now();
    let p = tokio::task::block_in_place(|| backup_on(&nodes, 0, &url));
    eprintln!("a backup of a primary with a full disk: {p} after {:?}", began.elapsed());
    match p["state"].as_str() {
        Some("done") => {
            let m = loc.manifest(p["backup"].as_str().expect("id")).await.expect("manifest");
            let got = restored(&loc, &m, dir.path()).await;
            for (k, v) in &want {
                assert_eq!(got.get(k), Some(v), "{} acknowledged before the fill", String::from_utf8_lossy(k));
            }
        }
        _ => {
            assert_eq!(p["state"], "failed", "{p}");
            assert!(p["error"].as_str().is_some_and(|e| !e.is_empty()), "a clear error: {p}");
            assert!(loc.list().await.expect("list").is_empty(), "no backup written: {p}");
        }
    }
    nodes[0].free_disk().expect("free the disk");
}
