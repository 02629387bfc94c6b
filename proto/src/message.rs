//! Requests, operations, responses and replies.

use crate::error::ErrorCode;
use crate::limits::*;

/// Operation codes on the wire. Stable numbers: never reuse one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpCode {
    /// [`Op::Get`]
    Get = 1,
    /// [`Op::Put`]
    Put = 2,
    /// [`Op::Insert`]
    Insert = 3,
    /// [`Op::Update`]
    Update = 4,
    /// [`Op::Delete`]
    Delete = 5,
    /// [`Op::Scan`]
    Scan = 6,
    /// [`Op::FloorScan`]
    FloorScan = 7,
    /// [`Op::FetchAdd`]
    FetchAdd = 8,
    /// [`Op::CompareAndSwap`]
    CompareAndSwap = 9,
    /// [`Op::VectorScalar`]
    VectorScalar = 10,
    /// [`Op::VectorVector`]
    VectorVector = 11,
    /// [`Op::Reduce`]
    Reduce = 12,
    /// [`Op::Filter`]
    Filter = 13,
    /// [`Op::Batch`]
    Batch = 14,
    /// [`Op::RegionMap`]
    RegionMap = 15,
    /// [`Op::Auth`]
    Auth = 16,
    /// [`Op::Pivots`]
    Pivots = 17,
    /// [`Op::ReplicaSync`]
    ReplicaSync = 18,
    /// [`Op::TreeNodes`]
    TreeNodes = 19,
    /// [`Op::AddText`]
    AddText = 20,
    /// [`Op::AddTexts`]
    AddTexts = 21,
    /// [`Op::Stats`]
    Stats = 22,
}

impl OpCode {
    /// The code for byte `b`, if known.
    pub fn from_u8(b: u8) -> Option<OpCode> {
        use OpCode::*;
        Some(match b {
            1 => Get,
            2 => Put,
            3 => Insert,
            4 => Update,
            5 => Delete,
            6 => Scan,
            7 => FloorScan,
            8 => FetchAdd,
            9 => CompareAndSwap,
            10 => VectorScalar,
            11 => VectorVector,
            12 => Reduce,
            13 => Filter,
            14 => Batch,
            15 => RegionMap,
            16 => Auth,
            17 => Pivots,
            18 => ReplicaSync,
            19 => TreeNodes,
            20 => AddText,
            21 => AddTexts,
            22 => Stats,
            _ => return None,
        })
    }

    /// The operation's stable name (as in docs/protocol.md; metrics label by it).
    pub fn name(self) -> &'static str {
        use OpCode::*;
        match self {
            Get => "get",
            Put => "put",
            Insert => "insert",
            Update => "update",
            Delete => "delete",
            Scan => "scan",
            FloorScan => "floor_scan",
            FetchAdd => "fetch_add",
            CompareAndSwap => "compare_and_swap",
            VectorScalar => "vector_scalar",
            VectorVector => "vector_vector",
            Reduce => "reduce",
            Filter => "filter",
            Batch => "batch",
            RegionMap => "region_map",
            Auth => "auth",
            Pivots => "pivots",
            ReplicaSync => "replica_sync",
            TreeNodes => "tree_nodes",
            AddText => "add_text",
            AddTexts => "add_texts",
            Stats => "stats",
        }
    }

    /// Whether the operation changes data (it goes to the host's write pipeline).
    pub fn is_write(self) -> bool {
        !matches!(
            self,
            OpCode::Get
                | OpCode::Scan
                | OpCode::FloorScan
                | OpCode::Reduce
                | OpCode::Filter
                | OpCode::RegionMap
                | OpCode::Stats
                | OpCode::Auth
                | OpCode::Pivots
                | OpCode::ReplicaSync
                | OpCode::TreeNodes
        )
    }
}

/// Which replica may answer a read (hKVS access modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Consistency {
    /// The primary only (default).
    #[default]
    Linearizable,
    /// A replica no staler than `max_staleness_ms` may answer.
    Bounded {
        /// Bound in milliseconds.
        max_staleness_ms: u32,
    },
    /// Replicas when the primary is busy.
    Extended,
    /// Spread over primary and replicas.
    Interleaved,
}

