//! Host and device as real processes, driven over TCP with protocol frames.

mod faults;
mod harness;
mod ops;
