//! dpukv-storage: the storage engine of a dpukv node, as a library with no tokio, no sockets and
//! no Kubernetes.
//!
//! This crate sits at the bottom of the architecture (docs/architecture.md). The host process
//! (`dpukv-node`) owns a [`Writer`] per region; the device process (`dpukv-dpu`) opens the same
//! arena file as a [`Reader`] and serves GET and SCAN from it without ever waiting for the host.
//!
//! The tree is Honeycomb's B+tree (paper 000 §3): fixed-size nodes named by logical ids through a
//! page table, leaves with a shortcut block, a sorted block and a log block (order hints, back
//! pointers, version deltas), MVCC with a global write version and a global read version, old
//! versions reachable through per-buffer pointers, and epoch-based reclamation whose reader slots
//! live in the arena so readers in other processes take part.
//!
//! # Layout
//! - `announce`: an immutable payload in shared memory that a newer host marks closed (the
//!   node's region map).
//! - `arena`: the shared mapping (`shm`, where the `unsafe` accessors live; their few callers
//!   state their reasons in `SAFETY` comments), superblock layout, generation-checked reader
//!   slots and dead-reader detection, and the writer's page and LID allocators.
//! - `btree`: node format (`node`), wait-free snapshot reads and the read API shared by snapshots
//!   and the writer (`read`), a device reader's node cache (`cache`), and the single writer
//!   (`write`: batches, one operation, restructuring, space, publication, reclamation).
//! - `levels`: durable levels: immutable B+tree segments, the level builder, the manifest.
//! - `region`: the region store: value log + L0 + levels, compaction, recovery, readers.
//! - `vlog`: the value log: segments, records, group commit, fsync policies, recovery.
//! - `config`: [`ArenaConfig`] and its validation.
//! - `error`: [`Error`], classified with `code()`, `is_retryable()` and `outcome_unknown()`.
//! - `fs`: the file layer durable writes go through, and the fault-injecting one for tests.
//! - `workload`: invariant-checking workloads (the bank, the power-loss scenario) for the tools,
//!   tests, fuzz targets and demo.
//!
//! # Invariants
//! - Bytes a reader can reach are never modified in place; they are published by release stores
//!   of a page-table entry, a node's size word, or the global read version.
//! - A reader that pinned read version `rv` sees exactly the writes with version `<= rv`.
//! - Garbage retired at version `v` is freed only when every pinned reader slot holds `>= v`;
//!   a file retired at table-set generation `g` is deleted only when no reader pins a set `< g`.
//! - A write is visible to readers in other threads and processes once it may be acknowledged
//!   under the fsync policy, not before; nothing acknowledged is lost (module `vlog`). A gated
//!   region (a cluster's primary, `Region::gate_reads`) also shows a write only once its log end
//!   is within the bound its owner sets (what every backup holds), in L0 and in levels alike.
//!
//! The byte layout is specified in `docs/storage-format.md`.

pub mod announce;
mod arena;
mod btree;
mod config;
mod error;
pub mod fs;
pub mod levels;
pub mod region;
pub mod vlog;
pub mod workload;

pub use arena::Layout;
pub use btree::{BatchOp, Entry, ReadStats, Reader, SharedStats, Snapshot, StartHint, Stats, TopNode, Writer};
pub use config::{ArenaConfig, MAX_KEY_LEN, MAX_VALUE_LEN};
pub use error::{Error, Result};
