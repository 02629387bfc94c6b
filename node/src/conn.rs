//! Connection plumbing shared by the host and the device: reading whole frames (header first,
//! limits checked before the body is read), a writer task that coalesces ready responses into
//! frames, and a cap on requests in flight per connection (which bounds every queue behind it).

use std::sync::Arc;

use dpukv_proto::{DecodeError, ErrorCode, RequestEntry, Response, decode_requests, encode_responses, frame_header};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

/// Most requests of one connection in flight; also the capacity of its response channel, so a
/// response can always be queued without waiting.
pub const MAX_IN_FLIGHT: usize = 4096;

/// Reads the next complete frame into `buf` (replacing its contents). `Ok(false)` at a clean end
/// of stream.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> Result<bool, FrameReadError> {
    buf.clear();
    buf.resize(8, 0);
    match r.read_exact(&mut buf[..8]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(FrameReadError::Io(e)),
    }
    let h =
        frame_header(buf).map_err(FrameReadError::Decode)?.ok_or(FrameReadError::Decode(DecodeError::Incomplete))?;
    buf.resize(h.total, 0);
    r.read_exact(&mut buf[8..]).await.map_err(FrameReadError::Io)?;
    Ok(true)
}

/// Why a connection stops.
#[derive(Debug, thiserror::Error)]
pub enum FrameReadError {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(std::io::Error),
    /// The frame cannot be trusted.
    #[error("bad frame: {0}")]
    Decode(DecodeError),
}

/// Reads and decodes the next frame of requests and reserves their in-flight permits. None when
/// the connection should end: closed, shutting down, or a frame that cannot be trusted (the
/// client is told why first).
pub async fn next_requests<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    out: &Outbox,
    stop: &CancellationToken,
) -> Option<Vec<RequestEntry>> {
    let got = tokio::select! {
        _ = stop.cancelled() => return None,
        got = read_frame(r, buf) => got,
    };
    let bad = match got {
        Ok(true) => match decode_requests(buf) {
            Ok(entries) => {
                let permits = out.in_flight.clone().acquire_many_owned(entries.len() as u32).await.ok()?;
                permits.forget();
                return Some(entries);
            }
            Err(e) => e.to_string(),
        },
        Ok(false) | Err(FrameReadError::Io(_)) => return None,
        Err(FrameReadError::Decode(e)) => e.to_string(),
    };
    let _ = out.tx.send(Response::error(0, ErrorCode::BadRequest, bad)).await;
    None
}

/// The write side of a connection: responses queued on `tx` are written in frames.
pub struct Outbox {
    /// Queue a response here.
    pub tx: mpsc::Sender<Response>,
    /// Permits for requests in flight: take one per request read, the writer returns it.
    pub in_flight: Arc<Semaphore>,
}

/// Starts the writer task for `w`; it ends when every sender is dropped or the socket fails.
pub fn spawn_writer<W: AsyncWrite + Unpin + Send + 'static>(mut w: W) -> (Outbox, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<Response>(MAX_IN_FLIGHT);
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let permits = in_flight.clone();
    let task = tokio::spawn(async move {
        let mut batch = Vec::with_capacity(256);
        let mut buf = Vec::with_capacity(64 << 10);
        while let Some(first) = rx.recv().await {
            batch.push(first);
            while batch.len() < dpukv_proto::limits::MAX_OPS_PER_FRAME {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            buf.clear();
            // Keep frames under the limit: large values go in frames of their own.
            let mut start = 0;
            while start < batch.len() {
                let mut end = start;
                let mut size = 0;
                while end < batch.len()
                    && (end == start || size + approx_size(&batch[end]) < dpukv_proto::limits::MAX_FRAME / 2)
                {
                    size += approx_size(&batch[end]);
                    end += 1;
                }
                encode_responses(&batch[start..end], &mut buf);
                start = end;
            }
            let n = batch.len();
            batch.clear();
            if w.write_all(&buf).await.is_err() {
                break;
            }
            permits.add_permits(n);
        }
        let _ = w.shutdown().await;
    });
    (Outbox { tx, in_flight }, task)
}

fn approx_size(r: &Response) -> usize {
    use dpukv_proto::Reply;
    64 + match &r.result {
        Ok(Reply::Value(Some(v))) | Ok(Reply::Vector(v)) => v.len(),
        Ok(Reply::Items { items, token }) => {
            token.len() + items.iter().map(|(k, v)| k.len() + v.len() + 8).sum::<usize>()
        }
        Ok(Reply::Cas { current, .. }) => current.as_ref().map_or(0, Vec::len),
        _ => 0,
    }
}
