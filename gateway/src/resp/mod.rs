//! The Redis protocol (RESP 2) front end, so that `redis-cli`, `redis-benchmark` and Redis
//! client libraries work unchanged (docs/gateway.md).
//!
//! A connection reads what the client sent, takes every complete command from it (at most
//! `max_pipeline` at a time), runs them, and writes their replies in order. Pipelined commands
//! on disjoint keys run concurrently; a command on a key already touched in the group waits for
//! the group (so commands on one key apply in the order sent — unlike Redis, pipelined commands
//! on *different* keys may apply in any order; each is linearizable). Unknown commands are
//! answered with an error, never by closing the connection; only bytes that are not RESP (or
//! exceed the limits) close it, after an error reply.
//!
//! # Layout
//! - `frame`: parsing commands and encoding replies.
//! - `command`: the commands.
//! - `cursors`: `SCAN` cursors.
//! - `pattern`: `MATCH` globs.
//!
//! Bounds: a connection's read buffer holds at most one command beyond what it has taken (16
//! MiB); each command reserves its largest reply from the gateway's memory budget before it
//! runs, and the reservation is given back once its reply is written; connections are capped.

mod command;
pub mod cursors;
pub mod frame;
mod pattern;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dpukv_net::conn::Budget;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::{Access, Principal};
use crate::metrics::Metrics;
use crate::upstream::Upstream;
use command::Touches;
use cursors::Cursors;
use frame::{Limits, ParseError, Reply, parse_command};

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
}

/// What every connection shares.
pub struct Shared {
    /// The cluster.
    pub up: Arc<Upstream>,
    /// Who may do what.
    pub access: Access,
    /// Limits.
    pub limits: RespLimits,
    /// The process's memory budget (replies reserve from it).
    pub budget: Budget,
    /// `SCAN` cursors.
    pub cursors: Cursors,
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
        let Ok((stream, _)) = accepted else { continue };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // Redis's own answer when its client limit is reached.
            let mut s = stream;
            let _ =
                tokio::time::timeout(Duration::from_secs(1), s.write_all(b"-ERR max number of clients reached\r\n"))
                    .await;
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
            if let Err(e) = connection(stream, &shared, stop).await {
                tracing::debug!(error = %e, "RESP connection ended");
            }
            drop(permit);
        });
    }
}

/// A connection's own state.
#[derive(Default)]
struct ConnState {
    quit: bool,
    /// Who authenticated (`AUTH`), if anyone.
    caller: Option<Arc<Principal>>,
    /// How gets are served, if the connection chose (`CONSISTENCY`, `READONLY`, `READWRITE`);
    /// else the token's service level, else linearizable.
    consistency: Option<dpukv_proto::Consistency>,
}

impl ConnState {
    fn consistency(&self) -> dpukv_proto::Consistency {
        self.consistency.or_else(|| self.caller.as_ref().and_then(|p| p.consistency)).unwrap_or_default()
    }
}

const READ_CHUNK: usize = 16 << 10;

