//! Logs and traces of a server process. Logs go to stderr (`RUST_LOG`, default `info`). With the
//! `otel` feature and `OTEL_EXPORTER_OTLP_ENDPOINT` set, spans of requests are also exported over
//! OTLP/gRPC (the SDK's batch processor; `OTEL_TRACES_SAMPLER`, `OTEL_BSP_SCHEDULE_DELAY` and the
//! other standard variables apply), under the process's service name.
//!
//! A request's span is made by [`request_span`]: a child of the trace context the request
//! carries (or, for a front end, a new trace). Only sampled traces get spans; without an
//! exporter nothing is made at all, so requests pay one atomic load.

use std::sync::atomic::{AtomicBool, Ordering};

use dpukv_proto::{OpCode, TraceContext};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The target of request spans (what the exporting layer takes).
pub const TRACE_TARGET: &str = "dpukv::trace";

/// Set once an exporter runs.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether request spans are made (an exporter runs).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// The process's telemetry; [`Telemetry::shutdown`] sends the spans still buffered.
pub struct Telemetry {
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// Sends what is buffered and stops exporting (call before the runtime ends).
    pub fn shutdown(self) {
        #[cfg(feature = "otel")]
        if let Some(p) = self.provider {
            EXPORTING.store(false, Ordering::Relaxed);
            if let Err(e) = p.shutdown() {
                tracing::warn!(error = %e, "flushing the last spans failed");
            }
        }
    }
}

/// Starts logging, and exporting traces as `service` when `OTEL_EXPORTER_OTLP_ENDPOINT` is set
/// (call inside the tokio runtime: the gRPC client runs on it).
pub fn init(service: &'static str) -> Telemetry {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr).with_filter(filter);
    #[cfg(feature = "otel")]
    {
        let (traces, provider, failed) = match exporter(service) {
            Ok(Some((layer, provider))) => (Some(layer), Some(provider), None),
            Ok(None) => (None, None, None),
            Err(e) => (None, None, Some(e)),
        };
        let _ = tracing_subscriber::registry().with(traces).with(logs).try_init();
        if let Some(e) = failed {
            tracing::warn!(error = %e, "OTEL_EXPORTER_OTLP_ENDPOINT is set, but the exporter did not start: no traces");
        } else if provider.is_some() {
            EXPORTING.store(true, Ordering::Relaxed);
            tracing::info!(service, "exporting traces over OTLP");
        }
        Telemetry { provider }
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = service;
        let _ = tracing_subscriber::registry().with(logs).try_init();
        Telemetry {}
    }
}

#[cfg(feature = "otel")]
type TraceLayer = Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>;

#[cfg(feature = "otel")]
fn exporter(
    service: &'static str,
) -> Result<Option<(TraceLayer, opentelemetry_sdk::trace::SdkTracerProvider)>, String> {
    use opentelemetry::trace::TracerProvider as _;
    match std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT") {
        Ok(v) if !v.trim().is_empty() => {}
        _ => return Ok(None),
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().build().map_err(|e| e.to_string())?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("dpukv");
    let only_requests = tracing_subscriber::filter::Targets::new().with_target(TRACE_TARGET, tracing::Level::INFO);
    let layer = tracing_opentelemetry::layer().with_tracer(tracer).with_filter(only_requests);
    Ok(Some((Box::new(layer), provider)))
}

/// A span for a request of `op` handled by `component` (`gateway`, `device`, `host`): a child
/// of `parent`, or with `root` the start of a new trace when there is none. Returns the span
/// (ended when dropped) and the context to send on with the request, or None when nothing is
/// traced (no exporter, an unsampled trace, no parent and not `root`).
pub fn request_span(
    component: &'static str,
    op: &'static str,
    parent: Option<&TraceContext>,
    root: bool,
) -> Option<(tracing::Span, TraceContext)> {
    if !exporting() || parent.is_some_and(|p| !p.sampled()) || (parent.is_none() && !root) {
        return None;
    }
    #[cfg(feature = "otel")]
    {
        use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let name = format!("{component} {op}");
        let span = tracing::info_span!(target: TRACE_TARGET, "request", otel.name = %name, otel.kind = "server", dpukv.op = op);
        if let Some(p) = parent {
            let remote = SpanContext::new(
                TraceId::from_bytes(p.trace_id),
                SpanId::from_bytes(p.span_id),
                TraceFlags::new(p.flags),
                true,
                TraceState::NONE,
            );
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
        }
        let cx = span.context();
        let own = cx.span().span_context().clone();
        if !own.is_valid() || !own.is_sampled() {
            return None;
        }
        let ctx = TraceContext {
            trace_id: own.trace_id().to_bytes(),
            span_id: own.span_id().to_bytes(),
            flags: own.trace_flags().to_u8(),
        };
        Some((span, ctx))
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (component, op);
        None
    }
}

/// [`request_span`] for a binary-protocol request.
pub fn op_span(
    component: &'static str,
    op: OpCode,
    parent: Option<&TraceContext>,
    root: bool,
) -> Option<(tracing::Span, TraceContext)> {
    request_span(component, op.name(), parent, root)
}
