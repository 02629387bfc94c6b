//! dpukv-e2e: the end-to-end harness (docs/architecture.md: nothing depends on it). It builds and
//! starts real processes, injects faults by killing them, records client histories and checks
//! them for linearizability.
//!
//! # Layout
//! - `linearizability`: a WGL/Porcupine-style checker for a key-value register model,
//!   partitioned by key, with scans projected to per-key reads.
//! - `history`: recording invocations and responses from concurrent clients.
//! - `staleness`: a checker of bounded-staleness reads (hot-key replicas).
//! - `procs`: building the binaries and running a node pod (host + device).
//! - `etcd`: a real etcd member per test (free ports, fast elections), stoppable and resumable,
//!   with TLS if asked.
//! - `certs`: a test cluster's certificates with identities (docs/security.md), and an
//!   attacker's.
//! - `cluster`: node pods that join a cluster in a real etcd; killable, resumable.
//! - `gateway`: a gateway process in front of a cluster.
//! - `netns`: hosts in network namespaces on a bridge, partitioned with nftables.
//! - `delay`: a TCP proxy adding an adjustable delay (a slow link to etcd).
//! - `otlp`: an OTLP/gRPC trace receiver that keeps the spans processes export.
//! - `apiserver`: a test double of the Kubernetes API server (REST and watch, finalizers,
//!   garbage collection, admission) for the kinds the operator uses.
//! - `crd_schema`: what the API server does to a custom resource from its CRD's schema
//!   (pruning, defaults, types, CEL rules with the quantity library, ratcheting).
//! - `kubelet`: the StatefulSet and Deployment controllers and a kubelet running pods as real
//!   processes in network namespaces, over `apiserver`.
//! - `webdriver`: a W3C WebDriver client driving headless Chromium through chromedriver (the
//!   web console's browser tests).

pub mod apiserver;
pub mod certs;
pub mod cluster;
pub mod crd_schema;
pub mod delay;
pub mod etcd;
pub mod gateway;
pub mod history;
pub mod kubelet;
pub mod linearizability;
pub mod netns;
pub mod otlp;
pub mod procs;
pub mod staleness;
pub mod webdriver;
