//! The Redis protocol (RESP 2) front end, so that `redis-cli`, `redis-benchmark` and Redis
//! client libraries work unchanged (docs/gateway.md).
//!
//! A connection reads what the client sent, takes every complete command from it (at most
//! `max_pipeline` at a time), runs them, and writes their replies in order. Pipelined commands
//! on disjoint keys run concurrently; a command on a key already touched in the group waits for
//! the group (so commands on one key apply in the order sent — unlike Redis, pipelined commands
//! on *different* keys may apply in any order; each is linearizable). Unknown commands are
//! answered with an error, never by closing the connection; only bytes that are not RESP (or
//! exceed the limits) close it, after an error reply. `CLIENT REPLY OFF|SKIP` suppress replies
//! as in Redis; `MULTI` ... `EXEC` of plain writes runs as one atomic batch (`transaction`).
//!
//! # Layout
//! - `frame`: parsing commands and encoding replies.
//! - `command`: the commands.
//! - `transaction`: `MULTI`, `EXEC`, `DISCARD`.
//! - `cursors`: `SCAN` cursors.
//! - `pattern`: `MATCH` globs.
//!
//! # Bounds
//! - Before it authenticates (with tokens configured), a connection holds a fixed 16 KiB input
//!   buffer and nothing else: its commands may hold 4 KiB (`AUTH` and `HELLO` fit), every other
//!   command is answered `NOAUTH` without reserving anything, and it must authenticate within
//!   `auth_timeout`.
//! - Once authenticated, everything it holds comes from its share of the memory budget
//!   (`crate::budget`, `--conn-memory`): its input buffer past 16 KiB (charged before it grows),
//!   and each command's largest reply, reserved before it runs and given back once the reply is
//!   written. A command whose reservation the connection's share cannot give now waits only
//!   after the replies before it are written (holding nothing else), at most `command_timeout`,
//!   then is answered `-OOM`; a command must arrive whole within `command_timeout` of its first
//!   byte (slow clients cannot hold a large buffer).
//! - Connections are capped; an idle connection is closed after `idle_timeout`; a reply write
//!   must finish within `write_timeout`; a session whose token is revoked (removed from the
//!   token file) is closed when the file is re-read.

mod command;
pub mod cursors;
pub mod frame;
pub mod pattern;
mod transaction;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpukv_net::conn::Budget;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::{Access, Principal};
use crate::budget::{Held, Share};
use crate::metrics::Metrics;
use crate::throttle::AuthThrottle;
use crate::upstream::Upstream;
use command::Touches;
use cursors::Cursors;
use frame::{Limits, ParseError, Reply, parse_command};
use transaction::Multi;

/// The front end's limits.
#[derive(Debug, Clone, Copy)]
pub struct RespLimits {
    /// Connections open at once (more are closed at once).
    pub max_connections: usize,
    /// Commands taken from a connection's input at a time.
    pub max_pipeline: usize,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    /// A reply write must finish within this.
    pub write_timeout: Duration,
    /// What one command may hold.
    pub command: Limits,
    /// A command must arrive whole within this of its first byte, and waits at most this for
    /// memory for its reply.
    pub command_timeout: Duration,
    /// Bytes one connection may hold (its share of the memory budget).
    pub conn_memory: usize,
    /// With tokens configured, a connection must authenticate within this.
    pub auth_timeout: Duration,
}

/// What every connection shares.
pub struct Shared {
    /// The cluster.
    pub up: Arc<Upstream>,
    /// Who may do what.
    pub access: Access,
    /// Failed authentications per peer address.
    pub throttle: Arc<AuthThrottle>,
    /// Limits.
    pub limits: RespLimits,
    /// The process's memory budget (connections take their shares from it).
    pub budget: Budget,
    /// `SCAN` cursors (shared by the gateways of a process: a cursor may be continued on any
    /// connection).
    pub cursors: Arc<Cursors>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// This front end's address (for `INFO`).
    pub port: u16,
    /// TLS, if the front end speaks it.
    pub tls: Option<Arc<dpukv_net::tls::ServerTls>>,
}

/// Serves `listener` until `stop`.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken, tracker: TaskTracker) {
    let open = Arc::new(Semaphore::new(shared.limits.max_connections));
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((stream, peer)) = accepted else { continue };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // Redis's own answer when its client limit is reached (written off the accepting
            // task: a client that does not read cannot hold up the others' accepts).
            tokio::spawn(async move {
                let mut s = stream;
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    s.write_all(b"-ERR max number of clients reached\r\n"),
                )
                .await;
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (shared, stop) = (shared.clone(), stop.clone());
        tracker.spawn(async move {
            let _counted = shared.metrics.connection("resp");
            let stream = match dpukv_net::tls::accept(shared.tls.as_deref(), stream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "a RESP client failed the TLS handshake");
                    return;
                }
            };
            let session = Session::new(stream, &shared, peer.ip());
            if let Err(e) = session.run(stop).await {
                tracing::debug!(error = %e, "RESP connection ended");
            }
            drop(permit);
        });
    }
}

