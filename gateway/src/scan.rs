//! Scans across the cluster (Fat-B+Tree §III-C, parallel range queries): the range is cut where
//! the region map cuts it, the parts are read in parallel — a window of them at a time, each by
//! [`Client::scan_part`](dpukv_client::Client::scan_part) — and their items are taken in key
//! order until the item or byte limit; the reply carries a continuation token (the last key
//! returned) when the range goes on. Tokens name a key, not a region, so they stay valid across
//! splits, merges and failovers.
//!
//! Memory is bounded twice: a scan reads ahead at most `parallelism` parts, each at most one
//! item more than `limit` and about `max_bytes`; and every part holds one of the gateway's
//! `part_permits` from before it starts until its items are taken, so all scans together hold
//! at most that many parts. Parts take their permits in key order, and a scan waits for a
//! permit only for the next part it needs (holding none for later ones), so scans never wait on
//! each other in a cycle.
//!
//! Consistency: each region is read at its own snapshot, as with the client library's scans
//! (docs/protocol.md §6).

use std::collections::VecDeque;
use std::sync::Arc;

use dpukv_client::{ClientError, ScanPart, successor};
use dpukv_proto::limits::{MAX_KEY, MAX_SCAN_BYTES, MAX_SCAN_ITEMS};
use dpukv_proto::{ErrorCode, ErrorReply, Reply, ScanToken};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::Metrics;
use crate::pivots::{self, PivotCache};
use crate::upstream::Upstream;

/// How scans may use the cluster.
#[derive(Clone)]
pub struct ScanLimits {
    /// Parts one scan reads ahead.
    pub parallelism: usize,
    /// Parts all scans may hold at once (see the module documentation).
    pub part_permits: Arc<Semaphore>,
    /// Scans asking for at least this many items cut each region's part at keys from the
    /// region's index (`pivots`) into pieces read in parallel (0: never) — while the gateway's
    /// scans hold fewer than `parallelism` parts: when several scans run at once, they already
    /// keep the devices' reader threads busy, and cutting would only add requests and merging.
    pub split_min: usize,
    /// The permits `part_permits` started with.
    pub parts_total: usize,
    /// Where parts are counted.
    pub metrics: Arc<Metrics>,
    /// The regions' pivots and gap sizes long scans are cut by.
    pub pivots: Arc<PivotCache>,
}

/// A scan as a front end asks for it (the binary protocol's fields).
#[derive(Debug, Clone, Default)]
pub struct ScanRequest {
    /// First key (empty: the start of the key space).
    pub lo: Vec<u8>,
    /// Last key, inclusive (empty: the end of the key space).
    pub hi: Vec<u8>,
    /// Most items (0: 10,000).
    pub limit: u32,
    /// Most bytes of keys and values (0: 4 MiB).
    pub max_bytes: u32,
    /// A continuation token from an earlier page (empty: the first page).
    pub token: Vec<u8>,
    /// Start at the largest key `<= lo` (without a token).
    pub floor: bool,
    /// A floor below this is not used (the scan starts at `lo`): the caller may read only from
    /// here on (its token's grant).
    pub floor_min: Vec<u8>,
}

fn error(code: ErrorCode, message: &str) -> ErrorReply {
    ErrorReply { code, message: message.into() }
}

type PartResult = (Result<ScanPart, ClientError>, OwnedSemaphorePermit);

/// Aborts the parts still running when a scan ends early.
struct Running(VecDeque<tokio::task::JoinHandle<PartResult>>);

