//! `MULTI` ... `EXEC` (what redis-py's default pipeline sends), `DISCARD`, `WATCH`, `UNWATCH`.
//!
//! A transaction runs as **one atomic batch** (the binary protocol's `batch`, all or nothing,
//! at one version): so only plain writes may be queued — `SET key value` (no options) and
//! `MSET` — and their keys must lie in one region. Anything else queued (a read, `INCR`, `SET
//! ... NX`, ...) is answered with an error at once and makes `EXEC` answer `EXECABORT`, as Redis
//! does for a command refused while queueing: a read or a read-modify-write inside a
//! transaction would need the values *at* the batch's version, which a batch cannot answer, so
//! running it would not be the isolation Redis promises. Keys spanning regions make `EXEC`
//! answer an error with nothing applied. `WATCH` is refused (no optimistic locking);
//! `UNWATCH` is accepted (nothing is watched).
//!
//! Bounds: a transaction holds at most `MAX_BATCH_OPS` writes, and its queued bytes are
//! charged to the connection's share until `EXEC` or `DISCARD`.

use dpukv_proto::{ErrorCode, WriteOp};

use super::frame::Reply;
use super::{Session, command, noperm};
use crate::budget::Held;

/// A transaction being queued.
#[derive(Default)]
pub(super) struct Multi {
    /// The writes queued, in order.
    ops: Vec<WriteOp>,
    /// Commands queued (each answered `OK` by `EXEC`).
    commands: usize,
    /// A command was refused while queueing: `EXEC` answers `EXECABORT`.
    failed: bool,
    /// The queued bytes, charged to the connection's share.
    held: Held,
}

/// Aborts the transaction (`EXEC` will answer `EXECABORT`) and answers `r`.
fn fail(m: &mut Multi, r: Reply) -> Reply {
    m.failed = true;
    r
}

/// Whether `name` acts on the transaction itself (run, not queued, inside `MULTI`).
pub(super) fn controls(name: &str) -> bool {
    matches!(name, "exec" | "discard" | "multi" | "watch" | "unwatch" | "quit" | "reset")
}

impl Session<'_> {
    /// Queues `args` into the open transaction: `QUEUED`, or an error that aborts it.
    pub(super) fn queue(&mut self, args: &[Vec<u8>]) -> Reply {
        let refusal = self.refusal(args);
        let share = &self.share;
        let Some(m) = self.state.multi.as_mut() else { return Reply::err("no transaction") };
        if let Some(r) = refusal {
            return fail(m, r);
        }
        let n = args.len();
        let ops: Vec<WriteOp> = match command::name(args).as_str() {
            "set" if n == 3 => vec![WriteOp::Put { key: args[1].clone(), value: args[2].clone() }],
            "mset" if n >= 3 && n % 2 == 1 => {
                args[1..].chunks(2).map(|kv| WriteOp::Put { key: kv[0].clone(), value: kv[1].clone() }).collect()
            }
            _ => {
                return fail(
                    m,
                    Reply::err(
                        "only SET key value and MSET may run inside MULTI on dpukv (a transaction is one atomic batch of writes within one region)",
                    ),
                );
            }
        };
        if m.ops.len() + ops.len() > dpukv_proto::limits::MAX_BATCH_OPS {
            return fail(
                m,
                Reply::err(format!("a transaction holds at most {} writes", dpukv_proto::limits::MAX_BATCH_OPS)),
            );
        }
        let bytes = 64 + args.iter().map(|a| a.len() + 16).sum::<usize>();
        match share.try_take(bytes) {
            Some(h) => m.held.merge(h),
            None => return fail(m, Reply::err("the transaction is larger than this connection may hold")),
        }
        m.ops.extend(ops);
        m.commands += 1;
        Reply::Simple("QUEUED")
    }

    /// `MULTI`, `EXEC`, `DISCARD`, `WATCH`, `UNWATCH`.
    pub(super) async fn transaction(&mut self, name: &str, args: &[Vec<u8>]) -> Reply {
        match name {
            "multi" if args.len() == 1 => {
                if self.state.multi.is_some() {
                    return Reply::err("MULTI calls can not be nested");
                }
                self.state.multi = Some(Multi::default());
                Reply::Simple("OK")
            }
            "discard" if args.len() == 1 => match self.state.multi.take() {
                Some(_) => Reply::Simple("OK"),
                None => Reply::err("DISCARD without MULTI"),
            },
            "unwatch" if args.len() == 1 => Reply::Simple("OK"),
            "watch" if self.state.multi.is_some() => Reply::err("WATCH inside MULTI is not allowed"),
            "watch" => Reply::err("WATCH is not supported by dpukv (MULTI/EXEC runs as one atomic batch)"),
            "exec" if args.len() == 1 => {
                let Some(m) = self.state.multi.take() else { return Reply::err("EXEC without MULTI") };
                if m.failed {
                    return Reply::Error("EXECABORT Transaction discarded because of previous errors.".into());
                }
                // Checked again at EXEC: the token may have changed meanwhile.
                if let Some(p) = &self.state.caller
                    && !m.ops.iter().all(|o| p.may(crate::auth::Perm::Write, WriteOp::key(o)))
                {
                    return noperm();
                }
                if m.ops.is_empty() {
                    return Reply::Array(Vec::new());
                }
                match self.shared.up.client().batch(m.ops).await {
                    Ok(_) => Reply::Array((0..m.commands).map(|_| Reply::Simple("OK")).collect()),
                    Err(e) if e.code() == Some(ErrorCode::WrongRegion) => Reply::err(
                        "the transaction's keys span regions of the cluster: nothing was applied (MULTI/EXEC runs as one atomic batch, which stays within one region)",
                    ),
                    Err(e) => command::error_reply(e),
                }
            }
            other => Reply::err(format!("wrong number of arguments for '{other}' command")),
        }
    }
}
