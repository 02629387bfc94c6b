//! A cluster of real node pods (host and device processes) on a real etcd: the first layout,
//! replication, and failover when a primary's node is SIGKILLed.

use std::time::{Duration, Instant};

use dpukv_client::Client;
use dpukv_e2e::cluster::{ClusterNode, must_see_map, put_routed, wait_for_map};
use dpukv_e2e::etcd::Etcd;

const LEASE_MS: &str = "1000";

fn start(etcd: &Etcd, n: u32, extra: &[&str]) -> Vec<ClusterNode> {
    let mut args = vec!["--lease-ttl-ms", LEASE_MS, "--replication-factor", "3", "--fsync", "always"];
    args.extend_from_slice(extra);
    (1..=n).map(|id| ClusterNode::start(id, "e2e", &etcd.url(), &args).expect("node")).collect()
}

/// One region, with a primary and two backups, nothing joining.
fn one_region_fully_copied(m: &dpukv_proto::regionmap::RegionMap) -> bool {
    m.regions.len() == 1
        && m.regions[0].primary != 0
        && m.regions[0].backups.len() == 2
        && m.regions[0].joining.is_empty()
}

/// A client writing `key{i}` = `v{i}` one at a time through `seed` until stopped: any failed
/// write ends it with an error naming `during` (what it ran through).
struct Writer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Writes acknowledged so far.
    count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<Result<Written, String>>,
}

/// What a [`Writer`] had acknowledged, and its longest write.
struct Written {
    acked: Vec<(String, String)>,
    longest: Duration,
}

impl Writer {
    fn start(seed: &str, during: String) -> Writer {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (seed, stopped, counted) = (seed.to_string(), stop.clone(), count.clone());
        let task = tokio::spawn(async move {
            let c = Client::connect(&seed, 1).await.expect("connect");
            let (mut acked, mut longest, mut i) = (Vec::new(), Duration::ZERO, 0u32);
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                let (k, v) = (format!("key{i:06}"), format!("v{i}"));
                let began = Instant::now();
                match c.put(k.as_bytes(), v.as_bytes()).await {
                    Ok(_) => acked.push((k, v)),
                    Err(e) => return Err(format!("write {i} failed {during}: {e}")),
                }
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                longest = longest.max(began.elapsed());
                i += 1;
            }
            Ok(Written { acked, longest })
        });
        Writer { stop, count, task }
    }

    /// Waits until `more` writes beyond those acknowledged now are (a condition, not a time: on a
    /// loaded machine a fixed wait once let a drain end before the second write).
    async fn wait_for_more(&self, more: usize, what: &str) {
        let target = self.count.load(std::sync::atomic::Ordering::Relaxed) + more;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.count.load(std::sync::atomic::Ordering::Relaxed) < target {
            assert!(!self.task.is_finished(), "the writer ended {what}");
            assert!(Instant::now() < deadline, "fewer than {more} writes acknowledged {what} in 60 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops it; what it wrote, or the write that failed.
    async fn finish(self) -> Result<Written, String> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.task.await.map_err(|e| format!("the writer panicked: {e}"))?
    }
}

/// How many of `acked` a read through `seed` does not find as written.
async fn lost(seed: &str, acked: &[(String, String)]) -> usize {
    let c = Client::connect(seed, 1).await.expect("connect");
    let mut lost = 0;
    for (k, v) in acked {
        if c.get(k.as_bytes()).await.expect("read").as_deref() != Some(v.as_bytes()) {
            lost += 1;
        }
    }
    lost
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_fails_over_to_a_backup_and_no_acknowledged_write_is_lost() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &[]);
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    let laid_out = |m: &dpukv_proto::regionmap::RegionMap| {
        m.regions.len() == 1 && m.regions[0].primary != 0 && m.regions[0].backups.len() == 2
    };
    let map = match wait_for_map(&all, Duration::from_secs(60), laid_out).await {
        Ok(m) => m,
        Err(e) => panic!("{e}\n{}", nodes.iter().map(ClusterNode::logs).collect::<String>()),
    };
    let region = map.regions[0].clone();
    let primary = region.primary;
    let device = map.node(primary).expect("the primary is registered").device.clone();
    let c = Client::connect(&device, 2).await.expect("connect to the primary");
    let mut acked = Vec::new();
    for i in 0..300u32 {
        let (k, v) = (format!("key{i:04}"), format!("value-{i}"));
        if let Err(e) = c.put(k.as_bytes(), v.as_bytes()).await {
            // On a loaded machine a lease can run out before the fault: the cluster fails over
            // by itself, and the write goes to whoever leads now.
            eprintln!("write {i} at node {primary} failed ({e}); routing it again");
            if let Err(e) = put_routed(&all, k.as_bytes(), v.as_bytes(), Duration::from_secs(30)).await {
                let logs: String = nodes.iter().map(ClusterNode::logs).collect();
                panic!("write {i} failed before any fault: {e}\n{logs}");
            }
        }
        acked.push((k, v));
    }
    // The primary now (it may have changed under load).
    let map = wait_for_map(&all, Duration::from_secs(30), laid_out).await.expect("a laid out map");
    let region = map.regions[0].clone();
    let primary = region.primary;
    // Its figures: every backup holds every acknowledged write (no lag), bytes went out and in.
    let metric = |id: u32, sample: &str| nodes[id as usize - 1].metric(sample).expect("metrics").unwrap_or(-1.0);
    assert_eq!(metric(primary, "dpukv_cluster_regions_led"), 1.0);
    assert!(metric(primary, "dpukv_replication_log_bytes_shipped_total") > 0.0);
    for &b in &region.backups {
        let lag = |unit: &str| {
            metric(primary, &format!("dpukv_replication_lag_{unit}{{region=\"{}\",backup=\"{b}\"}}", region.id))
        };
        assert_eq!((lag("bytes"), lag("records")), (0.0, 0.0), "backup {b} holds every acknowledged write");
        assert!(metric(b, "dpukv_replication_log_bytes_received_total") > 0.0, "backup {b} received the log");
        assert_eq!(metric(b, "dpukv_cluster_regions_backed"), 1.0);
    }
    let killed_at = Instant::now();
    nodes[primary as usize - 1].kill();
    let survivors: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != primary).collect();
    let promoted = |m: &dpukv_proto::regionmap::RegionMap| {
        let r = &m.regions[0];
        r.primary != primary && r.primary != 0 && r.epoch > region.epoch
    };
    let after = match wait_for_map(&survivors, Duration::from_secs(30), promoted).await {
        Ok(m) => m,
        Err(e) => panic!("{e}\n{}", nodes.iter().map(ClusterNode::logs).collect::<String>()),
    };
    let new_primary = after.regions[0].primary;
    assert!(region.backups.contains(&new_primary), "a backup was promoted: {region:?} -> {:?}", after.regions[0]);
    let c2 = Client::connect(&after.node(new_primary).expect("registered").device, 2).await.expect("connect");
    // The first write to the region after the kill.
    let mut first_write = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while first_write.is_none() {
        match c2.put(b"after-failover", b"1").await {
            Ok(_) => first_write = Some(killed_at.elapsed()),
            Err(e) if Instant::now() < deadline => {
                eprintln!("waiting for the new primary: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!(
                "the new primary never took a write: {e}\n{}",
                nodes.iter().map(ClusterNode::logs).collect::<String>()
            ),
        }
    }
    eprintln!("failover: first acknowledged write {:?} after the kill", first_write.expect("set"));
    let promoted_metric = nodes[new_primary as usize - 1].metric("dpukv_cluster_promotions_total").expect("metrics");
    assert_eq!(promoted_metric, Some(1.0), "the new primary counts its promotion");
    let mut lost = Vec::new();
    for (k, v) in &acked {
        match c2.get(k.as_bytes()).await {
            Ok(Some(got)) if got == v.as_bytes() => {}
            other => lost.push((k.clone(), format!("{other:?}"))),
        }
    }
    assert!(
        lost.is_empty(),
        "acknowledged writes lost after failover: {lost:?}\n{}",
        nodes.iter().map(ClusterNode::logs).collect::<String>()
    );
}

