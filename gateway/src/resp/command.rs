//! The Redis commands the gateway answers, mapped onto dpukv's operations (docs/gateway.md has
//! the table): strings (`GET`, `SET` with `NX`/`XX`/`GET`, `SETNX`, `GETSET`, `MGET`, `MSET`,
//! `DEL`, `EXISTS`, `TYPE`, `STRLEN`), counters (`INCR`, `INCRBY`, `DECR`, `DECRBY`, on decimal
//! text as in Redis), `SCAN` in key order, and what `redis-cli` and `redis-benchmark` ask at
//! start (`PING`, `ECHO`, `INFO`, `COMMAND`, `CONFIG GET`, `TIME`). Connection commands (`AUTH`,
//! `HELLO`, `QUIT`, `SELECT`, `CLIENT`, the read modes `READONLY`, `READWRITE`, `CONSISTENCY`,
//! and the transaction's `MULTI`, `EXEC`, `DISCARD`, `WATCH`, `UNWATCH`) are the server loop's.

use dpukv_client::ClientError;
use dpukv_proto::{ErrorCode, WriteOp};

use super::cursors::{Cursors, Position};
use super::frame::Reply;
use super::pattern;
use crate::scan::ScanRequest;
use crate::upstream::Upstream;

/// What a command touches, for running a pipeline's commands concurrently: commands on disjoint
/// keys run together; a command on a key already touched in the group waits for the group.
#[derive(Debug, PartialEq, Eq)]
pub enum Touches {
    /// Nothing stored (PING, INFO, ...).
    Nothing,
    /// These keys.
    Keys(Vec<Vec<u8>>),
    /// Any key (SCAN): runs alone.
    Everything,
    /// The connection's state (AUTH, HELLO, ...): runs alone, in the server loop.
    Connection,
}

/// The command's name, lowercased.
pub fn name(args: &[Vec<u8>]) -> String {
    args.first().map(|a| String::from_utf8_lossy(a).to_ascii_lowercase()).unwrap_or_default()
}

/// What `args` touches.
pub fn touches(args: &[Vec<u8>]) -> Touches {
    let rest = || args[1..].to_vec();
    match name(args).as_str() {
        "get" | "set" | "setnx" | "getset" | "incr" | "decr" | "incrby" | "decrby" | "type" | "strlen" => {
            Touches::Keys(args.get(1).cloned().into_iter().collect())
        }
        "mget" | "del" | "exists" | "unlink" => Touches::Keys(rest()),
        "mset" => Touches::Keys(args[1..].iter().step_by(2).cloned().collect()),
        "scan" => Touches::Everything,
        "auth" | "hello" | "quit" | "select" | "client" | "reset" | "readonly" | "readwrite" | "consistency"
        | "multi" | "exec" | "discard" | "watch" | "unwatch" => Touches::Connection,
        _ => Touches::Nothing,
    }
}

/// Whether `caller` may run `args` (connection commands are not asked here): reads need `read`
/// on every key, writes `write`, and commands that answer what they found (`SETNX`, `GETSET`,
/// `DEL`'s count, counters, `SET` with `NX`/`XX`/`GET`) both; `SCAN` needs `read` on its whole
/// range (its `MATCH` prefix's).
pub fn permitted(caller: &crate::auth::Principal, args: &[Vec<u8>]) -> bool {
    use crate::auth::Perm::{Read, Write};
    let all =
        |keys: &[Vec<u8>], perms: &[crate::auth::Perm]| keys.iter().all(|k| perms.iter().all(|p| caller.may(*p, k)));
    let rest = &args[1.min(args.len())..];
    match name(args).as_str() {
        "get" | "mget" | "exists" | "type" | "strlen" => all(rest, &[Read]),
        "mset" => all(&rest.iter().step_by(2).cloned().collect::<Vec<_>>(), &[Write]),
        "set" => {
            let answers_found = args.iter().skip(3).any(|o| {
                let o = o.to_ascii_lowercase();
                o == b"nx" || o == b"xx" || o == b"get"
            });
            let key = &rest[..1.min(rest.len())];
            if answers_found { all(key, &[Read, Write]) } else { all(key, &[Write]) }
        }
        "setnx" | "getset" | "incr" | "decr" | "incrby" | "decrby" => all(&rest[..1.min(rest.len())], &[Read, Write]),
        "del" | "unlink" => all(rest, &[Read, Write]),
        "scan" => {
            let mut pattern = Vec::new();
            let mut i = 2;
            while i + 1 < args.len() {
                if args[i].eq_ignore_ascii_case(b"match") {
                    pattern = args[i + 1].clone();
                }
                i += 2;
            }
            let (lo, hi) = pattern::prefix_range(&pattern::literal_prefix(&pattern));
            caller.may_range(Read, &lo, &hi)
        }
        _ => true,
    }
}