/// A get answered at once (on the thread serving connections) that takes longer than this is
/// logged: a value read from disk, or a stall.
const SLOW_GET_NOW: Duration = Duration::from_millis(50);

/// What `CLIENT REPLY` chose.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum ReplyMode {
    /// Every command is answered.
    #[default]
    On,
    /// No command is answered.
    Off,
    /// The next command is not answered.
    Skip,
}

/// A connection's own state.
#[derive(Default)]
struct ConnState {
    quit: bool,
    /// Close once the replies so far are written (too many failed `AUTH`s).
    close: bool,
    /// Who authenticated (`AUTH`), if anyone.
    caller: Option<Arc<Principal>>,
    /// How gets are served, if the connection chose (`CONSISTENCY`, `READONLY`, `READWRITE`);
    /// else the token's service level, else linearizable.
    consistency: Option<dpukv_proto::Consistency>,
    /// `CLIENT REPLY`.
    reply: ReplyMode,
    /// A transaction being queued (`MULTI`).
    multi: Option<Multi>,
    /// Failed `AUTH`s on this connection.
    auth_failures: u32,
    /// `CLIENT SETNAME` (`HELLO ... SETNAME`): at most [`MAX_CLIENT_NAME`] bytes.
    name: Option<Vec<u8>>,
}

/// The longest connection name `CLIENT SETNAME` keeps.
const MAX_CLIENT_NAME: usize = 256;

/// `CLIENT ID`s: unique in the process (every front end thread's connections), from 1.
static NEXT_CLIENT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A name `CLIENT SETNAME` takes: no spaces, newlines or other characters outside `!`..`~` (as
/// Redis), at most [`MAX_CLIENT_NAME`] bytes; empty clears it.
fn client_name(name: &[u8]) -> Result<Option<Vec<u8>>, Reply> {
    if name.len() > MAX_CLIENT_NAME {
        return Err(Reply::err(format!("client names are at most {MAX_CLIENT_NAME} bytes")));
    }
    if name.iter().any(|b| !(b'!'..=b'~').contains(b)) {
        return Err(Reply::err("Client names cannot contain spaces, newlines or special characters."));
    }
    Ok((!name.is_empty()).then(|| name.to_vec()))
}

impl ConnState {
    fn consistency(&self) -> dpukv_proto::Consistency {
        self.consistency.or_else(|| self.caller.as_ref().and_then(|p| p.consistency)).unwrap_or_default()
    }
}

/// Input read at a time; also the input buffer every connection holds outside the budget (a
/// fixed cost per connection, bounded by `--max-connections`).
const READ_CHUNK: usize = 16 << 10;

/// What a command may hold before the connection has authenticated: `AUTH [user] token` and
/// `HELLO 2 AUTH user token SETNAME name` fit.
const PRE_AUTH: Limits = Limits { max_args: 16, max_arg: 1024, max_command: 4096 };

/// One command of a group: run it with the bytes reserved for its reply, or answer it as is.
enum Entry {
    Run {
        args: Vec<Vec<u8>>,
        room: usize,
    },
    Answer {
        name: String,
        reply: Reply,
    },
    /// `INCR`/`DECR`/`INCRBY`/`DECRBY`s of keys of one region: each key's run of deltas in the
    /// order sent, all in one `add_text` (one key) or `add_texts` (see `command::add`); the
    /// first's reply goes here, the others' at their [`Entry::Joined`].
    Add {
        /// Each key and its deltas.
        adds: Vec<(Vec<u8>, Vec<i64>)>,
        /// Each command in the order sent: its key's index in `adds`, and its name.
        order: Vec<(usize, String)>,
    },
    /// Plain `SET`s of distinct keys of one region: one atomic batch (`command::puts`); the
    /// first's reply goes here, the others' at their [`Entry::Joined`].
    Puts {
        kvs: Vec<(Vec<u8>, Vec<u8>)>,
        bytes: usize,
    },
    /// A command that joined the [`Entry::Add`] or [`Entry::Puts`] at this index of the group.
    Joined {
        to: usize,
    },
}

/// A plain `SET key value`'s key and value (see `command::plain_set`), taken from its arguments.
fn key_value(args: Vec<Vec<u8>>) -> (Vec<u8>, Vec<u8>) {
    let mut args = args.into_iter().skip(1);
    (args.next().unwrap_or_default(), args.next().unwrap_or_default())
}

/// Most `SET`s one batch of a pipeline group holds, and about its most bytes of keys and values.
const MAX_PUTS: usize = 256;
const MAX_PUTS_BYTES: usize = 1 << 20;

/// One connection.
struct Session<'a> {
    stream: dpukv_net::tls::Stream,
    shared: &'a Shared,
    peer: IpAddr,
    share: Share,
    /// What the client sent and was not taken yet.
    input: Vec<u8>,
    /// The input buffer's capacity past `READ_CHUNK`, charged to the share.
    input_held: Held,
    /// Replies not yet written, and what they hold.
    out: Vec<u8>,
    held: Vec<Held>,
    state: ConnState,
    /// Announces a new token document.
    changes: tokio::sync::watch::Receiver<u64>,
    /// Since when the connection has had no token (it must authenticate within the limit).
    unauthenticated_since: tokio::time::Instant,
    /// `CLIENT ID`.
    id: u64,
}

