//! Integration tests of the engine: model tests against `BTreeMap`, MVCC snapshot isolation,
//! concurrent readers, readers in other processes, and corrupt arenas.

mod common;
mod concurrency;
mod corrupt;
mod hints;
mod lifetimes;
mod model;
mod multiprocess;
#[path = "../support/model.rs"]
mod support_model;
