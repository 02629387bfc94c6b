//! The faults a production cluster sees every week, each as a deterministic regression test on
//! real processes and a real etcd (docs/cluster.md, "Fault model"): etcd outages, stuck and
//! partitioned backups, full disks, power loss of every replica, nodes that come back on new
//! addresses. Each test names the defect it once caught.

use std::time::{Duration, Instant};

use dpukv_e2e::cluster::{ClusterNode, must_see_map, put_routed};
use dpukv_e2e::etcd::Etcd;
use dpukv_proto::regionmap::RegionMap;

/// The node flags of these tests: a 1 s lease, three replicas, every write synced.
const ARGS: [&str; 6] = ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--fsync", "always"];

fn env_or(var: &str, default: u64) -> u64 {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn logs(nodes: &[ClusterNode]) -> String {
    nodes.iter().map(ClusterNode::logs).collect()
}

/// The keys of `acked` (key, value written) that `c` does not read back with their value (each
/// get retried for 10 s while it fails: the region may be failing over).
async fn lost_writes(c: &dpukv_client::Client, acked: &[(String, String)]) -> Vec<String> {
    let mut lost = Vec::new();
    for (k, v) in acked {
        let mut got = c.get(k.as_bytes()).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.is_err() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            got = c.get(k.as_bytes()).await;
        }
        if got.as_ref().ok().and_then(|g| g.as_deref()) != Some(v.as_bytes()) {
            lost.push(k.clone());
        }
    }
    lost
}

/// Every region has a live primary and `copies - 1` backups, and every node is registered.
fn whole(nodes: usize, copies: usize) -> impl Fn(&RegionMap) -> bool {
    move |m: &RegionMap| {
        m.nodes.len() == nodes
            && !m.regions.is_empty()
            && m.regions.iter().all(|r| m.node(r.primary).is_some() && r.backups.len() + 1 == copies)
    }
}

/// Writes `key` through whoever leads its region until one is acknowledged; the time it took.
async fn first_ack(nodes: &[ClusterNode], alive: impl Fn(&ClusterNode) -> bool, key: &[u8]) -> Duration {
    let t = Instant::now();
    let asked: Vec<&ClusterNode> = nodes.iter().filter(|n| alive(n)).collect();
    if let Err(e) = put_routed(&asked, key, b"after", Duration::from_secs(30)).await {
        panic!("no write to {} was acknowledged: {e}\n{}", String::from_utf8_lossy(key), logs(nodes));
    }
    t.elapsed()
}

/// An etcd outage once stopped failover for good: the master loop (and every candidate's
/// campaign) returned on the first failed request, while the node leases survived etcd's
/// restart — so nobody ran for master again, `/cluster/summary` still named one, and a primary
/// that died afterwards never had its region failed over. Now: etcd stopped 10 s
/// (`DPUKV_ETCD_OUTAGE_SECONDS`) and started again, then a primary's pod SIGKILLed — a write to
/// its region is acknowledged again within 3 s of the kill; `DPUKV_ETCD_OUTAGE_ITERATIONS`
/// times (default 2; the acceptance run is 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_etcd_outage_a_dead_primary_still_fails_over_within_3_s() {
    let (outage, iterations) = (env_or("DPUKV_ETCD_OUTAGE_SECONDS", 10), env_or("DPUKV_ETCD_OUTAGE_ITERATIONS", 2));
    let mut etcd = Etcd::start().expect("etcd");
    let mut nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "faults", &etcd.url(), &ARGS).expect("node")).collect();
    let mut failovers = Vec::new();
    for i in 0..iterations {
        let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), whole(3, 3)).await;
        etcd.stop();
        tokio::time::sleep(Duration::from_secs(outage)).await;
        etcd.resume().expect("etcd again");
        // The cluster is whole again (no failover happened: nobody's lease ended) and a master
        // completed a round after the outage.
        let map_after = must_see_map(&nodes, |_| true, Duration::from_secs(30), whole(3, 3)).await;
        let region = map.regions[0].id;
        let victim = map_after.region(region).expect("the region").primary;
        let summary_ok = |n: &ClusterNode| {
            n.admin_get("/cluster/summary").ok().is_some_and(|s| {
                let age = s.split("\"master_round_age_ms\": ").nth(1).and_then(|r| r.split(',').next());
                age.and_then(|a| a.trim().parse::<u64>().ok()).is_some_and(|a| a < 2000)
            })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !nodes.iter().any(summary_ok) {
            assert!(Instant::now() < deadline, "no master completed a round after the outage\n{}", logs(&nodes));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let key = map_after.region(region).expect("the region").start.clone();
        let key = if key.is_empty() { b"a".to_vec() } else { key };
        let killed = Instant::now();
        nodes[victim as usize - 1].kill();
        let took = first_ack(&nodes, |n| n.id != victim, &key).await;
        let since_kill = killed.elapsed().min(took + Duration::from_millis(1));
        eprintln!("iteration {i}: node {victim} killed; its region acknowledged a write after {since_kill:?}");
        failovers.push(since_kill);
        nodes[victim as usize - 1].resume().expect("restart the killed pod");
    }
    failovers.sort();
    eprintln!("failovers after an etcd outage: {failovers:?}");
    assert!(
        failovers.iter().all(|d| *d <= Duration::from_secs(3)),
        "a region took more than 3 s to acknowledge a write after its primary died: {failovers:?}\n{}",
        logs(&nodes)
    );
}

