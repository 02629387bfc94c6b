//! The replication protocol between a region's primary and its backups (Tebis over TCP): the
//! primary streams its log's bytes (segment, offset, bytes) and, after each compaction, the new
//! levels' index segments; a backup answers with how far it holds the log, or refuses with a
//! typed reason (a stale epoch names the current one).
//!
//! Frames: `[u32 length of what follows][u8 version = REPL_VERSION][u8 kind][body]`, little-endian,
//! at most [`MAX_REPL_FRAME`] bytes. Every message names its region and the epoch it is sent
//! under. Decoding is checked (typed [`ReplDecodeError`], never a panic, nothing reserved beyond
//! the frame's bytes). The storage encodings carried inside (manifests, level metadata, sessions)
//! are opaque bytes here, checked by the storage layer that reads them.

/// Protocol version in every frame.
pub const REPL_VERSION: u8 = 1;
/// Largest frame (length prefix included): a whole log or index segment (64 MiB at most) and
/// its header.
pub const MAX_REPL_FRAME: usize = (64 << 20) + 4096;
/// Longest name or message.
pub const MAX_REPL_TEXT: usize = 1024;

/// Why a backup refuses what a primary sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplRefusal {
    /// The message's epoch is older than the newest the backup has seen (`current`).
    StaleEpoch = 1,
    /// The backup does not hold this region (or not as a backup).
    WrongRegion = 2,
    /// The primary belongs to another cluster.
    WrongCluster = 3,
    /// The bytes do not continue the backup's copy (it says where it is).
    Gap = 4,
    /// The backup failed to apply it (disk, corruption): it must be copied again.
    Failed = 5,
    /// The connection's certificate does not name the node the `Hello` says is the primary
    /// (docs/security.md): only that node may stream the region.
    Forbidden = 6,
}

impl ReplRefusal {
    fn from_u8(b: u8) -> Option<ReplRefusal> {
        Some(match b {
            1 => ReplRefusal::StaleEpoch,
            2 => ReplRefusal::WrongRegion,
            3 => ReplRefusal::WrongCluster,
            4 => ReplRefusal::Gap,
            5 => ReplRefusal::Failed,
            6 => ReplRefusal::Forbidden,
            _ => return None,
        })
    }

    /// A stable code naming it.
    pub fn code(self) -> &'static str {
        match self {
            ReplRefusal::StaleEpoch => "stale_epoch",
            ReplRefusal::WrongRegion => "wrong_region",
            ReplRefusal::WrongCluster => "wrong_cluster",
            ReplRefusal::Gap => "gap",
            ReplRefusal::Failed => "failed",
            ReplRefusal::Forbidden => "forbidden",
        }
    }
}