/// What a value read costs at most (the value and its framing).
const PER_VALUE: usize = dpukv_proto::limits::MAX_VALUE + 64;

/// What a `GET key` reserves: [`reply_bound`] of it, from the key alone.
pub fn get_bound(key: &[u8]) -> usize {
    PER_VALUE + (3 + 16) + (key.len() + 16)
}

/// The most bytes `args` holds while it runs — its reply, a value it reads on the way, the
/// copies it sends — reserved from the connection's share before it runs (like the binary
/// protocol's requests). `MGET` may ask for more than a share holds: it is given what the share
/// can, and reads its keys in waves within it.
pub fn reply_bound(args: &[Vec<u8>]) -> usize {
    let sent = args.iter().map(|a| a.len() + 16).sum::<usize>();
    if plain_set(args) {
        // `+OK` or an error: a plain SET brings no value into the gateway (with `GET` it does).
        return 4096 + sent;
    }
    match name(args).as_str() {
        "get" | "getset" | "set" | "setnx" | "type" | "strlen" | "exists" | "del" | "unlink" => PER_VALUE + sent,
        // An integer or an error: `add_text` brings no value into the gateway.
        "incr" | "decr" | "incrby" | "decrby" => 4096 + sent,
        "mget" => PER_VALUE.saturating_mul(args.len().saturating_sub(1)),
        "scan" => dpukv_proto::limits::MAX_SCAN_BYTES as usize + 64 * 1024,
        _ => 4096 + sent,
    }
}

fn wrong_arity(cmd: &str) -> Reply {
    Reply::err(format!("wrong number of arguments for '{cmd}' command"))
}

/// A dpukv error as a Redis error reply.
pub fn error_reply(e: ClientError) -> Reply {
    match e.code() {
        Some(ErrorCode::KeySize) => Reply::err("key is empty or longer than 1024 bytes"),
        Some(ErrorCode::ValueTooLarge) => Reply::err("value is larger than 1 MiB (1048576 bytes)"),
        Some(ErrorCode::TypeMismatch) => {
            Reply::Error("WRONGTYPE Operation against a key holding the wrong kind of value".into())
        }
        Some(c) if c.is_retryable() || c == ErrorCode::WrongRegion => {
            Reply::Error(format!("TRYAGAIN the cluster cannot answer now ({}): retry", c.name()))
        }
        _ if e.outcome_unknown() => {
            Reply::err(format!("outcome unknown: the write may or may not have been applied ({e})"))
        }
        _ if e.is_retryable() => Reply::Error(format!("TRYAGAIN the cluster cannot be reached now ({e}): retry")),
        _ => Reply::err(e),
    }
}

/// A value as a bulk reply, none as nil.
pub(crate) fn bulk_or_nil(v: Option<Vec<u8>>) -> Reply {
    v.map_or(Reply::Nil, Reply::Bulk)
}

