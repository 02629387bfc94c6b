//! Each connection's share of the process's byte budget (`--memory-budget`, shared with the
//! binary front end's `dpukv_net::conn`). A connection of the RESP front end holds what it
//! buffers and reserves for replies in its [`Share`]: at most `--conn-memory` bytes of its own,
//! each byte also taken from the process's budget. So no connection can take more than its
//! share, and a connection that must wait for the process's budget waits holding nothing but its
//! input (the front end writes what it has answered first), so connections never wait on each
//! other in a cycle; a wait is bounded in time by its caller.
//!
//! Reservations are taken only once the connection has authenticated (before that, a connection
//! holds a fixed input buffer and nothing else), and given back when dropped — on every path,
//! errors included.
//!
//! [`Starvation`] watches the process's budget: `/readyz` reports a budget that has stayed
//! spent, so that a stalled gateway stops looking healthy to its load balancer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dpukv_net::conn::Budget;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// One connection's share (see the module documentation).
pub struct Share {
    own: Arc<Semaphore>,
    budget: Budget,
    size: usize,
}

/// Bytes held from a share (and from the process's budget) until dropped.
#[derive(Debug, Default)]
pub struct Held {
    own: Option<OwnedSemaphorePermit>,
    global: Option<OwnedSemaphorePermit>,
}

impl Held {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.own.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }

    /// Gives back all but `keep` bytes.
    pub fn shrink_to(&mut self, keep: usize) {
        let extra = self.bytes().saturating_sub(keep);
        if extra > 0 {
            drop(self.own.as_mut().and_then(|p| p.split(extra)));
            drop(self.global.as_mut().and_then(|p| p.split(extra)));
        }
    }

    /// Adds `other`'s bytes to these.
    pub fn merge(&mut self, other: Held) {
        for (mine, theirs) in [(&mut self.own, other.own), (&mut self.global, other.global)] {
            match (mine.as_mut(), theirs) {
                (Some(m), Some(t)) => m.merge(t),
                (None, t) => *mine = t,
                (_, None) => {}
            }
        }
    }
}

impl Share {
    /// A share of `size` bytes of `budget` (at most the whole budget).
    pub fn new(budget: &Budget, size: usize) -> Share {
        let size = size.clamp(1, budget.total().min(u32::MAX as usize));
        Share { own: Arc::new(Semaphore::new(size)), budget: budget.clone(), size }
    }

    /// Its size.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes of it free now.
    pub fn free(&self) -> usize {
        self.own.available_permits()
    }

    /// Takes `n` bytes (at most the share's size) if both the share and the process's budget
    /// have them now.
    pub fn try_take(&self, n: usize) -> Option<Held> {
        let n = n.min(self.size) as u32;
        let own = self.own.clone().try_acquire_many_owned(n).ok()?;
        let global = self.budget.try_hold(n as usize)?;
        Some(Held { own: Some(own), global: Some(global) })
    }

    /// Takes `n` bytes (at most the share's size), waiting while the share or the process's
    /// budget is spent. The caller bounds the wait, and holds nothing else of the share while
    /// it waits for more than the share has free.
    pub async fn take(&self, n: usize) -> Held {
        let n = n.min(self.size) as u32;
        let own = self.own.clone().acquire_many_owned(n).await.ok();
        let global = Some(self.budget.hold(n as usize).await);
        Held { own, global }
    }
}

/// Whether the process's budget has stayed spent: it is looked at every `every`, and counts as
/// spent while less than `want` bytes of it are free (room for one value read).
pub struct Starvation {
    since: Mutex<Option<tokio::time::Instant>>,
}

impl Starvation {
    /// Starts watching `budget` until `stop`.
    pub fn watch(
        budget: Budget,
        want: usize,
        every: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) -> Arc<Starvation> {
        let me = Arc::new(Starvation { since: Mutex::new(None) });
        let watched = me.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                let mut since = watched.since.lock().unwrap_or_else(|e| e.into_inner());
                if budget.available() >= want.min(budget.total()) {
                    *since = None;
                } else if since.is_none() {
                    *since = Some(tokio::time::Instant::now());
                }
            }
        });
        me
    }

    /// How long the budget has been spent, if it is.
    pub fn spent_for(&self) -> Option<Duration> {
        self.since.lock().unwrap_or_else(|e| e.into_inner()).map(|t| t.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway whose budget was held by one client looked healthy: `/readyz` now asks this.
    #[tokio::test(start_paused = true)]
    async fn a_spent_budget_is_seen_and_forgotten_when_it_comes_back() {
        let budget = Budget::new(100);
        let stop = tokio_util::sync::CancellationToken::new();
        let s = Starvation::watch(budget.clone(), 10, Duration::from_millis(500), stop.clone());
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(s.spent_for(), None);
        let all = budget.hold(95).await;
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert!(s.spent_for().is_some_and(|d| d >= Duration::from_secs(5)), "{:?}", s.spent_for());
        drop(all);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(s.spent_for(), None);
        stop.cancel();
    }

    #[tokio::test]
    async fn a_share_bounds_one_connection_and_gives_everything_back() {
        let budget = Budget::new(100);
        let a = Share::new(&budget, 40);
        let b = Share::new(&budget, 40);
        let mut x = a.try_take(30).expect("room");
        assert!(a.try_take(20).is_none(), "past the share");
        let y = b.try_take(40).expect("another connection's own share");
        assert_eq!(budget.used(), 70);
        x.shrink_to(10);
        assert_eq!((a.free(), budget.used()), (30, 50));
        x.merge(a.take(25).await);
        assert_eq!(x.bytes(), 35);
        assert!(a.try_take(1000).is_none(), "clamped to the share, which is partly held");
        drop((x, y));
        assert_eq!((a.free(), b.free(), budget.used()), (40, 40, 0));
    }
}
