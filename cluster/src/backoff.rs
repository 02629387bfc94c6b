//! Retry pacing for the cluster's control loops (master, election, membership, the node's
//! follower loop): exponential backoff with full jitter, reset after a success. A loop that meets
//! a transient error (etcd unreachable, a timeout) waits [`Backoff::wait`] and tries again —
//! forever; only the loop's owner decides that it ends. Also the random ids the cluster draws
//! ([`random_id`]), from the same source as the jitter.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// Exponential backoff between `min` and `max`, each wait drawn uniformly from its upper half
/// (so many nodes retrying after one etcd outage spread out, but no wait is shorter than half the
/// current step).
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    step: Duration,
}

impl Backoff {
    /// Waits from `min`, doubling up to `max`.
    pub fn new(min: Duration, max: Duration) -> Backoff {
        Backoff { min, max: max.max(min), step: min }
    }

    /// The next wait (and doubles the step).
    pub fn wait(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        let half = step / 2;
        half + half.mul_f64(jitter())
    }

    /// A success: the next wait starts from `min` again.
    pub fn reset(&mut self) {
        self.step = self.min;
    }
}

/// A random id, never 0 (the process's random hasher keys and the clock; no dependency for so
/// little): a fence's, a leader's life.
pub fn random_id() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish().max(1)
}

/// A number in [0, 1) from the process's random hasher keys (no dependency for so little).
fn jitter() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_and_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let waits: Vec<Duration> = (0..6).map(|_| b.wait()).collect();
        let steps = [100, 200, 400, 800, 800, 800];
        for (w, s) in waits.iter().zip(steps) {
            let s = Duration::from_millis(s);
            assert!(*w >= s / 2 && *w <= s, "{w:?} within [{:?}, {s:?}]", s / 2);
        }
        b.reset();
        assert!(b.wait() <= Duration::from_millis(100));
        // Jitter spreads the waits.
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let distinct: std::collections::HashSet<Duration> = (0..20).map(|_| b.wait()).collect();
        assert!(distinct.len() > 10, "waits are jittered: {distinct:?}");
    }
}
