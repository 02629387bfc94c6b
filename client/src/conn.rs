//! One pipelined connection: a writer task drains queued requests into frames (assigning ids),
//! a reader task completes them by id. A broken connection fails what is in flight with
//! `Disconnected` and is re-dialled by the next request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dpukv_proto::{Request, Response, decode_responses, encode_requests, frame_header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::error::ClientError;

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Response>>>>;

struct Live {
    tx: mpsc::Sender<(Request, oneshot::Sender<Response>)>,
}

/// See the module documentation.
pub(crate) struct Connection {
    addr: String,
    live: tokio::sync::Mutex<Option<Live>>,
}

/// Requests queued per connection before callers wait (bounds memory and in-flight work).
const QUEUE: usize = 4096;

impl Connection {
    pub(crate) async fn open(addr: &str) -> Result<Connection, ClientError> {
        let c = Connection { addr: addr.to_string(), live: tokio::sync::Mutex::new(None) };
        *c.live.lock().await = Some(dial(addr).await?);
        Ok(c)
    }

    pub(crate) async fn call(&self, req: Request) -> Result<Response, ClientError> {
        if let Err(c) = req.op.validate() {
            return Err(ClientError::Invalid(c));
        }
        let tx = {
            let mut live = self.live.lock().await;
            if live.as_ref().is_none_or(|l| l.tx.is_closed()) {
                *live = Some(dial(&self.addr).await?);
            }
            live.as_ref().expect("dialled above").tx.clone()
        };
        let (done, wait) = oneshot::channel();
        tx.send((req, done)).await.map_err(|_| ClientError::Disconnected)?;
        wait.await.map_err(|_| ClientError::Disconnected)
    }
}

async fn dial(addr: &str) -> Result<Live, ClientError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut r, mut w) = stream.into_split();
    let waiters: Waiters = Arc::new(Mutex::new(HashMap::new()));
    // Set by the reader when the connection is gone, before it drops the waiters; the writer
    // checks it after registering new ones, so none is left waiting forever.
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let closed_r = closed.clone();
    let (tx, mut rx) = mpsc::channel::<(Request, oneshot::Sender<Response>)>(QUEUE);
    let ws = waiters.clone();
    tokio::spawn(async move {
        let mut next_id = 1u64;
        let mut batch = Vec::with_capacity(256);
        let mut buf = Vec::with_capacity(64 << 10);
        while let Some(first) = rx.recv().await {
            batch.push(first);
            // Client-side batching: everything queued goes out in one frame (within limits).
            let mut bytes = 0;
            while batch.len() < dpukv_proto::limits::MAX_OPS_PER_FRAME && bytes < dpukv_proto::limits::MAX_FRAME / 4 {
                match rx.try_recv() {
                    Ok(x) => {
                        bytes += approx(&x.0);
                        batch.push(x);
                    }
                    Err(_) => break,
                }
            }
            let mut reqs = Vec::with_capacity(batch.len());
            {
                let mut w = ws.lock().unwrap_or_else(|e| e.into_inner());
                for (mut req, done) in batch.drain(..) {
                    req.id = next_id;
                    next_id += 1;
                    w.insert(req.id, done);
                    reqs.push(req);
                }
                if closed.load(std::sync::atomic::Ordering::Acquire) {
                    w.clear();
                    break;
                }
            }
            buf.clear();
            encode_requests(&reqs, &mut buf);
            if w.write_all(&buf).await.is_err() {
                break;
            }
        }
        ws.lock().unwrap_or_else(|e| e.into_inner()).clear();
    });
    tokio::spawn(async move {
        let mut buf = Vec::new();
        loop {
            buf.clear();
            buf.resize(8, 0);
            if r.read_exact(&mut buf).await.is_err() {
                break;
            }
            let Ok(Some(h)) = frame_header(&buf) else { break };
            buf.resize(h.total, 0);
            if r.read_exact(&mut buf[8..]).await.is_err() {
                break;
            }
            let Ok(resps) = decode_responses(&buf) else { break };
            let mut w = waiters.lock().unwrap_or_else(|e| e.into_inner());
            for resp in resps {
                if let Some(done) = w.remove(&resp.id) {
                    let _ = done.send(resp);
                }
            }
        }
        // Dropping the senders fails every request in flight with Disconnected.
        closed_r.store(true, std::sync::atomic::Ordering::Release);
        waiters.lock().unwrap_or_else(|e| e.into_inner()).clear();
    });
    Ok(Live { tx })
}

fn approx(r: &Request) -> usize {
    use dpukv_proto::Op;
    64 + match &r.op {
        Op::Put { key, value } | Op::Insert { key, value } | Op::Update { key, value } => key.len() + value.len(),
        Op::VectorVector { operand, .. } => operand.len(),
        Op::Batch { ops } => ops.len() * 64,
        op => op.key().len(),
    }
}
