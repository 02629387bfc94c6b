//! Encoding and checked decoding of frames (byte diagrams in `docs/protocol.md`).
//!
//! A frame is `u32 len | u8 version | u8 kind | u16 count | entries`, every entry prefixed by its
//! own `u32` length. [`frame_header`] tells whether a complete frame is buffered before anything
//! is parsed; a bad entry inside a well-formed frame becomes an error for that request id only.

use crate::error::{DecodeError, ErrorCode};
use crate::limits::*;
use crate::message::*;

/// Request flag: an exactly-once session block follows the header.
const F_SESSION: u16 = 1;
/// Request flag: the write is a retry (only with a session).
const F_RETRY: u16 = 2;
/// Request flag: a trace context block follows (after the session block, if any).
const F_TRACE: u16 = 4;
/// Request flag: a get aimed at a hot-key replica ([`Request::replica`]).
const F_REPLICA: u16 = 8;
/// Request flag: a start-hint block follows (after the trace block, if any).
const F_HINT: u16 = 16;
const KIND_REQUESTS: u8 = 1;
const KIND_RESPONSES: u8 = 2;
/// Bytes of the frame header.
pub const FRAME_HEADER: usize = 8;

/// What the first bytes of a frame say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Total frame length, header included.
    pub total: usize,
    /// Entries in the frame.
    pub count: usize,
    /// Whether it carries requests (else responses).
    pub requests: bool,
}

/// Reads the header at the start of `buf`: `Ok(None)` if fewer than 8 bytes are buffered.
pub fn frame_header(buf: &[u8]) -> Result<Option<FrameHeader>, DecodeError> {
    if buf.len() < FRAME_HEADER {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
    let total = len + 4;
    if total > MAX_FRAME {
        return Err(DecodeError::TooLarge(total));
    }
    if total < FRAME_HEADER {
        return Err(DecodeError::Malformed("frame shorter than its header"));
    }
    if buf[4] != crate::VERSION {
        return Err(DecodeError::Version(buf[4]));
    }
    let requests = match buf[5] {
        KIND_REQUESTS => true,
        KIND_RESPONSES => false,
        _ => return Err(DecodeError::Malformed("unknown frame kind")),
    };
    let count = u16::from_le_bytes([buf[6], buf[7]]) as usize;
    if count > MAX_OPS_PER_FRAME {
        return Err(DecodeError::Malformed("more entries than the limit"));
    }
    Ok(Some(FrameHeader { total, count, requests }))
}

// ---- writing ------------------------------------------------------------------------------------

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
}

fn begin_frame(out: &mut Vec<u8>, kind: u8, count: usize) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(crate::VERSION);
    out.push(kind);
    out.extend_from_slice(&(count as u16).to_le_bytes());
    start
}

