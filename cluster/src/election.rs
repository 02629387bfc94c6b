//! Leader election on any [`MetaStore`] (etcd's recipe, so both stores share one implementation):
//! each candidate puts a key `<name>/<lease as 16 hex digits>` bound to its lease; the candidate
//! whose key is oldest (lowest create revision) leads; the others wait for a deletion under the
//! prefix and look again. A leader's authority is its key: [`Leadership::fence`] is a compare that
//! holds only while that very key exists, so a deposed leader's transactions fail.

use crate::meta::{Compare, KeyValue, LeaseId, MetaError, MetaStore, Result, Revision, Txn, TxnOp, WatchEvent};

/// Leadership won by [`campaign`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leadership {
    /// The leader's key.
    pub key: Vec<u8>,
    /// The revision that created it.
    pub create_revision: Revision,
    /// The lease it is bound to.
    pub lease: LeaseId,
}

impl Leadership {
    /// A compare that holds only while this leadership lasts: put it in every transaction the
    /// leader makes.
    pub fn fence(&self) -> Compare {
        Compare::CreateRevision(self.key.clone(), self.create_revision)
    }
}

fn prefix(name: &[u8]) -> Vec<u8> {
    let mut p = name.to_vec();
    p.push(b'/');
    p
}

/// Becomes a candidate for `name` under `lease` (kept alive by the caller) announcing `value`,
/// and returns once leading. Ends with [`MetaError::LeaseNotFound`] if the lease ends first.
pub async fn campaign<S: MetaStore>(s: &S, name: &[u8], lease: LeaseId, value: &[u8]) -> Result<Leadership> {
    let prefix = prefix(name);
    let mut key = prefix.clone();
    key.extend_from_slice(format!("{lease:016x}").as_bytes());
    // A campaign again under the same lease keeps its place in the queue.
    s.txn(Txn {
        when: vec![Compare::Absent(key.clone())],
        then: vec![TxnOp::Put { key: key.clone(), value: value.to_vec(), lease: Some(lease) }],
        otherwise: vec![],
    })
    .await?;
    loop {
        let (kvs, rev) = s.range(&prefix).await?;
        let me = kvs.iter().find(|kv| kv.key == key).ok_or(MetaError::LeaseNotFound(lease))?;
        if kvs.iter().all(|kv| kv.create_revision >= me.create_revision) {
            return Ok(Leadership { key, create_revision: me.create_revision, lease });
        }
        // Wait for a candidate (ours included) to go, then look again.
        let mut w = s.watch(&prefix, rev + 1).await?;
        loop {
            match w.next().await {
                Some(Ok(WatchEvent::Delete { .. })) => break,
                Some(Ok(WatchEvent::Put(_))) => continue,
                Some(Err(_)) | None => break, // read again
            }
        }
    }
}

/// The current leader's key and value, if anyone leads `name`.
pub async fn leader<S: MetaStore>(s: &S, name: &[u8]) -> Result<Option<KeyValue>> {
    let (kvs, _) = s.range(&prefix(name)).await?;
    Ok(kvs.into_iter().min_by_key(|kv| kv.create_revision))
}

/// Gives leadership up (deletes the leader's key if it is still this leadership's).
pub async fn resign<S: MetaStore>(s: &S, l: &Leadership) -> Result<()> {
    s.txn(Txn { when: vec![l.fence()], then: vec![TxnOp::Delete { key: l.key.clone() }], otherwise: vec![] }).await?;
    Ok(())
}
