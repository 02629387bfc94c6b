//! The operator's suite: the generated CRD and its rules (`crd`), the reconciler (`reconcile`)
//! and leader election (`lease`) against a mock API server, and the RBAC the chart grants
//! (`rbac`; every request those tests see is checked against it by `calls`).

mod calls;
mod crd;
mod etcd_tls;
mod lease;
mod rbac;
mod reconcile;
