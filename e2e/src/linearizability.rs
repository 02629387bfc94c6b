//! Linearizability checking of key-value histories (Wing & Gong's search with Lowe's
//! memoization, as in Porcupine), partitioned by key: a history is linearizable iff each key's
//! sub-history is, since the model's operations on different keys commute. Scans are projected
//! into one read per key of their range, over the scan's interval (keys in the range that the
//! scan did not return are reads of "absent").
//!
//! Operations whose outcome is unknown (the client lost the connection or got a retryable error
//! after sending) may have taken effect at any point after their invocation, or not at all.

use std::collections::{BTreeMap, HashMap, HashSet};

/// What an operation did to one key, and what it returned.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyOp {
    /// Read: the value returned (None = absent).
    Get(Option<Vec<u8>>),
    /// Upsert.
    Put(Vec<u8>),
    /// Delete.
    Delete,
    /// Insert: whether it succeeded (false = KeyExists).
    Insert(Vec<u8>, bool),
    /// Update: whether it succeeded (false = KeyNotFound).
    Update(Vec<u8>, bool),
    /// fetch_add on a u64 value: delta, and the old value returned.
    FetchAdd(u64, u64),
    /// compare-and-swap: expected, new, and whether it swapped.
    Cas(Option<Vec<u8>>, Vec<u8>, bool),
}

/// One operation on one key, with its real-time interval (any monotonic clock).
#[derive(Debug, Clone)]
pub struct Event {
    /// The key.
    pub key: Vec<u8>,
    /// The operation and its result.
    pub op: KeyOp,
    /// Invocation time.
    pub call: u64,
    /// Response time; None when the outcome is unknown.
    pub ret: Option<u64>,
}

/// Applies `op` to a register holding `state`: the new state if the result is consistent.
fn step(state: &Option<Vec<u8>>, op: &KeyOp, known: bool) -> Option<Option<Vec<u8>>> {
    let u64_of = |v: &Option<Vec<u8>>| match v {
        None => Some(0),
        Some(b) if b.len() == 8 => Some(u64::from_le_bytes(b.as_slice().try_into().ok()?)),
        Some(_) => None,
    };
    match op {
        KeyOp::Get(v) => (v == state).then(|| state.clone()),
        KeyOp::Put(v) => Some(Some(v.clone())),
        KeyOp::Delete => Some(None),
        KeyOp::Insert(v, ok) => match (state.is_some(), known.then_some(*ok)) {
            (false, Some(true) | None) => Some(Some(v.clone())),
            (true, Some(false) | None) => Some(state.clone()),
            _ => None,
        },
        KeyOp::Update(v, ok) => match (state.is_some(), known.then_some(*ok)) {
            (true, Some(true) | None) => Some(Some(v.clone())),
            (false, Some(false) | None) => Some(None),
            _ => None,
        },
        KeyOp::FetchAdd(delta, old) => {
            let cur = u64_of(state)?;
            (!known || cur == *old).then(|| Some(cur.wrapping_add(*delta).to_le_bytes().to_vec()))
        }
        KeyOp::Cas(expected, new, swapped) => {
            let matches = state == expected;
            match (matches, known.then_some(*swapped)) {
                (true, Some(true) | None) => Some(Some(new.clone())),
                (false, Some(false) | None) => Some(state.clone()),
                _ => None,
            }
        }
    }
}

/// The result of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every key's history is linearizable.
    Linearizable,
    /// This key's history is not.
    Violation {
        /// The key.
        key: Vec<u8>,
        /// Its operations, for the report.
        ops: usize,
    },
    /// The search exceeded its budget on this key (inconclusive).
    Unknown(Vec<u8>),
}

/// Checks a history (events of every key).
pub fn check(events: &[Event], budget_per_key: u64) -> Verdict {
    let mut by_key: BTreeMap<&[u8], Vec<&Event>> = BTreeMap::new();
    for e in events {
        // A read whose result is unknown constrains nothing.
        if e.ret.is_none() && matches!(e.op, KeyOp::Get(_)) {
            continue;
        }
        by_key.entry(&e.key).or_default().push(e);
    }
    for (key, evs) in by_key {
        match check_key(&evs, budget_per_key) {
            Some(true) => {}
            Some(false) => return Verdict::Violation { key: key.to_vec(), ops: evs.len() },
            None => return Verdict::Unknown(key.to_vec()),
        }
    }
    Verdict::Linearizable
}

