//! Polling many futures in one task: their outputs in order. The gateway answers a client's frame
//! (or a RESP pipeline) this way rather than with a task per request — the requests bound for one
//! device then reach its connection's queue together and leave in one frame, and the answers go
//! back together, with one system call each way instead of one per request.

/// Polls `futs` together; their outputs in order.
pub async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<std::pin::Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut done: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futs.iter_mut().zip(done.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    done.into_iter().map(|o| o.expect("every future finished")).collect()
}