/// Runs a command that is not a connection command; its gets are served with `consistency`;
/// `room` is what was reserved for it (`MGET` keeps within it).
pub async fn run(
    up: &Upstream,
    cursors: &Cursors,
    info: &str,
    args: Vec<Vec<u8>>,
    consistency: dpukv_proto::Consistency,
    room: usize,
) -> Reply {
    let cmd = name(&args);
    let n = args.len();
    let with;
    let c = if consistency == dpukv_proto::Consistency::Linearizable {
        up.client()
    } else {
        with = up.client().clone().with_consistency(consistency);
        &with
    };
    match cmd.as_str() {
        "ping" => match n {
            1 => Reply::Simple("PONG"),
            2 => Reply::Bulk(args[1].clone()),
            _ => wrong_arity(&cmd),
        },
        "echo" if n == 2 => Reply::Bulk(args[1].clone()),
        "get" if n == 2 => c.get(&args[1]).await.map_or_else(error_reply, bulk_or_nil),
        "set" if n >= 3 => set(up, &args).await,
        "setnx" if n == 3 => match c.insert(&args[1], &args[2]).await {
            Ok(_) => Reply::Integer(1),
            Err(e) if e.code() == Some(ErrorCode::KeyExists) => Reply::Integer(0),
            Err(e) => error_reply(e),
        },
        "getset" if n == 3 => swap(up, &args[1], &args[2], None).await,
        "mget" if n >= 2 => mget(c, &args[1..], room).await,
        "mset" if n >= 3 && n % 2 == 1 => {
            let ops = args[1..].chunks(2).map(|kv| WriteOp::Put { key: kv[0].clone(), value: kv[1].clone() }).collect();
            match c.batch_across_regions(ops).await {
                Ok(_) => Reply::Simple("OK"),
                Err(e) => error_reply(e),
            }
        }
        "del" | "unlink" if n >= 2 => {
            // The count is of keys that existed when read just before their delete.
            let mut deleted = 0;
            for k in &args[1..] {
                match c.get(k).await {
                    Ok(None) => {}
                    Ok(Some(_)) => match c.delete(k).await {
                        Ok(_) => deleted += 1,
                        Err(e) => return error_reply(e),
                    },
                    Err(e) => return error_reply(e),
                }
            }
            Reply::Integer(deleted)
        }
        "exists" if n >= 2 => {
            let mut found = 0;
            for k in &args[1..] {
                match c.get(k).await {
                    Ok(v) => found += i64::from(v.is_some()),
                    Err(e) => return error_reply(e),
                }
            }
            Reply::Integer(found)
        }
        "type" if n == 2 => match c.get(&args[1]).await {
            Ok(Some(_)) => Reply::Simple("string"),
            Ok(None) => Reply::Simple("none"),
            Err(e) => error_reply(e),
        },
        "strlen" if n == 2 => match c.get(&args[1]).await {
            Ok(v) => Reply::Integer(v.map_or(0, |v| v.len() as i64)),
            Err(e) => error_reply(e),
        },
        "incr" | "decr" | "incrby" | "decrby" => match additive(&args) {
            Some(Ok(d)) => add(up, &[(args[1].clone(), vec![d])])
                .await
                .pop()
                .and_then(|mut r| r.pop())
                .unwrap_or_else(|| Reply::err("no reply")),
            Some(Err(reply)) => reply,
            None => wrong_arity(&cmd),
        },
        "scan" if n >= 2 => scan(up, cursors, &args).await,
        "info" => Reply::Bulk(info.as_bytes().to_vec()),
        "command" => match args.get(1).map(|a| a.to_ascii_lowercase()).as_deref() {
            Some(b"count") => Reply::Integer(COMMANDS.len() as i64),
            Some(b"info") => Reply::Array(args[2..].iter().map(|_| Reply::Nil).collect()),
            _ => Reply::Array(Vec::new()),
        },
        "config" => match args.get(1).map(|a| a.to_ascii_lowercase()).as_deref() {
            Some(b"get") if n == 3 => {
                let want = args[2].to_ascii_lowercase();
                let mut out = Vec::new();
                for (k, v) in CONFIG {
                    if pattern::matches(&want, k.as_bytes()) {
                        out.push(Reply::Bulk(k.as_bytes().to_vec()));
                        out.push(Reply::Bulk(v.as_bytes().to_vec()));
                    }
                }
                Reply::Array(out)
            }
            _ => Reply::err("only CONFIG GET is supported by dpukv"),
        },
        "time" if n == 1 => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            Reply::Array(vec![
                Reply::Bulk(now.as_secs().to_string().into_bytes()),
                Reply::Bulk(now.subsec_micros().to_string().into_bytes()),
            ])
        }
        c if COMMANDS.contains(&c) => wrong_arity(c),
        _ => {
            let shown: Vec<String> = args[1..]
                .iter()
                .take(8)
                .map(|a| format!("'{}'", String::from_utf8_lossy(&a[..a.len().min(64)])))
                .collect();
            Reply::err(format!(
                "unknown command '{}', with args beginning with: {}",
                String::from_utf8_lossy(&args[0][..args[0].len().min(64)]),
                shown.join(" ")
            ))
        }
    }
}