/// The backup whose copy of the log reaches furthest is promoted: one backup's host is paused
/// (SIGSTOP, well within its lease) while 20 MiB of writes go on — they reach the other backup,
/// more than the paused one's socket buffers take, and are never acknowledged (outcome unknown)
/// — then the primary's pod is killed and the paused host resumes. Both backups report how far their logs reach; the master promotes the one holding
/// the writes, which are then read back. Without the reports the master would pick the backup
/// with the lower id, the paused one, and the writes would be gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backup_whose_log_reaches_furthest_is_promoted() {
    use dpukv_client::proto::{ErrorCode, Op};
    const TAIL: u32 = 40;
    let big = |i: u32| vec![b'a' + (i % 26) as u8; 512 << 10];
    let etcd = Etcd::start().expect("etcd");
    // A lease long enough that the paused host keeps its registration (then both backups are
    // candidates for the promotion).
    // No stall reports: the paused backup must stay in the write set, for the promotion to
    // choose between the two backups by how far their logs reach.
    let args = [
        "--lease-ttl-ms",
        "8000",
        "--replication-factor",
        "3",
        "--replication-timeout-ms",
        "300",
        "--stall-timeout-ms",
        "0",
    ];
    let mut nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "e2e", &etcd.url(), &args).expect("node")).collect();
    let full = |m: &dpukv_proto::regionmap::RegionMap| {
        m.regions.len() == 1 && m.regions[0].primary != 0 && m.regions[0].backups.len() == 2
    };
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), full).await;
    let region = map.regions[0].clone();
    let (p, behind, ahead) = (
        region.primary,
        *region.backups.iter().min().expect("two backups"),
        *region.backups.iter().max().expect("two backups"),
    );
    let c = Client::connect(&map.node(p).expect("registered").device, 1).await.expect("connect");
    for i in 0..50u32 {
        c.put(format!("acked{i:03}").as_bytes(), b"v").await.expect("an acknowledged write");
    }
    nodes[behind as usize - 1].signal("STOP", false).expect("pause the backup's host");
    let paused = Instant::now();
    // Sent once each, untagged: the primary waits for the paused backup and gives up.
    let tail: Vec<_> = (0..TAIL)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(
                async move { c.send(Op::Put { key: format!("tail{i:03}").into_bytes(), value: big(i) }).await },
            )
        })
        .collect();
    for t in tail {
        let code = t.await.expect("task").expect("an answer").result.err().map(|e| e.code);
        assert_eq!(code, Some(ErrorCode::OutcomeUnknown), "a write the paused backup lacks is not acknowledged");
    }
    nodes[p as usize - 1].kill();
    nodes[behind as usize - 1].signal("CONT", false).expect("resume the backup's host");
    eprintln!("the backup's host was paused for {:?}", paused.elapsed());
    let promoted = |m: &dpukv_proto::regionmap::RegionMap| m.regions[0].primary != p && m.regions[0].primary != 0;
    let after = must_see_map(&nodes, |n| n.id != p, Duration::from_secs(30), promoted).await;
    let logs = || nodes.iter().map(ClusterNode::logs).collect::<String>();
    assert_eq!(after.regions[0].epoch, region.epoch + 1, "the promotion is the region's only change\n{}", logs());
    assert_eq!(after.regions[0].primary, ahead, "the backup that holds more is promoted\n{}", logs());
    let survivors: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != p).collect();
    let c2 = Client::connect(&survivors[0].device, 1).await.expect("connect");
    for i in 0..TAIL {
        let got = c2.get(format!("tail{i:03}").as_bytes()).await.expect("read");
        assert!(got == Some(big(i)), "write tail{i:03} survived on the promoted backup");
    }
    for i in 0..50u32 {
        assert!(c2.get(format!("acked{i:03}").as_bytes()).await.expect("read").is_some(), "acked{i:03}");
    }
}

