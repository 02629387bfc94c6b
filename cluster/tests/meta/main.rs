//! The metadata-store conformance suite against the in-memory store.

use std::time::Duration;

use dpukv_cluster::conformance::must_conform;
use dpukv_cluster::keys::{ClusterConfig, Keys};
use dpukv_cluster::master::{self, Waits};
use dpukv_cluster::membership::{Member, Timing, register};
use dpukv_cluster::meta::Compare;
use dpukv_cluster::{MemStore, MetaStore};
use dpukv_proto::regionmap::NodeInfo;

#[tokio::test]
async fn the_memory_store_conforms() {
    must_conform(&MemStore::new(), b"/dpukv/test/", Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_fails_over_on_the_memory_store() {
    dpukv_cluster::conformance::must_fail_over(&MemStore::new(), "mem", Duration::from_secs(1)).await;
}

/// Three registered nodes (long leases, no keep-alives needed) and one region laid out with
/// three replicas; returns the keys, the members and the region's primary.
async fn laid_out(s: &MemStore) -> (Keys, Vec<Member>, u32) {
    let keys = Keys::new("handover").expect("keys");
    master::bootstrap_config(s, &keys, &ClusterConfig::new(3, vec![])).await.expect("config");
    let mut members = Vec::new();
    for id in 1..=3 {
        members.push(register(s, &keys, &node(id), TIMING).await.expect("register"));
    }
    master::round(s, &keys, &always(), &mut Waits::default()).await.expect("lay out");
    let snap = master::read(s, &keys).await.expect("read");
    assert_eq!(snap.map.regions.len(), 1, "one region");
    let p = snap.map.regions[0].primary;
    (keys, members, p)
}

const TIMING: Timing = Timing { ttl: Duration::from_secs(60), drift: 0.01, margin: Duration::from_millis(100) };

fn node(id: u32) -> NodeInfo {
    NodeInfo {
        id,
        device: format!("d{id}"),
        replication: format!("r{id}"),
        admin: format!("a{id}"),
        zone: String::new(),
    }
}

/// A fence that always holds (these tests run no election).
fn always() -> Compare {
    Compare::Absent(b"/no-such-key".to_vec())
}

/// The master planned a promotion from a snapshot in which the primary was gone; the primary
/// registered again before the transaction (and may be serving by a map it read since): the
/// promotion must not apply — or two nodes would serve the region.
#[tokio::test]
async fn a_promotion_planned_while_the_primary_was_away_does_not_apply_once_it_is_back() {
    let s = MemStore::new();
    let (keys, members, p) = laid_out(&s).await;
    s.revoke(members[p as usize - 1].lease).await.expect("the primary's lease ends");
    let before = master::read(&s, &keys).await.expect("read");
    let r = before.map.regions[0].clone();
    for &b in &r.backups {
        s.put(&keys.position_of(r.id, b), format!("{} 100", r.epoch).as_bytes(), None).await.expect("report");
    }
    let stale = master::read(&s, &keys).await.expect("read");
    assert!(!stale.map.nodes.iter().any(|n| n.id == p), "the snapshot has the primary gone");
    register(&s, &keys, &node(p), TIMING).await.expect("the primary registers again");
    let applied = master::apply(&s, &keys, &always(), &mut Waits::default(), stale).await.expect("apply");
    assert!(applied.changes.is_empty(), "nothing applied from the stale plan: {:?}", applied.changes);
    let after = master::read(&s, &keys).await.expect("read");
    assert_eq!((after.map.regions[0].primary, after.map.regions[0].epoch), (p, r.epoch), "the primary kept its region");
}

/// Moving a primary away from a live node (a drain's hand-over) leaves a handover key bound to
/// that node's lease: the new primary may not serve while it exists, and it goes once the old
/// primary deletes it — or its lease ends.
#[tokio::test]
async fn a_primary_moved_off_a_live_node_waits_for_it_to_release_the_region() {
    let s = MemStore::new();
    let (keys, members, p) = laid_out(&s).await;
    s.put(&keys.drain(p), b"", None).await.expect("drain the primary's node");
    master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("round");
    let snap = master::read(&s, &keys).await.expect("read");
    let r = &snap.map.regions[0];
    assert!(r.primary != p && !r.replicas().any(|n| n == p), "handed over and left: {r:?}");
    assert_eq!(snap.unreleased(r.id, r.primary), Some(p), "the new primary waits for the old one");
    assert_eq!(snap.unreleased(r.id, p), None, "a node does not wait for itself");
    let kv = s.get(&keys.handover(r.id, p)).await.expect("get").expect("the handover key");
    assert_eq!(kv.lease, Some(members[p as usize - 1].lease), "bound to the old primary's lease");
    assert_eq!(kv.value, r.epoch.to_string().as_bytes(), "naming the new epoch");
    s.revoke(members[p as usize - 1].lease).await.expect("the old primary's lease ends");
    let snap = master::read(&s, &keys).await.expect("read");
    assert_eq!(snap.unreleased(r.id, r.primary), None, "a node whose lease ended serves nothing");
}

/// The summary the admin API and the operator's status show: regions without a live primary,
/// and regions short of the copies the live nodes allow.
#[tokio::test]
async fn the_health_counts_regions_without_a_primary_or_short_of_copies() {
    let s = MemStore::new();
    let (keys, members, p) = laid_out(&s).await;
    let h = master::read(&s, &keys).await.expect("read").health();
    assert_eq!((h.nodes, h.regions, h.without_primary, h.under_replicated), (3, 1, 0, 0), "{h:?}");
    let snap = master::read(&s, &keys).await.expect("read");
    let b = snap.map.regions[0].backups[0];
    s.revoke(members[b as usize - 1].lease).await.expect("a backup's lease ends");
    let h = master::read(&s, &keys).await.expect("read").health();
    // Two live nodes hold two copies: all the live nodes allow.
    assert_eq!((h.nodes, h.without_primary, h.under_replicated), (2, 0, 0), "{h:?}");
    master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("the master drops it");
    register(&s, &keys, &node(b), TIMING).await.expect("it returns, holding nothing");
    let h = master::read(&s, &keys).await.expect("read").health();
    assert_eq!((h.nodes, h.without_primary, h.under_replicated), (3, 0, 1), "three live nodes, two copies: {h:?}");
    // Draining the node without a copy: two nodes are left to hold copies, and they do.
    s.put(&keys.drain(b), b"", None).await.expect("drain");
    let h = master::read(&s, &keys).await.expect("read").health();
    assert_eq!((h.nodes, h.without_primary, h.under_replicated), (3, 0, 0), "a drain is not a loss: {h:?}");
    s.delete(&keys.drain(b)).await.expect("lift the drain");
    s.revoke(members[p as usize - 1].lease).await.expect("the primary's lease ends");
    let h = master::read(&s, &keys).await.expect("read").health();
    assert_eq!((h.nodes, h.without_primary, h.under_replicated), (2, 1, 1), "{h:?}");
}