/// `MGET`: the keys are read concurrently, in waves that keep what is held (the values read
/// so far and those being read) within `room`; a reply that would outgrow it is an error.
async fn mget(c: &dpukv_client::Client, keys: &[Vec<u8>], room: usize) -> Reply {
    let mut out = Vec::with_capacity(keys.len());
    let mut used = 0usize;
    let mut rest = keys;
    while !rest.is_empty() {
        let wave = (room.saturating_sub(used) / PER_VALUE).min(rest.len());
        if wave == 0 {
            return Reply::err(format!(
                "MGET's reply would outgrow what this connection may hold ({room} bytes): ask for fewer keys"
            ));
        }
        let (now, later) = rest.split_at(wave);
        let tasks: Vec<_> = now
            .iter()
            .map(|k| {
                let (c, k, trace) = (c.clone(), k.clone(), dpukv_client::trace::current());
                tokio::spawn(dpukv_client::trace::scope(trace, async move { c.get(&k).await }))
            })
            .collect();
        for t in tasks {
            match t.await {
                Ok(Ok(v)) => {
                    used += 16 + v.as_ref().map_or(0, Vec::len);
                    out.push(bulk_or_nil(v));
                }
                Ok(Err(e)) => return error_reply(e),
                Err(_) => return Reply::err("a read failed"),
            }
        }
        rest = later;
    }
    Reply::Array(out)
}

/// The commands answered (for arity errors and `COMMAND COUNT`).
pub const COMMANDS: &[&str] = &[
    "ping",
    "echo",
    "get",
    "set",
    "setnx",
    "getset",
    "mget",
    "mset",
    "del",
    "unlink",
    "exists",
    "type",
    "strlen",
    "incr",
    "decr",
    "incrby",
    "decrby",
    "scan",
    "info",
    "command",
    "config",
    "time",
    "auth",
    "hello",
    "quit",
    "select",
    "client",
    "reset",
    "readonly",
    "readwrite",
    "consistency",
    "multi",
    "exec",
    "discard",
    "watch",
    "unwatch",
];

/// What `CONFIG GET` reports (what clients and `redis-benchmark` ask about).
const CONFIG: &[(&str, &str)] =
    &[("save", ""), ("appendonly", "no"), ("databases", "1"), ("maxmemory", "0"), ("maxmemory-policy", "noeviction")];

/// Compare-and-swap attempts before a contended read-modify-write gives up.
const CAS_ATTEMPTS: usize = 64;