fn end_frame(out: &mut [u8], start: usize) {
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

fn begin_entry(out: &mut Vec<u8>) -> usize {
    out.extend_from_slice(&[0; 4]);
    out.len()
}

fn end_entry(out: &mut [u8], body: usize) {
    let len = (out.len() - body) as u32;
    out[body - 4..body].copy_from_slice(&len.to_le_bytes());
}

fn put_write_op(w: &mut W<'_>, op: &WriteOp) {
    match op {
        WriteOp::Put { key, value } | WriteOp::Insert { key, value } | WriteOp::Update { key, value } => {
            w.u8(match op {
                WriteOp::Put { .. } => OpCode::Put,
                WriteOp::Insert { .. } => OpCode::Insert,
                _ => OpCode::Update,
            } as u8);
            w.bytes(key);
            w.bytes(value);
        }
        WriteOp::Delete { key } => {
            w.u8(OpCode::Delete as u8);
            w.bytes(key);
        }
    }
}

/// Appends one frame carrying `reqs` (at most [`MAX_OPS_PER_FRAME`]) to `out`. Callers check
/// [`Op::validate`] and [`MAX_FRAME`] first; the encoder does not.
pub fn encode_requests(reqs: &[Request], out: &mut Vec<u8>) {
    let start = begin_frame(out, KIND_REQUESTS, reqs.len());
    for r in reqs {
        let body = begin_entry(out);
        let mut w = W(out);
        w.u64(r.id);
        w.u8(r.op.code() as u8);
        let (c, bound) = match r.consistency {
            Consistency::Linearizable => (0, 0),
            Consistency::Bounded { max_staleness_ms } => (1, max_staleness_ms),
            Consistency::Extended => (2, 0),
            Consistency::Interleaved => (3, 0),
        };
        w.u8(c);
        let flags = match r.session {
            None => 0,
            Some(s) => F_SESSION | if s.retry { F_RETRY } else { 0 },
        } | if r.trace.is_some() { F_TRACE } else { 0 }
            | if r.replica { F_REPLICA } else { 0 }
            | if r.hint.is_some() { F_HINT } else { 0 };
        w.u16(flags);
        w.u32(bound);
        w.u64(r.read_version);
        w.u32(r.region);
        w.u64(r.epoch);
        if let Some(s) = r.session {
            w.u64(s.client);
            w.u64(s.seq);
            w.u64(s.acked_below);
        }
        if let Some(t) = &r.trace {
            w.0.extend_from_slice(&t.trace_id);
            w.0.extend_from_slice(&t.span_id);
            w.u8(t.flags);
        }
        if let Some(h) = &r.hint {
            w.u64(h.arena);
            put_tree_node(&mut w, &h.node);
        }
        match &r.op {
            Op::Get { key } | Op::Delete { key } => w.bytes(key),
            Op::Put { key, value } | Op::Insert { key, value } | Op::Update { key, value } => {
                w.bytes(key);
                w.bytes(value);
            }
            Op::Scan { lo, hi, limit, max_bytes, token } | Op::FloorScan { lo, hi, limit, max_bytes, token } => {
                w.bytes(lo);
                w.bytes(hi);
                w.u32(*limit);
                w.u32(*max_bytes);
                w.bytes(token);
            }
            Op::FetchAdd { key, delta } => {
                w.bytes(key);
                w.u64(*delta);
            }
            Op::AddText { key, deltas } => {
                w.bytes(key);
                w.u16(deltas.len() as u16);
                for d in deltas {
                    w.u64(*d as u64);
                }
            }
            Op::AddTexts { adds } => {
                w.u16(adds.len() as u16);
                for (key, deltas) in adds {
                    w.bytes(key);
                    w.u16(deltas.len() as u16);
                    for d in deltas {
                        w.u64(*d as u64);
                    }
                }
            }
            Op::CompareAndSwap { key, expected, new } => {
                w.bytes(key);
                w.u8(expected.is_some() as u8);
                w.bytes(expected.as_deref().unwrap_or(&[]));
                w.bytes(new);
            }
            Op::VectorScalar { key, elem, op, operand } => {
                w.bytes(key);
                w.u8(*elem as u8);
                w.u8(*op as u8);
                w.0.extend_from_slice(operand);
            }
            Op::VectorVector { key, elem, op, operand } => {
                w.bytes(key);
                w.u8(*elem as u8);
                w.u8(*op as u8);
                w.bytes(operand);
            }
            Op::Reduce { key, elem, op } => {
                w.bytes(key);
                w.u8(*elem as u8);
                w.u8(*op as u8);
            }
            Op::Filter { key, elem, cmp, operand } => {
                w.bytes(key);
                w.u8(*elem as u8);
                w.u8(*cmp as u8);
                w.0.extend_from_slice(operand);
            }
            Op::Batch { ops } => {
                w.u16(ops.len() as u16);
                for o in ops {
                    put_write_op(&mut w, o);
                }
            }
            Op::RegionMap | Op::Stats => {}
            Op::Auth { token } => w.bytes(token),
            Op::Pivots { lo, hi, max } => {
                w.bytes(lo);
                w.bytes(hi);
                w.u16(*max);
            }
            Op::TreeNodes { key, nodes } => {
                w.bytes(key);
                w.u16(nodes.len() as u16);
                for n in nodes {
                    put_tree_node(&mut w, n);
                }
            }
            Op::ReplicaSync { watermark_ms, reset, entries } => {
                w.u64(*watermark_ms);
                w.u8(*reset as u8);
                w.u16(entries.len() as u16);
                for e in entries {
                    w.bytes(&e.key);
                    w.u64(e.version);
                    w.u8(e.value.is_some() as u8);
                    w.bytes(e.value.as_deref().unwrap_or(&[]));
                }
            }
        }
        end_entry(out, body);
    }
    end_frame(out, start);
}

const R_DONE: u8 = 0;
const R_ABSENT: u8 = 1;
const R_VALUE: u8 = 2;
const R_ITEMS: u8 = 3;
const R_CAS: u8 = 4;
const R_SCALAR: u8 = 5;
const R_VECTOR: u8 = 6;
const R_REGION_MAP: u8 = 7;
const R_KEYS: u8 = 8;
const R_TREE_NODES: u8 = 9;
const R_ADDED: u8 = 10;
const R_STATS: u8 = 11;

/// A tree node: lid, version, level, lo, has_hi, hi.
fn put_tree_node(w: &mut W<'_>, n: &TreeNode) {
    w.u64(n.lid);
    w.u64(n.version);
    w.u8(n.level);
    w.bytes(&n.lo);
    w.u8(n.hi.is_some() as u8);
    w.bytes(n.hi.as_deref().unwrap_or(&[]));
}

/// Appends one frame carrying `resps` (at most [`MAX_OPS_PER_FRAME`]) to `out`.
pub fn encode_responses(resps: &[Response], out: &mut Vec<u8>) {
    let start = begin_frame(out, KIND_RESPONSES, resps.len());
    for r in resps {
        encode_response_entry(r, out);
    }
    end_frame(out, start);
}

/// A response frame built from entries encoded apart ([`encode_response_entry`]), for a server
/// that encodes responses where they are produced and frames them where they are written.
#[derive(Debug)]
pub struct ResponseFrame {
    start: usize,
    count: usize,
}

impl ResponseFrame {
    /// Starts a frame at the end of `out`.
    pub fn begin(out: &mut Vec<u8>) -> ResponseFrame {
        ResponseFrame { start: begin_frame(out, KIND_RESPONSES, 0), count: 0 }
    }

    /// Appends `count` entries encoded with [`encode_response_entry`].
    pub fn push_encoded(&mut self, out: &mut Vec<u8>, entries: &[u8], count: usize) {
        out.extend_from_slice(entries);
        self.count += count;
    }

    /// Appends one response.
    pub fn push(&mut self, out: &mut Vec<u8>, r: &Response) {
        encode_response_entry(r, out);
        self.count += 1;
    }

    /// The header of a frame of `count` entries, `entries_len` bytes encoded apart with
    /// [`encode_response_entry`], for a server that writes a large batch after it as it is
    /// rather than copying it into a frame.
    pub fn header(entries_len: usize, count: usize) -> [u8; 8] {
        let mut h = Vec::with_capacity(8);
        let start = begin_frame(&mut h, KIND_RESPONSES, count);
        let mut h: [u8; 8] = h.try_into().expect("a frame header is 8 bytes");
        h[start..start + 4].copy_from_slice(&((entries_len + 4) as u32).to_le_bytes());
        h
    }

    /// Entries in the frame so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Completes the frame (at most [`MAX_OPS_PER_FRAME`] entries).
    pub fn finish(self, out: &mut [u8]) {
        out[self.start + 6..self.start + 8].copy_from_slice(&(self.count as u16).to_le_bytes());
        end_frame(out, self.start);
    }
}

/// Appends one response entry, with its length prefix, to `out` (see [`ResponseFrame`]).
pub fn encode_response_entry(r: &Response, out: &mut Vec<u8>) {
    {
        let body = begin_entry(out);
        let mut w = W(out);
        w.u64(r.id);
        let status = match &r.result {
            Ok(_) => 0,
            Err(e) => e.code as u8,
        };
        w.u8(status);
        w.u8(r.replicated as u8);
        let kind = match &r.result {
            Ok(Reply::Done) | Err(_) => R_DONE,
            Ok(Reply::Value(None)) => R_ABSENT,
            Ok(Reply::Value(Some(_))) => R_VALUE,
            Ok(Reply::Items { .. }) => R_ITEMS,
            Ok(Reply::Cas { .. }) => R_CAS,
            Ok(Reply::Scalar(_)) => R_SCALAR,
            Ok(Reply::Vector(_)) => R_VECTOR,
            Ok(Reply::RegionMap(_)) => R_REGION_MAP,
            Ok(Reply::Stats(_)) => R_STATS,
            Ok(Reply::Keys(_)) => R_KEYS,
            Ok(Reply::TreeNodes { .. }) => R_TREE_NODES,
            Ok(Reply::Added(_)) => R_ADDED,
        };
        w.u8(kind);
        w.u8(0);
        w.u64(r.version);
        match &r.result {
            Err(e) => {
                let m = &e.message.as_bytes()[..e.message.len().min(MAX_MESSAGE)];
                w.u16(m.len() as u16);
                w.0.extend_from_slice(m);
            }
            Ok(Reply::Done) | Ok(Reply::Value(None)) => {}
            Ok(Reply::Value(Some(v))) | Ok(Reply::Vector(v)) => w.bytes(v),
            Ok(Reply::Items { items, token }) => {
                w.u32(items.len() as u32);
                for (k, v) in items {
                    w.bytes(k);
                    w.bytes(v);
                }
                w.bytes(token);
            }
            Ok(Reply::Cas { swapped, current }) => {
                w.u8(*swapped as u8);
                w.u8(current.is_some() as u8);
                w.bytes(current.as_deref().unwrap_or(&[]));
            }
            Ok(Reply::Scalar(s)) => w.0.extend_from_slice(s),
            Ok(Reply::RegionMap(m)) => {
                let mut b = Vec::new();
                m.encode(&mut b);
                w.bytes(&b);
            }
            Ok(Reply::Stats(s)) => {
                let mut b = Vec::new();
                s.encode(&mut b);
                w.bytes(&b);
            }
            Ok(Reply::Keys(keys)) => {
                w.u16(keys.len() as u16);
                for k in keys {
                    w.bytes(k);
                }
            }
            Ok(Reply::TreeNodes { arena, nodes }) => {
                w.u64(*arena);
                w.u32(nodes.len() as u32);
                for (parent, n) in nodes {
                    w.u16(*parent);
                    put_tree_node(&mut w, n);
                }
            }
            Ok(Reply::Added(results)) => {
                w.u16(results.len() as u16);
                for r in results {
                    w.u8(r.is_some() as u8);
                    w.u64(r.unwrap_or(0) as u64);
                }
            }
        }
        end_entry(out, body);
    }
}

// ---- reading ------------------------------------------------------------------------------------

/// A checked reader over one entry; errors carry the code the server answers with.
struct R<'a> {
    b: &'a [u8],
    p: usize,
}

