//! What the shim reports — completions, connection events, "nothing yet" — in the form both
//! `ffi` and its stand-in (a build without libfabric) hand to `stream`.

/// libfabric's "nothing yet" (`FI_EAGAIN`).
pub const EAGAIN: i32 = 11;

/// One completion, as the shim writes it (`struct dkf_completion` in shim/dkf.c).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Completion {
    /// The buffer's index (among receive buffers, or among send buffers).
    pub index: u64,
    /// Bytes received (a receive's completion).
    pub len: u64,
    /// 1 for a receive, 0 for a send.
    pub recv: i32,
    /// 0, or a negative libfabric error code: the operation failed.
    pub error: i32,
}

/// What the connection-management queue said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(dkf_built), allow(dead_code))] // (a build without libfabric sees none)
pub enum CmEvent {
    /// Nothing new.
    Nothing,
    /// The connection is established.
    Connected,
    /// The peer shut it down, or refused it.
    Shutdown,
}