/// One replication message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplMessage {
    /// Primary -> backup, first on a connection: who sends, for which region and epoch.
    Hello {
        /// The cluster's name (a backup of another cluster refuses).
        cluster: String,
        /// The region.
        region: u32,
        /// The epoch the primary serves under.
        epoch: u64,
        /// The primary's node id.
        primary: u32,
        /// The primary's log end when it began to lead (a position): a backup whose copies
        /// followed another node — or another life of this one — drops what they hold from
        /// here on.
        base: u64,
        /// The primary's life as the region's leader: a number it draws each time it begins to
        /// lead the region (a restart is a new life). A primary that lost power may have lost
        /// the end of its log that its backups received; a new life tells them to cut at `base`.
        /// `None` from primaries older than this field (encoded as kind 1; with it, kind 9).
        life: Option<u64>,
    },
    /// Backup -> primary: where to stream from (its log position, `None`: it has nothing and
    /// must be copied from the start).
    Resume {
        /// The region.
        region: u32,
        /// The epoch it accepts.
        epoch: u64,
        /// The position (a log sequence number).
        from: Option<u64>,
    },
    /// Primary -> backup: log bytes.
    Append {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
        /// The primary's segment id.
        segment: u64,
        /// Where the bytes start in it.
        offset: u32,
        /// The segment file's size.
        segment_size: u32,
        /// Whether they end the segment.
        sealed: bool,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// Backup -> primary: it holds the log up to `upto` (everything before it).
    Held {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
        /// The position.
        upto: u64,
    },
    /// Primary -> backup: an index shipment begins (Send Index: one compaction's output, or
    /// the whole index). Only metadata: the levels' segments follow as [`ReplMessage::IndexPart`]s
    /// — a chunk of one segment at a time, interleaved with the log — and [`ReplMessage::IndexEnd`]
    /// installs it. Neither side holds more than one segment of it in memory.
    IndexBegin {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
        /// The primary's manifest after the compaction (storage's encoding).
        manifest: Vec<u8>,
        /// The exactly-once sessions snapshot stored with it.
        sessions: Vec<u8>,
        /// The levels shipped, each its metadata (storage's encoding).
        levels: Vec<Vec<u8>>,
    },
    /// Primary -> backup: bytes of one level segment of the shipment begun, from `offset`;
    /// `last` ends the segment. A segment's parts come in order, one segment after another.
    IndexPart {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
        /// The primary's segment id (one of a shipped level's).
        segment: u64,
        /// Where the bytes start in the segment.
        offset: u64,
        /// Whether they end the segment.
        last: bool,
        /// The bytes (at most a chunk).
        bytes: Vec<u8>,
    },
    /// Primary -> backup: every segment of the shipment was sent: install it (answered with
    /// [`ReplMessage::Installed`]).
    IndexEnd {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
    },
    /// Primary -> backup, answering its `Resume`: the log from where the backup resumes is no
    /// longer here (collected while it was away): it drops its copy, and the next connection
    /// copies the region from the start. Sent only by the region's current primary (the
    /// backup checked its `Hello` against the map) and only to a backup outside the write set.
    Restart {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
    },
    /// Backup -> primary: the index of that manifest generation is installed.
    Installed {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
        /// The backup's manifest generation after installing.
        generation: u64,
    },
    /// Primary -> backup: log segments the primary still has, ascending; a segment below the
    /// last one named and not named is gone there (garbage collection). The backup drops its
    /// copies of those once its own index no longer needs them (they lie before its manifest's
    /// log start). A primary with more than [`MAX_LIVE_SEGMENTS`] names its lowest ones.
    Segments {
        /// The region.
        region: u32,
        /// The epoch.
        epoch: u64,
        /// The primary's segment ids, ascending, at most [`MAX_LIVE_SEGMENTS`] (encoding keeps the
        /// lowest).
        live: Vec<u64>,
    },
    /// Backup -> primary: refused; `current` is the backup's newest epoch (for `StaleEpoch`) and
    /// `at` its log position (for `Gap`).
    Refuse {
        /// The region.
        region: u32,
        /// Why.
        reason: ReplRefusal,
        /// The backup's newest epoch.
        current: u64,
        /// The backup's log position.
        at: u64,
        /// A human-readable message.
        message: String,
    },
}

/// A frame that cannot be decoded. After any error but `Incomplete` the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplDecodeError {
    /// More bytes are needed.
    #[error("incomplete replication frame")]
    Incomplete,
    /// The frame's declared length is over the limit.
    #[error("replication frame of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// Another protocol version.
    #[error("unsupported replication protocol version {0}")]
    Version(u8),
    /// The frame's structure is broken.
    #[error("malformed replication frame: {0}")]
    Malformed(&'static str),
}

impl ReplDecodeError {
    /// A stable code naming it.
    pub fn code(&self) -> &'static str {
        match self {
            ReplDecodeError::Incomplete => "incomplete",
            ReplDecodeError::TooLarge(_) => "frame_too_large",
            ReplDecodeError::Version(_) => "bad_version",
            ReplDecodeError::Malformed(_) => "malformed",
        }
    }
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const RESUME: u8 = 2;
    pub const APPEND: u8 = 3;
    pub const HELD: u8 = 4;
    /// Kind 5 was a whole index in one frame (before shipments were chunked); no longer sent.
    pub const INDEX_BEGIN: u8 = 10;
    pub const INDEX_PART: u8 = 11;
    pub const INDEX_END: u8 = 12;
    pub const RESTART: u8 = 13;
    pub const INSTALLED: u8 = 6;
    pub const REFUSE: u8 = 7;
    pub const SEGMENTS: u8 = 8;
    pub const HELLO_LIFE: u8 = 9;
}

