//! `dpukv local` keeps a pod up as a kubelet would: a host or device that dies is restarted,
//! clients carry on (their retries bridge the gap), and SIGTERM stops everything.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dpukv_client::Client;
use dpukv_e2e::procs::{Proc, bin_dir};

/// `dpukv local` with `flags` on `dir` (its output discarded), killed when dropped.
fn start_local(flags: &[&str], dir: &std::path::Path) -> Proc {
    let mut c = Command::new(bin_dir().expect("binaries").join("dpukv"));
    c.arg("local").args(flags).arg("--dir").arg(dir).stdout(Stdio::null()).stderr(Stdio::null());
    Proc(c.spawn().expect("start dpukv local"))
}

/// The pids of `pid`'s children running `binary`.
fn children_running(pid: u32, binary: &str) -> Vec<u32> {
    let list = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    list.split_whitespace()
        .filter_map(|c| c.parse().ok())
        .filter(|c| {
            std::fs::read(format!("/proc/{c}/cmdline"))
                .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).split('\0').next().is_some_and(|a| a.ends_with(binary)))
        })
        .collect()
}

/// Waits until `pid` has exactly one child running `binary` other than `not`; returns it.
fn child_running(pid: u32, binary: &str, not: Option<u32>) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found: Vec<u32> = children_running(pid, binary).into_iter().filter(|c| Some(*c) != not).collect();
        if let [one] = found[..] {
            return one;
        }
        assert!(Instant::now() < deadline, "no {binary} under dpukv local");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn kill(signal: &str, pid: u32) {
    let ok = Command::new("kill").args([signal, &pid.to_string()]).status().is_ok_and(|s| s.success());
    assert!(ok, "kill {signal} {pid}");
}

#[test]
fn local_restarts_a_process_that_dies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = dpukv_e2e::procs::free_port().expect("a free port");
    let addr = format!("127.0.0.1:{port}");
    let mut local = Command::new(bin_dir().expect("binaries").join("dpukv"))
        .args(["local", "--listen", &addr, "--fsync", "always", "--dir"])
        .arg(dir.path())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start dpukv local");
    let stderr = local.stderr.take().expect("stderr");
    let (lines, said) = std::sync::mpsc::channel::<String>();
    let log = std::thread::spawn(move || {
        let mut all = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send(line.clone());
            all.push(line);
        }
        all
    });
    let local = Proc(local);
    let pid = local.0.id();
    // Ready when it says so (on a loaded machine starting takes a while: wait for the event,
    // not a guess; it failed once at a 30 s guess). Its stderr ending first is a failure.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match said.recv_timeout(left) {
            Ok(line) if line.contains("the gateway serves on") => break,
            Ok(_) => {}
            Err(e) => panic!("dpukv local never said it serves within 300 s ({e})"),
        }
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        let c = loop {
            match Client::connect(&addr, 1).await {
                Ok(c) => break c,
                Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => panic!("dpukv local never served: {e}"),
            }
        };
        c.put(b"before", b"1").await.expect("put");
        let host = child_running(pid, "dpukv-node", None);
        kill("-9", host);
        c.put(b"after-host", b"2").await.expect("the retried put lands on the restarted host");
        let new_host = child_running(pid, "dpukv-node", Some(host));
        assert_ne!(new_host, host);
        let device = child_running(pid, "dpukv-dpu", None);
        kill("-9", device);
        assert_eq!(c.get(b"before").await.expect("the read is retried").as_deref(), Some(&b"1"[..]));
        assert_eq!(c.get(b"after-host").await.expect("read").as_deref(), Some(&b"2"[..]));
        let new_device = child_running(pid, "dpukv-dpu", Some(device));
        kill("-TERM", pid);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z")) {
            assert!(Instant::now() < deadline, "dpukv local did not stop on SIGTERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for p in [new_host, new_device] {
            let gone = !std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| !s.contains(") Z"));
            assert!(gone, "process {p} outlived dpukv local");
        }
    });
    drop(local); // reaps it
    let log = log.join().expect("log reader");
    let restarts = log.iter().filter(|l| l.contains("exited") && l.contains("restart")).count();
    assert_eq!(restarts, 2, "{log:#?}");
}

