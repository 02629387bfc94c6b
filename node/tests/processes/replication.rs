//! Tebis replication over real TCP sockets on 127.0.0.1 (in one process: a primary region and
//! backup hosts with their own listeners): acknowledgements wait for every backup, a promoted
//! backup answers like its primary, and the epoch fence refuses a deposed primary.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dpukv_node::replication::{Acks, BackupHost, Feed, SenderConfig, SenderEnd, spawn_sender, spawn_sender_after};
use dpukv_proto::replication::ReplRefusal;
use dpukv_storage::region::{Region, RegionConfig, RegionReader};
use dpukv_storage::vlog::FsyncPolicy;

struct BackupNode {
    host: Arc<BackupHost>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl BackupNode {
    fn start(dir: &std::path::Path, cluster: &str) -> BackupNode {
        let host = BackupHost::new(cluster, dir.to_path_buf());
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = Arc::new(AtomicBool::new(false));
        host.serve(listener, None, stop.clone()).expect("serve");
        BackupNode { host, addr, stop }
    }
}

impl Drop for BackupNode {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// The sender's end, or a panic if it does not end within 10 s (a test fails, never hangs).
fn ended(h: std::thread::JoinHandle<SenderEnd>) -> SenderEnd {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !h.is_finished() {
        assert!(std::time::Instant::now() < deadline, "the sender should have ended (refused) by now");
        std::thread::sleep(Duration::from_millis(10));
    }
    h.join().expect("sender")
}

fn sender_cfg(region_dir: &std::path::Path, epoch: u64, backup: u32, addr: SocketAddr) -> SenderConfig {
    SenderConfig {
        cluster: "test".into(),
        region: 1,
        epoch,
        primary: 1,
        backup,
        // By name, as nodes advertise themselves on Kubernetes (resolved at each connection).
        addr: dpukv_node::replication::PeerAddr::new(format!("localhost:{}", addr.port())),
        region_dir: region_dir.to_path_buf(),
        base: dpukv_storage::vlog::Lsn(0),
        life: 1,
        stats: Arc::default(),
        send_index: true,
        catch_up: None,
        tls: None,
    }
}

#[test]
fn every_acknowledged_write_is_on_every_backup_and_a_promoted_backup_answers_like_the_primary() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pdir = dir.path().join("primary");
    let mut primary =
        Region::open(RegionConfig::tiny(&pdir, dir.path().join("pshm"), FsyncPolicy::Always)).expect("open").0;
    primary.capture_exports();
    let backups: Vec<BackupNode> =
        (2..=3).map(|n| BackupNode::start(&dir.path().join(format!("node{n}")), "test")).collect();
    for b in &backups {
        b.host.back(1, 1, 1);
    }
    let (feed, acks, stop) = (Feed::new(), Acks::new(1, vec![2, 3]), Arc::new(AtomicBool::new(false)));
    let senders: Vec<_> = backups
        .iter()
        .zip(2..)
        .map(|(b, n)| {
            spawn_sender(
                sender_cfg(&pdir, 1, n, b.addr),
                primary.vlog().tail(),
                feed.clone(),
                acks.clone(),
                stop.clone(),
            )
            .expect("sender")
        })
        .collect();
    // Enough writes for many segments (16 KiB each) and compactions (8 KiB L0); overwrites, so
    // garbage collection takes segments out.
    let mut collected = 0;
    for i in 0..3000u32 {
        let key = format!("key{:05}", (i * 7919) % 2000);
        let ack = primary
            .put(key.as_bytes(), format!("value {i} {}", "x".repeat((i % 50) as usize)).as_bytes())
            .expect("put");
        feed.committed();
        if i % 50 == 0 {
            collected += primary.maintain().expect("maintain").gc.deleted;
            for e in primary.take_exports() {
                feed.export(e);
            }
        }
        acks.wait(ack.end, Duration::from_secs(20)).expect("every backup holds the write");
        for n in [2, 3] {
            assert!(acks.position(n).expect("held") >= ack.end, "backup {n} holds write {i}");
        }
    }
    primary.flush_now().expect("flush");
    for e in primary.take_exports() {
        feed.export(e);
    }
    let end = primary.vlog().end();
    feed.committed();
    acks.wait(end, Duration::from_secs(20)).expect("caught up");
    // Let the last index arrive, and the backups drop the log copies the primary collected.
    assert!(collected > 0, "the primary collected log segments");
    let segments = |d: &std::path::Path| -> Vec<u64> {
        let mut v: Vec<u64> = std::fs::read_dir(d.join("vlog"))
            .expect("vlog dir")
            .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".vlog")?.parse().ok())
            .collect();
        v.sort_unstable();
        v
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for b in &backups {
        while b.host.stats().log_segments_dropped.load(Ordering::Relaxed) == 0 {
            assert!(std::time::Instant::now() < deadline, "a backup drops copies of collected segments");
            std::thread::sleep(Duration::from_millis(50));
        }
        let (kept, live) = (segments(&b.host.dir(1)), segments(&pdir));
        assert!(kept.len() < 3 * live.len() + 4, "a backup keeps about the primary's log: {kept:?} vs {live:?}");
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Release);
    for s in senders {
        assert_eq!(s.join().expect("sender"), SenderEnd::Stopped);
    }
    let bdir = backups[0].host.dir(1);
    backups[0].host.release(1);
    let (promoted, rec) =
        Region::open(RegionConfig::tiny(&bdir, dir.path().join("bshm"), FsyncPolicy::Always)).expect("promote");
    let all = |r: &Region| r.scan(b"", b"\xff", usize::MAX).expect("scan");
    assert_eq!(all(&promoted), all(&primary), "the promoted backup answers like the primary");
    assert!(promoted.manifest().levels.len() == primary.manifest().levels.len(), "Send Index shipped the levels");
    assert!(rec.replayed < 3000, "the shipped index covers most of the log: replayed {}", rec.replayed);
}

