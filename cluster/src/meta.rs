//! The metadata store's contract: keys and values with revisions, atomic transactions with
//! compares, leases, and watches — the subset of etcd's API the cluster relies on.

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc;

/// A store-wide revision: every change gets the next one.
pub type Revision = i64;

/// A lease's id (never 0).
pub type LeaseId = i64;

/// One key as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// Its value.
    pub value: Vec<u8>,
    /// The revision that created this key (since it last did not exist).
    pub create_revision: Revision,
    /// The revision of its last change.
    pub mod_revision: Revision,
    /// The lease it is bound to, if any.
    pub lease: Option<LeaseId>,
}

/// A condition a transaction checks, all against one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(Vec<u8>),
    /// The key exists and was last changed at exactly this revision.
    ModRevision(Vec<u8>, Revision),
    /// The key exists and was created at exactly this revision (a leader's fence).
    CreateRevision(Vec<u8>, Revision),
    /// The key exists with exactly this value.
    Value(Vec<u8>, Vec<u8>),
    /// No key starting with the prefix (non-empty) was created or changed after this revision
    /// (a deleted key is not seen: callers rely on a deletion also changing a key that stays).
    UnchangedSince(Vec<u8>, Revision),
}

/// A change a transaction makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    /// Sets a key (bound to `lease`, or to none).
    Put {
        /// The key.
        key: Vec<u8>,
        /// Its new value.
        value: Vec<u8>,
        /// The lease to bind it to.
        lease: Option<LeaseId>,
    },
    /// Deletes a key (nothing if absent).
    Delete {
        /// The key.
        key: Vec<u8>,
    },
}

/// If every compare holds, `then` is applied, else `otherwise` — atomically, as one revision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    /// The conditions.
    pub when: Vec<Compare>,
    /// Applied if they all hold.
    pub then: Vec<TxnOp>,
    /// Applied if one does not.
    pub otherwise: Vec<TxnOp>,
}

/// What a transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnResult {
    /// Whether the compares held (and `then` was applied).
    pub succeeded: bool,
    /// The store's revision after it.
    pub revision: Revision,
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was set (its state after the change).
    Put(KeyValue),
    /// A key was deleted (by a delete or by its lease ending) at `revision`.
    Delete {
        /// The key.
        key: Vec<u8>,
        /// The revision of the deletion.
        revision: Revision,
    },
}

impl WatchEvent {
    /// The revision of the change.
    pub fn revision(&self) -> Revision {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { revision, .. } => *revision,
        }
    }

    /// The key changed.
    pub fn key(&self) -> &[u8] {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }
}

/// Changes under a prefix, in revision order. Bounded ([`WATCH_QUEUE`] events): a watcher that
/// falls that far behind gets [`MetaError::WatchLagged`] and must read again and re-watch.
#[derive(Debug)]
pub struct Watch {
    rx: mpsc::Receiver<Result<WatchEvent>>,
}

/// Events a watch holds for a slow watcher before it ends with [`MetaError::WatchLagged`].
pub const WATCH_QUEUE: usize = 4096;

impl Watch {
    /// A watch fed through `rx` (for implementations).
    pub fn new(rx: mpsc::Receiver<Result<WatchEvent>>) -> Watch {
        Watch { rx }
    }

    /// The next change; `None` once the store is gone. After an error the watch is over.
    pub async fn next(&mut self) -> Option<Result<WatchEvent>> {
        self.rx.recv().await
    }

    /// The next change if one is queued now (without waiting); `None` if none is, or the store
    /// is gone.
    pub fn try_next(&mut self) -> Option<Result<WatchEvent>> {
        self.rx.try_recv().ok()
    }
}

/// What every [`MetaStore::range_except`] refuses: an empty range, or an excepted prefix that
/// is not a longer prefix inside it.
pub(crate) fn check_except(prefix: &[u8], except: &[u8]) -> Result<()> {
    if prefix.is_empty() || !except.starts_with(prefix) || except.len() <= prefix.len() {
        return Err(MetaError::Invalid("the excepted prefix must lie inside a non-empty range".into()));
    }
    Ok(())
}

