//! The metadata-store conformance suite against the in-memory store.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dpukv_cluster::conformance::must_conform;
use dpukv_cluster::fence::{CutOptions, FenceError, FenceHolder, FenceSpec, FenceStep, commit_txn, take_cut};
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

/// A store that counts the bytes of the keys and values its reads return.
#[derive(Clone)]
struct Counting {
    inner: MemStore,
    read: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Counting {
    fn count(&self, kvs: &[dpukv_cluster::KeyValue]) {
        let n: usize = kvs.iter().map(|kv| kv.key.len() + kv.value.len()).sum();
        self.read.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

type Ranged = dpukv_cluster::meta::Result<(Vec<dpukv_cluster::KeyValue>, i64)>;

impl MetaStore for Counting {
    async fn get(&self, key: &[u8]) -> dpukv_cluster::meta::Result<Option<dpukv_cluster::KeyValue>> {
        let kv = self.inner.get(key).await?;
        self.count(kv.as_slice());
        Ok(kv)
    }
    async fn range(&self, prefix: &[u8]) -> Ranged {
        let r = self.inner.range(prefix).await?;
        self.count(&r.0);
        Ok(r)
    }
    async fn range_except(&self, prefix: &[u8], except: &[u8]) -> Ranged {
        let r = self.inner.range_except(prefix, except).await?;
        self.count(&r.0);
        Ok(r)
    }
    async fn txn(&self, txn: dpukv_cluster::Txn) -> dpukv_cluster::meta::Result<dpukv_cluster::TxnResult> {
        self.inner.txn(txn).await
    }
    async fn delete_prefix(&self, prefix: &[u8]) -> dpukv_cluster::meta::Result<u64> {
        self.inner.delete_prefix(prefix).await
    }
    async fn grant(&self, ttl: Duration) -> dpukv_cluster::meta::Result<dpukv_cluster::LeaseId> {
        self.inner.grant(ttl).await
    }
    async fn keep_alive(&self, lease: dpukv_cluster::LeaseId) -> dpukv_cluster::meta::Result<()> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke(&self, lease: dpukv_cluster::LeaseId) -> dpukv_cluster::meta::Result<()> {
        self.inner.revoke(lease).await
    }
    async fn watch(&self, prefix: &[u8], from: i64) -> dpukv_cluster::meta::Result<dpukv_cluster::Watch> {
        self.inner.watch(prefix, from).await
    }
}

/// Every member loop reads the cluster's state (`master::read`) 20 times a second; the event
/// log beside it (up to ~256 events of a few hundred bytes) was read along every time, though
/// nothing there decides anything — tens of KB per read per node from etcd, at idle. It is left
/// out now.
#[tokio::test]
async fn reading_the_cluster_leaves_the_event_log_out() {
    let s = Counting { inner: MemStore::new(), read: Default::default() };
    let keys = Keys::new("events-apart").expect("keys");
    master::bootstrap_config(&s, &keys, &ClusterConfig::new(3, vec![])).await.expect("config");
    for id in 1..=3 {
        register(&s, &keys, &node(id), TIMING).await.expect("register");
    }
    master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("lay out");
    let before = master::read(&s, &keys).await.expect("read");
    let events = 256 * 300;
    for seq in 0..256 {
        s.put(&keys.event(seq), &[b'e'; 300], None).await.expect("an event");
    }
    s.read.store(0, std::sync::atomic::Ordering::Relaxed);
    let after = master::read(&s, &keys).await.expect("read");
    let read = s.read.load(std::sync::atomic::Ordering::Relaxed);
    assert!(read < 4096, "a read of a 3-node cluster's state took {read} bytes ({events} of them events)");
    assert_eq!((after.map.regions, after.map.nodes), (before.map.regions, before.map.nodes));
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
        fabric: String::new(),
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

/// Zones in the summary: three zones for three copies, every region's copies apart; a zone
/// lost (its only node gone), the region is short of a copy that the one node left — in a zone
/// the region has — cannot take (`zone_blocked`), until a node in a third zone comes.
#[tokio::test]
async fn the_health_says_when_zones_keep_a_region_short_of_a_copy() {
    let s = MemStore::new();
    let keys = Keys::new("zones").expect("keys");
    master::bootstrap_config(&s, &keys, &ClusterConfig::new(3, vec![])).await.expect("config");
    let zoned = |id: u32, zone: &str| NodeInfo { zone: zone.into(), ..node(id) };
    let mut members = Vec::new();
    for (id, zone) in [(1, "a"), (2, "b"), (3, "c"), (4, "a")] {
        members.push(register(&s, &keys, &zoned(id, zone), TIMING).await.expect("register"));
    }
    master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("lay out");
    let snap = master::read(&s, &keys).await.expect("read");
    let h = snap.health();
    assert_eq!((h.zones, h.zone_shared, h.zone_blocked, h.under_replicated), (3, 0, 0, 0), "{h:?}");
    // Zone c's only node goes: the node left without a copy is in zone a, which the region has.
    let r = &snap.map.regions[0];
    assert!(r.replicas().any(|n| n == 3), "zone c holds a copy: {r:?}");
    s.revoke(members[2].lease).await.expect("node 3's lease ends");
    for _ in 0..3 {
        master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("round");
    }
    let snap = master::read(&s, &keys).await.expect("read");
    let h = snap.health();
    let r = &snap.map.regions[0];
    assert!(!(r.replicas().any(|n| n == 1) && r.replicas().any(|n| n == 4)), "no two copies in zone a: {r:?}");
    assert_eq!((h.zones, h.zone_shared, h.under_replicated, h.zone_blocked), (2, 0, 1, 1), "{h:?}");
    // A node in a third zone: the region gets its copy there.
    register(&s, &keys, &zoned(5, "d"), TIMING).await.expect("register");
    master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("round");
    let h = master::read(&s, &keys).await.expect("read").health();
    assert_eq!((h.zones, h.zone_blocked), (3, 0), "{h:?}");
}

/// A store that can be taken down: while down, every request but lease keep-alives fails as
/// unavailable and open watches end with that error — an etcd outage whose leases survive (etcd
/// refreshes every lease when it comes back, so nodes need not register again).
#[derive(Clone)]
struct Outage {
    inner: MemStore,
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Outage {
    fn check(&self) -> dpukv_cluster::meta::Result<()> {
        if self.down.load(std::sync::atomic::Ordering::Acquire) {
            return Err(dpukv_cluster::MetaError::Unavailable("the store is down".into()));
        }
        Ok(())
    }
}

impl MetaStore for Outage {
    async fn get(&self, key: &[u8]) -> dpukv_cluster::meta::Result<Option<dpukv_cluster::KeyValue>> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn range(&self, prefix: &[u8]) -> dpukv_cluster::meta::Result<(Vec<dpukv_cluster::KeyValue>, i64)> {
        self.check()?;
        self.inner.range(prefix).await
    }
    async fn txn(&self, txn: dpukv_cluster::Txn) -> dpukv_cluster::meta::Result<dpukv_cluster::TxnResult> {
        self.check()?;
        self.inner.txn(txn).await
    }
    async fn delete_prefix(&self, prefix: &[u8]) -> dpukv_cluster::meta::Result<u64> {
        self.check()?;
        self.inner.delete_prefix(prefix).await
    }
    async fn grant(&self, ttl: Duration) -> dpukv_cluster::meta::Result<dpukv_cluster::LeaseId> {
        self.check()?;
        self.inner.grant(ttl).await
    }
    async fn keep_alive(&self, lease: dpukv_cluster::LeaseId) -> dpukv_cluster::meta::Result<()> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke(&self, lease: dpukv_cluster::LeaseId) -> dpukv_cluster::meta::Result<()> {
        self.check()?;
        self.inner.revoke(lease).await
    }
    async fn watch(&self, prefix: &[u8], from: i64) -> dpukv_cluster::meta::Result<dpukv_cluster::Watch> {
        self.check()?;
        let mut inner = self.inner.watch(prefix, from).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(dpukv_cluster::meta::WATCH_QUEUE + 1);
        let down = self.down.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    ev = inner.next() => match ev {
                        Some(ev) => if tx.send(ev).await.is_err() { return },
                        None => return,
                    },
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {
                        if down.load(std::sync::atomic::Ordering::Acquire) {
                            let _ = tx.send(Err(dpukv_cluster::MetaError::Unavailable("the store went down".into()))).await;
                            return;
                        }
                        if tx.is_closed() { return }
                    }
                }
            }
        });
        Ok(dpukv_cluster::Watch::new(rx))
    }
}

/// A master loop must outlive an outage of the metadata store: it once returned on the first
/// failed request (and every other candidate with it, when their watches ended), so after an
/// etcd restart nobody acted as master — a node that died afterwards never had its regions
/// failed over, while the election key (its lease alive) still named a master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_outlives_an_outage_of_the_store_and_fails_over_afterwards() {
    use dpukv_cluster::master::LoopStatus;
    use tokio_util::sync::CancellationToken;
    let s = Outage { inner: MemStore::new(), down: Default::default() };
    let keys = Keys::new("outage").expect("keys");
    master::bootstrap_config(&s, &keys, &ClusterConfig::new(3, vec![])).await.expect("config");
    let timing = Timing { ttl: Duration::from_secs(1), drift: 0.01, margin: Duration::from_millis(50) };
    let cancel = CancellationToken::new();
    let mut nodes = Vec::new();
    for id in 1..=3u32 {
        let m = register(&s, &keys, &node(id), timing).await.expect("register");
        let (s1, s2, k2, c1, c2) = (s.clone(), s.clone(), keys.clone(), cancel.clone(), cancel.clone());
        let (lease, status) = (m.lease, LoopStatus::default());
        let st = status.clone();
        let keeper = tokio::spawn(async move { m.keep_alive(&s1, timing, c1).await });
        let candidate =
            tokio::spawn(
                async move { master::run(&s2, &k2, lease, &node(id), Duration::from_millis(100), c2, st).await },
            );
        nodes.push((keeper, candidate, status));
    }
    let wait_for = |what: &'static str, f: Box<dyn Fn(&master::Snapshot) -> bool + Send>| {
        let (s, keys) = (s.clone(), keys.clone());
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                if let Ok(snap) = master::read(&s, &keys).await
                    && f(&snap)
                {
                    return snap;
                }
                assert!(std::time::Instant::now() < deadline, "{what} never happened");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let snap = wait_for("the layout", Box::new(|s| s.map.regions.len() == 1)).await;
    let victim = snap.map.regions[0].primary;
    // The outage: longer than the master's tick and every retry, shorter than nothing (leases
    // are kept alive through it, as etcd keeps them across a restart).
    s.down.store(true, std::sync::atomic::Ordering::Release);
    tokio::time::sleep(Duration::from_secs(2)).await;
    s.down.store(false, std::sync::atomic::Ordering::Release);
    for (id, (_, candidate, status)) in nodes.iter().enumerate() {
        assert!(!candidate.is_finished(), "node {}'s master loop ended in the outage", id + 1);
        assert!(status.running(), "node {} reports its loop running", id + 1);
    }
    let h = wait_for("a round after the outage", Box::new(|s| s.health().master_round_age_ms.is_some_and(|a| a < 500)))
        .await
        .health();
    assert!(h.master != 0, "a master is named: {h:?}");
    let master_status = &nodes[h.master as usize - 1].2;
    assert!(master_status.leading() && master_status.errors() > 0, "the master met the outage and goes on");
    // The primary's node dies after the outage: its region fails over.
    let (keeper, candidate, _) = &nodes[victim as usize - 1];
    keeper.abort();
    candidate.abort();
    let after = wait_for(
        "the failover",
        Box::new(move |s| s.map.regions[0].primary != victim && s.map.regions[0].primary != 0),
    )
    .await;
    assert!(snap.map.regions[0].backups.contains(&after.map.regions[0].primary), "a backup was promoted");
    cancel.cancel();
    for (keeper, candidate, _) in nodes {
        let _ = keeper.await;
        let _ = candidate.await;
    }
}

