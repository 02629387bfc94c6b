//! The fabric stream over libfabric's `tcp` provider on loopback: bytes arrive whole and in
//! order in both directions at once, flow control holds a writer whose reader does not read
//! (and lets it go on when it does), a peer's end is seen, and bad addresses and options are
//! typed errors.

use std::time::Duration;

use dpukv_fabric::{FabricAddr, FabricError, FabricListener, FabricStream, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(20);

/// Small buffers, so a few kilobytes already need credits to come back.
fn small() -> Options {
    Options { bufsize: 256, nbufs: 4, spin: Some(8) }
}

async fn pair(opts: Options) -> (FabricStream, FabricStream) {
    let l = FabricListener::bind("tcp", "127.0.0.1", 0, opts).expect("listen");
    let port = l.port();
    assert_ne!(port, 0);
    let accept = async {
        let s = l.accept().await.expect("accept");
        s.established(WAIT).await.expect("established");
        s
    };
    let connect = async { FabricStream::connect("tcp", "127.0.0.1", port, opts, WAIT).await.expect("connect") };
    tokio::join!(accept, connect)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_cross_both_ways_at_once_in_order() {
    for opts in [small(), Options::default()] {
        let (server, client) = pair(opts).await;
        // The server echoes everything back.
        let echo = tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(server);
            let mut buf = vec![0; 1000];
            loop {
                let n = r.read(&mut buf).await.expect("server read");
                if n == 0 {
                    break;
                }
                w.write_all(&buf[..n]).await.expect("server write");
                w.flush().await.expect("flush");
            }
        });
        let data = pattern(3 << 20, 7);
        let (mut r, mut w) = tokio::io::split(client);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            // Writes of odd sizes, flushed now and then.
            for (i, chunk) in sent.chunks(7919).enumerate() {
                w.write_all(chunk).await.expect("client write");
                if i % 3 == 0 {
                    w.flush().await.expect("flush");
                }
            }
            w.flush().await.expect("flush");
            w
        });
        let mut back = vec![0; data.len()];
        tokio::time::timeout(WAIT, r.read_exact(&mut back)).await.expect("in time").expect("read");
        assert!(back == data, "every byte back in order ({opts:?})");
        // A shutdown ends the connection both ways (there is no half-close): the server's
        // reader sees its end.
        let mut w = writer.await.expect("writer");
        w.shutdown().await.expect("shutdown");
        tokio::time::timeout(WAIT, echo).await.expect("the server saw the end").expect("echo");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_does_not_read_holds_its_writer_and_lets_it_go_when_it_reads() {
    let (mut server, client) = pair(small()).await;
    let data = pattern(64 << 10, 3);
    let sent = data.clone();
    let (_r, mut w) = tokio::io::split(client);
    let writer = tokio::spawn(async move {
        w.write_all(&sent).await.expect("write");
        w.flush().await.expect("flush");
        w
    });
    // Nothing is read: the writer cannot have sent more than the server's buffers hold.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!writer.is_finished(), "64 KiB went into 4 buffers of 256 bytes");
    let mut got = vec![0; data.len()];
    tokio::time::timeout(WAIT, server.read_exact(&mut got)).await.expect("in time").expect("read");
    assert!(got == data);
    let _w = tokio::time::timeout(WAIT, writer).await.expect("the writer went on").expect("writer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_goes_is_an_end_and_a_refused_write() {
    let (server, mut client) = pair(small()).await;
    drop(server);
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(WAIT, client.read(&mut buf)).await.expect("in time");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    let wrote = tokio::time::timeout(WAIT, async {
        client.write_all(b"anyone?").await?;
        client.flush().await
    })
    .await
    .expect("in time");
    assert!(wrote.is_err(), "a write to a closed connection fails");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_bad_addresses_and_options_are_typed_errors() {
    // A port with nothing behind it (bound and closed at once).
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let r = FabricStream::connect("tcp", "127.0.0.1", port, small(), Duration::from_secs(5)).await;
    assert!(r.is_err(), "connected to nothing");
    let r = FabricStream::connect("no-such-provider", "127.0.0.1", port, small(), Duration::from_secs(5)).await;
    assert!(matches!(r, Err(FabricError::Call { .. })), "{:?}", r.err());
    let r = FabricListener::bind("tcp", "127.0.0.1", 0, Options { nbufs: 1, ..small() });
    assert!(matches!(r, Err(FabricError::Options(_))));
    assert!(matches!(FabricAddr::parse("tcp://x:1"), Err(FabricError::Address(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_come_and_go_without_leaking_descriptors() {
    let fds = || std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    let l = FabricListener::bind("tcp", "127.0.0.1", 0, small()).expect("listen");
    let port = l.port();
    // Warm up (the provider opens what it keeps for the process once).
    let accept = || async {
        let s = l.accept().await?;
        s.established(WAIT).await?;
        Ok::<_, FabricError>(s)
    };
    let before = {
        let (a, c) = tokio::join!(accept(), FabricStream::connect("tcp", "127.0.0.1", port, small(), WAIT));
        drop((a.expect("accept"), c.expect("connect")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        fds()
    };
    for i in 0..50u8 {
        let (a, c) = tokio::join!(accept(), FabricStream::connect("tcp", "127.0.0.1", port, small(), WAIT));
        let (mut a, mut c) = (a.expect("accept"), c.expect("connect"));
        c.write_all(&[i; 10]).await.expect("write");
        c.flush().await.expect("flush");
        let mut b = [0; 10];
        a.read_exact(&mut b).await.expect("read");
        assert_eq!(b, [i; 10]);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = fds();
    assert!(after <= before + 4, "descriptors: {before} before 50 connections, {after} after");
}
