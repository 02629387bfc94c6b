//! The bandwidth cap of a node's uploads: a token bucket in bytes, shared by every upload of
//! the process; an upload takes its object's bytes before sending them.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A token bucket of bytes: at most `rate` bytes a second, in bursts of at most one second's
/// worth (a request larger than a burst waits until the bucket would hold it, then empties it).
#[derive(Debug)]
pub struct Throttle {
    rate: u64,
    state: Mutex<(f64, Instant)>,
}

impl Throttle {
    /// A cap of `rate` bytes a second (0: none).
    pub fn new(rate: u64) -> Throttle {
        Throttle { rate, state: Mutex::new((rate as f64, Instant::now())) }
    }

    /// Waits until `bytes` may be sent.
    pub async fn take(&self, bytes: u64) {
        if self.rate == 0 {
            return;
        }
        let wait = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let rate = self.rate as f64;
            st.0 = (st.0 + now.duration_since(st.1).as_secs_f64() * rate).min(rate);
            st.1 = now;
            st.0 -= bytes as f64;
            // In debt: wait until it is paid back.
            if st.0 < 0.0 { Duration::from_secs_f64(-st.0 / rate) } else { Duration::ZERO }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn uploads_are_held_to_the_rate_after_one_burst() {
        let t = Throttle::new(100_000);
        let began = Instant::now();
        t.take(100_000).await; // the burst
        assert!(began.elapsed() < Duration::from_millis(50));
        for _ in 0..5 {
            t.take(20_000).await;
        }
        let took = began.elapsed();
        // 100 kB more at 100 kB/s: a second (a loaded machine may add, never take away).
        assert!(took >= Duration::from_millis(950), "{took:?}");
        assert!(took < Duration::from_secs(10), "{took:?}");
        let none = Throttle::new(0);
        none.take(u64::MAX).await;
    }
}
