//! Host and device as real processes, driven over TCP with protocol frames (and, in
//! `powerloss`, through a simulated power loss of the whole pod).

mod bounds;
mod fabric;
mod faults;
mod harness;
mod ops;
mod powerloss;
mod replication;
#[allow(dead_code)] // shared with the storage suite, which uses all of it
#[path = "../../../storage/tests/support/tmpfs.rs"]
mod tmpfs;