/// Most segment ids a `Segments` message names (a region's log of 1 TiB in 64 MiB segments).
pub const MAX_LIVE_SEGMENTS: usize = 1 << 14;

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u32(out, b.len() as u32);
    out.extend_from_slice(b);
}

impl ReplMessage {
    /// The region the message is about.
    pub fn region(&self) -> u32 {
        match self {
            ReplMessage::Hello { region, .. }
            | ReplMessage::Resume { region, .. }
            | ReplMessage::Append { region, .. }
            | ReplMessage::Held { region, .. }
            | ReplMessage::IndexBegin { region, .. }
            | ReplMessage::IndexPart { region, .. }
            | ReplMessage::IndexEnd { region, .. }
            | ReplMessage::Restart { region, .. }
            | ReplMessage::Installed { region, .. }
            | ReplMessage::Segments { region, .. }
            | ReplMessage::Refuse { region, .. } => *region,
        }
    }

    /// Appends the message's frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; 4]);
        out.push(REPL_VERSION);
        match self {
            ReplMessage::Hello { cluster, region, epoch, primary, base, life } => {
                out.push(if life.is_some() { kind::HELLO_LIFE } else { kind::HELLO });
                put_u32(out, *region);
                put_u64(out, *epoch);
                put_u32(out, *primary);
                put_u64(out, *base);
                put_bytes(out, cluster.as_bytes());
                if let Some(l) = life {
                    put_u64(out, *l);
                }
            }
            ReplMessage::Resume { region, epoch, from } => {
                out.push(kind::RESUME);
                put_u32(out, *region);
                put_u64(out, *epoch);
                out.push(u8::from(from.is_some()));
                put_u64(out, from.unwrap_or(0));
            }
            ReplMessage::Append { region, epoch, segment, offset, segment_size, sealed, bytes } => {
                out.push(kind::APPEND);
                put_u32(out, *region);
                put_u64(out, *epoch);
                put_u64(out, *segment);
                put_u32(out, *offset);
                put_u32(out, *segment_size);
                out.push(u8::from(*sealed));
                put_bytes(out, bytes);
            }
            ReplMessage::Held { region, epoch, upto } => {
                out.push(kind::HELD);
                put_u32(out, *region);
                put_u64(out, *epoch);
                put_u64(out, *upto);
            }
            ReplMessage::IndexBegin { region, epoch, manifest, sessions, levels } => {
                out.push(kind::INDEX_BEGIN);
                put_u32(out, *region);
                put_u64(out, *epoch);
                put_bytes(out, manifest);
                put_bytes(out, sessions);
                put_u32(out, levels.len() as u32);
                for l in levels {
                    put_bytes(out, l);
                }
            }
            ReplMessage::IndexPart { region, epoch, segment, offset, last, bytes } => {
                out.push(kind::INDEX_PART);
                put_u32(out, *region);
                put_u64(out, *epoch);
                put_u64(out, *segment);
                put_u64(out, *offset);
                out.push(u8::from(*last));
                put_bytes(out, bytes);
            }
            ReplMessage::Restart { region, epoch } => {
                out.push(kind::RESTART);
                put_u32(out, *region);
                put_u64(out, *epoch);
            }
            ReplMessage::IndexEnd { region, epoch } => {
                out.push(kind::INDEX_END);
                put_u32(out, *region);
                put_u64(out, *epoch);
            }
            ReplMessage::Installed { region, epoch, generation } => {
                out.push(kind::INSTALLED);
                put_u32(out, *region);
                put_u64(out, *epoch);
                put_u64(out, *generation);
            }
            ReplMessage::Segments { region, epoch, live } => {
                out.push(kind::SEGMENTS);
                put_u32(out, *region);
                put_u64(out, *epoch);
                let live = &live[..live.len().min(MAX_LIVE_SEGMENTS)];
                put_u32(out, live.len() as u32);
                for id in live {
                    put_u64(out, *id);
                }
            }
            ReplMessage::Refuse { region, reason, current, at, message } => {
                out.push(kind::REFUSE);
                put_u32(out, *region);
                out.push(*reason as u8);
                put_u64(out, *current);
                put_u64(out, *at);
                put_bytes(out, &message.as_bytes()[..floor_char_boundary(message, MAX_REPL_TEXT)]);
            }
        }
        let len = (out.len() - start - 4) as u32;
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// Decodes the frame at the start of `buf`: the message and the bytes it took, or
    /// `Incomplete` if `buf` does not hold a whole frame yet.
    pub fn decode(buf: &[u8]) -> Result<(ReplMessage, usize), ReplDecodeError> {
        if buf.len() < 4 {
            return Err(ReplDecodeError::Incomplete);
        }
        let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        if len + 4 > MAX_REPL_FRAME {
            return Err(ReplDecodeError::TooLarge(len + 4));
        }
        if buf.len() < 4 + len {
            return Err(ReplDecodeError::Incomplete);
        }
        let mut r = R { b: &buf[4..4 + len] };
        let version = r.u8()?;
        if version != REPL_VERSION {
            return Err(ReplDecodeError::Version(version));
        }
        let m = match r.u8()? {
            k @ (kind::HELLO | kind::HELLO_LIFE) => {
                let (region, epoch, primary, base) = (r.u32()?, r.u64()?, r.u32()?, r.u64()?);
                let cluster = String::from_utf8(r.bytes(MAX_REPL_TEXT)?)
                    .map_err(|_| ReplDecodeError::Malformed("cluster name is not UTF-8"))?;
                let life = if k == kind::HELLO_LIFE { Some(r.u64()?) } else { None };
                ReplMessage::Hello { cluster, region, epoch, primary, base, life }
            }
            kind::RESUME => {
                let (region, epoch, has) = (r.u32()?, r.u64()?, r.u8()?);
                let at = r.u64()?;
                let from = match has {
                    0 if at == 0 => None,
                    1 => Some(at),
                    _ => return Err(ReplDecodeError::Malformed("bad resume position")),
                };
                ReplMessage::Resume { region, epoch, from }
            }
            kind::APPEND => {
                let (region, epoch, segment, offset, segment_size) = (r.u32()?, r.u64()?, r.u64()?, r.u32()?, r.u32()?);
                let sealed = r.flag()?;
                let bytes = r.bytes(MAX_REPL_FRAME)?;
                if offset as u64 + bytes.len() as u64 > segment_size as u64 {
                    return Err(ReplDecodeError::Malformed("log bytes beyond their segment"));
                }
                ReplMessage::Append { region, epoch, segment, offset, segment_size, sealed, bytes }
            }
            kind::HELD => ReplMessage::Held { region: r.u32()?, epoch: r.u64()?, upto: r.u64()? },
            kind::INDEX_BEGIN => {
                let (region, epoch) = (r.u32()?, r.u64()?);
                let manifest = r.bytes(MAX_REPL_FRAME)?;
                let sessions = r.bytes(MAX_REPL_FRAME)?;
                let n = r.count(4)?;
                let levels = (0..n).map(|_| r.bytes(MAX_REPL_FRAME)).collect::<Result<Vec<_>, _>>()?;
                ReplMessage::IndexBegin { region, epoch, manifest, sessions, levels }
            }
            kind::INDEX_PART => {
                let (region, epoch, segment, offset) = (r.u32()?, r.u64()?, r.u64()?, r.u64()?);
                let last = r.flag()?;
                ReplMessage::IndexPart { region, epoch, segment, offset, last, bytes: r.bytes(MAX_REPL_FRAME)? }
            }
            kind::INDEX_END => ReplMessage::IndexEnd { region: r.u32()?, epoch: r.u64()? },
            kind::RESTART => ReplMessage::Restart { region: r.u32()?, epoch: r.u64()? },
            kind::INSTALLED => ReplMessage::Installed { region: r.u32()?, epoch: r.u64()?, generation: r.u64()? },
            kind::SEGMENTS => {
                let (region, epoch) = (r.u32()?, r.u64()?);
                let n = r.count(8)?;
                if n > MAX_LIVE_SEGMENTS {
                    return Err(ReplDecodeError::Malformed("too many segments"));
                }
                let live = (0..n).map(|_| r.u64()).collect::<Result<Vec<u64>, _>>()?;
                if live.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(ReplDecodeError::Malformed("segments not ascending"));
                }
                ReplMessage::Segments { region, epoch, live }
            }
            kind::REFUSE => {
                let region = r.u32()?;
                let reason = ReplRefusal::from_u8(r.u8()?).ok_or(ReplDecodeError::Malformed("unknown refusal"))?;
                let (current, at) = (r.u64()?, r.u64()?);
                let message = String::from_utf8(r.bytes(MAX_REPL_TEXT)?)
                    .map_err(|_| ReplDecodeError::Malformed("message is not UTF-8"))?;
                ReplMessage::Refuse { region, reason, current, at, message }
            }
            _ => return Err(ReplDecodeError::Malformed("unknown message kind")),
        };
        if !r.b.is_empty() {
            return Err(ReplDecodeError::Malformed("bytes after the message"));
        }
        Ok((m, 4 + len))
    }
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    let mut i = s.len().min(max);
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

