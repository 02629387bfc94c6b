//! [`MemStore`]: the metadata store in process, with etcd's semantics — one revision counter
//! (a transaction's changes share one revision), leases that end when not kept alive and delete
//! their keys, and watches that replay retained history then follow live changes.
//!
//! Bounds: history of the last [`HISTORY`] changes (older watch starts get
//! [`MetaError::Compacted`]); each watch queues at most [`WATCH_QUEUE`] events (then it ends with
//! [`MetaError::WatchLagged`]). Leases are ended by a reaper task every 20 ms and checked before
//! every operation, so no operation sees a lease past its deadline.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::meta::{
    Compare, KeyValue, LeaseId, MetaError, MetaStore, Result, Revision, Txn, TxnOp, TxnResult, WATCH_QUEUE, Watch,
    WatchEvent,
};

/// Changes kept for watches that start in the past.
pub const HISTORY: usize = 10_000;

/// The in-process metadata store. Cloning shares it. Needs a Tokio runtime (its lease reaper).
#[derive(Clone)]
pub struct MemStore {
    state: Arc<Mutex<State>>,
}

struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<Vec<u8>>,
}

struct Watcher {
    prefix: Vec<u8>,
    tx: mpsc::Sender<Result<WatchEvent>>,
}

#[derive(Default)]
struct State {
    rev: Revision,
    kvs: BTreeMap<Vec<u8>, KeyValue>,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
    history: VecDeque<WatchEvent>,
    /// The newest revision no longer in `history`.
    compacted: Revision,
    watchers: Vec<Watcher>,
}

/// The most compares, or operations of either branch, a transaction may hold: etcd's default
/// `--max-txn-ops`.
pub const MAX_TXN_OPS: usize = 128;

impl Default for MemStore {
    fn default() -> Self {
        MemStore::new()
    }
}

impl MemStore {
    /// An empty store (revision 0). Must be called within a Tokio runtime.
    pub fn new() -> MemStore {
        let state = Arc::new(Mutex::new(State { next_lease: 1, ..State::default() }));
        let weak: Weak<Mutex<State>> = Arc::downgrade(&state);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let Some(state) = weak.upgrade() else { return };
                lock(&state).expire(Instant::now());
            }
        });
        MemStore { state }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut st = lock(&self.state);
        st.expire(Instant::now());
        f(&mut st)
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl State {
    /// Ends the leases past their deadline (each deletion its own revision, as in etcd).
    fn expire(&mut self, now: Instant) {
        let due: Vec<LeaseId> = self.leases.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| *id).collect();
        for id in due {
            self.end_lease(id);
        }
    }

    fn end_lease(&mut self, id: LeaseId) -> bool {
        let Some(lease) = self.leases.remove(&id) else { return false };
        if !lease.keys.is_empty() {
            self.rev += 1;
            for key in lease.keys {
                if self.kvs.remove(&key).is_some() {
                    self.emit(WatchEvent::Delete { key, revision: self.rev });
                }
            }
        }
        true
    }

    fn holds(&self, c: &Compare) -> bool {
        match c {
            Compare::Absent(k) => !self.kvs.contains_key(k),
            Compare::ModRevision(k, r) => self.kvs.get(k).is_some_and(|kv| kv.mod_revision == *r),
            Compare::CreateRevision(k, r) => self.kvs.get(k).is_some_and(|kv| kv.create_revision == *r),
            Compare::Value(k, v) => self.kvs.get(k).is_some_and(|kv| &kv.value == v),
            Compare::UnchangedSince(p, r) => {
                self.kvs.range(p.clone()..).take_while(|(k, _)| k.starts_with(p)).all(|(_, kv)| kv.mod_revision <= *r)
            }
        }
    }

    fn txn(&mut self, txn: Txn) -> Result<TxnResult> {
        // etcd's `--max-txn-ops` (128 by default): more compares or operations are refused.
        if [txn.when.len(), txn.then.len(), txn.otherwise.len()].iter().any(|&n| n > MAX_TXN_OPS) {
            return Err(MetaError::Invalid("too many operations in txn request".into()));
        }
        let succeeded = txn.when.iter().all(|c| self.holds(c));
        let ops = if succeeded { txn.then } else { txn.otherwise };
        // Checked before anything changes: a transaction is applied whole or not at all.
        for op in &ops {
            match op {
                TxnOp::Put { key, lease, .. } => {
                    if key.is_empty() {
                        return Err(MetaError::Invalid("empty key".into()));
                    }
                    if let Some(l) = lease
                        && !self.leases.contains_key(l)
                    {
                        return Err(MetaError::LeaseNotFound(*l));
                    }
                }
                TxnOp::Delete { key } if key.is_empty() => return Err(MetaError::Invalid("empty key".into())),
                TxnOp::Delete { .. } => {}
            }
        }
        let rev = self.rev + 1;
        let mut changed = false;
        for op in ops {
            match op {
                TxnOp::Put { key, value, lease } => {
                    let old = self.kvs.get(&key);
                    let create_revision = old.map_or(rev, |kv| kv.create_revision);
                    if let Some(l) = old.and_then(|kv| kv.lease)
                        && let Some(lease) = self.leases.get_mut(&l)
                    {
                        lease.keys.remove(&key);
                    }
                    if let Some(l) = lease {
                        self.leases.get_mut(&l).expect("checked above").keys.insert(key.clone());
                    }
                    let kv = KeyValue { key: key.clone(), value, create_revision, mod_revision: rev, lease };
                    self.kvs.insert(key, kv.clone());
                    self.emit(WatchEvent::Put(kv));
                    changed = true;
                }
                TxnOp::Delete { key } => {
                    if let Some(kv) = self.kvs.remove(&key) {
                        if let Some(lease) = kv.lease.and_then(|l| self.leases.get_mut(&l)) {
                            lease.keys.remove(&key);
                        }
                        self.emit(WatchEvent::Delete { key, revision: rev });
                        changed = true;
                    }
                }
            }
        }
        if changed {
            self.rev = rev;
        }
        Ok(TxnResult { succeeded, revision: self.rev })
    }

    fn emit(&mut self, ev: WatchEvent) {
        self.watchers.retain(|w| deliver(w, &ev));
        self.history.push_back(ev);
        while self.history.len() > HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.revision();
            }
        }
    }
}

