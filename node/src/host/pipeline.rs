//! The host's write pipeline: one thread owns the regions. It drains the jobs that connections
//! queue (a bounded channel), and per round and region: plain writes become one group commit
//! (`Region::write_group`: their own versions, one log write and sync); atomics execute in the
//! reservation station against forwarded values and are written back once per key; an operation
//! whose key the other kind already touched this round closes the round first, so each key's
//! operations apply in arrival order. Responses are released once the round is durable.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dpukv_proto::{ErrorCode, Op, Reply, Request, Response, WriteOp};
use dpukv_storage::BatchOp;
use dpukv_storage::region::{Region, WriteAck};
use dpukv_storage::vlog::{DurabilityWaiter, Lsn};
use tokio::sync::mpsc;

use crate::atomics::{AtomicError, ReservationStation};
use crate::reads::storage_error;
use crate::regions::RegionMap;

/// Requests from one connection, and where their responses go.
pub struct Job {
    /// Write requests and atomics.
    pub reqs: Vec<Request>,
    /// The connection's response channel.
    pub reply: mpsc::Sender<Response>,
}

/// Counters the pipeline publishes.
#[derive(Default)]
pub struct PipelineStats {
    /// Rounds executed.
    pub rounds: AtomicU64,
    /// Write requests applied.
    pub writes: AtomicU64,
    /// Atomics executed.
    pub atomics: AtomicU64,
    /// Values written back by the reservation station.
    pub write_backs: AtomicU64,
}

/// A response waiting for its round, and how its version is found.
enum Pending {
    /// Plain write: batch index in the region's group.
    Batch(usize),
    /// Atomic: the reply, and the key whose write-back carries its version.
    Atomic(Reply, Vec<u8>),
    /// Already decided (an error).
    Ready(Response),
}

struct RegionRound {
    ops: Vec<Vec<OwnedOp>>,
    plain_keys: HashSet<Vec<u8>>,
    pending: Vec<(mpsc::Sender<Response>, u64, Pending)>,
}

/// An owned write of a batch (the group is built before it is borrowed as `BatchOp`s).
enum OwnedOp {
    Put(Vec<u8>, Vec<u8>),
    Insert(Vec<u8>, Vec<u8>),
    Update(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
}

impl OwnedOp {
    fn as_batch_op(&self) -> BatchOp<'_> {
        match self {
            OwnedOp::Put(k, v) => BatchOp::Put(k, v),
            OwnedOp::Insert(k, v) => BatchOp::Insert(k, v),
            OwnedOp::Update(k, v) => BatchOp::Update(k, v),
            OwnedOp::Delete(k) => BatchOp::Delete(k),
        }
    }
    fn key(&self) -> &[u8] {
        match self {
            OwnedOp::Put(k, _) | OwnedOp::Insert(k, _) | OwnedOp::Update(k, _) | OwnedOp::Delete(k) => k,
        }
    }
}

/// The pipeline; runs on its own thread ([`Pipeline::run`]).
pub struct Pipeline {
    /// Baseline mode: every atomic is its own round (one read-modify-write and log append per
    /// operation) instead of sharing the round's write-back.
    pub per_op_atomics: bool,
    regions: Vec<Region>,
    map: RegionMap,
    stations: Vec<ReservationStation>,
    durable_tx: std::sync::mpsc::SyncSender<Durable>,
    stats: Arc<PipelineStats>,
}

/// Responses released when a log position is durable.
struct Durable {
    waiter: DurabilityWaiter,
    end: Lsn,
    responses: Vec<(mpsc::Sender<Response>, Response)>,
}

/// Most jobs drained into one round.
const MAX_ROUND_JOBS: usize = 512;

