//! Start hints (Fat-B+Tree) against a model: hints to every node of the tree, taken from one
//! state, are used for gets after random writes (splits, log merges, node merges, root growth and
//! collapse). A hint never changes an answer; hints to what did not change are used; stale ones
//! are counted as misses; a hint to another arena is never used.

use std::collections::BTreeMap;

use dpukv_storage::{ArenaConfig, Entry, Reader, StartHint, TopNode};
use proptest::prelude::*;

use crate::common::{Rng, must_writer};

/// Every node of the tree (the root, then layer by layer), with the arena's nonce.
fn whole_tree(r: &mut Reader) -> (u64, Vec<TopNode>) {
    let s = r.snapshot().expect("snapshot");
    let nonce = s.arena_nonce();
    let mut all = s.expand(&[]).expect("root").into_iter().map(|(_, n)| n).collect::<Vec<_>>();
    let mut layer = all.clone();
    while !layer.is_empty() {
        layer = s.expand(&layer).expect("expand").into_iter().map(|(_, n)| n).collect();
        all.extend(layer.iter().cloned());
    }
    (nonce, all)
}

/// The deepest node covering `key` (what a gateway would send).
fn hint_for<'n>(nonce: u64, nodes: &'n [TopNode], key: &[u8]) -> Option<StartHint<'n>> {
    nodes
        .iter()
        .filter(|n| n.lo.as_slice() <= key && n.hi.as_deref().is_none_or(|hi| key < hi))
        .min_by_key(|n| n.level)
        .map(|n| StartHint { arena: nonce, lid: n.lid, version: n.version, lo: &n.lo, hi: n.hi.as_deref() })
}

fn value_of(e: Option<(Entry<'_>, u64)>) -> Option<Vec<u8>> {
    match e {
        Some((Entry::Value(v), _)) => Some(v.to_vec()),
        _ => None,
    }
}

/// Rounds of: take hints to the whole tree, write `writes[i]` random operations, then get every
/// probe key with its hint and compare with the model. Returns (hints used, hints missed).
fn run(seed: u64, rounds: &[usize], node_size: u32) -> Result<(u64, u64), TestCaseError> {
    let cfg = ArenaConfig::small_nodes(node_size);
    let (_dir, _path, mut w) = must_writer(&cfg);
    let mut r = w.reader().expect("reader");
    // A reader pinned across each round's writes keeps what they retire from being reclaimed:
    // merged-away nodes keep their buffers and versions behind their page-table entries, which
    // only their retirement mark tells from live ones.
    let mut old = w.reader().expect("reader");
    let mut m: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut rng = Rng(seed);
    let key = |rng: &mut Rng| format!("k{:05}", rng.below(3000)).into_bytes();
    for _ in 0..1500 {
        let (k, v) = (key(&mut rng), rng.bytes_upto(40));
        w.put(&k, &v).expect("put");
        m.insert(k, v);
    }
    let (mut used, mut missed) = (0, 0);
    for &writes in rounds {
        let (nonce, nodes) = whole_tree(&mut r);
        let pinned = old.snapshot().expect("snapshot");
        for _ in 0..writes {
            let k = key(&mut rng);
            // Mostly deletes and inserts of many keys, so nodes split, merge and the root moves.
            if rng.below(2) == 0 {
                w.delete(&k).expect("delete");
                m.remove(&k);
            } else {
                let v = rng.bytes_upto(60);
                w.put(&k, &v).expect("put");
                m.insert(k, v);
            }
        }
        let s = r.snapshot().expect("snapshot");
        let (mut u, mut x) = (0, 0);
        for _ in 0..400 {
            let k = key(&mut rng);
            let Some(h) = hint_for(nonce, &nodes, &k) else { continue };
            let (e, was_used) = s.get_versioned_hinted(&k, &h).expect("hinted get");
            prop_assert_eq!(value_of(e), m.get(&k).cloned(), "a hinted get of {:?} answered wrong", k);
            if was_used {
                u += 1
            } else {
                x += 1
            }
            // A scan from the key, its descent started where the hint says: the entries of the
            // same scan from the root (tombstones included), and the values the model's.
            let entries = |e: Entry<'_>| match e {
                Entry::Value(v) => Some(v.to_vec()),
                _ => None,
            };
            let (mut hinted, mut plain) = (Vec::new(), Vec::new());
            s.scan_entries_hinted(&k, b"k99999", 5, &h, |k, e| hinted.push((k.to_vec(), entries(e))))
                .expect("hinted scan");
            s.scan_entries(&k, b"k99999", 5, |k, e| plain.push((k.to_vec(), entries(e)))).expect("scan");
            prop_assert_eq!(&hinted, &plain, "a hinted scan from {:?} answered wrong", k);
            for (key, v) in hinted.iter().filter(|(_, v)| v.is_some()) {
                prop_assert_eq!(v.as_ref(), m.get(key), "a scanned value");
            }
        }
        if writes == 0 {
            prop_assert_eq!(x, 0, "hints taken from this very state were not used");
        }
        drop(pinned);
        used += u;
        missed += x;
    }
    Ok((used, missed))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn stale_hints_never_give_a_wrong_answer(
        seed in any::<u64>(),
        rounds in proptest::collection::vec(prop_oneof![Just(0usize), 1usize..50, 200usize..2000], 1..6),
    ) {
        run(seed, &rounds, 512)?;
    }
}

#[test]
fn hints_are_used_until_their_nodes_change_and_stale_ones_are_counted() {
    let (used, missed) = run(7, &[0, 5, 3000, 0, 3000], 512).expect("model");
    assert!(used > 400, "fresh hints must be used ({used} used)");
    assert!(missed > 50, "hints stale after thousands of writes must miss ({missed} missed)");
}

#[test]
fn a_hint_to_another_arena_is_never_used() {
    let cfg = ArenaConfig::small_nodes(512);
    let (_d1, _p1, mut a) = must_writer(&cfg);
    let (_d2, _p2, mut b) = must_writer(&cfg);
    for i in 0..2000u32 {
        let k = format!("k{i:05}").into_bytes();
        a.put(&k, b"a").expect("put");
        b.put(&k, b"b").expect("put");
    }
    let (mut ra, mut rb) = (a.reader().expect("reader"), b.reader().expect("reader"));
    let (nonce, nodes) = whole_tree(&mut ra);
    let s = rb.snapshot().expect("snapshot");
    assert_ne!(nonce, s.arena_nonce());
    for i in (0..2000u32).step_by(37) {
        let k = format!("k{i:05}").into_bytes();
        let h = hint_for(nonce, &nodes, &k).expect("a covering node");
        // Even naming b's nonce: a's node ids and versions mean nothing in b unless they match.
        let (e, used) = s.get_versioned_hinted(&k, &h).expect("get");
        assert!(!used);
        assert_eq!(value_of(e), Some(b"b".to_vec()));
    }
}
