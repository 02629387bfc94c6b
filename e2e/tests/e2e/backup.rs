//! Backups on real processes (docs/backup.md): the fence that gives a consistent cut, held by
//! real primaries on a real etcd.

use std::time::{Duration, Instant};

use dpukv_client::Client;
use dpukv_cluster::fence::{self, CutOptions, FenceSpec};
use dpukv_cluster::keys::Keys;
use dpukv_cluster::{EtcdOptions, EtcdStore, MetaStore, master};
use dpukv_e2e::cluster::{ClusterNode, must_see_map};
use dpukv_e2e::etcd::Etcd;

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
    let spec =
        FenceSpec { hold: Duration::from_secs(3), regions: snap.map.regions.iter().map(|r| (r.id, r.epoch)).collect() };
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

fn logs(nodes: &[ClusterNode]) -> String {
    nodes.iter().map(ClusterNode::logs).collect()
}