/// WGL search over one key's operations: Some(true) linearizable, Some(false) not, None when
/// the budget of search steps ran out.
fn check_key(evs: &[&Event], budget: u64) -> Option<bool> {
    let n = evs.len();
    // Entries: calls and returns in time order; returns of unknown outcomes never come.
    #[derive(Clone, Copy)]
    struct Ent {
        op: usize,
        is_call: bool,
        prev: usize,
        next: usize,
    }
    let mut order: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * n);
    for (i, e) in evs.iter().enumerate() {
        order.push((e.call, true, i));
        order.push((e.ret.unwrap_or(u64::MAX), false, i));
    }
    // At equal times, returns before calls (an op that returned at t precedes one called at t).
    order.sort_by_key(|&(t, is_call, i)| (t, is_call, i));
    let head = 2 * n; // sentinel
    let mut ents: Vec<Ent> = order.iter().map(|&(_, is_call, op)| Ent { op, is_call, prev: 0, next: 0 }).collect();
    ents.push(Ent { op: usize::MAX, is_call: false, prev: 0, next: 0 });
    for (i, e) in ents.iter_mut().enumerate().take(2 * n) {
        e.prev = if i == 0 { head } else { i - 1 };
        e.next = if i + 1 == 2 * n { head } else { i + 1 };
    }
    ents[head].next = if n == 0 { head } else { 0 };
    ents[head].prev = if n == 0 { head } else { 2 * n - 1 };
    let mut ret_of = vec![0usize; n];
    for (idx, e) in ents.iter().enumerate().take(2 * n) {
        if !e.is_call {
            ret_of[e.op] = idx;
        }
    }
    let words = n.div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut cache: HashSet<(Vec<u64>, Option<Vec<u8>>)> = HashSet::new();
    let mut stack: Vec<(usize, Option<Vec<u8>>)> = Vec::new();
    let mut state: Option<Vec<u8>> = None;
    let mut entry = ents[head].next;
    let mut steps = 0u64;
    // Operations with a known outcome still to place; once none is left, the unknown ones may
    // simply not have happened.
    let mut known_left = evs.iter().filter(|e| e.ret.is_some()).count();
    let lift = |ents: &mut Vec<Ent>, call: usize, ret: usize| {
        let (p, nx) = (ents[call].prev, ents[call].next);
        ents[p].next = nx;
        ents[nx].prev = p;
        let (p, nx) = (ents[ret].prev, ents[ret].next);
        ents[p].next = nx;
        ents[nx].prev = p;
    };
    let unlift = |ents: &mut Vec<Ent>, call: usize, ret: usize| {
        let (p, nx) = (ents[ret].prev, ents[ret].next);
        ents[p].next = ret;
        ents[nx].prev = ret;
        let (p, nx) = (ents[call].prev, ents[call].next);
        ents[p].next = call;
        ents[nx].prev = call;
    };
    while ents[head].next != head && known_left > 0 {
        steps += 1;
        if steps > budget {
            return None;
        }
        // Undoes the last linearization choice and moves past it.
        let mut backtrack = |ents: &mut Vec<Ent>, state: &mut Option<Vec<u8>>| -> Option<usize> {
            let (call, prev_state) = stack.pop()?;
            let op = ents[call].op;
            linearized[op / 64] &= !(1 << (op % 64));
            known_left += evs[op].ret.is_some() as usize;
            *state = prev_state;
            unlift(ents, call, ret_of[op]);
            Some(ents[call].next)
        };
        if entry == head {
            // Nothing more can be tried at this level.
            entry = backtrack(&mut ents, &mut state)?;
            continue;
        }
        let e = ents[entry];
        if e.is_call {
            let ev = evs[e.op];
            if let Some(next) = step(&state, &ev.op, ev.ret.is_some()) {
                let mut lin = linearized.clone();
                lin[e.op / 64] |= 1 << (e.op % 64);
                if cache.insert((lin.clone(), next.clone())) {
                    stack.push((entry, state.clone()));
                    state = next;
                    linearized = lin;
                    known_left -= ev.ret.is_some() as usize;
                    lift(&mut ents, entry, ret_of[e.op]);
                    entry = ents[head].next;
                    continue;
                }
            }
            entry = e.next;
        } else {
            // A return whose operation is not linearized yet: undo the last choice.
            match backtrack(&mut ents, &mut state) {
                Some(next) => entry = next,
                None => return Some(false),
            }
        }
    }
    Some(true)
}

