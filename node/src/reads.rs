//! The read path shared by the device (its normal job) and the host (the
//! `--serve-reads-on-host` baseline): gets, paged scans and floor scans across regions with
//! continuation tokens, and the read-only atomics (reduce, filter), from the regions'
//! shared-memory arenas and levels.

use dpukv_proto::limits::{MAX_SCAN_BYTES, MAX_SCAN_ITEMS};
use dpukv_proto::{ErrorCode, Op, Reply, Request, Response, ScanToken};
use dpukv_storage::region::RegionReader;

use crate::regions::RegionMap;

/// Maps a storage error to a protocol error response.
pub fn storage_error(id: u64, e: &dpukv_storage::Error) -> Response {
    let code = match e {
        dpukv_storage::Error::KeySize { .. } => ErrorCode::KeySize,
        dpukv_storage::Error::ValueTooLarge { .. } => ErrorCode::ValueTooLarge,
        dpukv_storage::Error::KeyExists => ErrorCode::KeyExists,
        dpukv_storage::Error::KeyNotFound => ErrorCode::KeyNotFound,
        e if e.is_retryable() => ErrorCode::Unavailable,
        dpukv_storage::Error::Io { .. } => ErrorCode::Unavailable,
        _ => ErrorCode::Internal,
    };
    Response::error(id, code, e.code())
}

/// The key right after `k` in byte order (`k` followed by a zero byte).
fn successor(k: &[u8]) -> Vec<u8> {
    let mut s = k.to_vec();
    s.push(0);
    s
}

/// Serves a read request (get, scan, floor scan) from `readers` (one per region of `map`).
pub fn serve(readers: &mut [RegionReader], map: &RegionMap, req: &Request) -> Response {
    let ok = |result| Response { id: req.id, version: 0, replicated: false, result: Ok(result) };
    if req.read_version != 0 {
        // Old versions live only as long as readers pin them; reading at a chosen one is not
        // offered (yet): say so rather than answer at another version.
        return Response::error(req.id, ErrorCode::Unsupported, "reads at a chosen version are not supported; send 0");
    }
    match &req.op {
        Op::Get { key } => match readers[map.route(key)].get_versioned(key) {
            Ok((v, version)) => Response { id: req.id, version, replicated: false, result: Ok(Reply::Value(v)) },
            Err(e) => storage_error(req.id, &e),
        },
        Op::Scan { lo, hi, limit, max_bytes, token } | Op::FloorScan { lo, hi, limit, max_bytes, token } => {
            let floor = matches!(req.op, Op::FloorScan { .. });
            match scan(readers, map, lo, hi, *limit, *max_bytes, token, floor) {
                Ok(Ok(r)) => ok(r),
                Ok(Err(code)) => Response::error(req.id, code, "malformed continuation token"),
                Err(e) => storage_error(req.id, &e),
            }
        }
        Op::Reduce { key, elem, op } => match readers[map.route(key)].get(key) {
            Ok(Some(v)) => match crate::atomics::vector::reduce(&v, *elem, *op) {
                Ok(s) => ok(Reply::Scalar(s)),
                Err(_) => {
                    Response::error(req.id, ErrorCode::TypeMismatch, "value is not an array of that element type")
                }
            },
            Ok(None) => Response::error(req.id, ErrorCode::KeyNotFound, "no value for the key"),
            Err(e) => storage_error(req.id, &e),
        },
        Op::Filter { key, elem, cmp, operand } => match readers[map.route(key)].get(key) {
            Ok(Some(v)) => match crate::atomics::vector::filter(&v, *elem, *cmp, operand) {
                Ok(out) => ok(Reply::Vector(out)),
                Err(_) => {
                    Response::error(req.id, ErrorCode::TypeMismatch, "value is not an array of that element type")
                }
            },
            Ok(None) => Response::error(req.id, ErrorCode::KeyNotFound, "no value for the key"),
            Err(e) => storage_error(req.id, &e),
        },
        _ => Response::error(req.id, ErrorCode::Internal, "not a read"),
    }
}

#[allow(clippy::too_many_arguments)]
fn scan(
    readers: &mut [RegionReader],
    map: &RegionMap,
    lo: &[u8],
    hi: &[u8],
    limit: u32,
    max_bytes: u32,
    token: &[u8],
    floor: bool,
) -> dpukv_storage::Result<Result<Reply, ErrorCode>> {
    let limit = if limit == 0 { MAX_SCAN_ITEMS } else { limit.min(MAX_SCAN_ITEMS) } as usize;
    let max_bytes = if max_bytes == 0 { MAX_SCAN_BYTES } else { max_bytes.min(MAX_SCAN_BYTES) } as usize;
    let mut start = if token.is_empty() {
        lo.to_vec()
    } else {
        match ScanToken::decode(token) {
            Some(t) => successor(&t.after),
            None => return Ok(Err(ErrorCode::BadToken)),
        }
    };
    if floor && token.is_empty() {
        // Honeycomb's SCAN starts at the largest key <= lo, which may sit in an earlier region.
        for i in (0..=map.route(lo)).rev() {
            let f = readers[i].floor_scan(lo, lo, 1)?;
            if let Some((k, _)) = f.into_iter().next() {
                start = k;
                break;
            }
        }
    }
    let mut items: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut bytes = 0usize;
    let mut more = false;
    for i in map.overlapping(&start, hi) {
        let page = readers[i].scan(&start, hi, limit + 1 - items.len())?;
        for (k, v) in page {
            if items.len() == limit || (bytes + k.len() + v.len() > max_bytes && !items.is_empty()) {
                more = true;
                break;
            }
            bytes += k.len() + v.len();
            items.push((k, v));
        }
        if more {
            break;
        }
    }
    let token = match (more, items.last()) {
        (true, Some((k, _))) => ScanToken { read_version: 0, after: k.clone() }.encode(),
        _ => Vec::new(),
    };
    Ok(Ok(Reply::Items { items, token }))
}
