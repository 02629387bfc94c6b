//! Host and device as real processes, driven over TCP with protocol frames.

mod bounds;
mod faults;
mod harness;
mod ops;
mod replication;
#[allow(dead_code)] // shared with the storage suite, which uses all of it
#[path = "../../../storage/tests/support/tmpfs.rs"]
mod tmpfs;