/// Sends `ev` to `w` if it is under its prefix; false once the watch is over (gone, or lagging:
/// the last free place carries the error).
fn deliver(w: &Watcher, ev: &WatchEvent) -> bool {
    if w.tx.is_closed() {
        return false;
    }
    if !ev.key().starts_with(&w.prefix) {
        return true;
    }
    if w.tx.capacity() <= 1 {
        let _ = w.tx.try_send(Err(MetaError::WatchLagged));
        return false;
    }
    w.tx.try_send(Ok(ev.clone())).is_ok()
}

impl MetaStore for MemStore {
    async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>> {
        Ok(self.with(|st| st.kvs.get(key).cloned()))
    }

    async fn range(&self, prefix: &[u8]) -> Result<(Vec<KeyValue>, Revision)> {
        Ok(self.with(|st| {
            let kvs =
                st.kvs.range(prefix.to_vec()..).take_while(|(k, _)| k.starts_with(prefix)).map(|(_, v)| v.clone());
            (kvs.collect(), st.rev)
        }))
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResult> {
        self.with(|st| st.txn(txn))
    }

    async fn delete_prefix(&self, prefix: &[u8]) -> Result<u64> {
        if prefix.is_empty() {
            return Err(MetaError::Invalid("an empty prefix".into()));
        }
        self.with(|st| {
            let keys: Vec<Vec<u8>> = st
                .kvs
                .range(prefix.to_vec()..)
                .map(|(k, _)| k)
                .take_while(|k| k.starts_with(prefix))
                .cloned()
                .collect();
            let n = keys.len() as u64;
            st.txn(Txn { then: keys.into_iter().map(|key| TxnOp::Delete { key }).collect(), ..Txn::default() })?;
            Ok(n)
        })
    }

    async fn grant(&self, ttl: Duration) -> Result<LeaseId> {
        if ttl.is_zero() {
            return Err(MetaError::Invalid("a lease needs a positive TTL".into()));
        }
        Ok(self.with(|st| {
            let id = st.next_lease;
            st.next_lease += 1;
            st.leases.insert(id, Lease { ttl, deadline: Instant::now() + ttl, keys: BTreeSet::new() });
            id
        }))
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        self.with(|st| match st.leases.get_mut(&lease) {
            Some(l) => {
                l.deadline = Instant::now() + l.ttl;
                Ok(())
            }
            None => Err(MetaError::LeaseNotFound(lease)),
        })
    }

    async fn revoke(&self, lease: LeaseId) -> Result<()> {
        self.with(|st| if st.end_lease(lease) { Ok(()) } else { Err(MetaError::LeaseNotFound(lease)) })
    }

    async fn watch(&self, prefix: &[u8], from: Revision) -> Result<Watch> {
        self.with(|st| {
            let from = if from <= 0 { st.rev + 1 } else { from };
            if from <= st.compacted {
                return Err(MetaError::Compacted(from));
            }
            let (tx, rx) = mpsc::channel(WATCH_QUEUE + 1);
            let w = Watcher { prefix: prefix.to_vec(), tx };
            let past: Vec<WatchEvent> = st.history.iter().filter(|e| e.revision() >= from).cloned().collect();
            if past.iter().all(|e| deliver(&w, e)) {
                st.watchers.push(w);
            }
            Ok(Watch::new(rx))
        })
    }
}
