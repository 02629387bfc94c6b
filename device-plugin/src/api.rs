//! The kubelet's device plugin API v1beta1, generated at build time from the vendored
//! `proto/v1beta1/api.proto` (k8s.io/kubelet, Apache 2.0): messages, the `Registration` client
//! and server, the `DevicePlugin` client and server.
#![allow(missing_docs, clippy::all)]

tonic::include_proto!("v1beta1");