/// A primary's side of backup fences as the node runs it (`host::cluster::hold_fences`), with a
/// log that grows by 10 at each fence: what it holds, and the cut it reported for each.
struct FencedPrimary {
    node: u32,
    holder: FenceHolder,
    end: u64,
    holding: BTreeSet<(u64, u32)>,
    reported: BTreeMap<u32, u64>,
    /// Regions it says hold no live key.
    empty: BTreeSet<u32>,
}

impl FencedPrimary {
    fn new(node: u32) -> FencedPrimary {
        let mut holder = FenceHolder::default();
        holder.set_reporter(1000 + i64::from(node)); // its registration lease, as the node says it
        FencedPrimary {
            node,
            holder,
            end: 0,
            holding: BTreeSet::new(),
            reported: BTreeMap::new(),
            empty: BTreeSet::new(),
        }
    }

    /// One map poll: the steps the holder gave, carried out.
    async fn poll(&mut self, s: &MemStore, keys: &Keys) -> Vec<FenceStep> {
        let snap = master::read(s, keys).await.expect("read");
        let me = self.node;
        let leads = |r: u32| snap.map.regions.iter().find(|x| x.id == r && x.primary == me).map(|x| x.epoch);
        let steps = self.holder.poll(keys, &snap.fences, leads, Instant::now());
        for step in steps.clone() {
            match step {
                FenceStep::Fence { fence, region, epoch } => {
                    self.end += 10;
                    self.holding.insert((fence.id, region));
                    self.reported.insert(region, self.end);
                    let txn = self.holder.fenced(
                        keys,
                        &fence,
                        region,
                        (epoch, self.end, self.empty.contains(&region)),
                        Instant::now(),
                    );
                    s.txn(txn).await.expect("report");
                    self.holder.reported(fence.id, region);
                }
                FenceStep::Report { id, region, txn } => {
                    s.txn(txn).await.expect("report");
                    self.holder.reported(id, region);
                }
                FenceStep::Break { txn, .. } => {
                    s.txn(txn).await.expect("break");
                }
                FenceStep::Lift { id, region } => {
                    assert!(self.holding.remove(&(id, region)), "lifted what it held");
                }
            }
        }
        steps
    }
}

