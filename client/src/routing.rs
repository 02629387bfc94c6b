//! Which node a request goes to: the cluster's region map (learned from any node with the
//! `region_map` op, so clients need no etcd), each region's primary device, and a pool of
//! pipelined connections per device. The one routing implementation clients and gateways use
//! (`dpukv_proto::regionmap` routes keys; this module picks connections and refreshes the map).
//!
//! A standalone node's map names one node with an empty device address: requests go to the
//! endpoint the client was given. Bounds: one pool per node of the map (at most
//! `regionmap::MAX_NODES`), each of the client's pool size.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use dpukv_proto::regionmap::RegionMap;
use dpukv_proto::{ErrorCode, ErrorReply, Op, Reply, Request};

use crate::ClientError;
use crate::conn::Connection;
use crate::local::{Local, LocalCall, LocalDevice};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A device's connections (or, for the device in this process, the device itself) and the
/// requests in flight on them (how busy it is, as this client sees it: the hot-key access modes
/// choose by it).
pub(crate) struct Pool {
    via: Via,
    in_flight: AtomicUsize,
}

enum Via {
    Net(Vec<Connection>),
    Local(Arc<dyn LocalDevice>),
}

impl Pool {
    pub(crate) fn new(conns: Vec<Connection>) -> Pool {
        Pool { via: Via::Net(conns), in_flight: AtomicUsize::new(0) }
    }

    /// The device in this process.
    pub(crate) fn local(device: Arc<dyn LocalDevice>) -> Pool {
        Pool { via: Via::Local(device), in_flight: AtomicUsize::new(0) }
    }

    /// Requests in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Sends `req` on connection `i` (modulo), counted in flight meanwhile.
    pub(crate) async fn call(
        &self,
        i: usize,
        req: Request,
        timeout: Duration,
    ) -> Result<dpukv_proto::Response, ClientError> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let r = match &self.via {
            Via::Net(conns) => conns[i % conns.len()].call(req, timeout).await,
            Via::Local(device) => call_local(&**device, req, timeout).await,
        };
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        r
    }
}

/// A request to the device in this process: checked as a connection checks it, answered within
/// `timeout` (then `TimedOut`: it may still execute).
async fn call_local(
    device: &dyn LocalDevice,
    req: Request,
    timeout: Duration,
) -> Result<dpukv_proto::Response, ClientError> {
    if let Err(c) = req.op.validate() {
        return Err(ClientError::Invalid(c));
    }
    match device.call(req) {
        LocalCall::Ready(r) => Ok(r),
        LocalCall::Later(answer) => match tokio::time::timeout(timeout, answer).await {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(ClientError::Disconnected),
            Err(_) => Err(ClientError::TimedOut),
        },
    }
}

/// How long a map refresh waits for the other nodes once one answered.
const REFRESH_GRACE: Duration = Duration::from_millis(250);
/// How long dialling a replica may take, and how long one that failed is not tried again.
const REPLICA_DIAL: Duration = Duration::from_millis(500);
const REPLICA_DOWN: Duration = Duration::from_secs(1);

/// A client's view of the cluster.
pub(crate) struct Router {
    seed: String,
    pool: usize,
    /// Presented on every connection, if given.
    token: Option<Arc<[u8]>>,
    /// TLS on every connection, if given.
    tls: Option<Arc<dpukv_net::tls::ClientTls>>,
    map: RwLock<Option<Arc<RegionMap>>>,
    /// The last map learned, kept when `map` is forgotten: its nodes are asked for a newer one.
    last: RwLock<Option<Arc<RegionMap>>>,
    pools: Mutex<HashMap<String, Arc<Pool>>>,
    /// Replicas that could not be dialled, and until when they are not tried again.
    down: Mutex<HashMap<String, std::time::Instant>>,
    refreshing: tokio::sync::Mutex<()>,
    /// The node whose device is in this process, and its pool.
    local: Option<(u32, Arc<Pool>)>,
}

/// Where one request goes.
pub(crate) struct Target {
    pub(crate) pool: Arc<Pool>,
    pub(crate) region: u32,
    pub(crate) epoch: u64,
    /// The region's backups' devices (hot-key replicas), only when asked for.
    pub(crate) replicas: Vec<Arc<Pool>>,
}

fn unavailable(msg: &str) -> ClientError {
    ClientError::Server(ErrorReply { code: ErrorCode::Unavailable, message: msg.into() })
}

