//! dpukv-net: how dpukv's servers hold their connections (docs/architecture.md). It sits on
//! `dpukv-proto` (the wire format) and under every process that accepts binary-protocol
//! connections — the device's data port, the host's link, the gateway's binary front end — so
//! that each one bounds what a peer can make it hold in the same way.
//!
//! # Layout
//! - `conn`: serving one binary-protocol connection within byte budgets, an in-flight cap and
//!   timeouts; responses go back through a [`conn::Sink`] from any thread; the flags that set
//!   those limits.
//! - `identity`: who a peer is (`spiffe://dpukv/<namespace>/<cluster>/<role>/<id>` in its
//!   certificate) and what its role lets it do: typed refusals (`unauthorized`, `forbidden`).
//! - `latency`: request latency per operation as a Prometheus histogram, recorded by `conn`.
//! - `process`: shutdown on signals, as every server binary starts; children that die with
//!   their supervisor (`dpukv local`).
//! - `ports`: ports on 127.0.0.1 reserved machine-wide (outside the kernel's ephemeral range,
//!   by a lock held for the process's life) for the processes `dpukv local` and the test suites
//!   start.
//! - `socket`: bounded liveness of long-lived TCP connections (keep-alive probes and
//!   `TCP_USER_TIMEOUT`): a vanished peer costs seconds, not the kernel's ~15 minutes.
//! - `telemetry`: logs, and traces exported over OTLP (feature `otel`): a span per traced
//!   request, joined to the trace its request carries.
//! - `tls`: TLS for async and blocking connections, mutual TLS, certificates re-read when
//!   their files change; [`tls::Stream`], one type for TCP and libfabric connections
//!   (`dpukv-fabric`), plain or TLS.
//!
//! # Invariants
//! - Bytes are charged to the connection's and the process's budgets before they are allocated;
//!   every queue behind a connection is bounded by its in-flight cap.
//! - A request id is unique among a connection's requests in flight.
//! - A TLS listener never serves a plain connection, and a listener with client authentication
//!   never one without a certificate its CA signed.
//! - A peer is a member of a cluster only by a certificate its CA signed whose URI SAN names
//!   the same namespace and cluster as the server's own certificate.

/// The libfabric transport ([`fabric::FabricStream`]): [`tls::Stream`] carries it beside TCP.
pub use dpukv_fabric as fabric;

pub mod conn;
pub mod identity;
pub mod latency;
pub mod ports;
pub mod process;
pub mod socket;
pub mod telemetry;
pub mod tls;
