//! Tebis replication over TCP (docs/cluster.md §5): a region's primary streams its log's bytes to
//! each backup and ships its index after every compaction; a write is acknowledged only once
//! every backup of the region's current set holds it ([`Acks::wait`]).
//!
//! - Primary side, per backup: [`spawn_sender`] — a thread that connects, says hello, learns
//!   where the backup is (`Resume`), streams log chunks from there ([`LogTail`]), ships the whole
//!   index once caught up (the backup may have missed compactions while away) and then each new
//!   compaction's export ([`Feed`]); a second thread reads the backup's `Held` answers into the
//!   region's [`Acks`].
//! - Backup side: [`BackupHost::serve`] — a thread per connection that checks the cluster,
//!   region and epoch (a message under an older epoch than the newest seen is refused with the
//!   current one: the fence against a deposed primary), applies chunks and exports to the
//!   region's [`Backup`] and answers how far it holds the log.
//!
//! Bounds: a connection reads one frame at a time (at most `MAX_REPL_FRAME`); a sender reads
//! log chunks of at most [`CHUNK`] bytes; the feed keeps at most [`FEED_EXPORTS`] exports (past
//! that, the sender ships the whole index again).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dpukv_net::identity::Peer;
use dpukv_net::tls::{ClientTls, ServerTls};
use dpukv_proto::replication::{MAX_REPL_FRAME, ReplDecodeError, ReplMessage, ReplRefusal};
use dpukv_storage::region::{
    Backup, IndexExport, IndexInstall, MAX_SHIPPED_SEGMENT, ReadGate, ShippedIndex, export_dir,
};
use dpukv_storage::vlog::{FsyncPolicy, LogTail, Lsn};

/// Largest log chunk a sender reads and sends at once.
pub const CHUNK: usize = 1 << 20;
/// Exports a feed keeps for its senders.
pub const FEED_EXPORTS: usize = 8;
/// How often a sender looks for log segments the primary collected (and tells its backup).
pub const SEGMENTS_EVERY: Duration = Duration::from_millis(500);
/// A replication peer that takes no bytes sent to it, or answers no keep-alive probe, for this
/// long has its connection ended (`dpukv_net::socket::bound_liveness`, and the write loop).
pub const LINK_DEAD_AFTER: Duration = Duration::from_secs(6);
/// Blocking writes on a replication link return at least this often, so a writer looks at its
/// stop flag while its peer takes nothing.
const WRITE_SLICE: Duration = Duration::from_millis(100);
/// How long a backup waits for a new connection's `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Replication connections a backup serves at once (each is a thread); more are closed at once.
pub const MAX_REPL_CONNECTIONS: usize = 4096;
/// Log chunks a backup under `--fsync always` may apply before it syncs them and says it holds
/// them (group commit: frames already arrived share one sync).
const SYNC_GROUP_FRAMES: usize = 16;

/// A stop flag nobody sets (a refusal's one frame is bounded by [`LINK_DEAD_AFTER`] alone).
static NEVER: AtomicBool = AtomicBool::new(false);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a write cannot be acknowledged by replication.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    /// A backup did not confirm in time.
    #[error("backups {0:?} did not confirm the write in time")]
    Timeout(Vec<u32>),
    /// This node stopped leading the region: nothing more is confirmed.
    #[error("this node no longer leads the region")]
    Closed,
    /// Every backup holds the write, but a backup's fence held it back (past the fence's cut)
    /// for longer than the wait.
    #[error("a backup's fence held the write back past its cut")]
    Fenced,
}

#[derive(Debug, Default)]
struct AckState {
    /// Set when the node stops leading the region: every wait fails from then on.
    closed: bool,
    epoch: u64,
    required: Vec<u32>,
    held: HashMap<u32, Lsn>,
    /// Backups that installed the whole index on their current connection.
    installed: std::collections::HashSet<u32>,
    /// What readers of the region may see: moved to what every required backup holds.
    gate: Option<ReadGate>,
    /// When each watched node last moved forward (or held the whole log): one that has not for
    /// a while is stalled ([`Acks::stalled`]).
    progress: HashMap<u32, Instant>,
    /// Nodes that left the region, with where they were and when they left: the log they lack
    /// is kept a while ([`Acks::retention_floor`]), in case they come back.
    departed: HashMap<u32, (Lsn, Instant)>,
    /// A backup's fence: its id and cut. Nothing past the cut is made known — acknowledged or
    /// shown to readers — until the fence is lifted (docs/backup.md §2).
    fence: Option<(u64, Lsn)>,
}

impl AckState {
    /// Readers see what may be made known ([`AckState::released`]; everything synced, with no
    /// backup required and no fence).
    fn show(&self) {
        if let Some(g) = &self.gate {
            g.set_bound(self.released().unwrap_or(Lsn(0)));
        }
    }

    /// What may be made known — acknowledged, shown to readers: what every required backup
    /// holds, and nothing past a fence's cut while one is held.
    fn released(&self) -> Option<Lsn> {
        let held = self.held_by_all()?;
        Some(self.fence.map_or(held, |(_, at)| held.min(at)))
    }

    /// What every required backup holds: the smallest of their positions (everything, with none
    /// required); None while one of them has not said.
    fn held_by_all(&self) -> Option<Lsn> {
        self.required.iter().try_fold(Lsn(u64::MAX), |least, n| self.held.get(n).map(|h| least.min(*h)))
    }
}

/// What each backup of a region holds, and the set a write must reach.
#[derive(Debug, Default)]
pub struct Acks {
    st: Mutex<AckState>,
    cv: Condvar,
}

impl Acks {
    /// Acks for a region at `epoch` whose writes must reach `required`.
    pub fn new(epoch: u64, required: Vec<u32>) -> Arc<Acks> {
        Arc::new(Acks { st: Mutex::new(AckState { epoch, required, ..AckState::default() }), cv: Condvar::new() })
    }

    /// A new epoch and backup set. Writes waiting go on waiting for the new set: every backup
    /// the master may promote at the new epoch is in it (a backup that left the set — stalled,
    /// dead — is not promotable; one that joined it held the whole log when it was reported
    /// caught up), so a write the new set holds may be acknowledged.
    pub fn set_required(&self, epoch: u64, required: Vec<u32>) {
        let mut st = lock(&self.st);
        st.epoch = epoch;
        st.required = required;
        st.show();
        self.cv.notify_all();
    }

    /// The nodes of `among` (a region's backups and joining nodes) that have not moved forward
    /// for `after` while the log reaches past what they hold (`end`): a required one holds up
    /// every write (docs/cluster.md §5, "Stalled backups"). A node is watched from the first
    /// time it is asked about; one that holds the whole log is moving.
    pub fn stalled(&self, among: &[u32], end: Lsn, after: Duration) -> Vec<u32> {
        let mut st = lock(&self.st);
        let now = Instant::now();
        let mut out = Vec::new();
        for &n in among {
            let behind = st.held.get(&n).is_none_or(|h| *h < end);
            let since = st.progress.entry(n).or_insert(now);
            if !behind {
                *since = now;
            } else if now.duration_since(*since) >= after {
                out.push(n);
            }
        }
        let watched: Vec<u32> = among.to_vec();
        st.progress.retain(|n, _| watched.contains(n));
        out
    }

    /// Gates the region's reads by what the backups hold: a write becomes visible only once
    /// every required backup holds it, so no failover can take back what a read returned.
    pub fn set_gate(&self, gate: ReadGate) {
        let mut st = lock(&self.st);
        st.gate = Some(gate);
        st.show();
    }

    /// The node stops leading the region: waiting writes, and any later ones, are not
    /// confirmed (their outcome is unknown to their clients).
    pub fn close(&self) {
        lock(&self.st).closed = true;
        self.cv.notify_all();
    }

    /// Records that `node` holds the log up to `upto`.
    pub fn held(&self, node: u32, upto: Lsn) {
        let mut st = lock(&self.st);
        let e = st.held.entry(node).or_insert(Lsn(0));
        if upto > *e {
            *e = upto;
            if let Some(t) = st.progress.get_mut(&node) {
                *t = Instant::now();
            }
            st.show();
            self.cv.notify_all();
        }
    }

    /// A new session with `node` began where it says it holds the log (`Resume`): its position
    /// is that, not the highest an earlier session reported — the node may have lost its copy
    /// since (a backup dropped from a region deletes it, and may be given the region back), and
    /// positions from before would have it reported caught up, or counted as holding writes,
    /// with nothing on its disk. Its index is shipped again on this session.
    /// A new session is not progress: a node whose sessions keep failing at the same place
    /// (a full disk refuses each one) stays stalled; only a position past the last one is.
    pub fn reset(&self, node: u32, pos: Lsn) {
        let mut st = lock(&self.st);
        st.departed.remove(&node);
        let before = st.held.insert(node, pos);
        st.installed.remove(&node);
        if before.is_none_or(|b| pos > b)
            && let Some(t) = st.progress.get_mut(&node)
        {
            *t = Instant::now();
        }
        st.show();
        self.cv.notify_all();
    }

    /// Forgets what `node` held (it left the region, or joined it anew: only a session of its
    /// own says again what it holds).
    pub fn forget(&self, node: u32) {
        let mut st = lock(&self.st);
        if let Some(at) = st.held.remove(&node) {
            st.departed.insert(node, (at, Instant::now()));
        }
        st.installed.remove(&node);
        st.progress.remove(&node);
        st.show();
    }

