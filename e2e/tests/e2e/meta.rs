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
