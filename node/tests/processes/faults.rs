//! Bad input and process failures: malformed frames, oversized fields, unknown op codes,
//! truncated frames and floods get error replies or a closed connection while other clients keep
//! being served; restarting the device, and SIGKILLing and restarting the host, lose no
//! acknowledged write, clients see retryable errors in the gap, and reads resume.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use dpukv_proto::{ErrorCode, Op, Reply, Request, encode_requests};

use crate::harness::{Conn, Pod};

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// The process's heap and other private memory (the shared arenas and mapped files are not
/// what a client can grow).
fn anon_kib(pid: u32) -> u64 {
    crate::harness::status_kib(pid, "RssAnon")
}

#[test]
fn bad_input_never_hurts_other_clients() {
    // A small memory budget, so the bound below is tight.
    let pod = Pod::start(&["--fsync", "never"], &["--memory-budget", "67108864", "--conn-memory", "33554432"]);
    let mut good = pod.connect();
    assert_eq!(good.one(Op::Put { key: k("a"), value: k("1") }).result, Ok(Reply::Done));

    // An unknown op code and an oversized key inside a valid frame: errors for those ids only.
    let mut c = pod.connect();
    let mut buf = Vec::new();
    encode_requests(&[Request::new(1, Op::Get { key: k("a") }), Request::new(2, Op::Get { key: k("b") })], &mut buf);
    buf[8 + 4 + 8] = 99; // the first entry's op code
    c.s.write_all(&buf).expect("send");
    let mut got = Vec::new();
    while got.len() < 2 {
        got.extend(c.read_frame().expect("responses"));
    }
    let by_id = |id| got.iter().find(|r: &&dpukv_proto::Response| r.id == id).expect("response").clone();
    assert_eq!(by_id(1).result.map_err(|e| e.code), Err(ErrorCode::UnknownOp));
    assert_eq!(by_id(2).result, Ok(Reply::Value(None)));
    let big = c.one(Op::Put { key: vec![7; 2000], value: k("v") });
    assert_eq!(big.result.map_err(|e| e.code), Err(ErrorCode::KeySize));
    // A read at a chosen version is refused, not answered at another version.
    let mut at = Request::new(77, Op::Get { key: k("a") });
    at.read_version = 5;
    let mut frame = Vec::new();
    encode_requests(&[at], &mut frame);
    c.s.write_all(&frame).expect("send");
    let r = c.read_frame().expect("response").remove(0);
    assert_eq!((r.id, r.result.map_err(|e| e.code)), (77, Err(ErrorCode::Unsupported)));

    // Garbage, a bad version, an oversized declared length, and a truncated frame: the
    // connection is closed (after an error reply where one can be sent).
    for bytes in [
        b"hello world, not a frame".to_vec(),
        {
            let mut b = vec![20, 0, 0, 0, 9, 1, 0, 0];
            b.extend([0; 20]);
            b
        },
        {
            let mut b = (64u32 << 20).to_le_bytes().to_vec();
            b.extend([1, 1, 0, 0]);
            b
        },
    ] {
        let mut s = TcpStream::connect(&pod.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        s.write_all(&bytes).expect("send");
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest); // the server closes
    }
    {
        let mut s = TcpStream::connect(&pod.addr).expect("connect");
        let mut frame = Vec::new();
        encode_requests(&[Request::new(5, Op::Get { key: k("a") })], &mut frame);
        s.write_all(&frame[..frame.len() - 3]).expect("send a truncated frame");
        drop(s); // and hang up mid-frame
    }

    // A flood: many connections each sending many frames without reading replies, then hanging
    // up. The device stays responsive and its memory stays bounded.
    let dev_pid = pod.device.as_ref().expect("device").0.id();
    let before = anon_kib(dev_pid);
    let flood: Vec<_> = (0..8)
        .map(|t| {
            let addr = pod.addr.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).expect("connect");
                let reqs: Vec<Request> = (0..500)
                    .map(|i| {
                        Request::new(i, Op::Put { key: format!("flood{t}-{i}").into_bytes(), value: vec![1; 100] })
                    })
                    .collect();
                let mut buf = Vec::new();
                encode_requests(&reqs, &mut buf);
                let deadline = Instant::now() + Duration::from_secs(2);
                while Instant::now() < deadline {
                    if s.write_all(&buf).is_err() {
                        break;
                    }
                }
            })
        })
        .collect();
    // Meanwhile the good client is still served.
    for i in 0..50 {
        let r = good.one(Op::Get { key: k("a") });
        assert_eq!(r.result, Ok(Reply::Value(Some(k("1")))), "request {i} during the flood");
    }
    for f in flood {
        f.join().expect("flooder");
    }
    let after = anon_kib(dev_pid);
    assert!(after < before + (64 + 32) * 1024, "device heap grew from {before} KiB to {after} KiB (budget 64 MiB)");
    assert_eq!(good.one(Op::Get { key: k("a") }).result, Ok(Reply::Value(Some(k("1")))));
}

