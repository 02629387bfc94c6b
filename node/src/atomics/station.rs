//! The reservation station: in-flight atomics of one pipeline round, indexed by key hash (1024
//! slots; operations whose keys share a slot form a chain and are examined in order, so a
//! collision can cost a comparison but never a missed dependency). Each key's latest value is
//! cached in its entry — loaded once, then forwarded from one operation to the next — and dirty
//! values are written back once per round, so a hot counter costs one log append per round
//! instead of one per operation.

use std::hash::{BuildHasher, Hasher};

use dpukv_proto::{Op, Reply};

use super::vector::{self, TypeMismatch};

const SLOTS: usize = 1024;

/// Why an atomic failed.
#[derive(Debug)]
pub enum AtomicError<E> {
    /// The value is not an array of the element type.
    TypeMismatch,
    /// A vector operation, reduce or filter on an absent key.
    NotFound,
    /// Loading the value failed.
    Load(E),
    /// Not an atomic.
    NotAtomic,
}

impl<E> From<TypeMismatch> for AtomicError<E> {
    fn from(_: TypeMismatch) -> Self {
        AtomicError::TypeMismatch
    }
}

struct Entry {
    key: Vec<u8>,
    value: Option<Vec<u8>>,
    dirty: bool,
}

/// A counter's value as `add_text` reads it: absent counts as 0.
fn counter(v: Option<&[u8]>) -> Result<i64, TypeMismatch> {
    v.map_or(Ok(0), |v| dpukv_proto::counter::parse(v).ok_or(TypeMismatch))
}

/// Each of `deltas` added in turn to `start`: each one's result, none for one that would
/// overflow (it has no effect: the next starts from the value before it); and the value after
/// them. What `add_text` answers, and what an exactly-once retry is answered again from the value
/// the key had before it.
pub fn add_each(start: i64, deltas: &[i64]) -> (Vec<Option<i64>>, i64) {
    let mut n = start;
    let results = deltas
        .iter()
        .map(|d| {
            let m = n.checked_add(*d)?;
            n = m;
            Some(m)
        })
        .collect();
    (results, n)
}

/// Applies an `add_text` run to the key's entry; the value is written even when unchanged
/// (INCRBY 0 makes an absent key "0"), but not when every increment overflowed.
fn add_text(e: &mut Entry, deltas: &[i64]) -> Result<Vec<Option<i64>>, TypeMismatch> {
    let (results, n) = add_each(counter(e.value.as_deref())?, deltas);
    if results.iter().any(Option::is_some) {
        e.value = Some(n.to_string().into_bytes());
        e.dirty = true;
    }
    Ok(results)
}

/// See the module documentation. It keeps no counters: its owner, the host's region writer,
/// counts atomics and write-backs in its `WriterStats` (exported as metrics).
pub struct ReservationStation {
    slots: Vec<Vec<Entry>>,
    hasher: std::collections::hash_map::RandomState,
}

impl Default for ReservationStation {
    fn default() -> Self {
        ReservationStation::new()
    }
}