impl Consistency {
    /// Parses `linearizable`, `bounded:MS`, `extended` or `interleaved` (the CLI's, the
    /// bench's and the gateway's spelling).
    pub fn parse(s: &str) -> Option<Consistency> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "linearizable" => Consistency::Linearizable,
            "extended" => Consistency::Extended,
            "interleaved" => Consistency::Interleaved,
            other => {
                let ms = other.strip_prefix("bounded:")?.parse().ok()?;
                Consistency::Bounded { max_staleness_ms: ms }
            }
        })
    }

    /// What [`Consistency::parse`] accepts (for error messages).
    pub const SPELLINGS: &'static str = "linearizable, bounded:MS, extended or interleaved";

    /// The spelling [`Consistency::parse`] reads.
    pub fn name(&self) -> String {
        match self {
            Consistency::Linearizable => "linearizable".into(),
            Consistency::Bounded { max_staleness_ms } => format!("bounded:{max_staleness_ms}"),
            Consistency::Extended => "extended".into(),
            Consistency::Interleaved => "interleaved".into(),
        }
    }
}

impl std::str::FromStr for Consistency {
    type Err = String;

    /// [`Consistency::parse`], refusing with a message (what command-line parsers show).
    fn from_str(s: &str) -> Result<Consistency, String> {
        Consistency::parse(s).ok_or_else(|| format!("{s:?}: expected {}", Consistency::SPELLINGS))
    }
}

/// One key of a [`Op::ReplicaSync`]: its value at `version`, or (None) the key's copy is to be
/// dropped (the key stopped being popular, or was deleted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncEntry {
    /// The key.
    pub key: Vec<u8>,
    /// The version the value was read at (the primary's).
    pub version: u64,
    /// The value; None: drop the copy.
    pub value: Option<Vec<u8>>,
}

/// A node of the top of a region's tree (its active arena), as a fat root caches it
/// (Fat-B+Tree; docs/hot-keys.md §9): id, version, level (0: a leaf) and fences `[lo, hi)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeNode {
    /// The node id.
    pub lid: u64,
    /// Its version.
    pub version: u64,
    /// Its level (0: a leaf).
    pub level: u8,
    /// Lower fence (inclusive).
    pub lo: Vec<u8>,
    /// Upper fence (exclusive; None: unbounded).
    pub hi: Option<Vec<u8>>,
}

impl TreeNode {
    /// An upper bound on the bytes the node takes encoded: its fences, and 32 for the id,
    /// version, level and length prefixes (and a reply's parent index).
    pub fn size_hint(&self) -> usize {
        self.lo.len() + self.hi.as_ref().map_or(0, Vec::len) + 32
    }
}

/// Where a get may start instead of the root: a node of the region's tree (a [`TreeNode`] of the
/// arena whose nonce is `arena`). The device uses it only if it is still valid for the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartHint {
    /// The arena's nonce (from the `tree_nodes` reply).
    pub arena: u64,
    /// The node.
    pub node: TreeNode,
}

/// The element type of a value read as an array of fixed-width numbers (atomics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Elem {
    /// u32, little-endian.
    U32 = 1,
    /// u64, little-endian.
    U64 = 2,
    /// i64, little-endian.
    I64 = 3,
    /// f64, little-endian IEEE 754.
    F64 = 4,
}

impl Elem {
    /// Bytes per element.
    pub fn width(self) -> usize {
        if self == Elem::U32 { 4 } else { 8 }
    }
    pub(crate) fn from_u8(b: u8) -> Option<Elem> {
        Some(match b {
            1 => Elem::U32,
            2 => Elem::U64,
            3 => Elem::I64,
            4 => Elem::F64,
            _ => return None,
        })
    }
}

/// Element-wise update of a vector value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum VecOp {
    /// element + operand (wrapping for integers)
    Add = 1,
    /// element - operand (wrapping for integers)
    Sub = 2,
    /// element * operand (wrapping for integers)
    Mul = 3,
    /// min(element, operand)
    Min = 4,
    /// max(element, operand)
    Max = 5,
    /// operand
    Set = 6,
}

impl VecOp {
    pub(crate) fn from_u8(b: u8) -> Option<VecOp> {
        use VecOp::*;
        Some(match b {
            1 => Add,
            2 => Sub,
            3 => Mul,
            4 => Min,
            5 => Max,
            6 => Set,
            _ => return None,
        })
    }
}

/// A reduction over a vector value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum = 1,
    /// Minimum.
    Min = 2,
    /// Maximum.
    Max = 3,
}