/// `SET key value [NX|XX] [GET]` (expiry options are refused: dpukv keeps keys until deleted).
async fn set(up: &Upstream, args: &[Vec<u8>]) -> Reply {
    let (mut nx, mut xx, mut get) = (false, false, false);
    for opt in &args[3..] {
        match opt.to_ascii_lowercase().as_slice() {
            b"nx" => nx = true,
            b"xx" => xx = true,
            b"get" => get = true,
            b"ex" | b"px" | b"exat" | b"pxat" | b"keepttl" => {
                return Reply::err("expiry (EX, PX, EXAT, PXAT, KEEPTTL) is not supported by dpukv");
            }
            _ => return Reply::err("syntax error"),
        }
    }
    if nx && xx {
        return Reply::err("syntax error");
    }
    let (key, value) = (&args[1], &args[2]);
    let c = up.client();
    if get {
        return swap(
            up,
            key,
            value,
            if nx {
                Some(false)
            } else if xx {
                Some(true)
            } else {
                None
            },
        )
        .await;
    }
    let r = if nx {
        c.insert(key, value).await
    } else if xx {
        c.update(key, value).await
    } else {
        c.put(key, value).await
    };
    match r {
        Ok(_) => Reply::Simple("OK"),
        Err(e) if matches!(e.code(), Some(ErrorCode::KeyExists | ErrorCode::KeyNotFound)) => Reply::Nil,
        Err(e) => error_reply(e),
    }
}

/// Sets `key` to `value` and answers the value it replaced (a compare-and-swap loop);
/// `must_exist`: only if the key exists (`Some(true)`) or does not (`Some(false)`).
async fn swap(up: &Upstream, key: &[u8], value: &[u8], must_exist: Option<bool>) -> Reply {
    let c = up.client();
    let mut seen = match c.get(key).await {
        Ok(v) => v,
        Err(e) => return error_reply(e),
    };
    for _ in 0..CAS_ATTEMPTS {
        if must_exist.is_some_and(|m| m != seen.is_some()) {
            return bulk_or_nil(seen);
        }
        match c.compare_and_swap(key, seen.as_deref(), value).await {
            Ok((true, _)) => return bulk_or_nil(seen),
            Ok((false, now)) => seen = now,
            Err(e) => return error_reply(e),
        }
    }
    Reply::err("too much contention on the key: retry")
}

/// For `INCR`, `DECR`, `INCRBY`, `DECRBY` with their arity: the key's delta, or the reply to a
/// delta that is not a 64-bit integer (or a `DECRBY` of the smallest one). None: not one of them.
pub fn additive(args: &[Vec<u8>]) -> Option<Result<i64, Reply>> {
    let cmd = name(args);
    // Read as Redis reads it: "+5", " 5" and "05" are not integers.
    let delta =
        |a: &[u8]| dpukv_proto::counter::parse(a).ok_or_else(|| Reply::err("value is not an integer or out of range"));
    Some(match (cmd.as_str(), args.len()) {
        ("incr", 2) => Ok(1),
        ("decr", 2) => Ok(-1),
        ("incrby", 3) => delta(&args[2]),
        ("decrby", 3) => {
            delta(&args[2]).and_then(|d| d.checked_neg().ok_or_else(|| Reply::err("decrement would overflow")))
        }
        _ => return None,
    })
}

/// Whether `args` is a plain `SET key value` (no options) a pipeline may write in one batch with
/// others of its region (see [`puts`]): a key and a value the protocol takes — one that it does
/// not is run on its own, and refused on its own.
pub fn plain_set(args: &[Vec<u8>]) -> bool {
    args.len() == 3
        && args[0].eq_ignore_ascii_case(b"set")
        && valid_key(&args[1])
        && args[2].len() <= dpukv_proto::limits::MAX_VALUE
}

/// Whether the protocol takes `key` (not empty, at most `MAX_KEY` bytes): what a command must
/// have to share a request with others.
pub fn valid_key(key: &[u8]) -> bool {
    !key.is_empty() && key.len() <= dpukv_proto::limits::MAX_KEY
}

