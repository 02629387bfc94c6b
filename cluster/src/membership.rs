//! A node's membership: its registration under a lease, kept alive, and the **authority** that
//! lease gives it — the instant until which it may act as a primary (docs/cluster.md §4, step 1).
//!
//! Before each keep-alive the node reads its monotonic clock (`t_sent`); when etcd answers, the
//! lease runs at least `ttl` past a moment after `t_sent`, so the node trusts itself until
//! `t_sent + ttl·(1 − ρ) − δ` ([`Timing`]). Past that instant, [`Authority::valid`] is false and
//! the node must stop acknowledging writes: by then etcd may have ended the lease and the master
//! may have promoted a backup.
//!
//! An authority also counts its **lives**: a lease that ended (found gone) ends a life, and a new
//! registration begins the next. Whatever a node decided under one lease — above all the region
//! map its device serves — must not be vouched for by the authority a later lease gives
//! ([`Authority::until_in`]): between the old lease's end and the new registration the master may
//! have handed the node's regions to others, and only a map read after the new registration says
//! so.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dpukv_proto::regionmap::NodeInfo;
use tokio_util::sync::CancellationToken;

use crate::keys::Keys;
use crate::meta::{Compare, LeaseId, MetaError, MetaStore, Result, Txn, TxnOp};

/// Lease timing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// The lease's TTL (`T`).
    pub ttl: Duration,
    /// Bound on the difference of two clocks' rates (`ρ`, e.g. 0.01).
    pub drift: f64,
    /// Safety margin (`δ`).
    pub margin: Duration,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing { ttl: Duration::from_secs(3), drift: 0.01, margin: Duration::from_millis(100) }
    }
}

impl Timing {
    /// How long after `t_sent` a successful keep-alive lets the node act.
    pub fn trust(&self) -> Duration {
        self.ttl.mul_f64(1.0 - self.drift).saturating_sub(self.margin)
    }
}

/// Until when the node may act as a primary; shared by the keeper (which extends it) and the
/// write path (which checks it). Cheap to clone and to check.
#[derive(Debug, Clone)]
pub struct Authority {
    base: Instant,
    /// Nanoseconds after `base` (0: none).
    until: Arc<AtomicU64>,
    /// The life (registration) `until` belongs to: bumped when a lease ends and when a
    /// registration begins.
    life: Arc<AtomicU64>,
    /// When it was last extended (a lease renewed or granted): nanoseconds after `base`, 0: never.
    renewed: Arc<AtomicU64>,
}

impl Default for Authority {
    fn default() -> Authority {
        Authority::new()
    }
}

impl Authority {
    /// No authority yet.
    pub fn new() -> Authority {
        Authority {
            base: Instant::now(),
            until: Arc::new(AtomicU64::new(0)),
            life: Arc::new(AtomicU64::new(0)),
            renewed: Arc::new(AtomicU64::new(0)),
        }
    }

    /// How long ago it was last extended (the lease renewed or granted; None: never).
    pub fn since_renewed(&self) -> Option<Duration> {
        let at = self.renewed.load(Ordering::Acquire);
        (at != 0).then(|| Instant::now().saturating_duration_since(self.base + Duration::from_nanos(at)))
    }

    /// The current life (see the module documentation): read it *before* reading what the
    /// authority is to vouch for, then ask [`Authority::until_in`] with it.
    pub fn life(&self) -> u64 {
        self.life.load(Ordering::Acquire)
    }

    /// The instant it ends, if it is still in life `life` (None: no authority, or a later life,
    /// which must not vouch for what was decided in `life`).
    pub fn until_in(&self, life: u64) -> Option<Instant> {
        // Read like a sequence lock: an `until` extended in a later life was written after that
        // life began, so reading it (acquire) makes the second read of `life` see the change.
        let before = self.life.load(Ordering::Acquire);
        let until = self.until.load(Ordering::Acquire);
        let after = self.life.load(Ordering::Acquire);
        (before == life && after == life && until != 0).then(|| self.base + Duration::from_nanos(until))
    }

    /// Whether the node may act as a primary now.
    pub fn valid(&self) -> bool {
        self.valid_at(Instant::now())
    }

    /// Whether it may at `t`.
    pub fn valid_at(&self, t: Instant) -> bool {
        let until = self.until.load(Ordering::Acquire);
        until != 0 && t.saturating_duration_since(self.base).as_nanos() < u128::from(until)
    }