/// A backup's node dies and comes back: the region goes on with the other backup, the returning
/// node is given the region again as a joining node, copies it while writes go on, and becomes
/// a backup; once the other two nodes die in turn, it is promoted and holds every acknowledged
/// write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returning_node_catches_up_as_a_backup_and_can_then_be_promoted_with_every_write() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &[]);
    let logs = |nodes: &[ClusterNode]| nodes.iter().map(ClusterNode::logs).collect::<String>();
    let full = one_region_fully_copied;
    let map = {
        let all: Vec<&ClusterNode> = nodes.iter().collect();
        wait_for_map(&all, Duration::from_secs(60), full).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)))
    };
    let r0 = map.regions[0].clone();
    let (p, b1, b2) = (r0.primary, r0.backups[0], r0.backups[1]);
    let mut acked: Vec<(String, String)> = Vec::new();
    let write = async |nodes: &[ClusterNode], from: u32, n: u32, acked: &mut Vec<(String, String)>| {
        let live: Vec<&ClusterNode> = nodes.iter().collect();
        for i in from..from + n {
            let (k, v) = (format!("key{i:05}"), format!("value-{i}"));
            put_routed(&live, k.as_bytes(), v.as_bytes(), Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("write {i}: {e}\n{}", logs(nodes)));
            acked.push((k, v));
        }
    };
    write(&nodes, 0, 100, &mut acked).await;
    // b1 dies: the region drops it and goes on with b2.
    nodes[b1 as usize - 1].kill();
    {
        let live: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != b1).collect();
        let dropped =
            |m: &dpukv_proto::regionmap::RegionMap| m.regions[0].primary == p && !m.regions[0].backups.contains(&b1);
        wait_for_map(&live, Duration::from_secs(30), dropped).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
    }
    write(&nodes, 100, 100, &mut acked).await;
    // b1 returns: it joins, copies, and becomes a backup again.
    nodes[b1 as usize - 1].resume().expect("resume");
    {
        let all: Vec<&ClusterNode> = nodes.iter().collect();
        let rejoined = |m: &dpukv_proto::regionmap::RegionMap| full(m) && m.regions[0].backups.contains(&b1);
        wait_for_map(&all, Duration::from_secs(60), rejoined).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
    }
    write(&nodes, 200, 100, &mut acked).await;
    // b2, then the primary, die: only b1 is left to promote.
    nodes[b2 as usize - 1].kill();
    {
        let live: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != b2).collect();
        let dropped = |m: &dpukv_proto::regionmap::RegionMap| !m.regions[0].backups.contains(&b2);
        wait_for_map(&live, Duration::from_secs(30), dropped).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
    }
    nodes[p as usize - 1].kill();
    let after = {
        let live: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id == b1).collect();
        let promoted = |m: &dpukv_proto::regionmap::RegionMap| m.regions[0].primary == b1;
        wait_for_map(&live, Duration::from_secs(30), promoted).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)))
    };
    let c = Client::connect(&after.node(b1).expect("registered").device, 1).await.expect("connect");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.get(b"key00000").await {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => {
                eprintln!("waiting for node {b1} to serve: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("node {b1} never served: {e}\n{}", logs(&nodes)),
        }
    }
    let mut lost = Vec::new();
    for (k, v) in &acked {
        match c.get(k.as_bytes()).await {
            Ok(Some(got)) if got == v.as_bytes() => {}
            other => lost.push((k.clone(), format!("{other:?}"))),
        }
    }
    assert!(
        lost.is_empty(),
        "{} acknowledged writes lost: {:?}\n{}",
        lost.len(),
        &lost[..lost.len().min(5)],
        logs(&nodes)
    );
}

/// The failover-time benchmark (docs/benchmarks.md): SIGKILL of the primary's pod, then the time
/// to the first acknowledged write to the region; `DPUKV_FAILOVER_RUNS` runs (none by default)
/// on one cluster (the killed node comes back and catches up between runs) with leases of
/// `DPUKV_FAILOVER_LEASE_MS` (default 2000, the production default). Prints median and max.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_time_benchmark() {
    let runs: usize = std::env::var("DPUKV_FAILOVER_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    if runs == 0 {
        return;
    }
    let lease = std::env::var("DPUKV_FAILOVER_LEASE_MS").unwrap_or_else(|_| "2000".into());
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", &lease, "--replication-factor", "3", "--fsync", "always"];
    let mut nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "bench", &etcd.url(), &args).expect("node")).collect();
    let logs = |nodes: &[ClusterNode]| nodes.iter().map(ClusterNode::logs).collect::<String>();
    let full = one_region_fully_copied;
    let mut times = Vec::new();
    for run in 0..runs {
        let map = {
            let all: Vec<&ClusterNode> = nodes.iter().collect();
            wait_for_map(&all, Duration::from_secs(120), full).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)))
        };
        let (p, epoch) = (map.regions[0].primary, map.regions[0].epoch);
        {
            let all: Vec<&ClusterNode> = nodes.iter().collect();
            put_routed(&all, b"warm", b"1", Duration::from_secs(30)).await.expect("a write before the kill");
        }
        let killed = Instant::now();
        nodes[p as usize - 1].kill();
        let live: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != p).collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let m = wait_for_map(&live, Duration::from_secs(60), |m| {
                m.regions[0].primary != p && m.regions[0].epoch > epoch
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
            let dev = &m.node(m.regions[0].primary).expect("registered").device;
            if let Ok(c) = Client::connect(dev, 1).await
                && c.put(b"after", format!("{run}").as_bytes()).await.is_ok()
            {
                break;
            }
            assert!(Instant::now() < deadline, "no write after the kill\n{}", logs(&nodes));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let t = killed.elapsed();
        eprintln!("run {run}: first acknowledged write {t:?} after the kill");
        times.push(t);
        nodes[p as usize - 1].resume().expect("resume");
    }
    times.sort();
    eprintln!(
        "failover (lease {lease} ms, {runs} runs): median {:?}, max {:?}, all {times:?}",
        times[times.len() / 2],
        times[times.len() - 1]
    );
}

/// Only the primary's host dies; its device lives on with the last map and the region's shared
/// memory. Once another node leads and takes a newer write, the old device must not answer the
/// old value: it stopped trusting its map when its host stopped renewing its authority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_host_died_stops_serving_before_another_node_leads() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &[]);
    let logs = |nodes: &[ClusterNode]| nodes.iter().map(ClusterNode::logs).collect::<String>();
    let map = {
        let all: Vec<&ClusterNode> = nodes.iter().collect();
        let ready =
            |m: &dpukv_proto::regionmap::RegionMap| m.regions[0].primary != 0 && m.regions[0].backups.len() == 2;
        wait_for_map(&all, Duration::from_secs(60), ready).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)))
    };
    let (p, epoch) = (map.regions[0].primary, map.regions[0].epoch);
    {
        let all: Vec<&ClusterNode> = nodes.iter().collect();
        put_routed(&all, b"k", b"old", Duration::from_secs(30)).await.expect("put");
    }
    let old_device = Client::connect(&nodes[p as usize - 1].device, 1).await.expect("connect");
    assert_eq!(old_device.get(b"k").await.expect("read").as_deref(), Some(&b"old"[..]));
    let t = Instant::now();
    nodes[p as usize - 1].kill_host();
    {
        let live: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != p).collect();
        let promoted = |m: &dpukv_proto::regionmap::RegionMap| m.regions[0].primary != p && m.regions[0].epoch > epoch;
        let m = wait_for_map(&live, Duration::from_secs(30), promoted)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
        eprintln!("promoted after {:?}: {:?} revision {}", t.elapsed(), m.regions[0], m.revision);
        put_routed(&live, b"k", b"new", Duration::from_secs(30)).await.expect("put at the new primary");
        eprintln!("new write after {:?}", t.elapsed());
    }
    let mut one = Client::connect(&nodes[p as usize - 1].device, 1).await.expect("connect").without_sessions();
    one.retry.deadline = Duration::from_millis(1);
    match one.get(b"k").await {
        Ok(Some(v)) => {
            panic!("the old device answered {:?} after another node took a newer write", String::from_utf8_lossy(&v))
        }
        Ok(None) => panic!("the old device answered absent"),
        Err(e) => assert!(e.to_string().contains("unavailable"), "refused as unavailable: {e}"),
    }
}

