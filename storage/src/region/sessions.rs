//! Exactly-once sessions: what the region remembers so a retried write is answered, not applied
//! again. A writer that wants exactly-once tags a batch with entries `(client, seq, reply)`; the
//! entries are logged with the batch (an annotation record, same version) and recorded here when
//! the batch is applied, so a retry of `(client, seq)` finds the version and reply of the first
//! attempt — across reconnects and restarts (replay rebuilds the table; each compaction stores a
//! snapshot of it as of the log position it covers, so the log can be compacted away).
//!
//! Bounds: a client tells which sequence numbers it no longer needs (`acked_below`: every seq
//! below it got its reply), and those entries go; a client keeps at most
//! [`SessionLimits::per_client`] entries (past that its oldest go, and a retry of one of them gets
//! [`Lookup::Expired`]); at most [`SessionLimits::clients`] clients are kept (the least recently
//! used goes). A retry that finds nothing is never applied blindly when it could have been
//! applied before: below the client's bounds it is [`Lookup::Expired`] and the owner reports its
//! outcome as unknown — also when it claims to be a first attempt, since an original delayed on
//! its way can arrive after its retry was applied and forgotten. Clients keep the seqs they have
//! in flight within [`SessionLimits::per_client`] of their oldest unfinished one, so the bound
//! never drops an entry a retry may still need.
//!
//! A retry from a client the table does not know is the hard case: the client may never have
//! reached this region, or it may have been evicted after its first attempt was applied. The
//! table tells them apart with time: clients promise to stop retrying a write
//! [`RETRY_WINDOW_MS`] after its first attempt (the client library gives up well before), and the
//! table keeps the latest last-use time of any evicted client. An unknown client's retry is new
//! only when no client used within the window has been evicted (then it cannot have been one of
//! them); otherwise it is expired. For the same reason a client recreated while such an eviction
//! is recent starts with its earlier seqs expired. Times are wall-clock milliseconds; replayed
//! records count as used at replay time, which only makes the rule more cautious.
//!
//! The annotation (little-endian): `u16 n`, then n × (`u64 client`, `u64 seq`, `u8 reply len`,
//! reply bytes). The snapshot file: `DPUKVSS1`, `u32 clients`, per client `u64 client`,
//! `u64 acked_below`, `u64 expired_below`, `u32 n`, n × (`u64 seq`, `u64 version`, `u8 len`,
//! reply); then `u64 evicted_used_ms` and a CRC32C of everything before it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::error::{Error, Result};

/// One exactly-once entry of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionEntry {
    /// The client's id.
    pub client: u64,
    /// The write's sequence number in the client's session.
    pub seq: u64,
    /// The reply to give a retry (at most 255 bytes; the owner's encoding).
    pub reply: Vec<u8>,
}

/// What a retry finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Applied at `version`; answer with `reply`.
    Applied {
        /// The batch's version.
        version: u64,
        /// The reply recorded with it.
        reply: Vec<u8>,
    },
    /// Never seen: apply it.
    New,
    /// Too old to tell (dropped by a bound, or below what the client acknowledged): its outcome
    /// is unknown.
    Expired,
}

/// How long after a write's first attempt a client may still retry it (milliseconds). Clients
/// must give up before; the server assumes they do (see the module documentation).
pub const RETRY_WINDOW_MS: u64 = 120_000;

/// The table's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Most clients remembered.
    pub clients: usize,
    /// Most entries per client.
    pub per_client: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits { clients: 16_384, per_client: 1024 }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Session {
    /// Every seq below this got its reply: forgotten.
    acked_below: u64,
    /// Seqs below this were dropped by the per-client bound: a retry of one is expired.
    expired_below: u64,
    entries: BTreeMap<u64, (u64, Vec<u8>)>,
    /// Logical time of the last use (for least-recently-used eviction).
    used: u64,
    /// Wall-clock time of the last use (ms since the Unix epoch).
    used_ms: u64,
}