#[test]
fn readers_see_a_write_only_once_every_backup_holds_it_even_through_a_compaction() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (pdir, pshm) = (dir.path().join("primary"), dir.path().join("pshm"));
    for fsync in [FsyncPolicy::Always, FsyncPolicy::Never] {
        let _ = std::fs::remove_dir_all(&pdir);
        let _ = std::fs::remove_dir_all(&pshm);
        let mut primary = Region::open(RegionConfig::tiny(&pdir, &pshm, fsync)).expect("open").0;
        let before = primary.put(b"before", b"0").expect("put");
        primary.wait_durable(before.end).expect("durable");
        primary.capture_exports();
        let backups: Vec<BackupNode> =
            (2..=3).map(|n| BackupNode::start(&dir.path().join(format!("{fsync:?}-node{n}")), "test")).collect();
        for b in &backups {
            b.host.back(1, 1, 1);
        }
        let (feed, acks, stop) = (Feed::new(), Acks::new(1, vec![2, 3]), Arc::new(AtomicBool::new(false)));
        acks.set_gate(primary.gate_reads());
        let mut reader = RegionReader::open(&pshm).expect("reader");
        // Only backup 2 streams: nothing written from here on may be read.
        let first = spawn_sender(
            sender_cfg(&pdir, 1, 2, backups[0].addr),
            primary.vlog().tail(),
            feed.clone(),
            acks.clone(),
            stop.clone(),
        )
        .expect("sender");
        let ack = primary.put(b"k", b"v").expect("put");
        feed.committed();
        assert!(acks.wait(ack.end, Duration::from_millis(300)).is_err(), "backup 3 does not hold it");
        assert!(acks.position(2).is_some_and(|p| p >= ack.end), "backup 2 holds it");
        assert_eq!(reader.get(b"before").expect("get"), Some(b"0".to_vec()), "what the region held stays visible");
        assert_eq!(reader.get(b"k").expect("get"), None, "{fsync:?}: a write one backup lacks is not read");
        // Enough writes to freeze and compact L0 (8 KiB): the levels may not show them either.
        for i in 0..400u32 {
            primary.put(format!("f{i:04}").as_bytes(), &[b'x'; 40]).expect("put");
        }
        feed.committed();
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(100));
            let _ = primary.maintain(); // installs a compaction that finished
        }
        assert!(primary.stats().flushes >= 1, "L0 froze");
        assert_eq!(reader.get(b"k").expect("get"), None, "{fsync:?}: nor once compacted");
        assert_eq!(reader.get(b"f0000").expect("get"), None, "{fsync:?}: nor the later writes");
        // Backup 3 catches up: everything shows.
        let second = spawn_sender(
            sender_cfg(&pdir, 1, 3, backups[1].addr),
            primary.vlog().tail(),
            feed.clone(),
            acks.clone(),
            stop.clone(),
        )
        .expect("sender");
        let end = primary.vlog().end();
        acks.wait(end, Duration::from_secs(10)).expect("both hold everything");
        assert_eq!(reader.get(b"k").expect("get"), Some(b"v".to_vec()), "{fsync:?}: shown once both hold it");
        assert_eq!(reader.get(b"f0399").expect("get"), Some(vec![b'x'; 40]));
        // Compactions and collection go on once the backups hold what they cover.
        primary.flush_now().expect("flush");
        assert_eq!(reader.get(b"f0200").expect("get"), Some(vec![b'x'; 40]));
        stop.store(true, Ordering::Release);
        assert_eq!(ended(first), SenderEnd::Stopped);
        assert_eq!(ended(second), SenderEnd::Stopped);
        drop(reader);
        primary.close().expect("close");
    }
}

