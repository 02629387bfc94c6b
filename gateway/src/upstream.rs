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
//! To its binary clients the gateway shows the cluster's map with every node reached at the
//! address they dialled ([`Upstream::client_map`]): existing clients need no change, send
//! everything to the gateway, and still see the real regions — those a token may see: a region
//! boundary is a real key (the first of a region), so a boundary outside the prefixes the
//! caller's token may read is hidden, the regions on both sides shown as one ([`visible_map`]). The gateway routes each request
//! by its own map (which it forgets now and then, every `map_refresh`, so changes no request
//! tripped over still reach it).

use std::sync::Arc;
use std::time::Duration;

use dpukv_client::{Client, ClientError};
use dpukv_proto::regionmap::RegionMap;
use dpukv_proto::{ErrorCode, Op, Reply, Request, Response};
use tokio_util::sync::CancellationToken;

use crate::auth::{Perm, Principal};
use crate::scan::{ScanLimits, ScanRequest};

/// See the module documentation.
pub struct Upstream {
    client: Client,
    scans: ScanLimits,
}

impl Upstream {
    /// Connects to the first of `seeds` (node devices) that answers, with `opts` (connections
    /// per device, TLS, the fat root's budget, extended mode's busy threshold).
    pub async fn connect(
        seeds: &[String],
        opts: dpukv_client::Options,
        scans: ScanLimits,
    ) -> Result<Upstream, ClientError> {
        let mut last = None;
        for seed in seeds {
            match Client::connect_with(seed, opts.clone()).await {
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

    /// The map binary clients are shown: the cluster's, with every node's device address empty
    /// ("the address you dialled") and no fabric endpoint, so they send everything to the
    /// gateway while seeing the real regions (a client splitting a batch by region splits it
    /// where the nodes will) — in map format 1, which every client reads.
    /// With `caller` (tokens configured), only the boundaries it may see ([`visible_map`]).
    pub async fn client_map(&self, caller: Option<&Principal>) -> Result<RegionMap, ClientError> {
        let mut map = visible_map(&*self.client.current_map().await?, caller);
        for n in &mut map.nodes {
            n.device.clear();
            n.fabric.clear();
        }
        Ok(map)
    }

    /// Answers one request of the binary front end (see the module documentation). The region
    /// and epoch a request names are the client's view of the map; the gateway routes by its
    /// own (the newer), so they are not checked here.
    pub async fn handle(&self, req: Request) -> Response {
        self.handle_on(req, None, Vec::new(), None).await
    }

    /// Like [`Upstream::handle`], forwarding on the device connections `pin` names (requests
    /// handled together with one pin leave together: `Client::forward_on`); a floor scan's
    /// floor below `floor_min` is not used (the caller's grant starts there). `caller`: whose
    /// view of the map the request names regions in (`None`: an open gateway, the whole map).
    pub async fn handle_on(
        &self,
        req: Request,
        pin: Option<usize>,
        floor_min: Vec<u8>,
        caller: Option<&Principal>,
    ) -> Response {
        let id = req.id;
        let ok = |reply| Response { id, version: 0, replicated: false, result: Ok(reply) };
        match &req.op {
            Op::RegionMap => match self.client_map(caller).await {
                Ok(m) => ok(Reply::RegionMap(m)),
                Err(e) => Response { id, version: 0, replicated: false, result: Err(e.into_reply(false)) },
            },
            Op::Stats => Response::error(
                id,
                ErrorCode::Unsupported,
                "statistics are a device's: the gateway's console gathers them (/v1/console, docs/console.md)",
            ),
            Op::Scan { lo, hi, limit, max_bytes, token } | Op::FloorScan { lo, hi, limit, max_bytes, token } => {
                if req.read_version != 0 {
                    return Response::error(
                        id,
                        ErrorCode::Unsupported,
                        "reads at a chosen version are not supported; send 0",
                    );
                }
                // A scan naming a region reads only that region (docs/protocol.md §6).
                let mut hi = hi.clone();
                if req.region != 0 {
                    // The region as the caller was shown it.
                    let map = match self.client.current_map().await {
                        Ok(m) => visible_map(&m, caller),
                        Err(e) => {
                            return Response { id, version: 0, replicated: false, result: Err(e.into_reply(false)) };
                        }
                    };
                    let Some(r) = map.region(req.region) else {
                        return Response::error(id, ErrorCode::WrongRegion, "no such region: refresh the region map");
                    };
                    if let Some(last) = r.last_key()
                        && (hi.is_empty() || last < hi)
                    {
                        hi = last;
                    }
                }
                let scan = ScanRequest {
                    lo: lo.clone(),
                    hi,
                    limit: *limit,
                    max_bytes: *max_bytes,
                    token: token.clone(),
                    floor: matches!(req.op, Op::FloorScan { .. }),
                    floor_min,
                };
                match crate::scan::run(self, scan).await {
                    Ok(reply) => ok(reply),
                    Err(e) => Response { id, version: 0, replicated: false, result: Err(e) },
                }
            }
            Op::Batch { .. } | Op::AddTexts { .. } => match self.regions_of(req.op.keys()).await {
                Ok(1) => self.client.forward_on(req, pin).await,
                Ok(_) => Response::error(
                    id,
                    ErrorCode::Unsupported,
                    "a batch (or add_texts) is atomic within one region of the cluster, and these keys span \
                     regions: split it (dpukv_client::Client::batch_across_regions)",
                ),
                Err(e) => Response { id, version: 0, replicated: false, result: Err(e.into_reply(true)) },
            },
            _ => self.client.forward_on(req, pin).await,
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

/// The map `caller` is shown: the cluster's, less the region boundaries it may not see. A
/// boundary is the first key of a region — a real key — so it is shown only if the caller may
/// read it (no caller: an open gateway, every boundary); a hidden boundary joins the regions on
/// its two sides into one, shown with the first's id, epoch and placement. The regions shown
/// still cover every key once, in order, and every boundary inside a prefix the caller may read
/// is there, so its scans and batches within its grants are planned where the nodes cut them.
pub fn visible_map(map: &RegionMap, caller: Option<&Principal>) -> RegionMap {
    let Some(p) = caller else { return map.clone() };
    let mut regions: Vec<dpukv_proto::regionmap::RegionInfo> = Vec::with_capacity(map.regions.len());
    for r in &map.regions {
        match regions.last_mut() {
            Some(prev) if !p.may(Perm::Read, &r.start) => prev.end = r.end.clone(),
            _ => regions.push(r.clone()),
        }
    }
    RegionMap { regions, ..map.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dpukv_proto::regionmap::RegionInfo;

    /// Any token could read the region map, whose boundaries are keys of every prefix: a token
    /// now sees only the boundaries it may read, and the regions still cover every key.
    #[test]
    fn a_token_sees_only_the_boundaries_it_may_read() {
        let map = RegionMap {
            revision: 7,
            master: 1,
            regions: RegionInfo::split(&[b"app/m".to_vec(), b"bank/secret".to_vec(), b"zoo".to_vec()], 1),
            nodes: Vec::new(),
        };
        let doc = r#"{"tokens": [
            {"name": "app", "token": "app-secret-0123456789", "grants": [{"prefix": "app/", "allow": ["read", "write"]}]},
            {"name": "all", "token": "all-secret-0123456789", "grants": [{"prefix": "", "allow": ["read"]}]},
            {"name": "w", "token": "w-secret-012345678901", "grants": [{"prefix": "", "allow": ["write"]}]}
        ]}"#;
        let tokens = crate::auth::Tokens::parse(doc).expect("valid");
        let app = tokens.authenticate(b"app-secret-0123456789").expect("app");
        let shown = visible_map(&map, Some(&app));
        shown.validate().expect("still a valid map");
        let starts: Vec<&[u8]> = shown.regions.iter().map(|r| r.start.as_slice()).collect();
        assert_eq!(starts, vec![b"".as_slice(), b"app/m"]);
        assert_eq!((shown.regions[1].id, shown.regions[1].end.as_deref()), (2, None), "joined up to the end");
        assert_eq!(visible_map(&map, tokens.authenticate(b"all-secret-0123456789").as_deref()), map);
        assert_eq!(visible_map(&map, None), map, "an open gateway shows everything");
        let w = visible_map(&map, tokens.authenticate(b"w-secret-012345678901").as_deref());
        assert_eq!(w.regions.len(), 1, "a token that reads nothing sees no boundary");
    }
}