/// etcd goes down for a while: no failover happens, nothing acknowledged is lost, and once etcd
/// is back the same primary takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_pauses_the_cluster_without_a_failover_and_it_resumes() {
    let mut etcd = Etcd::start().expect("etcd");
    let nodes = start(&etcd, 3, &[]);
    let logs = |nodes: &[ClusterNode]| nodes.iter().map(ClusterNode::logs).collect::<String>();
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    let ready = |m: &dpukv_proto::regionmap::RegionMap| m.regions[0].primary != 0 && m.regions[0].backups.len() == 2;
    let map =
        wait_for_map(&all, Duration::from_secs(60), ready).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
    let (p, epoch) = (map.regions[0].primary, map.regions[0].epoch);
    for i in 0..50u32 {
        put_routed(&all, format!("k{i}").as_bytes(), b"before", Duration::from_secs(30)).await.expect("put");
    }
    etcd.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The primary's authority ran out (it could not renew its lease): it acknowledges nothing.
    let mut c = Client::connect(&map.node(p).expect("node").device, 1).await.expect("connect");
    c.retry.deadline = Duration::from_millis(500);
    assert!(c.put(b"during", b"x").await.is_err(), "no write is acknowledged while the lease cannot be renewed");
    assert!(c.get(b"k0").await.is_err(), "no read is answered either");
    tokio::time::sleep(Duration::from_secs(1)).await;
    etcd.resume().expect("etcd again");
    for i in 0..50u32 {
        put_routed(&all, format!("k{i}").as_bytes(), b"after", Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("write {i} after etcd returned: {e}\n{}", logs(&nodes)));
    }
    let m = wait_for_map(&all, Duration::from_secs(10), ready).await.expect("map");
    assert_eq!((m.regions[0].primary, m.regions[0].epoch), (p, epoch), "no failover happened: {:?}", m.regions[0]);
    let c = Client::connect(&m.node(p).expect("node").device, 1).await.expect("connect");
    for i in 0..50u32 {
        assert_eq!(c.get(format!("k{i}").as_bytes()).await.expect("read").as_deref(), Some(&b"after"[..]));
    }
}

/// The client routes by the region map: writes to three regions led by different nodes, scans
/// across all of them (each key once, in order), and goes on through the failover of a region's
/// primary — refreshing its map — with fetch-adds applied exactly once across the switch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_routes_scans_across_regions_and_survives_a_failover_exactly_once() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &["--split-keys", "g,p"]);
    let logs = |nodes: &[ClusterNode]| nodes.iter().map(ClusterNode::logs).collect::<String>();
    let map = {
        let all: Vec<&ClusterNode> = nodes.iter().collect();
        let ready = |m: &dpukv_proto::regionmap::RegionMap| {
            m.regions.len() == 3 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2)
        };
        wait_for_map(&all, Duration::from_secs(60), ready).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)))
    };
    let leaders: std::collections::BTreeSet<u32> = map.regions.iter().map(|r| r.primary).collect();
    assert_eq!(leaders.len(), 3, "the first layout spreads the primaries: {:?}", map.regions);
    // Connect through a node that will survive.
    let victim = map.regions[0].primary;
    let seed = nodes.iter().find(|n| n.id != victim).expect("a survivor").device.clone();
    let c = Client::connect(&seed, 2).await.expect("connect");
    let key = |i: u32| format!("{}{i:04}", ["a", "h", "q"][i as usize % 3]);
    for i in 0..300u32 {
        c.put(key(i).as_bytes(), format!("v{i}").as_bytes())
            .await
            .unwrap_or_else(|e| panic!("put {i}: {e}\n{}", logs(&nodes)));
    }
    // A batch over all three regions: refused whole, or split into one atomic batch per region.
    let spread: Vec<dpukv_proto::WriteOp> = ["b", "i", "r"]
        .iter()
        .map(|p| dpukv_proto::WriteOp::Put { key: format!("{p}-batch").into_bytes(), value: b"x".to_vec() })
        .collect();
    let refused = c.batch(spread.clone()).await.expect_err("a batch spans regions");
    assert_eq!(refused.code(), Some(dpukv_proto::ErrorCode::WrongRegion), "{refused}");
    c.batch_across_regions(spread).await.expect("split by region");
    for p in ["b", "i", "r"] {
        assert_eq!(c.get(format!("{p}-batch").as_bytes()).await.expect("get"), Some(b"x".to_vec()));
        c.delete(format!("{p}-batch").as_bytes()).await.expect("delete");
    }
    let all = c.scan(b"", b"", 10_000).await.expect("scan");
    let mut want: Vec<Vec<u8>> = (0..300).map(|i| key(i).into_bytes()).collect();
    want.sort();
    assert_eq!(
        all.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        want,
        "every key once, in order, across regions"
    );
    // Fetch-adds on a key of region 1 while its primary is killed.
    let counter = b"counter";
    let mut done = 0u64;
    for i in 0..200u32 {
        if i == 100 {
            nodes[victim as usize - 1].kill();
        }
        match c.fetch_add(counter, 1).await {
            Ok(_) => done += 1,
            Err(e) => panic!("fetch_add {i}: {e}\n{}", logs(&nodes)),
        }
    }
    let v = c.get(counter).await.expect("read").expect("present");
    assert_eq!(
        u64::from_le_bytes(v[..8].try_into().expect("8 bytes")),
        done,
        "each acknowledged fetch_add applied once"
    );
    // Still every key, after the failover.
    let again = c.scan(b"", b"", 10_000).await.expect("scan");
    assert_eq!(again.len(), 301, "300 keys and the counter");
    let m = c.routing_map().expect("a map");
    assert_ne!(m.regions[0].primary, victim, "the client follows the new primary");
}

