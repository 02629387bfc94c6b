//! Protocol v1 codec: round trips, limits, malformed input.

use dpukv_proto::*;
use proptest::prelude::*;

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..=max)
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 1..=64)
}

fn elem() -> impl Strategy<Value = Elem> {
    prop_oneof![Just(Elem::U32), Just(Elem::U64), Just(Elem::I64), Just(Elem::F64)]
}

fn vec_op() -> impl Strategy<Value = VecOp> {
    prop_oneof![
        Just(VecOp::Add),
        Just(VecOp::Sub),
        Just(VecOp::Mul),
        Just(VecOp::Min),
        Just(VecOp::Max),
        Just(VecOp::Set)
    ]
}

fn write_op() -> impl Strategy<Value = WriteOp> {
    prop_oneof![
        (key(), bytes(40)).prop_map(|(key, value)| WriteOp::Put { key, value }),
        (key(), bytes(40)).prop_map(|(key, value)| WriteOp::Insert { key, value }),
        (key(), bytes(40)).prop_map(|(key, value)| WriteOp::Update { key, value }),
        key().prop_map(|key| WriteOp::Delete { key }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        key().prop_map(|key| Op::Get { key }),
        (key(), bytes(300)).prop_map(|(key, value)| Op::Put { key, value }),
        (key(), bytes(30)).prop_map(|(key, value)| Op::Insert { key, value }),
        (key(), bytes(30)).prop_map(|(key, value)| Op::Update { key, value }),
        key().prop_map(|key| Op::Delete { key }),
        (bytes(20), bytes(20), 0u32..=10_000, 0u32..=(4 << 20), bytes(30))
            .prop_map(|(lo, hi, limit, max_bytes, token)| Op::Scan { lo, hi, limit, max_bytes, token }),
        (bytes(20), bytes(20), 0u32..=10_000, 0u32..=(4 << 20), bytes(30))
            .prop_map(|(lo, hi, limit, max_bytes, token)| Op::FloorScan { lo, hi, limit, max_bytes, token }),
        (key(), any::<u64>()).prop_map(|(key, delta)| Op::FetchAdd { key, delta }),
        (key(), proptest::option::of(bytes(20)), bytes(20)).prop_map(|(key, expected, new)| Op::CompareAndSwap {
            key,
            expected,
            new
        }),
        (key(), elem(), vec_op(), any::<[u8; 8]>()).prop_map(|(key, elem, op, operand)| Op::VectorScalar {
            key,
            elem,
            op,
            operand
        }),
        (key(), elem(), vec_op(), bytes(64)).prop_map(|(key, elem, op, operand)| Op::VectorVector {
            key,
            elem,
            op,
            operand
        }),
        (key(), elem(), prop_oneof![Just(ReduceOp::Sum), Just(ReduceOp::Min), Just(ReduceOp::Max)])
            .prop_map(|(key, elem, op)| Op::Reduce { key, elem, op }),
        (
            key(),
            elem(),
            prop_oneof![Just(Cmp::Lt), Just(Cmp::Le), Just(Cmp::Eq), Just(Cmp::Ne), Just(Cmp::Ge), Just(Cmp::Gt)],
            any::<[u8; 8]>()
        )
            .prop_map(|(key, elem, cmp, operand)| Op::Filter { key, elem, cmp, operand }),
        proptest::collection::vec(write_op(), 1..8).prop_map(|ops| Op::Batch { ops }),
        Just(Op::RegionMap),
        Just(Op::Stats),
        proptest::collection::vec(any::<u8>(), 1..=256).prop_map(|token| Op::Auth { token }),
        (
            any::<u64>(),
            any::<bool>(),
            proptest::collection::vec((key(), any::<u64>(), proptest::option::of(bytes(40))), 0..6)
        )
            .prop_map(|(watermark_ms, reset, e)| Op::ReplicaSync {
                watermark_ms,
                reset,
                entries: e.into_iter().map(|(key, version, value)| SyncEntry { key, version, value }).collect(),
            }),
        (bytes(20), proptest::collection::vec(tree_node(), 0..5)).prop_map(|(key, nodes)| Op::TreeNodes { key, nodes }),
        (key(), proptest::collection::vec(any::<i64>(), 1..20)).prop_map(|(key, deltas)| Op::AddText { key, deltas }),
        proptest::collection::vec((key(), proptest::collection::vec(any::<i64>(), 1..5)), 1..6)
            .prop_map(|adds| Op::AddTexts { adds }),
    ]
}

fn tree_node() -> impl Strategy<Value = TreeNode> {
    (any::<u64>(), any::<u64>(), any::<u8>(), bytes(20), proptest::option::of(bytes(20)))
        .prop_map(|(lid, version, level, lo, hi)| TreeNode { lid, version, level, lo, hi })
}

/// A valid region map: regions split at sorted keys, led by nodes 1..=3.
fn region_map() -> impl Strategy<Value = dpukv_proto::regionmap::RegionMap> {
    use dpukv_proto::regionmap::{NodeInfo, RegionInfo, RegionMap, RegionState};
    (proptest::collection::btree_set(key(), 0..5), any::<u64>(), 0u32..4).prop_map(|(splits, revision, master)| {
        let mut starts = vec![Vec::new()];
        starts.extend(splits);
        let regions = (0..starts.len())
            .map(|i| RegionInfo {
                id: i as u32 + 1,
                start: starts[i].clone(),
                end: starts.get(i + 1).cloned(),
                primary: i as u32 % 3 + 1,
                backups: vec![(i as u32 + 1) % 3 + 1],
                joining: vec![],
                epoch: i as u64 + 1,
                state: RegionState::Serving,
            })
            .collect();
        let nodes = (1..=3)
            .map(|id| NodeInfo {
                id,
                device: format!("127.0.0.1:{id}"),
                replication: String::new(),
                admin: String::new(),
                zone: String::new(),
                fabric: if id == 2 { format!("fabric://tcp/127.0.0.1:{id}") } else { String::new() },
            })
            .collect();
        RegionMap { revision, master, regions, nodes }
    })
}

fn request() -> impl Strategy<Value = Request> {
    let consistency = prop_oneof![
        Just(Consistency::Linearizable),
        any::<u32>().prop_map(|ms| Consistency::Bounded { max_staleness_ms: ms }),
        Just(Consistency::Extended),
        Just(Consistency::Interleaved),
    ];
    let session = proptest::option::of(
        (1u64..u64::MAX, 1u64..u64::MAX, any::<bool>()).prop_map(|(client, seq, retry)| Session {
            client,
            seq,
            acked_below: seq / 2,
            retry,
        }),
    );
    let trace = proptest::option::of((any::<[u8; 16]>(), any::<[u8; 8]>(), any::<u8>()).prop_map(
        |(mut trace_id, mut span_id, flags)| {
            trace_id[0] |= 1;
            span_id[7] |= 1;
            TraceContext { trace_id, span_id, flags }
        },
    ));
    let hint = proptest::option::of((any::<u64>(), tree_node()));
    (any::<u64>(), consistency, any::<u64>(), any::<u32>(), any::<u64>(), (session, trace, any::<bool>(), hint), op())
        .prop_map(|(id, consistency, read_version, region, epoch, (session, trace, replica, hint), op)| Request {
            trace,
            // Only a get or a scan carries a start hint.
            hint: hint
                .filter(|_| matches!(op, Op::Get { .. } | Op::Scan { .. }))
                .map(|(arena, node)| std::sync::Arc::new(StartHint { arena, node })),
            // Only a get that is not linearizable may be aimed at a replica.
            replica: replica && matches!(op, Op::Get { .. }) && consistency != Consistency::Linearizable,
            id,
            consistency,
            // Read versions and sessions go with reads and writes respectively.
            read_version: if op.code().is_write() { 0 } else { read_version },
            region,
            epoch,
            session: session.filter(|_| op.code().is_write()),
            op,
        })
}

fn response() -> impl Strategy<Value = Response> {
    let reply = prop_oneof![
        Just(Reply::Done),
        proptest::option::of(bytes(100)).prop_map(Reply::Value),
        (proptest::collection::vec((key(), bytes(30)), 0..10), bytes(30))
            .prop_map(|(items, token)| Reply::Items { items, token }),
        (any::<bool>(), proptest::option::of(bytes(20))).prop_map(|(swapped, current)| Reply::Cas { swapped, current }),
        any::<[u8; 8]>().prop_map(Reply::Scalar),
        bytes(64).prop_map(Reply::Vector),
        region_map().prop_map(Reply::RegionMap),
        (any::<u64>(), proptest::collection::vec((any::<u16>(), tree_node()), 0..6))
            .prop_map(|(arena, nodes)| Reply::TreeNodes { arena, nodes }),
        proptest::collection::vec(proptest::option::of(any::<i64>()), 0..20).prop_map(Reply::Added),
        (proptest::collection::vec(("[a-z_]{1,20}", any::<u64>()), 0..6), any::<u32>(), any::<u64>(), bytes(20))
            .prop_map(|(counters, region, gets, k)| Reply::Stats(dpukv_proto::stats::DeviceStats {
                counters,
                regions: vec![dpukv_proto::stats::RegionStats {
                    region,
                    gets,
                    capacity: 8,
                    popular: 1,
                    distinct: 4,
                    top: vec![(k, 3)]
                }],
            })),
    ];
    let code = (1u8..=20).prop_map(|b| ErrorCode::from_u8(b).expect("known code"));
    let result = prop_oneof![
        3 => reply.prop_map(Ok),
        1 => (code, "[a-z ]{0,40}").prop_map(|(code, message)| Err(ErrorReply { code, message })),
    ];
    (any::<u64>(), any::<u64>(), any::<bool>(), result).prop_map(|(id, version, replicated, result)| Response {
        id,
        version,
        replicated,
        result,
    })
}

proptest! {
    #[test]
    fn requests_round_trip(reqs in proptest::collection::vec(request(), 0..20)) {
        let mut buf = Vec::new();
        encode_requests(&reqs, &mut buf);
        let h = frame_header(&buf).expect("header").expect("complete header");
        prop_assert_eq!(h.total, buf.len());
        prop_assert_eq!(h.count, reqs.len());
        let got: Vec<Request> = decode_requests(&buf).expect("decode").into_iter().map(|r| r.expect("valid entry")).collect();
        prop_assert_eq!(got, reqs.clone());
        // size_hint bounds each request's encoded size (the frame header aside).
        for r in &reqs {
            let mut one = Vec::new();
            encode_requests(std::slice::from_ref(r), &mut one);
            prop_assert!(one.len() - 8 <= r.size_hint(), "{:?}: {} > {}", r.op.code(), one.len() - 8, r.size_hint());
        }
        // Every proper prefix is incomplete, never an error or a panic.
        for cut in [0, 3, 7, buf.len() / 2, buf.len() - 1] {
            if cut < buf.len() {
                prop_assert!(matches!(decode_requests(&buf[..cut]), Err(DecodeError::Incomplete) | Err(DecodeError::Malformed(_))));
            }
        }
    }

    #[test]
    fn frames_built_from_entries_equal_encoded_frames(resps in proptest::collection::vec(response(), 0..20), cut in 0usize..20) {
        let mut whole = Vec::new();
        encode_responses(&resps, &mut whole);
        // Some entries encoded apart (as a reader thread does), the rest pushed one by one.
        let cut = cut.min(resps.len());
        let mut apart = Vec::new();
        for r in &resps[..cut] {
            encode_response_entry(r, &mut apart);
        }
        let mut built = Vec::new();
        let mut f = ResponseFrame::begin(&mut built);
        f.push_encoded(&mut built, &apart, cut);
        for r in &resps[cut..] {
            f.push(&mut built, r);
        }
        f.finish(&mut built);
        prop_assert_eq!(&built, &whole);
        // A header written before entries encoded apart (a large batch sent as it is).
        let mut entries = Vec::new();
        for r in &resps {
            encode_response_entry(r, &mut entries);
        }
        let mut headed = ResponseFrame::header(entries.len(), resps.len()).to_vec();
        headed.extend_from_slice(&entries);
        prop_assert_eq!(headed, whole);
    }

    #[test]
    fn responses_round_trip(resps in proptest::collection::vec(response(), 0..20)) {
        let mut buf = Vec::new();
        encode_responses(&resps, &mut buf);
        prop_assert_eq!(decode_responses(&buf).expect("decode"), resps);
    }

    /// Arbitrary bytes never panic the decoders.
    #[test]
    fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = frame_header(&b);
        let _ = decode_requests(&b);
        let _ = decode_responses(&b);
    }

    /// A valid frame with bytes flipped: still no panic, and any entry that decodes is in limits.
    #[test]
    fn flipped_frames_never_panic(reqs in proptest::collection::vec(request(), 1..6), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let mut buf = Vec::new();
        encode_requests(&reqs, &mut buf);
        for (at, x) in flips {
            let i = at % buf.len();
            buf[i] ^= x | 1;
        }
        if let Ok(entries) = decode_requests(&buf) {
            for r in entries.into_iter().flatten() {
                prop_assert!(r.op.validate().is_ok());
            }
        }
    }
}

