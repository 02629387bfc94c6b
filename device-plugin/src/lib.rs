//! dpukv-device-plugin: the kubelet device plugin that advertises DPUs to Kubernetes as the
//! `dpukv.io/dpu` resource (docs/device-plugin.md), so the device container of a node pod is
//! scheduled where a DPU is and given it. Without DPUs, `--emulated N` offers N virtual devices
//! (clusters whose node pods run the device emulator but still want the scheduling).
//!
//! It speaks the kubelet's device plugin API v1beta1 (gRPC over unix sockets; the `.proto` is
//! vendored and generated at build time), depends only on `dpukv-net` (how a process starts: logs,
//! shutdown on signals), and nothing depends on it but the chart's DaemonSet.
//!
//! # Layout
//! - `api`: the generated API.
//! - `sysfs`: finding PCI functions by vendor:device under a sysfs root; emulated devices.
//! - `plugin`: the `DevicePlugin` service: inventory and health, `ListAndWatch`, allocation.
//! - `kubelet`: the gRPC channel over a unix socket; `Register`.
//! - `runner`: serving, registering, re-registering after a kubelet restart, clean shutdown.
//! - `metrics`: Prometheus metrics, `/metrics` and `/healthz`.
//!
//! # Invariants
//! - A device once offered stays in the list, `Unhealthy` while it is missing: the kubelet is
//!   never told a device vanished silently, and never allocates an unhealthy one (refused).
//! - The plugin's socket exists only while it serves; a kubelet restart is followed by a new
//!   socket and a new registration.
//! - Memory is bounded: at most `plugin::MAX_DEVICES` devices, `plugin::STREAM_QUEUE` lists
//!   queued per stream.

pub mod api;
pub mod kubelet;
pub mod metrics;
pub mod plugin;
pub mod runner;
pub mod sysfs;
