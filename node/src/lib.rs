//! dpukv-node: the node pod's two halves (docs/architecture.md). The **host** (`dpukv-node`)
//! owns the regions — value log, in-memory tree, levels — and runs writes and atomics; the
//! **device** (`dpukv-dpu`, a DPU or its emulator sidecar) is the pod's network front: it serves
//! GET and SCAN itself, wait-free, from the host's shared memory, and forwards writes to the host.
//!
//! # Layout
//! - `pod`: the pod's shared directory — what the host publishes for the device, and where.
//! - `regions`: the static region map both halves route and check requests by.
//! - `conn`: serving one protocol connection within byte budgets and timeouts (from
//!   `dpukv-net`, shared with the gateway).
//! - `reads`: the read engine: a fixed pool of reader threads over the shared memory.
//! - `atomics`: vector operations and the reservation station.
//! - `popular`: which keys are popular (hKVS: moving-window admission, LRU-bounded set), counted
//!   by the device's readers (`dpu::hot_keys`).
//! - `process`: this process's CPU time and resident memory (the console's figures).
//! - `replica_table`: a device's copies of other primaries' popular keys, served within a
//!   staleness bound (docs/hot-keys.md).
//! - `replication`: Tebis over TCP — a primary's senders (log bytes, shipped index), the
//!   backups' server, and the acknowledgement rule (every backup of the set holds the write).
//! - `host`: the host process (`host::run`): per-region writers and releasers.
//! - `dpu`: the device process (`dpu::run`): the data port, the links to the host, and the
//!   front door (the gateway's RESP and HTTP front ends in its process).
//! - `admin`: `/healthz`, `/readyz`, `/metrics` (read-only).
//! - `backup`: a region's part of a backup — its snapshot uploaded as objects, and a region
//!   directory made again from a part.
//! - `control`: a cluster host's control API (`/cluster/*`), for operators and admins only.
//! - `http`: the bounded HTTP server under both.
//! - `config`: the binaries' flags.
//! - `sizing`: the automatic L0 budget (from the pod's memory).
//!
//! The device never calls host code: both halves meet only in `pod`, `regions`, `conn` and
//! `reads`, and in the shared directory.

pub mod admin;
pub mod atomics;
pub mod backup;
pub mod config;
pub mod control;
// Allocations counted per thread in the unit tests (a device's get allocates nothing per read).
#[cfg(test)]
#[global_allocator]
static COUNTING: dpukv_alloc_count::Counting = dpukv_alloc_count::Counting;

/// A tmpfs for unit tests that need a full disk (shared with the storage and node suites).
#[cfg(test)]
#[path = "../../storage/tests/support/tmpfs.rs"]
#[allow(dead_code)]
mod tmpfs;
pub use dpukv_net::conn;
pub mod dpu;
pub mod host;
mod http;
pub mod pod;
pub mod popular;
pub mod process;
pub mod reads;
pub mod regions;
pub mod replica_table;
pub mod replication;
pub mod sizing;