#[test]
fn a_deposed_primary_is_refused_with_the_current_epoch_and_its_writes_are_never_confirmed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pdir = dir.path().join("primary");
    let mut primary =
        Region::open(RegionConfig::tiny(&pdir, dir.path().join("pshm"), FsyncPolicy::Never)).expect("open").0;
    let b = BackupNode::start(&dir.path().join("node2"), "test");
    b.host.back(1, 5, 1);
    let (feed, stop) = (Feed::new(), Arc::new(AtomicBool::new(false)));
    // An older epoch than the backup knows: refused at once, with the current epoch.
    let acks = Acks::new(4, vec![2]);
    let old =
        spawn_sender(sender_cfg(&pdir, 4, 2, b.addr), primary.vlog().tail(), feed.clone(), acks.clone(), stop.clone())
            .expect("sender");
    match ended(old) {
        SenderEnd::Refused(ReplRefusal::StaleEpoch, 5, _) => {}
        other => panic!("expected a stale-epoch refusal naming epoch 5, got {other:?}"),
    }
    // A current primary streams; once a newer epoch is known to the backup, it is cut off and
    // nothing it writes after is confirmed.
    let acks = Acks::new(5, vec![2]);
    let cur =
        spawn_sender(sender_cfg(&pdir, 5, 2, b.addr), primary.vlog().tail(), feed.clone(), acks.clone(), stop.clone())
            .expect("sender");
    let ack = primary.put(b"a", b"1").expect("put");
    feed.committed();
    acks.wait(ack.end, Duration::from_secs(10)).expect("confirmed under the current epoch");
    b.host.back(1, 6, 1);
    let late = primary.put(b"b", b"2").expect("put");
    feed.committed();
    assert!(acks.wait(late.end, Duration::from_millis(500)).is_err(), "a deposed primary's write is never confirmed");
    match ended(cur) {
        SenderEnd::Refused(ReplRefusal::StaleEpoch, 6, _) => {}
        other => panic!("expected a stale-epoch refusal naming epoch 6, got {other:?}"),
    }
    // Other clusters and regions the node does not back are refused too.
    let mut foreign = sender_cfg(&pdir, 9, 2, b.addr);
    foreign.cluster = "other".into();
    let f = spawn_sender(foreign, primary.vlog().tail(), feed.clone(), Acks::new(9, vec![2]), stop.clone())
        .expect("sender");
    assert!(matches!(ended(f), SenderEnd::Refused(ReplRefusal::WrongCluster, ..)));
    // A region the node does not back (yet: its map may lag) is retried until it does.
    let mut wrong = sender_cfg(&pdir, 9, 2, b.addr);
    wrong.region = 7;
    let acks7 = Acks::new(9, vec![2]);
    let w = spawn_sender(wrong, primary.vlog().tail(), feed, acks7.clone(), stop.clone()).expect("sender");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!w.is_finished() && acks7.position(2).is_none(), "refused, and trying again");
    b.host.back(7, 9, 1);
    let end = primary.vlog().end();
    acks7.wait(end, Duration::from_secs(10)).expect("streams once the node backs the region");
    stop.store(true, Ordering::Release);
    assert_eq!(ended(w), SenderEnd::Stopped);
}