impl ReduceOp {
    pub(crate) fn from_u8(b: u8) -> Option<ReduceOp> {
        Some(match b {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Min,
            3 => ReduceOp::Max,
            _ => return None,
        })
    }
}

/// A comparison for [`Op::Filter`] (element `cmp` operand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Cmp {
    /// <
    Lt = 1,
    /// <=
    Le = 2,
    /// ==
    Eq = 3,
    /// !=
    Ne = 4,
    /// >=
    Ge = 5,
    /// >
    Gt = 6,
}

impl Cmp {
    pub(crate) fn from_u8(b: u8) -> Option<Cmp> {
        use Cmp::*;
        Some(match b {
            1 => Lt,
            2 => Le,
            3 => Eq,
            4 => Ne,
            5 => Ge,
            6 => Gt,
            _ => return None,
        })
    }
}

/// One write of an atomic batch.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum WriteOp {
    /// Upsert.
    Put { key: Vec<u8>, value: Vec<u8> },
    /// Insert (the batch fails if present).
    Insert { key: Vec<u8>, value: Vec<u8> },
    /// Update (the batch fails if absent).
    Update { key: Vec<u8>, value: Vec<u8> },
    /// Delete.
    Delete { key: Vec<u8> },
}

impl WriteOp {
    /// The key.
    pub fn key(&self) -> &[u8] {
        match self {
            WriteOp::Put { key, .. }
            | WriteOp::Insert { key, .. }
            | WriteOp::Update { key, .. }
            | WriteOp::Delete { key } => key,
        }
    }
}

/// One key of an [`Op::AddTexts`] and its deltas.
pub type KeyDeltas = (Vec<u8>, Vec<i64>);

/// An operation.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Op {
    /// The value of `key`.
    Get { key: Vec<u8> },
    /// Upsert.
    Put { key: Vec<u8>, value: Vec<u8> },
    /// Insert; `KeyExists` if present.
    Insert { key: Vec<u8>, value: Vec<u8> },
    /// Update; `KeyNotFound` if absent.
    Update { key: Vec<u8>, value: Vec<u8> },
    /// Delete.
    Delete { key: Vec<u8> },
    /// Items with keys in `[lo, hi]` ascending: at most `limit` items and `max_bytes` bytes
    /// (0 = the protocol maximum); continue with the reply's token.
    Scan { lo: Vec<u8>, hi: Vec<u8>, limit: u32, max_bytes: u32, token: Vec<u8> },
    /// Like `Scan` but starting at the largest key `<= lo` (Honeycomb's SCAN).
    FloorScan { lo: Vec<u8>, hi: Vec<u8>, limit: u32, max_bytes: u32, token: Vec<u8> },
    /// Adds `delta` to the value read as a little-endian u64 (absent = 0); replies with the old
    /// value.
    FetchAdd { key: Vec<u8>, delta: u64 },
    /// Replaces the value with `new` if it equals `expected` (None = absent); replies whether it
    /// did and the value it found.
    CompareAndSwap { key: Vec<u8>, expected: Option<Vec<u8>>, new: Vec<u8> },
    /// Updates every element with `op` and the scalar `operand` (8 bytes, read as `elem`).
    VectorScalar { key: Vec<u8>, elem: Elem, op: VecOp, operand: [u8; 8] },
    /// Updates element i with `op` and element i of `operand` (same length as the value).
    VectorVector { key: Vec<u8>, elem: Elem, op: VecOp, operand: Vec<u8> },
    /// Reduces the elements with `op`; replies with the scalar.
    Reduce { key: Vec<u8>, elem: Elem, op: ReduceOp },
    /// Replies with the elements for which `element cmp operand` holds.
    Filter { key: Vec<u8>, elem: Elem, cmp: Cmp, operand: [u8; 8] },
    /// Adds each of `deltas` in turn to the value read as a decimal signed 64-bit integer in
    /// text, as Redis keeps counters (absent = 0; `TypeMismatch` if it is not one), and stores
    /// the result as text: Redis's `INCRBY` for a run of increments of one key, applied in order
    /// and made durable together. Replies [`Reply::Added`]: each increment's result, or none
    /// for one that would overflow (it has no effect; the next starts from the value before it).
    AddText { key: Vec<u8>, deltas: Vec<i64> },
    /// [`Op::AddText`] for several keys of one region at once (a pipeline's `INCR`s of distinct
    /// keys): each key's run applied in order as `add_text` would, all of them atomically under
    /// one version and made durable together; `TypeMismatch` (nothing applied) if any value is
    /// not a counter. Replies [`Reply::Added`]: every increment's result, key after key.
    AddTexts { adds: Vec<KeyDeltas> },
    /// Writes applied atomically under one version.
    Batch { ops: Vec<WriteOp> },
    /// The cluster's region map as the node knows it (nodes, regions, primaries, epochs): how
    /// clients route without access to the metadata store.
    RegionMap,
    /// The device's statistics (its counters, and per region it leads the gets served and the
    /// most read popular keys): replies [`Reply::Stats`]. For the cluster's own roles and
    /// administrators (the console's source).
    Stats,
    /// Presents a bearer token for the connection (a gateway with tokens configured checks it;
    /// its later requests run with the token's permissions). Devices accept any token.
    Auth { token: Vec<u8> },
    /// Up to `max` keys inside `(lo, hi)` (an empty `hi`: unbounded), within the region of `lo`,
    /// that cut the range into parts holding similar shares of the region's data: where a long
    /// scan can be split to be read in parallel. From the region's index (interior nodes): an
    /// estimate, fewer or none in a small region.
    Pivots { lo: Vec<u8>, hi: Vec<u8>, max: u16 },
    /// Device to device (hot-key replicas, docs/hot-keys.md): the primary of the request's
    /// `region` (at its `epoch`) updates the copies of its popular keys on this device. `reset`:
    /// drop every copy of the region first (a new link starts with the whole popular set). Then
    /// `watermark_ms` (if not 0): every write to the region acknowledged before that time (the
    /// primary's clock, ms since the Unix epoch) is reflected in the copies sent so far.
    ReplicaSync { watermark_ms: u64, reset: bool, entries: Vec<SyncEntry> },
    /// The top of the tree of the region holding `key` (its active arena), for a fat root: the
    /// children of each of `nodes` that is still current (at most [`MAX_EXPAND`] nodes), or with
    /// no `nodes` the root itself. Replies [`Reply::TreeNodes`].
    TreeNodes { key: Vec<u8>, nodes: Vec<TreeNode> },
}