/// `dpukv cluster drain NODE` under load: four pods, one region with three replicas; the node
/// leading it is drained while a client writes; the region gets a copy on the spare node, the
/// primary is handed to a backup, the drained node ends up holding nothing, the region keeps
/// three copies, and every acknowledged write is there.
///
/// (It caught a stall: a write in flight at the handover was retried at the new primary, answered
/// from the replicated sessions without adding to the log, and waited for an Append its
/// caught-up backups never needed — a sender now counts where a backup resumes as held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_the_primary_s_node_under_load_moves_everything_off_it_and_loses_nothing() {
    let etcd = Etcd::start().expect("etcd");
    let nodes = start(&etcd, 4, &[]);
    let logs = |nodes: &[ClusterNode]| nodes.iter().map(ClusterNode::logs).collect::<String>();
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    let full = one_region_fully_copied;
    let map =
        wait_for_map(&all, Duration::from_secs(60), full).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
    let p = map.regions[0].primary;
    let seed = nodes.iter().find(|n| n.id != p).expect("another node").device.clone();
    let writer = Writer::start(&seed, "during the drain".into());
    writer.wait_for_more(20, "before the drain").await;
    let out = tokio::process::Command::new(dpukv_e2e::procs::bin_dir().expect("binaries").join("dpukv"))
        .args(["--endpoint", &seed, "cluster", "drain", &p.to_string()])
        .env("DPUKV_ADMIN_TOKEN", nodes[0].admin_token())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), out)
        .await
        .unwrap_or_else(|_| panic!("the drain did not finish in 90 s\n{}", logs(&nodes)))
        .expect("run dpukv");
    let progress = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "drain failed: {}\n{}", String::from_utf8_lossy(&out.stderr), logs(&nodes));
    assert!(progress.lines().last().is_some_and(|l| l.contains("\"done\": true")), "progress ends done: {progress}");
    writer.wait_for_more(10, "after the drain").await;
    let acked = writer.finish().await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes))).acked;
    let m = wait_for_map(&all, Duration::from_secs(30), full).await.expect("map");
    let r = &m.regions[0];
    assert!(r.primary != p && !r.backups.contains(&p) && !r.joining.contains(&p), "node {p} holds nothing: {r:?}");
    let lost = lost(&seed, &acked).await;
    assert!(acked.len() >= 30, "the client wrote before, during and after the drain: {}", acked.len());
    assert_eq!(lost, 0, "of {} acknowledged writes, {lost} lost\n{}", acked.len(), logs(&nodes));
    eprintln!("drain progress:\n{progress}{} writes during the drain", acked.len());
}

/// A node pod deleted or evicted (SIGTERM to its host and device, as the kubelet sends) leaves on
/// purpose: its host asks the master to move its primaries to backups elsewhere and stops only
/// once they are handed over — a handover, not a failover after its lease ends. A client
/// writing all along sees no failed write, nothing acknowledged is lost, and the host says so in
/// its log before it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_with_sigterm_hands_its_primaries_over_before_it_stops() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &[]);
    let logs = |nodes: &[ClusterNode]| nodes.iter().map(ClusterNode::logs).collect::<String>();
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    let full = one_region_fully_copied;
    let map =
        wait_for_map(&all, Duration::from_secs(60), full).await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
    let (p, epoch) = (map.regions[0].primary, map.regions[0].epoch);
    let seed = nodes.iter().find(|n| n.id != p).expect("another node").device.clone();
    let writer = Writer::start(&seed, format!("while node {p} left"));
    writer.wait_for_more(20, "before the SIGTERM").await;
    let host = nodes[p as usize - 1].host_pid().expect("host");
    let signalled = Instant::now();
    nodes[p as usize - 1].signal("TERM", true).expect("SIGTERM");
    // The host exits by itself once its primaries moved (well within its 20 s leave).
    while std::path::Path::new(&format!("/proc/{host}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{host}/stat")).unwrap_or_default().contains(") Z")
    {
        assert!(signalled.elapsed() < Duration::from_secs(25), "the host did not stop\n{}", logs(&nodes));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped = signalled.elapsed();
    let left = nodes[p as usize - 1].logs();
    assert!(left.contains("left: primaries handed over"), "the host handed its primaries over first:\n{left}");
    writer.wait_for_more(10, "after the node left").await;
    let Written { acked, longest } = writer.finish().await.unwrap_or_else(|e| panic!("{e}\n{}", logs(&nodes)));
    nodes[p as usize - 1].kill();
    let survivors: Vec<&ClusterNode> = nodes.iter().filter(|n| n.id != p).collect();
    let m =
        wait_for_map(&survivors, Duration::from_secs(30), |m| m.regions[0].primary != p && m.regions[0].primary != 0)
            .await
            .expect("map");
    assert!(m.regions[0].epoch > epoch, "a new epoch: {:?}", m.regions[0]);
    let lost = lost(&seed, &acked).await;
    assert!(acked.len() >= 30, "the client wrote before, during and after: {}", acked.len());
    assert_eq!(lost, 0, "of {} acknowledged writes, {lost} lost\n{}", acked.len(), logs(&nodes));
    eprintln!("SIGTERM to exit {stopped:?}; longest write {longest:?}; {} writes", acked.len());
}

