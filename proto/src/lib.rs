//! dpukv-proto: the contracts between dpukv's processes and its clients. Today: the client wire
//! protocol v1 — length-prefixed frames carrying batches of operations with request ids (so many
//! requests are in flight per connection and complete out of order), typed error codes, explicit
//! limits, and scan continuation tokens. Spec with byte diagrams: `docs/protocol.md`.
//!
//! This crate sits at the bottom of the architecture (docs/architecture.md) with `storage`; only it
//! knows byte layouts on the wire. It has no I/O: callers feed it bytes.
//!
//! # Layout
//! - `limits`: every size limit of the protocol.
//! - `error`: [`ErrorCode`] (on the wire) and [`DecodeError`] (a frame that cannot be parsed).
//! - `message`: requests, operations, responses, replies.
//! - `codec`: encoding and checked decoding of frames.
//! - [`control`]: the routes of a host's control API (`/cluster/*`), parsed and printed.
//! - [`regionmap`]: the cluster's region map (nodes, regions, epochs), its stored encoding, and
//!   key routing — the one implementation clients, gateways and nodes share.
//! - [`replication`]: the primary-to-backup protocol (log bytes, shipped index segments, what a
//!   backup holds, typed refusals).
//! - `token`: the scan continuation token.

mod codec;
pub mod control;
pub mod counter;
mod error;
pub mod limits;
mod message;
pub mod regionmap;
pub mod replication;
pub mod stats;
mod token;

pub use codec::{
    FrameHeader, RequestEntry, ResponseFrame, decode_requests, decode_responses, encode_requests,
    encode_response_entry, encode_responses, frame_header,
};
pub use error::{DecodeError, ErrorCode};
pub use message::{
    Cmp, Consistency, Elem, ErrorReply, KeyDeltas, Op, OpCode, ReduceOp, Reply, Request, Response, Session, StartHint,
    SyncEntry, TraceContext, TreeNode, VecOp, WriteOp,
};
pub use token::ScanToken;

/// Protocol version carried in every frame.
pub const VERSION: u8 = 1;