#[test]
fn malformed_replication_frames_close_the_connection_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = BackupNode::start(&dir.path().join("node2"), "test");
    b.host.back(1, 1, 1);
    let frames: Vec<Vec<u8>> = vec![
        vec![0xff, 0xff, 0xff, 0x7f],                  // over the frame limit
        vec![3, 0, 0, 0, 9, 1, 0],                     // another version
        vec![2, 0, 0, 0, 1, 99],                       // an unknown kind
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), // not this protocol at all
    ];
    for f in frames {
        let mut s = TcpStream::connect(b.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(&f).expect("write");
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {} // closed with bytes unread
            other => panic!("the backup should close the connection without an answer: {other:?}"),
        }
    }
    assert!(!b.host.dir(1).join("LOGMAP").exists(), "no backup state was created by garbage");
}

#[test]
fn catching_up_backups_are_sent_the_log_at_the_node_s_capped_rate_and_a_current_one_at_full_speed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pdir = dir.path().join("primary");
    let mut primary = Region::open(RegionConfig::new(&pdir, dir.path().join("pshm"))).expect("open").0;
    // 3 MiB of log before the backups connect: both must catch up.
    for i in 0..3000u32 {
        primary.put(format!("k{i:05}").as_bytes(), &[b'v'; 1024]).expect("put");
    }
    let end = primary.vlog().end();
    primary.wait_durable(end).expect("durable");
    // Backups `ns` catch up at once, their senders sharing one node-wide cap of `rate`.
    let catch_up = |rate: u64, ns: &[u32]| {
        let cap = dpukv_node::replication::CatchUpCap::new(rate);
        let started = std::time::Instant::now();
        let mut running = Vec::new();
        for &n in ns {
            let b = BackupNode::start(&dir.path().join(format!("node{n}")), "test");
            b.host.back(1, 1, 1);
            let (feed, acks, stop) = (Feed::new(), Acks::new(1, vec![n]), Arc::new(AtomicBool::new(false)));
            let mut cfg = sender_cfg(&pdir, 1, n, b.addr);
            cfg.catch_up = cap.clone();
            let h = spawn_sender(cfg, primary.vlog().tail(), feed, acks.clone(), stop.clone()).expect("sender");
            running.push((b, acks, stop, h));
        }
        for (_, acks, _, _) in &running {
            acks.wait(end, Duration::from_secs(30)).expect("caught up");
        }
        let took = started.elapsed();
        for (_b, _, stop, h) in running {
            stop.store(true, Ordering::Release);
            assert_eq!(ended(h), SenderEnd::Stopped);
        }
        took
    };
    let capped = catch_up(1 << 20, &[2]);
    let free = catch_up(0, &[3]);
    assert!(capped >= Duration::from_millis(1800), "3 MiB at 1 MiB/s took {capped:?}");
    assert!(free < capped / 2, "uncapped {free:?}, capped {capped:?}");
    // Two at once share the node's cap (it was per sender: two took as long as one).
    let two = catch_up(1 << 20, &[4, 5]);
    assert!(two >= Duration::from_millis(4500), "6 MiB over two senders at 1 MiB/s took {two:?}");
}

