//! Atomics (KV-Direct §3.2–3.3): vector operations on values read as arrays of numbers, and the
//! reservation station that lets the write pipeline execute many atomics on the same key against
//! a forwarded value and write it back once.
//!
//! # Layout
//! - `vector`: the operations themselves, pure functions over bytes.
//! - `station`: [`ReservationStation`], keyed by key hash, with data forwarding and write-back.

mod station;
pub mod vector;

pub use station::{AtomicError, ReservationStation, add_each};
