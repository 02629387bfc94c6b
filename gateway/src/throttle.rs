//! Failed authentications, throttled per peer address (docs/gateway.md, "Tokens"): a peer may
//! fail `burst` times in a row, then once per `window / burst`; past that its attempts — right
//! or wrong — are refused unheard until its allowance comes back, so guessing a token takes
//! years. (Each front end also ends a connection after [`PER_CONNECTION`] failures.)
//!
//! The table is bounded (`capacity` peers): a peer whose allowance is whole again is forgotten
//! first, then the one closest to it. IPv6 peers are counted per /64 (one host usually holds a
//! whole /64). Behind a proxy or a NAT every client shares the proxy's address: the allowance
//! is then theirs together.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failed authentications one connection may make; the next ends it.
pub const PER_CONNECTION: u32 = 3;

/// See the module documentation.
pub struct AuthThrottle {
    /// Per peer: when its allowance is whole again (the "theoretical arrival time" of the
    /// generic cell rate algorithm).
    peers: Mutex<HashMap<Peer, Instant>>,
    /// Time one failure costs.
    cost: Duration,
    /// Debt a peer may run up: `burst` failures.
    allowance: Duration,
    capacity: usize,
}

/// A peer's address as counted: IPv4 whole, IPv6 by its /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Peer {
    V4(u32),
    V6(u64),
}

impl Peer {
    fn of(ip: IpAddr) -> Peer {
        match ip {
            IpAddr::V4(a) => Peer::V4(a.into()),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => Peer::V4(v4.into()),
                None => Peer::V6((u128::from(a) >> 64) as u64),
            },
        }
    }
}

impl AuthThrottle {
    /// `burst` failures in a row per peer, then one per `window / burst`; at most `capacity`
    /// peers remembered.
    pub fn new(burst: u32, window: Duration, capacity: usize) -> AuthThrottle {
        let burst = burst.max(1);
        let cost = window / burst;
        AuthThrottle { peers: Mutex::new(HashMap::new()), cost, allowance: cost * burst, capacity: capacity.max(1) }
    }

    /// `Ok` if `ip` may try to authenticate now; else how long until it may.
    pub fn check(&self, ip: IpAddr) -> Result<(), Duration> {
        let now = Instant::now();
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        match peers.get(&Peer::of(ip)) {
            // One more failure must still fit in the allowance.
            Some(&whole_at) if whole_at + self.cost > now + self.allowance => {
                Err((whole_at + self.cost).saturating_duration_since(now + self.allowance))
            }
            _ => Ok(()),
        }
    }

    /// Counts a failed authentication by `ip`.
    pub fn failed(&self, ip: IpAddr) {
        let now = Instant::now();
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let peer = Peer::of(ip);
        if !peers.contains_key(&peer) && peers.len() >= self.capacity {
            peers.retain(|_, whole_at| *whole_at > now);
            if peers.len() >= self.capacity
                && let Some(soonest) = peers.iter().min_by_key(|(_, at)| **at).map(|(p, _)| *p)
            {
                peers.remove(&soonest);
            }
        }
        let at = peers.entry(peer).or_insert(now);
        *at = (*at).max(now) + self.cost;
    }

    /// Peers remembered.
    pub fn len(&self) -> usize {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("an address")
    }

    #[test]
    fn a_peer_gets_its_burst_then_waits() {
        let t = AuthThrottle::new(3, Duration::from_secs(300), 16);
        let a = ip("10.0.0.1");
        for _ in 0..3 {
            assert!(t.check(a).is_ok());
            t.failed(a);
        }
        let wait = t.check(a).expect_err("burst spent");
        assert!(wait > Duration::from_secs(90) && wait <= Duration::from_secs(100), "{wait:?}");
        assert!(t.check(ip("10.0.0.2")).is_ok(), "other peers are not affected");
        // One /64 is one peer; a v4-mapped address is its v4 address.
        let v6 = AuthThrottle::new(1, Duration::from_secs(60), 16);
        v6.failed(ip("2001:db8::1"));
        assert!(v6.check(ip("2001:db8::ffff")).is_err());
        assert!(v6.check(ip("2001:db8:0:1::1")).is_ok());
        v6.failed(ip("::ffff:10.0.0.9"));
        assert!(v6.check(ip("10.0.0.9")).is_err());
    }

    #[test]
    fn the_allowance_comes_back() {
        let t = AuthThrottle::new(2, Duration::from_millis(100), 16);
        let a = ip("10.0.0.1");
        t.failed(a);
        t.failed(a);
        assert!(t.check(a).is_err());
        std::thread::sleep(Duration::from_millis(60));
        assert!(t.check(a).is_ok(), "one failure's cost has passed");
    }

    #[test]
    fn the_table_stays_bounded() {
        let t = AuthThrottle::new(1, Duration::from_secs(60), 64);
        for i in 0..1000u32 {
            t.failed(IpAddr::V4(i.into()));
            assert!(t.len() <= 64);
        }
        assert!(t.check(IpAddr::V4(999u32.into())).is_err(), "the newest peer is remembered");
    }
}
