//! Recording a history: each client stamps invocations and responses with a shared monotonic
//! clock and appends events; the checker reads them after the run.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::linearizability::{Event, KeyOp};

/// A shared, append-only history.
#[derive(Clone)]
pub struct History {
    start: Instant,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Default for History {
    fn default() -> Self {
        History { start: Instant::now(), events: Arc::new(Mutex::new(Vec::new())) }
    }
}

impl History {
    /// Nanoseconds since the history began.
    pub fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Records one operation on one key.
    pub fn record(&self, key: &[u8], op: KeyOp, call: u64, ret: Option<u64>) {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).push(Event { key: key.to_vec(), op, call, ret });
    }

    /// Records several events (a projected scan).
    pub fn extend(&self, evs: Vec<Event>) {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).extend(evs);
    }

    /// How many events are recorded.
    pub fn len(&self) -> usize {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether nothing is recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Everything recorded so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
