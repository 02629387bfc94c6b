//! A bounded HTTP/1.1 server for a process's admin endpoint (module `admin`) and a host's
//! control API (module `control`): at most [`Limits::max_connections`] connections (more are
//! closed at once, handshaking ones included), a request's header within
//! [`Limits::header_timeout`], a connection's whole life within [`Limits::max_life`] (so an
//! idle keep-alive connection is let go), TLS handshakes off the accepting task (within
//! `dpukv_net::tls::HANDSHAKE_TIMEOUT`). Each request carries the connection's
//! [`Peer`](dpukv_net::identity::Peer) as an extension (`Peer::Unchecked` without TLS).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dpukv_net::tls::ServerTls;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::Service;

/// The bounds of one server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections at once (handshaking or served).
    pub max_connections: usize,
    /// From a connection's start (or its previous answer) to a complete request header.
    pub header_timeout: Duration,
    /// A connection's longest life (requests in flight are cut with it).
    pub max_life: Duration,
    /// Serve more than one request per connection.
    pub keep_alive: bool,
}

/// Binds `addr` and serves `app` within `limits` until `shutdown` (with TLS when `tls` is given);
/// returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    tls: Option<Arc<ServerTls>>,
    app: axum::Router,
    limits: Limits,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::spawn(async move {
        loop {
            let tcp = tokio::select! {
                _ = shutdown.cancelled() => return,
                a = listener.accept() => match a {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of descriptors, say: do not spin.
                        tracing::debug!(error = %e, "accepting an HTTP connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                tracing::debug!(addr = %local, "HTTP connection limit reached; closing one");
                drop(tcp);
                continue;
            };
            let (tls, app, stop) = (tls.clone(), app.clone(), shutdown.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let _ = tcp.set_nodelay(true);
                let (stream, peer) = match dpukv_net::tls::accept_peer(tls.as_deref(), tcp).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(error = %e, "an HTTP client failed the TLS handshake");
                        return;
                    }
                };
                let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(peer.clone());
                    let mut app = app.clone();
                    async move { app.call(req).await }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .keep_alive(limits.keep_alive)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => {}
                    _ = tokio::time::sleep(limits.max_life) => {}
                    _ = stop.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(Duration::from_secs(2), conn).await;
                    }
                }
            });
        }
    });
    Ok(local)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Instant;

    use axum::routing::get;

    use super::*;

    async fn start(limits: Limits) -> (SocketAddr, CancellationToken) {
        let stop = CancellationToken::new();
        let app = axum::Router::new().route("/x", get(|| async { "ok\n" }));
        let addr = serve("127.0.0.1:0".parse().expect("addr"), None, app, limits, stop.clone()).await.expect("serve");
        (addr, stop)
    }

    /// Reads what the server sends until it closes (or 10 s pass): how long that took and what.
    fn until_closed(mut s: std::net::TcpStream) -> (Duration, String) {
        let t = Instant::now();
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        (t.elapsed(), String::from_utf8_lossy(&out).into_owned())
    }

    /// A client that opens a connection and sends half a header, or nothing, loses it after the
    /// header timeout; one past the connection cap is closed at once; a request is answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_idle_and_surplus_connections_are_let_go() {
        let limits = Limits {
            max_connections: 2,
            header_timeout: Duration::from_millis(500),
            max_life: Duration::from_secs(3),
            keep_alive: true,
        };
        let (addr, stop) = start(limits).await;
        let results = tokio::task::spawn_blocking(move || {
            let mut half = std::net::TcpStream::connect(addr).expect("connect");
            half.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n").expect("write");
            let idle = std::net::TcpStream::connect(addr).expect("connect");
            std::thread::sleep(Duration::from_millis(100));
            // Both permits are taken: a third is closed without an answer.
            let third = std::net::TcpStream::connect(addr).expect("connect");
            let (t3, out3) = until_closed(third);
            let (t1, _) = until_closed(half);
            let (t2, _) = until_closed(idle);
            // The permits are back: a request is served.
            let mut ok = std::net::TcpStream::connect(addr).expect("connect");
            ok.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").expect("write");
            let (_, answer) = until_closed(ok);
            (t1, t2, t3, out3, answer)
        })
        .await
        .expect("client");
        let (t1, t2, t3, out3, answer) = results;
        assert!(t3 < Duration::from_millis(400) && out3.is_empty(), "the surplus connection: {t3:?} {out3:?}");
        assert!(t1 < Duration::from_secs(3), "half a header held the connection {t1:?}");
        assert!(t2 < Duration::from_secs(4), "an idle connection was held {t2:?}");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok\n"), "{answer}");
        stop.cancel();
    }
}
