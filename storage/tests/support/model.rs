//! The `BTreeMap` model shared by the engine and region model tests: ranged scans, Honeycomb's
//! floor scan, and batches with insert/update preconditions.

use std::collections::BTreeMap;
use std::ops::Bound;

/// The model: key -> value.
pub type Model = BTreeMap<Vec<u8>, Vec<u8>>;
/// Scan results.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Up to `limit` items with keys in `[lo, hi]`.
pub fn model_scan(m: &Model, lo: &[u8], hi: &[u8], limit: usize) -> Pairs {
    if lo > hi {
        return Vec::new();
    }
    m.range::<[u8], _>((Bound::Included(lo), Bound::Included(hi)))
        .take(limit)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Like [`model_scan`], from the largest key `<= lo` (or `lo` when there is none).
pub fn model_floor_scan(m: &Model, lo: &[u8], hi: &[u8], limit: usize) -> Pairs {
    let start = m
        .range::<[u8], _>((Bound::Unbounded, Bound::Included(lo)))
        .next_back()
        .map(|(k, _)| k.clone())
        .unwrap_or_else(|| lo.to_vec());
    model_scan(m, &start, hi, limit)
}

/// The engine operations of a batch of (op, key, value): 0 put, 1 insert, 2 update, 3 delete.
pub fn batch_ops(items: &[(u8, Vec<u8>, Vec<u8>)]) -> Vec<dpukv_storage::BatchOp<'_>> {
    use dpukv_storage::BatchOp;
    items
        .iter()
        .map(|(t, k, v)| match t {
            0 => BatchOp::Put(k, v),
            1 => BatchOp::Insert(k, v),
            2 => BatchOp::Update(k, v),
            _ => BatchOp::Delete(k),
        })
        .collect()
}

/// Applies a batch of (op, key, value) — op 0 put, 1 insert, 2 update, 3 delete — to a copy of
/// the model; None if an insert or update precondition fails (then nothing applies).
pub fn model_batch(m: &Model, items: &[(u8, Vec<u8>, Vec<u8>)]) -> Option<Model> {
    let mut m2 = m.clone();
    for (t, k, v) in items {
        match t {
            1 if m2.contains_key(k) => return None,
            2 if !m2.contains_key(k) => return None,
            0..=2 => {
                m2.insert(k.clone(), v.clone());
            }
            _ => {
                m2.remove(k);
            }
        }
    }
    Some(m2)
}
