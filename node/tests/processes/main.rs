//! Host and device as real processes, driven over TCP with protocol frames.

mod harness;
mod ops;