/// `dpukv regions` and `dpukv nodes` print the map a node serves by (a standalone node: its
/// regions, all led by node 1).
#[test]
fn regions_and_nodes_print_the_map_a_node_serves_by() {
    let pod = dpukv_e2e::procs::Pod::start(&["--split-keys", "g,p"]).expect("pod");
    let cli = |cmd: &str| {
        let out = Command::new(bin_dir().expect("binaries").join("dpukv"))
            .args(["--endpoint", &pod.addr, cmd])
            .output()
            .expect("run dpukv");
        assert!(out.status.success(), "dpukv {cmd}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    };
    assert_eq!(cli("regions"), "1\t\tg\t1\t\t1\n2\tg\tp\t1\t\t1\n3\tp\t\t1\t\t1\n");
    assert_eq!(cli("nodes"), "1\t\t\t\t\n");
}

/// `dpukv local --tls`: its own CA in DIR/tls, named in cluster.json; the CLI trusting it works
/// through the gateway, without it is refused; the device wants a client certificate (the
/// `client` role's in DIR/tls). And `dpukv local` killed with SIGKILL takes its processes with it.
#[test]
fn local_tls_serves_only_clients_that_trust_its_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = dpukv_e2e::procs::free_port().expect("a free port");
    let addr = format!("127.0.0.1:{port}");
    let _local = start_local(&["--tls", "--listen", &addr], dir.path());
    let info = dpukv_e2e::procs::cluster_json(dir.path(), Duration::from_secs(30)).expect("cluster.json");
    let ca = info["tls_ca"].as_str().expect("tls_ca").to_string();
    assert_eq!(std::path::Path::new(&ca), dir.path().join("tls/ca.pem"));
    let device = info["nodes"][0]["device"].as_str().expect("device").to_string();
    let cli = |endpoint: &str, tls: &[&str], args: &[&str]| {
        Command::new(bin_dir().expect("binaries").join("dpukv"))
            .args(["--endpoint", endpoint])
            .args(tls)
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("run dpukv")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = cli(&addr, &["--tls-ca", &ca], &["put", "k", "v"]);
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "never served: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = cli(&addr, &["--tls-ca", &ca], &["get", "k"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "v\n");
    let out = cli(&addr, &[], &["get", "k"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("speaks TLS"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = cli(&device, &["--tls-ca", &ca], &["get", "k"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("CertificateRequired"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A client's certificate (role client) writes and reads at the device.
    let cert = dir.path().join("tls/client.pem");
    let key = dir.path().join("tls/client.key");
    let (cert, key) = (cert.to_str().expect("utf-8"), key.to_str().expect("utf-8"));
    let out = cli(&device, &["--tls-ca", &ca, "--tls-cert", cert, "--tls-key", key], &["get", "k"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "v\n", "{}", String::from_utf8_lossy(&out.stderr));
    // Killed outright, dpukv local leaves none of its processes behind.
    let pid = _local.0.id();
    let children: Vec<u32> =
        ["dpukv-node", "dpukv-dpu", "dpukv-gateway"].iter().flat_map(|b| children_running(pid, b)).collect();
    assert_eq!(children.len(), 3, "host, device and gateway under dpukv local");
    kill("-9", pid);
    let deadline = Instant::now() + Duration::from_secs(10);
    for c in children {
        while std::fs::read_to_string(format!("/proc/{c}/stat")).is_ok_and(|s| !s.contains(") Z")) {
            assert!(Instant::now() < deadline, "process {c} outlived dpukv local's SIGKILL");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The local addresses of the TCP sockets `pid` listens on (from `/proc/net/tcp{,6}`, matched
/// by the socket inodes among its descriptors).
fn listening(pid: u32) -> Vec<std::net::SocketAddr> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(String::from))
        .collect();
    let mut out = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        for line in std::fs::read_to_string(file).unwrap_or_default().lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address, st (0A: LISTEN), inode
            if f.len() < 10 || f[3] != "0A" || !inodes.contains(f[9]) {
                continue;
            }
            let (ip, port) = f[1].split_once(':').expect("address:port");
            let port = u16::from_str_radix(port, 16).expect("port");
            let ip: std::net::IpAddr = if v6 {
                let mut b = [0u8; 16];
                for (i, w) in b.chunks_mut(4).enumerate() {
                    let word = u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16).expect("hex");
                    w.copy_from_slice(&word.to_le_bytes());
                }
                std::net::Ipv6Addr::from(b).into()
            } else {
                std::net::Ipv4Addr::from(u32::from_str_radix(ip, 16).expect("hex").to_le_bytes()).into()
            };
            out.push(std::net::SocketAddr::new(ip, port));
        }
    }
    out
}

/// `dpukv local --nodes 3` without `--tls` runs everything in plain text without credentials,
/// so every listener it starts — etcd's, each host's admin, control and replication ports,
/// each device's, the gateway's — is on 127.0.0.1; and it refuses a gateway address that is not.
#[test]
fn local_without_tls_listens_on_loopback_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = bin_dir().expect("binaries");
    let exposed_dir = tempfile::tempdir().expect("tempdir");
    let mut refused = Proc(
        Command::new(bin.join("dpukv"))
            .args(["local", "--nodes", "3", "--listen", "0.0.0.0:7070", "--dir"])
            .arg(exposed_dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dpukv local"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = refused.0.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "a plain gateway on every interface was started");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut why = String::new();
    std::io::Read::read_to_string(&mut refused.0.stderr.take().expect("stderr"), &mut why).expect("stderr");
    assert!(!status.success() && why.contains("127.0.0.1 only"), "{status}: {why}");
    let addr = format!("127.0.0.1:{}", dpukv_e2e::procs::free_port().expect("port"));
    let local = start_local(&["--nodes", "3", "--listen", &addr], dir.path());
    let pid = local.0.id();
    // Once all three hosts registered, every process listens where it will.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = Command::new(bin.join("dpukv")).args(["--endpoint", &addr, "nodes"]).output().expect("dpukv nodes");
        if out.status.success() && String::from_utf8_lossy(&out.stdout).lines().count() == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "three nodes never registered: {out:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut all = Vec::new();
    for binary in ["etcd", "dpukv-node", "dpukv-dpu", "dpukv-gateway"] {
        for child in children_running(pid, binary) {
            let l = listening(child);
            assert!(!l.is_empty(), "{binary} ({child}) listens nowhere");
            all.extend(l.into_iter().map(|a| (binary, a)));
        }
    }
    // etcd: client and peer; hosts: admin, control, replication; devices: data; gateway:
    // binary and admin.
    assert!(all.len() >= 2 + 3 * 3 + 3 + 2, "{all:?}");
    let exposed: Vec<_> = all.iter().filter(|(_, a)| !a.ip().is_loopback()).collect();
    assert!(exposed.is_empty(), "listening beyond loopback: {exposed:?}");
}

/// `dpukv local --nodes 3 --fabric tcp --tls` (issue 30): every device serves a fabric endpoint,
/// listed in cluster.json and registered in the region map; `dpukv-bench` runs YCSB A over it
/// with no errors (with a client certificate: the fabric endpoint speaks TLS like the data
/// port), and a client without a certificate is refused there too.
#[test]
fn local_fabric_endpoints_serve_ycsb_with_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = dpukv_e2e::procs::free_port().expect("a free port");
    let addr = format!("127.0.0.1:{port}");
    let _local = start_local(&["--nodes", "3", "--fabric", "tcp", "--tls", "--listen", &addr], dir.path());
    let info = dpukv_e2e::procs::cluster_json(dir.path(), Duration::from_secs(30)).expect("cluster.json");
    let fabrics: Vec<String> =
        (0..3).map(|i| info["nodes"][i]["fabric"].as_str().expect("fabric").to_string()).collect();
    for f in &fabrics {
        assert!(f.starts_with("fabric://tcp/127.0.0.1:"), "{f}");
    }
    let tls = |f: &str| dir.path().join("tls").join(f).display().to_string();
    let client_tls = [
        "--tls-ca".to_string(),
        tls("ca.pem"),
        "--tls-cert".into(),
        tls("client.pem"),
        "--tls-key".into(),
        tls("client.key"),
    ];
    let bench = |args: &[&str]| {
        Command::new(bin_dir().expect("binaries").join("dpukv-bench"))
            .args(["--endpoint", &fabrics[1]])
            .args(&client_tls)
            .args(args)
            .output()
            .expect("run dpukv-bench")
    };
    // Loaded once the cluster serves (the map settles in a few seconds).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = bench(&["--load-only", "--records", "5000"]);
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "never loaded: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(500));
    }
    let out = bench(&["--workload", "a", "--records", "5000", "--duration", "2", "--threads", "2", "--depth", "8"]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains(" 0 errors"), "{text}");
    // Every device has an admin endpoint of its own, listed as `device_admin`: their metrics
    // count the reads just served.
    let served: f64 = (0..3)
        .map(|i| {
            let admin = info["nodes"][i]["device_admin"].as_str().expect("device_admin").to_string();
            assert!(admin.starts_with("127.0.0.1:"), "{admin}");
            let out =
                Command::new("curl").args(["-s", "--max-time", "10", &format!("http://{admin}/metrics")]).output();
            let text = String::from_utf8_lossy(&out.expect("curl").stdout).to_string();
            text.lines()
                .find(|l| l.starts_with("dpukv_device_reads_served_total "))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no reads counter at {admin}: {text}"))
        })
        .sum();
    assert!(served > 0.0, "the devices served the benchmark's reads");
    // No certificate: refused at the fabric endpoint, as at the data port.
    let out = Command::new(bin_dir().expect("binaries").join("dpukv"))
        .args(["--endpoint", &fabrics[0], "--tls-ca", &tls("ca.pem"), "get", "k"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run dpukv");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("CertificateRequired"), "{err}");
}

/// Every node's cluster loop read the cluster's whole state from etcd every 50 ms — 60 reads a
/// second for three idle nodes, most of etcd's and a good part of the hosts' idle CPU. It now
/// reads when etcd says something changed (a watch) and otherwise every quarter second; only
/// while a node has work in progress that etcd does not announce does it read every 50 ms.
#[test]
fn an_idle_cluster_reads_its_state_from_etcd_a_few_times_a_second() {
    let dir = tempfile::tempdir().expect("dir");
    let gw = format!("127.0.0.1:{}", dpukv_e2e::procs::free_port().expect("port"));
    let _local = start_local(&["--nodes", "3", "--listen", &gw], dir.path());
    let info = dpukv_e2e::procs::cluster_json(dir.path(), Duration::from_secs(60)).expect("cluster.json");
    let etcd = info["etcd"].as_str().expect("etcd").trim_start_matches("http://").to_string();
    // etcd's count of the reads (ranges, and the read-only transactions the nodes read by).
    let reads = || -> f64 {
        let text = dpukv_e2e::cluster::http_call(&etcd, "GET", "/metrics", Duration::from_secs(5)).expect("metrics");
        text.lines()
            .filter(|l| l.starts_with("grpc_server_handled_total{grpc_code=\"OK\""))
            .filter(|l| l.contains("grpc_method=\"Range\"") || l.contains("grpc_method=\"Txn\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    // Laid out and settled: the gateway answers and a write is acknowledged by all three.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(c) = Client::connect(&gw, 1).await
                && c.put(b"settled", b"yes").await.is_ok()
            {
                break;
            }
            assert!(Instant::now() < deadline, "the cluster never took a write");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let (before, began) = (reads(), Instant::now());
    std::thread::sleep(Duration::from_secs(6));
    let per_sec = (reads() - before) / began.elapsed().as_secs_f64();
    // 3 nodes at 4 reads a second, the master's rounds and the nodes' load reports: about 20
    // (60 or more before).
    assert!(per_sec < 40.0, "an idle 3-node cluster read etcd {per_sec:.1} times a second");
}