/// Plain `SET`s of distinct keys of one region, from one pipeline group (commands a pipeline runs
/// concurrently, their order among themselves not fixed): written as one atomic batch — one
/// request, one write and one sync for all (a stronger guarantee than each on its own, and what
/// every reply waits for). A batch refused before anything was applied because the region split
/// under it (the map the group was formed by is stale) is written `SET` by `SET` instead; any
/// other failure is every `SET`'s (the batch is atomic: all were applied or none, or its outcome
/// is unknown for all). One `SET` is a put.
pub async fn puts(up: &Upstream, kvs: &[(Vec<u8>, Vec<u8>)]) -> Vec<Reply> {
    let c = up.client();
    let put = |r: Result<u64, ClientError>| r.map_or_else(error_reply, |_| Reply::Simple("OK"));
    if let [(k, v)] = kvs {
        return vec![put(c.put(k, v).await)];
    }
    let ops = kvs.iter().map(|(k, v)| WriteOp::Put { key: k.clone(), value: v.clone() }).collect();
    match c.batch(ops).await {
        Ok(_) => vec![Reply::Simple("OK"); kvs.len()],
        Err(ClientError::Server(e)) if e.code == ErrorCode::WrongRegion => {
            crate::join::join_all(kvs.iter().map(|(k, v)| async { put(c.put(k, v).await) }).collect()).await
        }
        Err(e) => vec![error_reply(e); kvs.len()],
    }
}

/// `INCRBY key delta` for each key's deltas in order, on the decimal text Redis keeps counters as
/// (an absent key counts as 0): the replies, key by key. A pipeline's increments of keys of one
/// region (see `Entry::Add`) go in one request — one `add_text` for a single key, else one
/// `add_texts` — applied by the primary in one round and made durable together
/// (docs/gateway.md). An `add_texts` refused whole before anything was applied — a key that is
/// not a counter, or keys the region no longer holds together (it split under the group's map) —
/// is sent again key by key, so each key gets its own answer.
pub async fn add(up: &Upstream, adds: &[dpukv_proto::KeyDeltas]) -> Vec<Vec<Reply>> {
    let c = up.client();
    let replies = |deltas: &[i64], r: Result<Vec<Option<i64>>, ClientError>| match r {
        Ok(results) => results
            .into_iter()
            .map(|r| r.map_or_else(|| Reply::err("increment or decrement would overflow"), Reply::Integer))
            .collect(),
        Err(e) if e.code() == Some(ErrorCode::TypeMismatch) => {
            deltas.iter().map(|_| Reply::err("value is not an integer or out of range")).collect()
        }
        Err(e) => {
            let r = error_reply(e);
            deltas.iter().map(|_| r.clone()).collect()
        }
    };
    let each = || {
        crate::join::join_all(
            adds.iter().map(|(k, d)| async { replies(d, c.add_text(k, d).await) }).collect::<Vec<_>>(),
        )
    };
    if let [(key, deltas)] = adds {
        return vec![replies(deltas, c.add_text(key, deltas).await)];
    }
    match c.add_texts(adds).await {
        Ok(results) => {
            let mut results = results.into_iter();
            adds.iter().map(|(_, d)| replies(d, Ok(results.by_ref().take(d.len()).collect()))).collect()
        }
        // Refused whole, nothing applied: a key that is not a counter, keys the region no longer
        // holds together, or a node that does not know add_texts (older) or its limits.
        Err(ClientError::Server(e))
            if matches!(
                e.code,
                ErrorCode::TypeMismatch
                    | ErrorCode::WrongRegion
                    | ErrorCode::UnknownOp
                    | ErrorCode::Unsupported
                    | ErrorCode::KeySize
                    | ErrorCode::TooManyOps
                    | ErrorCode::ValueTooLarge
            ) =>
        {
            each().await
        }
        Err(e) => {
            let r = error_reply(e);
            adds.iter().map(|(_, d)| d.iter().map(|_| r.clone()).collect()).collect()
        }
    }
}