impl ReservationStation {
    /// An empty station.
    pub fn new() -> Self {
        ReservationStation {
            slots: (0..SLOTS).map(|_| Vec::new()).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    fn slot(&self, key: &[u8]) -> usize {
        let mut h = self.hasher.build_hasher();
        h.write(key);
        h.finish() as usize % SLOTS
    }

    /// Whether an operation on `key` is in flight (its value is cached here).
    pub fn holds(&self, key: &[u8]) -> bool {
        self.slots[self.slot(key)].iter().any(|e| e.key == key)
    }

    /// The key's entry (chain, index), loaded with `load` the first time the key is seen this
    /// round.
    fn entry<E>(
        &mut self,
        key: &[u8],
        load: &mut impl FnMut(&[u8]) -> Result<Option<Vec<u8>>, E>,
    ) -> Result<(usize, usize), E> {
        let s = self.slot(key);
        let chain = &mut self.slots[s];
        if let Some(i) = chain.iter().position(|e| e.key == key) {
            return Ok((s, i));
        }
        let value = load(key)?;
        chain.push(Entry { key: key.to_vec(), value, dirty: false });
        Ok((s, chain.len() - 1))
    }

    /// Executes an atomic against the forwarded values of its keys, loading each with `load` the
    /// first time the key is seen this round. An `add_texts` checks every key's value before it
    /// changes any (it is applied whole or not at all).
    pub fn execute<E>(
        &mut self,
        op: &Op,
        mut load: impl FnMut(&[u8]) -> Result<Option<Vec<u8>>, E>,
    ) -> Result<Reply, AtomicError<E>> {
        if let Op::AddTexts { adds } = op {
            let mut at = Vec::with_capacity(adds.len());
            for (key, _) in adds {
                let (s, i) = self.entry(key, &mut load).map_err(AtomicError::Load)?;
                counter(self.slots[s][i].value.as_deref())?;
                at.push((s, i));
            }
            let mut results = Vec::with_capacity(adds.iter().map(|(_, d)| d.len()).sum());
            for ((s, i), (_, deltas)) in at.into_iter().zip(adds) {
                results.extend(add_text(&mut self.slots[s][i], deltas)?);
            }
            return Ok(Reply::Added(results));
        }
        let (s, i) = self.entry(op.key(), &mut load).map_err(AtomicError::Load)?;
        let e = &mut self.slots[s][i];
        let reply = match op {
            Op::FetchAdd { delta, .. } => {
                let (old, new) = vector::fetch_add(e.value.as_deref(), *delta)?;
                e.value = Some(new);
                e.dirty = true;
                Reply::Scalar(old.to_le_bytes())
            }
            Op::CompareAndSwap { expected, new, .. } => {
                let current = e.value.clone();
                let swapped = current == *expected;
                if swapped {
                    e.value = Some(new.clone());
                    e.dirty = true;
                }
                Reply::Cas { swapped, current }
            }
            Op::VectorScalar { elem, op, operand, .. } => {
                let v = e.value.as_deref().ok_or(AtomicError::NotFound)?;
                e.value = Some(vector::vector_scalar(v, *elem, *op, operand)?);
                e.dirty = true;
                Reply::Done
            }
            Op::VectorVector { elem, op, operand, .. } => {
                let v = e.value.as_deref().ok_or(AtomicError::NotFound)?;
                e.value = Some(vector::vector_vector(v, *elem, *op, operand)?);
                e.dirty = true;
                Reply::Done
            }
            Op::Reduce { elem, op, .. } => {
                let v = e.value.as_deref().ok_or(AtomicError::NotFound)?;
                Reply::Scalar(vector::reduce(v, *elem, *op)?)
            }
            Op::Filter { elem, cmp, operand, .. } => {
                let v = e.value.as_deref().ok_or(AtomicError::NotFound)?;
                Reply::Vector(vector::filter(v, *elem, *cmp, operand)?)
            }
            Op::AddText { deltas, .. } => Reply::Added(add_text(e, deltas)?),
            _ => return Err(AtomicError::NotAtomic),
        };
        Ok(reply)
    }

    /// Ends the round: the values to write back (dirty keys), and an empty station.
    pub fn drain(&mut self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        for chain in &mut self.slots {
            for e in chain.drain(..) {
                if e.dirty
                    && let Some(v) = e.value
                {
                    out.push((e.key, v));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_atomics_are_forwarded_and_written_back_once() {
        let mut rs = ReservationStation::new();
        let mut loads = 0;
        for i in 0..100u64 {
            let r = rs
                .execute::<()>(&Op::FetchAdd { key: b"ctr".to_vec(), delta: 2 }, |_| {
                    loads += 1;
                    Ok(Some(10u64.to_le_bytes().to_vec()))
                })
                .expect("fetch_add");
            assert_eq!(r, Reply::Scalar((10 + 2 * i).to_le_bytes()));
        }
        assert_eq!(loads, 1, "the value is loaded once and forwarded");
        let cas = rs.execute::<()>(
            &Op::CompareAndSwap {
                key: b"ctr".to_vec(),
                expected: Some(210u64.to_le_bytes().to_vec()),
                new: b"x".to_vec(),
            },
            |_| Ok(None),
        );
        assert!(matches!(cas, Ok(Reply::Cas { swapped: true, .. })));
        let out = rs.drain();
        assert_eq!(out, vec![(b"ctr".to_vec(), b"x".to_vec())]);
        assert!(rs.drain().is_empty());
    }

    #[test]
    fn text_counters_count_as_redis_does_and_are_written_back_once() {
        let add = |deltas: &[i64]| Op::AddText { key: b"n".to_vec(), deltas: deltas.to_vec() };
        let mut rs = ReservationStation::new();
        // Absent counts as 0; each increment's result in order; one overflow has no effect.
        let r = rs.execute::<()>(&add(&[1, 2, i64::MAX, -4]), |_| Ok(None)).expect("add");
        assert_eq!(r, Reply::Added(vec![Some(1), Some(3), None, Some(-1)]));
        // The next request on the key in the same round starts from the forwarded value.
        let r = rs.execute::<()>(&add(&[10]), |_| panic!("loaded twice")).expect("add");
        assert_eq!(r, Reply::Added(vec![Some(9)]));
        assert_eq!(rs.drain(), vec![(b"n".to_vec(), b"9".to_vec())], "one write-back, as text");
        // Not a counter as Redis reads one: refused whole, nothing written.
        for bad in [&b"x"[..], b"", b"01", b"-0", b"+1", b" 1", b"1.5", b"99999999999999999999"] {
            let r = rs.execute::<()>(&add(&[1]), |_| Ok(Some(bad.to_vec())));
            assert!(matches!(r, Err(AtomicError::TypeMismatch)), "{bad:?}: {r:?}");
            assert!(rs.drain().is_empty(), "{bad:?}");
        }
        // INCRBY 0 of an absent key makes it "0".
        rs.execute::<()>(&add(&[0]), |_| Ok(None)).expect("add");
        assert_eq!(rs.drain(), vec![(b"n".to_vec(), b"0".to_vec())]);
    }

    #[test]
    fn an_add_texts_checks_every_key_before_it_changes_any() {
        let mut rs = ReservationStation::new();
        let adds =
            |a: &[(&[u8], &[i64])]| Op::AddTexts { adds: a.iter().map(|(k, d)| (k.to_vec(), d.to_vec())).collect() };
        let load = |k: &[u8]| -> Result<Option<Vec<u8>>, ()> {
            Ok(match k {
                b"ten" => Some(b"10".to_vec()),
                b"text" => Some(b"abc".to_vec()),
                _ => None,
            })
        };
        // Each key's run in order, results key after key; a key named twice continues.
        let r = rs.execute(&adds(&[(b"ten", &[1, 2]), (b"new", &[-5]), (b"ten", &[100])]), load).expect("adds");
        assert_eq!(r, Reply::Added(vec![Some(11), Some(13), Some(-5), Some(113)]));
        // A key that is not a counter refuses the whole operation, even after keys that are.
        let r = rs.execute(&adds(&[(b"ten", &[1]), (b"text", &[1])]), load);
        assert!(matches!(r, Err(AtomicError::TypeMismatch)), "{r:?}");
        let mut out = rs.drain();
        out.sort();
        assert_eq!(out, vec![(b"new".to_vec(), b"-5".to_vec()), (b"ten".to_vec(), b"113".to_vec())]);
    }
}