impl Op {
    /// The operation's code.
    pub fn code(&self) -> OpCode {
        match self {
            Op::Get { .. } => OpCode::Get,
            Op::Put { .. } => OpCode::Put,
            Op::Insert { .. } => OpCode::Insert,
            Op::Update { .. } => OpCode::Update,
            Op::Delete { .. } => OpCode::Delete,
            Op::Scan { .. } => OpCode::Scan,
            Op::FloorScan { .. } => OpCode::FloorScan,
            Op::FetchAdd { .. } => OpCode::FetchAdd,
            Op::CompareAndSwap { .. } => OpCode::CompareAndSwap,
            Op::VectorScalar { .. } => OpCode::VectorScalar,
            Op::VectorVector { .. } => OpCode::VectorVector,
            Op::Reduce { .. } => OpCode::Reduce,
            Op::Filter { .. } => OpCode::Filter,
            Op::Batch { .. } => OpCode::Batch,
            Op::RegionMap => OpCode::RegionMap,
            Op::Stats => OpCode::Stats,
            Op::Auth { .. } => OpCode::Auth,
            Op::Pivots { .. } => OpCode::Pivots,
            Op::ReplicaSync { .. } => OpCode::ReplicaSync,
            Op::TreeNodes { .. } => OpCode::TreeNodes,
            Op::AddText { .. } => OpCode::AddText,
            Op::AddTexts { .. } => OpCode::AddTexts,
        }
    }

    /// The key the operation addresses (a scan's lower bound; a batch's first key).
    pub fn key(&self) -> &[u8] {
        match self {
            Op::Get { key }
            | Op::Put { key, .. }
            | Op::Insert { key, .. }
            | Op::Update { key, .. }
            | Op::Delete { key }
            | Op::FetchAdd { key, .. }
            | Op::CompareAndSwap { key, .. }
            | Op::VectorScalar { key, .. }
            | Op::VectorVector { key, .. }
            | Op::Reduce { key, .. }
            | Op::Filter { key, .. }
            | Op::AddText { key, .. } => key,
            Op::Scan { lo, .. } | Op::FloorScan { lo, .. } | Op::Pivots { lo, .. } => lo,
            Op::TreeNodes { key, .. } => key,
            Op::Batch { ops } => ops.first().map_or(&[], |o| o.key()),
            Op::AddTexts { adds } => adds.first().map_or(&[], |(k, _)| k),
            Op::RegionMap | Op::Stats | Op::Auth { .. } | Op::ReplicaSync { .. } => &[],
        }
    }