    /// The instant it ends (None: no authority).
    pub fn until(&self) -> Option<Instant> {
        let until = self.until.load(Ordering::Acquire);
        (until != 0).then(|| self.base + Duration::from_nanos(until))
    }

    /// Extends it to `t` (never shortens it).
    fn extend(&self, t: Instant) {
        let n = t.saturating_duration_since(self.base).as_nanos().min(u128::from(u64::MAX)) as u64;
        self.until.fetch_max(n.max(1), Ordering::AcqRel);
        let now = Instant::now().saturating_duration_since(self.base).as_nanos().min(u128::from(u64::MAX)) as u64;
        self.renewed.fetch_max(now.max(1), Ordering::AcqRel);
    }

    /// Ends it now (the lease is gone), and with it the life: `until` is cleared first, so a
    /// reader that sees the next life cannot read this life's end with it.
    fn revoke(&self) {
        self.until.store(0, Ordering::Release);
        self.life.fetch_add(1, Ordering::AcqRel);
    }
}

/// A registered node.
#[derive(Debug)]
pub struct Member {
    /// The lease its registration is bound to.
    pub lease: LeaseId,
    /// Its authority, kept current by [`Member::keep_alive`].
    pub authority: Authority,
}

/// Why registering failed.
pub fn id_taken(id: u32) -> MetaError {
    MetaError::Invalid(format!("node id {id} is registered by a live node: two nodes cannot share an id"))
}

/// Registers `info` under a new lease; fails if a live node holds the id.
pub async fn register<S: MetaStore>(s: &S, keys: &Keys, info: &NodeInfo, timing: Timing) -> Result<Member> {
    register_with(s, keys, info, timing, Authority::new()).await
}

/// Like [`register`], extending an existing authority (a node registering again after its lease
/// ended keeps one authority for its write paths).
pub async fn register_with<S: MetaStore>(
    s: &S,
    keys: &Keys,
    info: &NodeInfo,
    timing: Timing,
    authority: Authority,
) -> Result<Member> {
    let t_sent = Instant::now();
    let lease = s.grant(timing.ttl).await?;
    let key = keys.node(info.id);
    let t = s
        .txn(Txn {
            when: vec![Compare::Absent(key.clone())],
            then: vec![TxnOp::Put { key, value: info.encode(), lease: Some(lease) }],
            otherwise: vec![],
        })
        .await?;
    if !t.succeeded {
        let _ = s.revoke(lease).await;
        return Err(id_taken(info.id));
    }
    // A new lease, a new life (the previous one normally ended when its lease was found gone).
    authority.revoke();
    authority.extend(t_sent + timing.trust());
    Ok(Member { lease, authority })
}

