//! The nemesis (docs/cluster.md §10): a randomized schedule of the faults the cluster must
//! survive, on real processes — three pods in network namespaces (each host's files under the
//! power-loss journal, each data directory a tmpfs that can be filled), a real etcd in a fourth,
//! a gateway — while concurrent clients (four routing by the region map, two through the
//! gateway) run. The run is a sequence of rounds; each round's clients use keys of their own,
//! one fault is applied and healed in it, the cluster must become whole again, and the round's
//! whole history must be linearizable. After every round, every round's keys are read once more
//! and each history, with those reads, checked again: nothing acknowledged was lost to a later
//! fault.
//!
//! Faults: SIGKILL of a pod, SIGSTOP of a pod or of its host past the lease, a partition of a
//! node (both ways), a one-way cut between two nodes, etcd killed and restarted or paused, a
//! node's disk full, a power loss of every node at once, and a jump of one node's wall clock
//! (libfaketime, both ways, up to a minute). `DPUKV_NEMESIS_SECONDS` (default
//! 60) sets how long the schedule runs, `DPUKV_NEMESIS_SEED` the seed (printed, to reproduce a
//! failure) and `DPUKV_NEMESIS_FAULTS` (`ClockJump,Kill`, ...) limits the faults drawn. Needs root, `ip` and `nft`. Each round prints its fault, the longest gap between two
//! acknowledged writes across the clients (the unavailability the fault caused) and how long the
//! cluster took to be whole again.

use std::time::{Duration, Instant};

use dpukv_e2e::cluster::{ClusterNode, must_see_map};
use dpukv_e2e::etcd::Etcd;
use dpukv_e2e::history::History;
use dpukv_e2e::linearizability::KeyOp;
use dpukv_e2e::netns::Net;
use dpukv_proto::regionmap::RegionMap;

use crate::linearizable::{Run, client_with, must_be_linearizable};

const ARGS: [&str; 8] =
    ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--fsync", "always", "--split-keys", "g,p"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    Pause,
    PauseHost,
    Partition,
    OneWay,
    EtcdStop,
    EtcdPause,
    DiskFull,
    PowerLoss,
    ClockJump,
}

const FAULTS: [Fault; 10] = [
    Fault::Kill,
    Fault::Pause,
    Fault::PauseHost,
    Fault::Partition,
    Fault::OneWay,
    Fault::EtcdStop,
    Fault::EtcdPause,
    Fault::DiskFull,
    Fault::PowerLoss,
    Fault::ClockJump,
];

/// libfaketime (Debian's `faketime` package): a node's processes run under it with their wall
/// clock offset read from a file of their own (its monotonic clock stays real), so a round can
/// jump one node's wall clock and jump it back.
fn libfaketime() -> &'static str {
    ["/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("libfaketime (apt-get install faketime; scripts/test.sh installs it)")
}

/// xorshift64: the schedule's only source of chance, so a seed reproduces it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

fn whole(m: &RegionMap) -> bool {
    m.nodes.len() == 3
        && m.regions.len() == 3
        && m.regions.iter().all(|r| m.node(r.primary).is_some() && r.backups.len() == 2 && r.joining.is_empty())
}

/// The longest time between two acknowledged writes of a history (ns), from its first write on.
fn longest_write_gap(h: &History) -> u64 {
    let mut acks: Vec<u64> =
        h.events().iter().filter(|e| !matches!(e.op, KeyOp::Get(_))).filter_map(|e| e.ret).collect();
    acks.sort_unstable();
    acks.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
}

/// [`must_be_linearizable`], with every process's logs when it is not.
fn checked(h: &History, nodes: &[ClusterNode], gw: &dpukv_e2e::gateway::Gateway) {
    if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| must_be_linearizable(h))) {
        eprintln!("{}{}", nodes.iter().map(ClusterNode::logs).collect::<String>(), gw.logs());
        std::panic::resume_unwind(e);
    }
}

/// Reads every key of every round once more into its history.
async fn read_back(seed: &str, rounds: &[Round]) {
    let c = dpukv_client::Client::connect(seed, 1).await.expect("connect");
    for r in rounds {
        for i in 0..5 {
            let k = [r.prefix.as_bytes(), format!("k{i}").as_bytes()].concat();
            let call = r.history.now();
            let v = c.get(&k).await.unwrap_or_else(|e| panic!("reading {} back: {e}", String::from_utf8_lossy(&k)));
            r.history.record(&k, KeyOp::Get(v), call, Some(r.history.now()));
        }
    }
}