/// The health as `/cluster/summary` reports it at `n`: (without a primary, under-replicated).
fn summary(n: &ClusterNode) -> Option<(u64, u64)> {
    let s = n.admin_get("/cluster/summary").ok()?;
    let field = |name: &str| -> Option<u64> {
        s.split(&format!("\"{name}\": ")).nth(1)?.split([',', '}']).next()?.trim().parse().ok()
    };
    Some((field("without_primary")?, field("under_replicated")?))
}

/// A backup whose disk is full once held up every write of its regions: it kept its lease, so
/// nothing took it out of the write set; each write waited 5 s and ended `outcome_unknown`. Now
/// its primary reports it stalled and the master demotes it: writes are acknowledged again within
/// 5 s of the fill, the region reports under-replicated, and once space is freed the node
/// catches up and is a backup again — with no acknowledged write lost (checked after a failover
/// to a healed copy too). Needs root (the backup's disk is a 48 MiB tmpfs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_with_a_full_disk_leaves_the_write_set_and_rejoins_once_space_is_freed() {
    use dpukv_client::Client;
    let etcd = Etcd::start().expect("etcd");
    let mut nodes: Vec<ClusterNode> =
        (1..=2).map(|id| ClusterNode::start(id, "faults", &etcd.url(), &ARGS).expect("node")).collect();
    nodes.push(ClusterNode::start_on_small_disk(3, "faults", &etcd.url(), &ARGS, 48).expect("node 3"));
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), whole(3, 3)).await;
    let region = map.regions[0].clone();
    assert_ne!(region.primary, 3, "node 3 is a backup (the first layout leads from the lowest id): {region:?}");
    let primary = map.node(region.primary).expect("registered").device.clone();
    let c = Client::connect(&primary, 2).await.expect("connect");
    let mut acked: Vec<(String, String)> = Vec::new();
    for i in 0..200u32 {
        let (k, v) = (format!("before{i:04}"), format!("v{i}-{}", "x".repeat(500)));
        c.put(k.as_bytes(), v.as_bytes()).await.expect("a write before the fill");
        acked.push((k, v));
    }
    let filled = nodes[2].fill_disk().expect("fill the disk");
    let fill = Instant::now();
    eprintln!("filled node 3's disk with {} MiB", filled >> 20);
    // Writes go on; the first one issued after the fill is acknowledged within 5 s.
    let mut first = None;
    let mut i = 0u32;
    while fill.elapsed() < Duration::from_secs(8) || first.is_none() {
        let (k, v) = (format!("during{i:05}"), format!("v{i}-{}", "y".repeat(500)));
        match c.put(k.as_bytes(), v.as_bytes()).await {
            Ok(_) => {
                first.get_or_insert(fill.elapsed());
                acked.push((k, v));
            }
            Err(e) => panic!("write {i} after the fill failed: {e}\n{}", logs(&nodes)),
        }
        i += 1;
        assert!(fill.elapsed() < Duration::from_secs(30), "no write acknowledged after the fill\n{}", logs(&nodes));
    }
    let first = first.expect("set");
    eprintln!("after the fill: first write acknowledged after {first:?}, {i} writes in all");
    assert!(first <= Duration::from_secs(5), "writes were held up {first:?} by the full backup\n{}", logs(&nodes));
    let now = must_see_map(&nodes, |_| true, Duration::from_secs(10), |_| true).await;
    let r = now.region(region.id).expect("the region");
    assert!(!r.backups.contains(&3) && r.epoch > region.epoch, "node 3 left the write set: {r:?}");
    assert_eq!(summary(&nodes[0]).map(|s| s.1), Some(1), "the region reports under-replicated");
    assert_eq!(nodes[0].metric("dpukv_cluster_regions_under_replicated").expect("metrics"), Some(1.0));
    // Space comes back: node 3 catches up and is a backup again.
    nodes[2].free_disk().expect("free the disk");
    let healed = Instant::now();
    must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.region(region.id).is_some_and(|r| r.backups.contains(&3) && r.backups.len() == 2),
    )
    .await;
    eprintln!("node 3 was a backup again {:?} after space was freed", healed.elapsed());
    let deadline = Instant::now() + Duration::from_secs(10);
    while summary(&nodes[0]) != Some((0, 0)) {
        assert!(Instant::now() < deadline, "the region is whole again: {:?}", summary(&nodes[0]));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // No acknowledged write is lost — also after the primary dies and a backup takes over.
    let old = region.primary;
    nodes[old as usize - 1].kill();
    let after = must_see_map(
        &nodes,
        |n| n.id != old,
        Duration::from_secs(30),
        |m| m.region(region.id).is_some_and(|r| r.primary != old && m.node(r.primary).is_some()),
    )
    .await;
    let p = after.region(region.id).expect("region").primary;
    let c = Client::connect(&after.node(p).expect("registered").device, 2).await.expect("connect");
    let lost = lost_writes(&c, &acked).await;
    assert!(
        lost.is_empty(),
        "{} acknowledged writes lost (node {p} leads now): {:?}\n{}",
        lost.len(),
        &lost[..lost.len().min(10)],
        logs(&nodes)
    );
}