/// Replication over mutual TLS: a backup serving TLS (client certificates of the cluster's CA
/// required) holds every write a primary with such a certificate streams; a primary with a
/// certificate of another CA is never served.
#[test]
fn replication_runs_over_mutual_tls_and_refuses_strangers() {
    use dpukv_net::tls::{ClientTls, ServerTls, make_local_ca};
    let dir = tempfile::tempdir().expect("tempdir");
    let node1 = dpukv_net::identity::Identity::new("local", "test", dpukv_net::identity::Role::Node, "1").expect("id");
    let ours = make_local_ca(&dir.path().join("ours"), &["127.0.0.1", "localhost"], Some(&node1)).expect("CA");
    let theirs = make_local_ca(&dir.path().join("theirs"), &["127.0.0.1"], Some(&node1)).expect("other CA");
    let pdir = dir.path().join("primary");
    let mut primary =
        Region::open(RegionConfig::tiny(&pdir, dir.path().join("pshm"), FsyncPolicy::Always)).expect("open").0;
    let host = BackupHost::new("test", dir.path().join("node2"));
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = Arc::new(AtomicBool::new(false));
    let server = ServerTls::load(&ours, true).expect("server TLS");
    host.serve(listener, Some(server), stop.clone()).expect("serve");
    host.back(1, 1, 1);
    let ca = ours.ca.clone().expect("ca");
    // A stranger first: its certificate is refused, nothing is held.
    let stranger = ClientTls::load(&ca, Some((&theirs.cert, &theirs.key))).expect("client TLS");
    let (feed, acks) = (Feed::new(), Acks::new(1, vec![2]));
    let mut cfg = sender_cfg(&pdir, 1, 2, addr);
    cfg.tls = Some(stranger);
    let s = spawn_sender(cfg, primary.vlog().tail(), feed.clone(), acks.clone(), stop.clone()).expect("sender");
    let ack = primary.put(b"k0", b"v").expect("put");
    feed.committed();
    assert!(acks.wait(ack.end, Duration::from_millis(1500)).is_err(), "a primary of another CA is not served");
    // One of ours streams: every write is held.
    let member = ClientTls::load(&ca, Some((&ours.cert, &ours.key))).expect("client TLS");
    let (feed, acks) = (Feed::new(), Acks::new(1, vec![2]));
    let mut cfg = sender_cfg(&pdir, 1, 2, addr);
    cfg.tls = Some(member);
    let ours_sender =
        spawn_sender(cfg, primary.vlog().tail(), feed.clone(), acks.clone(), stop.clone()).expect("sender");
    for i in 0..500u32 {
        let ack = primary.put(format!("k{i:04}").as_bytes(), &[b'x'; 200]).expect("put");
        feed.committed();
        acks.wait(ack.end, Duration::from_secs(20)).expect("held by the backup over TLS");
    }
    stop.store(true, Ordering::Release);
    assert_eq!(ended(ours_sender), SenderEnd::Stopped);
    let _ = ended(s);
}

/// A forged `Hello` — another node naming itself the region's primary, under the largest epoch,
/// with base 0 — once raised the epoch the backup fences with to 2^64-1 (locking the real
/// primary out for good) and cut the backup's copy of the log at 0. A backup now takes a
/// stream only from the primary its own region map names, under that map's epoch.
#[test]
fn a_forged_hello_neither_raises_the_fence_nor_cuts_the_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pdir = dir.path().join("primary");
    let mut primary =
        Region::open(RegionConfig::tiny(&pdir, dir.path().join("pshm"), FsyncPolicy::Always)).expect("open").0;
    let b = BackupNode::start(&dir.path().join("node2"), "test");
    b.host.back(1, 5, 1);
    let (feed, stop) = (Feed::new(), Arc::new(AtomicBool::new(false)));
    let acks = Acks::new(5, vec![2]);
    let real =
        spawn_sender(sender_cfg(&pdir, 5, 2, b.addr), primary.vlog().tail(), feed.clone(), acks.clone(), stop.clone())
            .expect("sender");
    for i in 0..50u32 {
        let ack = primary.put(format!("k{i}").as_bytes(), b"v").expect("put");
        feed.committed();
        acks.wait(ack.end, Duration::from_secs(10)).expect("confirmed");
    }
    let held = acks.position(2).expect("held");
    // The forger: node 9, epoch 2^64-1, base 0.
    let mut forged = sender_cfg(&pdir, u64::MAX, 2, b.addr);
    forged.primary = 9;
    let forged_acks = Acks::new(u64::MAX, vec![2]);
    let forger_stop = Arc::new(AtomicBool::new(false));
    let f = spawn_sender(forged, primary.vlog().tail(), feed.clone(), forged_acks.clone(), forger_stop.clone())
        .expect("forger");
    // A newer epoch than the map's, from a node the map does not name: refused every time.
    let deadline = std::time::Instant::now() + Duration::from_millis(500);
    while std::time::Instant::now() < deadline {
        assert!(forged_acks.position(2).is_none(), "the forged stream was never taken");
        std::thread::sleep(Duration::from_millis(20));
    }
    forger_stop.store(true, Ordering::Release);
    assert_eq!(ended(f), SenderEnd::Stopped);
    // The real primary goes on, and the copy kept everything.
    let ack = primary.put(b"after", b"v").expect("put");
    feed.committed();
    acks.wait(ack.end, Duration::from_secs(10)).expect("the real primary is still confirmed");
    assert!(acks.position(2).expect("held") >= held, "the backup's copy was not cut");
    assert!(!real.is_finished(), "the real primary's stream goes on");
    stop.store(true, Ordering::Release);
    assert_eq!(ended(real), SenderEnd::Stopped);
}