/// Three nodes, three regions (split at "h" and "p"), one copy each: (keys, members, primaries).
async fn three_regions(s: &MemStore, name: &str) -> (Keys, Vec<Member>, Vec<u32>) {
    let keys = Keys::new(name).expect("keys");
    let config = ClusterConfig::new(1, vec![b"h".to_vec(), b"p".to_vec()]);
    master::bootstrap_config(s, &keys, &config).await.expect("config");
    let mut members = Vec::new();
    for id in 1..=3 {
        members.push(register(s, &keys, &node(id), TIMING).await.expect("register"));
    }
    master::round(s, &keys, &always(), &mut Waits::default()).await.expect("lay out");
    let snap = master::read(s, &keys).await.expect("read");
    assert_eq!(snap.map.regions.len(), 3, "{:?}", snap.map);
    let mut primaries: Vec<u32> = snap.map.regions.iter().map(|r| r.primary).collect();
    primaries.sort_unstable();
    primaries.dedup();
    (keys, members, primaries)
}

/// A fence written by hand (as `take_cut` writes it) under a lease: (id, create revision, the
/// map's revision).
async fn fence_by_hand(s: &MemStore, keys: &Keys, id: u64, hold: Duration) -> (u64, i64, i64) {
    let snap = master::read(s, keys).await.expect("read");
    let spec =
        FenceSpec { hold, regions: snap.map.regions.iter().map(|r| (r.id, r.epoch)).collect(), check_empty: false };
    let lease = s.grant(Duration::from_secs(30)).await.expect("lease");
    let create = s.put(&keys.fence(id), &spec.encode(), Some(lease)).await.expect("fence");
    (id, create, snap.map.revision as i64)
}

