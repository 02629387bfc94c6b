//! The cluster as the gateway sees it: the client library's [`Client`] — the one routing
//! implementation (region map from the nodes, a pool of pipelined connections per device, each
//! connection batching the requests queued on it into frames, refresh and retry on
//! `stale_epoch`/`wrong_region`/`unavailable`) — used in two ways:
//!
//! - requests of the binary front end are **forwarded** ([`Upstream::handle`]): a write keeps
//!   its sender's exactly-once tag, so the sender's retries through the gateway (and the
//!   gateway's own, after a failover) are applied once;
//! - the HTTP and RESP front ends call the typed operations, tagged with the gateway's own
//!   session.
//!
//! To its binary clients the gateway is a standalone node: one region covering every key, on
//! one node reached at the address they dialled ([`Upstream::virtual_map`]); existing clients
//! need no change. The map is also forgotten now and then (every `map_refresh`), so changes no
//! request tripped over still reach the gateway.

use std::sync::Arc;
use std::time::Duration;

use dpukv_client::{Client, ClientError};
use dpukv_proto::regionmap::{NodeInfo, RegionInfo, RegionMap, RegionState};
use dpukv_proto::{ErrorCode, Op, Reply, Request, Response};
use tokio_util::sync::CancellationToken;

use crate::scan::{ScanLimits, ScanRequest};

/// The id and epoch of the one region the gateway shows its binary clients.
pub const VIRTUAL_REGION: u32 = 1;
const VIRTUAL_EPOCH: u64 = 1;

/// See the module documentation.
pub struct Upstream {
    client: Client,
    scans: ScanLimits,
}

impl Upstream {
    /// Connects `pool` connections to the first of `seeds` (node devices) that answers.
    pub async fn connect(seeds: &[String], pool: usize, scans: ScanLimits) -> Result<Upstream, ClientError> {
        let mut last = None;
        for seed in seeds {
            match Client::connect(seed, pool).await {
                Ok(client) => {
                    // Learn the map now: a gateway that cannot see the cluster is not ready.
                    client.current_map().await?;
                    return Ok(Upstream { client, scans });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| ClientError::Io(std::io::Error::other("no seed node given"))))
    }

    /// The client the typed front ends call.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The scans' limits.
    pub fn scan_limits(&self) -> &ScanLimits {
        &self.scans
    }

    /// Forgets the region map every `every` until `stop` (the next request learns it again).
    pub fn refresh_map_every(self: &Arc<Self>, every: Duration, stop: CancellationToken) {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
                me.client.forget_map();
                let _ = me.client.current_map().await;
            }
        });
    }

    /// The map binary clients see: one region covering every key, led by node 1, whose device
    /// address is empty ("the address you dialled").
    pub fn virtual_map() -> RegionMap {
        RegionMap {
            revision: 0,
            master: 0,
            regions: vec![RegionInfo {
                id: VIRTUAL_REGION,
                start: Vec::new(),
                end: None,
                primary: 1,
                backups: Vec::new(),
                joining: Vec::new(),
                epoch: VIRTUAL_EPOCH,
                state: RegionState::Serving,
            }],
            nodes: vec![NodeInfo {
                id: 1,
                device: String::new(),
                replication: String::new(),
                admin: String::new(),
                zone: String::new(),
            }],
        }
    }

    /// Answers one request of the binary front end (see the module documentation). Requests
    /// naming a region must name the virtual one (a client with another map is told to learn
    /// this one).
    pub async fn handle(&self, req: Request) -> Response {
        let id = req.id;
        if req.region != 0 && req.region != VIRTUAL_REGION {
            return Response::error(id, ErrorCode::WrongRegion, "a gateway serves one region (id 1): learn its map");
        }
        if req.epoch != 0 && req.epoch != VIRTUAL_EPOCH {
            return Response::error(id, ErrorCode::StaleEpoch, "a gateway's region has epoch 1: learn its map");
        }
        let ok = |reply| Response { id, version: 0, replicated: false, result: Ok(reply) };
        match &req.op {
            Op::RegionMap => ok(Reply::RegionMap(Self::virtual_map())),
            Op::Scan { lo, hi, limit, max_bytes, token } | Op::FloorScan { lo, hi, limit, max_bytes, token } => {
                if req.read_version != 0 {
                    return Response::error(
                        id,
                        ErrorCode::Unsupported,
                        "reads at a chosen version are not supported; send 0",
                    );
                }
                let scan = ScanRequest {
                    lo: lo.clone(),
                    hi: hi.clone(),
                    limit: *limit,
                    max_bytes: *max_bytes,
                    token: token.clone(),
                    floor: matches!(req.op, Op::FloorScan { .. }),
                };
                match crate::scan::run(self, scan).await {
                    Ok(reply) => ok(reply),
                    Err(e) => Response { id, version: 0, replicated: false, result: Err(e) },
                }
            }
            Op::Batch { ops } => match self.regions_of(ops.iter().map(dpukv_proto::WriteOp::key)).await {
                Ok(1) => self.client.forward(req).await,
                Ok(_) => Response::error(
                    id,
                    ErrorCode::Unsupported,
                    "a batch is atomic within one region of the cluster, and these keys span regions: \
                     split it (dpukv_client::Client::batch_across_regions)",
                ),
                Err(e) => Response { id, version: 0, replicated: false, result: Err(e.into_reply(true)) },
            },
            _ => self.client.forward(req).await,
        }
    }

    /// How many regions (by the current map) hold these keys.
    async fn regions_of<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) -> Result<usize, ClientError> {
        let map = self.client.current_map().await?;
        let mut ids: Vec<u32> = keys.filter_map(|k| map.region_of(k).map(|r| r.id)).collect();
        ids.sort_unstable();
        ids.dedup();
        Ok(ids.len().max(1))
    }
}