impl Drop for Running {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

/// A piece of a cut region reads at least this many items at first.
const MIN_PIECE_ITEMS: usize = 256;

/// The region a part was planned in.
#[derive(Clone)]
struct RegionRef {
    id: u32,
    epoch: u64,
    start: Vec<u8>,
    /// Its last key (empty: the end of the key space).
    last: Vec<u8>,
}

/// A part of a scan's range: `[lo, hi]` (an empty `hi`: to the end of the key space), inside one
/// region when planned; `cut`: already cut by pivots (or not to be); `gaps`: the whole gaps
/// between pivots it spans (0: unknown), for learning their size; `spare`: the rest of a cut
/// region after the pieces planned to hold the page, started only when the page still needs it
/// (never read ahead).
struct Part {
    lo: Vec<u8>,
    hi: Vec<u8>,
    cut: bool,
    region: RegionRef,
    gaps: u32,
    spare: bool,
}

/// Cuts the first part, if not yet, at its region's pivots into pieces of about
/// `limit / parallelism` items (see [`pivots`]), so a long scan inside one region is read by
/// several device threads at once. Pivots are an optimization: if asking fails, the part stays
/// whole.
async fn cut_front(
    client: &dpukv_client::Client,
    cache: &PivotCache,
    parts: &mut VecDeque<Part>,
    limit: usize,
    parallelism: usize,
) {
    let Some(front) = parts.front_mut() else { return };
    if front.cut {
        return;
    }
    front.cut = true;
    let r = &front.region;
    let entry = match cache.get(r.id, r.epoch) {
        Some(e) => e,
        None => match client.pivots(&r.start, &r.last, pivots::ASK).await {
            Ok(keys) => cache.put(r.id, r.epoch, keys),
            Err(_) => return,
        },
    };
    let Part { lo, hi, region, .. } = parts.pop_front().expect("a front part");
    let pieces = pivots::plan(&entry.keys, entry.per_gap, &lo, &hi, limit, parallelism, MIN_PIECE_ITEMS);
    let n = pieces.len();
    for (i, p) in pieces.into_iter().enumerate().rev() {
        let spare = n > 1 && i == n - 1;
        parts.push_front(Part { lo: p.lo, hi: p.hi, cut: true, region: region.clone(), gaps: p.gaps, spare });
    }
}

/// One page of the scan `s` (see the module documentation).
pub async fn run(up: &Upstream, s: ScanRequest) -> Result<Reply, ErrorReply> {
    let limit = match s.limit {
        0 => MAX_SCAN_ITEMS as usize,
        n if n > MAX_SCAN_ITEMS => return Err(error(ErrorCode::TooManyOps, "limit is above 10,000")),
        n => n as usize,
    };
    let max_bytes = match s.max_bytes {
        0 => MAX_SCAN_BYTES as usize,
        n if n > MAX_SCAN_BYTES => return Err(error(ErrorCode::TooManyOps, "max_bytes is above 4 MiB")),
        n => n as usize,
    };
    if s.lo.len() > MAX_KEY || s.hi.len() > MAX_KEY {
        return Err(error(ErrorCode::KeySize, "a scan bound is longer than 1024 bytes"));
    }
    let client = up.client();
    let mut from = s.lo.clone();
    if !s.token.is_empty() {
        let t =
            ScanToken::decode(&s.token).ok_or_else(|| error(ErrorCode::BadToken, "malformed continuation token"))?;
        from = successor(&t.after).max(s.lo.clone());
    } else if s.floor
        && let Some(k) = client.floor_key(&s.lo).await.map_err(|e| e.into_reply(false))?
        && k >= s.floor_min
    {
        from = k;
    }
    let hi = s.hi;
    let done = || Reply::Items { items: Vec::new(), token: Vec::new() };
    if !hi.is_empty() && from > hi {
        return Ok(done());
    }
    // The parts: the range cut at the regions' ends (by the map now; each part re-plans itself
    // if the map moves under it).
    let map = client.current_map().await.map_err(|e| e.into_reply(false))?;
    let limits = up.scan_limits();
    // A long scan also cuts each region's part where the region's index does (see `split`).
    let parts_in_use = limits.parts_total.saturating_sub(limits.part_permits.available_permits());
    let split = limits.split_min > 0 && limit >= limits.split_min && parts_in_use < limits.parallelism;
    let mut parts: VecDeque<Part> = VecDeque::new();
    let mut a = from;
    for r in &map.regions[map.route(&a)..] {
        let last = r.last_key();
        let region =
            RegionRef { id: r.id, epoch: r.epoch, start: r.start.clone(), last: last.clone().unwrap_or_default() };
        match last {
            Some(last) if hi.is_empty() || last < hi => {
                parts.push_back(Part { lo: a, hi: last, cut: !split, region, gaps: 0, spare: false });
                a = r.end.clone().unwrap_or_default();
            }
            _ => {
                parts.push_back(Part { lo: a, hi: hi.clone(), cut: !split, region, gaps: 0, spare: false });
                break;
            }
        }
    }
    let want = limit + 1; // one more than the page takes: whether a next item exists
    // A piece of a cut region reads at most its share of the page at first (and reads on only
    // if the page needs it), so pieces read ahead beyond the page waste little.
    let piece_want = (limit / limits.parallelism.max(1)).max(MIN_PIECE_ITEMS).min(limit) + 1;
    let start_part = |p: Part, permit: OwnedSemaphorePermit| {
        limits.metrics.scan_parts.inc();
        let c = client.clone();
        let (a, b) = (p.lo, p.hi);
        let want = if split { piece_want } else { want };
        // The part's reads carry the scan's trace (a spawned task starts outside its scope).
        let trace = dpukv_client::trace::current();
        tokio::spawn(dpukv_client::trace::scope(
            trace,
            async move { (c.scan_part(&a, &b, want, max_bytes).await, permit) },
        ))
    };
    let mut running = Running(VecDeque::new());
    // Each started part's upper bound, region and whole gaps.
    let mut ends: VecDeque<(Vec<u8>, RegionRef, u32)> = VecDeque::new();
    let mut items: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut bytes = 0usize;
    let token = |items: &[(Vec<u8>, Vec<u8>)]| {
        items.last().map(|(k, _)| ScanToken { read_version: 0, after: k.clone() }.encode()).unwrap_or_default()
    };
    loop {
        // The next part must run (waiting for a permit if need be); read ahead while permits
        // are free, up to the window.
        if running.0.is_empty() {
            if split {
                cut_front(client, &limits.pivots, &mut parts, limit, limits.parallelism).await;
            }
            let Some(p) = parts.pop_front() else { break };
            let permit = limits
                .part_permits
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| error(ErrorCode::Unavailable, "the gateway is shutting down"))?;
            ends.push_back((p.hi.clone(), p.region.clone(), p.gaps));
            running.0.push_back(start_part(p, permit));
        }
        while running.0.len() < limits.parallelism.max(1) && !parts.is_empty() {
            if split {
                cut_front(client, &limits.pivots, &mut parts, limit, limits.parallelism).await;
            }
            if parts.front().is_some_and(|p| p.spare) {
                break;
            }
            let Ok(permit) = limits.part_permits.clone().try_acquire_owned() else { break };
            let p = parts.pop_front().expect("checked");
            ends.push_back((p.hi.clone(), p.region.clone(), p.gaps));
            running.0.push_back(start_part(p, permit));
        }
        let handle = running.0.pop_front().expect("one runs");
        let (end, region, gaps) = ends.pop_front().expect("one per part");
        let before = items.len();
        let (part, permit) = handle.await.map_err(|_| error(ErrorCode::Internal, "a scan part's task failed"))?;
        let mut part = part.map_err(|e| e.into_reply(false))?;
        loop {
            for (k, v) in std::mem::take(&mut part.items) {
                if items.len() == limit {
                    // Cut by the limit, and a next item exists.
                    let t = token(&items);
                    return Ok(Reply::Items { items, token: t });
                }
                let size = k.len() + v.len();
                if !items.is_empty() && bytes + size > max_bytes {
                    let t = token(&items);
                    return Ok(Reply::Items { items, token: t });
                }
                bytes += size;
                items.push((k, v));
            }
            if !part.more {
                break;
            }
            // The part stopped at its own limit: read on in its range (under its permit).
            let after = successor(&items.last().expect("a part that stopped at a limit holds items").0);
            let room = want - items.len();
            part = client.scan_part(&after, &end, room, max_bytes).await.map_err(|e| e.into_reply(false))?;
        }
        limits.pivots.learn(region.id, region.epoch, items.len() - before, gaps, false);
        drop(permit);
    }
    Ok(Reply::Items { items, token: Vec::new() })
}
