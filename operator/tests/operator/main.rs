//! The operator's suite: the generated CRD and its rules (`crd`), and the reconciler against a
//! mock API server (`reconcile`).

mod crd;
mod lease;
mod reconcile;
