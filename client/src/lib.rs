//! dpukv-client: the async client of dpukv's binary protocol (ARCHITECTURE.md §2: depends on
//! `proto` only). A [`Client`] keeps a pool of connections; each connection batches the requests
//! queued on it into frames (client-side batching, KV-Direct §3.4) and keeps many in flight,
//! matching responses to requests by id as they come back, in any order.
//!
//! # Layout
//! - `error`: [`ClientError`].
//! - `conn`: one pipelined connection (writer and reader tasks).
//! - `workload`: YCSB and cloud-storage workloads, key choosers, a latency histogram (bench).
//! - this module: [`Client`], the typed operations.

mod conn;
mod error;
pub mod workload;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use dpukv_proto as proto;
use dpukv_proto::{Cmp, Elem, Op, ReduceOp, Reply, Request, Response, ScanToken, VecOp, WriteOp};
pub use error::ClientError;

/// Result alias.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// A pool of pipelined connections to one endpoint.
#[derive(Clone)]
pub struct Client {
    conns: Arc<Vec<conn::Connection>>,
    next: Arc<AtomicUsize>,
    /// Retries of retryable errors (with backoff) before giving up.
    pub retries: u32,
}

impl Client {
    /// Connects `pool` connections to `addr` (host:port).
    pub async fn connect(addr: &str, pool: usize) -> Result<Client> {
        let mut conns = Vec::new();
        for _ in 0..pool.max(1) {
            conns.push(conn::Connection::open(addr).await?);
        }
        Ok(Client { conns: Arc::new(conns), next: Arc::new(AtomicUsize::new(0)), retries: 20 })
    }

    /// Sends one request on the next connection and waits for its response (no retries).
    pub async fn send(&self, op: Op) -> Result<Response> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        self.conns[i].call(Request::new(0, op)).await
    }

    /// Sends `op`, retrying retryable errors (host restarting, overload) with backoff; returns the
    /// reply or the final error.
    pub async fn call(&self, op: Op) -> Result<(Reply, u64)> {
        let mut delay = Duration::from_millis(5);
        let mut attempt = 0;
        loop {
            let out = self.send(op.clone()).await.and_then(|r| match r.result {
                Ok(reply) => Ok((reply, r.version)),
                Err(e) => Err(ClientError::Server(e)),
            });
            match out {
                Err(e) if e.is_retryable() && attempt < self.retries => {
                    attempt += 1;
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
                other => return other,
            }
        }
    }

    /// The value of `key`.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.call(Op::Get { key: key.to_vec() }).await?.0 {
            Reply::Value(v) => Ok(v),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Upsert; returns the write's version.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Put { key: key.to_vec(), value: value.to_vec() }).await?.1)
    }

    /// Insert (fails with `KeyExists`).
    pub async fn insert(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Insert { key: key.to_vec(), value: value.to_vec() }).await?.1)
    }

    /// Update (fails with `KeyNotFound`).
    pub async fn update(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Update { key: key.to_vec(), value: value.to_vec() }).await?.1)
    }

    /// Delete.
    pub async fn delete(&self, key: &[u8]) -> Result<u64> {
        Ok(self.call(Op::Delete { key: key.to_vec() }).await?.1)
    }

    /// Writes applied atomically.
    pub async fn batch(&self, ops: Vec<WriteOp>) -> Result<u64> {
        Ok(self.call(Op::Batch { ops }).await?.1)
    }

    /// Up to `limit` items with keys in `[lo, hi]`, following continuation tokens.
    pub async fn scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan_inner(lo, hi, limit, false).await
    }

    /// Like [`Client::scan`] from the largest key `<= lo`.
    pub async fn floor_scan(&self, lo: &[u8], hi: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan_inner(lo, hi, limit, true).await
    }

    async fn scan_inner(&self, lo: &[u8], hi: &[u8], limit: usize, floor: bool) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        let mut token = Vec::new();
        while out.len() < limit {
            let want = (limit - out.len()).min(proto::limits::MAX_SCAN_ITEMS as usize) as u32;
            let (lo, hi) = (lo.to_vec(), hi.to_vec());
            // The first page may be a floor scan; the rest continue after the last key.
            let op = if floor && token.is_empty() {
                Op::FloorScan { lo, hi, limit: want, max_bytes: 0, token: Vec::new() }
            } else {
                Op::Scan { lo, hi, limit: want, max_bytes: 0, token: token.clone() }
            };
            match self.call(op).await?.0 {
                Reply::Items { items, token: t } => {
                    out.extend(items);
                    if t.is_empty() || ScanToken::decode(&t).is_none() {
                        break;
                    }
                    token = t;
                }
                other => return Err(ClientError::unexpected(&other)),
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    /// Adds `delta` to the u64 value; returns the old value.
    pub async fn fetch_add(&self, key: &[u8], delta: u64) -> Result<u64> {
        match self.call(Op::FetchAdd { key: key.to_vec(), delta }).await?.0 {
            Reply::Scalar(s) => Ok(u64::from_le_bytes(s)),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Compare-and-swap; returns whether it swapped and the value found.
    pub async fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<(bool, Option<Vec<u8>>)> {
        let op = Op::CompareAndSwap { key: key.to_vec(), expected: expected.map(<[u8]>::to_vec), new: new.to_vec() };
        match self.call(op).await?.0 {
            Reply::Cas { swapped, current } => Ok((swapped, current)),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// Element-wise update with a scalar.
    pub async fn vector_scalar(&self, key: &[u8], elem: Elem, op: VecOp, operand: [u8; 8]) -> Result<()> {
        self.call(Op::VectorScalar { key: key.to_vec(), elem, op, operand }).await.map(|_| ())
    }

    /// Element-wise update with a vector.
    pub async fn vector_vector(&self, key: &[u8], elem: Elem, op: VecOp, operand: Vec<u8>) -> Result<()> {
        self.call(Op::VectorVector { key: key.to_vec(), elem, op, operand }).await.map(|_| ())
    }

    /// Reduction (8 bytes, read as `elem`).
    pub async fn reduce(&self, key: &[u8], elem: Elem, op: ReduceOp) -> Result<[u8; 8]> {
        match self.call(Op::Reduce { key: key.to_vec(), elem, op }).await?.0 {
            Reply::Scalar(s) => Ok(s),
            other => Err(ClientError::unexpected(&other)),
        }
    }

    /// The elements matching `element cmp operand`.
    pub async fn filter(&self, key: &[u8], elem: Elem, cmp: Cmp, operand: [u8; 8]) -> Result<Vec<u8>> {
        match self.call(Op::Filter { key: key.to_vec(), elem, cmp, operand }).await?.0 {
            Reply::Vector(v) => Ok(v),
            other => Err(ClientError::unexpected(&other)),
        }
    }
}
