//! The trace a caller's requests belong to: code that traces (a gateway's front end) runs its
//! calls inside [`scope`], and every request they send carries the context
//! (`Request::trace`, docs/protocol.md §4.2), so the devices' and hosts' spans join the trace. A
//! task-local: tasks spawned inside a scope start outside it unless wrapped again.

use std::future::Future;

use dpukv_proto::TraceContext;

tokio::task_local! {
    static CURRENT: Option<TraceContext>;
}

/// Runs `f` with its requests carrying `ctx` (None: none).
pub async fn scope<F: Future>(ctx: Option<TraceContext>, f: F) -> F::Output {
    CURRENT.scope(ctx, f).await
}

/// The context of the scope this task runs in, if any.
pub fn current() -> Option<TraceContext> {
    CURRENT.try_with(|c| *c).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_scope_holds_its_context_and_ends_with_it() {
        let ctx = TraceContext { trace_id: [3; 16], span_id: [4; 8], flags: 1 };
        assert_eq!(current(), None);
        assert_eq!(scope(Some(ctx), async { current() }).await, Some(ctx));
        assert_eq!(scope(None, async { current() }).await, None);
        assert_eq!(current(), None);
    }
}
