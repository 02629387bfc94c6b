//! dpukv-node: the node pod's two halves (ARCHITECTURE.md §3, §7). The **host** (`dpukv-node`)
//! owns the regions — value log, in-memory tree, levels — and runs writes and atomics; the
//! **device** (`dpukv-dpu`, a DPU or its emulator sidecar) is the pod's network front: it serves
//! GET and SCAN itself, wait-free, from the host's shared memory, and forwards writes to the host.
//!
//! # Layout
//! - `regions`: the static region map both halves route by.
//! - `reads`: the read path from shared memory (device, and host in the baseline mode).
//! - `atomics`: vector operations and the reservation station.
//! - `host`: the host process (`host::run`), its write pipeline.
//! - `dpu`: the device process (`dpu::run`).
//! - `conn`: frame reading, response writing, in-flight caps.
//! - `admin`: `/healthz`, `/readyz`, `/metrics`.
//! - `config`: the binaries' flags.

pub mod admin;
pub mod atomics;
pub mod config;
pub mod conn;
pub mod dpu;
pub mod host;
pub mod reads;
pub mod regions;
