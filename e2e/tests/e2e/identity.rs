//! Identities and roles on a real cluster with TLS everywhere (docs/security.md): three node
//! pods whose hosts and devices hold `node-<id>` certificates (`{node}` paths), etcd with TLS
//! and client certificates of its own CA, and an attacker holding certificates of weaker roles
//! (a gateway's, a client's, another node's, one without an identity, another cluster's).
//!
//! Before identities were checked, any certificate of the cluster's CA could write at a device,
//! plant hot-key copies in a backup's replica table (`replica_sync`), open a replication stream
//! to a backup as the region's primary, and drain or split through the hosts' admin port, which
//! took no credential at all; etcd took any client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpukv_client::{Client, ClientError, Options};
use dpukv_cluster::{EtcdOptions, EtcdStore, EtcdTls, MetaStore};
use dpukv_e2e::certs::ClusterCerts;
use dpukv_e2e::cluster::{ClusterNode, call_tls, http_request};
use dpukv_e2e::etcd::Etcd;
use dpukv_net::tls::ClientTls;
use dpukv_proto::regionmap::RegionMap;
use dpukv_proto::{Consistency, ErrorCode, Op, Reply, Request, SyncEntry};

const CLUSTER: &str = "sec";

/// A cluster of three node pods with TLS and identities, on an etcd with TLS.
struct Secure {
    certs: ClusterCerts,
    nodes: Vec<ClusterNode>,
    _etcd: Etcd,
    _dir: tempfile::TempDir,
}

impl Secure {
    /// Starts it (hosts and devices get `env` too) and waits for two regions with a primary and
    /// two backups each.
    fn start(env: &[(&str, &str)]) -> Secure {
        let dir = tempfile::tempdir().expect("tempdir");
        let certs = ClusterCerts::issue(&dir.path().join("certs"), CLUSTER, 3).expect("certificates");
        let etcd = Etcd::start_tls(certs.etcd_server()).expect("etcd with TLS");
        let mut extra: Vec<String> =
            ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--split-keys", "m"].map(String::from).to_vec();
        extra.extend(certs.etcd_client_flags());
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let both = certs.node_flags();
        let both: Vec<&str> = both.iter().map(String::as_str).collect();
        let mut nodes: Vec<ClusterNode> = (1..=3)
            .map(|id| ClusterNode::start_with(id, CLUSTER, &etcd.url(), &extra, &both, env).expect("node"))
            .collect();
        // The harness calls the control API over TLS with its token (no client certificate).
        for n in &mut nodes {
            n.set_control_tls(certs.client(None).expect("TLS"));
        }
        let s = Secure { certs, nodes, _etcd: etcd, _dir: dir };
        s.map(settled);
        s
    }

    fn tls(&self, name: &str) -> Arc<ClientTls> {
        self.certs.client(Some(name)).expect("TLS")
    }

    fn logs(&self) -> String {
        self.nodes.iter().map(ClusterNode::logs).collect()
    }

