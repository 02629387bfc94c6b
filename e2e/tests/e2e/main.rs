//! End-to-end tests over real processes: linearizability (with crashes), exactly-once retries,
//! and `dpukv local`'s supervision.

mod backup;
mod cluster;
mod console;
mod crds;
mod faults;
mod gateway;
mod gateway_attacks;
mod hot_keys;
mod identity;
mod linearizable;
mod local;
mod meta;
mod nemesis;
mod operator;
mod tls;
mod traces;