/// The master's node pod is SIGKILLed while a client writes to every region: another node wins
/// the election and fails over the regions the dead node led (a bumped epoch, a backup promoted),
/// no acknowledged write is lost, and the node, restarted, comes back as a member whose copies
/// are caught up again — never as the primary of an epoch it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_master_s_node_elects_another_master_that_fails_its_regions_over() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &["--split-keys", "g,p"]);
    let full = |m: &dpukv_proto::regionmap::RegionMap| {
        m.master != 0
            && m.regions.len() == 3
            && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2 && r.joining.is_empty())
    };
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), full).await;
    let master = map.master;
    let led: Vec<_> = map.regions.iter().filter(|r| r.primary == master).cloned().collect();
    assert!(!led.is_empty(), "the first layout gives every node a region to lead: {:?}", map.regions);
    let seed = nodes.iter().find(|n| n.id != master).expect("a survivor").device.clone();
    let c = Client::connect(&seed, 2).await.expect("connect");
    let key = |i: u32| format!("{}{i:04}", ["a", "h", "q"][i as usize % 3]);
    let mut acked = Vec::new();
    for i in 0..300u32 {
        if i == 150 {
            nodes[master as usize - 1].kill();
        }
        let (k, v) = (key(i), format!("v{i}"));
        match c.put(k.as_bytes(), v.as_bytes()).await {
            Ok(_) => acked.push((k, v)),
            Err(e) => panic!("put {i} (the client retries through failovers): {e}"),
        }
    }
    let healed = |m: &dpukv_proto::regionmap::RegionMap| {
        m.master != 0
            && m.master != master
            && m.regions.iter().all(|r| r.primary != 0 && r.primary != master)
            && led.iter().all(|old| m.regions.iter().any(|r| r.id == old.id && r.epoch > old.epoch))
    };
    let after = must_see_map(&nodes, |n| n.id != master, Duration::from_secs(30), healed).await;
    for old in &led {
        let now = after.regions.iter().find(|r| r.id == old.id).expect("the region is still there");
        assert!(old.backups.contains(&now.primary), "a backup of region {} was promoted: {now:?}", old.id);
    }
    for (k, v) in &acked {
        let got = c.get(k.as_bytes()).await.expect("read");
        assert_eq!(got.as_deref(), Some(v.as_bytes()), "acknowledged {k} survives the master's death");
    }
    // The node comes back: a member again, with a full copy of every region, and no region led
    // under an epoch it held before its death.
    nodes[master as usize - 1].resume().expect("restart");
    let rejoined = |m: &dpukv_proto::regionmap::RegionMap| {
        m.nodes.iter().any(|n| n.id == master)
            && m.regions.iter().all(|r| {
                r.backups.len() == 2 && r.joining.is_empty() && (r.primary == master || r.backups.contains(&master))
            })
    };
    let back = must_see_map(&nodes, |_| true, Duration::from_secs(60), rejoined).await;
    for r in back.regions.iter().filter(|r| r.primary == master) {
        let old = led.iter().find(|o| o.id == r.id);
        assert!(old.is_none_or(|o| r.epoch > o.epoch), "led again only under a newer epoch: {r:?}");
    }
    let all = c.scan(b"", b"", 10_000).await.expect("scan");
    assert_eq!(all.len(), 300, "every key once after the master's node returned");
}

/// Scale-out: six regions with three replicas on three pods; a fourth pod joins while a client
/// writes. The master copies replicas to it (joining, caught up, backup; the surplus trimmed) and
/// hands it primaries, until replica and primary counts differ by at most two; every region
/// keeps three in-sync copies at the end, and every acknowledged write is readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_gets_replicas_and_primaries_while_writes_go_on_and_nothing_is_lost() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &["--split-keys", "b,d,f,h,j"]);
    let settled = |n: usize| {
        move |m: &dpukv_proto::regionmap::RegionMap| {
            m.nodes.len() == n
                && m.regions.len() == 6
                && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2 && r.joining.is_empty())
        }
    };
    must_see_map(&nodes, |_| true, Duration::from_secs(60), settled(3)).await;
    let c = Client::connect(&nodes[0].device, 2).await.expect("connect");
    let key = |i: u32| format!("{}{i:05}", ["a", "c", "e", "g", "i", "k"][i as usize % 6]);
    let mut acked = Vec::new();
    for i in 0..300u32 {
        c.put(key(i).as_bytes(), format!("v{i}").as_bytes()).await.unwrap_or_else(|e| panic!("put {i}: {e}"));
        acked.push(i);
    }
    let args = ["--lease-ttl-ms", LEASE_MS, "--replication-factor", "3", "--fsync", "always"];
    nodes.push(ClusterNode::start(4, "e2e", &etcd.url(), &args).expect("node 4"));
    // Writes go on while the regions move.
    let balanced = |m: &dpukv_proto::regionmap::RegionMap| {
        let holds = |n: u32| m.regions.iter().filter(|r| r.primary == n || r.backups.contains(&n)).count();
        let leads = |n: u32| m.regions.iter().filter(|r| r.primary == n).count();
        settled(4)(m) && holds(4) >= 3 && leads(4) >= 1 && (1..=4).all(|n| leads(n) >= 1)
    };
    let mut i = 300u32;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        for _ in 0..20 {
            c.put(key(i).as_bytes(), format!("v{i}").as_bytes())
                .await
                .unwrap_or_else(|e| panic!("put {i} during the rebalance: {e}"));
            acked.push(i);
            i += 1;
        }
        let all: Vec<&ClusterNode> = nodes.iter().collect();
        if let Ok(m) = wait_for_map(&all, Duration::from_millis(200), balanced).await {
            eprintln!("balanced after {} writes: {:?}", i - 300, m.regions);
            break;
        }
        if Instant::now() > deadline {
            let m = wait_for_map(&all, Duration::from_secs(1), |_| true).await;
            panic!(
                "the new node never got its share: {m:?}\n{}",
                nodes.iter().map(ClusterNode::logs).collect::<String>()
            );
        }
    }
    for &i in &acked {
        let got = c.get(key(i).as_bytes()).await.unwrap_or_else(|e| panic!("get {i}: {e}"));
        assert_eq!(got, Some(format!("v{i}").into_bytes()), "acknowledged write {i} after the rebalance");
    }
    // The client found the new node's primaries (the reads above went there too).
    let m = c.routing_map().expect("a map");
    assert!(m.regions.iter().any(|r| r.primary == 4), "the client routes to the new node");
}

