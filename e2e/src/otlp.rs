//! An OTLP trace receiver for tests: the OpenTelemetry collector's gRPC `TraceService` (the
//! protocol the processes export with, from `opentelemetry-proto`) on a free loopback port,
//! keeping what it receives — service, name, ids — for assertions. No collector binary can be
//! installed here, so this stands in for one; it speaks the real protocol. Keeps at most
//! [`MAX_SPANS`] spans (later ones are dropped).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

/// The most spans kept.
pub const MAX_SPANS: usize = 100_000;

/// One span as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedSpan {
    /// The exporting process's `service.name`.
    pub service: String,
    /// The span's name.
    pub name: String,
    /// Its trace (16 bytes).
    pub trace_id: Vec<u8>,
    /// Its id (8 bytes).
    pub span_id: Vec<u8>,
    /// Its parent's id (empty for a root).
    pub parent_span_id: Vec<u8>,
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<ReceivedSpan>>>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> std::result::Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                if kept.len() < MAX_SPANS {
                    kept.push(ReceivedSpan {
                        service: service.clone(),
                        name: span.name,
                        trace_id: span.trace_id,
                        span_id: span.span_id,
                        parent_span_id: span.parent_span_id,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// A running receiver; stopped when dropped.
pub struct Collector {
    /// Its endpoint, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    spans: Sink,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Collector {
    /// Starts one on a free loopback port.
    pub fn start() -> Result<Collector> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let spans = Sink::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let service = TraceServiceServer::new(spans.clone());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let thread = std::thread::Builder::new().name("otlp-collector".into()).spawn(move || {
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                let _ = tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, async {
                        let _ = stopped.await;
                    })
                    .await;
            })
        })?;
        Ok(Collector { endpoint: format!("http://{addr}"), spans, stop: Some(stop), thread: Some(thread) })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits (up to `timeout`) until `done` holds for the spans received; returns them.
    pub fn wait_for(&self, timeout: Duration, done: impl Fn(&[ReceivedSpan]) -> bool) -> Result<Vec<ReceivedSpan>> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return Ok(spans);
            }
            if Instant::now() > deadline {
                return Err(anyhow::anyhow!("the spans expected did not arrive within {timeout:?}")).context(
                    spans.iter().map(|s| format!("{} {:?}", s.service, s.name)).collect::<Vec<_>>().join(", "),
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
