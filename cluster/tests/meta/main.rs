//! The metadata-store conformance suite against the in-memory store.

use std::time::Duration;

use dpukv_cluster::MemStore;
use dpukv_cluster::conformance::must_conform;

#[tokio::test]
async fn the_memory_store_conforms() {
    must_conform(&MemStore::new(), b"/dpukv/test/", Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_fails_over_on_the_memory_store() {
    dpukv_cluster::conformance::must_fail_over(&MemStore::new(), "mem", Duration::from_secs(1)).await;
}
