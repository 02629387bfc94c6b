//! The one state of a cluster outside Kubernetes: its keys in an external etcd
//! (`spec.etcd.endpoints`), under `/dpukv/NAMESPACE.NAME/` (`dpukv_cluster::keys`). Deleting the
//! `DpuKvCluster` deletes every Kubernetes object it owns, not those; the finalizer [`FINALIZER`]
//! holds the resource until the controller deleted them (`controller`), so a new cluster of the
//! same name starts clean and nothing is left behind. A managed etcd (`etcd.managed`) is owned by
//! the cluster and goes with it: no finalizer.
//!
//! The annotation [`SKIP_ANNOTATION`]` = "true"` lets a deletion proceed without cleaning — for an
//! etcd that is gone for good, which no retry will reach.

use std::time::Duration;

use dpukv_cluster::keys::Keys;
use dpukv_cluster::{EtcdOptions, EtcdStore, MetaError, MetaStore};
use futures::future::BoxFuture;
use kube::ResourceExt;

use crate::crd::DpuKvCluster;
use crate::render;

/// The finalizer of a cluster whose keys live in an external etcd.
pub const FINALIZER: &str = "dpukv.io/etcd-keys";

/// `"true"` on the resource: its deletion leaves the keys in etcd.
pub const SKIP_ANNOTATION: &str = "dpukv.io/skip-etcd-cleanup";

/// How long one cleanup may take (connecting included) before it fails and is retried.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// An external etcd: its endpoints, and TLS with a client certificate if it asks for one.
#[derive(Clone)]
pub struct EtcdTarget {
    /// Client URLs.
    pub endpoints: Vec<String>,
    /// Trusting its CA and presenting the client certificate of `etcd.clientSecret`.
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

/// Deletes every key under a prefix (the second argument) in the etcd the first names and
/// answers how many there were: [`delete_in_etcd`], or a test's in-memory store.
pub type KeyCleaner = Box<dyn Fn(EtcdTarget, Vec<u8>) -> BoxFuture<'static, Result<u64, MetaError>> + Send + Sync>;

/// The external etcd's endpoints (None: a managed etcd).
pub fn external_endpoints(c: &DpuKvCluster) -> Option<Vec<String>> {
    c.spec.etcd.endpoints.clone().filter(|e| !e.is_empty())
}

/// Whether the cluster's keys outlive its Kubernetes objects (they are in an external etcd).
pub fn needs_finalizer(c: &DpuKvCluster) -> bool {
    external_endpoints(c).is_some()
}

/// Whether the resource carries the finalizer.
pub fn has_finalizer(c: &DpuKvCluster) -> bool {
    c.finalizers().iter().any(|f| f == FINALIZER)
}

/// Whether the resource asks its deletion to leave the keys.
pub fn skip_requested(c: &DpuKvCluster) -> bool {
    c.annotations().get(SKIP_ANNOTATION).is_some_and(|v| v == "true")
}

/// The prefix of every key of the cluster (what its node pods write under).
pub fn prefix(c: &DpuKvCluster) -> Result<Vec<u8>, MetaError> {
    Ok(Keys::new(&render::cluster_name(c))?.root().to_vec())
}

/// The cleaner the operator runs with: [`delete_in_etcd`].
pub fn etcd_cleaner() -> KeyCleaner {
    Box::new(|target, prefix| Box::pin(delete_in_etcd(target, prefix)))
}

/// Connects to the etcd `target` names and deletes every key under `prefix` (one range delete),
/// within [`DEADLINE`].
pub async fn delete_in_etcd(target: EtcdTarget, prefix: Vec<u8>) -> Result<u64, MetaError> {
    let mut opts = EtcdOptions::new(target.endpoints);
    opts.op_timeout = DEADLINE / 2;
    if let Some(cfg) = target.tls {
        opts = opts.with_tls(dpukv_cluster::EtcdTls::new(move || cfg.clone()));
    }
    let delete = async {
        let store = EtcdStore::connect(&opts).await?;
        store.delete_prefix(&prefix).await
    };
    tokio::time::timeout(DEADLINE, delete)
        .await
        .unwrap_or_else(|_| Err(MetaError::Unavailable(format!("etcd did not answer within {DEADLINE:?}"))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::DpuKvClusterSpec;

    fn cluster(etcd: serde_json::Value) -> DpuKvCluster {
        let spec = serde_json::json!({"nodes": 3, "storage": {"size": "1Gi"}, "etcd": etcd});
        let spec: DpuKvClusterSpec = serde_json::from_value(spec).expect("spec");
        let mut c = DpuKvCluster::new("demo", spec);
        c.metadata.namespace = Some("db".into());
        c
    }

    #[test]
    fn only_an_external_etcd_needs_the_finalizer_and_the_prefix_is_the_nodes() {
        let external = cluster(serde_json::json!({"endpoints": ["http://etcd:2379"]}));
        assert!(needs_finalizer(&external));
        assert!(!needs_finalizer(&cluster(serde_json::json!({"managed": {}}))));
        assert_eq!(prefix(&external).expect("prefix"), b"/dpukv/db.demo/");
        // The node pods' cluster name is the same.
        let config = render::node_config_map(&external).data.expect("data");
        assert_eq!(format!("/dpukv/{}/", config["DPUKV_CLUSTER"]).as_bytes(), prefix(&external).expect("prefix"));
        let mut skipped = external.clone();
        assert!(!skip_requested(&skipped));
        skipped.annotations_mut().insert(SKIP_ANNOTATION.into(), "yes".into());
        assert!(!skip_requested(&skipped), "only \"true\"");
        skipped.annotations_mut().insert(SKIP_ANNOTATION.into(), "true".into());
        assert!(skip_requested(&skipped));
    }

    #[tokio::test]
    async fn an_unreachable_etcd_fails_the_cleanup_within_the_deadline() {
        let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        let started = std::time::Instant::now();
        let target = EtcdTarget { endpoints: vec![format!("http://{dead}")], tls: None };
        let r = delete_in_etcd(target, b"/dpukv/db.demo/".to_vec()).await;
        assert!(matches!(r, Err(MetaError::Unavailable(_))), "{r:?}");
        assert!(started.elapsed() <= DEADLINE + Duration::from_secs(1), "{:?}", started.elapsed());
    }
}
