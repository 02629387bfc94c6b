//! Checking **bounded staleness** (`bounded:MS` reads, docs/hot-keys.md): every read returns a
//! value that was current at most `MS` before the read began.
//!
//! Histories are of unique values: each write puts a value no other write puts. A read that
//! returned the value of write `w` is **too stale** if some write `w2` of the same key certainly
//! came after `w` (`w` returned before `w2` was called) and was acknowledged more than the bound
//! before the read was called — then `w`'s value had been overwritten for longer than the bound.
//! A read that returned a value no write put (and not the key's initial value), or put only by a
//! write called after the read returned, is **invented**. Writes whose outcome is unknown never
//! make a read stale (they may have taken effect late, or never) but do explain a read's value.

use std::collections::HashMap;

/// A write of a unique value.
#[derive(Debug, Clone)]
pub struct Write {
    /// The key.
    pub key: Vec<u8>,
    /// The value (unique among the writes).
    pub value: Vec<u8>,
    /// Invocation time (ns, one monotonic clock).
    pub call: u64,
    /// Acknowledgement time; None when the outcome is unknown.
    pub ret: Option<u64>,
}

/// A read that returned.
#[derive(Debug, Clone)]
pub struct Read {
    /// The key.
    pub key: Vec<u8>,
    /// The value returned (None: absent).
    pub value: Option<Vec<u8>>,
    /// Invocation time.
    pub call: u64,
    /// Response time.
    pub ret: u64,
}

/// What is wrong with a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// The value had been overwritten (by a write acknowledged at `overwritten_at`) for longer
    /// than the bound when the read was called at `read_call`.
    TooStale {
        /// The key.
        key: Vec<u8>,
        /// When the read was called.
        read_call: u64,
        /// When the overwriting write was acknowledged.
        overwritten_at: u64,
    },
    /// No write (called before the read returned) put the value.
    Invented {
        /// The key.
        key: Vec<u8>,
    },
}

/// Checks `reads` against `writes` with the bound `bound_ns`; `initial` holds each key's value
/// before the history (absent keys are absent). Returns every violation.
pub fn check(writes: &[Write], reads: &[Read], initial: &HashMap<Vec<u8>, Vec<u8>>, bound_ns: u64) -> Vec<Violation> {
    let mut by_value: HashMap<(&[u8], &[u8]), &Write> = HashMap::new();
    let mut by_key: HashMap<&[u8], Vec<&Write>> = HashMap::new();
    for w in writes {
        by_value.insert((&w.key, &w.value), w);
        by_key.entry(&w.key).or_default().push(w);
    }
    let mut out = Vec::new();
    for r in reads {
        let empty = Vec::new();
        let later = by_key.get(r.key.as_slice()).unwrap_or(&empty);
        // When the value read stopped being possibly current: the first acknowledgement of a
        // write that certainly followed the one that put it.
        let source_ret: Option<u64> = match &r.value {
            Some(v) => match by_value.get(&(r.key.as_slice(), v.as_slice())) {
                Some(w) if w.call <= r.ret => w.ret.or(Some(u64::MAX)),
                Some(_) => {
                    out.push(Violation::Invented { key: r.key.clone() });
                    continue;
                }
                None if initial.get(&r.key) == Some(v) => Some(0),
                None => {
                    out.push(Violation::Invented { key: r.key.clone() });
                    continue;
                }
            },
            // Absent (the histories have no deletes): current until the first write acknowledged.
            None => Some(0),
        };
        let Some(source_ret) = source_ret else { continue };
        let overwritten = later
            .iter()
            .filter(|w2| w2.call > source_ret)
            .filter_map(|w2| w2.ret)
            .filter(|&ret| ret.saturating_add(bound_ns) < r.call)
            .min();
        if let Some(at) = overwritten {
            out.push(Violation::TooStale { key: r.key.clone(), read_call: r.call, overwritten_at: at });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(v: &str, call: u64, ret: Option<u64>) -> Write {
        Write { key: b"k".to_vec(), value: v.into(), call, ret }
    }

    fn r(v: Option<&str>, call: u64) -> Read {
        Read { key: b"k".to_vec(), value: v.map(Into::into), call, ret: call + 1 }
    }

    #[test]
    fn a_value_overwritten_longer_than_the_bound_is_too_stale() {
        let writes = [w("a", 0, Some(10)), w("b", 20, Some(30))];
        let none = HashMap::new();
        assert!(check(&writes, &[r(Some("a"), 100)], &none, 100).is_empty(), "b acked 70 before: within 100");
        let v = check(&writes, &[r(Some("a"), 131)], &none, 100);
        assert_eq!(v, vec![Violation::TooStale { key: b"k".to_vec(), read_call: 131, overwritten_at: 30 }]);
        assert!(check(&writes, &[r(Some("b"), 10_000)], &none, 100).is_empty(), "the latest is never stale");
    }

    #[test]
    fn concurrent_and_unknown_writes_never_make_a_read_stale() {
        // b was called before a returned: concurrent, so a may be the later one.
        let writes = [w("a", 0, Some(10)), w("b", 5, Some(12)), w("c", 20, None)];
        assert!(check(&writes, &[r(Some("a"), 10_000)], &HashMap::new(), 100).is_empty());
        // A value from an unknown-outcome write explains the read.
        assert!(check(&writes, &[r(Some("c"), 10_000)], &HashMap::new(), 100).is_empty());
    }

    #[test]
    fn invented_and_absent_values() {
        let writes = [w("a", 50, Some(60))];
        let none = HashMap::new();
        assert_eq!(check(&writes, &[r(Some("zzz"), 10)], &none, 100), vec![Violation::Invented { key: b"k".to_vec() }]);
        assert_eq!(
            check(&writes, &[r(Some("a"), 10)], &none, 5),
            vec![Violation::Invented { key: b"k".to_vec() }],
            "read before the write was called"
        );
        assert!(check(&writes, &[r(None, 100)], &none, 100).is_empty());
        assert_eq!(check(&writes, &[r(None, 500)], &none, 100).len(), 1, "absent long after a put");
        let init = HashMap::from([(b"k".to_vec(), b"i".to_vec())]);
        assert!(check(&writes, &[r(Some("i"), 100)], &init, 100).is_empty());
        assert_eq!(check(&writes, &[r(Some("i"), 500)], &init, 100).len(), 1);
    }
}