/// See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct Sessions {
    limits: SessionLimits,
    clients: HashMap<u64, Session>,
    clock: u64,
    /// Clients evicted by the clients bound so far (since open).
    pub evicted: u64,
    /// The latest last-use time of any evicted client (ms since the Unix epoch; 0: none).
    evicted_used_ms: u64,
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Sessions {
    /// An empty table with these bounds.
    pub fn new(limits: SessionLimits) -> Sessions {
        Sessions { limits, ..Sessions::default() }
    }

    /// What a write `(client, seq)` finds; `first` says it is the write's first attempt (so it
    /// cannot have been applied before).
    pub fn lookup(&self, client: u64, seq: u64, first: bool) -> Lookup {
        self.lookup_at(client, seq, first, now_ms())
    }

    /// [`Sessions::lookup`] at wall-clock time `now_ms`.
    pub fn lookup_at(&self, client: u64, seq: u64, first: bool, now_ms: u64) -> Lookup {
        match self.clients.get(&client) {
            Some(s) => match s.entries.get(&seq) {
                Some((version, reply)) => Lookup::Applied { version: *version, reply: reply.clone() },
                // Below what the client acknowledged or what the bound dropped: even a "first"
                // attempt may be a late original whose retry was applied and then forgotten.
                None if seq < s.acked_below.max(s.expired_below) => Lookup::Expired,
                None => Lookup::New,
            },
            None if !first && self.recent_eviction(now_ms) => Lookup::Expired,
            None => Lookup::New,
        }
    }

    /// Whether a client used within the retry window of `now_ms` may have been evicted.
    fn recent_eviction(&self, now_ms: u64) -> bool {
        self.evicted_used_ms != 0 && now_ms <= self.evicted_used_ms.saturating_add(RETRY_WINDOW_MS)
    }

    /// The client acknowledged every seq below `below`: forget them.
    pub fn acknowledge(&mut self, client: u64, below: u64) {
        if let Some(s) = self.clients.get_mut(&client)
            && below > s.acked_below
        {
            s.acked_below = below;
            s.entries = s.entries.split_off(&below);
        }
    }

    /// Records entries applied at `version`.
    pub fn record(&mut self, version: u64, entries: &[SessionEntry]) {
        self.record_at(version, entries, now_ms());
    }

    /// [`Sessions::record`] at wall-clock time `now_ms`.
    pub fn record_at(&mut self, version: u64, entries: &[SessionEntry], now_ms: u64) {
        let recent = self.recent_eviction(now_ms);
        for e in entries {
            self.clock += 1;
            let clock = self.clock;
            let s = self.clients.entry(e.client).or_insert_with(|| Session {
                // Recreated while an eviction is recent: its earlier seqs may have been applied.
                expired_below: if recent { e.seq } else { 0 },
                ..Session::default()
            });
            s.used = clock;
            s.used_ms = now_ms;
            if e.seq < s.acked_below {
                continue;
            }
            s.entries.insert(e.seq, (version, e.reply.clone()));
            while s.entries.len() > self.limits.per_client {
                let (&seq, _) = s.entries.iter().next().expect("over the bound: not empty");
                s.entries.remove(&seq);
                s.expired_below = s.expired_below.max(seq + 1);
            }
        }
        while self.clients.len() > self.limits.clients {
            let oldest = self.clients.iter().min_by_key(|(_, s)| s.used).map(|(c, _)| *c).expect("not empty");
            if let Some(gone) = self.clients.remove(&oldest) {
                self.evicted_used_ms = self.evicted_used_ms.max(gone.used_ms);
            }
            self.evicted += 1;
        }
    }

    /// Entries remembered.
    pub fn len(&self) -> usize {
        self.clients.values().map(|s| s.entries.len()).sum()
    }

    /// Every remembered entry (for a split or merge: the range's new region must answer retries
    /// of writes this one applied). Recorded again elsewhere, an entry gets the version of the
    /// batch that carries it; the reply is the same.
    pub fn entries(&self) -> Vec<SessionEntry> {
        let mut out: Vec<SessionEntry> = self
            .clients
            .iter()
            .flat_map(|(&client, s)| {
                s.entries.iter().map(move |(&seq, (_, reply))| SessionEntry { client, seq, reply: reply.clone() })
            })
            .collect();
        out.sort_by_key(|e| (e.client, e.seq));
        out
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.clients.values().all(|s| s.entries.is_empty())
    }

    /// The annotation a batch carries for `entries`.
    pub(crate) fn encode_note(entries: &[SessionEntry]) -> Vec<u8> {
        let mut b = Vec::with_capacity(2 + entries.len() * 24);
        b.extend_from_slice(&(entries.len() as u16).to_le_bytes());
        for e in entries {
            b.extend_from_slice(&e.client.to_le_bytes());
            b.extend_from_slice(&e.seq.to_le_bytes());
            b.push(e.reply.len() as u8);
            b.extend_from_slice(&e.reply);
        }
        b
    }

    /// Parses an annotation (None if malformed).
    pub(crate) fn decode_note(b: &[u8]) -> Option<Vec<SessionEntry>> {
        let n = u16::from_le_bytes(b.get(..2)?.try_into().ok()?) as usize;
        let mut p = 2;
        let mut out = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let client = u64::from_le_bytes(b.get(p..p + 8)?.try_into().ok()?);
            let seq = u64::from_le_bytes(b.get(p + 8..p + 16)?.try_into().ok()?);
            let len = *b.get(p + 16)? as usize;
            let reply = b.get(p + 17..p + 17 + len)?.to_vec();
            p += 17 + len;
            out.push(SessionEntry { client, seq, reply });
        }
        (p == b.len()).then_some(out)
    }

    /// The snapshot file's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = b"DPUKVSS1".to_vec();
        b.extend_from_slice(&(self.clients.len() as u32).to_le_bytes());
        let mut ids: Vec<&u64> = self.clients.keys().collect();
        ids.sort();
        for id in ids {
            let s = &self.clients[id];
            for x in [*id, s.acked_below, s.expired_below] {
                b.extend_from_slice(&x.to_le_bytes());
            }
            b.extend_from_slice(&(s.entries.len() as u32).to_le_bytes());
            for (seq, (version, reply)) in &s.entries {
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(&version.to_le_bytes());
                b.push(reply.len() as u8);
                b.extend_from_slice(reply);
            }
        }
        b.extend_from_slice(&self.evicted_used_ms.to_le_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses a snapshot file; `path` names it in errors.
    pub(crate) fn decode(b: &[u8], limits: SessionLimits, path: &Path) -> Result<Sessions> {
        let bad = |off: usize, what| Error::corrupt_file(path, off as u64, what);
        if b.len() < 24 || &b[..8] != b"DPUKVSS1" {
            return Err(bad(0, "not a sessions snapshot"));
        }
        let crc_at = b.len() - 4;
        if crc32c::crc32c(&b[..crc_at]) != u32::from_le_bytes(b[crc_at..].try_into().expect("4 bytes")) {
            return Err(bad(crc_at, "sessions snapshot checksum mismatch"));
        }
        let body = crc_at - 8;
        let le64 = |p: usize| {
            b.get(p..p + 8).filter(|_| p + 8 <= body).map(|x| u64::from_le_bytes(x.try_into().expect("8 bytes")))
        };
        let le32 = |p: usize| {
            b.get(p..p + 4).filter(|_| p + 4 <= body).map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")))
        };
        let n = le32(8).ok_or_else(|| bad(8, "truncated"))? as usize;
        let mut t = Sessions::new(limits);
        let now = now_ms();
        let mut p = 12;
        for _ in 0..n {
            let (client, acked, expired) = match (le64(p), le64(p + 8), le64(p + 16)) {
                (Some(a), Some(b), Some(c)) => (a, b, c),
                _ => return Err(bad(p, "truncated client")),
            };
            let m = le32(p + 24).ok_or_else(|| bad(p, "truncated client"))? as usize;
            p += 28;
            // Loaded clients count as used now: when they are evicted, the eviction is recent
            // (their last use before the snapshot is unknown, and may be recent).
            let mut s = Session { acked_below: acked, expired_below: expired, used_ms: now, ..Session::default() };
            for _ in 0..m {
                let (seq, version) = match (le64(p), le64(p + 8)) {
                    (Some(a), Some(b)) => (a, b),
                    _ => return Err(bad(p, "truncated entry")),
                };
                let len = *b.get(p + 16).filter(|_| p + 16 < body).ok_or_else(|| bad(p, "truncated entry"))? as usize;
                let reply = b
                    .get(p + 17..p + 17 + len)
                    .filter(|_| p + 17 + len <= body)
                    .ok_or_else(|| bad(p, "truncated entry"))?;
                s.entries.insert(seq, (version, reply.to_vec()));
                p += 17 + len;
            }
            t.clients.insert(client, s);
        }
        if p != body {
            return Err(bad(p, "trailing bytes in the sessions snapshot"));
        }
        t.evicted_used_ms = u64::from_le_bytes(b[body..crc_at].try_into().expect("8 bytes"));
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(client: u64, seq: u64) -> SessionEntry {
        SessionEntry { client, seq, reply: vec![seq as u8; (seq % 9) as usize] }
    }

    #[test]
    fn retries_find_their_reply_until_acknowledged_or_bounded() {
        let mut t = Sessions::new(SessionLimits { clients: 2, per_client: 3 });
        assert_eq!(t.lookup(1, 1, false), Lookup::New, "no eviction ever: an unknown client was never applied");
        t.record(10, &[e(1, 1), e(1, 2)]);
        assert_eq!(t.lookup(1, 2, false), Lookup::Applied { version: 10, reply: e(1, 2).reply });
        assert_eq!(t.lookup(1, 3, false), Lookup::New, "a known client's unseen seq was never applied");
        t.acknowledge(1, 2);
        assert_eq!(t.lookup(1, 1, false), Lookup::Expired, "acknowledged: forgotten, never re-applied blindly");
        t.record(11, &[e(1, 3), e(1, 4), e(1, 5)]);
        assert_eq!(t.lookup(1, 2, false), Lookup::Expired, "dropped by the per-client bound");
        assert!(matches!(t.lookup(1, 5, false), Lookup::Applied { version: 11, .. }));
        t.record(12, &[e(2, 1)]);
        t.record(13, &[e(3, 1)]);
        assert_eq!(t.lookup(1, 5, false), Lookup::Expired, "the least recently used client was evicted");
        assert_eq!(t.lookup(9, 1, false), Lookup::Expired, "any unknown client may be the evicted one");
        assert_eq!(t.lookup(1, 6, true), Lookup::New, "a first attempt is new");
        assert_eq!(t.evicted, 1);
        t.record(14, &[e(1, 6)]);
        assert_eq!(t.lookup(1, 5, false), Lookup::Expired, "recreated while the eviction is recent");
        assert_eq!(t.lookup(1, 6, false), Lookup::Applied { version: 14, reply: e(1, 6).reply });
        let p = Path::new("sessions");
        let again = Sessions::decode(&t.encode(), t.limits, p).expect("round trip");
        assert_eq!(again.encode(), t.encode());
        let mut bad = t.encode();
        bad[13] ^= 1;
        assert!(Sessions::decode(&bad, t.limits, p).is_err());
        let later = now_ms() + RETRY_WINDOW_MS + 1;
        assert_eq!(again.lookup_at(9, 1, false, later), Lookup::New, "past the retry window of every eviction");
        assert_eq!(again.lookup(9, 1, false), Lookup::Expired, "the eviction time survives the snapshot");
        // Clients loaded from a snapshot and then evicted make the eviction recent too.
        let mut loaded = Sessions::decode(&t.encode(), SessionLimits { clients: 2, per_client: 3 }, p).expect("load");
        loaded.evicted_used_ms = 0;
        loaded.record(20, &[e(5, 1), e(6, 1)]);
        assert_eq!(loaded.lookup(1, 6, false), Lookup::Expired, "a loaded client was evicted just now");
        let note = Sessions::encode_note(&[e(7, 9), e(7, 10)]);
        assert_eq!(Sessions::decode_note(&note), Some(vec![e(7, 9), e(7, 10)]));
        assert_eq!(Sessions::decode_note(&note[..note.len() - 1]), None);
    }
}