/// Puts until `n` acknowledged, retrying retryable errors; returns the acknowledged keys.
fn must_write(conn: &mut Option<Conn>, addr: &str, from: u64, n: u64, acked: &mut Vec<u64>, retries: &mut u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = from;
    while i < from + n {
        assert!(Instant::now() < deadline, "writes did not resume");
        if conn.is_none() {
            match TcpStream::connect(addr) {
                Ok(_) => *conn = Some(Conn::connect(addr)),
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
        }
        let c = conn.as_mut().expect("connected");
        let ops: Vec<Op> = (i..i + 10)
            .map(|j| Op::Put { key: format!("w{j:06}").into_bytes(), value: j.to_le_bytes().to_vec() })
            .collect();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.call(ops))) {
            Ok(resps) => {
                let mut all_ok = true;
                for (j, r) in (i..).zip(resps) {
                    match r.result {
                        Ok(_) => acked.push(j),
                        // A put of a fixed value is idempotent: one whose outcome is unknown
                        // (in flight when the host died) may be sent again.
                        Err(e) if e.code.is_retryable() || e.code == ErrorCode::OutcomeUnknown => {
                            *retries += 1;
                            all_ok = false;
                        }
                        Err(e) => panic!("write {j} failed: {e:?}"),
                    }
                }
                if all_ok {
                    i += 10;
                } else {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            Err(_) => {
                // The connection broke (device restart): reconnect.
                *conn = None;
                *retries += 1;
            }
        }
    }
}

fn must_read_all(addr: &str, acked: &[u64]) {
    let mut c = Conn::connect(addr);
    for chunk in acked.chunks(200) {
        let ops = chunk.iter().map(|j| Op::Get { key: format!("w{j:06}").into_bytes() }).collect();
        for (j, r) in chunk.iter().zip(c.call(ops)) {
            assert_eq!(r.result, Ok(Reply::Value(Some(j.to_le_bytes().to_vec()))), "acknowledged write {j} lost");
        }
    }
}

#[test]
fn restarts_lose_no_acknowledged_write() {
    let mut pod = Pod::start(&["--fsync", "always", "--l0-budget", "65536"], &[]);
    let addr = pod.addr.clone();
    let mut conn = None;
    let (mut acked, mut retries) = (Vec::new(), 0u64);
    must_write(&mut conn, &addr, 0, 300, &mut acked, &mut retries);

    // SIGKILL the host mid-workload; writes fail retryably; restart it; they resume.
    let writer = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let (mut conn, mut acked, mut retries) = (None, Vec::new(), 0u64);
            must_write(&mut conn, &addr, 1000, 2000, &mut acked, &mut retries);
            (acked, retries)
        })
    };
    std::thread::sleep(Duration::from_millis(150));
    pod.host = None; // kill -9 + reap
    std::thread::sleep(Duration::from_millis(300));
    pod.start_host();
    let (more, more_retries) = writer.join().expect("writer");
    acked.extend(more);
    retries += more_retries;
    assert!(retries > 0, "the gap should have produced retryable errors");
    must_read_all(&addr, &acked);

    // Restart the device (stop and start on the same port): clients reconnect, data is there.
    let port = addr.clone();
    pod.device = None;
    let mut c = Command::new(env!("CARGO_BIN_EXE_dpukv-dpu"));
    c.arg("--shm-dir").arg(pod.shm()).args(["--listen", &port]).stderr(std::process::Stdio::null());
    pod.device = Some(crate::harness::Proc(c.spawn().expect("restart device")));
    let mut conn = None;
    must_write(&mut conn, &addr, 5000, 200, &mut acked, &mut retries);
    must_read_all(&addr, &acked);
}

use std::process::Command;