    /// Also waits for `node` from now on (a joining node about to be reported caught up: every
    /// write acknowledged after the report is on it too).
    pub fn require_also(&self, node: u32) {
        let mut st = lock(&self.st);
        if !st.required.contains(&node) {
            st.required.push(node);
            st.show();
        }
    }

    /// `node` installed the region's whole index (or there was none to install).
    pub fn set_installed(&self, node: u32, yes: bool) {
        let mut st = lock(&self.st);
        if yes {
            st.installed.insert(node);
        } else {
            st.installed.remove(&node);
        }
    }

    /// The oldest log position a backup may still resume from: the least of what every node
    /// streaming the region holds, and of where nodes that left it in the last `departed_for`
    /// were (None: no one is behind or away). Garbage collection keeps the log from there on,
    /// within a bound the caller sets.
    pub fn retention_floor(&self, departed_for: Duration) -> Option<Lsn> {
        let mut st = lock(&self.st);
        st.departed.retain(|_, (_, at)| at.elapsed() < departed_for);
        st.held.values().chain(st.departed.values().map(|(l, _)| l)).min().copied()
    }

    /// Fences the region for a backup's cut (docs/backup.md §2) at the log's written end
    /// (`end` reads it): from now until [`Acks::lift`] with the same `id`, nothing past the cut is
    /// acknowledged or shown to readers, while the log, its sync and the streams to backups go
    /// on. Returns the cut. A newer fence replaces an older one (that one is broken: it can no
    /// longer commit). Fails once the node stopped leading the region.
    ///
    /// Everything made known before the call is at or before the cut: acknowledgements are
    /// decided under this lock, and readers are first stopped at the end read before the cut is
    /// read again (a write published in between — with no backup required the gate shows what
    /// is synced — ended before that second read).
    pub fn fence(&self, id: u64, end: impl Fn() -> Lsn) -> Result<Lsn, AckError> {
        let mut st = lock(&self.st);
        if st.closed {
            return Err(AckError::Closed);
        }
        if let Some(g) = &st.gate {
            let first = end();
            g.set_bound(st.released().map_or(Lsn(0), |r| r.min(first)));
        }
        let at = end();
        st.fence = Some((id, at));
        st.show();
        Ok(at)
    }

    /// Lifts fence `id` (committed, aborted or broken): what waited past its cut is released.
    /// Whether that fence was held.
    pub fn lift(&self, id: u64) -> bool {
        let mut st = lock(&self.st);
        if st.fence.is_none_or(|(f, _)| f != id) {
            return false;
        }
        st.fence = None;
        st.show();
        self.cv.notify_all();
        true
    }

    /// The fence held, if any: its id and cut.
    pub fn fenced(&self) -> Option<(u64, Lsn)> {
        lock(&self.st).fence
    }

    /// Whether writes wait for `node`.
    pub fn required(&self, node: u32) -> bool {
        lock(&self.st).required.contains(&node)
    }

    /// Whether `node` has the whole index (a joining node is caught up once it also holds the
    /// log to its end).
    pub fn installed(&self, node: u32) -> bool {
        lock(&self.st).installed.contains(&node)
    }

    /// Every backup the writes wait for and every node that streamed, with what it holds.
    pub fn positions(&self) -> Vec<(u32, Option<Lsn>)> {
        let st = lock(&self.st);
        let mut nodes: Vec<u32> = st.required.iter().chain(st.held.keys()).copied().collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.into_iter().map(|n| (n, st.held.get(&n).copied())).collect()
    }

    /// Whether every required backup holds the log up to `upto`.
    pub fn holds(&self, upto: Lsn) -> bool {
        lock(&self.st).held_by_all().is_some_and(|h| h >= upto)
    }

    /// What `node` holds.
    pub fn position(&self, node: u32) -> Option<Lsn> {
        lock(&self.st).held.get(&node).copied()
    }

