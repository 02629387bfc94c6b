//! Hot-key replicas on real node pods (docs/hot-keys.md): popular keys are copied to the
//! backups' devices and served there within the reader's consistency; bounded reads are checked
//! against their bound, linearizable ones for linearizability, and a killed replica's reads fall
//! back to the primary without a wrong answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_client::{Client, Options};
use dpukv_e2e::cluster::{ClusterNode, must_see_map};
use dpukv_e2e::etcd::Etcd;
use dpukv_e2e::linearizability::{self, KeyOp, Verdict};
use dpukv_e2e::staleness::{self, Read, Write};
use dpukv_proto::Consistency;

const BOUND_MS: u32 = 100;
const HOT: usize = 8;

/// Everything the clients did, on one clock.
#[derive(Clone, Default)]
struct Record {
    writes: Arc<Mutex<Vec<Write>>>,
    bounded: Arc<Mutex<Vec<Read>>>,
    linearizable: Arc<Mutex<Vec<Read>>>,
}

fn key(i: usize) -> Vec<u8> {
    format!("hot{i}").into_bytes()
}

async fn client(addr: &str, c: Consistency) -> Client {
    let opts = Options { pool: 2, consistency: c, ..Options::default() };
    Client::connect_with(addr, opts).await.expect("connect")
}

/// Runs writers, bounded readers and linearizable readers until `until`; answers the gets the
/// bounded readers had served by primaries and by replicas.
async fn run(seed: &str, rec: &Record, t0: Instant, until: Instant, phase: &str) -> (u64, u64) {
    run_with(seed, rec, t0, until, phase, false).await
}

