//! The finalizer's cleanup against a real etcd that serves TLS and asks clients for certificates
//! (issue 26, item 3: an external etcd given `etcd.clientSecret`): with the client certificate
//! the cluster's keys go; without one etcd refuses and nothing is deleted.

use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpukv_cluster::{EtcdOptions, EtcdStore, EtcdTls, MetaStore};
use dpukv_operator::certs::{self, Leaf};
use dpukv_operator::etcd_keys::{EtcdTarget, delete_in_etcd};

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port for a child process, reserved machine-wide (outside the kernel's ephemeral range, which
/// could hand a released port to an outgoing connection before the child binds it).
fn free_port() -> u16 {
    dpukv_net::ports::reserve().expect("a free port")
}

fn leaf(name: &str, server: bool) -> Leaf {
    Leaf {
        common_name: name.into(),
        uri: None,
        dns: vec!["localhost".into()],
        ips: vec![IpAddr::from([127, 0, 0, 1])],
        server,
        client: !server,
    }
}

#[tokio::test]
async fn the_cleanup_reaches_an_external_etcd_over_tls_with_the_client_secret_and_not_without() {
    let now = time::OffsetDateTime::now_utc();
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = certs::new_ca("test etcd CA", now).expect("ca");
    let server = certs::issue(&ca, &leaf("etcd", true), now).expect("server");
    let client = certs::issue(&ca, &leaf("operator", false), now).expect("client");
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p
    };
    let (ca_file, cert, key) = (file("ca.crt", &ca.cert), file("tls.crt", &server.cert), file("tls.key", &server.key));
    let (cp, pp) = (free_port(), free_port());
    // (Peers speak plain text: one member, its peer port on loopback.)
    let (curl, purl) = (format!("https://127.0.0.1:{cp}"), format!("http://127.0.0.1:{pp}"));
    let _etcd = Killed(
        Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &curl, "--advertise-client-urls", &curl])
            .args(["--listen-peer-urls", &purl, "--initial-advertise-peer-urls", &purl])
            .args(["--initial-cluster", &format!("t={purl}"), "--client-cert-auth"])
            .arg("--cert-file")
            .arg(&cert)
            .arg("--key-file")
            .arg(&key)
            .arg("--trusted-ca-file")
            .arg(&ca_file)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("etcd.log")).expect("log"))
            .spawn()
            .expect("etcd (scripts/setup.sh installs etcd-server)"),
    );
    let with_cert = dpukv_operator::tls::client_config(&ca.cert, &client).expect("client config");
    let opts =
        |cfg: Arc<rustls::ClientConfig>| EtcdOptions::new([curl.clone()]).with_tls(EtcdTls::new(move || cfg.clone()));
    let deadline = Instant::now() + Duration::from_secs(30);
    let store = loop {
        match EtcdStore::connect(&opts(with_cert.clone())).await {
            Ok(s) if s.put(b"/dpukv/db.demo/nodes/1", b"x", None).await.is_ok() => break s,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
            Ok(_) | Err(_) => panic!(
                "etcd over TLS did not come up: {}",
                std::fs::read_to_string(dir.path().join("etcd.log")).unwrap_or_default()
            ),
        }
    };
    store.put(b"/dpukv/db.demo/map", b"y", None).await.expect("put");
    store.put(b"/dpukv/db.other/map", b"z", None).await.expect("put");
    // Without a client certificate (trusting the CA all the same): refused, nothing deleted.
    let no_cert = {
        let mut roots = rustls::RootCertStore::empty();
        use rustls_pki_types::pem::PemObject;
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca.cert.as_bytes()) {
            roots.add(c.expect("pem")).expect("root");
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Arc::new(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("versions")
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    };
    let refused =
        delete_in_etcd(EtcdTarget { endpoints: vec![curl.clone()], tls: Some(no_cert) }, b"/dpukv/db.demo/".to_vec())
            .await;
    assert!(refused.is_err(), "etcd took a client without a certificate: {refused:?}");
    assert_eq!(store.range(b"/dpukv/db.demo/").await.expect("range").0.len(), 2, "nothing was deleted");
    // Plain text to a TLS etcd: refused too.
    let plain = delete_in_etcd(
        EtcdTarget { endpoints: vec![curl.replace("https", "http")], tls: None },
        b"/dpukv/db.demo/".to_vec(),
    )
    .await;
    assert!(plain.is_err(), "{plain:?}");
    // With the client Secret's certificate: the cluster's keys go, another cluster's stay.
    let n =
        delete_in_etcd(EtcdTarget { endpoints: vec![curl.clone()], tls: Some(with_cert) }, b"/dpukv/db.demo/".to_vec())
            .await
            .expect("deleted over TLS");
    assert_eq!(n, 2);
    assert!(store.range(b"/dpukv/db.demo/").await.expect("range").0.is_empty());
    assert_eq!(store.range(b"/dpukv/db.other/").await.expect("range").0.len(), 1);
}