async fn connection(
    mut stream: dpukv_net::tls::Stream,
    shared: &Shared,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let limits = shared.limits;
    let mut buf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut state = ConnState::default();
    let mut out = Vec::with_capacity(READ_CHUNK);
    loop {
        // Take every complete command buffered (up to the pipeline limit).
        let mut cmds = Vec::new();
        let mut used = 0;
        let mut fatal = None;
        while cmds.len() < limits.max_pipeline {
            match parse_command(&buf[used..], &limits.command) {
                Ok((args, n)) => {
                    used += n;
                    if !args.is_empty() {
                        cmds.push(args);
                    }
                }
                Err(ParseError::Incomplete) => break,
                Err(e) => {
                    fatal = Some(e);
                    break;
                }
            }
        }
        buf.drain(..used);
        let mut held = Vec::new();
        if !cmds.is_empty() {
            run_pipeline(shared, &mut state, cmds, &mut out, &mut held).await;
        }
        if let Some(e) = &fatal {
            Reply::Error(format!("ERR {e}")).encode(&mut out);
        }
        if !out.is_empty() {
            match tokio::time::timeout(limits.write_timeout, stream.write_all(&out)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(std::io::ErrorKind::TimedOut.into()),
            }
            out.clear();
            drop(held);
            if out.capacity() > 4 * READ_CHUNK {
                out = Vec::with_capacity(READ_CHUNK);
            }
        }
        if fatal.is_some() || state.quit {
            return Ok(());
        }
        if cmds_pending(&buf, &limits.command) {
            continue; // more commands are buffered (the pipeline limit stopped the taking)
        }
        // Read more (a command is never larger than the limit, checked by the parser).
        if buf.capacity() - buf.len() < READ_CHUNK {
            buf.reserve(READ_CHUNK);
        }
        let got = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            got = tokio::time::timeout(limits.idle_timeout, stream.read_buf(&mut buf)) => got,
        };
        match got {
            Err(_) => return Ok(()), // idle
            Ok(Ok(0)) => return Ok(()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
        }
        if buf.is_empty() && buf.capacity() > 4 * READ_CHUNK {
            buf = Vec::with_capacity(READ_CHUNK);
        }
    }
}

/// Whether a complete command is buffered.
fn cmds_pending(buf: &[u8], limits: &Limits) -> bool {
    !matches!(parse_command(buf, limits), Err(ParseError::Incomplete))
}

/// Runs `cmds` in groups (see the module documentation) and appends their replies in order;
/// their reservations go into `held` (given back once the replies are written).
async fn run_pipeline(
    shared: &Shared,
    state: &mut ConnState,
    cmds: Vec<Vec<Vec<u8>>>,
    out: &mut Vec<u8>,
    held: &mut Vec<OwnedSemaphorePermit>,
) {
    let mut group: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut touched: std::collections::HashSet<Vec<u8>> = std::collections::HashSet::new();
    for args in cmds {
        let t = command::touches(&args);
        let conflicts = match &t {
            Touches::Nothing => false,
            Touches::Keys(keys) => keys.iter().any(|k| touched.contains(k)),
            Touches::Everything | Touches::Connection => !group.is_empty(),
        };
        if conflicts {
            run_group(shared, state, std::mem::take(&mut group), out, held).await;
            touched.clear();
        }
        match t {
            Touches::Connection => {
                let started = Instant::now();
                let name = command::name(&args);
                let r = connection_command(shared, state, &args);
                record(shared, &name, &r, started);
                r.encode(out);
                if state.quit {
                    return;
                }
            }
            Touches::Everything => {
                group.push(args);
                run_group(shared, state, std::mem::take(&mut group), out, held).await;
            }
            Touches::Keys(keys) => {
                touched.extend(keys);
                group.push(args);
            }
            Touches::Nothing => group.push(args),
        }
    }
    run_group(shared, state, group, out, held).await;
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
            _ => "error",
        };
        shared.metrics.error("resp", code);
    }
    shared.metrics.observe("resp", op, started);
}