    /// Every key the operation addresses: a batch's and an `add_texts`' keys, the one key of any
    /// other operation on keys (a scan's lower bound), none of a request about no key.
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let (one, batch, adds): (Option<&[u8]>, &[WriteOp], &[KeyDeltas]) = match self {
            Op::Batch { ops } => (None, ops, &[]),
            Op::AddTexts { adds } => (None, &[], adds),
            Op::RegionMap | Op::Stats | Op::Auth { .. } | Op::ReplicaSync { .. } => (None, &[], &[]),
            op => (Some(op.key()), &[], &[]),
        };
        one.into_iter().chain(batch.iter().map(WriteOp::key)).chain(adds.iter().map(|(k, _)| k.as_slice()))
    }

    /// Checks the limits; the error a server would answer with.
    pub fn validate(&self) -> Result<(), ErrorCode> {
        let key = |k: &[u8]| if k.is_empty() || k.len() > MAX_KEY { Err(ErrorCode::KeySize) } else { Ok(()) };
        let value = |v: &[u8]| if v.len() > MAX_VALUE { Err(ErrorCode::ValueTooLarge) } else { Ok(()) };
        match self {
            Op::Get { key: k }
            | Op::Delete { key: k }
            | Op::FetchAdd { key: k, .. }
            | Op::Reduce { key: k, .. }
            | Op::Filter { key: k, .. } => key(k),
            Op::VectorScalar { key: k, .. } => key(k),
            Op::AddText { key: k, deltas } => {
                key(k)?;
                if deltas.is_empty() || deltas.len() > MAX_ADDS {
                    return Err(ErrorCode::TooManyOps);
                }
                Ok(())
            }
            Op::AddTexts { adds } => {
                if adds.is_empty() || adds.len() > MAX_ADD_KEYS {
                    return Err(ErrorCode::TooManyOps);
                }
                let mut total = 0;
                for (k, deltas) in adds {
                    key(k)?;
                    if deltas.is_empty() {
                        return Err(ErrorCode::TooManyOps);
                    }
                    total += deltas.len();
                }
                if total > MAX_ADDS {
                    return Err(ErrorCode::TooManyOps);
                }
                Ok(())
            }
            Op::Put { key: k, value: v } | Op::Insert { key: k, value: v } | Op::Update { key: k, value: v } => {
                key(k)?;
                value(v)
            }
            Op::VectorVector { key: k, operand, .. } => {
                key(k)?;
                value(operand)
            }
            Op::CompareAndSwap { key: k, expected, new } => {
                key(k)?;
                value(new)?;
                expected.as_deref().map_or(Ok(()), value)
            }
            Op::Scan { lo, hi, limit, max_bytes, token } | Op::FloorScan { lo, hi, limit, max_bytes, token } => {
                if lo.len() > MAX_KEY || hi.len() > MAX_KEY {
                    return Err(ErrorCode::KeySize);
                }
                if *limit > MAX_SCAN_ITEMS || *max_bytes > MAX_SCAN_BYTES {
                    return Err(ErrorCode::TooManyOps);
                }
                if token.len() > MAX_TOKEN {
                    return Err(ErrorCode::BadToken);
                }
                Ok(())
            }
            Op::RegionMap | Op::Stats => Ok(()),
            Op::Pivots { lo, hi, max } => {
                if lo.len() > MAX_KEY || hi.len() > MAX_KEY {
                    return Err(ErrorCode::KeySize);
                }
                if *max > crate::limits::MAX_PIVOTS {
                    return Err(ErrorCode::TooManyOps);
                }
                Ok(())
            }
            Op::Auth { token } => {
                if token.is_empty() || token.len() > crate::limits::MAX_AUTH_TOKEN {
                    return Err(ErrorCode::BadRequest);
                }
                Ok(())
            }
            Op::TreeNodes { key, nodes } => {
                if key.len() > MAX_KEY
                    || nodes.iter().any(|n| n.lo.len() > MAX_KEY || n.hi.as_ref().is_some_and(|h| h.len() > MAX_KEY))
                {
                    return Err(ErrorCode::KeySize);
                }
                if nodes.len() > MAX_EXPAND {
                    return Err(ErrorCode::TooManyOps);
                }
                Ok(())
            }
            Op::ReplicaSync { entries, .. } => {
                if entries.len() > MAX_BATCH_OPS {
                    return Err(ErrorCode::TooManyOps);
                }
                for e in entries {
                    key(&e.key)?;
                    e.value.as_deref().map_or(Ok(()), value)?;
                }
                Ok(())
            }
            Op::Batch { ops } => {
                if ops.is_empty() || ops.len() > MAX_BATCH_OPS {
                    return Err(ErrorCode::TooManyOps);
                }
                for o in ops {
                    key(o.key())?;
                    if let WriteOp::Put { value: v, .. }
                    | WriteOp::Insert { value: v, .. }
                    | WriteOp::Update { value: v, .. } = o
                    {
                        value(v)?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// A write's exactly-once tag: the client's session and the write's place in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    /// The client's id (random, chosen by the client library).
    pub client: u64,
    /// The write's sequence number in the client's session (from 1).
    pub seq: u64,
    /// Every seq below this got its reply: the server may forget them.
    pub acked_below: u64,
    /// Not the first attempt: the write may have been applied before.
    pub retry: bool,
}

/// A W3C trace context (www.w3.org/TR/trace-context): the trace a request belongs to and the
/// span that sent it, so a server's spans join the caller's trace (docs/protocol.md §4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The trace (not all zero).
    pub trace_id: [u8; 16],
    /// The calling span (not all zero).
    pub span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceContext {
    /// Whether the caller records this trace (the sampled flag).
    pub fn sampled(&self) -> bool {
        self.flags & 1 != 0
    }

    /// Parses a `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`); None if it is not one
    /// (as the W3C specification asks, an invalid header is ignored, not refused).
    pub fn from_traceparent(header: &str) -> Option<TraceContext> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        // Version 00 has exactly four fields; later versions may add more after these.
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let hex = |s: &str, out: &mut [u8]| -> Option<()> {
            if s.len() != out.len() * 2 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                return None;
            }
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
            }
            Some(())
        };
        let (mut trace_id, mut span_id, mut f) = ([0u8; 16], [0u8; 8], [0u8; 1]);
        hex(version, &mut [0u8; 1])?;
        hex(trace, &mut trace_id)?;
        hex(span, &mut span_id)?;
        hex(flags, &mut f)?;
        let ctx = TraceContext { trace_id, span_id, flags: f[0] };
        ctx.is_valid().then_some(ctx)
    }

    /// The `traceparent` header for this context.
    pub fn traceparent(&self) -> String {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        format!("00-{}-{}-{:02x}", hex(&self.trace_id), hex(&self.span_id), self.flags)
    }

    /// Neither id is all zero (what the specification calls invalid).
    pub fn is_valid(&self) -> bool {
        self.trace_id != [0; 16] && self.span_id != [0; 8]
    }
}

/// A request: an operation with its id and read options.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Chosen by the client; echoed in the response. Unique among the connection's requests in
    /// flight.
    pub id: u64,
    /// Which replica may answer a read.
    pub consistency: Consistency,
    /// Read at this version (0 = the latest).
    pub read_version: u64,
    /// The region the client believes holds the key (0 = let the node decide).
    pub region: u32,
    /// The region epoch the client knows (0 = unchecked).
    pub epoch: u64,
    /// A write's exactly-once tag (None: the write is not retried safely).
    pub session: Option<Session>,
    /// The trace the request belongs to, if the caller traces it.
    pub trace: Option<TraceContext>,
    /// Where a get (or a scan, from its `lo`) may start in the region's tree (a fat root's start
    /// hint), if the sender knows. Only on a get or a scan. Shared: a client hands out the same
    /// cached hint to every get that falls in its node (no copy of the fences per request).
    pub hint: Option<std::sync::Arc<StartHint>>,
    /// A get aimed at a hot-key replica (a device that is not the key's primary): answered from
    /// the device's replica table within the consistency's bound, else `not_replicated`. Only on
    /// a get whose consistency is not linearizable.
    pub replica: bool,
    /// The operation.
    pub op: Op,
}

