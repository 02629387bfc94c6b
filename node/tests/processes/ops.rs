//! Every operation through the device: reads served by the device, writes and atomics by the
//! host, many per frame, answered by id.

use dpukv_proto::{Cmp, Elem, ErrorCode, Op, ReduceOp, Reply, VecOp, WriteOp};

use crate::harness::Pod;

fn value(r: &dpukv_proto::Response) -> Option<Vec<u8>> {
    match &r.result {
        Ok(Reply::Value(v)) => v.clone(),
        other => panic!("expected a value, got {other:?}"),
    }
}

#[test]
fn operations_through_the_device() {
    let pod = Pod::start(&["--fsync", "always", "--split-keys", "m"], &[]);
    let mut c = pod.connect();
    let k = |s: &str| s.as_bytes().to_vec();
    // A frame of writes across both regions, then reads.
    let puts: Vec<Op> = (0..50)
        .map(|i| Op::Put { key: k(&format!("key{i:03}")), value: k(&format!("v{i}")) })
        .chain((0..50).map(|i| Op::Put { key: k(&format!("zz{i:03}")), value: k(&format!("w{i}")) }))
        .collect();
    for r in c.call(puts) {
        assert_eq!(r.result, Ok(Reply::Done), "{r:?}");
        assert!(r.version > 0);
    }
    assert_eq!(value(&c.one(Op::Get { key: k("key007") })), Some(k("v7")));
    // A read carries the value's version: at least the write's, at most now.
    let w = c.one(Op::Put { key: k("a-versioned"), value: k("x") });
    let r = c.one(Op::Get { key: k("a-versioned") });
    assert!(r.version >= w.version && w.version > 0, "read version {} vs write {}", r.version, w.version);
    assert_eq!(c.one(Op::Get { key: k("nope") }).version, 0, "no version for an absent key");
    assert_eq!(value(&c.one(Op::Get { key: k("nope") })), None);
    // Scans page with tokens across the region boundary at "m".
    let mut all = Vec::new();
    let mut token = Vec::new();
    loop {
        let r = c.one(Op::Scan { lo: k("key"), hi: k("zz999"), limit: 30, max_bytes: 0, token: token.clone() });
        let Ok(Reply::Items { items, token: t }) = r.result else { panic!("scan: {r:?}") };
        assert!(items.len() <= 30);
        all.extend(items);
        if t.is_empty() {
            break;
        }
        token = t;
    }
    assert_eq!(all.len(), 100);
    assert!(all.windows(2).all(|w| w[0].0 < w[1].0));
    let r = c.one(Op::FloorScan { lo: k("key0075"), hi: k("key010"), limit: 10, max_bytes: 0, token: vec![] });
    let Ok(Reply::Items { items, .. }) = r.result else { panic!("floor scan: {r:?}") };
    assert_eq!(
        items.iter().map(|x| x.0.clone()).collect::<Vec<_>>(),
        vec![k("key007"), k("key008"), k("key009"), k("key010")]
    );
    // Insert/update preconditions, delete, batch.
    assert_eq!(
        c.one(Op::Insert { key: k("key001"), value: k("x") }).result.map_err(|e| e.code),
        Err(ErrorCode::KeyExists)
    );
    assert_eq!(
        c.one(Op::Update { key: k("absent"), value: k("x") }).result.map_err(|e| e.code),
        Err(ErrorCode::KeyNotFound)
    );
    assert_eq!(c.one(Op::Delete { key: k("key001") }).result, Ok(Reply::Done));
    assert_eq!(value(&c.one(Op::Get { key: k("key001") })), None);
    let b = c.one(Op::Batch {
        ops: vec![WriteOp::Put { key: k("b1"), value: k("1") }, WriteOp::Delete { key: k("key002") }],
    });
    assert_eq!(b.result, Ok(Reply::Done));
    assert_eq!(value(&c.one(Op::Get { key: k("b1") })), Some(k("1")));
    assert_eq!(value(&c.one(Op::Get { key: k("key002") })), None);
    // Atomics: fetch_add, CAS, vectors.
    let fa: Vec<Op> = (0..100).map(|_| Op::FetchAdd { key: k("ctr"), delta: 3 }).collect();
    let olds: Vec<u64> = c
        .call(fa)
        .iter()
        .map(|r| match r.result {
            Ok(Reply::Scalar(s)) => u64::from_le_bytes(s),
            ref o => panic!("{o:?}"),
        })
        .collect();
    let mut sorted = olds.clone();
    sorted.sort();
    assert_eq!(sorted, (0..100).map(|i| i * 3).collect::<Vec<u64>>(), "each fetch_add sees a distinct old value");
    assert_eq!(value(&c.one(Op::Get { key: k("ctr") })), Some(300u64.to_le_bytes().to_vec()));
    let cas =
        c.one(Op::CompareAndSwap { key: k("ctr"), expected: Some(300u64.to_le_bytes().to_vec()), new: k("done") });
    assert!(matches!(cas.result, Ok(Reply::Cas { swapped: true, .. })));
    let vec: Vec<u8> = [5u64, 1, 9].iter().flat_map(|x| x.to_le_bytes()).collect();
    c.one(Op::Put { key: k("vec"), value: vec });
    assert_eq!(
        c.one(Op::VectorScalar { key: k("vec"), elem: Elem::U64, op: VecOp::Add, operand: 10u64.to_le_bytes() }).result,
        Ok(Reply::Done)
    );
    assert_eq!(
        c.one(Op::Reduce { key: k("vec"), elem: Elem::U64, op: ReduceOp::Sum }).result,
        Ok(Reply::Scalar(45u64.to_le_bytes()))
    );
    assert_eq!(
        c.one(Op::Filter { key: k("vec"), elem: Elem::U64, cmp: Cmp::Gt, operand: 12u64.to_le_bytes() }).result,
        Ok(Reply::Vector([15u64, 19].iter().flat_map(|x| x.to_le_bytes()).collect()))
    );
    assert_eq!(
        c.one(Op::Reduce { key: k("b1"), elem: Elem::U64, op: ReduceOp::Sum }).result.map_err(|e| e.code),
        Err(ErrorCode::TypeMismatch)
    );

    // Values up to the 1 MiB limit travel the whole way (the value log holds them; the device
    // reads them from it); one byte more is refused.
    let big: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    assert_eq!(c.one(Op::Put { key: k("big"), value: big.clone() }).result, Ok(Reply::Done));
    assert_eq!(value(&c.one(Op::Get { key: k("big") })), Some(big.clone()));
    let r = c.one(Op::Scan { lo: k("big"), hi: k("big"), limit: 0, max_bytes: 0, token: vec![] });
    assert!(matches!(r.result, Ok(Reply::Items { ref items, .. }) if items.len() == 1 && items[0].1 == big));
    let mut too_big = big;
    too_big.push(0);
    assert_eq!(
        c.one(Op::Put { key: k("big2"), value: too_big }).result.map_err(|e| e.code),
        Err(ErrorCode::ValueTooLarge)
    );
}