#[test]
fn bad_entries_fail_alone_with_their_ids() {
    let reqs = vec![
        Request::new(7, Op::Get { key: b"a".to_vec() }),
        Request::new(8, Op::Put { key: b"b".to_vec(), value: b"v".to_vec() }),
        Request::new(9, Op::Get { key: b"c".to_vec() }),
    ];
    let mut buf = Vec::new();
    encode_requests(&reqs, &mut buf);
    // The second entry starts after the frame header (8) and the first entry (4 + len).
    let first_len = u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")) as usize;
    let second = 8 + 4 + first_len + 4;
    buf[second + 8] = 200; // unknown op code
    let got = decode_requests(&buf).expect("frame");
    assert_eq!(got[0].as_ref().expect("first").id, 7);
    assert_eq!(got[1].as_ref().err().map(|e| (e.0, e.1)), Some((8, ErrorCode::UnknownOp)));
    assert_eq!(got[2].as_ref().expect("third").id, 9);
}

#[test]
fn tags_go_with_the_right_operations() {
    let put = || Op::Put { key: b"k".to_vec(), value: b"v".to_vec() };
    let tagged = |client| Session { client, seq: 1, acked_below: 1, retry: false };
    let mut zero = Request::new(1, put());
    zero.session = Some(tagged(0));
    let mut versioned = Request::new(2, put());
    versioned.read_version = 5;
    let mut read = Request::new(3, Op::Get { key: b"k".to_vec() });
    read.session = Some(tagged(9));
    let mut buf = Vec::new();
    encode_requests(&[zero, versioned, read], &mut buf);
    let got = decode_requests(&buf).expect("frame");
    for (i, e) in got.iter().enumerate() {
        assert_eq!(e.as_ref().err().map(|e| (e.0, e.1)), Some((i as u64 + 1, ErrorCode::BadRequest)), "entry {i}");
    }
}