/// The host's data directory on a small real file system: writes fill it and are refused with a
/// retryable error that says so (nothing half-written), the host stays up, and once the file
/// system grows the same host takes writes again — no restart — with every acknowledged write
/// readable.
#[test]
fn a_full_disk_refuses_writes_and_takes_them_again_without_a_restart() {
    let mut pod = Pod::start(&["--fsync", "always"], &[]);
    pod.host = None;
    let data = pod.dir.path().join("small-disk");
    let Some(disk) = crate::tmpfs::Tmpfs::mount_at(&data, 8 << 20) else { return };
    pod.start_host_at(&data, &["--fsync", "always", "--l0-budget", "262144"]);
    let value = |i: u32| vec![(i % 251) as u8; 64 << 10];
    let key = |i: u32| format!("full{i:05}").into_bytes();
    let mut c = pod.connect();
    let (mut acked, mut refused) = (Vec::new(), None);
    for i in 0..400u32 {
        match c.one(Op::Put { key: key(i), value: value(i) }).result {
            Ok(Reply::Done) => acked.push(i),
            Err(e) => {
                assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
                assert!(e.message.contains("space"), "the error says why: {e:?}");
                refused = Some(i);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let first_refused = refused.expect("an 8 MiB disk fills up");
    eprintln!("{} writes of 64 KiB acknowledged before the disk was full", acked.len());
    assert!(acked.len() > 20, "only {} writes fit", acked.len());
    // Still refused while full, and still serving reads.
    assert_eq!(
        c.one(Op::Put { key: key(first_refused), value: value(first_refused) }).result.map_err(|e| e.code),
        Err(ErrorCode::Unavailable)
    );
    assert_eq!(c.one(Op::Get { key: key(acked[0]) }).result, Ok(Reply::Value(Some(value(acked[0])))));
    // Atomics on a disk full to the last byte are refused too, whatever they read, and write
    // nothing (the deterministic case — both in one round — is the writer's unit test
    // a_round_whose_log_write_fails_answers_nothing_from_its_own_values).
    // (Filled to the last byte first: small writes still fit after the first large one is refused.)
    let mut tiny_refused = false;
    'fill: for size in [16 << 10, 1 << 10, 64, 8] {
        for j in 0..100_000u32 {
            match c.one(Op::Put { key: format!("fill{size}-{j}").into_bytes(), value: vec![1; size] }).result {
                Ok(Reply::Done) => {}
                Err(e) if e.code == ErrorCode::Unavailable => {
                    tiny_refused = size == 8;
                    continue 'fill;
                }
                other => panic!("{other:?}"),
            }
        }
    }
    assert!(tiny_refused, "the disk is full even for 8-byte values");
    let ctr = b"full-counter".to_vec();
    let round = c.call(vec![
        Op::FetchAdd { key: ctr.clone(), delta: 1 },
        Op::CompareAndSwap { key: ctr.clone(), expected: None, new: b"x".to_vec() },
    ]);
    for r in &round {
        assert_eq!(
            r.result.as_ref().map_err(|e| e.code),
            Err(ErrorCode::Unavailable),
            "answered from an unwritten round: {r:?}"
        );
    }
    assert_eq!(c.one(Op::Get { key: ctr.clone() }).result, Ok(Reply::Value(None)), "the refused round wrote nothing");
    let host_pid = pod.host_pid();
    disk.resize(256 << 20);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = first_refused;
    while i < first_refused + 50 {
        match c.one(Op::Put { key: key(i), value: value(i) }).result {
            Ok(Reply::Done) => {
                acked.push(i);
                i += 1;
            }
            Err(e) if e.code == ErrorCode::Unavailable => {
                assert!(Instant::now() < deadline, "writes did not resume: {e:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(pod.host_pid(), host_pid);
    assert!(std::fs::metadata(format!("/proc/{host_pid}")).is_ok(), "the host stayed up");
    for &j in &acked {
        assert_eq!(c.one(Op::Get { key: key(j) }).result, Ok(Reply::Value(Some(value(j)))), "acknowledged write {j}");
    }
    pod.host = None; // before the file system goes away
}

/// What `client` returned on each of 8 connections to `pod` at once, together.
fn from_8_clients<T: Send + 'static>(pod: &Pod, client: fn(&mut Conn) -> Vec<T>) -> Vec<T> {
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let addr = pod.addr.clone();
            std::thread::spawn(move || client(&mut Conn::connect(&addr)))
        })
        .collect();
    threads.into_iter().flat_map(|t| t.join().expect("client")).collect()
}

#[test]
fn concurrent_fetch_add_sums_exactly() {
    let pod = Pod::start(&["--fsync", "interval:2"], &[]);
    let mut olds = from_8_clients(&pod, |c| {
        let mut olds = Vec::new();
        for _ in 0..25 {
            let ops = (0..20).map(|_| Op::FetchAdd { key: k("hot"), delta: 1 }).collect();
            for r in c.call(ops) {
                match r.result {
                    Ok(Reply::Scalar(s)) => olds.push(u64::from_le_bytes(s)),
                    other => panic!("fetch_add: {other:?}"),
                }
            }
        }
        olds
    });
    olds.sort();
    assert_eq!(olds, (0..4000).collect::<Vec<u64>>(), "every fetch_add saw a distinct old value");
    let mut c = pod.connect();
    assert_eq!(c.one(Op::Get { key: k("hot") }).result, Ok(Reply::Value(Some(4000u64.to_le_bytes().to_vec()))));
}

/// `add_text` (Redis's INCRBY on decimal text) from 8 clients at once, 20 increments a request:
/// every increment's result is distinct and they sum exactly; the stored value is text; what is
/// not a counter, and requests with no increments or too many, get typed errors and change nothing.
#[test]
fn concurrent_add_text_sums_exactly_and_bad_requests_are_typed_errors() {
    let pod = Pod::start(&["--fsync", "interval:2"], &[]);
    let mut seen = from_8_clients(&pod, |c| {
        let mut seen = Vec::new();
        for _ in 0..25 {
            match c.one(Op::AddText { key: k("n"), deltas: vec![1; 20] }).result {
                Ok(Reply::Added(r)) => seen.extend(r.into_iter().map(|v| v.expect("no overflow"))),
                other => panic!("add_text: {other:?}"),
            }
        }
        seen
    });
    seen.sort();
    assert_eq!(seen, (1..=4000).collect::<Vec<i64>>(), "every increment saw a distinct result");
    let mut c = pod.connect();
    assert_eq!(c.one(Op::Get { key: k("n") }).result, Ok(Reply::Value(Some(b"4000".to_vec()))));
    c.one(Op::Put { key: k("s"), value: b"01".to_vec() });
    let code = |r: dpukv_proto::Response| r.result.map_err(|e| e.code);
    assert_eq!(code(c.one(Op::AddText { key: k("s"), deltas: vec![1] })), Err(ErrorCode::TypeMismatch));
    assert_eq!(code(c.one(Op::AddText { key: k("n"), deltas: vec![] })), Err(ErrorCode::TooManyOps));
    assert_eq!(code(c.one(Op::AddText { key: k("n"), deltas: vec![1; 1025] })), Err(ErrorCode::TooManyOps));
    assert_eq!(c.one(Op::Get { key: k("n") }).result, Ok(Reply::Value(Some(b"4000".to_vec()))), "nothing changed");
    assert_eq!(c.one(Op::Get { key: k("s") }).result, Ok(Reply::Value(Some(b"01".to_vec()))));
    // `add_texts`: several keys a request, from 8 clients at once: each key's results distinct.
    let seen = from_8_clients(&pod, |c| {
        let mut seen = Vec::new();
        for _ in 0..25 {
            match c.one(Op::AddTexts { adds: vec![(k("p"), vec![1; 5]), (k("q"), vec![2; 5])] }).result {
                Ok(Reply::Added(r)) if r.len() == 10 => {
                    seen.extend(r.iter().enumerate().map(|(i, v)| (i < 5, v.expect("no overflow"))));
                }
                other => panic!("add_texts: {other:?}"),
            }
        }
        seen
    });
    let (mut p, mut q) = (Vec::new(), Vec::new());
    for (is_p, v) in seen {
        if is_p { p.push(v) } else { q.push(v) }
    }
    p.sort();
    q.sort();
    assert_eq!(p, (1..=1000).collect::<Vec<i64>>());
    assert_eq!(q, (1..=1000).map(|i| 2 * i).collect::<Vec<i64>>());
    // One key that is not a counter refuses them all; too many keys is a typed error.
    let adds = |keys: &[&str]| Op::AddTexts { adds: keys.iter().map(|key| (k(key), vec![1])).collect() };
    assert_eq!(code(c.one(adds(&["p", "s"]))), Err(ErrorCode::TypeMismatch));
    let many: Vec<String> = (0..=dpukv_proto::limits::MAX_ADD_KEYS).map(|i| format!("k{i}")).collect();
    assert_eq!(code(c.one(adds(&many.iter().map(String::as_str).collect::<Vec<_>>()))), Err(ErrorCode::TooManyOps));
    assert_eq!(c.one(Op::Get { key: k("p") }).result, Ok(Reply::Value(Some(b"1000".to_vec()))), "nothing changed");
}

/// SIGTERM: the host stops taking connections, finishes its rounds, closes its regions (every
/// write synced whatever the fsync policy, compactions finished) and exits 0 within the grace
/// period; a new host finds every acknowledged write.
#[test]
fn a_clean_shutdown_keeps_every_acknowledged_write() {
    let mut pod = Pod::start(&["--fsync", "never", "--l0-budget", "65536"], &[]);
    let mut c = pod.connect();
    let puts: Vec<Op> =
        (0..2000u32).map(|i| Op::Put { key: format!("t{i:05}").into_bytes(), value: vec![i as u8; 100] }).collect();
    for chunk in puts.chunks(500) {
        for r in c.call(chunk.to_vec()) {
            assert_eq!(r.result, Ok(Reply::Done));
        }
    }
    let mut host = pod.host.take().expect("host");
    let pid = host.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = host.0.try_wait().expect("try_wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "the host did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "the host exited with {status}");
    pod.start_host();
    let mut c = pod.connect();
    for i in (0..2000u32).step_by(7) {
        let r = c.one(Op::Get { key: format!("t{i:05}").into_bytes() });
        assert_eq!(r.result, Ok(Reply::Value(Some(vec![i as u8; 100]))), "write {i}");
    }
}
