//! Who may do what at the device's data port (docs/security.md §3), by the role in the
//! caller's certificate (`dpukv_net::identity`):
//!
//! | operation | roles |
//! |---|---|
//! | reads, writes, atomics, `pivots`, `auth` | `gateway`, `client`, `admin` |
//! | `tree_nodes` (a fat root's expansions) | `gateway`, `admin` |
//! | `replica_sync` (hot-key copies) | `node`, and only the node the map this device serves names primary of the request's region |
//! | `region_map` | every role of the cluster (all of them route by it) |
//!
//! A request that is not allowed is answered `unauthorized` (no certificate, or one naming no
//! identity) or `forbidden` (another role, another cluster, another node) and goes no further.
//! Without TLS nothing is checked (plain mode, the documented opt-in).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dpukv_net::identity::{Peer, Refusal, Role};
use dpukv_proto::{ErrorCode, Op, Request, Response};

use crate::conn::{Incoming, Sink};
use crate::regions::RegionMap;

/// Reads and writes.
const DATA: &[Role] = &[Role::Gateway, Role::Client, Role::Admin];
/// `tree_nodes`.
const TREE: &[Role] = &[Role::Gateway, Role::Admin];
/// `stats` (the console's source: who may see every region's most read keys).
const STATS: &[Role] = &[Role::Gateway, Role::Operator, Role::Admin];
/// `region_map`.
const ANY: &[Role] = &[Role::Node, Role::Gateway, Role::Operator, Role::Admin, Role::Client];

/// Whether `peer` may send `req`; `map` is the region map this device serves (None: not yet
/// read).
pub(crate) fn check(peer: &Peer, req: &Request, map: impl FnOnce() -> Option<Arc<RegionMap>>) -> Result<(), Response> {
    let what = req.op.code().name();
    let allowed = match &req.op {
        Op::RegionMap => peer.allow(ANY, what),
        Op::TreeNodes { .. } => peer.allow(TREE, what),
        Op::Stats => peer.allow(STATS, what),
        Op::ReplicaSync { .. } if peer.unchecked() => Ok(()),
        Op::ReplicaSync { .. } => {
            // A copy of a popular key is taken only from the node that leads its region in the
            // map this device serves, never on a peer's word.
            let primary = map().and_then(|m| m.regions().iter().find(|r| r.id == req.region).map(|r| r.primary));
            match primary {
                Some(p) => peer.allow_node(p, &format!("replica_sync of region {}", req.region)),
                None => {
                    return Err(Response::error(
                        req.id,
                        ErrorCode::WrongRegion,
                        format!("region {} is not in this device's map", req.region),
                    ));
                }
            }
        }
        _ => peer.allow(DATA, what),
    };
    allowed.map_err(|r| {
        let code = match r {
            Refusal::Unauthorized(_) => ErrorCode::Unauthorized,
            Refusal::Forbidden(_) => ErrorCode::Forbidden,
        };
        Response::error(req.id, code, r.message())
    })
}

/// The requests of `batch` that `peer` may send; the others are answered on `sink` with their
/// refusal (counted in `refused`).
pub(crate) fn admit(
    batch: Vec<Incoming>,
    peer: &Peer,
    map: impl Fn() -> Option<Arc<RegionMap>>,
    sink: &Sink,
    refused: &AtomicU64,
) -> Vec<Incoming> {
    if peer.unchecked() {
        return batch;
    }
    let mut admitted = Vec::with_capacity(batch.len());
    for inc in batch {
        match check(peer, &inc.req, &map) {
            Ok(()) => admitted.push(inc),
            Err(resp) => {
                refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = ?peer, op = inc.req.op.code().name(), "refused a request for its caller's role");
                sink.send(resp, inc.charge);
            }
        }
    }
    admitted
}

#[cfg(test)]
mod tests {
    use dpukv_net::identity::Identity;
    use dpukv_proto::regionmap::{self, NodeInfo, RegionInfo};

    use super::*;

    fn map() -> Arc<RegionMap> {
        let node = |id| NodeInfo {
            id,
            device: String::new(),
            replication: String::new(),
            admin: String::new(),
            zone: String::new(),
            fabric: String::new(),
        };
        let mut regions = RegionInfo::split(&[b"m".to_vec()], 1);
        regions[1].primary = 2;
        let m = regionmap::RegionMap { revision: 1, master: 1, regions, nodes: vec![node(1), node(2)] };
        Arc::new(RegionMap::new(m, 2).expect("map"))
    }

    fn member(role: Role, id: &str) -> Peer {
        Peer::Member(Identity::new("db", "demo", role, id).expect("identity"))
    }

    fn code(peer: &Peer, op: Op, region: u32) -> Option<ErrorCode> {
        let mut req = Request::new(7, op);
        req.region = region;
        check(peer, &req, || Some(map())).err().map(|r| r.result.expect_err("an error").code)
    }

    #[test]
    fn each_operation_is_for_its_roles_and_syncs_only_from_the_regions_primary() {
        let put = || Op::Put { key: b"k".to_vec(), value: b"v".to_vec() };
        let sync = || Op::ReplicaSync { watermark_ms: 0, reset: false, entries: vec![] };
        let tree = || Op::TreeNodes { key: b"k".to_vec(), nodes: vec![] };
        for role in [Role::Gateway, Role::Client, Role::Admin] {
            assert_eq!(code(&member(role, "x"), put(), 0), None, "{role} writes");
        }
        assert_eq!(code(&member(Role::Node, "1"), put(), 0), Some(ErrorCode::Forbidden));
        assert_eq!(code(&member(Role::Operator, "op"), put(), 0), Some(ErrorCode::Forbidden));
        assert_eq!(code(&Peer::Anonymous, put(), 0), Some(ErrorCode::Unauthorized));
        assert_eq!(code(&member(Role::Client, "x"), tree(), 0), Some(ErrorCode::Forbidden));
        assert_eq!(code(&member(Role::Gateway, "x"), tree(), 0), None);
        assert_eq!(code(&member(Role::Node, "3"), Op::RegionMap, 0), None, "every member routes");
        assert_eq!(
            code(&member(Role::Client, "c"), Op::Stats, 0),
            Some(ErrorCode::Forbidden),
            "a client sees no stats"
        );
        assert_eq!(code(&member(Role::Node, "3"), Op::Stats, 0), Some(ErrorCode::Forbidden));
        assert_eq!(code(&member(Role::Gateway, "g"), Op::Stats, 0), None, "the console's gateway does");
        // Region 2 is led by node 2: only node 2 syncs its copies.
        assert_eq!(code(&member(Role::Node, "2"), sync(), 2), None);
        assert_eq!(code(&member(Role::Node, "1"), sync(), 2), Some(ErrorCode::Forbidden));
        assert_eq!(code(&member(Role::Gateway, "2"), sync(), 2), Some(ErrorCode::Forbidden));
        assert_eq!(code(&member(Role::Node, "2"), sync(), 9), Some(ErrorCode::WrongRegion));
        // Plain mode: nothing is checked.
        assert_eq!(code(&Peer::Unchecked, sync(), 2), None);
        assert_eq!(code(&Peer::Unchecked, tree(), 0), None);
    }
}