/// A response with an error code this decoder does not know is still an error, not a broken
/// frame (servers may add codes).
#[test]
fn unknown_error_codes_decode_as_errors() {
    let mut buf = Vec::new();
    let resp = Response {
        id: 4,
        version: 0,
        replicated: false,
        result: Err(ErrorReply { code: ErrorCode::BadToken, message: "m".into() }),
    };
    encode_responses(&[resp], &mut buf);
    // The status byte follows the entry length (4) and the id (8), after the frame header (8).
    buf[8 + 4 + 8] = 250;
    let got = decode_responses(&buf).expect("still a frame");
    let e = got[0].result.as_ref().expect_err("an error");
    assert_eq!(e.code, ErrorCode::Internal);
    assert!(e.message.contains("250"), "{}", e.message);
}

#[test]
fn limits_are_enforced() {
    let big = |n: usize| vec![0u8; n];
    let cases = vec![
        (Op::Get { key: big(limits::MAX_KEY + 1) }, ErrorCode::KeySize),
        (Op::Get { key: Vec::new() }, ErrorCode::KeySize),
        (Op::Put { key: b"k".to_vec(), value: big(limits::MAX_VALUE + 1) }, ErrorCode::ValueTooLarge),
        (
            Op::Scan { lo: vec![], hi: vec![], limit: limits::MAX_SCAN_ITEMS + 1, max_bytes: 0, token: vec![] },
            ErrorCode::TooManyOps,
        ),
        (Op::Batch { ops: vec![] }, ErrorCode::TooManyOps),
        (Op::AddTexts { adds: vec![] }, ErrorCode::TooManyOps),
        (Op::AddTexts { adds: vec![(b"k".to_vec(), vec![])] }, ErrorCode::TooManyOps),
        (Op::AddTexts { adds: vec![(Vec::new(), vec![1])] }, ErrorCode::KeySize),
        (
            Op::AddTexts { adds: (0..=limits::MAX_ADD_KEYS).map(|i| (vec![b'k', i as u8], vec![1])).collect() },
            ErrorCode::TooManyOps,
        ),
        (
            Op::AddTexts { adds: (0..2).map(|i| (vec![b'k', i as u8], vec![1; limits::MAX_ADDS / 2 + 1])).collect() },
            ErrorCode::TooManyOps,
        ),
    ];
    for (op, code) in cases {
        assert_eq!(op.validate(), Err(code), "{:?}", op.code());
        let mut buf = Vec::new();
        encode_requests(&[Request::new(1, op)], &mut buf);
        if buf.len() <= limits::MAX_FRAME {
            let got = decode_requests(&buf).expect("frame");
            assert_eq!(got[0].as_ref().err().map(|e| e.1), Some(code));
        }
    }
    // A frame header declaring more than the limit is refused before reading it.
    let mut h = vec![0u8; 8];
    h[0..4].copy_from_slice(&((limits::MAX_FRAME as u32) + 1).to_le_bytes());
    h[4] = VERSION;
    h[5] = 1;
    assert!(matches!(frame_header(&h), Err(DecodeError::TooLarge(_))));
    h[0..4].copy_from_slice(&100u32.to_le_bytes());
    h[4] = 9;
    assert!(matches!(frame_header(&h), Err(DecodeError::Version(9))));
    assert_eq!(frame_header(&h[..5]), Ok(None));
}

