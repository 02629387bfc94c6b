//! Readers see a write once it may be acknowledged, not before. Under `FsyncPolicy::Always` an L0
//! arena's writer does not publish its read version itself; the region queues (log end of a
//! group, last version of the group in this arena) and the value log's flusher publishes each
//! entry once its sync covers the entry's end — before it releases any waiter. A reader (the
//! device) therefore never returns a value that a power loss could take back, and an
//! acknowledged write is visible to every read that starts after the acknowledgement.
//!
//! Under `Interval` and `Never` a write is acknowledged once written to the OS, and the writer
//! publishes at once: readers see exactly the acknowledged writes there too.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::btree::ReadPublisher;
use crate::vlog::{Lsn, SyncHook};

#[derive(Default)]
struct State {
    /// Everything before this log position is synced.
    synced: u64,
    /// (log end, version, arena) in log order.
    queue: VecDeque<(u64, u64, ReadPublisher)>,
}

/// See the module documentation.
#[derive(Default)]
pub(crate) struct Publications {
    st: Mutex<State>,
}

impl Publications {
    /// A queue whose log is synced up to `synced`.
    pub(crate) fn new(synced: Lsn) -> Arc<Publications> {
        Arc::new(Publications { st: Mutex::new(State { synced: synced.0, queue: VecDeque::new() }) })
    }

    /// The hook the value log's flusher calls with each new synced position.
    pub(crate) fn hook(self: &Arc<Self>) -> SyncHook {
        let me = self.clone();
        Arc::new(move |lsn: Lsn| me.synced(lsn))
    }

    fn synced(&self, lsn: Lsn) {
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        st.synced = st.synced.max(lsn.0);
        while st.queue.front().is_some_and(|e| e.0 <= lsn.0) {
            let (_, version, p) = st.queue.pop_front().expect("front exists");
            p.publish(version);
        }
    }

    /// Publishes `version` of the arena behind `p` once the log is synced up to `end` (at once if
    /// it already is). Entries arrive in log order.
    pub(crate) fn push(&self, end: Lsn, version: u64, p: &ReadPublisher) {
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        if end.0 <= st.synced {
            p.publish(version);
        } else {
            st.queue.push_back((end.0, version, p.clone()));
        }
    }
}
