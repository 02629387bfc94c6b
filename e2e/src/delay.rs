//! A TCP proxy that delays every byte by an adjustable amount, in order — a slow link to etcd
//! (this kernel has no netem; docs/cluster.md §4 asks for a test with a slow etcd). Each
//! accepted connection gets two pumps (one per direction); each pump reads what arrives, stamps
//! it with when it may go on, and a writer sends it at that time. What is in flight is bounded
//! (1,024 reads per direction): a sender outrunning the delay is slowed, never buffered without
//! limit.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;

/// Reads in flight per direction.
const IN_FLIGHT: usize = 1024;

/// A running proxy; stops (and closes its connections) when dropped.
pub struct DelayProxy {
    addr: SocketAddr,
    delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl DelayProxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `target`.
    pub fn start(target: SocketAddr) -> Result<DelayProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (delay_ms, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (d, st) = (delay_ms.clone(), stop.clone());
        std::thread::Builder::new().name("delay-accept".into()).spawn(move || {
            while !st.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let Ok(server) = TcpStream::connect(target) else { continue };
                        let _ = client.set_nonblocking(false);
                        for (from, to) in [(&client, &server), (&server, &client)] {
                            if let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) {
                                pump(from, to, d.clone(), st.clone());
                            }
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        })?;
        Ok(DelayProxy { addr, delay_ms, stop })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its address as a URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Delays every byte that arrives from now on by `d` (each way).
    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::Release);
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Copies `from` to `to`, each read held back until the delay has passed.
fn pump(mut from: TcpStream, mut to: TcpStream, delay_ms: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Instant, Vec<u8>)>(IN_FLIGHT);
    let _ = from.set_read_timeout(Some(Duration::from_millis(100)));
    let reader_stop = stop.clone();
    let mut closer = to.try_clone().ok();
    let _ = std::thread::Builder::new().name("delay-read".into()).spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        while !reader_stop.load(Ordering::Acquire) {
            match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let due = Instant::now() + Duration::from_millis(delay_ms.load(Ordering::Acquire));
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(_) => break,
            }
        }
        let _ = from.shutdown(Shutdown::Read);
    });
    let _ = std::thread::Builder::new().name("delay-write".into()).spawn(move || {
        while let Ok((due, bytes)) = rx.recv() {
            if stop.load(Ordering::Acquire) {
                break;
            }
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            if to.write_all(&bytes).is_err() {
                break;
            }
        }
        if let Some(c) = closer.take() {
            let _ = c.shutdown(Shutdown::Write);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_arrive_in_order_after_the_delay() {
        let echo = TcpListener::bind("127.0.0.1:0").expect("bind");
        let target = echo.local_addr().expect("addr");
        std::thread::spawn(move || {
            let (mut s, _) = echo.accept().expect("accept");
            let mut buf = [0u8; 1024];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 || s.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        });
        let p = DelayProxy::start(target).expect("proxy");
        let mut c = TcpStream::connect(p.addr()).expect("connect");
        let mut round_trip = |msg: &[u8]| {
            let t = Instant::now();
            c.write_all(msg).expect("write");
            let mut got = vec![0u8; msg.len()];
            c.read_exact(&mut got).expect("read");
            assert_eq!(got, msg);
            t.elapsed()
        };
        assert!(round_trip(b"fast") < Duration::from_millis(150));
        p.set_delay(Duration::from_millis(150));
        let slow = round_trip(b"slow, in order");
        assert!(slow >= Duration::from_millis(300), "two delayed legs: {slow:?}");
    }
}