    /// The newest map the nodes answer (asked with the admin's certificate), once `ready`.
    fn map(&self, ready: impl Fn(&RegionMap) -> bool) -> RegionMap {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let tls = self.tls("admin");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut newest: Option<RegionMap> = None;
            for n in &self.nodes {
                let req = Request::new(1, Op::RegionMap);
                if let Ok(r) = rt.block_on(call_tls(&n.device, &tls, req, Duration::from_secs(2)))
                    && let Ok(Reply::RegionMap(m)) = r.result
                    && newest.as_ref().is_none_or(|x| m.revision > x.revision)
                {
                    newest = Some(m);
                }
            }
            if let Some(m) = newest
                && ready(&m)
            {
                return m;
            }
            assert!(Instant::now() < deadline, "the map never became ready\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn device(&self, m: &RegionMap, node: u32) -> String {
        m.node(node).expect("registered").device.clone()
    }
}

/// Both regions with a primary and two backups, every one of them among the map's nodes. (A map
/// taken with no condition, from whichever node answered in time, could be an older one naming a
/// backup it does not list — seen on a loaded CI machine.)
fn settled(m: &RegionMap) -> bool {
    m.regions.len() == 2
        && m.regions.iter().all(|r| {
            r.primary != 0 && r.backups.len() == 2 && r.backups.iter().chain([&r.primary]).all(|n| m.node(*n).is_some())
        })
}

fn opts(tls: Arc<ClientTls>) -> Options {
    Options { pool: 1, tls: Some(tls), ..Options::default() }
}

/// What a request sent straight to `addr` with `tls` was answered: Ok(reply) or the error code.
async fn ask(addr: &str, tls: &ClientTls, req: Request) -> Result<Reply, ErrorCode> {
    let r = call_tls(addr, tls, req, Duration::from_secs(10)).await.expect("an answer");
    r.result.map_err(|e| e.code)
}

fn put(region: &dpukv_proto::regionmap::RegionInfo, key: &[u8], value: &[u8]) -> Request {
    let mut r = Request::new(7, Op::Put { key: key.to_vec(), value: value.to_vec() });
    (r.region, r.epoch) = (region.id, region.epoch);
    r
}

/// A direct write at a device is served only to the roles that may write (gateway, client,
/// admin): no certificate is refused at the handshake, another node's, the operator's, another
/// cluster's and a nameless one are refused `forbidden`/`unauthorized` — and nothing they sent
/// is written. `tree_nodes` is the gateway's and admins' only.
#[test]
fn a_device_takes_writes_only_from_roles_that_may_write() {
    let s = Secure::start(&[]);
    let m = s.map(settled);
    let region = m.region_of(b"apple").expect("a region").clone();
    let primary = s.device(&m, region.primary);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        // The client's certificate writes (the library routes it).
        let c = Client::connect_with(&primary, opts(s.tls("client"))).await.expect("connect");
        c.put(b"apple", b"red").await.unwrap_or_else(|e| panic!("a client's write: {e}\n{}", s.logs()));
        // No certificate: the handshake is refused.
        let t = Instant::now();
        let anonymous = Client::connect_with(&primary, opts(s.certs.client(None).expect("TLS"))).await;
        let refused = match anonymous {
            Err(e) => e,
            Ok(c) => c.put(b"apple", b"anonymous").await.expect_err("a write without a client certificate"),
        };
        // (A write that went out before the server's refusal arrived is reported with an unknown
        // outcome around the TLS error: the client cannot know it was never executed.)
        let tls_refusal = match &refused {
            ClientError::OutcomeUnknown(inner) => matches!(**inner, ClientError::Tls(_)),
            e => matches!(e, ClientError::Tls(_)),
        };
        assert!(tls_refusal, "a write without a client certificate: {refused:?}");
        assert!(t.elapsed() < Duration::from_secs(5), "refused at once: {:?}", t.elapsed());
        // Certificates that do not grant writes.
        for (who, code) in [
            ("node-3", ErrorCode::Forbidden),
            ("operator", ErrorCode::Forbidden),
            ("stranger", ErrorCode::Forbidden),
            ("nameless", ErrorCode::Unauthorized),
        ] {
            let got = ask(&primary, &s.tls(who), put(&region, b"apple", who.as_bytes())).await;
            assert_eq!(got.err(), Some(code), "a write with the {who} certificate");
        }
        // The library surfaces it at once, not retried.
        let t = Instant::now();
        let node3 =
            Client::connect_with(&primary, opts(s.tls("node-3"))).await.expect("connect (the map is any member's)");
        match node3.put(b"apple", b"node-3").await {
            Err(ClientError::Server(e)) => assert_eq!(e.code, ErrorCode::Forbidden, "{e:?}"),
            other => panic!("a write with node 3's certificate: {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5), "refused at once: {:?}", t.elapsed());
        // Nothing was written.
        assert_eq!(c.get(b"apple").await.expect("get").as_deref(), Some(&b"red"[..]));
        // tree_nodes: the gateway's and admins'.
        let tree = || {
            let mut r = Request::new(8, Op::TreeNodes { key: b"apple".to_vec(), nodes: vec![] });
            (r.region, r.epoch) = (region.id, region.epoch);
            r
        };
        assert_eq!(ask(&primary, &s.tls("client"), tree()).await.err(), Some(ErrorCode::Forbidden));
        assert!(ask(&primary, &s.tls("gateway"), tree()).await.is_ok(), "the gateway expands the tree");
    });
}

/// A `replica_sync` — hot-key copies a backup's device serves to bounded reads — is taken only
/// from the node its map names primary of the region: one presented with the gateway's
/// certificate, or another backup's, is refused, and the backup serves no forged copy. The
/// real primary's syncs (its device, with its node certificate) still land.
#[test]
fn a_replica_sync_is_taken_only_from_the_regions_primary() {
    let env = [("DPUKV_POPULAR_K", "2"), ("DPUKV_POPULAR_WINDOW", "1000"), ("DPUKV_REPLICA_SYNC_INTERVAL_MS", "5")];
    let s = Secure::start(&env);
    let m = s.map(settled);
    let region = m.region_of(b"apple").expect("a region").clone();
    let (backup, other_backup) = (region.backups[0], region.backups[1]);
    let backup_device = s.device(&m, backup);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let now_ms =
            || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64;
        let forged = |id: u64| {
            let entries =
                vec![SyncEntry { key: b"apple".to_vec(), version: u64::MAX / 2, value: Some(b"forged".to_vec()) }];
            let mut r = Request::new(id, Op::ReplicaSync { watermark_ms: now_ms(), reset: false, entries });
            (r.region, r.epoch) = (region.id, region.epoch);
            r
        };
        let replica_get = |id: u64| {
            let mut r = Request::new(id, Op::Get { key: b"apple".to_vec() });
            (r.region, r.epoch, r.replica) = (region.id, region.epoch, true);
            r.consistency = Consistency::Bounded { max_staleness_ms: 60_000 };
            r
        };
        for who in ["gateway".to_string(), format!("node-{other_backup}"), "client".into(), "admin".into()] {
            let got = ask(&backup_device, &s.tls(&who), forged(1)).await;
            assert_eq!(got.err(), Some(ErrorCode::Forbidden), "a replica_sync with the {who} certificate");
        }
        // The backup holds no forged copy: a bounded read aimed at it finds none.
        let got = ask(&backup_device, &s.tls("client"), replica_get(2)).await;
        assert_eq!(
            got.as_ref().err(),
            Some(&ErrorCode::NotReplicated),
            "the backup served a copy nobody vouched for: {got:?}"
        );
        // The real primary's copies still land: make apple popular at the primary, then read it
        // from the backup.
        let primary = s.device(&m, region.primary);
        let c = Client::connect_with(&primary, opts(s.tls("client"))).await.expect("connect");
        c.put(b"apple", b"red").await.expect("put");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            for _ in 0..4 {
                c.get(b"apple").await.expect("get");
            }
            match ask(&backup_device, &s.tls("client"), replica_get(3)).await {
                Ok(Reply::Value(Some(v))) => {
                    assert_eq!(v, b"red");
                    break;
                }
                other => assert!(
                    Instant::now() < deadline,
                    "the primary's sync never reached its backup over TLS: {other:?}\n{}",
                    s.logs()
                ),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// A replication `Hello` naming the region's real primary and epoch, sent to a backup with the
/// gateway's certificate or another backup's, is refused `forbidden`; the cluster goes on and,
/// after the primary dies, the promoted backup has every acknowledged write.
#[test]
fn a_forged_hello_with_another_roles_certificate_is_refused() {
    use dpukv_proto::replication::{ReplMessage, ReplRefusal};
    use std::io::{Read, Write};
    let mut s = Secure::start(&[]);
    let m = s.map(settled);
    let region = m.region_of(b"apple").expect("a region").clone();
    let (backup, other_backup) = (region.backups[0], region.backups[1]);
    let repl = m.node(backup).expect("registered").replication.clone();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let c = rt.block_on(Client::connect_with(&s.device(&m, region.primary), opts(s.tls("client")))).expect("connect");
    for i in 0..20 {
        rt.block_on(c.put(format!("apple{i}").as_bytes(), b"v1")).expect("put");
    }
    let hello = |who: &str| -> ReplMessage {
        let tcp = std::net::TcpStream::connect(&repl).expect("connect");
        let mut link = s.tls(who).connect_blocking(tcp, &repl).expect("handshake");
        link.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut frame = Vec::new();
        let h = ReplMessage::Hello {
            cluster: CLUSTER.into(),
            region: region.id,
            epoch: region.epoch,
            primary: region.primary,
            base: 0,
            life: Some(u64::MAX),
        };
        h.encode(&mut frame);
        link.write_all(&frame).expect("hello");
        let mut len = [0u8; 4];
        link.read_exact(&mut len).expect("an answer");
        let mut answer = len.to_vec();
        answer.resize(4 + u32::from_le_bytes(len) as usize, 0);
        link.read_exact(&mut answer[4..]).expect("an answer");
        ReplMessage::decode(&answer).expect("a frame").0
    };
    for who in ["gateway".to_string(), format!("node-{other_backup}"), "admin".into()] {
        match hello(&who) {
            ReplMessage::Refuse { reason: ReplRefusal::Forbidden, .. } => {}
            other => panic!("a Hello as node {} with the {who} certificate was answered {other:?}", region.primary),
        }
    }
    // Nothing changed: writes go on, and the backups promoted after the primary dies have them.
    for i in 20..40 {
        rt.block_on(c.put(format!("apple{i}").as_bytes(), b"v1")).expect("put after the forged Hellos");
    }
    s.nodes[region.primary as usize - 1].kill();
    let after = s.map(|m| m.region_of(b"apple").is_some_and(|r| r.primary != region.primary && r.primary != 0));
    let new_primary = s.device(&after, after.region_of(b"apple").expect("a region").primary);
    let mut c = rt.block_on(Client::connect_with(&new_primary, opts(s.tls("client")))).expect("connect");
    c.retry.deadline = Duration::from_secs(30);
    for i in 0..40 {
        let got = rt.block_on(c.get(format!("apple{i}").as_bytes())).expect("read after failover");
        assert_eq!(got.as_deref(), Some(&b"v1"[..]), "apple{i}\n{}", s.logs());
    }
}

/// The control API: a drain or a split without an admin's or the operator's credential is
/// refused (a TLS failure, 401 or 403) and changes nothing; the admin port serves no
/// `/cluster/*`; with an admin certificate, or the admin token, it is done.
#[test]
fn a_drain_or_split_without_admin_credentials_is_refused_and_changes_nothing() {
    let s = Secure::start(&[]);
    let m = s.map(settled);
    let n = &s.nodes[0];
    let t = Duration::from_secs(10);
    let split = format!("/cluster/split/{}/67", m.region_of(b"g").expect("a region").id); // at "g"
    let status = |who: Option<&str>, auth: Option<&str>, method: &str, path: &str| -> Result<u16, String> {
        let tls = match who {
            Some(w) => s.tls(w),
            None => s.certs.client(None).expect("TLS"),
        };
        let bearer = auth.map(|a| format!("Bearer {a}"));
        let headers: Vec<(&str, &str)> = bearer.as_deref().map(|b| ("Authorization", b)).into_iter().collect();
        http_request(&n.control, Some(&tls), &headers, method, path, t).map(|(c, _)| c).map_err(|e| e.to_string())
    };
    for path in ["/cluster/drain/1", &split] {
        // Plain HTTP to the control API: no answer.
        assert!(http_request(&n.control, None, &[], "POST", path, t).is_err(), "plain HTTP was answered");
        // A certificate of another CA: the handshake fails.
        assert!(status(Some("foreign"), None, "POST", path).is_err(), "another CA's admin certificate");
        // No credential, or one that does not grant it.
        assert_eq!(status(None, None, "POST", path), Ok(401), "{path} without a credential");
        assert_eq!(status(Some("nameless"), None, "POST", path), Ok(401), "{path} with a nameless certificate");
        for who in ["gateway", "node-2", "client", "stranger"] {
            assert_eq!(status(Some(who), None, "POST", path), Ok(403), "{path} with the {who} certificate");
        }
        assert_eq!(status(None, Some("not-the-admin-token-at-all"), "POST", path), Ok(403), "a wrong token");
        // The admin port is read-only.
        let old = http_request(&n.admin, None, &[], "POST", path, t).expect("the admin port answers");
        assert_eq!(old.0, 404, "the admin port took {path}");
    }
    // Nothing changed.
    std::thread::sleep(Duration::from_secs(2));
    let (code, body) =
        http_request(&n.control, Some(&s.tls("admin")), &[], "GET", "/cluster/drain/1", t).expect("progress");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"draining\": false"), "node 1 is draining after refused requests: {body}");
    assert_eq!(s.map(|_| true).regions.len(), 2, "a region was split by a refused request");
    // The operator's certificate and the token read the summary; an admin's certificate splits.
    assert_eq!(status(Some("operator"), None, "GET", "/cluster/summary"), Ok(200));
    assert_eq!(status(None, Some(n.admin_token()), "GET", "/cluster/summary"), Ok(200));
    assert_eq!(status(Some("admin"), None, "POST", &split), Ok(200), "an admin's split");
    s.map(|m| m.regions.len() == 3);
}

/// `dpukv local --nodes 3 --tls`: its etcd speaks only TLS and refuses clients without a
/// certificate of its own CA (plain HTTP, no certificate, the cluster CA's admin certificate),
/// while the nodes (with theirs) run the cluster; `dpukv cluster` needs the admin certificate.
#[test]
fn local_tls_etcd_refuses_clients_without_its_certificate_and_the_cli_needs_an_admin() {
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = format!("127.0.0.1:{}", dpukv_e2e::procs::free_port().expect("port"));
    let bin = dpukv_e2e::procs::bin_dir().expect("binaries");
    let local = Command::new(bin.join("dpukv"))
        .args(["local", "--nodes", "3", "--tls", "--listen", &gw, "--dir"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("dpukv local");
    let _local = dpukv_e2e::procs::Proc(local);
    let info = dpukv_e2e::procs::cluster_json(dir.path(), Duration::from_secs(30)).expect("cluster.json");
    let tls = &info["tls"];
    let s = |v: &serde_json::Value| v.as_str().expect("a string").to_string();
    let (ca, admin_cert, admin_key) = (s(&tls["ca"]), s(&tls["admin_cert"]), s(&tls["admin_key"]));
    let url = s(&info["etcd"]);
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    let cli = |args: &[&str]| {
        Command::new(bin.join("dpukv")).args(["--endpoint", &gw, "--tls-ca", &ca]).args(args).output().expect("dpukv")
    };
    // The cluster runs: the nodes reach etcd with their client certificate.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = cli(&["nodes"]);
        if out.status.success() && String::from_utf8_lossy(&out.stdout).lines().count() == 3 {
            break;
        }
        let logs =
            ["node-1/host.log", "etcd.log"].map(|f| std::fs::read_to_string(dir.path().join(f)).unwrap_or_default());
        assert!(Instant::now() < deadline, "three nodes never registered: {out:?}\n{logs:#?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let read = |opts: EtcdOptions| async move {
            let store = EtcdStore::connect_checked(&opts).await?;
            store.range(b"/dpukv/").await.map(|(kvs, _)| kvs.len())
        };
        let with = |ca: &str, pair: Option<(&str, &str)>| {
            let t = ClientTls::load(
                std::path::Path::new(ca),
                pair.map(|(c, k)| (std::path::Path::new(c), std::path::Path::new(k))),
            )
            .expect("TLS");
            EtcdOptions::new([url.clone()]).with_tls(EtcdTls::new(move || t.config()))
        };
        let etcd_ca = s(&tls["etcd_ca"]);
        // Plain HTTP to its port, TLS without a certificate, the cluster CA's admin certificate.
        assert!(read(EtcdOptions::new([url.replace("https://", "http://")])).await.is_err(), "plain HTTP");
        assert!(read(with(&etcd_ca, None)).await.is_err(), "no client certificate");
        assert!(read(with(&etcd_ca, Some((&admin_cert, &admin_key)))).await.is_err(), "the cluster CA's admin");
        // With its client certificate: the cluster's keys.
        let pair = (s(&tls["etcd_client_cert"]), s(&tls["etcd_client_key"]));
        let n = read(with(&etcd_ca, Some((&pair.0, &pair.1)))).await.expect("etcd with its client certificate");
        assert!(n > 0, "the nodes wrote their keys");
    });
    // `dpukv cluster drain`: refused without the admin certificate, done with it.
    let out = cli(&["cluster", "drain", "3", "--no-wait"]);
    assert!(!out.status.success(), "a drain without an admin certificate");
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"), "{}", String::from_utf8_lossy(&out.stderr));
    let admin = ["--tls-cert", &admin_cert, "--tls-key", &admin_key];
    let out = cli(&[&admin[..], &["cluster", "drain", "3", "--no-wait"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"draining\": true"), "{out:?}");
    let out = cli(&[&admin[..], &["cluster", "drain", "3", "--cancel"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