impl Request {
    /// A request with default options.
    pub fn new(id: u64, op: Op) -> Request {
        Request {
            id,
            consistency: Consistency::Linearizable,
            read_version: 0,
            region: 0,
            epoch: 0,
            session: None,
            trace: None,
            hint: None,
            replica: false,
            op,
        }
    }

    /// An upper bound on the bytes the request takes encoded (its variable-length fields plus a
    /// fixed allowance for the entry header, session block and length prefixes), for budgets.
    pub fn size_hint(&self) -> usize {
        // Entry length and header (36 bytes), the session block (24), the trace block (25),
        // length prefixes and fixed fields of any operation (at most 24 more).
        const OVERHEAD: usize = 128;
        const PER_BATCH_OP: usize = 16;
        OVERHEAD
            + self.hint.as_ref().map_or(0, |h| h.node.size_hint() + 8)
            + match &self.op {
                Op::Put { key, value } | Op::Insert { key, value } | Op::Update { key, value } => {
                    key.len() + value.len()
                }
                Op::CompareAndSwap { key, expected, new } => {
                    key.len() + new.len() + expected.as_ref().map_or(0, Vec::len)
                }
                Op::VectorVector { key, operand, .. } => key.len() + operand.len(),
                Op::Batch { ops } => ops
                    .iter()
                    .map(|o| match o {
                        WriteOp::Put { key, value }
                        | WriteOp::Insert { key, value }
                        | WriteOp::Update { key, value } => key.len() + value.len() + PER_BATCH_OP,
                        WriteOp::Delete { key } => key.len() + PER_BATCH_OP,
                    })
                    .sum(),
                Op::Scan { lo, hi, token, .. } | Op::FloorScan { lo, hi, token, .. } => {
                    lo.len() + hi.len() + token.len()
                }
                Op::Pivots { lo, hi, .. } => lo.len() + hi.len(),
                Op::Auth { token } => token.len(),
                Op::AddText { key, deltas } => key.len() + 8 * deltas.len(),
                Op::AddTexts { adds } => adds.iter().map(|(k, d)| k.len() + 8 * d.len() + PER_BATCH_OP).sum(),
                Op::TreeNodes { key, nodes } => key.len() + nodes.iter().map(TreeNode::size_hint).sum::<usize>(),
                Op::ReplicaSync { entries, .. } => {
                    entries.iter().map(|e| e.key.len() + e.value.as_ref().map_or(0, Vec::len) + PER_BATCH_OP).sum()
                }
                op => op.key().len(),
            }
    }
}

