//! TLS through a real cluster: mutual TLS on the devices and the replication links, TLS on the
//! gateway's three front ends (the client library, `curl`, `redis-cli`), a failover carried over
//! TLS, every kind of stranger refused with a clear error, and a certificate rotated under an
//! open connection.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpukv_client::{Client, ClientError, Options};
use dpukv_e2e::certs::ClusterCerts;
use dpukv_e2e::cluster::ClusterNode;
use dpukv_e2e::etcd::Etcd;
use dpukv_e2e::gateway::Gateway;
use dpukv_net::identity::Role;
use dpukv_net::tls::ClientTls;

fn opts(tls: Arc<ClientTls>) -> Options {
    Options { pool: 1, token: None, tls: Some(tls), ..Options::default() }
}

/// The newest region map the nodes answer over TLS, once `ready` holds for it.
async fn tls_map(
    nodes: &[ClusterNode],
    tls: &Arc<ClientTls>,
    ready: impl Fn(&dpukv_proto::regionmap::RegionMap) -> bool,
) -> dpukv_proto::regionmap::RegionMap {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for n in nodes {
            if let Ok(c) = Client::connect_with(&n.device, opts(tls.clone())).await
                && let Ok(m) = c.region_map().await
                && ready(&m)
            {
                return m;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no map over TLS\n{}",
            nodes.iter().map(ClusterNode::logs).collect::<String>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `curl` over HTTPS trusting `ca`: the status and the body (status 0: no HTTP answer).
fn curl(ca: Option<&std::path::Path>, method: &str, url: &str, body: Option<&str>) -> (u16, String) {
    let mut c = Command::new("curl");
    c.args(["-s", "-X", method, "-o", "-", "-w", "\n%{http_code}", "--max-time", "20", url]);
    if let Some(ca) = ca {
        c.arg("--cacert").arg(ca);
    }
    if let Some(b) = body {
        c.args(["--data-binary", b]);
    }
    let out = c.output().expect("curl (Debian's curl package) runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// `redis-cli` against `port` (with TLS trusting `ca` if given): its output, trimmed.
fn redis(ca: Option<&std::path::Path>, port: &str, args: &[&str]) -> String {
    let mut c = Command::new("redis-cli");
    if let Some(ca) = ca {
        c.arg("--tls").arg("--cacert").arg(ca);
    }
    let out = c.args(["-h", "127.0.0.1", "-p", port]).args(args).output().expect("redis-cli runs");
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)).trim().to_string()
}

/// The SHA-256 fingerprint of the certificate the server at `addr` presents (`openssl`).
fn served_fingerprint(addr: &str) -> String {
    let shown = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {addr} </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256"
        ))
        .output()
        .expect("openssl runs");
    let text = String::from_utf8_lossy(&shown.stdout).trim().to_string();
    assert!(text.contains("Fingerprint"), "no certificate from {addr}: {text:?}");
    text
}

/// Asserts that `r` failed with a TLS error mentioning `what`, and quickly (the client must not
/// retry what retrying cannot fix).
fn must_refuse<T: std::fmt::Debug>(r: Result<T, ClientError>, started: Instant, what: &str) {
    match r {
        Err(ClientError::Tls(why)) => assert!(why.contains(what), "refused, but for {why:?} (expected {what:?})"),
        other => panic!("expected a TLS refusal ({what}), got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5), "the refusal took {:?}", started.elapsed());
}

#[test]
fn tls_everywhere_refuses_strangers_and_survives_failover_and_rotation() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A certificate per role (docs/security.md): node-<id>, the gateway's; and a stranger's of
    // another CA.
    let certs = ClusterCerts::issue(dir.path(), "tls", 3).expect("certificates");
    let ca_pem = certs.ca();
    let (node_tls, stranger) = (certs.files("node-1"), certs.files("foreign"));
    let other_ca = certs.foreign_ca();
    let node_flags = certs.node_flags();
    let node_flags: Vec<&str> = node_flags.iter().map(String::as_str).collect();
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--split-keys", "m"];
    let mut nodes: Vec<ClusterNode> = (1..=3)
        .map(|id| ClusterNode::start_with(id, "tls", &etcd.url(), &args, &node_flags, &[]).expect("node"))
        .collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let member = ClientTls::load(&ca_pem, Some((&node_tls.cert, &node_tls.key))).expect("member TLS");
    rt.block_on(tls_map(&nodes, &member, |m| {
        m.regions.len() == 2 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2)
    }));
    let seeds: Vec<&str> = nodes.iter().map(|n| n.device.as_str()).collect();
    let gw_flags = certs.gateway_flags();
    let gw_flags: Vec<&str> = gw_flags.iter().map(String::as_str).collect();
    let gw = Gateway::start(&seeds, &gw_flags).expect("gateway");
    let trusting = ClientTls::load(&ca_pem, None).expect("client TLS");

    // Every process's log, for a failure's message.
    let logs =
        |nodes: &[ClusterNode]| format!("{}{}", nodes.iter().map(ClusterNode::logs).collect::<String>(), gw.logs());
    rt.block_on(async {
        // The binary protocol through the gateway, over TLS, without a client certificate.
        let c = Client::connect_with(&gw.binary, opts(trusting.clone())).await.expect("connect over TLS");
        c.put(b"apple", b"red").await.unwrap_or_else(|e| panic!("put: {e:?}\n{}", logs(&nodes)));
        c.put(b"zebra", b"stripes").await.unwrap_or_else(|e| panic!("put: {e:?}\n{}", logs(&nodes)));
        assert_eq!(c.get(b"apple").await.expect("get").as_deref(), Some(&b"red"[..]));

        // Strangers, each refused at once with what went wrong.
        let t = Instant::now();
        let plain = Client::connect(&gw.binary, 1).await.expect("TCP connects");
        must_refuse(plain.get(b"apple").await, t, "speaks TLS");
        let t = Instant::now();
        let wrong_ca = ClientTls::load(&other_ca, None).expect("other CA");
        must_refuse(Client::connect_with(&gw.binary, opts(wrong_ca)).await.map(|_| ()), t, "not trusted");
        // The devices want a certificate from the cluster's CA.
        let t = Instant::now();
        let anonymous = Client::connect_with(&nodes[0].device, opts(trusting.clone())).await.expect("handshake");
        must_refuse(anonymous.get(b"apple").await, t, "refused");
        let t = Instant::now();
        let foreign = ClientTls::load(&ca_pem, Some((&stranger.cert, &stranger.key))).expect("stranger TLS");
        let foreign = Client::connect_with(&nodes[0].device, opts(foreign)).await.expect("handshake");
        must_refuse(foreign.get(b"apple").await, t, "refused");
        let t = Instant::now();
        let plain = Client::connect(&nodes[0].device, 1).await.expect("TCP connects");
        must_refuse(plain.get(b"apple").await, t, "speaks TLS");

        // HTTP: HTTPS works, plain HTTP gets no answer.
        let https = |path: &str| format!("https://{}{path}", gw.http);
        let (s, b) = curl(Some(&ca_pem), "GET", &https("/v1/kv/apple"), None);
        assert_eq!(s, 200, "{b}");
        assert!(b.contains("\"red\""), "{b}");
        let (s, b) = curl(Some(&ca_pem), "PUT", &https("/v1/kv/kiwi"), Some(r#"{"value": "green"}"#));
        assert_eq!(s, 200, "{b}");
        assert_eq!(curl(None, "GET", &format!("http://{}/v1/kv/apple", gw.http), None).0, 0);
        assert_eq!(curl(Some(&other_ca), "GET", &https("/v1/kv/apple"), None).0, 0, "curl trusted a stranger");

        // The Redis protocol: redis-cli --tls works, plain redis-cli does not.
        assert_eq!(redis(Some(&ca_pem), gw.resp_port(), &["SET", "lime", "sour"]), "OK");
        assert_eq!(redis(Some(&ca_pem), gw.resp_port(), &["GET", "kiwi"]), "green");
        assert_ne!(redis(None, gw.resp_port(), &["GET", "kiwi"]), "green");

        // A failover: the primary of apple's region dies; a backup fed over mutual TLS takes
        // over with every acknowledged write.
        let m = c.region_map().await.expect("map");
        let primary = m.region_of(b"apple").expect("a region").primary;
        let victim = nodes.iter_mut().find(|n| n.id == primary).expect("the primary");
        victim.kill();
        let mut reader = Client::connect_with(&gw.binary, opts(trusting.clone())).await.expect("connect");
        reader.retry.deadline = Duration::from_secs(30);
        let apple =
            reader.get(b"apple").await.unwrap_or_else(|e| panic!("read after failover: {e:?}\n{}", logs(&nodes)));
        assert_eq!(apple.as_deref(), Some(&b"red"[..]));
        assert_eq!(reader.get(b"kiwi").await.expect("read after failover").as_deref(), Some(&b"green"[..]));
        assert_eq!(reader.get(b"zebra").await.expect("read").as_deref(), Some(&b"stripes"[..]));
        let after = c.region_map().await.expect("map");
        assert_ne!(after.region_of(b"apple").expect("a region").primary, primary, "no failover happened");

        // Rotation: the gateway's certificate is replaced under an open connection; new
        // connections get the new one, the open one goes on.
        let before = served_fingerprint(&gw.binary);
        certs.issue_as("gateway", Some(Role::Gateway), "gateway").expect("new gateway certificate");
        let deadline = Instant::now() + Duration::from_secs(15);
        while served_fingerprint(&gw.binary) == before {
            assert!(Instant::now() < deadline, "the gateway never served its new certificate");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        c.put(b"apple", b"green").await.expect("the open connection goes on");
        let fresh = Client::connect_with(&gw.binary, opts(trusting.clone())).await.expect("a new connection");
        assert_eq!(fresh.get(b"apple").await.expect("get").as_deref(), Some(&b"green"[..]));
        assert_ne!(served_fingerprint(&gw.http), before, "HTTP serves the new certificate too");
        assert_ne!(served_fingerprint(&gw.resp), before, "RESP serves the new certificate too");
    });
}

/// `dpukv local --nodes 3 --tls --device-fronts`: every device's front door speaks TLS only,
/// presenting a gateway certificate of its own (not its node's); `redis-cli --tls` and `curl`
/// trusting the cluster's CA write and read every key through every node's front door — two
/// regions on three nodes, so at least one front door forwards both keys to the other devices'
/// mutual-TLS data ports with that certificate —, while plain text and clients that do not trust
/// the CA get nothing.
#[test]
fn device_front_doors_speak_tls_and_forward_with_a_gateway_identity_of_their_own() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = format!("127.0.0.1:{}", dpukv_e2e::procs::free_port().expect("port"));
    let bin = dpukv_e2e::procs::bin_dir().expect("binaries");
    let local = Command::new(bin.join("dpukv"))
        .args(["local", "--nodes", "3", "--tls", "--device-fronts", "--split-keys", "m", "--listen", &gw, "--dir"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("local.log")).expect("log"))
        .spawn()
        .expect("dpukv local");
    let _local = dpukv_e2e::procs::Proc(local);
    let info = dpukv_e2e::procs::cluster_json(dir.path(), Duration::from_secs(30)).expect("cluster.json");
    let ca = std::path::PathBuf::from(info["tls_ca"].as_str().expect("tls_ca"));
    let fronts: Vec<(String, String)> = (0..3)
        .map(|i| {
            let n = &info["nodes"][i];
            let port = n["resp"].as_str().expect("resp").rsplit(':').next().expect("port").to_string();
            (port, n["http"].as_str().expect("http").to_string())
        })
        .collect();
    let logs = || {
        ["local.log", "node-1/device.log", "node-2/device.log", "node-3/device.log"]
            .map(|f| format!("{f}:\n{}", std::fs::read_to_string(dir.path().join(f)).unwrap_or_default()))
            .join("\n")
    };
    // Each front door answers once its node is up and both regions have a primary.
    for (port, _) in &fronts {
        // (Generous: on a loaded machine three TLS nodes and etcd take a while to elect.)
        let deadline = Instant::now() + Duration::from_secs(120);
        while redis(Some(&ca), port, &["SET", "a-key", "ready"]) != "OK"
            || redis(Some(&ca), port, &["SET", "z-key", "ready"]) != "OK"
        {
            assert!(Instant::now() < deadline, "front door {port} never served both keys\n{}", logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    // It presents a gateway's certificate, its own.
    for (i, (port, _)) in fronts.iter().enumerate() {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "openssl s_client -connect 127.0.0.1:{port} </dev/null 2>/dev/null | openssl x509 -noout -ext subjectAltName"
            ))
            .output()
            .expect("openssl runs");
        let sans = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(sans.contains(&format!("spiffe://dpukv/local/local/gateway/front-{}", i + 1)), "{sans}");
    }
    // Every key through every front door, read back through every other one (RESP and HTTP).
    for (i, (port, http)) in fronts.iter().enumerate() {
        let v = format!("from-{i}");
        for k in ["a-key", "z-key"] {
            assert_eq!(redis(Some(&ca), port, &["SET", k, &v]), "OK", "node {}: SET {k}\n{}", i + 1, logs());
            for (other, other_http) in &fronts {
                assert_eq!(redis(Some(&ca), other, &["GET", k]), v);
                let (status, body) = curl(Some(&ca), "GET", &format!("https://{other_http}/v1/kv/{k}"), None);
                assert_eq!(status, 200, "{body}");
                assert!(body.contains(&format!("\"{v}\"")), "{body}");
            }
        }
        // Plain text and clients that do not trust the CA get no answer.
        assert_ne!(redis(None, port, &["GET", "a-key"]), v, "plain text answered");
        assert_eq!(curl(None, "GET", &format!("https://{http}/v1/kv/a-key"), None).0, 0, "curl trusted no CA");
        assert_eq!(curl(None, "GET", &format!("http://{http}/v1/kv/a-key"), None).0, 0, "plain HTTP answered");
    }
}
