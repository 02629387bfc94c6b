//! `SCAN` cursors. Redis clients parse a cursor as a 64-bit number (`redis-cli --scan` reads it
//! with `strtoull`), so a continuation key cannot travel in it: the gateway keeps, per cursor
//! number, where the scan goes on. The table is bounded — in entries and in bytes
//! ([`MAX_BYTES`]: a position holds two keys and a `MATCH` pattern of up to 16 KiB); oldest
//! cursors go first — and entries expire; a cursor it no longer knows is answered `ERR invalid cursor`. A cursor is valid on
//! any connection to this gateway (clients with connection pools move between connections); a
//! scan continued at another gateway replica is not.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where a scan goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The next key to read from.
    pub from: Vec<u8>,
    /// The range's end (inclusive; empty: the end of the key space).
    pub hi: Vec<u8>,
    /// The MATCH pattern (empty: none).
    pub pattern: Vec<u8>,
}

/// Most bytes of positions the table keeps.
pub const MAX_BYTES: usize = 64 << 20;

impl Position {
    /// About the bytes it holds.
    fn size(&self) -> usize {
        64 + self.from.len() + self.hi.len() + self.pattern.len()
    }
}

/// See the module documentation.
pub struct Cursors {
    table: Mutex<Table>,
    capacity: usize,
    ttl: Duration,
}

#[derive(Default)]
struct Table {
    by_id: HashMap<u64, (Position, Instant)>,
    order: VecDeque<u64>,
    next: u64,
    bytes: usize,
}

impl Cursors {
    /// A table of at most `capacity` cursors, each valid for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> Cursors {
        // Cursor numbers start at a random point so that two gateways (or one restarted) are
        // unlikely to hand out the same ones.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let table = Table { next: h.finish() >> 2, ..Table::default() };
        Cursors { table: Mutex::new(table), capacity: capacity.max(1), ttl }
    }

    /// A new cursor for `p` (a number above 0, below 2^63).
    pub fn put(&self, p: Position) -> u64 {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.next = (t.next + 1) & (u64::MAX >> 2);
        let id = t.next.max(1);
        while t.order.len() >= self.capacity || (t.bytes + p.size() > MAX_BYTES && !t.order.is_empty()) {
            if let Some(old) = t.order.pop_front()
                && let Some((gone, _)) = t.by_id.remove(&old)
            {
                t.bytes -= gone.size();
            }
        }
        t.order.push_back(id);
        t.bytes += p.size();
        t.by_id.insert(id, (p, Instant::now()));
        id
    }

    /// Where cursor `id` goes on, if it is known and not expired.
    pub fn get(&self, id: u64) -> Option<Position> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.by_id.get(&id).filter(|(_, at)| at.elapsed() < self.ttl).map(|(p, _)| p.clone())
    }

    /// Cursors held.
    pub fn len(&self) -> usize {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).by_id.len()
    }

    /// Whether no cursor is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_stays_bounded_and_cursors_expire() {
        let c = Cursors::new(3, Duration::from_millis(200));
        let p = |k: &str| Position { from: k.as_bytes().to_vec(), hi: Vec::new(), pattern: Vec::new() };
        let ids: Vec<u64> = ["a", "b", "c", "d"].iter().map(|k| c.put(p(k))).collect();
        assert!(ids.iter().all(|&i| i > 0 && i < 1 << 63));
        assert_eq!(c.len(), 3, "the oldest went");
        assert_eq!(c.get(ids[0]), None);
        assert_eq!(c.get(ids[3]), Some(p("d")));
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(c.get(ids[3]), None, "expired");
    }
}