impl<'a> Session<'a> {
    fn new(stream: dpukv_net::tls::Stream, shared: &'a Shared, peer: IpAddr) -> Session<'a> {
        Session {
            stream,
            shared,
            peer,
            share: Share::new(&shared.budget, shared.limits.conn_memory),
            input: Vec::with_capacity(READ_CHUNK),
            input_held: Held::default(),
            out: Vec::with_capacity(READ_CHUNK),
            held: Vec::new(),
            state: ConnState::default(),
            changes: shared.access.changed(),
            unauthenticated_since: tokio::time::Instant::now(),
            id: NEXT_CLIENT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Whether the connection may run commands (it authenticated, or no token is needed).
    fn authenticated(&self) -> bool {
        !self.shared.access.required() || self.state.caller.is_some()
    }

    fn command_limits(&self) -> Limits {
        if self.authenticated() { self.shared.limits.command } else { PRE_AUTH }
    }

    /// Takes the token document in force: `false` if the connection's token was revoked.
    fn refresh_caller(&mut self) -> bool {
        self.changes.borrow_and_update();
        match &self.state.caller {
            Some(p) => match self.shared.access.current(p) {
                Some(now) => {
                    self.state.caller = Some(now);
                    true
                }
                None => {
                    tracing::info!(token = %p.name, "a revoked token's RESP session is closed");
                    false
                }
            },
            None => true,
        }
    }

    async fn run(mut self, stop: CancellationToken) -> std::io::Result<()> {
        let limits = self.shared.limits;
        // When the first byte of a command not yet whole arrived.
        let mut partial_since: Option<tokio::time::Instant> = None;
        loop {
            if self.changes.has_changed().unwrap_or(false) && !self.refresh_caller() {
                return Ok(());
            }
            // Take every complete command buffered (up to the pipeline limit).
            let mut cmds = Vec::new();
            let mut used = 0;
            let mut fatal = None;
            let authenticated = self.authenticated();
            let command_limits = self.command_limits();
            // Taken out while its commands are parsed (gets answered at once need `self`).
            let input = std::mem::take(&mut self.input);
            // GETs answered in the loop count toward the pipeline limit too.
            let mut answered = 0;
            while cmds.len() + answered < limits.max_pipeline {
                // A GET at the front with nothing before it pending, that the device in this
                // process answers at once (an embedded front door): parsed in place, answered
                // here, in order — no arguments copied, no group, no task.
                if cmds.is_empty()
                    && let Some((key, n)) = frame::get_command(&input[used..], &command_limits)
                    && self.get_now(&input[used..][key])
                {
                    used += n;
                    answered += 1;
                    continue;
                }
                match parse_command(&input[used..], &command_limits) {
                    Ok((args, n)) => {
                        used += n;
                        if !args.is_empty() {
                            // What follows an AUTH is parsed once it ran (with its limits).
                            let auth = !authenticated && matches!(command::name(&args).as_str(), "auth" | "hello");
                            cmds.push(args);
                            if auth {
                                break;
                            }
                        }
                    }
                    Err(ParseError::Incomplete) => break,
                    Err(e) => {
                        fatal = Some(e);
                        break;
                    }
                }
            }
            self.input = input;
            self.input.drain(..used);
            if !cmds.is_empty() {
                self.run_pipeline(cmds).await?;
            }
            if let Some(e) = &fatal {
                Reply::Error(format!("ERR {e}")).encode(&mut self.out);
            }
            self.flush().await?;
            if fatal.is_some() {
                linger(&mut self.stream).await;
                return Ok(());
            }
            if self.state.quit || self.state.close {
                return Ok(());
            }
            if self.input.is_empty() {
                partial_since = None;
            } else {
                if !matches!(parse_command(&self.input, &self.command_limits()), Err(ParseError::Incomplete)) {
                    continue; // more commands are buffered (the pipeline limit stopped the taking)
                }
                partial_since.get_or_insert_with(tokio::time::Instant::now);
            }
            self.shrink_input();
            // The next deadline: idle, a command arriving whole, authenticating.
            let mut deadline = tokio::time::Instant::now() + limits.idle_timeout;
            let mut why = "idle";
            if let Some(t) = partial_since
                && t + limits.command_timeout < deadline
            {
                (deadline, why) = (t + limits.command_timeout, "a command did not arrive whole in time");
            }
            let auth_by = self.unauthenticated_since + limits.auth_timeout;
            if !self.authenticated() && auth_by < deadline {
                (deadline, why) = (auth_by, "not authenticated in time");
            }
            // Room to read into (charged to the share past the fixed buffer).
            if !self.grow_input(deadline).await {
                let _ = self.write_now(&format!("-ERR Protocol error: {why}\r\n")).await;
                linger(&mut self.stream).await;
                return Ok(());
            }
            let got = tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                changed = self.changes.changed() => {
                    if changed.is_err() || !self.refresh_caller() {
                        return Ok(());
                    }
                    continue;
                }
                got = tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.input)) => got,
            };
            match got {
                Err(_) => {
                    tracing::debug!(why, "closing a RESP connection");
                    if why != "idle" {
                        let _ = self.write_now(&format!("-ERR Protocol error: {why}\r\n")).await;
                        linger(&mut self.stream).await;
                    }
                    return Ok(());
                }
                Ok(Ok(0)) => return Ok(()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
            }
        }
    }

    /// Makes room in the input buffer for a read: past the fixed `READ_CHUNK`, its capacity is
    /// charged to the share first (waiting until `deadline` at most). `false`: no room in time.
    async fn grow_input(&mut self, deadline: tokio::time::Instant) -> bool {
        let spare = self.input.capacity() - self.input.len();
        if spare >= 1024 {
            return true;
        }
        // A command is never larger than the parser's limit: room for it and one read more.
        // Before authentication the fixed buffer is all there is (a command holds 4 KiB).
        let most = if self.authenticated() { self.command_limits().max_command + READ_CHUNK } else { READ_CHUNK };
        let want = (self.input.capacity() * 2).max(self.input.len() + READ_CHUNK).min(most);
        if want <= self.input.capacity() {
            return spare > 0;
        }
        let charge = want.saturating_sub(READ_CHUNK).saturating_sub(self.input_held.bytes());
        if charge > 0 {
            let more = match self.share.try_take(charge) {
                Some(h) => h,
                // Only the input is held here (replies were written): waiting cannot be for
                // the connection's own bytes.
                None => match tokio::time::timeout_at(deadline, self.share.take(charge)).await {
                    Ok(h) => h,
                    Err(_) => return false,
                },
            };
            self.input_held.merge(more);
        }
        self.input.reserve_exact(want - self.input.len());
        true
    }

    /// Gives back a large input buffer once what it holds is small again.
    fn shrink_input(&mut self) {
        if self.input.capacity() > 4 * READ_CHUNK && self.input.len() <= READ_CHUNK / 2 {
            let mut small = Vec::with_capacity(READ_CHUNK);
            small.extend_from_slice(&self.input);
            self.input = small;
            self.input_held = Held::default();
        }
    }

    /// Writes the replies so far and gives back what they held.
    async fn flush(&mut self) -> std::io::Result<()> {
        if !self.out.is_empty() {
            match tokio::time::timeout(self.shared.limits.write_timeout, self.stream.write_all(&self.out)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(std::io::ErrorKind::TimedOut.into()),
            }
            self.out.clear();
            if self.out.capacity() > 4 * READ_CHUNK {
                self.out = Vec::with_capacity(READ_CHUNK);
            }
        }
        self.held.clear();
        Ok(())
    }

    /// Writes `text` at once (the connection is closing).
    async fn write_now(&mut self, text: &str) -> std::io::Result<()> {
        match tokio::time::timeout(self.shared.limits.write_timeout, self.stream.write_all(text.as_bytes())).await {
            Ok(r) => r,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// Appends a reply, unless `CLIENT REPLY` suppresses it.
    fn emit(&mut self, r: Reply) {
        match self.state.reply {
            ReplyMode::On => r.encode(&mut self.out),
            ReplyMode::Off => {}
            ReplyMode::Skip => self.state.reply = ReplyMode::On,
        }
    }

    /// The most one command may reserve: the share, less what the input buffer holds.
    fn room(&self) -> usize {
        self.share.size().saturating_sub(self.input_held.bytes()).max(1)
    }

    /// What `args` reserves for its reply: its bound, at most the room there is.
    fn reservation(&self, args: &[Vec<u8>]) -> usize {
        command::reply_bound(args).min(self.room())
    }

    /// Why `args` is answered without running, if it is: no token, or a key not granted.
    fn refusal(&self, args: &[Vec<u8>]) -> Option<Reply> {
        if !self.shared.access.required() {
            return None;
        }
        match &self.state.caller {
            None => Some(noauth()),
            Some(p) if !command::permitted(p, args) => Some(noperm()),
            Some(_) => None,
        }
    }

    /// Runs `cmds` in groups (see the module documentation) and appends their replies in order.
    async fn run_pipeline(&mut self, cmds: Vec<Vec<Vec<u8>>>) -> std::io::Result<()> {
        let mut group: Vec<Entry> = Vec::new();
        let mut touched: std::collections::HashSet<Vec<u8>> = std::collections::HashSet::new();
        // Keys whose only command in the group so far is the increment run at this index: a
        // further increment of the key joins it instead of waiting for the group (KV-Direct's
        // dependent atomics in one round: one write, one sync, every reply after it).
        let mut adds: std::collections::HashMap<Vec<u8>, usize> = std::collections::HashMap::new();
        // Regions whose increments so far make the run at this index: an increment of a key the
        // group has not touched yet joins it too (one request, one write for them all).
        let mut add_regions: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        // Regions whose plain `SET`s so far make the batch at this index: a further one joins it
        // (one request, one write and one sync for them all).
        let mut puts: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        let map = self.shared.up.client().routing_map();
        let region_of = |key: &[u8]| map.as_ref().and_then(|m| m.region_of(key)).map(|r| r.id);
        for args in cmds {
            if self.state.quit || self.state.close {
                break;
            }
            let name = command::name(&args);
            if self.state.multi.is_some() && !transaction::controls(&name) {
                let started = Instant::now();
                let r = self.queue(&args);
                record(self.shared, &name, &r, started);
                self.emit(r);
                continue;
            }
            // (A key the protocol refuses is run on its own, and refused on its own.)
            let additive = match command::additive(&args) {
                Some(Ok(d)) if self.authenticated() && command::valid_key(&args[1]) => Some(d),
                _ => None,
            };
            // The increment run this one may join: its key's, or (a key the group has not touched)
            // its region's while that has room for another key.
            let join = additive.and_then(|_| match adds.get(&args[1]) {
                Some(&to) => Some(to),
                None if !touched.contains(&args[1]) => region_of(&args[1]).and_then(|r| add_regions.get(&r).copied()),
                None => None,
            });
            if let Some(d) = additive
                && let Some(to) = join
                && let Some(Entry::Add { adds: run, order }) = group.get_mut(to)
                && order.len() < dpukv_proto::limits::MAX_ADDS
                && (adds.contains_key(&args[1]) || run.len() < dpukv_proto::limits::MAX_ADD_KEYS)
                && self.refusal(&args).is_none()
                && let Some(held) = self.share.try_take(self.reservation(&args))
            {
                let i = match run.iter().position(|(k, _)| *k == args[1]) {
                    Some(i) => i,
                    None => {
                        run.push((args[1].clone(), Vec::new()));
                        adds.insert(args[1].clone(), to);
                        touched.insert(args[1].clone());
                        run.len() - 1
                    }
                };
                run[i].1.push(d);
                order.push((i, name));
                group.push(Entry::Joined { to });
                self.held.push(held);
                continue;
            }
            let plain_set = self.authenticated() && command::plain_set(&args);
            if plain_set
                && !touched.contains(&args[1])
                && let Some(&to) = region_of(&args[1]).and_then(|r| puts.get(&r))
                && let Some(Entry::Puts { kvs, bytes }) = group.get_mut(to)
                && kvs.len() < MAX_PUTS
                && *bytes + args[1].len() + args[2].len() <= MAX_PUTS_BYTES
                && self.refusal(&args).is_none()
                && let Some(held) = self.share.try_take(self.reservation(&args))
            {
                *bytes += args[1].len() + args[2].len();
                let (key, value) = key_value(args);
                touched.insert(key.clone());
                kvs.push((key, value));
                group.push(Entry::Joined { to });
                self.held.push(held);
                continue;
            }
            let t = command::touches(&args);
            let conflicts = match &t {
                Touches::Nothing => false,
                Touches::Keys(keys) => keys.iter().any(|k| touched.contains(k)),
                Touches::Everything | Touches::Connection => !group.is_empty(),
            };
            if conflicts {
                self.run_group(std::mem::take(&mut group)).await;
                touched.clear();
                adds.clear();
                add_regions.clear();
                puts.clear();
            }
            if let Touches::Connection = t {
                let started = Instant::now();
                let r = self.connection_command(&args).await;
                if let Some(r) = r {
                    record(self.shared, &name, &r, started);
                    self.emit(r);
                }
                continue;
            }
            // Checked before anything is reserved, read or written for the command.
            if let Some(reply) = self.refusal(&args) {
                group.push(Entry::Answer { name, reply });
                continue;
            }
            let need = self.reservation(&args);
            let held = match self.share.try_take(need) {
                Some(h) => h,
                None => {
                    // Run and write what came before, so that nothing of this connection is
                    // held while it waits; then wait (bounded) for the share and the budget.
                    self.run_group(std::mem::take(&mut group)).await;
                    touched.clear();
                    adds.clear();
                    add_regions.clear();
                    puts.clear();
                    self.flush().await?;
                    match tokio::time::timeout(self.shared.limits.command_timeout, self.share.take(need)).await {
                        Ok(h) => h,
                        Err(_) => {
                            let reply = Reply::Error(
                                "OOM the gateway's memory budget is spent: retry (its reply could not be reserved in time)"
                                    .into(),
                            );
                            record(self.shared, &name, &reply, Instant::now());
                            self.emit(reply);
                            continue;
                        }
                    }
                }
            };
            match additive {
                Some(d) => {
                    adds.insert(args[1].clone(), group.len());
                    if let Some(r) = region_of(&args[1]) {
                        add_regions.insert(r, group.len());
                    }
                    group.push(Entry::Add { adds: vec![(args[1].clone(), vec![d])], order: vec![(0, name)] });
                }
                None if plain_set => {
                    if let Some(r) = region_of(&args[1]) {
                        puts.insert(r, group.len());
                    }
                    let bytes = args[1].len() + args[2].len();
                    group.push(Entry::Puts { kvs: vec![key_value(args)], bytes });
                }
                None => group.push(Entry::Run { args, room: held.bytes() }),
            }
            self.held.push(held);
            match t {
                Touches::Everything => {
                    self.run_group(std::mem::take(&mut group)).await;
                    adds.clear();
                    add_regions.clear();
                    puts.clear();
                }
                Touches::Keys(keys) => touched.extend(keys),
                Touches::Nothing | Touches::Connection => {}
            }
        }
        self.run_group(group).await;
        Ok(())
    }

    /// Answers `GET key` if the device in this process answers it at once (linearizable, not in
    /// a transaction, allowed, its reply reserved): the reply is encoded straight into the
    /// output and true returned. Otherwise nothing is done (the general path runs the command).
    fn get_now(&mut self, key: &[u8]) -> bool {
        if !self.shared.up.client().has_local()
            || self.state.multi.is_some()
            || self.state.consistency() != dpukv_proto::Consistency::Linearizable
        {
            return false;
        }
        // Refused (no token, or the key not granted): the general path answers why.
        if self.shared.access.required()
            && !self.state.caller.as_ref().is_some_and(|p| p.may(crate::auth::Perm::Read, key))
        {
            return false;
        }
        let Some(held) = self.share.try_take(command::get_bound(key).min(self.room())) else { return false };
        let started = Instant::now();
        // The value is appended to the output by the device, then framed where it lies.
        let mark = self.out.len();
        let Some(r) = self.shared.up.client().get_now_into(key, &mut self.out) else { return false };
        match r {
            Ok(found) => {
                if self.state.reply == ReplyMode::On {
                    frame::frame_bulk(&mut self.out, mark, found.is_some());
                } else {
                    self.out.truncate(mark);
                    self.emit(Reply::Nil); // suppressed (or the skip used up): nothing is written
                }
                let took = started.elapsed();
                self.shared.metrics.observe_resp_get(took.as_secs_f64());
                if took > SLOW_GET_NOW {
                    tracing::warn!(?took, "a get answered at once was slow (this thread's connections waited)");
                }
            }
            Err(e) => {
                let reply = command::error_reply(e);
                record(self.shared, "get", &reply, started);
                self.emit(reply);
            }
        }
        self.held.push(held);
        true
    }

    /// Runs a group's commands concurrently; appends their replies in order.
    async fn run_group(&mut self, group: Vec<Entry>) {
        if group.is_empty() {
            return;
        }
        let shared = self.shared;
        let consistency = self.state.consistency();
        // Gets the device in this process answers at once (an embedded front door) are
        // answered here, without a task each; the rest run concurrently below.
        let client = if consistency == dpukv_proto::Consistency::Linearizable {
            std::borrow::Cow::Borrowed(shared.up.client())
        } else {
            std::borrow::Cow::Owned(shared.up.client().clone().with_consistency(consistency))
        };
        let group: Vec<Entry> = group
            .into_iter()
            .map(|e| match e {
                Entry::Run { args, room } if args.len() == 2 && args[0].eq_ignore_ascii_case(b"get") => {
                    match client.get_now(&args[1]) {
                        Some(r) => Entry::Answer {
                            name: "get".into(),
                            reply: r.map_or_else(command::error_reply, command::bulk_or_nil),
                        },
                        None => Entry::Run { args, room },
                    }
                }
                e => e,
            })
            .collect();
        // INFO's text, only when a command asks for it.
        let info =
            if group.iter().any(|e| matches!(e, Entry::Run { args, .. } if args[0].eq_ignore_ascii_case(b"info"))) {
                info(shared)
            } else {
                String::new()
            };
        // Where each position's reply comes from: its own entry, or the run it joined.
        let from: Vec<usize> =
            group.iter().enumerate().map(|(i, e)| if let Entry::Joined { to } = e { *to } else { i }).collect();
        let futs: Vec<_> = group
            .into_iter()
            .map(|e| {
                let info = info.as_str();
                async move {
                    let started = Instant::now();
                    let one = |name, r| std::collections::VecDeque::from([(name, r, started)]);
                    match e {
                        Entry::Answer { name, reply } => one(name, reply),
                        Entry::Joined { .. } => std::collections::VecDeque::new(),
                        Entry::Run { args, room } => {
                            let name = command::name(&args);
                            // Each command starts a trace (sampled as the exporter's sampler says).
                            let op = op_label(&name);
                            let traced = dpukv_net::telemetry::request_span("gateway redis", op, None, true);
                            let (_span, ctx) = traced.map_or((None, None), |(s, c)| (Some(s), Some(c)));
                            let run = command::run(&shared.up, &shared.cursors, info, args, consistency, room);
                            let r = dpukv_client::trace::scope(ctx, run).await;
                            one(name, r)
                        }
                        Entry::Add { adds, order } => {
                            let op = op_label(&order[0].1);
                            let traced = dpukv_net::telemetry::request_span("gateway redis", op, None, true);
                            let (_span, ctx) = traced.map_or((None, None), |(s, c)| (Some(s), Some(c)));
                            let replies = dpukv_client::trace::scope(ctx, command::add(&shared.up, &adds)).await;
                            // Key by key as applied; answered in the order sent.
                            let mut per_key: Vec<std::collections::VecDeque<Reply>> =
                                replies.into_iter().map(Into::into).collect();
                            order
                                .into_iter()
                                .map(|(i, n)| {
                                    let r = per_key[i].pop_front().unwrap_or_else(|| Reply::err("no reply"));
                                    (n, r, started)
                                })
                                .collect()
                        }
                        Entry::Puts { kvs, .. } => {
                            let traced = dpukv_net::telemetry::request_span("gateway redis", "set", None, true);
                            let (_span, ctx) = traced.map_or((None, None), |(s, c)| (Some(s), Some(c)));
                            let replies = dpukv_client::trace::scope(ctx, command::puts(&shared.up, &kvs)).await;
                            replies.into_iter().map(|r| ("set".to_string(), r, started)).collect()
                        }
                    }
                }
            })
            .collect();
        let mut results = crate::join::join_all(futs).await;
        for i in from {
            let (name, r, started) =
                results[i].pop_front().unwrap_or_else(|| ("incr".into(), Reply::err("no reply"), Instant::now()));
            record(shared, &name, &r, started);
            self.emit(r);
        }
    }

    /// `AUTH [user] token`: the user, if given, must be the token's name (or `default`).
    /// Failures are throttled per peer address, and end the connection after a few.
    fn authenticate(&mut self, user: Option<&Vec<u8>>, token: &[u8]) -> Reply {
        let shared = self.shared;
        if !shared.access.required() {
            return Reply::err(
                "AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?",
            );
        }
        if let Err(wait) = shared.throttle.check(self.peer) {
            return Reply::err(format!(
                "too many failed authentications from this address: retry in {} s",
                wait.as_secs().max(1)
            ));
        }
        match shared.access.authenticate(token) {
            Some(p) if user.is_none_or(|u| u.as_slice() == b"default" || u.as_slice() == p.name.as_bytes()) => {
                self.state.caller = Some(p);
                Reply::Simple("OK")
            }
            _ => {
                shared.throttle.failed(self.peer);
                self.state.auth_failures += 1;
                if self.state.auth_failures >= crate::throttle::PER_CONNECTION {
                    self.state.close = true;
                }
                Reply::Error("WRONGPASS invalid username-password pair or user is disabled.".into())
            }
        }
    }

    /// `AUTH`, `HELLO`, `QUIT`, `SELECT`, `CLIENT`, `RESET`, the read modes, and `MULTI`,
    /// `EXEC`, `DISCARD`, `WATCH`, `UNWATCH`. `None`: no reply (`CLIENT REPLY OFF|SKIP`).
    async fn connection_command(&mut self, args: &[Vec<u8>]) -> Option<Reply> {
        let n = args.len();
        let name = command::name(args);
        if !self.authenticated() && !matches!(name.as_str(), "auth" | "hello" | "quit" | "reset") {
            return Some(noauth());
        }
        if name == "reset" {
            // The token is forgotten: the connection has `--auth-timeout` again to present one.
            self.state = ConnState::default();
            self.unauthenticated_since = tokio::time::Instant::now();
            return Some(Reply::Simple("RESET"));
        }
        let state = &mut self.state;
        Some(match name.as_str() {
            "quit" => {
                state.quit = true;
                Reply::Simple("OK")
            }
            // Redis Cluster's replica reads: READONLY lets gets go to replicas (here: spread over
            // the primary and the hot keys' replicas), READWRITE back to the primary only.
            "readonly" if n == 1 => {
                state.consistency = Some(dpukv_proto::Consistency::Interleaved);
                Reply::Simple("OK")
            }
            "readwrite" if n == 1 => {
                state.consistency = Some(dpukv_proto::Consistency::Linearizable);
                Reply::Simple("OK")
            }
            // CONSISTENCY [linearizable | bounded:MS | extended | interleaved]: sets (or shows) how
            // this connection's gets are served.
            "consistency" if n == 1 => Reply::Bulk(state.consistency().name().into_bytes()),
            "consistency" if n == 2 => match dpukv_proto::Consistency::parse(&String::from_utf8_lossy(&args[1])) {
                Some(c) => {
                    state.consistency = Some(c);
                    Reply::Simple("OK")
                }
                None => Reply::err(format!("consistency must be {}", dpukv_proto::Consistency::SPELLINGS)),
            },
            "select" if n == 2 => match args[1].as_slice() {
                b"0" => Reply::Simple("OK"),
                _ => Reply::err("DB index is out of range"),
            },
            "auth" if n == 2 || n == 3 => self.authenticate(args.get(n - 2).filter(|_| n == 3), &args[n - 1]),
            "hello" => {
                if let Some(v) = args.get(1)
                    && v.as_slice() != b"2"
                {
                    return Some(Reply::Error("NOPROTO sorry, this protocol version is not supported".into()));
                }
                // HELLO 2 AUTH user password [SETNAME name]
                if let Some(i) = args.iter().position(|a| a.eq_ignore_ascii_case(b"auth")) {
                    let (Some(user), Some(password)) = (args.get(i + 1), args.get(i + 2)) else {
                        return Some(Reply::err("syntax error in HELLO option 'auth'"));
                    };
                    if let r @ Reply::Error(_) = self.authenticate(Some(user), password) {
                        return Some(r);
                    }
                } else if !self.authenticated() {
                    return Some(noauth());
                }
                if let Some(i) = args.iter().position(|a| a.eq_ignore_ascii_case(b"setname")) {
                    let Some(name) = args.get(i + 1) else {
                        return Some(Reply::err("syntax error in HELLO option 'setname'"));
                    };
                    match client_name(name) {
                        Ok(name) => self.state.name = name,
                        Err(r) => return Some(r),
                    }
                }
                let s = |x: &str| Reply::Bulk(x.as_bytes().to_vec());
                Reply::Array(vec![
                    s("server"),
                    s("dpukv"),
                    s("version"),
                    s(env!("CARGO_PKG_VERSION")),
                    s("proto"),
                    Reply::Integer(2),
                    s("id"),
                    Reply::Integer(self.id as i64),
                    s("mode"),
                    s("standalone"),
                    s("role"),
                    s("master"),
                    s("modules"),
                    Reply::Array(Vec::new()),
                ])
            }
            // CLIENT REPLY ON|OFF|SKIP: OFF answers nothing until ON, SKIP skips the next
            // command's answer; neither is answered itself (as in Redis).
            "client" if n == 3 && args[1].eq_ignore_ascii_case(b"reply") => {
                match args[2].to_ascii_lowercase().as_slice() {
                    b"on" => {
                        state.reply = ReplyMode::On;
                        Reply::Simple("OK")
                    }
                    b"off" => {
                        state.reply = ReplyMode::Off;
                        return None;
                    }
                    b"skip" => {
                        // Under OFF nothing is answered anyway.
                        if state.reply == ReplyMode::On {
                            state.reply = ReplyMode::Skip;
                        }
                        return None;
                    }
                    _ => Reply::err("syntax error"),
                }
            }
            "client" => match args.get(1).map(|a| a.to_ascii_lowercase()).as_deref() {
                Some(b"setname") if n == 3 => match client_name(&args[2]) {
                    Ok(name) => {
                        state.name = name;
                        Reply::Simple("OK")
                    }
                    Err(r) => r,
                },
                Some(b"setinfo" | b"no-evict" | b"no-touch") => Reply::Simple("OK"),
                Some(b"getname") if n == 2 => state.name.clone().map_or(Reply::Nil, Reply::Bulk),
                Some(b"id") if n == 2 => Reply::Integer(self.id as i64),
                Some(b"setname" | b"getname" | b"id") => Reply::err(format!(
                    "wrong number of arguments for 'client|{}' command",
                    String::from_utf8_lossy(&args[1]).to_ascii_lowercase()
                )),
                _ => Reply::err("unknown CLIENT subcommand"),
            },
            "multi" | "exec" | "discard" | "watch" | "unwatch" => return Some(self.transaction(&name, args).await),
            other => Reply::err(format!("wrong number of arguments for '{other}' command")),
        })
    }
}

/// After an error reply to a connection being closed: shuts the write side and reads (and
/// drops) what the client still sends for a moment (1 s, 1 MiB at most), so that closing with
/// unread input does not reset the connection before the client reads the reply.
pub(crate) async fn linger<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(stream: &mut S) {
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
    let mut scratch = vec![0u8; 16 << 10];
    let mut left = 1usize << 20;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while left > 0 {
            match stream.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

/// The metric label of a command (a fixed set: unknown names are `other`).
fn op_label(name: &str) -> &'static str {
    command::COMMANDS.iter().copied().find(|c| *c == name).unwrap_or("other")
}

fn record(shared: &Shared, name: &str, r: &Reply, started: Instant) {
    let op = op_label(name);
    if let Reply::Error(e) = r {
        let code = match e.split(' ').next() {
            Some("TRYAGAIN") => "unavailable",
            Some("WRONGTYPE") => "type_mismatch",
            Some("NOAUTH") | Some("WRONGPASS") => "unauthorized",
            Some("NOPERM") => "forbidden",
            Some("OOM") => "overloaded",
            _ => "error",
        };
        shared.metrics.error("resp", code);
    }
    shared.metrics.observe("resp", op, started);
}

/// `INFO`'s text.
fn info(shared: &Shared) -> String {
    format!(
        "# Server\r\nredis_version:7.0.0\r\ndpukv_version:{}\r\nredis_mode:standalone\r\nos:{}\r\narch_bits:64\r\n\
         tcp_port:{}\r\n\r\n# Clients\r\nmaxclients:{}\r\n\r\n# Persistence\r\nloading:0\r\naof_enabled:0\r\n\r\n\
         # Replication\r\nrole:master\r\n\r\n# Keyspace\r\n",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::OS,
        shared.port,
        shared.limits.max_connections
    )
}

fn noauth() -> Reply {
    Reply::Error("NOAUTH Authentication required.".into())
}

fn noperm() -> Reply {
    Reply::Error("NOPERM this user has no permissions to access one of the keys used as arguments".into())
}