/// A Hello over mutual TLS is taken only from the certificate of the node it names as the
/// region's primary. Before identities were checked, any certificate of the cluster's CA — a
/// gateway's, another node's — could open a stream as the map's primary and append to the
/// backup's copy (here: the Hello was answered `Resume`).
#[test]
fn a_stream_is_taken_only_from_the_certificate_of_the_node_it_names() {
    use dpukv_net::identity::{Identity, Role};
    use dpukv_net::tls::{ClientTls, LocalCa, ServerTls, TlsFiles};
    use dpukv_proto::replication::ReplMessage;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = LocalCa::new().expect("CA");
    let ca_pem = dir.path().join("ca.pem");
    ca.write_ca(&ca_pem).expect("CA");
    let issue = |name: &str, role: Role, id: &str| {
        let f = TlsFiles {
            cert: dir.path().join(format!("{name}.pem")),
            key: dir.path().join(format!("{name}.key")),
            ca: Some(ca_pem.clone()),
        };
        let identity = Identity::new("local", "test", role, id).expect("identity");
        ca.issue(&["127.0.0.1", "localhost"], Some(&identity), &f).expect("issue");
        f
    };
    let backup_files = issue("node-2", Role::Node, "2");
    let host = BackupHost::new("test", dir.path().join("node2"));
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = Arc::new(AtomicBool::new(false));
    host.serve(listener, Some(ServerTls::load(&backup_files, true).expect("server TLS")), stop.clone()).expect("serve");
    // Region 1 at epoch 4, led by node 1, as this backup's map says.
    host.back(1, 4, 1);
    let hello = |files: &TlsFiles| -> ReplMessage {
        let tls = ClientTls::load(&ca_pem, Some((&files.cert, &files.key))).expect("client TLS");
        let tcp = TcpStream::connect(addr).expect("connect");
        let mut s = tls.connect_blocking(tcp, &addr.to_string()).expect("handshake");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut frame = Vec::new();
        ReplMessage::Hello { cluster: "test".into(), region: 1, epoch: 4, primary: 1, base: 0, life: Some(1) }
            .encode(&mut frame);
        s.write_all(&frame).expect("hello");
        let mut len = [0u8; 4];
        s.read_exact(&mut len).expect("an answer");
        let mut answer = len.to_vec();
        answer.resize(4 + u32::from_le_bytes(len) as usize, 0);
        s.read_exact(&mut answer[4..]).expect("an answer");
        ReplMessage::decode(&answer).expect("a frame").0
    };
    let refused = |m: ReplMessage| matches!(m, ReplMessage::Refuse { reason: ReplRefusal::Forbidden, .. });
    let gateway = issue("gateway", Role::Gateway, "gw");
    assert!(refused(hello(&gateway)), "a gateway's certificate claiming to be node 1");
    let node3 = issue("node-3", Role::Node, "3");
    assert!(refused(hello(&node3)), "node 3's certificate claiming to be node 1");
    let admin = issue("admin", Role::Admin, "root");
    assert!(refused(hello(&admin)), "an admin's certificate");
    assert_eq!(host.held(1), None, "nothing was taken");
    let node1 = issue("node-1", Role::Node, "1");
    assert!(matches!(hello(&node1), ReplMessage::Resume { .. }), "node 1 itself is served");
    stop.store(true, Ordering::Release);
}

/// Peak resident memory of this process (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse().ok())
        .expect("VmHWM");
    kib << 10
}

/// Resets the peak resident memory to the current one (Linux: `echo 5 > clear_refs`).
fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").expect("clear_refs");
}