type EntryError = (ErrorCode, &'static str);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EntryError> {
        let s = self.b.get(self.p..self.p + n).ok_or((ErrorCode::BadRequest, "entry truncated"))?;
        self.p += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, EntryError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, EntryError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> Result<u32, EntryError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, EntryError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn arr8(&mut self) -> Result<[u8; 8], EntryError> {
        Ok(self.take(8)?.try_into().expect("8 bytes"))
    }
    /// A length-prefixed byte string of at most `max` bytes (`code` if longer).
    fn bytes(&mut self, max: usize, code: ErrorCode) -> Result<Vec<u8>, EntryError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err((code, "field longer than the protocol allows"));
        }
        Ok(self.take(n)?.to_vec())
    }
    fn key(&mut self) -> Result<Vec<u8>, EntryError> {
        let k = self.bytes(MAX_KEY, ErrorCode::KeySize)?;
        if k.is_empty() {
            return Err((ErrorCode::KeySize, "empty key"));
        }
        Ok(k)
    }
    fn value(&mut self) -> Result<Vec<u8>, EntryError> {
        self.bytes(MAX_VALUE, ErrorCode::ValueTooLarge)
    }
    fn elem(&mut self) -> Result<Elem, EntryError> {
        Elem::from_u8(self.u8()?).ok_or((ErrorCode::BadRequest, "unknown element type"))
    }
    fn tree_node(&mut self) -> Result<TreeNode, EntryError> {
        let (lid, version, level) = (self.u64()?, self.u64()?, self.u8()?);
        let lo = self.bytes(MAX_KEY, ErrorCode::KeySize)?;
        let has_hi = self.u8()?;
        let hi = self.bytes(MAX_KEY, ErrorCode::KeySize)?;
        let hi = match has_hi {
            0 if hi.is_empty() => None,
            1 => Some(hi),
            _ => return Err((ErrorCode::BadRequest, "malformed tree node")),
        };
        Ok(TreeNode { lid, version, level, lo, hi })
    }
    fn done(&self) -> Result<(), EntryError> {
        if self.p == self.b.len() { Ok(()) } else { Err((ErrorCode::BadRequest, "trailing bytes in entry")) }
    }
}

