//! dpukv-cluster: the cluster's metadata — where regions live and who leads — behind one trait.
//!
//! Where it sits: below the node (which registers under a lease and runs the master when elected)
//! and the gateway; it may use `dpukv-proto` (region-map types) and nothing else of dpukv.
//! Nothing here touches storage.
//!
//! - [`meta`]: the [`MetaStore`] trait — ranges, transactions with compares, leases with
//!   keepalive, watches from a revision — the subset of etcd's API the cluster uses.
//! - [`etcd`]: [`EtcdStore`], the trait on a real etcd (v3 API), every request with a deadline;
//!   TLS with a client certificate ([`EtcdTls`]).
//! - [`mem`]: [`MemStore`], an in-process implementation with etcd's semantics (one revision
//!   counter, leases that expire and delete their keys, ordered watch events) for the single-node
//!   mode and unit tests.
//! - [`election`]: leader election built on the trait (etcd's recipe: a key per candidate under
//!   the election's prefix, bound to its lease; the oldest key leads), so both stores share it.
//! - [`keys`]: the key layout under `/dpukv/<cluster>/` and the stored cluster configuration.
//! - [`membership`]: a node's registration under a lease and the authority it gives (until when
//!   the node may act as a primary).
//! - [`master`]: the elected master's loop — first layout, then placement changes, each one
//!   fenced transaction; it retries every transient error forever and campaigns again when
//!   deposed, so a master loop never dies while its node lives.
//! - [`fence`]: backup fences — a consistent cut of every region, taken through the store
//!   while the cluster serves (the coordinator, and the primaries' side as pure decisions).
//! - [`restore`]: restoring a backup into an empty cluster — the cut that replaces the map by
//!   the backup's regions, the nodes' reports, the master's end of it.
//! - [`schedule`]: the cluster's backup schedule (restore points) and its last backup, as stored.
//! - [`events`]: the cluster's event log — failovers with their duration, handovers, splits,
//!   merges, drains, backups — derived by the master from its successive snapshots.
//! - [`backoff`]: exponential backoff with jitter for every control loop's retries.
//! - [`placement`]: where replicas go — the first layout, and the master's next changes after
//!   failures, joins, drains and catch-ups (pure functions, model-tested).
//! - [`handoff`]: splits and merges — when the master starts one and how it commits or aborts
//!   (pure functions, tested on the map they leave).
//! - [`conformance`]: the behaviour every store must show, run against each implementation.
//!
//! Invariants every implementation keeps: revisions only grow and every change has its own; a
//! transaction is atomic and its compares see one state; a key bound to a lease is deleted when
//! the lease ends (revoked, or not kept alive within its TTL); a watch delivers every change to its
//! prefix after its start revision, in revision order, or ends with an error — never skips one.

pub mod backoff;
pub mod conformance;
pub mod election;
pub mod etcd;
pub mod events;
pub mod fence;
pub mod handoff;
pub mod keys;
pub mod master;
pub mod mem;
pub mod membership;
pub mod meta;
pub mod placement;
pub mod restore;
pub mod schedule;

pub use election::{Leadership, campaign, leader, resign};
pub use etcd::{EtcdOptions, EtcdStore, EtcdTls};
pub use mem::MemStore;
pub use meta::{Compare, KeyValue, LeaseId, MetaError, MetaStore, Revision, Txn, TxnOp, TxnResult, Watch, WatchEvent};
