//! The device's libfabric endpoint (`--fabric-listen`, here over libfabric's `tcp` provider):
//! the same protocol, limits and answers as its data port; a malicious frame ends only its own
//! connection, one that ends mid-frame applies nothing; a device that goes away is a typed
//! error at the client, not a hang.

use std::time::Duration;

use dpukv_client::{Client, ClientError};
use dpukv_net::fabric::{FabricAddr, FabricStream, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::Pod;

fn k(i: usize) -> Vec<u8> {
    format!("key{i:05}").into_bytes()
}

fn v(i: usize) -> Vec<u8> {
    format!("value-{i}-{}", "x".repeat(i % 300)).into_bytes()
}

#[test]
fn a_device_serves_the_protocol_over_its_fabric_endpoint() {
    let mut pod = Pod::start(&[], &["--fabric-listen", "127.0.0.1:0", "--fabric-provider", "tcp"]);
    assert!(pod.fabric.starts_with("fabric://tcp/127.0.0.1:"), "the device logs its endpoint: {:?}", pod.fabric);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let retry = dpukv_client::RetryPolicy { deadline: Duration::from_secs(5), ..Default::default() };
    let opts = dpukv_client::Options { pool: 2, ..Default::default() };
    let mut c = rt.block_on(Client::connect_with(&pod.fabric, opts)).expect("connect over the fabric");
    c.retry = retry;
    rt.block_on(async {
        for i in 0..500 {
            c.put(&k(i), &v(i)).await.expect("put");
        }
        // Values larger than a fabric buffer (64 KiB) cross in several messages.
        let big: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
        c.put(b"big", &big).await.expect("put big");
        assert_eq!(c.get(b"big").await.expect("get big"), Some(big));
        // Many requests in flight at once, from several tasks.
        let gets = (0..8).map(|t| {
            let c = c.clone();
            async move {
                for i in (t..500).step_by(8) {
                    assert_eq!(c.get(&k(i)).await.expect("get"), Some(v(i)));
                }
            }
        });
        for g in gets.map(|f| tokio::spawn(f)).collect::<Vec<_>>() {
            g.await.expect("task");
        }
        let items = c.scan(&k(0), &k(499), 1000).await.expect("scan");
        assert_eq!(items.len(), 500);
        assert_eq!(c.add_text(b"n", &[1, 2, 3]).await.expect("add_text"), vec![Some(1), Some(3), Some(6)]);
        // A request outside the limits gets the typed error it gets over TCP.
        let r = c.put(&vec![b'k'; dpukv_proto::limits::MAX_KEY + 1], b"v").await;
        assert!(matches!(r, Err(ClientError::Invalid(_) | ClientError::Server(_))), "{r:?}");
    });
    // A malicious frame (a header declaring more than the protocol allows) ends that connection
    // only; the device serves the others.
    rt.block_on(async {
        let at = FabricAddr::parse(&pod.fabric).expect("address");
        let mut s = FabricStream::connect(&at.provider, &at.host, at.port, Options::default(), Duration::from_secs(10))
            .await
            .expect("connect");
        let mut frame = ((dpukv_proto::limits::MAX_FRAME as u32) + 1).to_le_bytes().to_vec();
        frame.extend_from_slice(&[1, 1, 0, 0, 0, 0, 0, 0]);
        s.write_all(&frame).await.expect("write");
        s.flush().await.expect("flush");
        let mut buf = vec![0; 4096];
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "the device ended the connection that sent a bad frame");
        assert_eq!(c.get(&k(7)).await.expect("others are served"), Some(v(7)));
        // Connections that end in the middle of a frame (half a put, then gone), many times:
        // nothing of them is applied, and the device serves on.
        for i in 0..20 {
            let mut s =
                FabricStream::connect(&at.provider, &at.host, at.port, Options::default(), Duration::from_secs(10))
                    .await
                    .expect("connect");
            let mut frame = Vec::new();
            let put = dpukv_proto::Op::Put { key: b"half".to_vec(), value: vec![b'x'; 100_000] };
            dpukv_proto::encode_requests(&[dpukv_proto::Request::new(i, put)], &mut frame);
            s.write_all(&frame[..frame.len() / 2]).await.expect("write");
            s.flush().await.expect("flush");
            drop(s);
        }
        assert_eq!(c.get(b"half").await.expect("get"), None, "half a frame is never applied");
        assert_eq!(c.get(&k(9)).await.expect("others are served"), Some(v(9)));
    });
    // The device goes: the client's next request fails, typed, within its deadline.
    pod.device = None;
    let r = rt.block_on(async { tokio::time::timeout(Duration::from_secs(30), c.get(&k(1))).await });
    let r = r.expect("an answer, not a hang");
    assert!(r.is_err(), "a read from a device that is gone: {r:?}");
}

/// A fabric connection request past `--max-connections` is refused at once (before any buffer
/// is registered for it), not left to time out; once a connection goes, its slot serves again.
#[test]
fn fabric_requests_past_the_connection_limit_are_refused_at_once() {
    let pod =
        Pod::start(&[], &["--fabric-listen", "127.0.0.1:0", "--fabric-provider", "tcp", "--max-connections", "1"]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let at = FabricAddr::parse(&pod.fabric).expect("address");
    rt.block_on(async {
        let connect =
            || FabricStream::connect(&at.provider, &at.host, at.port, Options::PROTOCOL, Duration::from_secs(10));
        let first = connect().await.expect("the first connection");
        let began = std::time::Instant::now();
        let second = connect().await;
        assert!(second.is_err(), "a second connection past the limit");
        assert!(began.elapsed() < Duration::from_secs(5), "refused at once, not timed out: {:?}", began.elapsed());
        drop(first);
        // The slot is free again once the device saw the first go.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match connect().await {
                Ok(_) => break,
                Err(e) => {
                    assert!(std::time::Instant::now() < deadline, "the slot never came back: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
}