/// `SCAN cursor [MATCH pattern] [COUNT n] [TYPE string]`: keys in key order; see `cursors`.
async fn scan(up: &Upstream, cursors: &Cursors, args: &[Vec<u8>]) -> Reply {
    let Some(cursor) = std::str::from_utf8(&args[1]).ok().and_then(|s| s.parse::<u64>().ok()) else {
        return Reply::err("invalid cursor");
    };
    let (mut pattern_arg, mut count) = (None, 10usize);
    let mut i = 2;
    while i < args.len() {
        let opt = args[i].to_ascii_lowercase();
        let Some(v) = args.get(i + 1) else { return Reply::err("syntax error") };
        match opt.as_slice() {
            b"match" => pattern_arg = Some(v.clone()),
            b"count" => match std::str::from_utf8(v).ok().and_then(|s| s.parse::<usize>().ok()) {
                Some(n) if n >= 1 => count = n.min(dpukv_proto::limits::MAX_SCAN_ITEMS as usize),
                _ => return Reply::err("value is not an integer or out of range"),
            },
            // Every dpukv value is a string.
            b"type" if v.eq_ignore_ascii_case(b"string") => {}
            b"type" => return Reply::Array(vec![Reply::Bulk(b"0".to_vec()), Reply::Array(Vec::new())]),
            _ => return Reply::err("syntax error"),
        }
        i += 2;
    }
    if pattern_arg.as_ref().is_some_and(|p| p.len() > pattern::MAX_PATTERN) {
        return Reply::err(format!("MATCH patterns are at most {} bytes", pattern::MAX_PATTERN));
    }
    let pos = if cursor == 0 {
        let pattern = pattern_arg.clone().unwrap_or_default();
        let (lo, hi) = pattern::prefix_range(&pattern::literal_prefix(&pattern));
        Position { from: lo, hi, pattern }
    } else {
        match cursors.get(cursor) {
            // A MATCH given again must be the same one (as Redis requires).
            Some(p) if pattern_arg.as_ref().is_none_or(|m| *m == p.pattern) => p,
            _ => return Reply::err("invalid cursor"),
        }
    };
    // Compiled once for every key read; a pattern no key can match reads nothing.
    let glob = pattern::Glob::new(&pos.pattern);
    if !glob.can_match_a_key() {
        return Reply::Array(vec![Reply::Bulk(b"0".to_vec()), Reply::Array(Vec::new())]);
    }
    let req = ScanRequest {
        lo: pos.from.clone(),
        hi: pos.hi.clone(),
        limit: count as u32,
        max_bytes: 0,
        token: Vec::new(),
        floor: false,
        floor_min: Vec::new(),
    };
    let (items, token) = match crate::scan::run(up, req).await {
        Ok(dpukv_proto::Reply::Items { items, token }) => (items, token),
        Ok(_) => return Reply::err("unexpected scan reply"),
        Err(e) => return error_reply(ClientError::Server(e)),
    };
    let next = match dpukv_proto::ScanToken::decode(&token) {
        Some(t) => cursors.put(Position { from: dpukv_client::successor(&t.after), ..pos.clone() }),
        None => 0,
    };
    let keys =
        items.into_iter().filter(|(k, _)| glob.is_empty() || glob.matches(k)).map(|(k, _)| Reply::Bulk(k)).collect();
    Reply::Array(vec![Reply::Bulk(next.to_string().into_bytes()), Reply::Array(keys)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `INCRBY k +5` was taken as 5 (Rust's integer parser reads a `+`); Redis answers that it
    /// is not an integer, as it does for " 5" and "05".
    #[test]
    fn amounts_are_integers_as_redis_reads_them() {
        let args = |cmd: &str, n: &str| vec![cmd.as_bytes().to_vec(), b"k".to_vec(), n.as_bytes().to_vec()];
        assert!(matches!(additive(&args("incrby", "5")), Some(Ok(5))));
        assert!(matches!(additive(&args("DECRBY", "-5")), Some(Ok(5))));
        for bad in ["+5", " 5", "05", "-0", "5.0", "9223372036854775808"] {
            assert!(matches!(additive(&args("incrby", bad)), Some(Err(Reply::Error(_)))), "{bad:?}");
        }
        assert!(matches!(additive(&args("decrby", "-9223372036854775808")), Some(Err(_))), "overflow");
        assert!(matches!(additive(&[b"incr".to_vec(), b"k".to_vec()]), Some(Ok(1))));
        assert!(additive(&[b"get".to_vec(), b"k".to_vec()]).is_none());
    }
}
