//! Send Index on the backup (Tebis §2.3): rewrites a level segment shipped by the primary into a
//! local one. Value pointers are translated through the *log segment map* (primary log segment ->
//! local log segment) and node pointers through the *index segment map* (primary level segment ->
//! local level segment); offsets inside segments are unchanged, so the rewrite is one pass over
//! the nodes with a hash lookup per pointer — no key comparisons, no sorting, no reads of the log.

use std::collections::HashMap;
use std::path::Path;

use super::format::{LNode, NODE_HDR, NODE_LEAF, SEG_MAGIC, le32, le64};
use crate::error::{Error, Result};

/// Translates `p` (segment << 32 | offset) through `map`.
fn translate(p: u64, map: &HashMap<u64, u64>, path: &Path, at: usize) -> Result<u64> {
    if p == 0 {
        return Ok(0);
    }
    match map.get(&(p >> 32)) {
        Some(&local) => Ok(local << 32 | (p & 0xffff_ffff)),
        None => Err(Error::corrupt_file(path, at as u64, "pointer to a segment the backup does not have")),
    }
}

/// Rewrites the shipped segment `src` (primary id `primary_id`) as local segment `local_id`.
/// `path` names the shipped segment in errors.
pub fn rewrite_segment(
    src: &[u8],
    node_size: u32,
    primary_id: u64,
    local_id: u64,
    index_map: &HashMap<u64, u64>,
    log_map: &HashMap<u64, u64>,
    path: &Path,
) -> Result<Vec<u8>> {
    let ns = node_size as usize;
    if ns < NODE_HDR.max(32) || src.len() < ns || &src[..8] != SEG_MAGIC || crc32c::crc32c(&src[..28]) != le32(src, 28)
    {
        return Err(Error::corrupt_file(path, 0, "bad shipped level segment header"));
    }
    let nodes = le32(src, 20) as usize;
    if le64(src, 8) != primary_id || le32(src, 16) != node_size || src.len() != ns * (nodes + 1) {
        return Err(Error::corrupt_file(path, 8, "shipped segment does not match its metadata"));
    }
    if crc32c::crc32c(&src[ns..]) != le32(src, 24) {
        return Err(Error::corrupt_file(path, ns as u64, "shipped segment checksum mismatch"));
    }
    let mut out = src.to_vec();
    let put64 = |out: &mut Vec<u8>, at: usize, v: u64| out[at..at + 8].copy_from_slice(&v.to_le_bytes());
    for n in 1..=nodes {
        let base = n * ns;
        let err = |off: u64, what| Error::corrupt_file(path, off, what);
        let node = LNode::parse(&src[base..base + ns], base as u64, err)?;
        put64(&mut out, base + 8, translate(node.link, index_map, path, base + 8)?);
        put64(&mut out, base + 16, translate(node.prev, index_map, path, base + 16)?);
        let map = if node.kind == NODE_LEAF { log_map } else { index_map };
        for i in 0..node.count {
            if let Some(at) = node.pointer_offset(i, &err)? {
                let at = base + at;
                put64(&mut out, at, translate(le64(src, at), map, path, at)?);
            }
        }
    }
    out[8..16].copy_from_slice(&local_id.to_le_bytes());
    let crc = crc32c::crc32c(&out[ns..]);
    out[24..28].copy_from_slice(&crc.to_le_bytes());
    let hc = crc32c::crc32c(&out[..28]);
    out[28..32].copy_from_slice(&hc.to_le_bytes());
    Ok(out)
}