/// A cluster whose backups build their own index (`--backup-index build`): the primary ships no
/// index, each backup replays its complete log copies and compacts them itself; when the
/// primary's pod is killed, the promoted backup adopts what it built — it replays only the rest
/// of its log — and holds every acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_index_backup_builds_its_own_index_and_is_promoted_with_every_write() {
    let etcd = Etcd::start().expect("etcd");
    let mut nodes = start(&etcd, 3, &["--backup-index", "build"]);
    let laid_out = |m: &dpukv_proto::regionmap::RegionMap| {
        m.regions.len() == 1 && m.regions[0].primary != 0 && m.regions[0].backups.len() == 2
    };
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), laid_out).await;
    let c = Client::connect(&map.node(map.regions[0].primary).expect("primary").device, 2).await.expect("connect");
    // About 6 MiB of log: several complete 2 MiB segments for the backups to index.
    let value = |i: u32| format!("{i:0>1000}").into_bytes();
    for b in 0..60u32 {
        let ops = (0..100u32)
            .map(|j| {
                let i = b * 100 + j;
                dpukv_proto::WriteOp::Put { key: format!("k{i:05}").into_bytes(), value: value(i) }
            })
            .collect();
        c.batch(ops).await.unwrap_or_else(|e| panic!("batch {b}: {e}"));
    }
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(30), laid_out).await;
    let r = map.regions[0].clone();
    let built = |id: u32| nodes[id as usize - 1].metric("dpukv_replication_records_built_total").expect("metrics");
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.backups.iter().any(|&b| built(b).unwrap_or(0.0) < 1000.0) {
        assert!(
            Instant::now() < deadline,
            "the backups index their copies: {:?}",
            r.backups.iter().map(|&b| built(b)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        nodes[r.primary as usize - 1].metric("dpukv_replication_index_bytes_shipped_total").expect("metrics"),
        Some(0.0),
        "no index is shipped"
    );
    nodes[r.primary as usize - 1].kill();
    let promoted =
        |m: &dpukv_proto::regionmap::RegionMap| m.regions[0].primary != r.primary && m.regions[0].epoch > r.epoch;
    let after = must_see_map(&nodes, |n| n.id != r.primary, Duration::from_secs(30), promoted).await;
    let p = after.regions[0].primary;
    let c2 = Client::connect(&after.node(p).expect("registered").device, 2).await.expect("connect");
    for i in (0..6000u32).step_by(7) {
        let got = c2.get(format!("k{i:05}").as_bytes()).await.unwrap_or_else(|e| panic!("get {i}: {e}"));
        assert_eq!(got, Some(value(i)), "acknowledged write {i} on the promoted Build Index copy");
    }
    let n = c2.scan(b"", b"", 10_000).await.expect("scan").len();
    assert_eq!(n, 6000, "every key");
    // The promoted copy opened on what it built: it replayed only part of its log.
    let log = nodes[p as usize - 1].logs();
    let replayed: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("region open"))
        .filter_map(|l| l.split("replayed=").nth(1)?.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .collect();
    assert!(
        replayed.last().is_some_and(|&n| n < 6000),
        "the promoted copy replays only what it did not build: {replayed:?}"
    );
}

/// Runs `dpukv --endpoint SEED ARGS...`, panicking (with the nodes' logs) unless it succeeds
/// within `timeout`; returns its standard output.
async fn dpukv_cli(seed: &str, args: &[&str], timeout: Duration, nodes: &[ClusterNode]) -> String {
    let out = tokio::process::Command::new(dpukv_e2e::procs::bin_dir().expect("binaries").join("dpukv"))
        .args(["--endpoint", seed])
        .args(args)
        .env("DPUKV_ADMIN_TOKEN", nodes[0].admin_token())
        .output();
    let logs = || nodes.iter().map(ClusterNode::logs).collect::<String>();
    let out = tokio::time::timeout(timeout, out)
        .await
        .unwrap_or_else(|_| panic!("dpukv {args:?} did not finish in {timeout:?}\n{}", logs()))
        .expect("run dpukv");
    assert!(out.status.success(), "dpukv {args:?} failed: {}\n{}", String::from_utf8_lossy(&out.stderr), logs());
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// `dpukv cluster split` and `dpukv cluster merge` under load: one region of 2000 keys on three
/// nodes; two clients keep overwriting every key (through the library: writes refused while
/// their range is copied are retried with their exactly-once tag) and a third scans the whole
/// key range again and again. The region splits at the middle (a new region on the same nodes,
/// the old one narrowed, both epochs moved), then the new region merges back. Every scan sees
/// each key exactly once, in order, with a value written to that key; every acknowledged write
/// is there at the end. (Placement may balance the new region's primary to another node first:
/// the merge then moves it back before copying.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_and_a_merge_under_load_lose_no_write_and_scans_see_each_key_once() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const N: usize = 2000;
    let etcd = Etcd::start().expect("etcd");
    let nodes = start(&etcd, 3, &[]);
    let one = |m: &dpukv_proto::regionmap::RegionMap| {
        m.regions.len() == 1 && m.regions[0].backups.len() == 2 && m.regions[0].joining.is_empty()
    };
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), one).await;
    let (source, epoch) = (map.regions[0].id, map.regions[0].epoch);
    let seed = nodes[0].device.clone();
    let key = |i: usize| format!("key{i:05}").into_bytes();
    let c = Client::connect(&seed, 1).await.expect("connect");
    for chunk in (0..N).collect::<Vec<_>>().chunks(200) {
        let ops = chunk
            .iter()
            .map(|&i| dpukv_client::proto::WriteOp::Put { key: key(i), value: format!("v0-{i}").into_bytes() })
            .collect();
        c.batch(ops).await.expect("load");
    }
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    // Writers: writer w owns the keys i with i % 2 == w; per key, the values it may hold.
    let writers: Vec<_> = (0..2usize)
        .map(|w| {
            let (seed, stop) = (seed.clone(), stop.clone());
            tokio::spawn(async move {
                let c = Client::connect(&seed, 1).await.expect("connect");
                let mut may_hold: HashMap<usize, Vec<String>> = HashMap::new();
                // Keys written once each (between the others): a write lost to the copy is never
                // overwritten, so it shows.
                let mut once: Vec<Vec<u8>> = Vec::new();
                let (mut round, mut acked, mut failed) = (1u64, 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    for i in (w..N).step_by(2 * 7) {
                        let v = format!("v{round}-{i}");
                        match c.put(&key(i), v.as_bytes()).await {
                            Ok(_) => {
                                may_hold.insert(i, vec![v]);
                                acked += 1;
                            }
                            Err(_) => {
                                may_hold.entry(i).or_insert_with(|| vec![format!("v0-{i}")]).push(v);
                                failed += 1;
                            }
                        }
                        let k = [key((i * 7919 + round as usize) % N), format!("-{w}-{round}").into_bytes()].concat();
                        if c.put(&k, b"once").await.is_ok() {
                            once.push(k);
                        }
                    }
                    round += 1;
                }
                (may_hold, once, acked, failed)
            })
        })
        .collect();
    // The scanner: every scan sees each key once, in order, with a value of that key.
    let scans = std::sync::Arc::new(AtomicU64::new(0));
    let scanner = {
        let (seed, stop, scans) = (seed.clone(), stop.clone(), scans.clone());
        tokio::spawn(async move {
            let c = Client::connect(&seed, 1).await.expect("connect");
            while !stop.load(Ordering::Relaxed) {
                let items = match c.scan(b"key", b"key~", 1 << 20).await {
                    Ok(items) => items,
                    Err(e) => return Err(format!("a scan failed: {e}")),
                };
                if items.windows(2).any(|w| w[0].0 >= w[1].0) {
                    return Err("a scan's keys are not strictly ascending".into());
                }
                let items: Vec<_> = items.into_iter().filter(|(k, _)| k.len() == 8).collect();
                if items.len() != N {
                    return Err(format!("a scan saw {} of the {N} keys", items.len()));
                }
                for (i, (k, v)) in items.iter().enumerate() {
                    if *k != key(i) || !String::from_utf8_lossy(v).ends_with(&format!("-{i}")) {
                        return Err(format!(
                            "item {i} of a scan: {:?} = {:?}",
                            String::from_utf8_lossy(k),
                            String::from_utf8_lossy(v)
                        ));
                    }
                }
                scans.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let split_started = Instant::now();
    dpukv_cli(&seed, &["cluster", "split", &source.to_string(), "key01000"], Duration::from_secs(120), &nodes).await;
    let split_took = split_started.elapsed();
    let two = must_see_map(&nodes, |_| true, Duration::from_secs(30), |m| m.regions.len() == 2).await;
    let (left, right) = (&two.regions[0], &two.regions[1]);
    assert_eq!((left.id, left.end.as_deref()), (source, Some(&b"key01000"[..])), "{two:?}");
    assert!(left.epoch > epoch && right.id > source && right.start == b"key01000" && right.end.is_none(), "{two:?}");
    let nodes_of = |r: &dpukv_proto::regionmap::RegionInfo| r.replicas().collect::<std::collections::BTreeSet<u32>>();
    assert_eq!(nodes_of(right), nodes_of(left), "on its source's nodes (placement may then move its primary)");
    let scans_after_split = scans.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let merge_started = Instant::now();
    dpukv_cli(&seed, &["cluster", "merge", &right.id.to_string()], Duration::from_secs(120), &nodes).await;
    let merge_took = merge_started.elapsed();
    let merged = must_see_map(&nodes, |_| true, Duration::from_secs(30), |m| m.regions.len() == 1).await;
    assert_eq!((merged.regions[0].id, merged.regions[0].end.clone()), (source, None), "{merged:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    scanner
        .await
        .expect("scanner")
        .unwrap_or_else(|e| panic!("{e}\n{}", nodes.iter().map(ClusterNode::logs).collect::<String>()));
    let total_scans = scans.load(Ordering::Relaxed);
    let mut may_hold = HashMap::new();
    let mut once = Vec::new();
    let (mut acked, mut failed) = (0, 0);
    for w in writers {
        let (m, o, a, f) = w.await.expect("writer");
        may_hold.extend(m);
        once.extend(o);
        acked += a;
        failed += f;
    }
    let mut lost_once = 0;
    for k in &once {
        if c.get(k).await.expect("read").as_deref() != Some(&b"once"[..]) {
            lost_once += 1;
        }
    }
    assert_eq!(lost_once, 0, "of {} acknowledged inserts, {lost_once} lost", once.len());
    let mut wrong = Vec::new();
    for i in 0..N {
        let got = c.get(&key(i)).await.expect("read").map(|v| String::from_utf8_lossy(&v).to_string());
        let ok = match may_hold.get(&i) {
            Some(vals) => got.as_ref().is_some_and(|g| vals.contains(g)),
            None => got == Some(format!("v0-{i}")),
        };
        if !ok {
            wrong.push((i, got));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} keys lost their last acknowledged write: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    assert!(
        acked > 100 && scans_after_split > 0 && total_scans > scans_after_split,
        "load ran throughout: {acked} writes, {total_scans} scans"
    );
    let logs: String = nodes.iter().map(ClusterNode::logs).collect();
    assert!(logs.contains("handoff copied"), "the copy was reported");
    eprintln!(
        "split took {split_took:?}, merge {merge_took:?}; {acked} writes acknowledged, {failed} failed; {total_scans} scans"
    );
}

/// A region past the configured size splits by itself: its primary reports its size and middle
/// key, the master splits it there, and every key is still readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_past_its_size_splits_by_itself_at_its_middle() {
    let etcd = Etcd::start().expect("etcd");
    let nodes = start(&etcd, 3, &["--split-bytes", "262144"]);
    let one = |m: &dpukv_proto::regionmap::RegionMap| m.regions.len() == 1 && m.regions[0].backups.len() == 2;
    must_see_map(&nodes, |_| true, Duration::from_secs(60), one).await;
    let c = Client::connect(&nodes[0].device, 1).await.expect("connect");
    let value = vec![b'x'; 1000];
    for chunk in (0..1000u32).collect::<Vec<_>>().chunks(100) {
        let ops = chunk
            .iter()
            .map(|i| dpukv_client::proto::WriteOp::Put { key: format!("k{i:04}").into_bytes(), value: value.clone() })
            .collect();
        c.batch_across_regions(ops).await.expect("load");
    }
    let split = must_see_map(&nodes, |_| true, Duration::from_secs(60), |m| m.regions.len() >= 2).await;
    // The client still has the map from before the split: a batch across the new boundary is
    // refused as spanning regions, split again by the refreshed map, and applied.
    // (It was sent again and again, refused each time, until the client's 30 s deadline: a batch
    // that spans regions by the refreshed map is now handed back at once to be split.)
    let across = ["k0000a", "k0999a"]
        .map(|k| dpukv_client::proto::WriteOp::Put { key: k.as_bytes().to_vec(), value: b"across".to_vec() });
    let sent = std::time::Instant::now();
    c.batch_across_regions(across.to_vec()).await.expect("a batch across the new boundary, split again");
    assert!(sent.elapsed() < Duration::from_secs(10), "split again at once, took {:?}", sent.elapsed());
    for k in ["k0000a", "k0999a"] {
        assert_eq!(c.get(k.as_bytes()).await.expect("read").as_deref(), Some(&b"across"[..]), "{k}");
    }
    // Split near the middle of the keys (by bytes), not at an edge.
    let at = split.regions[1].start.clone();
    assert!(
        at.as_slice() > b"k0200".as_slice() && at.as_slice() < b"k0800".as_slice(),
        "split at {:?}",
        String::from_utf8_lossy(&at)
    );
    for i in 0..1000u32 {
        assert_eq!(c.get(format!("k{i:04}").as_bytes()).await.expect("read").as_deref(), Some(&value[..]), "key {i}");
    }
    eprintln!("split at {:?} into {} regions", String::from_utf8_lossy(&at), split.regions.len());
}