/// An index larger than a replication frame (64 MiB) once never reached a backup: it went as
/// one frame, the backup refused it, and the sender reconnected forever; it was also held in
/// memory twice on each side. Now a shipment is its metadata, then a chunk of one segment at a
/// time, interleaved with the log: the backup installs it and answers like the primary, and
/// neither side's memory grows by more than a few segments (both sides live in this process).
#[test]
fn an_index_larger_than_a_frame_is_shipped_in_parts_with_memory_bounded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pdir = dir.path().join("primary");
    let mut cfg = RegionConfig::new(&pdir, dir.path().join("pshm"));
    cfg.vlog.fsync = FsyncPolicy::Never;
    cfg.l0_budget = 24 << 20;
    let mut primary = Region::open(cfg).expect("open").0;
    // 24-byte keys and 232-byte values, stored in the levels' leaves (not the log): ~72 MiB of
    // index.
    let n = 290_000u32;
    let value = |i: u32| format!("{i:010}-{}", "v".repeat(221));
    for i in 0..n {
        primary
            .put(format!("key-{:020}", (i as u64 * 2_654_435_761) % 1_000_000_007).as_bytes(), value(i).as_bytes())
            .expect("put");
    }
    primary.flush_now().expect("flush");
    let index: u64 = primary.manifest().levels.iter().map(|l| l.bytes).sum();
    assert!(
        index > dpukv_proto::replication::MAX_REPL_FRAME as u64,
        "the index ({index} bytes) is larger than a frame"
    );
    let b = BackupNode::start(&dir.path().join("node2"), "test");
    b.host.back(1, 1, 1);
    let (feed, acks, stop) = (Feed::new(), Acks::new(1, vec![2]), Arc::new(AtomicBool::new(false)));
    let cfg = sender_cfg(&pdir, 1, 2, b.addr);
    let stats = cfg.stats.clone();
    reset_peak_rss();
    let before = peak_rss();
    let h = spawn_sender(cfg, primary.vlog().tail(), feed, acks.clone(), stop.clone()).expect("sender");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !acks.installed(2) || acks.position(2) < Some(primary.vlog().end()) {
        assert!(std::time::Instant::now() < deadline, "the backup installs the whole index");
        std::thread::sleep(Duration::from_millis(50));
    }
    let grew = peak_rss().saturating_sub(before);
    stop.store(true, Ordering::Release);
    assert_eq!(ended(h), SenderEnd::Stopped);
    assert_eq!(stats.whole_index_shipments.load(Ordering::Relaxed), 1, "shipped once, no reconnect");
    assert!(stats.index_bytes_shipped.load(Ordering::Relaxed) >= index);
    assert!(grew < 32 << 20, "shipping {index} bytes of index grew the peak memory by {grew} bytes");
    // The backup, promoted, answers like the primary — from the shipped levels, not a replay.
    let bdir = b.host.dir(1);
    b.host.release(1);
    let (promoted, rec) = Region::open(RegionConfig::new(&bdir, dir.path().join("bshm"))).expect("promote");
    assert!(rec.replayed < 1000, "the shipped index covers the log: replayed {}", rec.replayed);
    for i in (0..n).step_by(997) {
        let key = format!("key-{:020}", (i as u64 * 2_654_435_761) % 1_000_000_007);
        assert_eq!(promoted.get(key.as_bytes()).expect("get"), Some(value(i).into_bytes()), "key {i}");
    }
}