/// Splits a complete frame into its entries (each without its length prefix).
fn entries(frame: &[u8], want_requests: bool) -> Result<Vec<&[u8]>, DecodeError> {
    let h = frame_header(frame)?.ok_or(DecodeError::Incomplete)?;
    if frame.len() < h.total {
        return Err(DecodeError::Incomplete);
    }
    if frame.len() > h.total {
        return Err(DecodeError::Malformed("bytes after the frame"));
    }
    if h.requests != want_requests {
        return Err(DecodeError::Malformed("unexpected frame kind"));
    }
    let mut out = Vec::with_capacity(h.count);
    let mut p = FRAME_HEADER;
    for _ in 0..h.count {
        let len = frame.get(p..p + 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize);
        let len = len.ok_or(DecodeError::Malformed("entry length past the frame"))?;
        let e = frame.get(p + 4..p + 4 + len).ok_or(DecodeError::Malformed("entry past the frame"))?;
        if e.len() < 8 {
            return Err(DecodeError::Malformed("entry without a request id"));
        }
        out.push(e);
        p += 4 + len;
    }
    if p != frame.len() {
        return Err(DecodeError::Malformed("frame length and entries disagree"));
    }
    Ok(out)
}

/// One decoded request entry: the request, or its id with the error to answer it with.
pub type RequestEntry = Result<Request, (u64, ErrorCode, &'static str)>;

/// Decodes a complete request frame (`frame` is exactly [`FrameHeader::total`] bytes).
pub fn decode_requests(frame: &[u8]) -> Result<Vec<RequestEntry>, DecodeError> {
    Ok(entries(frame, true)?.into_iter().map(decode_request).collect())
}

fn decode_request(e: &[u8]) -> RequestEntry {
    let id = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
    let mut r = R { b: e, p: 8 };
    let parse = |r: &mut R<'_>| -> Result<Request, EntryError> {
        let code = r.u8()?;
        let (c, flags, bound) = (r.u8()?, r.u16()?, r.u32()?);
        let consistency = match (c, bound) {
            (0, 0) => Consistency::Linearizable,
            (1, ms) => Consistency::Bounded { max_staleness_ms: ms },
            (2, 0) => Consistency::Extended,
            (3, 0) => Consistency::Interleaved,
            (0 | 2 | 3, _) => {
                return Err((ErrorCode::BadRequest, "a staleness bound with a consistency that has none"));
            }
            _ => return Err((ErrorCode::BadRequest, "unknown consistency")),
        };
        if flags & !(F_SESSION | F_RETRY | F_TRACE | F_REPLICA | F_HINT) != 0
            || (flags & F_RETRY != 0 && flags & F_SESSION == 0)
        {
            return Err((ErrorCode::BadRequest, "reserved request flags set"));
        }
        let (read_version, region, epoch) = (r.u64()?, r.u32()?, r.u64()?);
        let session = if flags & F_SESSION != 0 {
            let (client, seq, acked_below) = (r.u64()?, r.u64()?, r.u64()?);
            if client == 0 {
                return Err((ErrorCode::BadRequest, "session client id 0 is reserved"));
            }
            if seq == 0 || acked_below > seq {
                return Err((ErrorCode::BadRequest, "session seq must be >= 1 and not below acked_below"));
            }
            Some(Session { client, seq, acked_below, retry: flags & F_RETRY != 0 })
        } else {
            None
        };
        let trace = if flags & F_TRACE != 0 {
            let (mut trace_id, mut span_id) = ([0u8; 16], [0u8; 8]);
            trace_id.copy_from_slice(r.take(16)?);
            span_id.copy_from_slice(r.take(8)?);
            let t = TraceContext { trace_id, span_id, flags: r.u8()? };
            if !t.is_valid() {
                return Err((ErrorCode::BadRequest, "an all-zero trace or span id"));
            }
            Some(t)
        } else {
            None
        };
        let hint = if flags & F_HINT != 0 {
            let arena = r.u64()?;
            Some(std::sync::Arc::new(StartHint { arena, node: r.tree_node()? }))
        } else {
            None
        };
        let op = match OpCode::from_u8(code).ok_or((ErrorCode::UnknownOp, "unknown operation code"))? {
            OpCode::Get => Op::Get { key: r.key()? },
            OpCode::Delete => Op::Delete { key: r.key()? },
            OpCode::Put => Op::Put { key: r.key()?, value: r.value()? },
            OpCode::Insert => Op::Insert { key: r.key()?, value: r.value()? },
            OpCode::Update => Op::Update { key: r.key()?, value: r.value()? },
            c @ (OpCode::Scan | OpCode::FloorScan) => {
                let lo = r.bytes(MAX_KEY, ErrorCode::KeySize)?;
                let hi = r.bytes(MAX_KEY, ErrorCode::KeySize)?;
                let (limit, max_bytes) = (r.u32()?, r.u32()?);
                let token = r.bytes(MAX_TOKEN, ErrorCode::BadToken)?;
                if c == OpCode::Scan {
                    Op::Scan { lo, hi, limit, max_bytes, token }
                } else {
                    Op::FloorScan { lo, hi, limit, max_bytes, token }
                }
            }
            OpCode::FetchAdd => Op::FetchAdd { key: r.key()?, delta: r.u64()? },
            OpCode::AddText => {
                let key = r.key()?;
                let n = r.u16()? as usize;
                if n == 0 || n > MAX_ADDS {
                    return Err((ErrorCode::TooManyOps, "add_text takes 1 to 1024 increments"));
                }
                let mut deltas = Vec::with_capacity(n);
                for _ in 0..n {
                    deltas.push(r.u64()? as i64);
                }
                Op::AddText { key, deltas }
            }
            OpCode::AddTexts => {
                let n = r.u16()? as usize;
                if n == 0 || n > MAX_ADD_KEYS {
                    return Err((ErrorCode::TooManyOps, "add_texts takes 1 to 28 keys"));
                }
                let (mut adds, mut total) = (Vec::with_capacity(n), 0);
                for _ in 0..n {
                    let key = r.key()?;
                    let m = r.u16()? as usize;
                    total += m;
                    if m == 0 || total > MAX_ADDS {
                        return Err((
                            ErrorCode::TooManyOps,
                            "add_texts takes 1 to 1024 increments in all, some per key",
                        ));
                    }
                    let mut deltas = Vec::with_capacity(m);
                    for _ in 0..m {
                        deltas.push(r.u64()? as i64);
                    }
                    adds.push((key, deltas));
                }
                Op::AddTexts { adds }
            }
            OpCode::CompareAndSwap => {
                let key = r.key()?;
                let has = r.u8()?;
                let exp = r.value()?;
                let expected = match has {
                    0 if exp.is_empty() => None,
                    1 => Some(exp),
                    _ => return Err((ErrorCode::BadRequest, "malformed expected value")),
                };
                Op::CompareAndSwap { key, expected, new: r.value()? }
            }
            OpCode::VectorScalar => {
                let (key, elem) = (r.key()?, r.elem()?);
                let op = VecOp::from_u8(r.u8()?).ok_or((ErrorCode::BadRequest, "unknown vector operation"))?;
                Op::VectorScalar { key, elem, op, operand: r.arr8()? }
            }
            OpCode::VectorVector => {
                let (key, elem) = (r.key()?, r.elem()?);
                let op = VecOp::from_u8(r.u8()?).ok_or((ErrorCode::BadRequest, "unknown vector operation"))?;
                Op::VectorVector { key, elem, op, operand: r.bytes(MAX_VECTOR, ErrorCode::ValueTooLarge)? }
            }
            OpCode::Reduce => {
                let (key, elem) = (r.key()?, r.elem()?);
                let op = ReduceOp::from_u8(r.u8()?).ok_or((ErrorCode::BadRequest, "unknown reduction"))?;
                Op::Reduce { key, elem, op }
            }
            OpCode::Filter => {
                let (key, elem) = (r.key()?, r.elem()?);
                let cmp = Cmp::from_u8(r.u8()?).ok_or((ErrorCode::BadRequest, "unknown comparison"))?;
                Op::Filter { key, elem, cmp, operand: r.arr8()? }
            }
            OpCode::Batch => {
                let n = r.u16()? as usize;
                if n == 0 || n > MAX_BATCH_OPS {
                    return Err((ErrorCode::TooManyOps, "batch size outside 1..=1024"));
                }
                let mut ops = Vec::with_capacity(n);
                for _ in 0..n {
                    ops.push(match OpCode::from_u8(r.u8()?) {
                        Some(OpCode::Put) => WriteOp::Put { key: r.key()?, value: r.value()? },
                        Some(OpCode::Insert) => WriteOp::Insert { key: r.key()?, value: r.value()? },
                        Some(OpCode::Update) => WriteOp::Update { key: r.key()?, value: r.value()? },
                        Some(OpCode::Delete) => WriteOp::Delete { key: r.key()? },
                        _ => return Err((ErrorCode::UnknownOp, "a batch holds put, insert, update and delete only")),
                    });
                }
                Op::Batch { ops }
            }
            OpCode::RegionMap => Op::RegionMap,
            OpCode::Stats => Op::Stats,
            OpCode::Pivots => {
                let lo = r.bytes(MAX_KEY, ErrorCode::KeySize)?;
                let hi = r.bytes(MAX_KEY, ErrorCode::KeySize)?;
                Op::Pivots { lo, hi, max: r.u16()? }
            }
            OpCode::TreeNodes => {
                let key = r.bytes(MAX_KEY, ErrorCode::KeySize)?;
                let n = r.u16()? as usize;
                if n > MAX_EXPAND {
                    return Err((ErrorCode::TooManyOps, "more than 64 nodes to expand"));
                }
                let mut nodes = Vec::with_capacity(n);
                for _ in 0..n {
                    nodes.push(r.tree_node()?);
                }
                Op::TreeNodes { key, nodes }
            }
            OpCode::ReplicaSync => {
                let watermark_ms = r.u64()?;
                let reset = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err((ErrorCode::BadRequest, "malformed reset flag")),
                };
                let n = r.u16()? as usize;
                if n > MAX_BATCH_OPS {
                    return Err((ErrorCode::TooManyOps, "more than 1024 sync entries"));
                }
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let (key, version, has) = (r.key()?, r.u64()?, r.u8()?);
                    let v = r.value()?;
                    let value = match has {
                        0 if v.is_empty() => None,
                        1 => Some(v),
                        _ => return Err((ErrorCode::BadRequest, "malformed sync entry")),
                    };
                    entries.push(SyncEntry { key, version, value });
                }
                Op::ReplicaSync { watermark_ms, reset, entries }
            }
            OpCode::Auth => {
                let token = r.bytes(crate::limits::MAX_AUTH_TOKEN, ErrorCode::BadRequest)?;
                if token.is_empty() {
                    return Err((ErrorCode::BadRequest, "an empty token"));
                }
                Op::Auth { token }
            }
        };
        r.done()?;
        if session.is_some() && !req_is_write(&op) {
            return Err((ErrorCode::BadRequest, "an exactly-once session on a read"));
        }
        if read_version != 0 && req_is_write(&op) {
            return Err((ErrorCode::BadRequest, "a read version on a write"));
        }
        if hint.is_some() && !matches!(op, Op::Get { .. } | Op::Scan { .. }) {
            return Err((ErrorCode::BadRequest, "a start hint on something other than a get or a scan"));
        }
        let replica = flags & F_REPLICA != 0;
        if replica && (!matches!(op, Op::Get { .. }) || consistency == Consistency::Linearizable) {
            return Err((ErrorCode::BadRequest, "a replica read is a get that is not linearizable"));
        }
        let req = Request { id, consistency, read_version, region, epoch, session, trace, hint, replica, op };
        req.op.validate().map_err(|c| (c, "request outside the protocol's limits"))?;
        Ok(req)
    };
    parse(&mut r).map_err(|(code, what)| (id, code, what))
}

