//! Host and device as real processes, driven over TCP with protocol frames.

mod bounds;
mod faults;
mod harness;
mod ops;