#[test]
fn scan_tokens_round_trip() {
    let t = ScanToken { read_version: 42, after: b"last key".to_vec() };
    assert_eq!(ScanToken::decode(&t.encode()), Some(t));
    assert_eq!(ScanToken::decode(b"\x02xxxxxxxxx"), None);
    assert_eq!(ScanToken::decode(b""), None);
}

#[test]
fn traceparent_headers_round_trip_and_bad_ones_are_ignored() {
    let t = TraceContext::from_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").expect("valid");
    assert_eq!(t.trace_id[0], 0x4b);
    assert_eq!(t.span_id[7], 0xb7);
    assert!(t.sampled());
    assert_eq!(t.traceparent(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    for bad in [
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    ] {
        assert_eq!(TraceContext::from_traceparent(bad), None, "{bad:?}");
    }
    // A later version may carry more fields after the four it shares with 00.
    assert!(TraceContext::from_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-x").is_some());
}

#[test]
fn an_all_zero_trace_id_is_a_bad_request() {
    let mut r = Request::new(7, Op::Get { key: b"k".to_vec() });
    r.trace = Some(TraceContext { trace_id: [1; 16], span_id: [2; 8], flags: 1 });
    let mut buf = Vec::new();
    encode_requests(std::slice::from_ref(&r), &mut buf);
    // The trace block follows the 36-byte entry header (after the 4-byte entry length and the
    // 8-byte frame header): zero its trace id.
    let at = 8 + 4 + 36;
    assert_eq!(&buf[at..at + 16], &[1; 16]);
    buf[at..at + 16].fill(0);
    let got = decode_requests(&buf).expect("a well-formed frame");
    assert!(matches!(got[0], Err((7, ErrorCode::BadRequest, _))), "{got:?}");
}