/// A successful reply.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Reply {
    /// A write or delete was applied.
    Done,
    /// A get: the value, or None when absent.
    Value(Option<Vec<u8>>),
    /// A scan page, and the token to continue with (empty when the range is done).
    Items { items: Vec<(Vec<u8>, Vec<u8>)>, token: Vec<u8> },
    /// Compare-and-swap: whether it swapped, and the value it found.
    Cas { swapped: bool, current: Option<Vec<u8>> },
    /// A scalar: fetch-add's old value, a reduction's result (8 bytes, read as the element type).
    Scalar([u8; 8]),
    /// A vector: a filter's matching elements.
    Vector(Vec<u8>),
    /// The region map (validated when decoded).
    RegionMap(crate::regionmap::RegionMap),
    /// [`Op::Stats`]'s answer.
    Stats(crate::stats::DeviceStats),
    /// Keys: `pivots`' answer, ascending.
    Keys(Vec<Vec<u8>>),
    /// `tree_nodes`' answer: the arena's nonce, and each node with the index of its parent among
    /// the nodes asked about.
    TreeNodes { arena: u64, nodes: Vec<(u16, TreeNode)> },
    /// `add_text`'s answer: each increment's result in order, none for one that would overflow.
    Added(Vec<Option<i64>>),
}

/// A failed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    /// What went wrong.
    pub code: ErrorCode,
    /// A human-readable explanation (never echoes user keys or values in full).
    pub message: String,
}

/// A response to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// The version of the value read or written (0 if none).
    pub version: u64,
    /// The key is replicated on other nodes' devices (hot-key replicas).
    pub replicated: bool,
    /// The outcome.
    pub result: Result<Reply, ErrorReply>,
}

impl Response {
    /// An error response.
    pub fn error(id: u64, code: ErrorCode, message: impl Into<String>) -> Response {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Response { id, version: 0, replicated: false, result: Err(ErrorReply { code, message }) }
    }
}
