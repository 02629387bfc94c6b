//! Readers see a write once it may be acknowledged, not before. Under `FsyncPolicy::Always` an L0
//! arena's writer does not publish its read version itself; the region queues (log end of a
//! group, last version of the group in this arena) and the value log's flusher publishes each
//! entry once its sync covers the entry's end — before it releases any waiter. A reader (the
//! device) therefore never returns a value that a power loss could take back, and an
//! acknowledged write is visible to every read that starts after the acknowledgement.
//!
//! Under `Interval` and `Never` a write is acknowledged once written to the OS, and the writer
//! publishes at once: readers see exactly the acknowledged writes there too.
//!
//! A replicated region (a cluster's primary) is also *gated* ([`ReadGate`]): an entry is published
//! only once its end is below both the synced position and a bound its owner sets — the log
//! position every backup of the region holds. A read can then never return a write a failover
//! could take back (docs/cluster.md §5). The bound may go down (a new backup set that holds less):
//! what is published stays published, later writes wait for the new set.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::btree::ReadPublisher;
use crate::vlog::{Lsn, SyncHook};

struct State {
    /// Everything before this log position is synced (`u64::MAX` when syncs do not gate).
    synced: u64,
    /// Everything before this log position may be shown (`u64::MAX` when ungated).
    bound: u64,
    /// (log end, version, arena) in log order.
    queue: VecDeque<(u64, u64, ReadPublisher)>,
}

impl State {
    fn threshold(&self) -> u64 {
        self.synced.min(self.bound)
    }

    fn drain(&mut self) {
        let t = self.threshold();
        while self.queue.front().is_some_and(|e| e.0 <= t) {
            let (_, version, p) = self.queue.pop_front().expect("front exists");
            p.publish(version);
        }
    }
}

/// See the module documentation.
pub(crate) struct Publications {
    st: Mutex<State>,
    cv: Condvar,
}

impl Publications {
    /// A queue whose log is synced up to `synced` (`u64::MAX`: syncs do not gate), ungated.
    pub(crate) fn new(synced: Lsn) -> Arc<Publications> {
        Arc::new(Publications {
            st: Mutex::new(State { synced: synced.0, bound: u64::MAX, queue: VecDeque::new() }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hook the value log's flusher calls with each new synced position.
    pub(crate) fn hook(self: &Arc<Self>) -> SyncHook {
        let me = self.clone();
        Arc::new(move |lsn: Lsn| me.synced(lsn))
    }

    fn synced(&self, lsn: Lsn) {
        let mut st = self.lock();
        st.synced = st.synced.max(lsn.0);
        st.drain();
        self.cv.notify_all();
    }

    /// Publishes `version` of the arena behind `p` once the log is synced (and, gated, shown) up
    /// to `end` (at once if it already is). Entries arrive in log order.
    pub(crate) fn push(&self, end: Lsn, version: u64, p: &ReadPublisher) {
        let mut st = self.lock();
        if end.0 <= st.threshold() && st.queue.is_empty() {
            p.publish(version);
        } else {
            st.queue.push_back((end.0, version, p.clone()));
            st.drain();
        }
    }

    /// Gates publication by a bound, starting at `bound`.
    pub(crate) fn gate(&self, bound: Lsn) {
        self.lock().bound = bound.0;
    }

    /// Whether publication is gated by a bound.
    pub(crate) fn gated(&self) -> bool {
        self.lock().bound != u64::MAX
    }

    fn set_bound(&self, bound: Lsn) {
        let mut st = self.lock();
        st.bound = bound.0;
        st.drain();
        self.cv.notify_all();
    }

    /// Whether a gate holds back writes ending at or before `upto` (they are not synced and
    /// shown yet); false when ungated.
    pub(crate) fn gate_holds(&self, upto: Lsn) -> bool {
        let st = self.lock();
        st.bound != u64::MAX && st.threshold() < upto.0
    }

    /// Waits up to `timeout` until everything before `upto` may be shown (synced and below the
    /// bound); whether it may.
    pub(crate) fn wait_shown(&self, upto: Lsn, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if st.threshold() >= upto.0 {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// The handle a replicated region's owner moves the bound with: readers see the region's writes
/// only below it (and below the synced position). Obtained from
/// [`Region::gate_reads`](super::Region::gate_reads).
#[derive(Clone)]
pub struct ReadGate(pub(crate) Arc<Publications>);

impl ReadGate {
    /// Readers may see every write that ends at or before `bound` (and is synced); later ones
    /// wait. The bound may go down: what readers see already stays visible.
    pub fn set_bound(&self, bound: Lsn) {
        self.0.set_bound(bound);
    }

    /// Waits up to `timeout` until every write ending at or before `upto` is visible; whether it
    /// is.
    pub fn wait_shown(&self, upto: Lsn, timeout: Duration) -> bool {
        self.0.wait_shown(upto, timeout)
    }
}

impl std::fmt::Debug for ReadGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.0.lock();
        f.debug_struct("ReadGate").field("synced", &st.synced).field("bound", &st.bound).finish()
    }
}