/// A backup that dies and comes back on a new replication port before the master notices
/// (found black-box: `dpukv local` restarts a killed host 0.5 s later on a fresh port) once left
/// its regions unwritable for minutes: the master saw it alive and changed nothing, and the
/// primaries kept dialling the old address. Now senders follow a node's current registration.
/// Deterministic here: the master (started first, with a 5 s lease) is paused across the
/// backup's kill, its old (1 s) lease's end and its new registration (at least 1.5 s); stall reports are off, so
/// only following the new address can bring the writes back — within seconds of the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_back_on_a_new_port_before_the_master_noticed_gets_its_streams_again() {
    use dpukv_client::Client;
    let etcd = Etcd::start().expect("etcd");
    let args = |lease: &'static str| {
        vec!["--lease-ttl-ms", lease, "--replication-factor", "3", "--fsync", "always", "--split-keys", "d,j,p"]
            .into_iter()
            .chain(["--stall-timeout-ms", "0"])
            .collect::<Vec<_>>()
    };
    let mut nodes = vec![ClusterNode::start(1, "faults", &etcd.url(), &args("5000")).expect("node 1")];
    // Node 1 campaigns alone, so it is the master.
    let deadline = Instant::now() + Duration::from_secs(30);
    while nodes[0].admin_get("/cluster/summary").ok().is_none_or(|s| !s.starts_with("{\"master\": 1,")) {
        assert!(Instant::now() < deadline, "node 1 never became master\n{}", logs(&nodes));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in 2..=4 {
        nodes.push(ClusterNode::start(id, "faults", &etcd.url(), &args("1000")).expect("node"));
    }
    // A region the master holds no copy of (four nodes, three copies each).
    let map = must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(90),
        |m| {
            m.master == 1
                && m.nodes.len() == 4
                && m.regions.len() == 4
                && m.regions.iter().all(|r| m.node(r.primary).is_some() && r.backups.len() == 2 && r.joining.is_empty())
                && m.regions.iter().any(|r| !r.replicas().any(|n| n == 1))
        },
    )
    .await;
    let region = map.regions.iter().find(|r| !r.replicas().any(|n| n == 1)).expect("a region").clone();
    let (p, b) = (region.primary, region.backups[0]);
    let key = if region.start.is_empty() { b"a".to_vec() } else { region.start.clone() };
    let c = Client::connect(&map.node(p).expect("primary").device, 1).await.expect("connect");
    c.put(&key, b"before").await.expect("a write before");
    // Pause the master, kill the backup and start it again at once (a new replication port).
    nodes[0].signal("STOP", false).expect("pause the master");
    let paused = Instant::now();
    nodes[b as usize - 1].kill();
    nodes[b as usize - 1].resume().expect("restart the backup");
    let restarted = Instant::now();
    let writer = {
        let (c, key) = (c.clone(), key.clone());
        tokio::spawn(async move {
            loop {
                if c.put(&key, b"after").await.is_ok() {
                    return Instant::now();
                }
            }
        })
    };
    // The master stays paused until the backup has registered again — which waits for its old
    // lease to end — and at least 1.5 s: it must never see the backup gone. (A fixed 1.5 s pause
    // was not enough on a loaded machine, where the restart took 2.4 s: the master then saw the
    // node gone and changed the region, and the test's premise did not hold.)
    let registered_again = |n: &ClusterNode| n.logs().matches("registered node=").count() >= 2;
    // (Within 4.5 s: the master's own 5 s lease must outlast its pause.)
    while paused.elapsed() < Duration::from_millis(1500) || !registered_again(&nodes[b as usize - 1]) {
        assert!(
            paused.elapsed() < Duration::from_millis(4500),
            "the backup did not register again in time\n{}",
            logs(&nodes)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nodes[0].signal("CONT", false).expect("resume the master");
    let acked = tokio::time::timeout(Duration::from_secs(20), writer).await;
    let after = must_see_map(&nodes, |_| true, Duration::from_secs(10), |_| true).await;
    let r = after.region(region.id).expect("the region");
    let acked = match acked {
        Ok(Ok(t)) => t.duration_since(restarted),
        _ => panic!("no write to the region was acknowledged within 20 s of the restart: {r:?}\n{}", logs(&nodes)),
    };
    eprintln!("node {b} restarted on a new port; a write to region {} acknowledged {acked:?} later", region.id);
    assert_eq!(r.epoch, region.epoch, "the master changed nothing (it never saw the backup gone): {r:?}");
    // Without following the new address the writes never come back (the 20 s above); the bound
    // is far from that, and loose enough for a loaded machine, where the restart alone — a 1 s
    // lease to expire, regions to open — took 2.4 s once (and the acknowledgement 3.8 s).
    assert!(acked <= Duration::from_secs(10), "writes came back {acked:?} after the restart\n{}", logs(&nodes));
}

/// Power loss of every replica at once once lost acknowledged writes: a backup said it held a
/// write before its copy was on disk, and after the cut a backup was promoted without the
/// acknowledged tail (the returning old primary then deleted the only synced copy). Now, under
/// `--fsync always`, a backup syncs before it says it holds, and a restarted copy resumes from
/// the valid records it kept. Three pods with their files under the fault journal take writes
/// from concurrent clients; all three lose power at a seeded moment; each disk keeps only what
/// a real one might; two come back first — the third region's primary stays off until a backup
/// took its region over, which is the case that lost writes — then the third; every
/// acknowledged write is read back.
/// `DPUKV_POWERLOSS_SEEDS` runs (default 3; the acceptance run is 30), `DPUKV_POWERLOSS_SEED`
/// the first seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_loss_of_every_replica_loses_no_acknowledged_write() {
    use std::sync::{Arc, Mutex};

    use dpukv_client::Client;
    let (runs, first) = (env_or("DPUKV_POWERLOSS_SEEDS", 3), env_or("DPUKV_POWERLOSS_SEED", 1));
    let etcd = Etcd::start().expect("etcd");
    let mut args = ARGS.to_vec();
    args.extend(["--split-keys", "g,p"]);
    let mut nodes: Vec<ClusterNode> = (1..=3)
        .map(|id| {
            ClusterNode::start_with(id, "faults", &etcd.url(), &args, &[], &[("DPUKV_FAULT_JOURNAL", "1")])
                .expect("node")
        })
        .collect();
    type Acked = Arc<Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;
    let acked: Acked = Arc::default();
    for seed in first..first + runs {
        must_see_map(&nodes, |_| true, Duration::from_secs(90), whole(3, 3)).await;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        for w in 0..4u64 {
            let (acked, stop, seed_node) = (acked.clone(), stop.clone(), nodes[w as usize % 3].device.clone());
            writers.push(tokio::spawn(async move {
                let Ok(c) = Client::connect(&seed_node, 2).await else { return };
                for i in 0u64.. {
                    if stop.load(std::sync::atomic::Ordering::Acquire) {
                        return;
                    }
                    // Keys spread over the three regions (split at g and p).
                    let k = format!("{}{seed:03}-{w}-{i:06}", ["c", "k", "t"][(i % 3) as usize]).into_bytes();
                    let v = format!("{seed}/{w}/{i}/{}", "v".repeat((i % 200) as usize)).into_bytes();
                    match tokio::time::timeout(Duration::from_secs(3), c.put(&k, &v)).await {
                        Ok(Ok(_)) => acked.lock().expect("lock").push((k, v)),
                        _ => return,
                    }
                }
            }));
        }
        // The cut comes at a seeded moment, 0.3-1.5 s into the writes.
        let at = Duration::from_millis(300 + (seed * 7919) % 1200);
        tokio::time::sleep(at).await;
        for n in nodes.iter_mut() {
            n.kill();
        }
        stop.store(true, std::sync::atomic::Ordering::Release);
        for w in writers {
            let _ = w.await;
        }
        for n in nodes.iter_mut() {
            let report = n.power_cut(seed * 10 + u64::from(n.id)).expect("power cut");
            let dropped = report.lines().filter(|l| l.contains("dropped")).count();
            eprintln!("seed {seed}: node {} cut at {at:?} ({dropped} report lines about dropped data)", n.id);
        }
        // The primary of one region (the seed says which) comes back last: its region is taken
        // over by a backup whose copy is all there is.
        let late = (seed % 3) as u32 + 1;
        for n in nodes.iter_mut().filter(|n| n.id != late) {
            n.resume().expect("power back on");
        }
        let taken_over = move |m: &RegionMap| {
            m.nodes.len() == 2
                && !m.regions.is_empty()
                && m.regions.iter().all(|r| r.primary != late && m.node(r.primary).is_some())
        };
        must_see_map(&nodes, |n| n.id != late, Duration::from_secs(90), taken_over).await;
        nodes[late as usize - 1].resume().expect("power back on");
        let map = must_see_map(&nodes, |_| true, Duration::from_secs(90), whole(3, 3)).await;
        let c =
            Client::connect(&map.node(map.regions[0].primary).expect("a primary").device, 2).await.expect("connect");
        let acked = acked.lock().expect("lock").clone();
        let mut lost = Vec::new();
        for (k, v) in &acked {
            let mut got = c.get(k).await;
            let deadline = Instant::now() + Duration::from_secs(20);
            while got.is_err() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
                got = c.get(k).await;
            }
            if got.as_ref().ok().and_then(|g| g.as_deref()) != Some(v.as_slice()) {
                lost.push(String::from_utf8_lossy(k).into_owned());
            }
        }
        eprintln!("seed {seed}: {} acknowledged writes in all, {} lost", acked.len(), lost.len());
        assert!(
            lost.is_empty(),
            "seed {seed}: {} of {} acknowledged writes lost after a power loss of every replica: {:?}\n{}",
            lost.len(),
            acked.len(),
            &lost[..lost.len().min(10)],
            logs(&nodes)
        );
    }
}