struct R<'a> {
    b: &'a [u8],
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ReplDecodeError> {
        if self.b.len() < n {
            return Err(ReplDecodeError::Malformed("truncated"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, ReplDecodeError> {
        Ok(self.take(1)?[0])
    }
    fn flag(&mut self) -> Result<bool, ReplDecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(ReplDecodeError::Malformed("a flag is not 0 or 1")),
        }
    }
    fn u32(&mut self) -> Result<u32, ReplDecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, ReplDecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self, max: usize) -> Result<Vec<u8>, ReplDecodeError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(ReplDecodeError::Malformed("a field over its limit"));
        }
        Ok(self.take(n)?.to_vec())
    }
    /// A count of items taking at least `min_item` bytes each, checked against what is left.
    fn count(&mut self, min_item: usize) -> Result<usize, ReplDecodeError> {
        let n = self.u32()? as usize;
        if n > self.b.len() / min_item {
            return Err(ReplDecodeError::Malformed("a count beyond the frame"));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn arb_msg() -> impl Strategy<Value = ReplMessage> {
        let bytes = || prop::collection::vec(any::<u8>(), 0..64);
        let reason = prop_oneof![
            Just(ReplRefusal::StaleEpoch),
            Just(ReplRefusal::WrongRegion),
            Just(ReplRefusal::WrongCluster),
            Just(ReplRefusal::Gap),
            Just(ReplRefusal::Failed),
            Just(ReplRefusal::Forbidden)
        ];
        prop_oneof![
            ("[a-z-]{0,12}", any::<u32>(), any::<u64>(), any::<u32>(), any::<u64>(), any::<Option<u64>>()).prop_map(
                |(cluster, region, epoch, primary, base, life)| ReplMessage::Hello {
                    cluster,
                    region,
                    epoch,
                    primary,
                    base,
                    life
                }
            ),
            (any::<u32>(), any::<u64>(), any::<Option<u64>>()).prop_map(|(region, epoch, from)| ReplMessage::Resume {
                region,
                epoch,
                from
            }),
            (any::<u32>(), any::<u64>(), any::<u64>(), 0u32..1000, any::<bool>(), bytes()).prop_map(
                |(region, epoch, segment, offset, sealed, bytes)| ReplMessage::Append {
                    region,
                    epoch,
                    segment,
                    offset,
                    segment_size: offset + bytes.len() as u32 + 10,
                    sealed,
                    bytes
                }
            ),
            (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(region, epoch, upto)| ReplMessage::Held {
                region,
                epoch,
                upto
            }),
            (any::<u32>(), any::<u64>(), bytes(), bytes(), prop::collection::vec(bytes(), 0..3)).prop_map(
                |(region, epoch, manifest, sessions, levels)| ReplMessage::IndexBegin {
                    region,
                    epoch,
                    manifest,
                    sessions,
                    levels
                }
            ),
            (any::<u32>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<bool>(), bytes()).prop_map(
                |(region, epoch, segment, offset, last, bytes)| ReplMessage::IndexPart {
                    region,
                    epoch,
                    segment,
                    offset,
                    last,
                    bytes
                }
            ),
            (any::<u32>(), any::<u64>()).prop_map(|(region, epoch)| ReplMessage::IndexEnd { region, epoch }),
            (any::<u32>(), any::<u64>()).prop_map(|(region, epoch)| ReplMessage::Restart { region, epoch }),
            (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(region, epoch, generation)| ReplMessage::Installed {
                region,
                epoch,
                generation
            }),
            (any::<u32>(), any::<u64>(), prop::collection::btree_set(any::<u64>(), 0..20)).prop_map(
                |(region, epoch, live)| ReplMessage::Segments { region, epoch, live: live.into_iter().collect() }
            ),
            (any::<u32>(), reason, any::<u64>(), any::<u64>(), ".{0,40}").prop_map(
                |(region, reason, current, at, message)| ReplMessage::Refuse { region, reason, current, at, message }
            ),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_back_to_back(msgs in prop::collection::vec(arb_msg(), 1..6)) {
            let mut buf = Vec::new();
            for m in &msgs {
                m.encode(&mut buf);
            }
            let mut at = 0;
            for m in &msgs {
                let (got, n) = ReplMessage::decode(&buf[at..]).expect("decodes");
                prop_assert_eq!(&got, m);
                at += n;
            }
            prop_assert_eq!(at, buf.len());
        }

        #[test]
        fn damaged_frames_are_typed_errors(m in arb_msg(), cut in any::<prop::sample::Index>(), flip in any::<prop::sample::Index>(), bit in 0u8..8, garbage in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut buf = Vec::new();
            m.encode(&mut buf);
            prop_assert_eq!(ReplMessage::decode(&buf[..cut.index(buf.len())]), Err(ReplDecodeError::Incomplete));
            let i = flip.index(buf.len());
            buf[i] ^= 1 << bit;
            if let Ok((again, n)) = ReplMessage::decode(&buf) {
                let mut re = Vec::new();
                again.encode(&mut re);
                prop_assert_eq!(&re[..], &buf[..n], "whatever decodes re-encodes to its bytes");
            }
            let _ = ReplMessage::decode(&garbage);
        }
    }

    #[test]
    fn limits_and_versions_are_refused() {
        let mut b = Vec::new();
        ReplMessage::Held { region: 1, epoch: 2, upto: 3 }.encode(&mut b);
        b[4] = 9;
        assert_eq!(ReplMessage::decode(&b), Err(ReplDecodeError::Version(9)));
        let huge = ((MAX_REPL_FRAME) as u32).to_le_bytes();
        assert!(matches!(ReplMessage::decode(&huge), Err(ReplDecodeError::TooLarge(_))));
        let mut a = Vec::new();
        ReplMessage::Append {
            region: 1,
            epoch: 1,
            segment: 1,
            offset: 90,
            segment_size: 100,
            sealed: false,
            bytes: vec![0; 20],
        }
        .encode(&mut a);
        assert_eq!(ReplMessage::decode(&a), Err(ReplDecodeError::Malformed("log bytes beyond their segment")));
        assert_eq!(ReplRefusal::StaleEpoch.code(), "stale_epoch");
    }
}