/// Runs commands concurrently, each after reserving its largest reply from the budget; appends
/// their replies in order.
async fn run_group(
    shared: &Shared,
    state: &ConnState,
    group: Vec<Vec<Vec<u8>>>,
    out: &mut Vec<u8>,
    held: &mut Vec<OwnedSemaphorePermit>,
) {
    if group.is_empty() {
        return;
    }
    let info = info(shared);
    let (caller, consistency) = (state.caller.as_deref(), state.consistency());
    for args in &group {
        held.push(shared.budget.hold(command::reply_bound(args)).await);
    }
    let required = shared.access.required();
    let futs: Vec<_> = group
        .iter()
        .map(|args| {
            let (started, info) = (Instant::now(), info.as_str());
            // Checked before anything is read or written for the command.
            let refusal = match caller {
                None if required => Some(noauth()),
                Some(p) if required && !command::permitted(p, args) => Some(Reply::Error(
                    "NOPERM this user has no permissions to access one of the keys used as arguments".into(),
                )),
                _ => None,
            };
            async move {
                let r = match refusal {
                    Some(r) => r,
                    None => {
                        // Each command starts a trace (sampled as the exporter's sampler says).
                        let op = op_label(&command::name(args));
                        let traced = dpukv_net::telemetry::request_span("gateway redis", op, None, true);
                        let (_span, ctx) = traced.map_or((None, None), |(s, c)| (Some(s), Some(c)));
                        let run = command::run(&shared.up, &shared.cursors, info, args.clone(), consistency);
                        dpukv_client::trace::scope(ctx, run).await
                    }
                };
                (r, started)
            }
        })
        .collect();
    let results = crate::join::join_all(futs).await;
    for ((r, started), args) in results.into_iter().zip(&group) {
        record(shared, &command::name(args), &r, started);
        r.encode(out);
    }
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

/// `AUTH [user] token`: the user, if given, must be the token's name (or `default`).
fn authenticate(shared: &Shared, state: &mut ConnState, user: Option<&Vec<u8>>, token: &[u8]) -> Reply {
    if !shared.access.required() {
        return Reply::err(
            "AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?",
        );
    }
    match shared.access.authenticate(token) {
        Some(p) if user.is_none_or(|u| u.as_slice() == b"default" || u.as_slice() == p.name.as_bytes()) => {
            state.caller = Some(p);
            Reply::Simple("OK")
        }
        _ => Reply::Error("WRONGPASS invalid username-password pair or user is disabled.".into()),
    }
}

/// `AUTH`, `HELLO`, `QUIT`, `SELECT`, `CLIENT`, `RESET`.
fn connection_command(shared: &Shared, state: &mut ConnState, args: &[Vec<u8>]) -> Reply {
    let n = args.len();
    let name = command::name(args);
    if shared.access.required()
        && state.caller.is_none()
        && !matches!(name.as_str(), "auth" | "hello" | "quit" | "reset")
    {
        return noauth();
    }
    match name.as_str() {
        "quit" => {
            state.quit = true;
            Reply::Simple("OK")
        }
        "reset" => {
            *state = ConnState::default();
            Reply::Simple("RESET")
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
        "auth" if n == 2 || n == 3 => authenticate(shared, state, args.get(n - 2).filter(|_| n == 3), &args[n - 1]),
        "hello" => {
            if let Some(v) = args.get(1)
                && v.as_slice() != b"2"
            {
                return Reply::Error("NOPROTO sorry, this protocol version is not supported".into());
            }
            // HELLO 2 AUTH user password [SETNAME name]
            if let Some(i) = args.iter().position(|a| a.eq_ignore_ascii_case(b"auth")) {
                let (Some(user), Some(password)) = (args.get(i + 1), args.get(i + 2)) else {
                    return Reply::err("syntax error in HELLO option 'auth'");
                };
                if let r @ Reply::Error(_) = authenticate(shared, state, Some(user), password) {
                    return r;
                }
            } else if shared.access.required() && state.caller.is_none() {
                return noauth();
            }
            let s = |x: &str| Reply::Bulk(x.as_bytes().to_vec());
            Reply::Array(vec![
                s("server"),
                s("dpukv"),
                s("version"),
                s(env!("CARGO_PKG_VERSION")),
                s("proto"),
                Reply::Integer(2),
                s("mode"),
                s("standalone"),
                s("role"),
                s("master"),
                s("modules"),
                Reply::Array(Vec::new()),
            ])
        }
        "client" => match args.get(1).map(|a| a.to_ascii_lowercase()).as_deref() {
            Some(b"setname" | b"setinfo" | b"no-evict" | b"no-touch" | b"reply") => Reply::Simple("OK"),
            Some(b"getname") => Reply::Nil,
            Some(b"id") => Reply::Integer(1),
            _ => Reply::err("unknown CLIENT subcommand"),
        },
        other => Reply::err(format!("wrong number of arguments for '{other}' command")),
    }
}