/// Why a metadata operation failed. Codes are stable (`code`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// The store cannot be reached (or timed out); the operation may or may not have happened if
    /// it was a write.
    #[error("metadata store unavailable: {0}")]
    Unavailable(String),
    /// The lease does not exist (expired or revoked).
    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),
    /// A watch asked for history the store no longer keeps.
    #[error("revision {0} is compacted: read again and watch from the current revision")]
    Compacted(Revision),
    /// A watcher fell too far behind and its watch ended.
    #[error("watch fell behind: read again and watch from the current revision")]
    WatchLagged,
    /// A request the store refuses (bad TTL, empty key, ...).
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl MetaError {
    /// A stable code naming the error.
    pub fn code(&self) -> &'static str {
        match self {
            MetaError::Unavailable(_) => "meta_unavailable",
            MetaError::LeaseNotFound(_) => "lease_not_found",
            MetaError::Compacted(_) => "revision_compacted",
            MetaError::WatchLagged => "watch_lagged",
            MetaError::Invalid(_) => "invalid_request",
        }
    }
}

/// Results of metadata operations.
pub type Result<T> = std::result::Result<T, MetaError>;

/// The metadata store the cluster runs on (etcd, or [`crate::MemStore`]). Cheap to clone; every
/// clone is the same store.
pub trait MetaStore: Clone + Send + Sync + 'static {
    /// The key, if it exists.
    fn get(&self, key: &[u8]) -> impl Future<Output = Result<Option<KeyValue>>> + Send;

    /// Every key starting with `prefix`, in key order, and the revision they were read at.
    fn range(&self, prefix: &[u8]) -> impl Future<Output = Result<(Vec<KeyValue>, Revision)>> + Send;

    /// Every key starting with `prefix` but not with `except` (a longer prefix inside it), in
    /// key order, and the revision they were all read at: one read that leaves a large part of a
    /// prefix out (the cluster's event log, read by nobody who reads the rest). By default a
    /// whole range, filtered.
    fn range_except(
        &self,
        prefix: &[u8],
        except: &[u8],
    ) -> impl Future<Output = Result<(Vec<KeyValue>, Revision)>> + Send {
        async move {
            check_except(prefix, except)?;
            let (kvs, rev) = self.range(prefix).await?;
            Ok((kvs.into_iter().filter(|kv| !kv.key.starts_with(except)).collect(), rev))
        }
    }

    /// Applies a transaction atomically.
    fn txn(&self, txn: Txn) -> impl Future<Output = Result<TxnResult>> + Send;

    /// Deletes every key starting with `prefix` at once (one revision; none if nothing was
    /// there) and returns how many there were. An empty prefix is refused (it would be every key
    /// in the store).
    fn delete_prefix(&self, prefix: &[u8]) -> impl Future<Output = Result<u64>> + Send;

    /// A new lease that lives `ttl` (rounded up to whole seconds by etcd) unless kept alive.
    fn grant(&self, ttl: Duration) -> impl Future<Output = Result<LeaseId>> + Send;

    /// Renews a lease for its TTL; [`MetaError::LeaseNotFound`] once it has ended.
    fn keep_alive(&self, lease: LeaseId) -> impl Future<Output = Result<()>> + Send;

    /// Ends a lease now, deleting its keys.
    fn revoke(&self, lease: LeaseId) -> impl Future<Output = Result<()>> + Send;

    /// Changes to keys under `prefix` with a revision >= `from` (`from` <= 0: from now on), in order.
    fn watch(&self, prefix: &[u8], from: Revision) -> impl Future<Output = Result<Watch>> + Send;

    /// Sets a key; returns the revision of the change.
    fn put(&self, key: &[u8], value: &[u8], lease: Option<LeaseId>) -> impl Future<Output = Result<Revision>> + Send {
        let op = TxnOp::Put { key: key.to_vec(), value: value.to_vec(), lease };
        async move { Ok(self.txn(Txn { then: vec![op], ..Txn::default() }).await?.revision) }
    }

    /// Deletes a key; returns the store's revision after it.
    fn delete(&self, key: &[u8]) -> impl Future<Output = Result<Revision>> + Send {
        let op = TxnOp::Delete { key: key.to_vec() };
        async move { Ok(self.txn(Txn { then: vec![op], ..Txn::default() }).await?.revision) }
    }
}