    /// Blocks until every required backup (of the set in force: it may change while waiting)
    /// holds the log up to `end`.
    pub fn wait(&self, end: Lsn, timeout: Duration) -> Result<(), AckError> {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.st);
        loop {
            if st.closed {
                return Err(AckError::Closed);
            }
            if st.released().is_some_and(|h| h >= end) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<u32> =
                    st.required.iter().copied().filter(|n| st.held.get(n).is_none_or(|h| *h < end)).collect();
                return Err(if missing.is_empty() && st.fence.is_some() {
                    AckError::Fenced
                } else {
                    AckError::Timeout(missing)
                });
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// What a primary's writer tells its senders: new log bytes, new compaction exports.
#[derive(Debug, Default)]
pub struct Feed {
    st: Mutex<FeedState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct FeedState {
    commits: u64,
    exports: VecDeque<Arc<IndexExport>>,
    /// Exports dropped from the front (senders behind them ship the whole index).
    dropped: u64,
    /// (log end, records written up to it) of recent rounds, oldest first, at most
    /// [`FEED_MARKS`]: how many records a backup at some position lacks.
    marks: VecDeque<(Lsn, u64)>,
    /// Records written so far.
    records: u64,
    /// Records up to the newest round dropped from `marks` (0: none dropped).
    floor: u64,
}

/// Rounds whose (end, records) a feed remembers for the records lag.
pub const FEED_MARKS: usize = 4096;

/// A node's replication figures, for `/metrics` (docs/operations.md): one per node, shared by
/// its senders (primary side) and its backup host.
#[derive(Debug, Default)]
pub struct ReplStats {
    /// Log bytes sent to backups (Append frames).
    pub log_bytes_shipped: AtomicU64,
    /// Sessions to a backup that resumed from a log position of its own (past the log's start:
    /// it was not copied again).
    pub sessions_resumed: AtomicU64,
    /// Backups told to copy a region again: the log they lacked was collected here.
    pub copies_restarted: AtomicU64,
    /// Copies this node retired and took back when given their region again.
    pub copies_reused: AtomicU64,
    /// Index bytes sent to backups (Index frames: Send Index).
    pub index_bytes_shipped: AtomicU64,
    /// Log bytes this node received and holds as a backup.
    pub log_bytes_received: AtomicU64,
    /// Index bytes this node installed as a backup.
    pub index_bytes_installed: AtomicU64,
    /// Connections whose whole index was shipped (a backup (re)joining the stream).
    pub whole_index_shipments: AtomicU64,
    /// Log segment copies this node dropped as a backup, following the primary's collection.
    pub log_segments_dropped: AtomicU64,
    /// Records this node replayed into its own index as a Build Index backup.
    pub records_built: AtomicU64,
}

impl Feed {
    /// A feed.
    pub fn new() -> Arc<Feed> {
        Arc::new(Feed::default())
    }

    /// The log grew.
    pub fn committed(&self) {
        lock(&self.st).commits += 1;
        self.cv.notify_all();
    }

    /// The log grew to `end` with `records` more records.
    pub fn committed_at(&self, end: Lsn, records: u64) {
        let mut st = lock(&self.st);
        st.records += records;
        let total = st.records;
        st.marks.push_back((end, total));
        if st.marks.len() > FEED_MARKS
            && let Some((_, upto)) = st.marks.pop_front()
        {
            st.floor = upto;
        }
        st.commits += 1;
        self.cv.notify_all();
    }

    /// Records written after log position `held` (a backup's lag in records). Past the oldest
    /// remembered round, a lower bound.
    pub fn records_after(&self, held: Lsn) -> u64 {
        let st = lock(&self.st);
        // The last round that ends at or before `held`: everything up to it is held.
        let i = st.marks.partition_point(|(end, _)| *end <= held);
        let covered = match i {
            // Before every remembered round: at most what the dropped rounds wrote is held.
            0 => st.floor,
            i => st.marks[i - 1].1,
        };
        st.records - covered.min(st.records)
    }

    /// A compaction finished: its export, for every sender.
    pub fn export(&self, e: IndexExport) {
        let mut st = lock(&self.st);
        st.exports.push_back(Arc::new(e));
        while st.exports.len() > FEED_EXPORTS {
            st.exports.pop_front();
            st.dropped += 1;
        }
        self.cv.notify_all();
    }

    /// Waits up to `timeout` for a commit or export after `seen` commits.
    fn wait(&self, seen: u64, timeout: Duration) -> u64 {
        let st = lock(&self.st);
        let st = self.cv.wait_timeout_while(st, timeout, |s| s.commits == seen).unwrap_or_else(|e| e.into_inner()).0;
        st.commits
    }

    /// Exports with a manifest generation above `after`, in order; None if some were dropped
    /// (the whole index must be shipped).
    fn exports_after(&self, after: u64) -> Option<Vec<Arc<IndexExport>>> {
        let st = lock(&self.st);
        let newer: Vec<Arc<IndexExport>> =
            st.exports.iter().filter(|e| e.manifest.generation > after).cloned().collect();
        // Generations grow by one per compaction: a gap before the oldest kept means some were
        // dropped before this sender shipped them.
        if st.dropped > 0 && st.exports.front().is_some_and(|e| e.manifest.generation > after + 1) {
            return None;
        }
        Some(newer)
    }
}

/// A replication connection: TCP, or the plain end of a TLS session's bridge
/// (`dpukv_net::tls`: the session runs on two threads of its own).
enum Link {
    Tcp(TcpStream),
    Tls(std::os::unix::net::UnixStream),
}

impl Link {
    /// Connects to `addr` (`host:port`, resolved now: a restarted peer may have a new address
    /// under its name), with TLS when `tls` is given (the host is the name its certificate must
    /// carry).
    fn connect(addr: &str, tls: Option<&ClientTls>) -> std::io::Result<Link> {
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
        let mut connected = None;
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                Ok(s) => {
                    connected = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let tcp = connected.ok_or(last)?;
        tcp.set_nodelay(true)?;
        dpukv_net::socket::bound_liveness(&tcp, LINK_DEAD_AFTER)?;
        // The TLS bridge's own writes to the network give up once the peer takes nothing.
        tcp.set_write_timeout(Some(LINK_DEAD_AFTER))?;
        let link = match tls {
            Some(t) => Link::Tls(t.connect_blocking(tcp, addr)?),
            None => Link::Tcp(tcp),
        };
        link.set_write_timeout(Some(WRITE_SLICE))?;
        Ok(link)
    }

    /// Accepts `tcp`, with TLS when `tls` is given; who the peer is (its certificate's identity).
    fn accept(tcp: TcpStream, tls: Option<&ServerTls>) -> std::io::Result<(Link, Peer)> {
        tcp.set_nonblocking(false)?;
        tcp.set_nodelay(true)?;
        dpukv_net::socket::bound_liveness(&tcp, LINK_DEAD_AFTER)?;
        tcp.set_write_timeout(Some(LINK_DEAD_AFTER))?;
        let (link, peer) = match tls {
            Some(t) => t.accept_blocking(tcp).map(|(s, peer)| (Link::Tls(s), peer))?,
            None => (Link::Tcp(tcp), Peer::Unchecked),
        };
        link.set_write_timeout(Some(WRITE_SLICE))?;
        Ok((link, peer))
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Link::Tcp(s) => s.set_write_timeout(t),
            Link::Tls(s) => s.set_write_timeout(t),
        }
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Link::Tcp(s) => s.set_read_timeout(t),
            Link::Tls(s) => s.set_read_timeout(t),
        }
    }

    fn try_clone(&self) -> std::io::Result<Link> {
        Ok(match self {
            Link::Tcp(s) => Link::Tcp(s.try_clone()?),
            Link::Tls(s) => Link::Tls(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Link::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Link::Tls(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl Read for Link {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => s.read(b),
            Link::Tls(s) => s.read(b),
        }
    }
}

impl Write for Link {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => s.write(b),
            Link::Tls(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Link::Tcp(s) => s.flush(),
            Link::Tls(s) => s.flush(),
        }
    }
}

/// Writes one frame; its size in bytes. Gives up when `stop` is set, or when the peer took
/// nothing for [`LINK_DEAD_AFTER`] (the link's writes time out every [`WRITE_SLICE`], so a
/// writer never waits on a stuck peer without looking at its stop flag).
fn write_msg(s: &mut impl Write, m: &ReplMessage, stop: &AtomicBool) -> std::io::Result<u64> {
    let mut b = Vec::new();
    m.encode(&mut b);
    let (mut rest, mut progress) = (&b[..], Instant::now());
    while !rest.is_empty() {
        match s.write(rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                rest = &rest[n..];
                progress = Instant::now();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                if stop.load(Ordering::Acquire) {
                    return Err(std::io::Error::new(ErrorKind::Interrupted, "stopped while the peer took nothing"));
                }
                if progress.elapsed() >= LINK_DEAD_AFTER {
                    return Err(std::io::Error::new(
                        ErrorKind::TimedOut,
                        format!("the peer took no bytes for {LINK_DEAD_AFTER:?}"),
                    ));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(b.len() as u64)
}

/// Why reading a frame failed.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Decode(#[from] ReplDecodeError),
}

fn read_msg(s: &mut impl Read) -> Result<ReplMessage, ReadError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n + 4 > MAX_REPL_FRAME {
        return Err(ReplDecodeError::TooLarge(n + 4).into());
    }
    let mut frame = vec![0u8; 4 + n];
    frame[..4].copy_from_slice(&len);
    s.read_exact(&mut frame[4..])?;
    Ok(ReplMessage::decode(&frame)?.0)
}

/// An index shipment under way on one connection (Send Index): its metadata went ahead in an
/// `IndexBegin`; its segments go one chunk per turn of the sender's loop, between the log's
/// chunks (a large index never holds the log back for long, and never sits in memory).
struct Shipment {
    export: Arc<IndexExport>,
    /// The whole index (paced by the catch-up cap), not one compaction's output.
    whole: bool,
    /// Segments not sent yet, in order.
    segments: VecDeque<u64>,
    /// The segment being sent: its id, file, size and the offset reached.
    current: Option<(u64, std::fs::File, u64, u64)>,
}

impl Shipment {
    /// Begins shipping `export`: its metadata goes now.
    fn begin(
        s: &mut Link,
        region: u32,
        epoch: u64,
        export: Arc<IndexExport>,
        whole: bool,
        stop: &AtomicBool,
    ) -> anyhow::Result<Shipment> {
        let (manifest, sessions, levels) = export.parts();
        let m = ReplMessage::IndexBegin { region, epoch, manifest, sessions, levels };
        let mut b = Vec::new();
        m.encode(&mut b);
        if b.len() > MAX_REPL_FRAME {
            anyhow::bail!("the index's metadata ({} bytes) exceeds a replication frame", b.len());
        }
        write_msg(s, &m, stop)?;
        let segments = export.levels.iter().flat_map(|l| l.segments.iter().copied()).collect();
        Ok(Shipment { export, whole, segments, current: None })
    }

    /// Sends the next chunk (or, all sent, the `IndexEnd`): Ok(Some(bytes)) while parts remain
    /// to send after this one or this was a part, Ok(None) once the end went.
    fn step(&mut self, s: &mut Link, region: u32, epoch: u64, stop: &AtomicBool) -> anyhow::Result<Option<u64>> {
        if self.current.is_none() {
            let Some(id) = self.segments.pop_front() else {
                write_msg(s, &ReplMessage::IndexEnd { region, epoch }, stop)?;
                return Ok(None);
            };
            let p = self.export.segment_path(id);
            let f = std::fs::File::open(&p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            let size = f.metadata()?.len();
            self.current = Some((id, f, size, 0));
        }
        let Some((id, f, size, offset)) = self.current.as_mut() else { unreachable!("set above") };
        let n = (*size - *offset).min(CHUNK as u64) as usize;
        let mut bytes = vec![0u8; n];
        f.read_exact(&mut bytes)?;
        let last = *offset + n as u64 == *size;
        let m = ReplMessage::IndexPart { region, epoch, segment: *id, offset: *offset, last, bytes };
        write_msg(s, &m, stop)?;
        *offset += n as u64;
        if last {
            self.current = None;
        }
        Ok(Some(n as u64))
    }
}

/// A backup connection's index shipment being installed, and the segment being received (its
/// id and the bytes so far).
type Installing = (IndexInstall, Option<(u64, Vec<u8>)>);

/// Who a sender is and where its backup is.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// The cluster's name.
    pub cluster: String,
    /// The region.
    pub region: u32,
    /// The epoch the primary serves under.
    pub epoch: u64,
    /// The primary's node id.
    pub primary: u32,
    /// The backup's node id.
    pub backup: u32,
    /// The backup's replication address (`host:port`, as it advertises it: a DNS name on
    /// Kubernetes), read and resolved at each connection: it follows the backup's current
    /// registration (a restarted backup may listen elsewhere).
    pub addr: PeerAddr,
    /// The region's data directory (for whole-index exports).
    pub region_dir: PathBuf,
    /// The primary's log end when it began to lead (see `ReplMessage::Hello`).
    pub base: Lsn,
    /// The primary's life as the region's leader (drawn when it began to lead; see
    /// `ReplMessage::Hello`).
    pub life: u64,
    /// The node's replication figures.
    pub stats: Arc<ReplStats>,
    /// Ship the index (Send Index); false: the backup builds its own (Build Index).
    pub send_index: bool,
    /// The node's cap on bytes per second sent to backups that are catching up (more than a
    /// chunk behind, or receiving the whole index), shared by every sender of the node (None:
    /// no cap). Steady streaming is never slowed.
    pub catch_up: Option<Arc<CatchUpCap>>,
    /// TLS to the backup (presenting this node's certificate), if the cluster uses it.
    pub tls: Option<Arc<ClientTls>>,
}

/// Where a node takes replication streams, as its current registration says: shared by every
/// sender to that node and updated by the member's loop whenever it reads the map, so a sender
/// reconnects to where the node is now, not where it was when the sender started. Empty while
/// the node is not registered (a sender then waits and tries again).
#[derive(Debug, Clone, Default)]
pub struct PeerAddr(Arc<Mutex<String>>);

impl PeerAddr {
    /// An address.
    pub fn new(addr: impl Into<String>) -> PeerAddr {
        PeerAddr(Arc::new(Mutex::new(addr.into())))
    }

    /// The address now.
    pub fn get(&self) -> String {
        lock(&self.0).clone()
    }

    /// The node registered at `addr`; whether it moved.
    pub fn set(&self, addr: &str) -> bool {
        let mut a = lock(&self.0);
        let moved = *a != addr;
        if moved {
            *a = addr.to_string();
        }
        moved
    }
}

/// Every node's [`PeerAddr`], kept current from the region map by the member's loop.
#[derive(Debug, Clone, Default)]
pub struct Peers(Arc<Mutex<HashMap<u32, PeerAddr>>>);

impl Peers {
    /// Node `id`'s address (empty until the map names it).
    pub fn addr(&self, id: u32) -> PeerAddr {
        lock(&self.0).entry(id).or_default().clone()
    }

    /// Takes the registrations of a map just read: a node registered elsewhere is dialled
    /// there from its senders' next connection; a node not registered has no address. Returns
    /// the nodes whose address changed.
    pub fn update(&self, nodes: &[dpukv_proto::regionmap::NodeInfo]) -> Vec<u32> {
        let mut peers = lock(&self.0);
        let mut moved = Vec::new();
        for (id, a) in peers.iter() {
            let now = nodes.iter().find(|n| n.id == *id).map_or("", |n| n.replication.as_str());
            if a.set(now) {
                moved.push(*id);
            }
        }
        for n in nodes {
            peers.entry(n.id).or_insert_with(|| PeerAddr::new(n.replication.clone()));
        }
        moved
    }
}

/// One node's cap on catch-up bytes per second, shared by all its senders: a node that copies
/// many regions at once (after another node died, or when one joins) takes at most this much of
/// its disk and network from its clients, however many senders run. A token bucket holding at
/// most one second's worth.
#[derive(Debug)]
pub struct CatchUpCap {
    rate: u64,
    /// (last refill, tokens: bytes that may be sent now; negative: owed).
    st: Mutex<(Instant, f64)>,
}

impl CatchUpCap {
    /// A cap of `rate` bytes per second (None for 0: no cap).
    pub fn new(rate: u64) -> Option<Arc<CatchUpCap>> {
        (rate > 0).then(|| Arc::new(CatchUpCap { rate, st: Mutex::new((Instant::now(), rate as f64)) }))
    }

    /// Takes `n` bytes from the bucket (refilled for the time since): how long until the node
    /// owes nothing again.
    fn spend(&self, n: u64) -> Duration {
        let mut st = lock(&self.st);
        let now = Instant::now();
        let rate = self.rate as f64;
        st.1 = (st.1 + now.duration_since(st.0).as_secs_f64() * rate).min(rate) - n as f64;
        st.0 = now;
        if st.1 >= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(-st.1 / rate) }
    }
}

/// After `n` bytes of a catch-up, waits until the node's cap owes nothing (every sender waits
/// its turn: the debt is the node's), looking at `stop` every 100 ms.
fn pace(cap: Option<&CatchUpCap>, n: u64, catching_up: bool, stop: &AtomicBool) {
    let Some(cap) = cap.filter(|_| catching_up) else { return };
    let mut wait = cap.spend(n);
    while !wait.is_zero() && !stop.load(Ordering::Acquire) {
        std::thread::sleep(wait.min(Duration::from_millis(100)));
        wait = cap.spend(0);
    }
}

/// What ended a sender (it reconnects by itself unless stopped or refused for good).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderEnd {
    /// Stopped by its owner.
    Stopped,
    /// The backup refused for good (a newer epoch, another cluster, not its region).
    Refused(ReplRefusal, u64, String),
}

/// Starts streaming `region`'s log and index to one backup; reconnects after errors until `stop`
/// or a refusal for good — after 100 ms; when the link itself keeps failing (no answer, no
/// address), the wait doubles up to [`MAX_RECONNECT_WAIT`]: a backup pod that is restarting must
/// not cost a name lookup and a connection attempt every 100 ms per region, and the bound keeps
/// the extra delay once it is back small. Returns the thread (its result says why it ended).
pub fn spawn_sender(
    cfg: SenderConfig,
    tail: LogTail,
    feed: Arc<Feed>,
    acks: Arc<Acks>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<SenderEnd>> {
    spawn_sender_after(cfg, tail, feed, acks, stop, None)
}

/// How long a new sender waits for the one it replaces (stopped) to end before it connects.
pub const PREVIOUS_SENDER_WAIT: Duration = Duration::from_secs(5);

/// [`spawn_sender`], replacing `previous` — the stopped sender of the same backup under an older
/// epoch: the new one connects only once that one has ended (up to [`PREVIOUS_SENDER_WAIT`]). Two
/// sessions to one backup at once shared its positions and index flag in [`Acks`]: the old
/// one, beginning its whole-index shipment after the new one's was installed, marked the backup
/// as lacking the index for good — a joining node that never counted as caught up (found by the
/// nemesis after a power loss).
pub fn spawn_sender_after(
    cfg: SenderConfig,
    tail: LogTail,
    feed: Arc<Feed>,
    acks: Arc<Acks>,
    stop: Arc<AtomicBool>,
    previous: Option<JoinHandle<SenderEnd>>,
) -> std::io::Result<JoinHandle<SenderEnd>> {
    std::thread::Builder::new().name(format!("dpukv-repl-{}-{}", cfg.region, cfg.backup)).spawn(move || {
        if let Some(prev) = previous {
            let began = Instant::now();
            while !prev.is_finished() && began.elapsed() < PREVIOUS_SENDER_WAIT && !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if prev.is_finished() {
                let _ = prev.join();
            } else {
                tracing::warn!(region = cfg.region, backup = cfg.backup, "the sender replaced has not ended; going on");
            }
        }
        let mut wait = MIN_RECONNECT_WAIT;
        while !stop.load(Ordering::Acquire) {
            let began = std::time::Instant::now();
            match send_session(&cfg, &tail, &feed, &acks, &stop) {
                // The backup has not learned yet that it backs the region (its map lags this
                // one), or it needs the stream again: try again shortly.
                // (Forbidden: this node's certificate is not the one the backup wants — say, in a
                // rotation; a new one is re-read, so it is tried again too.)
                Ok(SenderEnd::Refused(
                    ReplRefusal::WrongRegion | ReplRefusal::Gap | ReplRefusal::Failed | ReplRefusal::Forbidden,
                    _,
                    why,
                )) => {
                    tracing::debug!(region = cfg.region, backup = cfg.backup, why, "the backup refused for now; reconnecting");
                    // The backup answered: its map lags, it will take the stream shortly.
                    wait = MIN_RECONNECT_WAIT;
                }
                Ok(end) => return end,
                Err(e) => {
                    tracing::debug!(region = cfg.region, backup = cfg.backup, error = %e, "replication stream ended; reconnecting");
                    // A session that lasted was a working link: the next attempt comes soon.
                    if began.elapsed() > MAX_RECONNECT_WAIT {
                        wait = MIN_RECONNECT_WAIT;
                    }
                }
            }
            pause(&stop, wait);
            wait = (wait * 2).min(MAX_RECONNECT_WAIT);
        }
        SenderEnd::Stopped
    })
}

/// A sender's first wait before reconnecting.
const MIN_RECONNECT_WAIT: Duration = Duration::from_millis(100);
/// A sender's longest wait before reconnecting (attempts that keep failing double the wait).
pub const MAX_RECONNECT_WAIT: Duration = Duration::from_millis(500);

/// Sleeps `d`, or less once `stop` is set (a stopped sender must end promptly: a hand-over
/// waits for it).
fn pause(stop: &AtomicBool, d: Duration) {
    let until = std::time::Instant::now() + d;
    while !stop.load(Ordering::Acquire) {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

/// How long a sender waits for the backup's answer to its Hello (opening a large copy included).
const RESUME_TIMEOUT: Duration = Duration::from_secs(30);

/// One connection's life: Ok(end) when it must not reconnect.
fn send_session(
    cfg: &SenderConfig,
    tail: &LogTail,
    feed: &Feed,
    acks: &Arc<Acks>,
    stop: &AtomicBool,
) -> anyhow::Result<SenderEnd> {
    let addr = cfg.addr.get();
    if addr.is_empty() {
        anyhow::bail!("node {} is not registered (no replication address)", cfg.backup);
    }
    let mut s = Link::connect(&addr, cfg.tls.as_deref())?;
    let (region, epoch) = (cfg.region, cfg.epoch);
    let hello = ReplMessage::Hello {
        cluster: cfg.cluster.clone(),
        region,
        epoch,
        primary: cfg.primary,
        base: cfg.base.0,
        life: Some(cfg.life),
    };
    write_msg(&mut s, &hello, stop)?;
    // A backup that does not answer its Hello is tried again, not waited for forever.
    s.set_read_timeout(Some(RESUME_TIMEOUT))?;
    let resume = read_msg(&mut s)?;
    s.set_read_timeout(None)?;
    let mut pos = match resume {
        ReplMessage::Resume { from: Some(p), .. } => Lsn(p),
        ReplMessage::Resume { from: None, .. } => tail.start()?,
        ReplMessage::Refuse { reason, current, message, .. } => {
            return Ok(SenderEnd::Refused(reason, current, message));
        }
        other => anyhow::bail!("expected resume, got {other:?}"),
    };
    if !tail.continues_from(pos)? {
        // What the backup lacks was collected here while it was away: it starts over — unless
        // writes wait for it (then it holds every acknowledged write, so nothing it lacks can
        // have been collected; a contradiction left to the stall report, never a wipe).
        if acks.required(cfg.backup) {
            anyhow::bail!("backup {} in the write set resumes at {pos:?}, which this log no longer has", cfg.backup);
        }
        write_msg(&mut s, &ReplMessage::Restart { region, epoch }, stop)?;
        cfg.stats.copies_restarted.fetch_add(1, Ordering::Relaxed);
        anyhow::bail!("backup {} resumes at {pos:?}, collected here: told to copy the region again", cfg.backup);
    }
    cfg.stats.sessions_resumed.fetch_add(u64::from(pos > tail.start()?), Ordering::Relaxed);
    tracing::debug!(region, backup = cfg.backup, epoch, from = ?pos, end = ?tail.end(), "streaming to a backup");
    // A stopped session touches nothing shared (its successor's may have begun).
    if stop.load(Ordering::Acquire) {
        return Ok(SenderEnd::Stopped);
    }
    // The backup holds everything before where it resumes (and nothing more, whatever an
    // earlier session said): a write that adds nothing to the log (a retry answered from the
    // sessions) must not wait for an Append that never comes.
    acks.reset(cfg.backup, pos);
    // The backup's answers, read on their own thread.
    let mut rs = s.try_clone()?;
    let (acks2, backup) = (acks.clone(), cfg.backup);
    let refused: Arc<Mutex<Option<SenderEnd>>> = Arc::default();
    let refused2 = refused.clone();
    let closed = Arc::new(AtomicBool::new(false));
    let closed2 = closed.clone();
    let reader = std::thread::Builder::new().name(format!("dpukv-repl-acks-{region}-{backup}")).spawn(move || {
        while let Ok(m) = read_msg(&mut rs) {
            match m {
                ReplMessage::Held { upto, .. } => acks2.held(backup, Lsn(upto)),
                ReplMessage::Installed { .. } => acks2.set_installed(backup, true),
                ReplMessage::Refuse { reason, current, message, .. } => {
                    *lock(&refused2) = Some(SenderEnd::Refused(reason, current, message));
                    break;
                }
                _ => break,
            }
        }
        closed2.store(true, Ordering::Release);
    })?;
    let result = (|| -> anyhow::Result<Option<SenderEnd>> {
        let mut shipped_generation = 0u64;
        let mut whole_index_due = true;
        let mut shipment: Option<Shipment> = None;
        let (mut last_live, mut last_segments_check) = (Vec::new(), Instant::now());
        let mut seen = 0u64;
        loop {
            if stop.load(Ordering::Acquire) {
                return Ok(Some(SenderEnd::Stopped));
            }
            if closed.load(Ordering::Acquire) {
                return Ok(lock(&refused).take());
            }
            // The primary's segments are listed before the log is streamed: a segment its
            // garbage collection took out is named gone only after the log holding the copies it
            // relocated (written before it went) reached the backup.
            let live = if last_segments_check.elapsed() >= SEGMENTS_EVERY {
                last_segments_check = Instant::now();
                Some(tail.segments()?)
            } else {
                None
            };
            // The log first, as far as it is written.
            let mut sent = false;
            while let Some(c) = tail.chunk(pos, CHUNK)? {
                let next = c.next();
                tracing::trace!(
                    region,
                    backup = cfg.backup,
                    segment = c.segment,
                    offset = c.offset,
                    len = c.bytes.len(),
                    sealed = c.sealed,
                    "append"
                );
                let behind = tail.end().0.saturating_sub(pos.0) > CHUNK as u64;
                let n = write_msg(
                    &mut s,
                    &ReplMessage::Append {
                        region,
                        epoch,
                        segment: c.segment,
                        offset: c.offset,
                        segment_size: c.segment_size,
                        sealed: c.sealed,
                        bytes: c.bytes,
                    },
                    stop,
                )?;
                cfg.stats.log_bytes_shipped.fetch_add(n, Ordering::Relaxed);
                pace(cfg.catch_up.as_deref(), n, behind, stop);
                pos = next;
                sent = true;
                if stop.load(Ordering::Acquire) {
                    break;
                }
            }
            // Then the index: whole once per connection (or when exports were missed), then
            // each compaction's export in order, a chunk per turn. (A Build Index backup builds
            // its own.) A shipment begins only with the log sent as far as it is written: the
            // levels it ships point into log the backup then has.
            if !cfg.send_index {
                if whole_index_due {
                    acks.set_installed(cfg.backup, true);
                    whole_index_due = false;
                }
            } else {
                if shipment.is_none() {
                    if whole_index_due {
                        whole_index_due = false;
                        if stop.load(Ordering::Acquire) {
                            return Ok(Some(SenderEnd::Stopped));
                        }
                        acks.set_installed(cfg.backup, false);
                        match export_dir(&cfg.region_dir)? {
                            Some(e) => {
                                shipment = Some(Shipment::begin(&mut s, region, epoch, Arc::new(e), true, stop)?);
                                cfg.stats.whole_index_shipments.fetch_add(1, Ordering::Relaxed);
                            }
                            None => acks.set_installed(cfg.backup, true),
                        }
                    } else {
                        match feed.exports_after(shipped_generation) {
                            None => whole_index_due = true,
                            Some(list) => {
                                if let Some(e) = list.into_iter().next() {
                                    shipment = Some(Shipment::begin(&mut s, region, epoch, e, false, stop)?);
                                }
                            }
                        }
                    }
                    sent |= shipment.is_some() || whole_index_due;
                }
                if let Some(sh) = shipment.as_mut() {
                    sent = true;
                    match sh.step(&mut s, region, epoch, stop)? {
                        Some(n) => {
                            cfg.stats.index_bytes_shipped.fetch_add(n, Ordering::Relaxed);
                            pace(cfg.catch_up.as_deref(), n, sh.whole, stop);
                        }
                        None => {
                            shipped_generation = sh.export.manifest.generation;
                            shipment = None;
                        }
                    }
                }
            }
            // The primary's garbage collection, for the backup's log copies to follow: named on
            // every change, checked at most every SEGMENTS_EVERY. (A stop above leaves it for
            // the next connection.)
            if let Some(live) = live.filter(|l| *l != last_live && !stop.load(Ordering::Acquire)) {
                write_msg(&mut s, &ReplMessage::Segments { region, epoch, live: live.clone() }, stop)?;
                last_live = live;
            }
            if !sent {
                seen = feed.wait(seen, Duration::from_millis(5));
            }
        }
    })();
    s.shutdown();
    let _ = reader.join();
    match result {
        Ok(Some(end)) => Ok(end),
        Ok(None) => anyhow::bail!("the backup closed the connection"),
        Err(e) => Err(e),
    }
}

/// A Build Index builder thread and its stop flag.
type Builder = (Arc<AtomicBool>, JoinHandle<()>);

/// The backup side of a node: the regions it backs (with the newest epoch its region map gives
/// each, and the primary it names) and their [`Backup`]s.
pub struct BackupHost {
    cluster: String,
    data_dir: PathBuf,
    /// Region -> (epoch, primary), from the region map this node read from etcd — never from
    /// a peer's word.
    roles: Mutex<HashMap<u32, (u64, u32)>>,
    /// Open backups; `None` once released (a connection still holding it stops there).
    backups: Mutex<HashMap<u32, Arc<Mutex<Option<Backup>>>>>,
    stats: Arc<ReplStats>,
    /// Build Index: each backed region's builder (its stop flag and thread).
    build: AtomicBool,
    builders: Mutex<HashMap<u32, Builder>>,
    /// When received log bytes are made durable (the node's `--fsync`; `always` by default).
    fsync: Mutex<FsyncPolicy>,
    /// Copies of regions this node stopped backing, kept in `retained/` for a while: if it is
    /// given the region back (a short lease lapse, a cancelled move), it resumes from its own
    /// log instead of being copied again. Region -> when it was retired.
    retained: Mutex<HashMap<u32, Instant>>,
    /// How long a retired copy is kept (zero: copies are deleted at once).
    retain_for: Mutex<Duration>,
}

impl std::fmt::Debug for BackupHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackupHost")
            .field("cluster", &self.cluster)
            .field("roles", &*lock(&self.roles))
            .finish_non_exhaustive()
    }
}

impl BackupHost {
    /// A host for `cluster` keeping backups under `data_dir/region-<id>`.
    pub fn new(cluster: &str, data_dir: PathBuf) -> Arc<BackupHost> {
        Self::with_stats(cluster, data_dir, Arc::default())
    }

    /// Like [`BackupHost::new`], counting into `stats`.
    pub fn with_stats(cluster: &str, data_dir: PathBuf, stats: Arc<ReplStats>) -> Arc<BackupHost> {
        Arc::new(BackupHost {
            cluster: cluster.into(),
            data_dir,
            roles: Mutex::default(),
            backups: Mutex::default(),
            stats,
            build: AtomicBool::new(false),
            builders: Mutex::default(),
            fsync: Mutex::new(FsyncPolicy::Always),
            retained: Mutex::default(),
            retain_for: Mutex::new(Duration::ZERO),
        })
    }

    /// Keeps copies of regions this node stops backing for `d` ([`BackupHost::retire`]), and
    /// takes on the copies an earlier process of this node retired (kept `d` from now).
    pub fn set_retain_for(&self, d: Duration) {
        *lock(&self.retain_for) = d;
        let now = Instant::now();
        let mut kept = lock(&self.retained);
        if let Ok(dir) = std::fs::read_dir(self.retained_dir()) {
            for e in dir.flatten() {
                let name = e.file_name();
                if let Some(id) = name.to_str().and_then(|n| n.strip_prefix("region-")?.parse().ok()) {
                    kept.entry(id).or_insert(now);
                }
            }
        }
    }

    fn retained_dir(&self) -> PathBuf {
        self.data_dir.join("retained")
    }

    fn retained_copy(&self, region: u32) -> PathBuf {
        self.retained_dir().join(format!("region-{region}"))
    }

    /// Stops backing `region` ([`BackupHost::release`]) and keeps its copy aside for the
    /// retention time, if the directory is a backup copy (`LOGMAP`) and retention is on;
    /// otherwise the caller removes it. Whether it was kept.
    pub fn retire(&self, region: u32) -> bool {
        self.release(region);
        let (dir, to) = (self.dir(region), self.retained_copy(region));
        if lock(&self.retain_for).is_zero() || !dir.join("LOGMAP").exists() {
            return false;
        }
        let _ = std::fs::remove_dir_all(&to);
        let kept = std::fs::create_dir_all(self.retained_dir()).and_then(|()| std::fs::rename(&dir, &to));
        match kept {
            Ok(()) => {
                lock(&self.retained).insert(region, Instant::now());
                tracing::info!(region, "kept the copy of a region this node no longer backs, in case it comes back");
                true
            }
            Err(e) => {
                tracing::warn!(region, error = %e, "keeping a retired copy failed");
                false
            }
        }
    }

    /// Deletes retired copies older than the retention time, and those of `gone` regions.
    pub fn sweep_retained(&self, gone: impl Fn(u32) -> bool) {
        let keep_for = *lock(&self.retain_for);
        let old: Vec<u32> = lock(&self.retained)
            .iter()
            .filter(|&(&id, &at)| gone(id) || at.elapsed() >= keep_for)
            .map(|(&id, _)| id)
            .collect();
        for id in old {
            lock(&self.retained).remove(&id);
            let _ = std::fs::remove_dir_all(self.retained_copy(id));
            tracing::debug!(region = id, "dropped a retired copy");
        }
    }

    /// Takes a retired copy of `region` back into place, if one is kept and nothing is there.
    fn unretire(&self, region: u32) {
        if lock(&self.retained).remove(&region).is_none() {
            return;
        }
        let (from, dir) = (self.retained_copy(region), self.dir(region));
        if dir.exists() || std::fs::rename(&from, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&from);
            return;
        }
        self.stats.copies_reused.fetch_add(1, Ordering::Relaxed);
        tracing::info!(region, "backing a region again from the copy kept when it was retired");
    }

    /// When received log bytes become durable, as the node's own log (`--fsync`): `always` syncs
    /// every chunk before saying it is held (a write is acknowledged only once it is on the disk
    /// of every replica in the write set); `interval:MS` syncs every MS (a power loss of every
    /// replica loses at most that much of acknowledged writes); `never` syncs when a copy is
    /// complete. Set once, before serving.
    pub fn set_fsync(self: &Arc<Self>, policy: FsyncPolicy) {
        *lock(&self.fsync) = policy;
        let FsyncPolicy::Interval(every) = policy else { return };
        let host = Arc::downgrade(self);
        let _ = std::thread::Builder::new().name("dpukv-repl-flush".into()).spawn(move || {
            loop {
                std::thread::sleep(every);
                let Some(host) = host.upgrade() else { return };
                let open: Vec<_> = lock(&host.backups).values().cloned().collect();
                for b in open {
                    if let Some(b) = lock(&b).as_mut().filter(|b| b.has_unsynced())
                        && let Err(e) = b.sync_log()
                    {
                        tracing::error!(error = %e, "syncing a backup's log copy failed");
                    }
                }
            }
        });
    }

    fn fsync(&self) -> FsyncPolicy {
        *lock(&self.fsync)
    }

    /// Build Index (`true`): backups index their complete log copies themselves, on a thread per
    /// region, instead of installing the primary's shipped index.
    pub fn set_build_index(&self, on: bool) {
        self.build.store(on, Ordering::Release);
    }

    /// The node's replication figures (this host's, and its senders' when they share them).
    pub fn stats(&self) -> Arc<ReplStats> {
        self.stats.clone()
    }

    /// How many regions this node backs.
    pub fn backed(&self) -> usize {
        lock(&self.roles).len()
    }

    /// Backs `region` at `epoch`, whose primary is node `primary`, as the region map read from
    /// etcd says: only that node's stream under that epoch is taken (an older epoch is refused
    /// for good, a newer one until the map shows it). An older map changes nothing.
    pub fn back(&self, region: u32, epoch: u64, primary: u32) {
        let mut r = lock(&self.roles);
        let e = r.entry(region).or_insert((epoch, primary));
        if epoch >= e.0 {
            *e = (epoch, primary);
        }
    }

    /// The regions this node backs.
    pub fn backed_ids(&self) -> Vec<u32> {
        lock(&self.roles).keys().copied().collect()
    }

    /// Whether this node backs `region`.
    pub fn backs(&self, region: u32) -> bool {
        lock(&self.roles).contains_key(&region)
    }

    /// Stops backing `region` (to promote it or remove it): no message is applied to it after
    /// this returns — a connection in the middle of one finishes it first, later ones are
    /// refused — so the copy's files are complete and stable for whoever opens them next.
    pub fn release(&self, region: u32) {
        lock(&self.roles).remove(&region);
        let b = lock(&self.backups).remove(&region);
        if let Some(b) = b {
            drop(lock(&b).take());
        }
        // A builder finishes its step first: nothing is built into the directory after this.
        let builder = lock(&self.builders).remove(&region);
        if let Some((stop, h)) = builder {
            stop.store(true, Ordering::Release);
            let _ = h.join();
        }
    }

    /// Stops backing `region` to lead it: like [`BackupHost::release`], and what a Build Index
    /// backup built becomes the copy's index (so opening it replays only the rest).
    pub fn promote(&self, region: u32) -> dpukv_storage::Result<()> {
        // Opened once first: a copy that was streaming when this node lost power is cut at the
        // end of its valid records and its torn tail zeroed (`Backup::open_with`). Otherwise
        // opening it as a region would read the primary's durability hints in the torn part —
        // written by the primary's disk, not this one's — as a damaged durable log.
        let opened = self.backup(region).map(|_| ());
        self.release(region);
        opened?;
        dpukv_storage::region::adopt_built_index(&self.dir(region))
    }

    /// Starts `region`'s builder (Build Index): every 200 ms, if complete log copies arrived,
    /// it indexes them (`build_index`), outside the backup's lock.
    fn start_builder(&self, region: u32, backup: Arc<Mutex<Option<Backup>>>) {
        let mut builders = lock(&self.builders);
        if builders.contains_key(&region) {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (stop2, dir, stats) = (stop.clone(), self.dir(region), self.stats.clone());
        let spawned = std::thread::Builder::new().name(format!("dpukv-build-{region}")).spawn(move || {
            let mut built_to = None;
            while !stop2.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(200));
                let sealed = match lock(&backup).as_ref() {
                    Some(b) => b.sealed_segments(),
                    None => return,
                };
                if sealed.last().copied() == built_to || stop2.load(Ordering::Acquire) {
                    continue;
                }
                let build = dpukv_storage::region::build_dir(&dir);
                let cfg = dpukv_storage::region::RegionConfig::new(&build, build.join("shm"))
                    .with_fs(crate::host::durable_fs());
                match dpukv_storage::region::build_index(&dir, &sealed, cfg) {
                    Ok(n) => {
                        built_to = sealed.last().copied();
                        stats.records_built.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!(region, error = %e, "building the index failed; will retry"),
                }
            }
        });
        match spawned {
            Ok(h) => {
                builders.insert(region, (stop, h));
            }
            Err(e) => tracing::error!(region, error = %e, "starting the index builder failed"),
        }
    }

    /// How far this node's copies of `region`'s log reach (None: not backed here, or nothing
    /// copied yet).
    pub fn held(&self, region: u32) -> Option<dpukv_storage::vlog::Lsn> {
        if !self.backs(region) || !self.dir(region).join("LOGMAP").exists() {
            return None;
        }
        let b = self.backup(region).ok()?;
        lock(&b).as_ref().and_then(Backup::held_end)
    }

    /// The region's backup directory.
    pub fn dir(&self, region: u32) -> PathBuf {
        self.data_dir.join(format!("region-{region}"))
    }

    fn backup(&self, region: u32) -> dpukv_storage::Result<Arc<Mutex<Option<Backup>>>> {
        let mut b = lock(&self.backups);
        if let Some(x) = b.get(&region) {
            return Ok(x.clone());
        }
        self.unretire(region);
        let x = Arc::new(Mutex::new(Some(Backup::open_with(self.dir(region), crate::host::durable_fs())?)));
        b.insert(region, x.clone());
        if self.build.load(Ordering::Acquire) {
            self.start_builder(region, x.clone());
        }
        Ok(x)
    }

    /// Accepts replication connections on `listener` until `stop`, a thread per connection (at
    /// most [`MAX_REPL_CONNECTIONS`]; more are closed at once). With `tls`, connections speak TLS
    /// only (and, if it asks for client certificates, only primaries with a certificate of the
    /// cluster's CA are served). A connection must say `Hello` within [`HELLO_TIMEOUT`].
    pub fn serve(
        self: &Arc<Self>,
        listener: TcpListener,
        tls: Option<Arc<ServerTls>>,
        stop: Arc<AtomicBool>,
    ) -> std::io::Result<JoinHandle<()>> {
        listener.set_nonblocking(true)?;
        let host = self.clone();
        let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        std::thread::Builder::new().name("dpukv-repl-accept".into()).spawn(move || {
            while !stop.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((s, peer)) => {
                        if active.load(Ordering::Acquire) >= MAX_REPL_CONNECTIONS {
                            tracing::warn!(%peer, "too many replication connections; closing one");
                            continue;
                        }
                        active.fetch_add(1, Ordering::AcqRel);
                        let (host, tls, stop, active2) = (host.clone(), tls.clone(), stop.clone(), active.clone());
                        let spawned = std::thread::Builder::new().name("dpukv-repl-backup".into()).spawn(move || {
                            match Link::accept(s, tls.as_deref()) {
                                Ok((link, who)) => {
                                    if let Err(e) = host.session(link, &who, &stop) {
                                        tracing::debug!(%peer, error = %e, "replication connection ended");
                                    }
                                }
                                Err(e) => {
                                    tracing::warn!(%peer, error = %e, "a replication connection failed its TLS handshake")
                                }
                            }
                            active2.fetch_sub(1, Ordering::AcqRel);
                        });
                        if spawned.is_err() {
                            active.fetch_sub(1, Ordering::AcqRel);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        })
    }

    /// The epoch fence: a connection under an older epoch than the newest known is refused
    /// (with the current one) and closed.
    fn fence(s: &mut impl Write, region: u32, epoch: u64, known: u64) -> anyhow::Result<()> {
        if epoch < known {
            return Self::refuse(
                s,
                region,
                ReplRefusal::StaleEpoch,
                known,
                format!("region {region} is at epoch {known}"),
            );
        }
        Ok(())
    }

    /// Takes one part of the index shipment begun on a connection: a segment's bytes arrive in
    /// order, one segment after another, each at most [`MAX_SHIPPED_SEGMENT`]; a whole segment is
    /// installed at once (rewritten through the segment maps and written). Err: why the
    /// shipment cannot go on (the connection is refused; the primary ships again).
    fn index_part(
        backup: &Mutex<Option<Backup>>,
        install: &mut Option<Installing>,
        segment: u64,
        offset: u64,
        last: bool,
        bytes: &[u8],
    ) -> Result<(), String> {
        let Some((inst, current)) = install.as_mut() else { return Err("an index part with no index begun".into()) };
        let buf = match current {
            Some((id, buf)) if *id == segment => buf,
            Some((id, _)) => return Err(format!("index segment {segment} began before segment {id} ended")),
            None if inst.lacks(segment) => &mut current.insert((segment, Vec::new())).1,
            None => return Err(format!("index segment {segment} is not one the shipment lacks")),
        };
        if offset != buf.len() as u64 {
            return Err(format!("index segment {segment}: part at {offset}, {} bytes received", buf.len()));
        }
        if offset + bytes.len() as u64 > MAX_SHIPPED_SEGMENT {
            return Err(format!("index segment {segment} is larger than {MAX_SHIPPED_SEGMENT} bytes"));
        }
        buf.extend_from_slice(bytes);
        if last {
            let (_, whole) = current.take().unwrap_or_default();
            let mut g = lock(backup);
            let b = g.as_mut().ok_or("released here")?;
            b.install_segment(inst, segment, &whole).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn refuse(
        s: &mut impl Write,
        region: u32,
        reason: ReplRefusal,
        current: u64,
        message: String,
    ) -> anyhow::Result<()> {
        write_msg(s, &ReplMessage::Refuse { region, reason, current, at: 0, message: message.clone() }, &NEVER)?;
        anyhow::bail!("refused: {}: {message}", reason.code())
    }

    fn session(&self, mut s: Link, peer: &Peer, stop: &AtomicBool) -> anyhow::Result<()> {
        s.set_read_timeout(Some(HELLO_TIMEOUT))?;
        let (region, epoch, primary, base, life) = match read_msg(&mut s)? {
            ReplMessage::Hello { cluster, region, epoch, primary, base, life } => {
                if cluster != self.cluster {
                    return Self::refuse(
                        &mut s,
                        region,
                        ReplRefusal::WrongCluster,
                        0,
                        format!("this node is in cluster {:?}", self.cluster),
                    );
                }
                // Only the node the Hello names may stream as it (its certificate says which).
                if let Err(r) = peer.allow_node(primary, "a replication stream") {
                    return Self::refuse(&mut s, region, ReplRefusal::Forbidden, 0, r.to_string());
                }
                (region, epoch, primary, base, life.unwrap_or(0))
            }
            other => anyhow::bail!("expected hello, got {other:?}"),
        };
        // From here the primary streams when it has something; a vanished one is found by the
        // link's keep-alive probes.
        s.set_read_timeout(None)?;
        // What the Hello claims is checked against the map this node read from etcd: a peer's
        // word never raises the epoch a backup fences with, nor names a region's primary.
        let known = lock(&self.roles).get(&region).copied();
        let Some((known, leader)) = known else {
            return Self::refuse(
                &mut s,
                region,
                ReplRefusal::WrongRegion,
                0,
                format!("this node does not back region {region}"),
            );
        };
        Self::fence(&mut s, region, epoch, known)?;
        if epoch > known || primary != leader {
            // A new primary can be a map poll ahead of this node: it tries again shortly.
            return Self::refuse(
                &mut s,
                region,
                ReplRefusal::WrongRegion,
                known,
                format!("this node's map has region {region} at epoch {known} led by node {leader}"),
            );
        }
        let backup = self.backup(region)?;
        let from = match lock(&backup).as_mut() {
            // Copies that followed another primary, or another life of this one, lose what they
            // hold past this life's base.
            Some(b) => {
                b.follow(u64::from(primary), life, Lsn(base))?;
                b.resume_from()
            }
            None => {
                return Self::refuse(
                    &mut s,
                    region,
                    ReplRefusal::WrongRegion,
                    0,
                    "the region was just released here".into(),
                );
            }
        };
        write_msg(&mut s, &ReplMessage::Resume { region, epoch, from: from.map(|l| l.0) }, stop)?;
        // Frames are read through a buffer, so that one already here is seen: under `always`,
        // chunks that arrived together share one sync (group commit) before `Held` says so.
        let mut r = std::io::BufReader::with_capacity(256 << 10, s.try_clone()?);
        let always = self.fsync() == FsyncPolicy::Always;
        // Applied but not yet answered (under `always`: not yet synced): the position, and how
        // many chunks.
        let mut unanswered: Option<(Lsn, usize)> = None;
        // The index shipment being installed, and the segment being received (its id and bytes
        // so far: at most MAX_SHIPPED_SEGMENT, the only part of an index held in memory).
        let mut install: Option<Installing> = None;
        loop {
            if let Some((upto, frames)) = unanswered
                && (!always || r.buffer().is_empty() || frames >= SYNC_GROUP_FRAMES)
            {
                if always {
                    let synced = match lock(&backup).as_mut() {
                        Some(b) => b.sync_log(),
                        None => {
                            return Self::refuse(&mut s, region, ReplRefusal::WrongRegion, 0, "released here".into());
                        }
                    };
                    if let Err(e) = synced {
                        return Self::refuse(&mut s, region, ReplRefusal::Failed, known, e.to_string());
                    }
                }
                tracing::trace!(region, epoch, upto = ?upto, "held");
                write_msg(&mut s, &ReplMessage::Held { region, epoch, upto: upto.0 }, stop)?;
                unanswered = None;
            }
            let m = read_msg(&mut r)?;
            if m.region() != region {
                return Self::refuse(
                    &mut s,
                    m.region(),
                    ReplRefusal::WrongRegion,
                    0,
                    "one region per connection".into(),
                );
            }
            // The fence: once a newer primary has spoken, this connection's epoch is stale.
            let known = lock(&self.roles).get(&region).map_or(u64::MAX, |&(e, _)| e);
            Self::fence(&mut s, region, epoch, known)?;
            match m {
                ReplMessage::Append { segment, offset, segment_size, sealed, bytes, .. } => {
                    self.stats.log_bytes_received.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    let c = dpukv_storage::vlog::LogChunk { segment, offset, bytes, segment_size, sealed };
                    let r = match lock(&backup).as_mut() {
                        Some(b) => b.append_log(&c),
                        None => {
                            return Self::refuse(&mut s, region, ReplRefusal::WrongRegion, 0, "released here".into());
                        }
                    };
                    match r {
                        Ok(upto) => unanswered = Some((upto, unanswered.map_or(1, |(_, n)| n + 1))),
                        Err(e) => return Self::refuse(&mut s, region, ReplRefusal::Gap, known, e.to_string()),
                    }
                }
                ReplMessage::Restart { .. } => {
                    // The region's primary (its Hello checked against the map) no longer has
                    // the log this copy lacks: start over, from nothing.
                    let mut g = lock(&backup);
                    if g.take().is_some() {
                        let dir = self.dir(region);
                        let fresh = std::fs::remove_dir_all(&dir)
                            .map_err(|source| dpukv_storage::Error::Io { path: dir.clone(), source })
                            .and_then(|()| Backup::open_with(&dir, crate::host::durable_fs()));
                        match fresh {
                            Ok(b) => *g = Some(b),
                            Err(e) => {
                                drop(g);
                                lock(&self.backups).remove(&region);
                                tracing::warn!(region, error = %e, "starting the copy over failed");
                            }
                        }
                        tracing::info!(
                            region,
                            epoch,
                            "the primary no longer has the log this copy lacks: copying the region again"
                        );
                    }
                    return Ok(());
                }
                ReplMessage::IndexBegin { manifest, sessions, levels, .. } => {
                    let r = ShippedIndex::from_parts((manifest, sessions, levels)).and_then(|shipped| {
                        let mut g = lock(&backup);
                        let b = g.as_mut().ok_or_else(|| dpukv_storage::Error::Config("released here".into()))?;
                        b.begin_index(shipped)
                    });
                    match r {
                        Ok(inst) => install = Some((inst, None)),
                        Err(e) => return Self::refuse(&mut s, region, ReplRefusal::Failed, known, e.to_string()),
                    }
                }
                ReplMessage::IndexPart { segment, offset, last, bytes, .. } => {
                    self.stats.index_bytes_installed.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    if let Err(why) = Self::index_part(&backup, &mut install, segment, offset, last, &bytes) {
                        return Self::refuse(&mut s, region, ReplRefusal::Failed, known, why);
                    }
                }
                ReplMessage::IndexEnd { .. } => {
                    let r = match install.take() {
                        Some((inst, None)) => {
                            let mut g = lock(&backup);
                            match g.as_mut() {
                                Some(b) => {
                                    b.finish_index(inst).map(|()| b.manifest().generation).map_err(|e| e.to_string())
                                }
                                None => Err("released here".to_string()),
                            }
                        }
                        Some((_, Some(_))) => Err("the index ended inside a segment".to_string()),
                        None => Err("an index end with no index begun".to_string()),
                    };
                    match r {
                        Ok(generation) => {
                            write_msg(&mut s, &ReplMessage::Installed { region, epoch, generation }, stop)?;
                        }
                        Err(why) => return Self::refuse(&mut s, region, ReplRefusal::Failed, known, why),
                    }
                }
                ReplMessage::Segments { live, .. } => {
                    let r = match lock(&backup).as_mut() {
                        Some(b) => b.retain_log_segments(&live),
                        None => {
                            return Self::refuse(&mut s, region, ReplRefusal::WrongRegion, 0, "released here".into());
                        }
                    };
                    match r {
                        Ok(gone) if !gone.is_empty() => {
                            self.stats.log_segments_dropped.fetch_add(gone.len() as u64, Ordering::Relaxed);
                            tracing::debug!(region, ?gone, "dropped log copies the primary collected");
                        }
                        Ok(_) => {}
                        Err(e) => return Self::refuse(&mut s, region, ReplRefusal::Failed, known, e.to_string()),
                    }
                }
                other => anyhow::bail!("unexpected {other:?}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_lag_counts_the_rounds_after_a_position_and_a_lower_bound_past_the_remembered_ones() {
        let f = Feed::new();
        f.committed_at(Lsn(100), 2);
        f.committed_at(Lsn(200), 3);
        f.committed_at(Lsn(250), 0); // a round that wrote nothing
        f.committed_at(Lsn(300), 1);
        let lag: Vec<u64> =
            [0, 99, 100, 150, 200, 250, 299, 300, 400].iter().map(|&p| f.records_after(Lsn(p))).collect();
        assert_eq!(lag, [6, 6, 4, 4, 1, 1, 1, 0, 0]);
        // Past FEED_MARKS rounds the oldest are forgotten: a position before them lags by at
        // least what the remembered rounds wrote.
        let f = Feed::new();
        for i in 1..=(FEED_MARKS as u64 + 10) {
            f.committed_at(Lsn(i * 10), 2);
        }
        let total = 2 * (FEED_MARKS as u64 + 10);
        assert_eq!(f.records_after(Lsn(0)), 2 * FEED_MARKS as u64);
        assert_eq!(f.records_after(Lsn(15 * 10)), total - 30);
        assert_eq!(f.records_after(Lsn((FEED_MARKS as u64 + 10) * 10)), 0);
    }

    #[test]
    fn positions_name_every_required_backup_and_every_node_that_streamed() {
        let a = Acks::new(1, vec![2, 3]);
        a.held(4, Lsn(10)); // a joining node
        a.held(2, Lsn(20));
        assert_eq!(a.positions(), vec![(2, Some(Lsn(20))), (3, None), (4, Some(Lsn(10)))]);
        assert!(!a.holds(Lsn(5)), "backup 3 holds nothing yet");
        a.held(3, Lsn(15));
        assert!(a.holds(Lsn(15)) && !a.holds(Lsn(16)), "the joining node does not count");
    }

    /// A backup's fence at 100: writes ending at or before the cut are acknowledged, later
    /// ones — held by every backup — wait for the lift, and readers see nothing past the cut
    /// until then; a lift of another fence changes nothing.
    #[test]
    fn a_fence_holds_back_acknowledgements_and_reads_past_its_cut_until_lifted() {
        let a = Acks::new(1, vec![2]);
        a.held(2, Lsn(50));
        assert_eq!(a.fence(7, || Lsn(100)), Ok(Lsn(100)));
        a.held(2, Lsn(300));
        assert_eq!(a.wait(Lsn(100), Duration::from_millis(10)), Ok(()), "at the cut");
        assert_eq!(a.wait(Lsn(101), Duration::from_millis(50)), Err(AckError::Fenced), "past the cut");
        assert!(!a.lift(8), "another fence");
        assert_eq!(a.fenced(), Some((7, Lsn(100))));
        let waiting = {
            let a = Arc::new(a);
            let w = a.clone();
            let t = std::thread::spawn(move || w.wait(Lsn(300), Duration::from_secs(10)));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!t.is_finished(), "held by the fence");
            assert!(a.lift(7));
            t
        };
        assert_eq!(waiting.join().expect("waiter"), Ok(()), "released by the lift");
    }

    /// The read gate stops at the cut too, and goes on after the lift.
    #[test]
    fn a_fence_caps_the_read_gate_at_its_cut() {
        use dpukv_storage::region::{Region, RegionConfig};
        let dir = tempfile::tempdir().expect("dir");
        let cfg = RegionConfig::tiny(dir.path().join("r"), dir.path().join("shm"), FsyncPolicy::Never);
        let mut region = Region::open(cfg).expect("region").0;
        let gate = region.gate_reads();
        let a = Acks::new(1, vec![]);
        a.set_gate(gate.clone());
        let first = region.put(b"a", b"v").expect("put").end;
        assert_eq!(a.fence(1, || first), Ok(first));
        let second = region.put(b"b", b"v").expect("put").end;
        assert!(gate.wait_shown(first, Duration::from_secs(5)), "the cut is visible");
        assert!(!gate.wait_shown(second, Duration::from_millis(100)), "past the cut: not yet");
        assert!(a.lift(1));
        assert!(gate.wait_shown(second, Duration::from_secs(5)), "visible once lifted");
    }

    #[test]
    fn a_closed_region_takes_no_fence() {
        let a = Acks::new(1, vec![2]);
        a.close();
        assert_eq!(a.fence(1, || Lsn(5)), Err(AckError::Closed));
    }

    /// A backup whose disk is full refuses every session at the same position; the primary
    /// reconnects every 100 ms. New sessions are not progress: it is reported stalled after the
    /// bound all the same (it was never reported when a session counted as moving).
    #[test]
    fn a_node_whose_sessions_restart_where_they_failed_is_stalled_after_the_bound() {
        let a = Acks::new(1, vec![2, 3]);
        let bound = Duration::from_millis(200);
        a.held(2, Lsn(100));
        a.held(3, Lsn(100));
        assert!(a.stalled(&[2, 3], Lsn(150), bound).is_empty(), "watched from now on");
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(400) {
            a.reset(3, Lsn(100)); // a new session, refused where the last one was
            a.held(2, Lsn(150 + t.elapsed().as_millis() as u64));
            std::thread::sleep(Duration::from_millis(20));
        }
        let end = Lsn(1_000);
        assert_eq!(a.stalled(&[2, 3], end, bound), vec![3], "only the node that takes no log");
        // A session that resumes further on is progress.
        a.reset(3, Lsn(120));
        assert!(a.stalled(&[3], end, bound).is_empty());
        // A node that holds the whole log is never stalled, however long it is quiet.
        a.held(3, end);
        std::thread::sleep(Duration::from_millis(250));
        assert!(a.stalled(&[3], end, bound).is_empty());
    }
}