/// [`run`]; with `failover`, a get may fail (while the region has no primary), never be wrong.
async fn run_with(seed: &str, rec: &Record, t0: Instant, until: Instant, phase: &str, failover: bool) -> (u64, u64) {
    let now = move || t0.elapsed().as_nanos() as u64;
    let mut tasks = tokio::task::JoinSet::new();
    for wi in 0..2 {
        let (c, rec) = (client(seed, Consistency::Linearizable).await, rec.clone());
        let phase = phase.to_string();
        tasks.spawn(async move {
            let mut i = 0;
            while Instant::now() < until {
                let k = key((i * 3 + wi) % HOT);
                let v = format!("{phase}-w{wi}-{i}").into_bytes();
                let call = now();
                let r = c.put(&k, &v).await;
                let ret = r.is_ok().then(now);
                rec.writes.lock().expect("history lock").push(Write { key: k, value: v, call, ret });
                i += 1;
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        });
    }
    let bounded = client(seed, Consistency::Bounded { max_staleness_ms: BOUND_MS }).await;
    let lin = client(seed, Consistency::Linearizable).await;
    for ri in 0..6 {
        let (c, rec) = (if ri < 4 { bounded.clone() } else { lin.clone() }, rec.clone());
        tasks.spawn(async move {
            let mut i = ri;
            while Instant::now() < until {
                let k = key(i % HOT);
                let call = now();
                // A read may fail while a replica dies (it is retried at the primary); an
                // error is an error, never a wrong value.
                let v = match c.get(&k).await {
                    Ok(v) => v,
                    Err(_) if failover => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    Err(e) => panic!("a get of a hot key failed: {e}"),
                };
                let read = Read { key: k, value: v, call, ret: now() };
                if ri < 4 {
                    rec.bounded.lock().expect("history lock").push(read)
                } else {
                    rec.linearizable.lock().expect("history lock").push(read)
                }
                i += 1;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("a client task panicked");
    }
    bounded.read_counts().get()
}

fn check(rec: &Record, initial: &HashMap<Vec<u8>, Vec<u8>>) {
    let writes = rec.writes.lock().expect("history lock").clone();
    let bounded = rec.bounded.lock().expect("history lock").clone();
    let v = staleness::check(&writes, &bounded, initial, u64::from(BOUND_MS) * 1_000_000);
    assert!(v.is_empty(), "{} bounded reads broke their bound, first: {:?}", v.len(), v.first());
    // Linearizable reads with every write, as one history.
    let mut events: Vec<linearizability::Event> = writes
        .iter()
        .map(|w| linearizability::Event {
            key: w.key.clone(),
            op: KeyOp::Put(w.value.clone()),
            call: w.call,
            ret: w.ret,
        })
        .collect();
    for (k, v) in initial {
        events.push(linearizability::Event { key: k.clone(), op: KeyOp::Put(v.clone()), call: 0, ret: Some(1) });
    }
    for r in rec.linearizable.lock().expect("history lock").iter() {
        events.push(linearizability::Event {
            key: r.key.clone(),
            op: KeyOp::Get(r.value.clone()),
            call: r.call,
            ret: Some(r.ret),
        });
    }
    assert_eq!(linearizability::check(&events, 5_000_000), Verdict::Linearizable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_are_read_from_replicas_within_their_bound_and_a_killed_replica_s_reads_fall_back() {
    let etcd = Etcd::start().expect("etcd");
    let env = [
        ("DPUKV_POPULAR_K", "2"),
        ("DPUKV_POPULAR_WINDOW", "1000"),
        ("DPUKV_REPLICA_SYNC_INTERVAL_MS", "5"),
        ("DPUKV_MAX_CLOCK_SKEW_MS", "0"),
    ];
    let args = ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--fsync", "interval:5"];
    let mut nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start_with(id, "hot", &etcd.url(), &args, &[], &env).expect("node")).collect();
    let laid_out = |m: &dpukv_proto::regionmap::RegionMap| {
        m.regions.len() == 1 && m.regions[0].primary != 0 && m.regions[0].backups.len() == 2
    };
    let map = must_see_map(&nodes, |_| true, Duration::from_secs(60), laid_out).await;
    let primary = map.regions[0].primary;
    let seed = map.node(primary).expect("registered").device.clone();
    let setup = client(&seed, Consistency::Linearizable).await;
    let mut initial = HashMap::new();
    for i in 0..HOT {
        let v = format!("initial-{i}").into_bytes();
        setup.put(&key(i), &v).await.expect("seed a hot key");
        initial.insert(key(i), v);
    }
    let (rec, t0) = (Record::default(), Instant::now());

    // All nodes up: the bounded readers are served by replicas, within their bound.
    let (p, r) = run(&seed, &rec, t0, Instant::now() + Duration::from_secs(6), "a").await;
    eprintln!("all up: bounded gets {p} by the primary, {r} by replicas");
    assert!(r * 5 > p + r, "replicas served {r} of {} bounded gets: under 20%", p + r);
    check(&rec, &initial);

    // A replica's node is killed: its reads go to the other replica or the primary; nothing
    // wrong is returned and no get fails.
    let victim = map.regions[0].backups[0];
    nodes[victim as usize - 1].kill();
    let (p2, r2) = run(&seed, &rec, t0, Instant::now() + Duration::from_secs(5), "b").await;
    eprintln!("replica {victim} killed: bounded gets {p2} by the primary, {r2} by replicas");
    assert!(p2 > 0 && r2 > 0, "reads went on at the primary and the live replica");
    check(&rec, &initial);
    nodes[victim as usize - 1].resume().expect("restart the replica");
    must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.nodes.len() == 3 && m.regions[0].backups.len() == 2 && m.regions[0].primary == primary,
    )
    .await;

    // The primary's host is paused past its lease while its device lives on: a backup takes
    // over. The old primary's device must stop vouching for its copies (a paused host once left
    // its device stamping fresh watermarks), the replicas must refuse readers that know the new
    // epoch, and the new primary announces its epoch: no bounded read breaks its bound, and the
    // linearizable reads and the writes stay linearizable, across the whole failover.
    let until = Instant::now() + Duration::from_secs(8);
    let pause = {
        let host = nodes[primary as usize - 1].host_pid().expect("the primary's host runs").to_string();
        let signal = move |s: &str| {
            let ok = std::process::Command::new("kill").arg(s).arg(&host).status().is_ok_and(|x| x.success());
            assert!(ok, "kill {s} {host}");
        };
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            signal("-STOP");
            tokio::time::sleep(Duration::from_secs(4)).await;
            signal("-CONT");
        })
    };
    let (p3, r3) = run_with(&seed, &rec, t0, until, "c", true).await;
    pause.await.expect("pause task");
    let after = must_see_map(&nodes, |_| true, Duration::from_secs(30), |m| m.regions[0].primary != primary).await;
    eprintln!(
        "primary {primary}'s host paused 4 s: node {} leads now; bounded gets {p3} by primaries, {r3} by replicas",
        after.regions[0].primary
    );
    check(&rec, &initial);
    drop(nodes);
}