struct Round {
    fault: Fault,
    history: History,
    prefix: String,
    gap: Duration,
    whole_after: Duration,
}

#[test]
fn nemesis() {
    let seconds = std::env::var("DPUKV_NEMESIS_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(60u64);
    let seed = std::env::var("DPUKV_NEMESIS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    // DPUKV_NEMESIS_FAULTS=ClockJump,Kill: only those (to reproduce or study one).
    let faults: Vec<Fault> = match std::env::var("DPUKV_NEMESIS_FAULTS") {
        Ok(only) => FAULTS.into_iter().filter(|f| only.split(',').any(|o| o.trim() == format!("{f:?}"))).collect(),
        Err(_) => FAULTS.to_vec(),
    };
    assert!(!faults.is_empty(), "DPUKV_NEMESIS_FAULTS names none of {FAULTS:?}");
    eprintln!("nemesis: {seconds} s, DPUKV_NEMESIS_SEED={seed}, faults {faults:?}");
    let mut rng = Rng(seed);
    // Declared first: dropped last, after every process in its namespaces is gone.
    let net = Net::new(&[2, 11, 12, 13]).expect("network namespaces (root, iproute2 and nftables)");
    let host = |id: u32| 10 + id as u8;
    let mut etcd = Etcd::start_in(net.exec_prefix(2), &net.addr(2)).expect("etcd");
    let clocks = tempfile::tempdir().expect("tempdir");
    let clock = |id: u32| clocks.path().join(format!("clock-{id}"));
    let mut nodes: Vec<ClusterNode> = (1..=3)
        .map(|id| {
            std::fs::write(clock(id), "+0\n").expect("clock file");
            let file = clock(id).to_string_lossy().into_owned();
            ClusterNode::start_in_with(
                id,
                "nemesis",
                &etcd.url(),
                &ARGS,
                net.exec_prefix(host(id)),
                &net.addr(host(id)),
                &[
                    ("DPUKV_FAULT_JOURNAL", "1"),
                    ("LD_PRELOAD", libfaketime()),
                    ("FAKETIME_TIMESTAMP_FILE", &file),
                    ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
                    ("FAKETIME_CACHE_DURATION", "1"),
                ],
                Some(512),
            )
            .expect("node")
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(must_see_map(&nodes, |_| true, Duration::from_secs(120), whole));
    let seeds: Vec<&str> = nodes.iter().map(|n| n.device.as_str()).collect();
    let gw = dpukv_e2e::gateway::Gateway::start(&seeds, &[]).expect("gateway");
    let started = Instant::now();
    let mut rounds: Vec<Round> = Vec::new();
    while started.elapsed() < Duration::from_secs(seconds) || rounds.is_empty() {
        let n = rounds.len();
        // Each round's keys in one of the three regions, in turn.
        let prefix = format!("{}{n}-", ["c", "k", "t"][n % 3]);
        let fault = faults[rng.below(faults.len() as u64) as usize];
        let (h, run) = (History::default(), Run::default());
        let mut tasks = Vec::new();
        for i in 0..6u64 {
            let addr = if i < 4 { nodes[i as usize % 3].device.clone() } else { gw.binary.clone() };
            tasks.push(rt.spawn(client_with(addr, i, h.clone(), run.clone(), false, true, prefix.clone())));
        }
        std::thread::sleep(rng.millis(300, 1000));
        let victim = 1 + rng.below(3) as u32;
        let other = 1 + (victim + rng.below(2) as u32) % 3;
        let hold = rng.millis(1000, 4000);
        eprintln!("round {n} ({prefix}): {fault:?}, node {victim}, {hold:?}");
        match fault {
            Fault::Kill => {
                nodes[victim as usize - 1].kill();
                std::thread::sleep(rng.millis(200, 2000));
                nodes[victim as usize - 1].resume().expect("restart the pod");
            }
            Fault::Pause | Fault::PauseHost => {
                let pod = fault == Fault::Pause;
                nodes[victim as usize - 1].signal("STOP", pod).expect("pause");
                std::thread::sleep(hold);
                nodes[victim as usize - 1].signal("CONT", pod).expect("resume");
            }
            Fault::Partition => {
                net.isolate(host(victim)).expect("isolate");
                std::thread::sleep(hold);
                net.heal(host(victim)).expect("heal");
            }
            Fault::OneWay => {
                net.cut(host(victim), host(other)).expect("cut");
                std::thread::sleep(hold);
                net.uncut(host(victim)).expect("uncut");
            }
            Fault::EtcdStop => {
                etcd.stop();
                std::thread::sleep(rng.millis(1000, 10_000));
                etcd.resume().expect("etcd again");
            }
            Fault::EtcdPause => {
                etcd.signal("STOP").expect("pause etcd");
                std::thread::sleep(hold);
                etcd.signal("CONT").expect("resume etcd");
            }
            Fault::DiskFull => {
                nodes[victim as usize - 1].fill_disk().expect("fill the disk");
                std::thread::sleep(hold);
                nodes[victim as usize - 1].free_disk().expect("free the disk");
            }
            Fault::ClockJump => {
                // One node's wall clock (host and device) jumps by up to a minute either way,
                // and back: nothing may depend on it but the bounded-staleness clocks, which
                // must notice.
                let secs = 5 + rng.below(56);
                let jump = if rng.below(2) == 0 { format!("+{secs}s") } else { format!("-{secs}s") };
                eprintln!("  node {victim}'s wall clock jumps {jump}");
                std::fs::write(clock(victim), format!("{jump}\n")).expect("jump");
                std::thread::sleep(hold + Duration::from_secs(1));
                std::fs::write(clock(victim), "+0\n").expect("jump back");
                std::thread::sleep(Duration::from_millis(1100));
            }
            Fault::PowerLoss => {
                for node in nodes.iter_mut() {
                    node.kill();
                }
                for node in nodes.iter_mut() {
                    let cut = seed.wrapping_mul(31).wrapping_add(n as u64 * 7 + u64::from(node.id));
                    node.power_cut(cut).expect("power cut");
                }
                for node in nodes.iter_mut() {
                    node.resume().expect("power back on");
                }
            }
        }
        run.restarts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let healed = Instant::now();
        rt.block_on(must_see_map(&nodes, |_| true, Duration::from_secs(120), whole));
        let whole_after = healed.elapsed();
        // Some calm, then the clients stop once the round has enough events.
        std::thread::sleep(Duration::from_millis(500));
        run.stop_when(Duration::from_secs(60), || h.len() >= 400);
        rt.block_on(async {
            for t in tasks {
                t.await.expect("client task");
            }
        });
        checked(&h, &nodes, &gw);
        let gap = Duration::from_nanos(longest_write_gap(&h));
        rounds.push(Round { fault, history: h.clone(), prefix, gap, whole_after });
        // Every round's keys, this one's too, after this round's fault: each history with these
        // reads must still be linearizable (an acknowledged write lost shows here).
        // (All of them every fifth round and at the end; the last two otherwise: a long run's
        // checks would otherwise grow with the square of its rounds.)
        let last = started.elapsed() >= Duration::from_secs(seconds);
        let from = if n % 5 == 4 || last { 0 } else { rounds.len().saturating_sub(2) };
        rt.block_on(read_back(&nodes[0].device, &rounds[from..]));
        for r in &rounds[from..] {
            checked(&r.history, &nodes, &gw);
        }
        eprintln!(
            "round {n}: {} events, linearizable; longest write gap {gap:?}, whole {whole_after:?} after healing",
            h.len()
        );
    }
    // The figures, by fault.
    let mut by: std::collections::BTreeMap<Fault, Vec<(Duration, Duration)>> = Default::default();
    for r in &rounds {
        by.entry(r.fault).or_default().push((r.gap, r.whole_after));
    }
    eprintln!(
        "nemesis: {} rounds in {:?}, seed {seed}; 0 lost, every history linearizable",
        rounds.len(),
        started.elapsed()
    );
    for (f, mut v) in by {
        v.sort();
        let gaps: Vec<Duration> = v.iter().map(|x| x.0).collect();
        let median = gaps[gaps.len() / 2];
        let worst = gaps[gaps.len() - 1];
        eprintln!("  {f:?}: {} rounds; longest write gap median {median:?}, max {worst:?}", v.len());
    }
    drop(gw);
    drop(nodes);
}