/// Projects a scan of `[lo, hi]` that returned `items` into per-key reads of `keys` (the keys a
/// test uses): returned keys read their value, others in the range read "absent".
pub fn scan_events(
    keys: &[Vec<u8>],
    lo: &[u8],
    hi: &[u8],
    items: &[(Vec<u8>, Vec<u8>)],
    call: u64,
    ret: u64,
) -> Vec<Event> {
    let got: HashMap<&[u8], &[u8]> = items.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
    keys.iter()
        .filter(|k| k.as_slice() >= lo && k.as_slice() <= hi)
        .map(|k| Event {
            key: k.clone(),
            op: KeyOp::Get(got.get(k.as_slice()).map(|v| v.to_vec())),
            call,
            ret: Some(ret),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(key: &str, op: KeyOp, call: u64, ret: u64) -> Event {
        Event { key: key.as_bytes().to_vec(), op, call, ret: Some(ret) }
    }

    #[test]
    fn accepts_concurrent_and_rejects_stale_reads() {
        let v = |s: &str| s.as_bytes().to_vec();
        // Put overlaps the read: either value is fine.
        let ok = vec![
            ev("k", KeyOp::Put(v("1")), 0, 10),
            ev("k", KeyOp::Get(Some(v("1"))), 5, 6),
            ev("k", KeyOp::Get(None), 1, 2),
        ];
        assert_eq!(check(&ok, 100_000), Verdict::Linearizable);
        // A read after the put returned that still sees the old value is stale.
        let stale = vec![ev("k", KeyOp::Put(v("1")), 0, 10), ev("k", KeyOp::Get(None), 11, 12)];
        assert!(matches!(check(&stale, 100_000), Verdict::Violation { .. }));
        // fetch_adds must see distinct old values in some order.
        let fa = vec![
            ev("c", KeyOp::FetchAdd(1, 0), 0, 10),
            ev("c", KeyOp::FetchAdd(1, 1), 0, 10),
            ev("c", KeyOp::Get(Some(2u64.to_le_bytes().to_vec())), 11, 12),
        ];
        assert_eq!(check(&fa, 100_000), Verdict::Linearizable);
        let dup = vec![ev("c", KeyOp::FetchAdd(1, 0), 0, 10), ev("c", KeyOp::FetchAdd(1, 0), 0, 10)];
        assert!(matches!(check(&dup, 100_000), Verdict::Violation { .. }));
        // An unknown-outcome put may or may not have happened.
        let mut unknown = vec![Event { key: v("k"), op: KeyOp::Put(v("9")), call: 0, ret: None }];
        unknown.push(ev("k", KeyOp::Get(None), 5, 6));
        unknown.push(ev("k", KeyOp::Get(Some(v("9"))), 7, 8));
        assert_eq!(check(&unknown, 100_000), Verdict::Linearizable);
        unknown.push(ev("k", KeyOp::Get(None), 9, 10));
        assert!(matches!(check(&unknown, 100_000), Verdict::Violation { .. }));
    }

    proptest::proptest! {
        /// Histories produced by running operations one at a time against a model are always
        /// linearizable, however their intervals are stretched (without reordering).
        #[test]
        fn sequential_histories_pass(ops in proptest::collection::vec((0u8..3, 0u8..5, 0u8..4), 1..60), stretch in proptest::collection::vec(0u64..3, 60)) {
            let mut model: HashMap<u8, Option<Vec<u8>>> = HashMap::new();
            let mut events = Vec::new();
            for (i, (k, kind, v)) in ops.into_iter().enumerate() {
                let cur = model.entry(k).or_insert(None).clone();
                let op = match kind {
                    0 => KeyOp::Get(cur.clone()),
                    1 => KeyOp::Put(vec![v]),
                    2 => KeyOp::Delete,
                    3 => KeyOp::Insert(vec![v], cur.is_none()),
                    _ => KeyOp::Cas(Some(vec![v]), vec![v + 1], cur == Some(vec![v])),
                };
                let next = step(&cur, &op, true).expect("a sequential run is consistent");
                model.insert(k, next);
                let t = 10 * i as u64;
                events.push(Event { key: vec![k], op, call: t, ret: Some(t + 5 + stretch[i % 60]) });
            }
            proptest::prop_assert_eq!(check(&events, 1_000_000), Verdict::Linearizable);
        }
    }
}