/// Through the gateway, writes alone once took ~7 s to move off a paused primary: the master
/// promoted a backup after about its lease, but the gateway kept sending writes to the old
/// device, which forwarded them to its stopped host; the map was learned again only when they
/// timed out, and every 5 s. Now the device refuses writes once its host stops vouching for its
/// map (and fails the ones it forwarded), so the gateway looks the map up again at once: with
/// the primary's host SIGSTOPped (10 s) and only writes coming in, a write is acknowledged by
/// the new primary within 3 s of the stop, and none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_the_gateway_move_off_a_paused_primary_within_3_s() {
    use dpukv_client::Client;
    let etcd = Etcd::start().expect("etcd");
    let nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "faults", &etcd.url(), &ARGS).expect("node")).collect();
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), whole(3, 3)).await;
    let (region, p) = (map.regions[0].clone(), map.regions[0].primary);
    if p == map.master {
        eprintln!("(node {p} is the primary and the master: the master's pause adds its lease to the failover)");
    }
    let seeds: Vec<&str> = nodes.iter().map(|n| n.device.as_str()).collect();
    let gw = dpukv_e2e::gateway::Gateway::start(&seeds, &[]).expect("gateway");
    let c = Client::connect(&gw.binary, 1).await.expect("connect to the gateway");
    let mut acked = Vec::new();
    for i in 0..50u32 {
        let k = format!("w{i:05}");
        c.put(k.as_bytes(), b"v").await.expect("a write before the pause");
        acked.push(k);
    }
    // (key, when it was sent, when it was acknowledged)
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant, Instant)>();
    let writer = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut errors = 0;
            for i in 50u32.. {
                let k = format!("w{i:05}");
                let t = Instant::now();
                match c.put(k.as_bytes(), b"v").await {
                    Ok(_) => {
                        if tx.send((k, t, Instant::now())).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        errors += 1;
                        if errors <= 5 {
                            eprintln!("write {k} failed after {:?}: {e}", t.elapsed());
                        }
                    }
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    while let Ok((k, _, _)) = rx.try_recv() {
        acked.push(k);
    }
    nodes[p as usize - 1].signal("STOP", false).expect("pause the primary's host");
    let stopped = Instant::now();
    let mut first = None;
    while stopped.elapsed() < Duration::from_secs(10) {
        match tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
            Ok(Some((k, sent, at))) => {
                // A write sent after the stop can only have been acknowledged by a new primary.
                if sent > stopped {
                    first.get_or_insert(at - stopped);
                }
                acked.push(k);
            }
            Ok(None) => break,
            Err(_) => {}
        }
    }
    nodes[p as usize - 1].signal("CONT", false).expect("resume the host");
    writer.abort();
    while let Ok((k, _, _)) = rx.try_recv() {
        acked.push(k);
    }
    let first = first.unwrap_or_else(|| panic!("no write acknowledged in 10 s\n{}{}", logs(&nodes), gw.logs()));
    eprintln!(
        "node {p}'s host paused: first write through the gateway acknowledged {first:?} later; {} in all",
        acked.len()
    );
    let after = must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(30),
        |m| m.region(region.id).is_some_and(|r| r.primary != p && m.node(r.primary).is_some()),
    )
    .await;
    assert!(after.region(region.id).expect("region").epoch > region.epoch, "a backup was promoted");
    let mut lost = Vec::new();
    for k in &acked {
        if c.get(k.as_bytes()).await.ok().flatten().as_deref() != Some(&b"v"[..]) {
            lost.push(k.clone());
        }
    }
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    assert!(
        first <= Duration::from_secs(3),
        "writes through the gateway came back {first:?} after the primary paused\n{}",
        gw.logs()
    );
}

