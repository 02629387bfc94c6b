//! A device in the caller's own process: a front end embedded in a node's device process (its
//! RESP and HTTP ports, `dpukv-dpu --resp/--http`) reaches that device's regions by a call, not
//! over a socket — no second hop, no encoding, and a get served on the calling thread. Every
//! other node is reached over the network as before; routing, retries and exactly-once tags do
//! not change (the device checks the request exactly as one from a socket).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use dpukv_proto::{Request, Response};

/// A device answering requests in this process.
pub trait LocalDevice: Send + Sync {
    /// Answers `req`: at once (a get served on the calling thread), or by a future the caller
    /// polls (writes go to the host, scans to the read engine). A request whose future is
    /// dropped may still execute, like one whose connection broke.
    fn call(&self, req: Request) -> LocalCall<'_>;

    /// A get of `key` (in `region`, at `epoch`, by the caller's map) answered at once on the
    /// calling thread, the value appended to `out` with no allocation but `out`'s growth — the
    /// device checks it exactly as a [`dpukv_proto::Op::Get`] sent to [`LocalDevice::call`].
    /// None: this device does not answer gets that way (use `call`).
    fn get_into(&self, region: u32, epoch: u64, key: &[u8], out: &mut Vec<u8>) -> Option<GetInto> {
        let _ = (region, epoch, key, out);
        None
    }
}

/// What [`LocalDevice::get_into`] answered.
#[derive(Debug, Clone, PartialEq)]
pub enum GetInto {
    /// The value was appended: its length, and whether the key is replicated on other devices
    /// (hot keys: the reply's flag).
    Value {
        /// Bytes appended.
        len: usize,
        /// The version of the entry that decided it (as a response's `version`).
        version: u64,
        /// The key is replicated.
        replicated: bool,
    },
    /// The key has no value (nothing appended).
    Missing {
        /// The key is replicated.
        replicated: bool,
    },
    /// The device's error answer (nothing appended).
    Error(dpukv_proto::ErrorReply),
}

/// A [`LocalDevice`]'s answer.
pub enum LocalCall<'a> {
    /// Answered.
    Ready(Response),
    /// To be answered by this future (None: the device stopped before it answered).
    Later(Pin<Box<dyn Future<Output = Option<Response>> + Send + 'a>>),
}

/// The node whose device is in this process ([`crate::Options::local`]): its requests are
/// answered by `device`.
#[derive(Clone)]
pub struct Local {
    /// The node's id in the cluster's map.
    pub node: u32,
    /// Its device.
    pub device: Arc<dyn LocalDevice>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local").field("node", &self.node).finish_non_exhaustive()
    }
}
