//! dpukv-fabric: the binary protocol's transport over libfabric (docs/architecture.md,
//! "Transports"). libfabric is the portable RDMA API: the same calls run on the `verbs` provider
//! (RoCE, InfiniBand, BlueField), `efa`, and — what tests use here, with no RDMA NIC — the `tcp`
//! provider over loopback. It sits under the device's data port and the Rust client, beside TCP:
//! a [`FabricStream`] is an `AsyncRead + AsyncWrite` byte stream, so the protocol's framing,
//! limits and TLS above it are the ones TCP connections get.
//!
//! # Layout
//! - `ffi`: the shim's functions (shim/dkf.c: libfabric's inline calls in linkable form) behind
//!   owned handles — the crate's only `unsafe`. Without the `libfabric` feature, or without
//!   libfabric's headers at build time, a stand-in answers [`FabricError::NotBuilt`].
//! - `reports`: what the shim reports (completions, connection events), shared by `ffi` and its
//!   stand-in.
//! - `stream`: [`FabricStream`] (credit flow control over registered buffers, completion
//!   polling with a bounded spin) and [`FabricListener`].
//! - `addr`: [`FabricAddr`], `fabric://PROVIDER/HOST:PORT`.
//!
//! # Invariants
//! - A connection's memory is its registered buffers, fixed when it is made (2 × `nbufs` ×
//!   `bufsize`): a peer can make it hold nothing more.
//! - A sender never has more messages unconsumed at its peer than the peer posted buffers for
//!   (no receiver-not-ready on hardware that has no buffering of its own).
//! - Every libfabric object is closed exactly once, after the reactor stopped watching its
//!   descriptors.

mod addr;
#[cfg(dkf_built)]
mod ffi;
#[cfg(not(dkf_built))]
#[path = "ffi_absent.rs"]
mod ffi;
mod reports;
mod stream;

pub use addr::FabricAddr;
pub use stream::{FabricListener, FabricStream, Options, spin_for};

/// Why a fabric operation failed.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// This build has no libfabric (the `libfabric` feature was off, or its headers missing).
    #[error(
        "this build of dpukv has no libfabric support (built without libfabric's headers or the `libfabric` feature)"
    )]
    NotBuilt,
    /// libfabric is not installed here (it is loaded when a fabric endpoint is first opened).
    #[error("libfabric is not available: {0}")]
    Unavailable(String),
    /// A libfabric call failed.
    #[error("libfabric {what}: {message} (error {code})")]
    Call {
        /// The operation.
        what: &'static str,
        /// libfabric's error code (positive).
        code: i32,
        /// Its text.
        message: String,
    },
    /// A bad `fabric://` address, or a name with a NUL byte.
    #[error("fabric address: {0}")]
    Address(String),
    /// Buffer sizes out of range.
    #[error("fabric options: {0}")]
    Options(String),
    /// The peer broke the transport's rules.
    #[error("fabric peer: {0}")]
    Protocol(String),
    /// A deadline passed.
    #[error("fabric: timed out {0}")]
    TimedOut(String),
    /// The reactor refused a descriptor, or the connection failed.
    #[error("fabric: {0}")]
    Io(#[from] std::io::Error),
}

/// Whether this build can speak libfabric (built with the `libfabric` feature and its headers).
pub const BUILT: bool = cfg!(dkf_built);