/// A drain around a backup the primary cannot reach (packets from the primary to it dropped)
/// once froze: the primary's sender to that backup sat in a blocking write that ignored its stop
/// flag, and the primary's member loop waited for it when it handed the region over
/// (`handovers_waiting` stayed 1 until TCP gave up, ~15 minutes). Now writes on replication
/// links look at their stop flag and time out, nothing in the member loop waits for a sender,
/// and the stalled backup leaves the write set: the drain completes within 10 s while a client
/// writes. Four pods in network namespaces; needs root, `ip` and `nft`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_completes_within_10_s_around_a_one_way_partition_from_the_primary_to_a_backup() {
    use dpukv_e2e::netns::Net;
    // Declared first: dropped last, after every process in its namespaces is gone.
    let net = Net::new(&[2, 11, 12, 13, 14]).expect("network namespaces (root, iproute2 and nftables)");
    let host = |id: u32| 10 + id as u8;
    let etcd = Etcd::start_in(net.exec_prefix(2), &net.addr(2)).expect("etcd");
    let nodes: Vec<ClusterNode> = (1..=4)
        .map(|id| {
            ClusterNode::start_in(id, "faults", &etcd.url(), &ARGS, net.exec_prefix(host(id)), &net.addr(host(id)))
                .expect("node")
        })
        .collect();
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(90), whole(4, 3)).await;
    let region = map.regions[0].clone();
    let (p, b) = (region.primary, region.backups[0]);
    let others: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != p).collect();
    // Clients write 64 KiB values throughout (through whoever leads): the log grows well past
    // what the cut-off backup's socket buffers hold, so the primary's sender to it blocks.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let (stop, seed) = (stop.clone(), nodes[w as usize % 4].device.clone());
        writers.push(tokio::spawn(async move {
            let c = dpukv_client::Client::connect(&seed, 1).await.expect("connect");
            let value = vec![b'v'; 64 << 10];
            let mut acked = 0u64;
            for i in 0u64.. {
                if stop.load(std::sync::atomic::Ordering::Acquire) {
                    break;
                }
                if c.put(format!("d{w}-{i:06}").as_bytes(), &value).await.is_ok() {
                    acked += 1;
                }
            }
            acked
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    net.cut(host(p), host(b)).expect("cut the primary's packets to a backup");
    // Until the backup left the write set (stalled) and the log went on without it.
    must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(30),
        |m| m.region(region.id).is_some_and(|r| !r.backups.contains(&b)),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let asked = Instant::now();
    others[0].admin_post(&format!("/cluster/drain/{p}")).expect("drain request");
    let deadline = asked + Duration::from_secs(30);
    loop {
        let status = others[0].admin_get(&format!("/cluster/drain/{p}")).unwrap_or_default();
        if status.contains("\"done\": true") {
            break;
        }
        assert!(Instant::now() < deadline, "the drain did not complete in 30 s: {status}\n{}", logs(&nodes));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Done in the map; the new primary serves once the old one released the region (a frozen
    // member loop never did): a write is acknowledged through the others.
    let key = if region.start.is_empty() { b"a".to_vec() } else { region.start.clone() };
    first_ack(&nodes, |n| n.id != p, &key).await;
    let took = asked.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Release);
    let mut acked = 0;
    for w in writers {
        acked += w.await.expect("writer");
    }
    eprintln!(
        "node {p} drained, and a write acknowledged by the new primary, {took:?} after the request (its packets to node {b} dropped); {acked} writes acknowledged"
    );
    net.uncut(host(p)).expect("uncut");
    assert!(took <= Duration::from_secs(10), "the drain took {took:?}\n{}", logs(&nodes));
    assert!(acked > 0, "writes went on");
}

/// A backup dropped from its region while away (its host paused past its lease) deletes its copy
/// when it resumes and is given the region back as a joining node — and was reported caught up
/// at once: its primary judged it by the positions the node's earlier session had reported. It
/// became a backup with an empty copy and, promoted, lost the region's acknowledged writes (the
/// nemesis found it). Now a node that joins anew, and every new session, starts from what the
/// node says it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_dropped_while_away_is_caught_up_only_once_it_holds_the_log_again() {
    use dpukv_client::Client;
    let etcd = Etcd::start().expect("etcd");
    let mut nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "faults", &etcd.url(), &ARGS).expect("node")).collect();
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), whole(3, 3)).await;
    let region = map.regions[0].clone();
    let (p, b, other) = (region.primary, region.backups[0], region.backups[1]);
    if b == map.master {
        eprintln!("(node {b} is also the master)");
    }
    let c = Client::connect(&map.node(p).expect("primary").device, 2).await.expect("connect");
    let value = vec![b'x'; 16 << 10];
    let mut acked = Vec::new();
    for i in 0..600u32 {
        let k = format!("r{i:05}");
        c.put(k.as_bytes(), &value).await.expect("a write");
        acked.push(k);
    }
    // The backup's host is away past its lease: dropped from the region.
    nodes[b as usize - 1].signal("STOP", false).expect("pause");
    must_see_map(
        &nodes,
        |n| n.id != b,
        Duration::from_secs(30),
        |m| m.region(region.id).is_some_and(|r| !r.replicas().any(|n| n == b)),
    )
    .await;
    nodes[b as usize - 1].signal("CONT", false).expect("resume");
    // It comes back as a backup (having copied the region again)...
    must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.region(region.id).is_some_and(|r| r.backups.contains(&b) && r.joining.is_empty()),
    )
    .await;
    // ...and then holds every acknowledged write: the other two die and it is promoted.
    nodes[p as usize - 1].kill();
    nodes[other as usize - 1].kill();
    let after = must_see_map(
        &nodes,
        |n| n.id == b,
        Duration::from_secs(30),
        |m| m.region(region.id).is_some_and(|r| r.primary == b),
    )
    .await;
    let c = Client::connect(&after.node(b).expect("registered").device, 2).await.expect("connect");
    let mut lost = Vec::new();
    for k in &acked {
        let mut got = c.get(k.as_bytes()).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.is_err() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            got = c.get(k.as_bytes()).await;
        }
        if got.as_ref().ok().and_then(|v| v.as_deref()) != Some(value.as_slice()) {
            lost.push(k.clone());
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged writes lost: {:?}\n{}",
        lost.len(),
        acked.len(),
        &lost[..lost.len().min(5)],
        logs(&nodes)
    );
}

