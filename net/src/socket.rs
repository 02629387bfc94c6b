//! Liveness of long-lived TCP connections between the cluster's processes (replication streams,
//! the TLS bridges under them): a peer that vanished — powered off, partitioned, paused — must
//! cost a bounded time, not the kernel's default of ~15 minutes of retransmissions. Keep-alive
//! probes find an idle connection's peer gone; `TCP_USER_TIMEOUT` ends a connection whose sent
//! data stays unacknowledged, so a writer blocked on a full send buffer gets an error.

use std::os::fd::AsFd;
use std::time::Duration;

/// Ends `sock` once its peer has not answered for about `dead_after` (at least 3 s): keep-alive
/// probes start after a third of it idle and repeat every second, and data sent but not
/// acknowledged for `dead_after` fails the connection.
pub fn bound_liveness(sock: impl AsFd, dead_after: Duration) -> std::io::Result<()> {
    use rustix::net::sockopt;
    let dead_after = dead_after.max(Duration::from_secs(3));
    let idle = (dead_after / 3).max(Duration::from_secs(1));
    let probes = ((dead_after - idle).as_secs() as u32).max(1);
    sockopt::set_socket_keepalive(&sock, true)?;
    sockopt::set_tcp_keepidle(&sock, idle)?;
    sockopt::set_tcp_keepintvl(&sock, Duration::from_secs(1))?;
    sockopt::set_tcp_keepcnt(&sock, probes)?;
    sockopt::set_tcp_user_timeout(&sock, dead_after.as_millis().min(u128::from(u32::MAX)) as u32)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_are_set_on_a_real_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        bound_liveness(&c, Duration::from_secs(6)).expect("set");
        use rustix::net::sockopt;
        assert!(sockopt::socket_keepalive(&c).expect("keepalive"));
        assert_eq!(sockopt::tcp_keepidle(&c).expect("idle"), Duration::from_secs(2));
        assert_eq!(sockopt::tcp_keepcnt(&c).expect("count"), 4);
        assert_eq!(sockopt::tcp_user_timeout(&c).expect("user timeout"), 6000);
    }
}