impl Member {
    /// Keeps the lease alive every `ttl / 3` until `cancel`, extending the authority after each
    /// success; a failed keep-alive is retried at once (the authority runs out on its own). Ends
    /// with [`MetaError::LeaseNotFound`] when the lease has ended (the node must register again:
    /// the master may have given its regions away), and revokes the lease when cancelled.
    pub async fn keep_alive<S: MetaStore>(&self, s: &S, timing: Timing, cancel: CancellationToken) -> Result<()> {
        let period = timing.ttl / 3;
        loop {
            let t_sent = Instant::now();
            match s.keep_alive(self.lease).await {
                Ok(()) => self.authority.extend(t_sent + timing.trust()),
                Err(e @ MetaError::LeaseNotFound(_)) => {
                    self.authority.revoke();
                    return Err(e);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "lease keep-alive failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(period / 4) => continue,
                        _ = cancel.cancelled() => break,
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(period.saturating_sub(t_sent.elapsed())) => {}
                _ = cancel.cancelled() => break,
            }
        }
        self.authority.revoke();
        let _ = s.revoke(self.lease).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The authority must count from when a keep-alive was *sent*: counted from its answer, a
    //! slow link to the store (an answer arriving late) would let a node believe it leads after
    //! the store ended its lease and the master promoted a backup.

    use super::*;
    use crate::mem::MemStore;
    use crate::meta::{KeyValue, Revision, TxnResult, Watch};

    /// A store whose keep-alives are answered `delay` after the store applied them.
    #[derive(Clone)]
    struct SlowAnswers {
        inner: MemStore,
        delay: Duration,
        applied: Arc<std::sync::Mutex<Vec<Instant>>>,
    }

    impl MetaStore for SlowAnswers {
        async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>> {
            self.inner.get(key).await
        }
        async fn range(&self, prefix: &[u8]) -> Result<(Vec<KeyValue>, Revision)> {
            self.inner.range(prefix).await
        }
        async fn txn(&self, txn: Txn) -> Result<TxnResult> {
            self.inner.txn(txn).await
        }
        async fn delete_prefix(&self, prefix: &[u8]) -> Result<u64> {
            self.inner.delete_prefix(prefix).await
        }
        async fn grant(&self, ttl: Duration) -> Result<LeaseId> {
            self.inner.grant(ttl).await
        }
        async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
            let r = self.inner.keep_alive(lease).await;
            self.applied.lock().expect("lock").push(Instant::now());
            tokio::time::sleep(self.delay).await;
            r
        }
        async fn revoke(&self, lease: LeaseId) -> Result<()> {
            self.inner.revoke(lease).await
        }
        async fn watch(&self, prefix: &[u8], from: Revision) -> Result<Watch> {
            self.inner.watch(prefix, from).await
        }
    }

    #[tokio::test]
    async fn the_authority_ends_before_the_lease_however_late_the_answer() {
        let timing = Timing { ttl: Duration::from_millis(900), drift: 0.01, margin: Duration::from_millis(50) };
        let applied = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = SlowAnswers { inner: MemStore::new(), delay: Duration::from_millis(500), applied: applied.clone() };
        let keys = Keys::new("t").expect("keys");
        let info = NodeInfo {
            id: 1,
            device: "d".into(),
            replication: "r".into(),
            admin: "a".into(),
            zone: "".into(),
            fabric: String::new(),
        };
        let m = register(&s, &keys, &info, timing).await.expect("register");
        let registered = Instant::now();
        let cancel = CancellationToken::new();
        let keeper = {
            let (m, c) = (Member { lease: m.lease, authority: m.authority.clone() }, cancel.clone());
            tokio::spawn(async move { m.keep_alive(&s, timing, c).await })
        };
        // Whenever the node has authority, the store's lease must outlast it: the lease runs
        // `ttl` past the last keep-alive the store applied (or the registration).
        let mut checked = 0;
        while registered.elapsed() < Duration::from_secs(3) {
            let lease_end = applied.lock().expect("lock").last().copied().unwrap_or(registered) + timing.ttl;
            if let Some(until) = m.authority.until() {
                assert!(until <= lease_end, "the authority outlives the lease by {:?}", until - lease_end);
                checked += 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cancel.cancel();
        keeper.await.expect("keeper").expect("keep-alive");
        assert!(applied.lock().expect("lock").len() >= 2 && checked > 10, "keep-alives were applied and checked");
        assert!(m.authority.until().is_none(), "revoked at the end");
    }

    /// A node whose lease ended registers again and has authority again — but not for the map it
    /// published under the old lease: the master may have moved its regions in between (a paused
    /// pod served a stale map for ~100 ms after resuming, until this held).
    #[tokio::test]
    async fn a_new_registration_does_not_vouch_for_what_the_old_lease_decided() {
        let s = MemStore::new();
        let timing = Timing { ttl: Duration::from_millis(600), drift: 0.01, margin: Duration::from_millis(50) };
        let keys = Keys::new("t").expect("keys");
        let info = NodeInfo {
            id: 1,
            device: "d".into(),
            replication: "r".into(),
            admin: "a".into(),
            zone: "".into(),
            fabric: String::new(),
        };
        let m = register(&s, &keys, &info, timing).await.expect("register");
        let first = m.authority.life();
        assert!(m.authority.until_in(first).is_some(), "the first life has authority");
        s.revoke(m.lease).await.expect("end the lease");
        let ended = m.keep_alive(&s, timing, CancellationToken::new()).await;
        assert!(matches!(ended, Err(MetaError::LeaseNotFound(_))), "the keeper finds the lease gone: {ended:?}");
        assert!(!m.authority.valid() && m.authority.until_in(first).is_none(), "the authority ended with the lease");
        let again = register_with(&s, &keys, &info, timing, m.authority.clone()).await.expect("register again");
        assert!(m.authority.valid(), "registered again, the node has authority");
        assert!(m.authority.until_in(first).is_none(), "but not for what it decided under the old lease");
        assert!(again.authority.until_in(again.authority.life()).is_some(), "and for what it decides now");
    }
}