/// A backup away for a moment (its host paused past its lease) was dropped from its region
/// and, given it back, deleted its copy and was copied again from the start — the whole region
/// over the network and onto its disk after every short lapse. Now it keeps its copy aside
/// when it stops backing the region (`--retain-copies-secs`) and the primary keeps the log it
/// lacks from collection (`--retain-log-mib`): back, it is streamed only what was written while
/// it was away. No acknowledged write is lost, and it serves as a backup again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_back_from_a_short_lapse_resumes_from_its_own_copy() {
    use dpukv_client::Client;
    let etcd = Etcd::start().expect("etcd");
    let mut nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "faults", &etcd.url(), &ARGS).expect("node")).collect();
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), whole(3, 3)).await;
    let region = map.regions[0].clone();
    let away = *region.backups.iter().max().expect("a backup");
    let primary = map.node(region.primary).expect("registered").device.clone();
    let c = Client::connect(&primary, 2).await.expect("connect");
    let mut acked = Vec::new();
    // 4 MiB before the lapse.
    for i in 0..400u32 {
        let (k, v) = (format!("before{i:04}"), format!("{i}-{}", "b".repeat(10 << 10)));
        c.put(k.as_bytes(), v.as_bytes()).await.expect("a write before the lapse");
        acked.push((k, v));
    }
    let received =
        |n: &ClusterNode| n.metric("dpukv_replication_log_bytes_received_total").ok().flatten().unwrap_or(0.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while received(&nodes[away as usize - 1]) < (400 * (10 << 10)) as f64 {
        assert!(Instant::now() < deadline, "node {away} holds the 4 MiB");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = received(&nodes[away as usize - 1]);
    nodes[away as usize - 1].signal("STOP", true).expect("pause");
    // Writes go on without it (it is dropped once its lease ends).
    let paused = Instant::now();
    let mut i = 0u32;
    while paused.elapsed() < Duration::from_secs(4) {
        if i < 300 {
            let (k, v) = (format!("during{i:04}"), format!("{i}-{}", "d".repeat(1 << 10)));
            c.put(k.as_bytes(), v.as_bytes()).await.expect("a write while it is away");
            acked.push((k, v));
            i += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let dropped = must_see_map(
        &nodes,
        |n| n.id != away,
        Duration::from_secs(10),
        |m| m.region(region.id).is_some_and(|r| !r.backups.contains(&away) && !r.joining.contains(&away)),
    )
    .await;
    assert!(dropped.region(region.id).is_some_and(|r| r.primary == region.primary));
    nodes[away as usize - 1].signal("CONT", true).expect("resume");
    must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(30),
        |m| m.region(region.id).is_some_and(|r| r.backups.contains(&away)),
    )
    .await;
    let streamed = received(&nodes[away as usize - 1]) - before;
    let reused = nodes[away as usize - 1].metric("dpukv_replication_copies_reused_total").ok().flatten();
    eprintln!("node {away} back: {streamed} bytes streamed to it after the lapse, copies reused {reused:?}");
    assert_eq!(reused, Some(1.0), "it took its own copy back\n{}", logs(&nodes));
    // It lacked ~0.3 MB (300 writes of 1 KiB); the region holds 4 MB.
    assert!(streamed < (1 << 20) as f64, "only what it lacked was streamed, not the region: {streamed} bytes");
    // Every acknowledged write is there — also on the copy it resumed, once it leads.
    nodes[region.primary as usize - 1].kill();
    let after = must_see_map(
        &nodes,
        |n| n.id != region.primary,
        Duration::from_secs(30),
        |m| m.region(region.id).is_some_and(|r| r.primary != region.primary && m.node(r.primary).is_some()),
    )
    .await;
    let p = after.region(region.id).expect("region").primary;
    let c = Client::connect(&after.node(p).expect("registered").device, 2).await.expect("connect");
    let lost = lost_writes(&c, &acked).await;
    assert!(lost.is_empty(), "acknowledged writes lost (node {p} leads now): {lost:?}\n{}", logs(&nodes));
}
