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

/// A value as Redis reads a counter: a decimal signed 64-bit integer in canonical form — an
/// optional `-`, digits without a leading zero (`0` alone), nothing else (no `+`, no spaces, not
/// `-0`), at most 20 bytes.
pub fn parse_decimal(v: &[u8]) -> Option<i64> {
    let digits = v.strip_prefix(b"-").unwrap_or(v);
    let canonical = !digits.is_empty()
        && v.len() <= 20
        && digits.iter().all(u8::is_ascii_digit)
        && (digits[0] != b'0' || (digits.len() == 1 && digits.len() == v.len()));
    if !canonical {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
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

    /// Executes an atomic against the key's forwarded value, loading it with `load` the first
    /// time the key is seen this round.
    pub fn execute<E>(
        &mut self,
        op: &Op,
        load: impl FnOnce(&[u8]) -> Result<Option<Vec<u8>>, E>,
    ) -> Result<Reply, AtomicError<E>> {
        let key = op.key();
        let s = self.slot(key);
        let chain = &mut self.slots[s];
        let i = match chain.iter().position(|e| e.key == key) {
            Some(i) => i,
            None => {
                let value = load(key).map_err(AtomicError::Load)?;
                chain.push(Entry { key: key.to_vec(), value, dirty: false });
                chain.len() - 1
            }
        };
        let e = &mut chain[i];
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
            Op::AddText { deltas, .. } => {
                let mut n = match e.value.as_deref() {
                    None => 0,
                    Some(v) => parse_decimal(v).ok_or(AtomicError::TypeMismatch)?,
                };
                let mut results = Vec::with_capacity(deltas.len());
                for d in deltas {
                    match n.checked_add(*d) {
                        Some(m) => {
                            n = m;
                            results.push(Some(m));
                            // Written even when unchanged (INCRBY 0 makes an absent key "0").
                            e.dirty = true;
                        }
                        None => results.push(None),
                    }
                }
                if e.dirty {
                    e.value = Some(n.to_string().into_bytes());
                }
                Reply::Added(results)
            }
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
        assert_eq!(parse_decimal(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_decimal(b"0"), Some(0));
        // INCRBY 0 of an absent key makes it "0".
        rs.execute::<()>(&add(&[0]), |_| Ok(None)).expect("add");
        assert_eq!(rs.drain(), vec![(b"n".to_vec(), b"0".to_vec())]);
    }
}