impl Pipeline {
    /// A pipeline over `regions` (in the order of `map`).
    pub fn new(regions: Vec<Region>, map: RegionMap, stats: Arc<PipelineStats>) -> Pipeline {
        let (durable_tx, durable_rx) = std::sync::mpsc::sync_channel::<Durable>(1024);
        std::thread::Builder::new()
            .name("dpukv-durable".into())
            .spawn(move || {
                // Releases responses in round order once their log position is durable.
                while let Ok(d) = durable_rx.recv() {
                    let failed = d.waiter.wait(d.end).err();
                    for (tx, r) in d.responses {
                        // A write whose sync failed is never acknowledged: its outcome is unknown.
                        let r = match &failed {
                            Some(e) if r.result.is_ok() => {
                                Response::error(r.id, ErrorCode::Unavailable, format!("outcome unknown: {}", e.code()))
                            }
                            _ => r,
                        };
                        // Capacity is reserved by the connection's in-flight cap; a closed
                        // connection just drops its responses.
                        let _ = tx.try_send(r);
                    }
                }
            })
            .expect("spawning the durability thread");
        let stations = regions.iter().map(|_| ReservationStation::new()).collect();
        Pipeline { per_op_atomics: false, regions, map, stations, durable_tx, stats }
    }

    /// Runs until every job sender is dropped.
    pub fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        while let Some(first) = rx.blocking_recv() {
            let mut jobs = vec![first];
            while jobs.len() < MAX_ROUND_JOBS {
                match rx.try_recv() {
                    Ok(j) => jobs.push(j),
                    Err(_) => break,
                }
            }
            self.round(jobs);
            self.stats.rounds.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn round(&mut self, jobs: Vec<Job>) {
        let mut rounds: Vec<RegionRound> = self
            .regions
            .iter()
            .map(|_| RegionRound { ops: Vec::new(), plain_keys: HashSet::new(), pending: Vec::new() })
            .collect();
        for job in jobs {
            for req in job.reqs {
                let r = self.map.route(req.op.key());
                if let Op::Batch { ops } = &req.op
                    && ops.iter().any(|o| self.map.route(o.key()) != r)
                {
                    let e = Response::error(req.id, ErrorCode::Unsupported, "a batch must stay within one region");
                    rounds[r].pending.push((job.reply.clone(), req.id, Pending::Ready(e)));
                    continue;
                }
                self.stage(r, &mut rounds[r], req, &job.reply);
            }
        }
        for (r, round) in rounds.into_iter().enumerate() {
            self.commit(r, round);
        }
    }

    /// Adds one request to its region's round, closing the round first if the request's key was
    /// touched by the other kind of operation.
    fn stage(&mut self, r: usize, round: &mut RegionRound, req: Request, reply: &mpsc::Sender<Response>) {
        let atomic = matches!(
            req.op,
            Op::FetchAdd { .. }
                | Op::CompareAndSwap { .. }
                | Op::VectorScalar { .. }
                | Op::VectorVector { .. }
                | Op::Reduce { .. }
                | Op::Filter { .. }
        );
        let conflict = if atomic {
            round.plain_keys.contains(req.op.key())
        } else {
            let keys: Vec<&[u8]> = match &req.op {
                Op::Batch { ops } => ops.iter().map(WriteOp::key).collect(),
                op => vec![op.key()],
            };
            keys.iter().any(|k| self.stations[r].holds(k))
        };
        if conflict {
            let done = std::mem::replace(
                round,
                RegionRound { ops: Vec::new(), plain_keys: HashSet::new(), pending: Vec::new() },
            );
            self.commit(r, done);
        }
        if atomic {
            let region = &self.regions[r];
            self.stats.atomics.fetch_add(1, Ordering::Relaxed);
            let pending = match self.stations[r].execute(&req.op, |k| region.get(k)) {
                Ok(reply) => Pending::Atomic(reply, req.op.key().to_vec()),
                Err(AtomicError::TypeMismatch) => Pending::Ready(Response::error(
                    req.id,
                    ErrorCode::TypeMismatch,
                    "value is not an array of that element type",
                )),
                Err(AtomicError::NotFound) => {
                    Pending::Ready(Response::error(req.id, ErrorCode::KeyNotFound, "no value for the key"))
                }
                Err(AtomicError::Load(e)) => Pending::Ready(storage_error(req.id, &e)),
                Err(AtomicError::NotAtomic) => {
                    Pending::Ready(Response::error(req.id, ErrorCode::Internal, "not an atomic"))
                }
            };
            round.pending.push((reply.clone(), req.id, pending));
            if self.per_op_atomics {
                let done = std::mem::replace(
                    round,
                    RegionRound { ops: Vec::new(), plain_keys: HashSet::new(), pending: Vec::new() },
                );
                self.commit(r, done);
            }
            return;
        }
        let ops: Vec<OwnedOp> = match req.op {
            Op::Put { key, value } => vec![OwnedOp::Put(key, value)],
            Op::Insert { key, value } => vec![OwnedOp::Insert(key, value)],
            Op::Update { key, value } => vec![OwnedOp::Update(key, value)],
            Op::Delete { key } => vec![OwnedOp::Delete(key)],
            Op::Batch { ops } => ops
                .into_iter()
                .map(|o| match o {
                    WriteOp::Put { key, value } => OwnedOp::Put(key, value),
                    WriteOp::Insert { key, value } => OwnedOp::Insert(key, value),
                    WriteOp::Update { key, value } => OwnedOp::Update(key, value),
                    WriteOp::Delete { key } => OwnedOp::Delete(key),
                })
                .collect(),
            _ => {
                round.pending.push((
                    reply.clone(),
                    req.id,
                    Pending::Ready(Response::error(req.id, ErrorCode::Internal, "reads are not written")),
                ));
                return;
            }
        };
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        round.plain_keys.extend(ops.iter().map(|o| o.key().to_vec()));
        round.pending.push((reply.clone(), req.id, Pending::Batch(round.ops.len())));
        round.ops.push(ops);
    }

    /// Commits a region's round: the plain batches and the station's write-backs in one group.
    fn commit(&mut self, r: usize, mut round: RegionRound) {
        if round.pending.is_empty() {
            return;
        }
        let write_backs = self.stations[r].drain();
        self.stats.write_backs.fetch_add(write_backs.len() as u64, Ordering::Relaxed);
        let first_wb = round.ops.len();
        for (k, v) in &write_backs {
            round.ops.push(vec![OwnedOp::Put(k.clone(), v.clone())]);
        }
        let borrowed: Vec<Vec<BatchOp<'_>>> =
            round.ops.iter().map(|b| b.iter().map(OwnedOp::as_batch_op).collect()).collect();
        let slices: Vec<&[BatchOp<'_>]> = borrowed.iter().map(Vec::as_slice).collect();
        let region = &mut self.regions[r];
        let results: Vec<dpukv_storage::Result<WriteAck>> =
            if slices.is_empty() { Vec::new() } else { region.write_group(&slices) };
        let current = region.version();
        let mut responses = Vec::with_capacity(round.pending.len());
        for (tx, id, p) in round.pending {
            let resp = match p {
                Pending::Ready(resp) => resp,
                Pending::Batch(i) => match &results[i] {
                    Ok(ack) => Response { id, version: ack.version, replicated: false, result: Ok(Reply::Done) },
                    Err(e) => storage_error(id, e),
                },
                Pending::Atomic(reply, key) => match write_backs.iter().position(|(k, _)| *k == key) {
                    Some(j) => match &results[first_wb + j] {
                        Ok(ack) => Response { id, version: ack.version, replicated: false, result: Ok(reply) },
                        Err(e) => storage_error(id, e),
                    },
                    // Read-only atomics (and failed CAS) change nothing.
                    None => Response { id, version: current, replicated: false, result: Ok(reply) },
                },
            };
            responses.push((tx, resp));
        }
        // Every round's responses go through the durability thread in order, with the log's end
        // as their position: no reply (even of a read-only atomic) reveals state that is not
        // durable yet. Connections cap their requests in flight at their channel's capacity, so
        // these sends never block.
        let d = Durable { waiter: region.vlog().durability(), end: region.vlog().end(), responses };
        if let Err(std::sync::mpsc::SendError(d)) = self.durable_tx.send(d) {
            for (tx, resp) in d.responses {
                let _ = tx.try_send(resp);
            }
        }
    }
}
