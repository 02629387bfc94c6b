//! dpukv-operator: dpukv on Kubernetes (docs/kubernetes.md). Users declare a `DpuKvCluster`;
//! the operator (issue 12, in progress) turns it into node pods, a gateway, services and a
//! disruption budget, and drains nodes through the cluster's master before they go.
//!
//! It depends on `dpukv-net` only for how a process starts (logs, shutdown on signals), on
//! `dpukv-cluster` only to delete a deleted cluster's keys in an external etcd (the key layout
//! and `MetaStore::delete_prefix`), calls the master's admin API over HTTP, and is the only crate
//! that may depend on Kubernetes crates (scripts/check-deps.py).
//!
//! # Layout
//! - `crd`: the `DpuKvCluster` resource — spec, status, CEL rules, printer columns, scale.
//! - `operation`: the `DpuKvOperation` resource (drain or step down one node pod, held while it
//!   exists) and its reconciler.
//! - `backups`: the `DpuKvBackup`, `DpuKvBackupSchedule` and `DpuKvRestore` resources and their
//!   reconcilers (through the cluster's control API: docs/backup.md §7).
//! - `manifest`: the CRD as YAML (what `crdgen` writes to `manifests/crds/`).
//! - `controller`: the reconciler — applies what `render` says, reports status, backs off;
//!   drains nodes before the node StatefulSet shrinks.
//! - `events`: the Kubernetes events it publishes on a cluster, and their reasons.
//! - `etcd_keys`: a cluster's keys in an external etcd — the finalizer, the skip annotation, the
//!   deletion (injectable: tests delete from an in-memory store).
//! - `claims`: volume sizes after creation — claim templates kept, claims expanded, shrinks refused.
//! - `admin`: a cluster's admin API — drains (and stopping them), the summary the status shows.
//! - `run`: the controller over every cluster and what it owns (and watches of the nodes' zones
//!   and of its pods the scheduler cannot place); `/metrics` and health.
//! - `metrics`: the operator's metrics, over all clusters and per cluster.
//! - `lease`: leader election over a coordination Lease (several replicas, one reconciles).
//! - `rbac`: the permissions the operator needs, as data (the chart's roles are generated from it).
//! - `render`: what a cluster becomes — the node StatefulSet, its headless Service, the node
//!   hosts' ConfigMap, the gateway Deployment and Service, the node pods' disruption budget.
//!
//! # Invariants
//! - The CRD in `manifests/crds/` is generated from `crd`, never edited (a test compares them).
//! - The chart's RBAC rule files are generated from `rbac`; every API request the operator's tests
//!   see it make is allowed by those rules, and every rule is used.
//! - Publishing an event never fails a reconcile.
//! - A finalizer only where state outlives the resource's Kubernetes objects (an external etcd's
//!   keys); the keys are deleted only once no node pod of the cluster runs.

pub mod admin;
pub mod backups;
pub mod certs;
pub mod claims;
pub mod controller;
pub mod crd;
pub mod etcd_keys;
pub mod events;
pub mod lease;
pub mod manifest;
pub mod metrics;
pub mod operation;
pub mod rbac;
pub mod render;
pub mod run;
pub mod tls;
