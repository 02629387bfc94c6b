//! The bandwidth cap of a node's uploads: a token bucket in bytes, shared by every upload of
//! the process; an upload takes its object's bytes before sending them. The cap adapts to the
//! foreground ([`Pace`]): a node whose writers are busy uploads at a lower rate, so a backup
//! takes longer rather than taking the writers' CPU and disk.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A token bucket of bytes: at most `rate` bytes a second, in bursts of at most one second's
/// worth (a request larger than a burst waits until the bucket would hold it, then empties it).
#[derive(Debug)]
pub struct Throttle {
    rate: AtomicU64,
    state: Mutex<(f64, Instant)>,
}

impl Throttle {
    /// A cap of `rate` bytes a second (0: none).
    pub fn new(rate: u64) -> Throttle {
        Throttle { rate: AtomicU64::new(rate), state: Mutex::new((rate as f64, Instant::now())) }
    }

    /// The cap from now on (0: none); what the bucket holds is kept, up to a second's worth.
    pub fn set_rate(&self, rate: u64) {
        self.rate.store(rate, Ordering::Relaxed);
    }

    /// The cap now.
    pub fn rate(&self) -> u64 {
        self.rate.load(Ordering::Relaxed)
    }

    /// Waits until `bytes` may be sent.
    pub async fn take(&self, bytes: u64) {
        let rate = self.rate();
        if rate == 0 {
            return;
        }
        let wait = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let rate = rate as f64;
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

/// Writes a second above which a node's writers count as busy.
pub const BUSY_WRITES_PER_SEC: u64 = 100;
/// How often [`Pace`] looks again.
pub const PACE_EVERY: Duration = Duration::from_millis(250);

/// Which cap a node's uploads get: `idle` while its writers apply fewer than
/// [`BUSY_WRITES_PER_SEC`], `busy` (lower) while they apply more — measured over the last
/// [`PACE_EVERY`] from a count of writes applied.
#[derive(Debug, Clone)]
pub struct Pace {
    idle: u64,
    busy: u64,
    last: Option<(u64, Instant)>,
}

impl Pace {
    /// Caps in bytes a second (0: none); the busy cap is never above the idle one.
    pub fn new(idle: u64, busy: u64) -> Pace {
        let busy = match (idle, busy) {
            (0, b) => b,
            (i, 0) => i,
            (i, b) => i.min(b),
        };
        Pace { idle, busy, last: None }
    }

    /// The writes applied so far (a counter that only grows) at `now`: the cap to set, once a
    /// window of [`PACE_EVERY`] has passed since the last one.
    pub fn observe(&mut self, writes: u64, now: Instant) -> Option<u64> {
        let Some((before, then)) = self.last else {
            self.last = Some((writes, now));
            return None;
        };
        let took = now.saturating_duration_since(then);
        if took < PACE_EVERY {
            return None;
        }
        self.last = Some((writes, now));
        let per_sec = writes.saturating_sub(before) as f64 / took.as_secs_f64();
        Some(if per_sec >= BUSY_WRITES_PER_SEC as f64 { self.busy } else { self.idle })
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
        // A cap set later holds from then on.
        let t = Throttle::new(0);
        t.set_rate(100_000);
        let began = Instant::now();
        t.take(100_000).await;
        t.take(50_000).await;
        assert!(began.elapsed() >= Duration::from_millis(450), "{:?}", began.elapsed());
    }

    #[test]
    fn uploads_slow_down_while_the_writers_are_busy() {
        let mut p = Pace::new(200, 40);
        let t0 = Instant::now();
        assert_eq!(p.observe(0, t0), None, "the first look only starts a window");
        assert_eq!(p.observe(10, t0 + PACE_EVERY / 2), None, "within the window");
        // 10 writes in 250 ms: 40/s, idle.
        assert_eq!(p.observe(10, t0 + PACE_EVERY), Some(200));
        // 50 more in the next 250 ms: 200/s, busy.
        assert_eq!(p.observe(60, t0 + 2 * PACE_EVERY), Some(40));
        // None in the next: idle again.
        assert_eq!(p.observe(60, t0 + 3 * PACE_EVERY), Some(200));
        // A busy node never uploads faster than an idle one.
        let mut p = Pace::new(10, 40);
        p.observe(0, t0);
        assert_eq!(p.observe(1000, t0 + PACE_EVERY), Some(10));
    }
}