/// A cut commits once every region's primary reported; its positions are the reports; every
/// primary lifts at its next poll, and nothing of the fence stays in the store.
#[tokio::test]
async fn a_cut_commits_on_every_primary_s_report_and_every_hold_is_lifted() {
    let s = MemStore::new();
    let (keys, _members, nodes) = three_regions(&s, "cut").await;
    let mut primaries: Vec<FencedPrimary> = nodes.iter().map(|&n| FencedPrimary::new(n)).collect();
    let done = std::sync::atomic::AtomicBool::new(false);
    let opts = CutOptions { hold: Duration::from_secs(5), attempts: 1, ..CutOptions::default() };
    let coordinator = async {
        let cut = take_cut(&s, &keys, opts).await;
        done.store(true, std::sync::atomic::Ordering::Release);
        cut
    };
    let polling = async {
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            for p in &mut primaries {
                p.poll(&s, &keys).await;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let (cut, ()) = tokio::join!(coordinator, polling);
    let cut = cut.expect("the cut commits");
    let reported: BTreeMap<u32, u64> = primaries.iter().flat_map(|p| p.reported.clone()).collect();
    assert_eq!(cut.positions, reported, "the cut is what the primaries reported");
    assert_eq!(cut.positions.len(), 3);
    // Each region's reporter is the lease its primary fenced under (a backup job checks it).
    for r in &cut.map.regions {
        assert_eq!(cut.reporters.get(&r.id), Some(&(1000 + i64::from(r.primary))), "region {}", r.id);
    }
    for p in &mut primaries {
        let steps = p.poll(&s, &keys).await;
        assert!(steps.iter().all(|s| matches!(s, FenceStep::Lift { .. })), "{steps:?}");
        assert!(p.holding.is_empty(), "node {} lifted every hold", p.node);
    }
    assert!(s.range(&keys.fences()).await.expect("range").0.is_empty(), "the fence and its reports are gone");
}

/// Nobody reports: the coordinator gives up after the hold, and the fence is gone with its
/// lease (a primary that sees it later has nothing to hold).
#[tokio::test]
async fn a_fence_no_primary_reports_fails_after_its_hold_and_leaves_nothing() {
    let s = MemStore::new();
    let (keys, _members, _) = three_regions(&s, "silent").await;
    let opts = CutOptions { hold: Duration::from_millis(100), attempts: 2, ..CutOptions::default() };
    let e = take_cut(&s, &keys, opts).await.expect_err("no reports");
    assert_eq!(e.code(), "fence_not_reported", "{e}");
    assert!(matches!(&e, FenceError::NotReported(r) if r.len() == 3), "{e:?}");
    assert!(s.range(&keys.fences()).await.expect("range").0.is_empty());
}

/// A primary whose hold ran out breaks the fence (deletes its key) and lifts at the next poll;
/// the commit can no longer apply, though every report is in.
#[tokio::test]
async fn a_fence_whose_hold_ran_out_is_broken_and_never_commits() {
    let s = MemStore::new();
    let (keys, _members, nodes) = three_regions(&s, "broken").await;
    let (id, create, map) = fence_by_hand(&s, &keys, 42, Duration::from_millis(100)).await;
    let mut primaries: Vec<FencedPrimary> = nodes.iter().map(|&n| FencedPrimary::new(n)).collect();
    for p in &mut primaries {
        p.poll(&s, &keys).await;
    }
    let snap = master::read(&s, &keys).await.expect("read");
    assert_eq!(snap.fences[0].reported.len(), 3, "every region reported");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let steps = primaries[0].poll(&s, &keys).await;
    assert!(steps.iter().any(|s| matches!(s, FenceStep::Break { id: i, .. } if *i == id)), "{steps:?}");
    assert!(!s.txn(commit_txn(&keys, id, create, map)).await.expect("txn").succeeded, "a broken fence never commits");
    for p in &mut primaries {
        p.poll(&s, &keys).await;
        assert!(p.holding.is_empty(), "node {} lifted", p.node);
    }
}

/// A region key changed after the map the fence was taken on (a failover, a repair, a split):
/// the commit does not apply. Unchanged, it does.
#[tokio::test]
async fn a_fence_commits_only_on_the_map_it_was_taken_on() {
    let s = MemStore::new();
    let (keys, _members, nodes) = three_regions(&s, "moved").await;
    let mut primaries: Vec<FencedPrimary> = nodes.iter().map(|&n| FencedPrimary::new(n)).collect();
    let (id, create, map) = fence_by_hand(&s, &keys, 42, Duration::from_secs(30)).await;
    for p in &mut primaries {
        p.poll(&s, &keys).await;
    }
    let region = master::read(&s, &keys).await.expect("read").map.regions[1].id;
    let kv = s.get(&keys.region(region)).await.expect("get").expect("region");
    s.put(&keys.region(region), &kv.value, None).await.expect("the region key rewritten");
    assert!(!s.txn(commit_txn(&keys, id, create, map)).await.expect("txn").succeeded, "the map moved");
    let (id, create, map) = fence_by_hand(&s, &keys, 43, Duration::from_secs(30)).await;
    assert!(s.txn(commit_txn(&keys, id, create, map)).await.expect("txn").succeeded, "the same map");
}

/// A node that restarted (a new holder) finds a fence its earlier life reported for a region it
/// still leads at the same epoch: it cannot know what it acknowledged since, so it breaks the
/// fence rather than let it commit.
#[tokio::test]
async fn a_restarted_primary_breaks_a_fence_its_earlier_life_reported() {
    let s = MemStore::new();
    let (keys, _members, nodes) = three_regions(&s, "restart").await;
    let (id, create, map) = fence_by_hand(&s, &keys, 42, Duration::from_secs(30)).await;
    let mut primaries: Vec<FencedPrimary> = nodes.iter().map(|&n| FencedPrimary::new(n)).collect();
    for p in &mut primaries {
        p.poll(&s, &keys).await;
    }
    let mut again = FencedPrimary::new(nodes[0]);
    let steps = again.poll(&s, &keys).await;
    assert!(matches!(steps.as_slice(), [FenceStep::Break { .. }]), "{steps:?}");
    assert!(!s.txn(commit_txn(&keys, id, create, map)).await.expect("txn").succeeded);
}

/// Takes a cut with `opts` while `primaries` poll, as the nodes would.
async fn cut_with(
    s: &MemStore,
    keys: &Keys,
    primaries: &mut [FencedPrimary],
    opts: CutOptions,
) -> Result<dpukv_cluster::fence::Cut, FenceError> {
    let done = std::sync::atomic::AtomicBool::new(false);
    let coordinator = async {
        let cut = take_cut(s, keys, opts).await;
        done.store(true, std::sync::atomic::Ordering::Release);
        cut
    };
    let polling = async {
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            for p in primaries.iter_mut() {
                p.poll(s, keys).await;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::join!(coordinator, polling).0
}

fn restore_plan() -> dpukv_cluster::restore::RestorePlan {
    use dpukv_cluster::restore::{PartRange, RestoreJob, RestorePlan};
    RestorePlan {
        job: RestoreJob { from: "file:///backups".into(), backup: "20261127T000000Z-0000000000000001".into() },
        parts: vec![
            PartRange { part: 7, start: vec![], end: Some(b"m".to_vec()) },
            PartRange { part: 9, start: b"m".to_vec(), end: None },
        ],
    }
}

/// A restore goes only into an empty cluster: its cut fails, naming the region, if one
/// primary says its region holds a key — and changes nothing. Into an empty one, the cut's
/// commit replaces the map by the backup's regions (new ids, its ranges, one primary each) and
/// writes the job; a second restore is refused while it is under way. The master ends it once
/// every region is open at its primary; a region whose primary died before any copy is given to
/// another node first.
#[tokio::test]
async fn a_restore_replaces_the_map_of_an_empty_cluster_only_and_the_master_ends_it() {
    use dpukv_cluster::restore::{self, RestoreReport, Step};
    let s = MemStore::new();
    let (keys, members, nodes) = three_regions(&s, "restore").await;
    let before = master::read(&s, &keys).await.expect("read");
    let mut primaries: Vec<FencedPrimary> = nodes.iter().map(|&n| FencedPrimary::new(n)).collect();
    // Every region empty but the one at "p".
    let full = before.map.regions.iter().find(|r| r.start == b"p").expect("region at p").id;
    for p in &mut primaries {
        p.empty = before.map.regions.iter().map(|r| r.id).filter(|&r| r != full).collect();
    }
    let opts = || CutOptions {
        hold: Duration::from_secs(5),
        attempts: 3,
        restore: Some(restore_plan()),
        ..CutOptions::default()
    };
    let e = cut_with(&s, &keys, &mut primaries, opts()).await.expect_err("a region holds a key");
    assert_eq!(e, FenceError::NotEmpty(vec![full]));
    assert_eq!(e.code(), "restore_cluster_not_empty");
    let after = master::read(&s, &keys).await.expect("read");
    assert_eq!(after.map.regions, before.map.regions, "a refused restore changes nothing");
    assert!(after.restore.is_none());
    // Empty everywhere: the map becomes the backup's.
    for p in &mut primaries {
        p.empty.insert(full);
    }
    let cut = cut_with(&s, &keys, &mut primaries, opts()).await.expect("the restore's cut");
    assert_eq!(cut.empty.len(), 3);
    let snap = master::read(&s, &keys).await.expect("read");
    let ranges: Vec<String> =
        snap.map.regions.iter().map(|r| format!("{} {:?}..{:?} +{}", r.id, r.start, r.end, r.backups.len())).collect();
    assert_eq!(
        ranges,
        vec![format!("4 {:?}..{:?} +0", b"", Some(b"m")), format!("5 {:?}..{:?} +0", b"m", None::<&[u8]>)]
    );
    let r = snap.restore.clone().expect("the restore is under way");
    assert_eq!(r.job, restore_plan().job);
    assert_eq!(r.regions.iter().map(|(id, rr)| (*id, rr.part)).collect::<Vec<_>>(), vec![(4, 7), (5, 9)]);
    assert!(snap.restoring(4) && snap.restoring(5) && !snap.restoring(1));
    let e = cut_with(&s, &keys, &mut primaries, opts()).await.expect_err("one at a time");
    assert!(matches!(&e, FenceError::Refused(m) if m.starts_with("restore_running")), "{e:?}");
    // Nothing opened yet: the master waits.
    let applied = master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("round");
    assert!(applied.restore_step.is_none(), "{applied:?}");
    // Region 4's primary dies before any copy: the region goes to a live node, epoch bumped.
    let dead = snap.map.region(4).expect("4").primary;
    s.revoke(members[dead as usize - 1].lease).await.expect("revoke");
    let applied = master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("round");
    let Some(Step::Reassign(moved)) = applied.restore_step else { panic!("{applied:?}") };
    assert_eq!((moved.id, moved.epoch), (4, 2));
    assert!(moved.primary != dead && moved.backups.is_empty());
    let r = master::read(&s, &keys).await.expect("read").restore.expect("under way");
    assert_eq!(r.regions[&4].fetch_by, Some(moved.primary), "the new primary fetches the part, whatever copy it holds");
    assert_eq!(r.regions[&5].fetch_by, None);
    // Both open at their primaries (rf 1: no copies to wait for): the restore ends.
    let snap = master::read(&s, &keys).await.expect("read");
    let r = snap.restore.clone().expect("under way");
    for region in [4, 5] {
        let primary = snap.map.region(region).expect("region").primary;
        let lease = members[primary as usize - 1].lease;
        let txn = restore::report_txn(&keys, &r, region, primary, &RestoreReport::Opened, lease);
        assert!(s.txn(txn).await.expect("report").succeeded);
        if region == 4 {
            let applied = master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("round");
            assert!(applied.restore_step.is_none(), "region 5 is not open yet: {applied:?}");
        }
    }
    let applied = master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("round");
    assert_eq!(applied.restore_step, Some(Step::End));
    let snap = master::read(&s, &keys).await.expect("read");
    assert!(snap.restore.is_none() && !snap.restoring(4));
    assert!(s.range(&keys.restores()).await.expect("range").0.is_empty(), "the restore's keys are gone");
    assert_eq!(snap.map.regions.len(), 2, "the backup's regions stay");
}

/// An abandoned restore leaves the cluster empty: its regions and keys go, and the master lays
/// out fresh regions under ids never used before.
#[tokio::test]
async fn an_aborted_restore_gives_back_an_empty_cluster_under_new_region_ids() {
    let s = MemStore::new();
    let (keys, _members, nodes) = three_regions(&s, "abort").await;
    let mut primaries: Vec<FencedPrimary> = nodes.iter().map(|&n| FencedPrimary::new(n)).collect();
    for p in &mut primaries {
        p.empty = [1, 2, 3].into();
    }
    let opts = CutOptions {
        hold: Duration::from_secs(5),
        attempts: 3,
        restore: Some(restore_plan()),
        ..CutOptions::default()
    };
    cut_with(&s, &keys, &mut primaries, opts).await.expect("the restore's cut");
    let snap = master::read(&s, &keys).await.expect("read");
    let txn = dpukv_cluster::restore::abort_txn(&keys, &snap).expect("a restore to abort");
    assert!(s.txn(txn).await.expect("abort").succeeded);
    master::round(&s, &keys, &always(), &mut Waits::default()).await.expect("lay out");
    let snap = master::read(&s, &keys).await.expect("read");
    assert!(snap.restore.is_none());
    let ids: Vec<u32> = snap.map.regions.iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![6, 7, 8], "fresh regions after every id used");
    assert!(s.range(&keys.restores()).await.expect("range").0.is_empty());
}