/// A backup that comes back after the primary collected the log it lacks once could never catch
/// up: each session resumed at a segment that was gone, the sender failed reading it, and
/// reconnected forever. Now the primary tells it to start over (`Restart`), and it is copied
/// from the start — and, resumed where the log is all still there, it is streamed only the rest.
#[test]
fn a_backup_resuming_where_the_log_was_collected_is_copied_again_and_one_resuming_in_time_is_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pdir = dir.path().join("primary");
    let mut primary =
        Region::open(RegionConfig::tiny(&pdir, dir.path().join("pshm"), FsyncPolicy::Never)).expect("open").0;
    primary.capture_exports();
    let b = BackupNode::start(&dir.path().join("node2"), "test");
    b.host.back(1, 1, 1);
    let write = |primary: &mut Region, from: u32, to: u32| {
        for i in from..to {
            primary
                .put(format!("key{:04}", i % 300).as_bytes(), format!("value {i} {}", "x".repeat(60)).as_bytes())
                .expect("put");
        }
        let end = primary.vlog().end();
        primary.wait_durable(end).expect("durable");
        end
    };
    let session = |primary: &mut Region, end| {
        let (feed, acks, stop) = (Feed::new(), Acks::new(1, vec![]), Arc::new(AtomicBool::new(false)));
        let cfg = sender_cfg(&pdir, 1, 2, b.addr);
        let stats = cfg.stats.clone();
        let h = spawn_sender(cfg, primary.vlog().tail(), feed, acks.clone(), stop.clone()).expect("sender");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while acks.position(2) < Some(end) {
            assert!(
                std::time::Instant::now() < deadline,
                "the backup catches up: at {:?} of {end:?}",
                acks.position(2)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Release);
        assert_eq!(ended(h), SenderEnd::Stopped);
        stats
    };
    let end = write(&mut primary, 0, 400);
    session(&mut primary, end);
    // Away a moment: the log it lacks is all still here; it is streamed only the rest.
    let end = write(&mut primary, 400, 500);
    let stats = session(&mut primary, end);
    assert_eq!(stats.sessions_resumed.load(Ordering::Relaxed), 1, "resumed from its own copy");
    assert_eq!(stats.copies_restarted.load(Ordering::Relaxed), 0);
    // Away long: overwrites and garbage collection take the segments where it stopped.
    let away = primary.vlog().end();
    let mut end = away;
    for round in 0..40u32 {
        end = write(&mut primary, 500 + round * 300, 800 + round * 300);
        primary.flush_now().expect("flush");
        for _ in 0..50 {
            primary.maintain().expect("maintain");
        }
        if !primary.vlog().tail().continues_from(away).expect("segments") {
            break;
        }
    }
    assert!(!primary.vlog().tail().continues_from(away).expect("segments"), "collection took the log it lacks");
    let stats = session(&mut primary, end);
    assert_eq!(stats.copies_restarted.load(Ordering::Relaxed), 1, "told to copy the region again");
    let bdir = b.host.dir(1);
    b.host.release(1);
    let (promoted, _) =
        Region::open(RegionConfig::tiny(&bdir, dir.path().join("bshm"), FsyncPolicy::Never)).expect("promote");
    let all = |r: &Region| r.scan(b"", b"\xff", usize::MAX).expect("scan");
    assert_eq!(all(&promoted), all(&primary), "the copy made again answers like the primary");
}

/// A retarget replaces a backup's sender (a new epoch) while the old one may still be inside its
/// session; the new one must not open its own until the old one has ended: two sessions at once
/// shared the backup's position and index flag, and the old one marked the backup as lacking the
/// index for good (found by the nemesis after a power loss). Here the old sender is a thread that
/// ends only when told; the backup is a bare listener that records when it is dialled.
#[test]
fn a_new_sender_connects_only_once_the_sender_it_replaces_has_ended() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pdir = dir.path().join("primary");
    let primary = Region::open(RegionConfig::tiny(&pdir, dir.path().join("pshm"), FsyncPolicy::Never)).expect("open").0;
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    let release = Arc::new(AtomicBool::new(false));
    let previous = {
        let release = release.clone();
        std::thread::spawn(move || {
            while !release.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            SenderEnd::Stopped
        })
    };
    let (feed, acks, stop) = (Feed::new(), Acks::new(1, vec![2]), Arc::new(AtomicBool::new(false)));
    let h = spawn_sender_after(
        sender_cfg(&pdir, 2, 2, addr),
        primary.vlog().tail(),
        feed,
        acks,
        stop.clone(),
        Some(previous),
    )
    .expect("sender");
    let dialled = |within: Duration| {
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            match listener.accept() {
                Ok(_) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("accept: {e}"),
            }
        }
        false
    };
    assert!(!dialled(Duration::from_millis(700)), "the new sender dialled while the one it replaces was still running");
    release.store(true, Ordering::Release);
    assert!(dialled(Duration::from_secs(5)), "the new sender dials once the one it replaces has ended");
    stop.store(true, Ordering::Release);
    assert_eq!(ended(h), SenderEnd::Stopped);
}
