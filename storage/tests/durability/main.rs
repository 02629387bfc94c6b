//! Durability tests: the value log (round trips, torn tails, corruption, fsync policies, SIGKILL
//! crashes of a writer process, the journaled fault layer under SIGKILL and power cuts).

mod corrupt;
mod crash;
mod device;
mod fullfs;
mod journal;
mod levels;
mod powerloss;
mod region;
mod sendindex;
mod sigkill;
mod snapshot;
#[path = "../support/model.rs"]
mod support_model;
#[path = "../support/tmpfs.rs"]
mod support_tmpfs;
mod vlog;
