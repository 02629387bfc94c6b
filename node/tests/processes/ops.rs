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
    operations_through(false);
}

/// The same requests and answers over the device's libfabric endpoint (the `tcp` provider).
#[test]
fn operations_through_the_devices_fabric_endpoint() {
    operations_through(true);
}

fn operations_through(fabric: bool) {
    let device: &[&str] = if fabric { &["--fabric-listen", "127.0.0.1:0", "--fabric-provider", "tcp"] } else { &[] };
    let pod = Pod::start(&["--fsync", "always", "--split-keys", "m"], device);
    let mut c = if fabric { pod.connect_fabric() } else { pod.connect() };
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

/// `GET /metrics` at `addr` (HTTP/1.0): the body, once the endpoint answers (within 10 s).
fn metrics(addr: &str) -> String {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
            let mut text = String::new();
            if s.read_to_string(&mut text).is_ok() && text.starts_with("HTTP/1.") {
                return text;
            }
        }
        assert!(std::time::Instant::now() < deadline, "no metrics at {addr}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The value of the sample named exactly `sample` (name and labels) in `text`.
fn sample(text: &str, sample: &str) -> Option<f64> {
    text.lines().find_map(|l| l.rsplit_once(' ').filter(|(n, _)| *n == sample).and_then(|(_, v)| v.parse().ok()))
}

/// Both processes export a latency histogram per operation: the device from a request's arrival
/// to its answer, the host for what the device forwards to it (writes, not reads).
#[test]
fn latency_histograms_count_each_operation_on_device_and_host() {
    let port = || std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").to_string();
    let (host_admin, device_admin) = (port(), port());
    let pod = Pod::start(&["--admin", &host_admin], &["--admin", &device_admin]);
    let mut c = pod.connect();
    for i in 0..5 {
        let r = c.one(Op::Put { key: format!("k{i}").into_bytes(), value: b"v".to_vec() });
        assert_eq!(r.result, Ok(Reply::Done));
    }
    for i in 0..7 {
        assert_eq!(value(&c.one(Op::Get { key: format!("k{i}").into_bytes() })).is_some(), i < 5);
    }
    // A request's latency is recorded once its answer is sent: the last ones may land a moment
    // after the client has them (it failed once on a loaded machine). Wait for them.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let (device, host) = loop {
        let (device, host) = (metrics(&device_admin), metrics(&host_admin));
        let seen = sample(&device, "dpukv_device_request_duration_seconds_count{op=\"get\"}") == Some(7.0)
            && sample(&device, "dpukv_device_request_duration_seconds_count{op=\"put\"}") == Some(5.0)
            && sample(&host, "dpukv_host_request_duration_seconds_count{op=\"put\"}") == Some(5.0);
        if seen || std::time::Instant::now() >= deadline {
            break (device, host);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(sample(&device, "dpukv_device_request_duration_seconds_count{op=\"put\"}"), Some(5.0), "{device}");
    assert_eq!(sample(&device, "dpukv_device_request_duration_seconds_count{op=\"get\"}"), Some(7.0), "{device}");
    assert_eq!(sample(&device, "dpukv_device_request_duration_seconds_count{op=\"scan\"}"), Some(0.0), "{device}");
    assert_eq!(sample(&host, "dpukv_host_request_duration_seconds_count{op=\"put\"}"), Some(5.0), "{host}");
    assert_eq!(sample(&host, "dpukv_host_request_duration_seconds_count{op=\"get\"}"), Some(0.0), "{host}");
    // Every request took some time, and less than the largest bucket.
    let sum = sample(&device, "dpukv_device_request_duration_seconds_sum{op=\"put\"}").expect("sum");
    assert!(sum > 0.0 && sum < 5.0 * 20.0, "{sum}");
    let inf = "dpukv_device_request_duration_seconds_bucket{le=\"+Inf\",op=\"get\"}";
    assert_eq!(sample(&device, inf), Some(7.0), "{device}");
}

/// A device's `stats`: its counters, and per region it leads the gets it served (the console's
/// source, docs/protocol.md §5).
#[test]
fn stats_count_the_gets_each_region_served_on_the_device() {
    let pod = Pod::start(&["--fsync", "never", "--split-keys", "m"], &[]);
    let mut c = pod.connect();
    let k = |s: &str| s.as_bytes().to_vec();
    assert_eq!(c.one(Op::Put { key: k("a"), value: k("1") }).result, Ok(Reply::Done));
    assert_eq!(c.one(Op::Put { key: k("z"), value: k("2") }).result, Ok(Reply::Done));
    let gets = |c: &mut crate::harness::Conn, key: &str, n| {
        for _ in 0..n {
            assert!(value(&c.one(Op::Get { key: k(key) })).is_some());
        }
    };
    gets(&mut c, "a", 7);
    gets(&mut c, "z", 3);
    let Ok(Reply::Stats(s)) = c.one(Op::Stats).result else { panic!("no stats") };
    let region = |id| s.regions.iter().find(|r| r.region == id).map(|r| r.gets);
    assert_eq!((region(1), region(2)), (Some(7), Some(3)), "{s:?}");
    assert!(s.counter("reads_served").is_some_and(|n| n >= 10), "{s:?}");
    assert!(s.counter("rss_bytes").is_some_and(|n| n > 1 << 20), "{s:?}");
    assert!(s.counter("uptime_ms").is_some() && s.counter("cpu_ms").is_some(), "{s:?}");
    assert_eq!(s.counter("reads_on_host"), Some(0));
    // Gets go on counting from there.
    gets(&mut c, "a", 2);
    let Ok(Reply::Stats(s)) = c.one(Op::Stats).result else { panic!("no stats") };
    assert_eq!(s.regions.iter().find(|r| r.region == 1).map(|r| r.gets), Some(9));
}

/// `pivots` at a device: keys from the region's index that cut a range into similar parts,
/// only inside the range and the region of `lo`; none in a tiny range; a `max` above the limit
/// is refused.
#[test]
fn pivots_come_from_the_regions_index_within_its_range() {
    let pod = Pod::start(&["--fsync", "never", "--split-keys", "m"], &[]);
    let mut c = pod.connect();
    for chunk in (0..20_000u32).collect::<Vec<_>>().chunks(1000) {
        let ops: Vec<Op> =
            chunk.iter().map(|i| Op::Put { key: format!("k{i:06}").into_bytes(), value: vec![b'v'; 40] }).collect();
        for r in c.call(ops) {
            assert_eq!(r.result, Ok(Reply::Done));
        }
    }
    let keys = |r: &dpukv_proto::Response| match &r.result {
        Ok(Reply::Keys(k)) => k.clone(),
        other => panic!("{other:?}"),
    };
    let p = keys(&c.one(Op::Pivots { lo: b"k001000".to_vec(), hi: b"k019000".to_vec(), max: 16 }));
    assert!(p.len() >= 8 && p.len() <= 16, "{} pivots", p.len());
    assert!(p.windows(2).all(|w| w[0] < w[1]));
    assert!(p.iter().all(|k| k.as_slice() > b"k001000".as_slice() && k.as_slice() < b"k019000".as_slice()));
    // Roughly even: no part between consecutive pivots holds more than a third of the range.
    let mut cuts = vec![1000u32];
    cuts.extend(p.iter().map(|k| String::from_utf8_lossy(&k[1..7]).parse::<u32>().unwrap_or(0)));
    cuts.push(19_000);
    assert!(cuts.windows(2).all(|w| w[1] - w[0] <= 6000), "{cuts:?}");
    // Within the region of lo: a range from "a" to "z" gets pivots below "m" only.
    let p = keys(&c.one(Op::Pivots { lo: b"a".to_vec(), hi: b"z".to_vec(), max: 16 }));
    assert!(!p.is_empty() && p.iter().all(|k| k.as_slice() < b"m".as_slice()), "{p:?}");
    // A tiny range: nothing to cut.
    assert!(keys(&c.one(Op::Pivots { lo: b"k000001".to_vec(), hi: b"k000003".to_vec(), max: 16 })).is_empty());
    let r = c.one(Op::Pivots { lo: b"a".to_vec(), hi: b"z".to_vec(), max: 257 });
    assert_eq!(r.result.expect_err("refused").code, ErrorCode::TooManyOps);
}

/// Fat-root start hints on the device: the whole top of a region's tree learnt with
/// `tree_nodes`, gets carrying the deepest node covering their key visit fewer nodes than gets
/// from the root, answer the same, and are counted; after enough writes to split the tree the
/// stale hints are counted as misses and still answer right.
#[test]
fn start_hints_visit_fewer_nodes_and_stale_ones_still_answer_right() {
    use dpukv_proto::{Request, StartHint, TreeNode};
    let port = || std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").to_string();
    let device_admin = port();
    let pod = Pod::start(&["--fsync", "never"], &["--admin", &device_admin]);
    let mut c = pod.connect();
    let key = |i: u32| format!("k{i:06}").into_bytes();
    for chunk in (0..20_000u32).step_by(2).collect::<Vec<_>>().chunks(1000) {
        let ops: Vec<Op> = chunk.iter().map(|&i| Op::Put { key: key(i), value: vec![b'v'; 40] }).collect();
        for r in c.call(ops) {
            assert_eq!(r.result, Ok(Reply::Done));
        }
    }
    let tree = |c: &mut crate::harness::Conn, nodes: Vec<TreeNode>| match c
        .one(Op::TreeNodes { key: b"k".to_vec(), nodes })
        .result
    {
        Ok(Reply::TreeNodes { arena, nodes }) => (arena, nodes.into_iter().map(|(_, n)| n).collect::<Vec<_>>()),
        other => panic!("{other:?}"),
    };
    // The whole tree, layer by layer (64 nodes per request at most).
    let (arena, mut all) = tree(&mut c, vec![]);
    let mut layer = all.clone();
    while !layer.is_empty() {
        let mut next = Vec::new();
        for part in layer.chunks(64) {
            let (a, kids) = tree(&mut c, part.to_vec());
            assert_eq!(a, arena);
            next.extend(kids);
        }
        all.extend(next.iter().cloned());
        layer = next;
    }
    assert!(all.iter().any(|n| n.level >= 1), "a tree of more than one level");
    let hint = |k: &[u8]| {
        let n = all
            .iter()
            .filter(|n| n.lo.as_slice() <= k && n.hi.as_deref().is_none_or(|h| k < h))
            .min_by_key(|n| n.level)
            .expect("a covering node");
        std::sync::Arc::new(StartHint { arena, node: n.clone() })
    };
    let visits = || {
        let m = metrics(&device_admin);
        let s = |name: &str| sample(&m, name).unwrap_or(0.0);
        (s("dpukv_device_node_visits_total"), s("dpukv_device_hinted_reads_total"), s("dpukv_device_hint_misses_total"))
    };
    let get = |c: &mut crate::harness::Conn, i: u32, with: bool| {
        let mut req = Request::new(1, Op::Get { key: key(i) });
        if with {
            req.hint = Some(hint(&key(i)));
        }
        c.send(vec![req]).remove(0)
    };
    let n = 2000u32;
    let (v0, _, _) = visits();
    for i in 0..n {
        assert_eq!(value(&get(&mut c, i * 10 % 20_000, false)).is_some(), (i * 10 % 20_000) % 2 == 0);
    }
    let (v1, h1, m1) = visits();
    for i in 0..n {
        assert_eq!(value(&get(&mut c, i * 10 % 20_000, true)).is_some(), (i * 10 % 20_000) % 2 == 0);
    }
    let (v2, h2, m2) = visits();
    let (plain, hinted) = ((v1 - v0) / f64::from(n), (v2 - v1) / f64::from(n));
    eprintln!("node visits per get: {plain:.2} from the root, {hinted:.2} with hints");
    assert_eq!((h2 - h1, m2 - m1), (f64::from(n), 0.0), "every fresh hint is used");
    assert!(hinted < plain && hinted <= 1.2, "{hinted:.2} visits per hinted get vs {plain:.2}");
    // Scans from a key, their descent started where the hint says: the same items, counted.
    for i in (0..100u32).map(|i| i * 197 % 20_000) {
        let mut req = Request::new(1, Op::Scan { lo: key(i), hi: key(19_999), limit: 3, max_bytes: 0, token: vec![] });
        req.hint = Some(hint(&key(i)));
        let first = (i + i % 2..).step_by(2).take(3).map(key).collect::<Vec<_>>();
        match &c.send(vec![req]).remove(0).result {
            Ok(Reply::Items { items, .. }) => {
                assert_eq!(items.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(), first, "scan from {i}")
            }
            other => panic!("{other:?}"),
        }
    }
    let (_, h2s, m2s) = visits();
    assert_eq!((h2s - h2, m2s - m2), (100.0, 0.0), "every scan's hint is used");
    let (h2, m2) = (h2s, m2s);
    // Fill the gaps: leaves split, the hints to them go stale.
    for chunk in (1..20_000u32).step_by(2).collect::<Vec<_>>().chunks(1000) {
        let ops: Vec<Op> = chunk.iter().map(|&i| Op::Put { key: key(i), value: vec![b'w'; 40] }).collect();
        for r in c.call(ops) {
            assert_eq!(r.result, Ok(Reply::Done));
        }
    }
    for i in 0..n {
        let j = i * 7 % 20_000;
        assert!(value(&get(&mut c, j, true)).is_some(), "key {j} after the splits");
    }
    let (_, h3, m3) = visits();
    assert!(m3 - m2 > 0.0, "stale hints are counted");
    assert_eq!((h3 - h2) + (m3 - m2), f64::from(n));
}
