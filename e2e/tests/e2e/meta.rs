//! The metadata store on a real etcd: the conformance suite the in-memory store passes, and what
//! the store does while etcd is down.

use std::time::{Duration, Instant};

use dpukv_cluster::conformance::must_conform;
use dpukv_cluster::{EtcdOptions, EtcdStore, MetaError, MetaStore};
use dpukv_e2e::etcd::Etcd;

#[tokio::test]
async fn the_etcd_store_conforms() {
    let etcd = Etcd::start().expect("etcd");
    let store = EtcdStore::connect_checked(&EtcdOptions::new([etcd.url()])).await.expect("connect");
    must_conform(&store, b"/dpukv/test/", Duration::from_secs(1)).await;
}

#[tokio::test]
async fn an_unreachable_etcd_is_a_prompt_typed_error_and_the_store_recovers_when_it_returns() {
    let mut etcd = Etcd::start().expect("etcd");
    let mut opts = EtcdOptions::new([etcd.url()]);
    opts.op_timeout = Duration::from_millis(500);
    let store = EtcdStore::connect_checked(&opts).await.expect("connect");
    store.put(b"/dpukv/t/k", b"1", None).await.expect("put");
    etcd.stop();
    let t = Instant::now();
    let err = store.put(b"/dpukv/t/k", b"2", None).await.expect_err("etcd is down");
    assert!(matches!(err, MetaError::Unavailable(_)), "{err:?}");
    assert_eq!(err.code(), "meta_unavailable");
    assert!(t.elapsed() < Duration::from_secs(3), "the error comes within the deadline, took {:?}", t.elapsed());
    let down = EtcdStore::connect_checked(&opts).await.expect_err("nothing listens");
    assert!(down.to_string().contains(&etcd.url()), "the error names the endpoint: {down}");
    etcd.resume().expect("etcd again");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match store.get(b"/dpukv/t/k").await {
            Ok(kv) => {
                assert_eq!(kv.expect("kept").value, b"1", "etcd keeps its data across the restart");
                break;
            }
            Err(e) if Instant::now() < deadline => {
                assert_eq!(e.code(), "meta_unavailable");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the store did not reconnect: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_fails_over_on_etcd() {
    let etcd = Etcd::start().expect("etcd");
    let store = EtcdStore::connect_checked(&EtcdOptions::new([etcd.url()])).await.expect("connect");
    dpukv_cluster::conformance::must_fail_over(&store, "etcd", Duration::from_secs(1)).await;
}

/// The store on an etcd with TLS and client certificates (`--client-cert-auth`): it conforms;
/// its client certificate is re-read when the files change — the next connection presents the
/// new one (here first one etcd does not trust: refused; then a good one again: served) while
/// the open connection goes on; https without TLS and TLS with http are typed errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_store_conforms_over_tls_and_takes_a_rotated_client_certificate() {
    use dpukv_cluster::EtcdTls;
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dpukv_e2e::certs::ClusterCerts::issue(dir.path(), "meta", 1).expect("certificates");
    let etcd = Etcd::start_tls(certs.etcd_server()).expect("etcd with TLS");
    let (cert, key) = (dir.path().join("client.pem"), dir.path().join("client.key"));
    let place = |from: &str| {
        for (ext, to) in [("pem", &cert), ("key", &key)] {
            let tmp = to.with_extension("tmp");
            std::fs::copy(dir.path().join(format!("{from}.{ext}")), &tmp).expect("copy");
            std::fs::rename(&tmp, to).expect("rename");
        }
    };
    place("etcd-client");
    let tls = dpukv_net::tls::ClientTls::load(&certs.etcd_ca(), Some((&cert, &key))).expect("TLS");
    let opts = EtcdOptions::new([etcd.url()]).with_tls(EtcdTls::new(move || tls.config()));
    let store = EtcdStore::connect_checked(&opts).await.expect("connect over TLS");
    must_conform(&store, b"/dpukv/tls/", Duration::from_secs(1)).await;
    store.put(b"/dpukv/tls-k", b"1", None).await.expect("put");
    // A certificate of the cluster's CA, not etcd's: the next connection is refused.
    std::thread::sleep(Duration::from_millis(1100)); // a new modification time
    place("admin");
    let deadline = Instant::now() + Duration::from_secs(15);
    while EtcdStore::connect_checked(&opts).await.is_ok() {
        assert!(Instant::now() < deadline, "the client certificate was never re-read");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(store.get(b"/dpukv/tls-k").await.expect("the open connection goes on").is_some());
    // Etcd's client certificate again: served.
    std::thread::sleep(Duration::from_millis(1100));
    place("etcd-client");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match EtcdStore::connect_checked(&opts).await {
            Ok(s) => {
                assert!(s.get(b"/dpukv/tls-k").await.expect("get").is_some());
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "the good certificate was never re-read: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Endpoints and TLS must agree.
    let https_plain = EtcdStore::connect(&EtcdOptions::new([etcd.url()])).await;
    assert!(matches!(https_plain, Err(MetaError::Invalid(_))), "https without TLS");
    let tls = dpukv_net::tls::ClientTls::load(&certs.etcd_ca(), None).expect("TLS");
    let http = EtcdOptions::new([etcd.url().replace("https", "http")]).with_tls(EtcdTls::new(move || tls.config()));
    assert!(matches!(EtcdStore::connect(&http).await, Err(MetaError::Invalid(_))), "TLS with http");
}
