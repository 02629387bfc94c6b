//! What no client can do to a pod: grow its memory past the budget (slow-loris frames, pages of
//! large values), exhaust its readers (connections are limited only by `--max-connections`),
//! lose a response (duplicate ids), or be served by a stale region map (region and epoch checks;
//! a replacement host with other regions).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dpukv_proto::limits::MAX_FRAME;
use dpukv_proto::{ErrorCode, Op, Reply, Request, WriteOp, encode_requests};

use crate::harness::{Conn, Pod, status_kib};

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// 200 connections announce maximal frames and trickle them; 4 clients scan pages of 1 MiB
/// values as fast as they can. The device's heap stays within its budget (plus a fixed
/// allowance), the host's does not move, another client's reads keep being answered, and the
/// slow frames are cut off at the frame timeout.
#[test]
fn memory_stays_bounded_under_slow_loris_and_large_scans() {
    const BUDGET_MIB: u64 = 128;
    const ALLOWANCE_MIB: u64 = 96;
    let budget = (BUDGET_MIB << 20).to_string();
    let pod = Pod::start(&["--fsync", "never"], &["--memory-budget", &budget, "--frame-timeout", "4"]);
    let mut good = pod.connect();
    assert_eq!(good.one(Op::Put { key: k("small"), value: k("1") }).result, Ok(Reply::Done));
    for i in 0..24u8 {
        let put = Op::Put { key: format!("big{i:02}").into_bytes(), value: vec![i; 1 << 20] };
        assert_eq!(good.one(put).result, Ok(Reply::Done));
    }
    let (dev, host) = (pod.device_pid(), pod.host_pid());
    let (dev0, host0) = (status_kib(dev, "RssAnon"), status_kib(host, "RssAnon"));

    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new((AtomicU64::new(dev0), AtomicU64::new(host0)));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.0.fetch_max(status_kib(dev, "RssAnon"), Ordering::Relaxed);
                peak.1.fetch_max(status_kib(host, "RssAnon"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    // Slow loris: a request frame header announcing MAX_FRAME bytes, then a trickle.
    let mut lorises: Vec<TcpStream> = (0..200)
        .map(|_| {
            let mut s = TcpStream::connect(&pod.addr).expect("connect");
            let mut head = (MAX_FRAME as u32 - 4).to_le_bytes().to_vec(); // total = len + 4
            head.extend([1, 1, 0, 0]);
            s.write_all(&head).expect("header");
            s.write_all(&[0; 100]).expect("a trickle");
            s
        })
        .collect();
    let scanners: Vec<_> = (0..4)
        .map(|_| {
            let (addr, stop) = (pod.addr.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut c = Conn::connect(&addr);
                let mut pages = 0;
                while !stop.load(Ordering::Relaxed) {
                    let scan = || Op::Scan { lo: k("big"), hi: k("big\u{ff}"), limit: 0, max_bytes: 0, token: vec![] };
                    for r in c.call(vec![scan(), scan(), scan(), scan()]) {
                        match r.result {
                            Ok(Reply::Items { items, .. }) => assert!(!items.is_empty()),
                            other => panic!("scan: {other:?}"),
                        }
                        pages += 1;
                    }
                }
                pages
            })
        })
        .collect();
    // Meanwhile the good client keeps being answered: no read waits until the scanners stop
    // (the bound is loose: the machine's 2 cores are shared with 16 scans and a parallel test).
    let until = Instant::now() + Duration::from_secs(6);
    let mut reads = 0;
    while Instant::now() < until {
        let t = Instant::now();
        assert_eq!(good.one(Op::Get { key: k("small") }).result, Ok(Reply::Value(Some(k("1")))));
        assert!(t.elapsed() < Duration::from_secs(5), "a read took {:?}", t.elapsed());
        reads += 1;
        for s in &mut lorises {
            let _ = s.write_all(&[0]);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Relaxed);
    let pages: u32 = scanners.into_iter().map(|s| s.join().expect("scanner")).sum();
    sampler.join().expect("sampler");
    // The frame timeout (4 s) has passed: every slow loris was cut off.
    for s in &mut lorises {
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let mut b = [0u8; 256];
        loop {
            match s.read(&mut b) {
                Ok(0) | Err(_) => break,
                Ok(_) => {} // an error reply may precede the close
            }
        }
    }
    let (dev_peak, host_peak) = (peak.0.load(Ordering::Relaxed), peak.1.load(Ordering::Relaxed));
    eprintln!(
        "device heap {} -> peak {} MiB, host {} -> {} MiB; {reads} reads, {pages} scan pages",
        dev0 >> 10,
        dev_peak >> 10,
        host0 >> 10,
        host_peak >> 10
    );
    assert!(pages > 20, "only {pages} scan pages");
    assert!(reads > 50, "only {reads} reads of the good client in 6 s");
    assert!(
        dev_peak < dev0 + ((BUDGET_MIB + ALLOWANCE_MIB) << 10),
        "device heap grew from {} to {} MiB (budget {BUDGET_MIB} MiB)",
        dev0 >> 10,
        dev_peak >> 10
    );
    assert!(
        host_peak < host0 + (ALLOWANCE_MIB << 10),
        "host heap grew from {} to {} MiB",
        host0 >> 10,
        host_peak >> 10
    );
}

/// Readers belong to the device's threads, not to connections: 300 connections (more than the
/// arenas' 128 reader slots) are all served, and the one past `--max-connections` is closed.
#[test]
fn connections_are_limited_only_by_max_connections() {
    let pod = Pod::start(&["--fsync", "never"], &["--max-connections", "300"]);
    pod.connect().one(Op::Put { key: k("a"), value: k("1") });
    let mut conns: Vec<Conn> = (0..300).map(|_| pod.connect()).collect();
    for (i, c) in conns.iter_mut().enumerate() {
        assert_eq!(c.one(Op::Get { key: k("a") }).result, Ok(Reply::Value(Some(k("1")))), "connection {i}");
    }
    let mut extra = TcpStream::connect(&pod.addr).expect("the kernel accepts it");
    extra.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut frame = Vec::new();
    encode_requests(&[Request::new(1, Op::Get { key: k("a") })], &mut frame);
    let _ = extra.write_all(&frame);
    let mut b = [0u8; 64];
    assert!(matches!(extra.read(&mut b), Ok(0) | Err(_)), "connection 301 is closed");
    drop(conns.pop());
    // A freed place is taken by the next connection.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = pod.connect();
        let mut frame = Vec::new();
        encode_requests(&[Request::new(1, Op::Get { key: k("a") })], &mut frame);
        if c.s.write_all(&frame).is_ok()
            && let Some(r) = c.read_frame()
        {
            assert_eq!(r[0].result, Ok(Reply::Value(Some(k("1")))));
            break;
        }
        assert!(Instant::now() < deadline, "no place freed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A request reusing the id of one in flight is a protocol error: an answer under that id would
/// be taken for the original's. The server says so under id 0 and closes the connection (the
/// client then treats what it had in flight as of unknown outcome); nothing leaks, so many such
/// connections later a full frame is still served.
#[test]
fn a_duplicate_request_id_closes_the_connection_and_leaks_nothing() {
    let pod = Pod::start(
        &["--fsync", "always"],
        &["--max-in-flight", "4", "--memory-budget", "67108864", "--conn-memory", "33554432"],
    );
    for round in 0..30u64 {
        let mut c = pod.connect();
        let id = 1000 + round;
        let reqs = vec![
            Request::new(id, Op::Put { key: k("dup"), value: round.to_le_bytes().to_vec() }),
            Request::new(id, Op::Get { key: k("dup") }),
        ];
        let mut frame = Vec::new();
        encode_requests(&reqs, &mut frame);
        c.s.write_all(&frame).expect("send");
        let mut got = Vec::new();
        while let Some(f) = c.read_frame() {
            got.extend(f);
        }
        let refusal = got.iter().find(|r| r.id == 0).expect("a protocol error under id 0");
        assert_eq!(refusal.result.as_ref().map_err(|e| e.code), Err(ErrorCode::BadRequest));
        assert!(got.iter().filter(|r| r.id == id).count() <= 1, "never two answers under one id: {got:?}");
    }
    // An id is free again as soon as its answer has been read: reusing it at once is no
    // duplicate (reads answered by the device and writes answered through the host alike).
    let mut c = pod.connect();
    for i in 0..2000u64 {
        let op = if i % 2 == 0 { Op::Get { key: k("dup") } } else { Op::Put { key: k("re"), value: k("v") } };
        let mut frame = Vec::new();
        encode_requests(&[Request::new(7, op)], &mut frame);
        c.s.write_all(&frame).expect("send");
        let r = c.read_frame().expect("an answer").remove(0);
        assert!(r.id == 7 && r.result.is_ok(), "reuse {i}: {r:?}");
    }
    let gets: Vec<Op> = (0..4).map(|_| Op::Get { key: k("dup") }).collect();
    for r in c.call(gets) {
        assert!(matches!(r.result, Ok(Reply::Value(_))), "{r:?}");
    }
}

/// A request naming a region and epoch is checked against the pod's map, on the device (reads)
/// and on the host (writes).
#[test]
fn region_and_epoch_are_checked() {
    let pod = Pod::start(&["--fsync", "never", "--split-keys", "m"], &[]);
    let mut c = pod.connect();
    let mut ask = |op: Op, region: u32, epoch: u64| {
        let mut r = Request::new(9, op);
        (r.region, r.epoch) = (region, epoch);
        let mut frame = Vec::new();
        encode_requests(&[r], &mut frame);
        c.s.write_all(&frame).expect("send");
        c.read_frame().expect("response").remove(0).result.map_err(|e| e.code)
    };
    let put = |key: &str| Op::Put { key: k(key), value: k("v") };
    let get = |key: &str| Op::Get { key: k(key) };
    assert_eq!(ask(put("z"), 2, 1), Ok(Reply::Done));
    assert_eq!(ask(put("z"), 1, 0), Err(ErrorCode::WrongRegion), "z is in region 2");
    assert_eq!(ask(put("a"), 1, 5), Err(ErrorCode::StaleEpoch));
    assert_eq!(ask(get("z"), 2, 1), Ok(Reply::Value(Some(k("v")))));
    assert_eq!(ask(get("z"), 1, 1), Err(ErrorCode::WrongRegion));
    assert_eq!(ask(get("a"), 1, 2), Err(ErrorCode::StaleEpoch));
    let across = Op::Batch { ops: vec![WriteOp::Delete { key: k("a") }, WriteOp::Delete { key: k("z") }] };
    assert_eq!(ask(across, 0, 0), Err(ErrorCode::WrongRegion), "a batch stays within one region");
}

/// The device routes by the map of the host that is up now: a replacement host with other split
/// keys (on a new data directory) is followed. The old data directory refuses other split keys.
#[test]
fn the_device_follows_a_replacement_host_with_other_regions() {
    let mut pod = Pod::start(&["--fsync", "always", "--split-keys", "m"], &[]);
    let mut c = pod.connect();
    assert_eq!(c.one(Op::Put { key: k("h"), value: k("old") }).result, Ok(Reply::Done));
    pod.host = None; // kill -9
    let fresh = pod.dir.path().join("data2");
    pod.start_host_at(&fresh, &["--fsync", "always", "--split-keys", "g"]);
    // "h" is now in region 2: written there and read from there.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut c = pod.connect();
        match c.one(Op::Put { key: k("h"), value: k("new") }).result {
            Ok(Reply::Done) => break,
            Err(e) if e.code.is_retryable() || e.code == ErrorCode::OutcomeUnknown => {}
            other => panic!("put: {other:?}"),
        }
        assert!(Instant::now() < deadline, "the device did not follow the new host");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut c = pod.connect();
    assert_eq!(c.one(Op::Get { key: k("h") }).result, Ok(Reply::Value(Some(k("new")))));
    let mut r = Request::new(3, Op::Get { key: k("h") });
    r.region = 2;
    let mut frame = Vec::new();
    encode_requests(&[r], &mut frame);
    c.s.write_all(&frame).expect("send");
    assert_eq!(c.read_frame().expect("response")[0].result, Ok(Reply::Value(Some(k("new")))));

    // The first data directory keeps its regions.
    pod.host = None;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dpukv-node"))
        .arg("--data-dir")
        .arg(pod.data())
        .arg("--shm-dir")
        .arg(pod.dir.path().join("shm-other"))
        .args(["--split-keys", "g"])
        .output()
        .expect("run dpukv-node");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("other regions"), "{err}");
}

/// Files of this pod (arenas, log segments, levels) that the process has mapped after they were
/// deleted.
fn deleted_mappings(pid: u32, pod_dir: &std::path::Path) -> Vec<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let dir = pod_dir.canonicalize().expect("canonical path");
    let mut files: Vec<String> = maps
        .lines()
        .filter(|l| l.contains(dir.to_string_lossy().as_ref()) && l.ends_with("(deleted)"))
        .filter_map(|l| l.split_whitespace().nth(5).map(str::to_string))
        .collect();
    files.sort();
    files.dedup();
    files
}

/// The device's reader threads let go of what the host retires — frozen arenas after their
/// compaction, log segments after garbage collection — even when no read comes to make them
/// look: a deleted file that stays mapped keeps its memory (tmpfs) or blocks (disk).
#[test]
fn idle_readers_let_go_of_retired_files() {
    let pod = Pod::start(&["--fsync", "never", "--l0-budget", "65536"], &["--read-threads", "2"]);
    let mut c = pod.connect();
    let round = |c: &mut Conn, n: u32| {
        let puts: Vec<Op> =
            (0..200u32).map(|i| Op::Put { key: format!("k{i:04}").into_bytes(), value: vec![n as u8; 400] }).collect();
        for r in c.call(puts) {
            assert_eq!(r.result, Ok(Reply::Done));
        }
    };
    // Reads on every reader thread, so each has every table open.
    round(&mut c, 0);
    for _ in 0..20 {
        let gets: Vec<Op> = (0..50u32).map(|i| Op::Get { key: format!("k{i:04}").into_bytes() }).collect();
        c.call(gets);
    }
    // Then writes only: arenas freeze and are compacted and deleted, segments are collected.
    for n in 1..40 {
        round(&mut c, n);
    }
    let dev = pod.device_pid();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let held = deleted_mappings(dev, pod.dir.path());
        if held.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the device still maps deleted files: {held:#?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        c.one(Op::Get { key: k("k0007") }).result,
        Ok(Reply::Value(Some(vec![39; 400]))),
        "and reads see the latest writes"
    );
}