fn req_is_write(op: &Op) -> bool {
    op.code().is_write()
}

/// Decodes a complete response frame.
pub fn decode_responses(frame: &[u8]) -> Result<Vec<Response>, DecodeError> {
    entries(frame, false)?.into_iter().map(decode_response).collect()
}

fn decode_response(e: &[u8]) -> Result<Response, DecodeError> {
    let mut r = R { b: e, p: 0 };
    let bad = |_: EntryError| DecodeError::Malformed("malformed response entry");
    let id = r.u64().map_err(bad)?;
    let status = r.u8().map_err(bad)?;
    let replicated = r.u8().map_err(bad)? & 1 == 1;
    let kind = r.u8().map_err(bad)?;
    r.u8().map_err(bad)?;
    let version = r.u64().map_err(bad)?;
    let result = if status != 0 {
        let n = r.u16().map_err(bad)? as usize;
        let m = r.take(n.min(MAX_MESSAGE)).map_err(bad)?;
        let message = String::from_utf8_lossy(m).into_owned();
        // A code added after this decoder was written: an error all the same (not retryable).
        match ErrorCode::from_u8(status) {
            Some(code) => Err(ErrorReply { code, message }),
            None => Err(ErrorReply { code: ErrorCode::Internal, message: format!("error code {status}: {message}") }),
        }
    } else {
        Ok(match kind {
            R_DONE => Reply::Done,
            R_ABSENT => Reply::Value(None),
            R_VALUE => Reply::Value(Some(r.value().map_err(bad)?)),
            R_VECTOR => Reply::Vector(r.value().map_err(bad)?),
            R_ITEMS => {
                let n = r.u32().map_err(bad)?;
                if n > MAX_SCAN_ITEMS {
                    return Err(DecodeError::Malformed("scan reply with too many items"));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let k = r.bytes(MAX_KEY, ErrorCode::KeySize).map_err(bad)?;
                    items.push((k, r.value().map_err(bad)?));
                }
                Reply::Items { items, token: r.bytes(MAX_TOKEN, ErrorCode::BadToken).map_err(bad)? }
            }
            R_CAS => {
                let swapped = r.u8().map_err(bad)? == 1;
                let has = r.u8().map_err(bad)? == 1;
                let v = r.value().map_err(bad)?;
                Reply::Cas { swapped, current: has.then_some(v) }
            }
            R_SCALAR => Reply::Scalar(r.arr8().map_err(bad)?),
            R_REGION_MAP => {
                let b = r.bytes(MAX_FRAME, ErrorCode::BadRequest).map_err(bad)?;
                Reply::RegionMap(
                    crate::regionmap::RegionMap::decode(&b)
                        .map_err(|_| DecodeError::Malformed("invalid region map"))?,
                )
            }
            R_STATS => {
                let b = r.bytes(MAX_FRAME, ErrorCode::BadRequest).map_err(bad)?;
                Reply::Stats(
                    crate::stats::DeviceStats::decode(&b)
                        .map_err(|_| DecodeError::Malformed("invalid device statistics"))?,
                )
            }
            R_KEYS => {
                let n = r.u16().map_err(bad)?;
                if n > crate::limits::MAX_PIVOTS {
                    return Err(DecodeError::Malformed("a keys reply with too many keys"));
                }
                let mut keys = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    keys.push(r.bytes(MAX_KEY, ErrorCode::KeySize).map_err(bad)?);
                }
                Reply::Keys(keys)
            }
            R_TREE_NODES => {
                let arena = r.u64().map_err(bad)?;
                let n = r.u32().map_err(bad)? as usize;
                if n > MAX_TREE_NODES {
                    return Err(DecodeError::Malformed("a tree reply with too many nodes"));
                }
                let mut nodes = Vec::with_capacity(n);
                for _ in 0..n {
                    let parent = r.u16().map_err(bad)?;
                    nodes.push((parent, r.tree_node().map_err(bad)?));
                }
                Reply::TreeNodes { arena, nodes }
            }
            R_ADDED => {
                let n = r.u16().map_err(bad)? as usize;
                if n > MAX_ADDS {
                    return Err(DecodeError::Malformed("an add_text reply with too many results"));
                }
                let mut results = Vec::with_capacity(n);
                for _ in 0..n {
                    let ok = r.u8().map_err(bad)?;
                    let v = r.u64().map_err(bad)? as i64;
                    results.push(match ok {
                        1 => Some(v),
                        0 => None,
                        _ => return Err(DecodeError::Malformed("an add_text result that is neither")),
                    });
                }
                Reply::Added(results)
            }
            _ => return Err(DecodeError::Malformed("unknown reply kind")),
        })
    };
    r.done().map_err(bad)?;
    Ok(Response { id, version, replicated, result })
}