impl Router {
    pub(crate) fn new(
        seed: &str,
        pool: usize,
        seed_pool: Arc<Pool>,
        token: Option<Arc<[u8]>>,
        tls: Option<Arc<dpukv_net::tls::ClientTls>>,
        local: Option<Local>,
    ) -> Router {
        let mut pools = HashMap::new();
        pools.insert(seed.to_string(), seed_pool);
        Router {
            seed: seed.to_string(),
            pool,
            token,
            tls,
            map: RwLock::new(None),
            last: RwLock::new(None),
            pools: Mutex::new(pools),
            down: Mutex::new(HashMap::new()),
            refreshing: tokio::sync::Mutex::new(()),
            local: local.map(|l| (l.node, Arc::new(Pool::local(l.device)))),
        }
    }

    /// The map in use, if one was learned.
    pub(crate) fn map(&self) -> Option<Arc<RegionMap>> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets the map (the next request learns it again).
    pub(crate) fn invalidate(&self) {
        *self.map.write().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Where to reach `node`'s device: over the fabric when this client dialled its seed over
    /// one and the node advertises a fabric endpoint, else its data port (an empty `device`: the
    /// seed itself).
    fn device(&self, map: &RegionMap, node: u32) -> Option<String> {
        let n = map.node(node)?;
        if dpukv_net::fabric::FabricAddr::is_fabric(&self.seed) && !n.fabric.is_empty() {
            return Some(n.fabric.clone());
        }
        Some(if n.device.is_empty() { self.seed.clone() } else { n.device.clone() })
    }

    /// The connections to node `node`'s device (by the current map; learnt first if none).
    pub(crate) async fn node_pool(&self, node: u32, timeout: Duration) -> Result<Arc<Pool>, ClientError> {
        let map = match self.map() {
            Some(m) => m,
            None => self.refresh(timeout).await?,
        };
        let addr = self.device(&map, node).ok_or_else(|| unavailable("no such node in the region map"))?;
        self.pool_for(&addr).await
    }

    async fn pool_for(&self, addr: &str) -> Result<Arc<Pool>, ClientError> {
        if let Some(p) = lock(&self.pools).get(addr) {
            return Ok(p.clone());
        }
        let mut conns = Vec::new();
        for _ in 0..self.pool {
            conns.push(Connection::open(addr, self.token.clone(), self.tls.clone()).await?);
        }
        let p = Arc::new(Pool::new(conns));
        let mut pools = lock(&self.pools);
        // Bounded by the nodes of the map (and the seed): drop pools of nodes that left.
        if let Some(map) = self.map() {
            let keep: Vec<String> = map.nodes.iter().filter_map(|n| self.device(&map, n.id)).collect();
            pools.retain(|a, _| a == &self.seed || keep.contains(a));
        }
        Ok(pools.entry(addr.to_string()).or_insert(p).clone())
    }

    /// Learns the map: asks the seed, every node of the last map learned and every node this
    /// client has talked to — all at once, each within `timeout` — and keeps the newest (highest
    /// metadata revision) answer. Every node of the last map is asked because the one this
    /// client talks to may be the one that fell behind: a primary whose host is paused still
    /// answers with the map it last had, naming itself (a gateway that asked only its seed and
    /// the devices it had used kept sending writes to such a node). One refresh at a time;
    /// callers that waited for one use its result.
    pub(crate) async fn refresh(&self, timeout: Duration) -> Result<Arc<RegionMap>, ClientError> {
        let _one = self.refreshing.lock().await;
        if let Some(m) = self.map() {
            return Ok(m);
        }
        let mut addrs = vec![self.seed.clone()];
        if let Some(last) = self.last.read().unwrap_or_else(|e| e.into_inner()).clone() {
            addrs.extend(last.nodes.iter().filter_map(|n| self.device(&last, n.id)));
        }
        addrs.extend(lock(&self.pools).keys().cloned());
        let mut seen = std::collections::HashSet::new();
        addrs.retain(|a| seen.insert(a.clone()));
        let mut asks = tokio::task::JoinSet::new();
        for a in addrs {
            // A node this client has a pool for is asked on it; another on a connection of its
            // own, dialled for this question only (nothing is kept for a node no request used).
            let pool = lock(&self.pools).get(&a).cloned();
            let (token, tls) = (self.token.clone(), self.tls.clone());
            asks.spawn(async move {
                let ask = async {
                    let req = Request::new(0, Op::RegionMap);
                    match pool {
                        Some(p) => p.call(0, req, timeout).await,
                        None => Connection::open(&a, token, tls).await?.call(req, timeout).await,
                    }
                };
                tokio::time::timeout(timeout, ask).await.unwrap_or(Err(ClientError::TimedOut))
            });
        }
        let mut newest: Option<RegionMap> = None;
        let mut last_err = None;
        // Once a map came back, the others get REFRESH_GRACE more: a paused or cut-off node
        // (which holds no newer map than the rest) does not hold the refresh up for `timeout`.
        let mut until: Option<tokio::time::Instant> = None;
        loop {
            let next = match until {
                Some(t) => match tokio::time::timeout_at(t, asks.join_next()).await {
                    Ok(n) => n,
                    Err(_) => break,
                },
                None => asks.join_next().await,
            };
            let Some(done) = next else { break };
            match done.unwrap_or_else(|_| Err(unavailable("asking a node for the region map failed"))) {
                Ok(dpukv_proto::Response { result: Ok(Reply::RegionMap(m)), .. }) => {
                    until.get_or_insert_with(|| tokio::time::Instant::now() + REFRESH_GRACE);
                    if newest.as_ref().is_none_or(|x| m.revision > x.revision) {
                        newest = Some(m);
                    }
                }
                Ok(dpukv_proto::Response { result: Err(e), .. }) => last_err = Some(ClientError::Server(e)),
                Ok(_) => last_err = Some(unavailable("a node answered the region map with something else")),
                Err(e) => last_err = Some(e),
            }
        }
        let Some(m) = newest else {
            return Err(last_err.unwrap_or_else(|| unavailable("no node answered the region map")));
        };
        let m = Arc::new(m);
        *self.map.write().unwrap_or_else(|e| e.into_inner()) = Some(m.clone());
        *self.last.write().unwrap_or_else(|e| e.into_inner()) = Some(m.clone());
        Ok(m)
    }

    /// Whether a device in this process answers some requests ([`crate::Options::local`]).
    pub(crate) fn has_local(&self) -> bool {
        self.local.is_some()
    }

    /// A get of `key` answered at once by the device in this process, its value appended to
    /// `out`, if that device leads the key's region by the map in use (None otherwise, or when the
    /// device answers gets only by a call).
    pub(crate) fn get_local_into(&self, key: &[u8], out: &mut Vec<u8>) -> Option<crate::local::GetInto> {
        let (node, pool) = self.local.as_ref()?;
        let Via::Local(device) = &pool.via else { return None };
        let map = self.map()?;
        let r = map.region_of(key)?;
        if r.primary != *node {
            return None;
        }
        device.get_into(r.id, r.epoch, key, out)
    }

    /// Where `req` goes: the primary device of the region holding its key, with the region and
    /// epoch to name (and, with `replicas`, the devices of the region's backups that can be
    /// reached). `region_map` requests go to the seed.
    pub(crate) async fn target(&self, req: &Request, timeout: Duration, replicas: bool) -> Result<Target, ClientError> {
        if let Op::RegionMap = req.op {
            let pool = self.pool_for(&self.seed).await?;
            return Ok(Target { pool, region: 0, epoch: 0, replicas: Vec::new() });
        }
        let map = match self.map() {
            Some(m) => m,
            None => self.refresh(timeout).await?,
        };
        let r = map.region_of(req.op.key()).ok_or_else(|| unavailable("the region map is empty"))?;
        let Some(addr) = self.device(&map, r.primary) else {
            self.invalidate();
            return Err(unavailable("the region has no live primary yet"));
        };
        let pool = match &self.local {
            Some((node, pool)) if *node == r.primary => pool.clone(),
            _ => self.pool_for(&addr).await?,
        };
        let mut pools = Vec::new();
        if replicas {
            for b in r.backups.iter().filter(|&&b| b != r.primary) {
                let Some(a) = self.device(&map, *b).filter(|a| a != &addr) else { continue };
                if lock(&self.down).get(&a).is_some_and(|until| *until > std::time::Instant::now()) {
                    continue;
                }
                // A backup that cannot be reached serves nothing (its reads go to the primary),
                // and is not dialled again for a while.
                match tokio::time::timeout(REPLICA_DIAL, self.pool_for(&a)).await {
                    Ok(Ok(p)) => pools.push(p),
                    _ => {
                        let mut down = lock(&self.down);
                        down.retain(|_, until| *until > std::time::Instant::now());
                        down.insert(a, std::time::Instant::now() + REPLICA_DOWN);
                    }
                }
            }
        }
        Ok(Target { pool, region: r.id, epoch: r.epoch, replicas: pools })
    }
}
