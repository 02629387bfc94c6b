//! A cluster's certificates, kept by the reconciler (docs/security.md §5), and the client
//! configuration the operator calls the nodes' control API with.
//!
//! - **Operator-issued** (no Secret named, no cert-manager issuer: the default): the Secret
//!   `NAME-ca` holds the cluster's CA (`ca.crt`, `ca.key`; `ca-previous.crt` after a renewal,
//!   trusted until it expires) and is mounted nowhere; `NAME-node-tls` holds `ca.crt` (the trust
//!   bundle) and `node-<id>.crt` / `node-<id>.key` for every node id the StatefulSet has or is
//!   about to have (written before it grows); `NAME-gateway-tls` the gateway's (`tls.crt`,
//!   `tls.key`, `ca.crt`). A managed etcd gets a CA of its own (`NAME-etcd-ca`), its members'
//!   certificate (`NAME-etcd-tls`) and the node hosts' client certificate (`NAME-etcd-client`).
//!   Each certificate is issued anew when it is missing, does not verify against the current CA,
//!   names other identities or DNS names, or has used two thirds of its life (`certs`); a
//!   Secret is written only when its content changed. The processes re-read changed files.
//! - **The user's Secrets** (`tls.clusterSecret`, `gatewaySecret`, `operatorSecret`): used as
//!   they are; the operator reads only its own (`operatorSecret`) to call the control API.
//! - **cert-manager** (`tls.certManager`): `Certificate`s per node, for the gateway and for the
//!   operator, from the issuer named; the operator copies the node ones into `NAME-node-tls` (one
//!   Secret for the StatefulSet's template, whatever its size).
//! - **Disabled**: nothing; the status says so (`Secure` False, `PlaintextOptIn`).
//!
//! The operator's own certificate (role `operator`) is made in memory from the cluster's CA and
//! kept for as long as it is good; it never leaves the process.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use time::OffsetDateTime;

use crate::certs::{self, CertError, Leaf, Pair};
use crate::crd::{DpuKvCluster, TlsSource};
use crate::render;

/// What keeping a cluster's certificates can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Issuing or reading a certificate.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// A Secret the cluster names lacks a key.
    #[error("Secret {secret} has no {key}")]
    Missing {
        /// The Secret.
        secret: String,
        /// The key.
        key: String,
    },
    /// rustls refused the operator's client configuration.
    #[error("the control API's client configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The Kubernetes API.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// What the reconcile needs of a cluster's TLS: how to call its control API, and what its
/// `Secure` condition says.
pub struct ClusterTls {
    /// The client configuration for the control API (None: plain HTTP).
    pub control: Option<Arc<rustls::ClientConfig>>,
    /// `Secure`'s status.
    pub secure: bool,
    /// Its reason.
    pub reason: &'static str,
    /// Its message.
    pub message: String,
}

/// The operator's in-memory certificates, per cluster (namespace/name): reissued when the CA
/// changes or they age.
#[derive(Default)]
pub struct OperatorCerts {
    by_cluster: Mutex<HashMap<String, (String, Pair)>>,
}

fn text(s: &Secret, key: &str) -> Option<String> {
    s.data.as_ref()?.get(key).and_then(|b| String::from_utf8(b.0.clone()).ok())
}

fn must(s: &Secret, key: &str) -> Result<String, TlsError> {
    text(s, key).ok_or_else(|| TlsError::Missing { secret: s.name_any(), key: key.into() })
}

fn owned_secret(c: &DpuKvCluster, name: &str, type_: &str, data: BTreeMap<String, String>) -> Secret {
    let mut labels = render::labels(c, "tls");
    labels.insert("dpukv.io/secret".into(), "tls".into());
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            namespace: c.namespace(),
            labels: Some(labels),
            owner_references: c.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some(type_.into()),
        data: Some(data.into_iter().map(|(k, v)| (k, ByteString(v.into_bytes()))).collect()),
        ..Default::default()
    }
}

/// Writes `want` unless the live Secret already holds exactly its data.
async fn keep(api: &Api<Secret>, live: &Option<Secret>, want: Secret) -> Result<(), TlsError> {
    if live.as_ref().is_some_and(|l| l.data == want.data && l.type_ == want.type_) {
        return Ok(());
    }
    let name = want.name_any();
    api.patch(&name, &PatchParams::apply(crate::controller::MANAGER).force(), &Patch::Apply(&want)).await?;
    Ok(())
}

/// A CA kept in `name`: the live one while good; else a new one, the old certificate kept as
/// `ca-previous.crt` (trusted until it expires). Returns the CA and the trust bundle.
async fn ca(
    api: &Api<Secret>,
    c: &DpuKvCluster,
    name: &str,
    common_name: &str,
    now: OffsetDateTime,
) -> Result<(Pair, String), TlsError> {
    let live = api.get_opt(name).await?;
    let current = live.as_ref().and_then(|s| Some(Pair { cert: text(s, "ca.crt")?, key: text(s, "ca.key")? }));
    let previous = live.as_ref().and_then(|s| text(s, "ca-previous.crt"));
    let (pair, previous) = match current {
        Some(p) if certs::ca_good(&p, now) => (p, previous),
        old => (certs::new_ca(common_name, now)?, old.map(|o| o.cert).filter(|p| certs::unexpired(p, now))),
    };
    let mut data =
        BTreeMap::from([("ca.crt".to_string(), pair.cert.clone()), ("ca.key".to_string(), pair.key.clone())]);
    if let Some(p) = previous.as_ref().filter(|p| certs::unexpired(p, now)) {
        data.insert("ca-previous.crt".into(), p.clone());
    }
    keep(api, &live, owned_secret(c, name, "Opaque", data)).await?;
    let bundle = certs::bundle(&pair.cert, previous.as_deref(), now);
    Ok((pair, bundle))
}

/// The leaves of a Secret: each kept while good, else issued anew; `ca.crt` is the bundle.
async fn leaves(
    api: &Api<Secret>,
    c: &DpuKvCluster,
    (name, type_): (&str, &str),
    (ca, bundle): (&Pair, &str),
    want: &[(String, String, Leaf)],
    now: OffsetDateTime,
) -> Result<(), TlsError> {
    let live = api.get_opt(name).await?;
    let mut data = BTreeMap::from([("ca.crt".to_string(), bundle.to_string())]);
    for (cert_key, key_key, leaf) in want {
        let old = live.as_ref().and_then(|s| Some(Pair { cert: text(s, cert_key)?, key: text(s, key_key)? }));
        let pair = match old {
            Some(p) if certs::leaf_good(&p, &ca.cert, leaf, now) => p,
            _ => certs::issue(ca, leaf, now)?,
        };
        data.insert(cert_key.clone(), pair.cert);
        data.insert(key_key.clone(), pair.key);
    }
    keep(api, &live, owned_secret(c, name, type_, data)).await
}

fn ns(c: &DpuKvCluster) -> String {
    c.namespace().unwrap_or_else(|| "default".into())
}

/// The DNS names of a Service `svc` in the cluster's namespace (short to fully qualified).
fn service_names(c: &DpuKvCluster, svc: &str) -> Vec<String> {
    let ns = ns(c);
    vec![svc.to_string(), format!("{svc}.{ns}"), format!("{svc}.{ns}.svc"), format!("{svc}.{ns}.svc.cluster.local")]
}

/// Node `id`'s certificate: its identity, and the names its pod is dialled at (device,
/// replication, control API), plus `localhost` for tools run in the pod.
pub fn node_leaf(c: &DpuKvCluster, id: u32) -> Leaf {
    let pod = format!("{}-{}", render::node_name(c), id - 1);
    let host = render::pod_host(c, &pod);
    Leaf {
        common_name: pod,
        uri: Some(certs::spiffe(&ns(c), &c.name_any(), "node", &id.to_string())),
        dns: vec![host.clone(), format!("{host}.cluster.local"), "localhost".into()],
        ips: vec![IpAddr::from([127, 0, 0, 1])],
        server: true,
        client: true,
    }
}

/// Node `id`'s front door's certificate (`frontDoor`): a gateway of its own
/// (`gateway/front-<id>`), reached at its pod's names like the node, and a client of the other
/// devices it forwards to.
pub fn front_leaf(c: &DpuKvCluster, id: u32) -> Leaf {
    let node = node_leaf(c, id);
    let name = format!("front-{id}");
    Leaf {
        common_name: format!("{}-{name}", c.name_any()),
        uri: Some(certs::spiffe(&ns(c), &c.name_any(), "gateway", &name)),
        ..node
    }
}

/// The gateway's certificate: reached by its Service's names; a client of the devices.
pub fn gateway_leaf(c: &DpuKvCluster) -> Leaf {
    Leaf {
        common_name: render::gateway_name(c),
        uri: Some(certs::spiffe(&ns(c), &c.name_any(), "gateway", &render::gateway_name(c))),
        dns: service_names(c, &c.name_any()),
        ips: Vec::new(),
        server: true,
        client: true,
    }
}

/// The operator's certificate for this cluster (a client only).
pub fn operator_leaf(c: &DpuKvCluster) -> Leaf {
    Leaf {
        common_name: "dpukv-operator".into(),
        uri: Some(certs::spiffe(&ns(c), &c.name_any(), "operator", "dpukv-operator")),
        dns: Vec::new(),
        ips: Vec::new(),
        server: false,
        client: true,
    }
}

/// The managed etcd members' certificate (server and peer): every member's name under its
/// headless Service, and the Service's own.
pub fn etcd_member_leaf(c: &DpuKvCluster) -> Leaf {
    let svc = render::etcd_name(c);
    let ns = ns(c);
    let mut dns = vec![format!("*.{svc}.{ns}.svc"), format!("*.{svc}.{ns}.svc.cluster.local")];
    dns.extend(service_names(c, &svc));
    dns.push("localhost".into());
    Leaf { common_name: svc, uri: None, dns, ips: vec![IpAddr::from([127, 0, 0, 1])], server: true, client: true }
}

/// The node hosts' etcd client certificate.
pub fn etcd_client_leaf(c: &DpuKvCluster) -> Leaf {
    Leaf {
        common_name: format!("{}-node", c.name_any()),
        uri: Some(certs::spiffe(&ns(c), &c.name_any(), "node", "etcd-client")),
        dns: Vec::new(),
        ips: Vec::new(),
        server: false,
        client: true,
    }
}

/// A rustls client configuration trusting `bundle` and presenting `pair`.
pub fn client_config(bundle: &str, pair: &Pair) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        let cert = cert.map_err(|e| CertError::Parse(e.to_string()))?;
        roots.add(cert)?;
    }
    let chain = CertificateDer::pem_slice_iter(pair.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::Parse(e.to_string()))?;
    let key = PrivateKeyDer::from_pem_slice(pair.key.as_bytes()).map_err(|e| CertError::Parse(e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    Ok(Arc::new(cfg))
}

impl OperatorCerts {
    /// This operator's certificate for `c`, from `ca`: the one made before while it is good.
    fn get(&self, c: &DpuKvCluster, ca: &Pair, now: OffsetDateTime) -> Result<Pair, TlsError> {
        let key = format!("{}/{}", ns(c), c.name_any());
        let leaf = operator_leaf(c);
        let mut m = self.by_cluster.lock().expect("operator certificates lock");
        if let Some((ca_cert, pair)) = m.get(&key)
            && *ca_cert == ca.cert
            && certs::leaf_good(pair, &ca.cert, &leaf, now)
        {
            return Ok(pair.clone());
        }
        let pair = certs::issue(ca, &leaf, now)?;
        m.insert(key, (ca.cert.clone(), pair.clone()));
        Ok(pair)
    }
}

/// The managed etcd's CA and certificates (nothing without a managed etcd or with TLS off).
async fn etcd(api: &Api<Secret>, c: &DpuKvCluster, now: OffsetDateTime) -> Result<(), TlsError> {
    if !render::managed_etcd_tls(c) {
        return Ok(());
    }
    let cn = format!("dpukv etcd {}/{}", ns(c), c.name_any());
    let (ca, bundle) = ca(api, c, &render::etcd_ca_secret(c), &cn, now).await?;
    let pair = |leaf| vec![("tls.crt".to_string(), "tls.key".to_string(), leaf)];
    let tls = "kubernetes.io/tls";
    leaves(api, c, (&render::etcd_tls_secret(c), tls), (&ca, &bundle), &pair(etcd_member_leaf(c)), now).await?;
    leaves(api, c, (&render::etcd_client_secret(c), tls), (&ca, &bundle), &pair(etcd_client_leaf(c)), now).await
}

/// cert-manager's `Certificate` kind.
pub fn certificate_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("cert-manager.io", "v1", "Certificate"), "certificates")
}

/// The cert-manager `Certificate`s of a cluster with `tls.certManager`: one per node id
/// (`NAME-node-<id>` into the Secret `NAME-node-<id>-tls`; with the front door also
/// `NAME-front-<id>` into `NAME-front-<id>-tls`), the gateway's (into
/// `NAME-gateway-tls`, mounted as it is) and the operator's (`NAME-operator-tls`).
pub fn certificates(c: &DpuKvCluster, ids: u32) -> Vec<DynamicObject> {
    let Some(cm) = &c.spec.tls.cert_manager else { return Vec::new() };
    let ar = certificate_resource();
    let cert = |name: String, secret: String, leaf: Leaf| {
        let mut usages = vec!["digital signature", "key encipherment"];
        if leaf.server {
            usages.push("server auth");
        }
        if leaf.client {
            usages.push("client auth");
        }
        let mut spec = serde_json::json!({
            "secretName": secret,
            "commonName": leaf.common_name,
            "duration": "2160h",
            "renewBefore": "720h",
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "usages": usages,
            "issuerRef": {"name": cm.issuer_ref.name, "kind": cm.issuer_ref.kind, "group": cm.issuer_ref.group},
        });
        if let Some(uri) = &leaf.uri {
            spec["uris"] = serde_json::json!([uri]);
        }
        if !leaf.dns.is_empty() {
            spec["dnsNames"] = serde_json::json!(leaf.dns);
        }
        if !leaf.ips.is_empty() {
            spec["ipAddresses"] = serde_json::json!(leaf.ips.iter().map(|i| i.to_string()).collect::<Vec<_>>());
        }
        let mut o = DynamicObject::new(&name, &ar).within(&ns(c));
        o.metadata.labels = Some(render::labels(c, "tls"));
        o.metadata.owner_references = c.controller_owner_ref(&()).map(|o| vec![o]);
        o.data = serde_json::json!({ "spec": spec });
        o
    };
    let mut out: Vec<DynamicObject> = (1..=ids)
        .map(|id| {
            let n = format!("{}-node-{id}", c.name_any());
            cert(n.clone(), format!("{n}-tls"), node_leaf(c, id))
        })
        .collect();
    if render::front_door(c).is_some() {
        out.extend((1..=ids).map(|id| {
            let n = format!("{}-front-{id}", c.name_any());
            cert(n.clone(), format!("{n}-tls"), front_leaf(c, id))
        }));
    }
    out.push(cert(render::gateway_name(c), render::gateway_tls_secret(c), gateway_leaf(c)));
    out.push(cert(format!("{}-operator", c.name_any()), operator_secret_name(c), operator_leaf(c)));
    out
}

/// The Secret holding the operator's certificate (user-given, or cert-manager's).
fn operator_secret_name(c: &DpuKvCluster) -> String {
    c.spec.tls.operator_secret.clone().unwrap_or_else(|| format!("{}-operator-tls", c.name_any()))
}

/// How the operator reaches an external etcd given `etcd.clientSecret` (None: plain, or a
/// managed etcd): trusting its `ca.crt`, presenting its `tls.crt`/`tls.key`.
pub async fn external_etcd_tls(
    client: &Client,
    c: &DpuKvCluster,
) -> Result<Option<Arc<rustls::ClientConfig>>, TlsError> {
    let Some(name) = c.spec.etcd.client_secret.as_deref().filter(|_| c.spec.etcd.managed.is_none()) else {
        return Ok(None);
    };
    let api: Api<Secret> = Api::namespaced(client.clone(), &ns(c));
    match from_secret(&api, name).await? {
        Some(cfg) => Ok(Some(cfg)),
        None => Err(TlsError::Missing {
            secret: name.into(),
            key: "ca.crt, tls.crt, tls.key (the Secret does not exist)".into(),
        }),
    }
}

/// The operator's client configuration from a Secret with `tls.crt`, `tls.key`, `ca.crt`.
async fn from_secret(api: &Api<Secret>, name: &str) -> Result<Option<Arc<rustls::ClientConfig>>, TlsError> {
    let Some(s) = api.get_opt(name).await? else { return Ok(None) };
    let pair = Pair { cert: must(&s, "tls.crt")?, key: must(&s, "tls.key")? };
    Ok(Some(client_config(&must(&s, "ca.crt")?, &pair)?))
}

/// Makes the cluster's certificates what they should be for node ids `1..=ids` (the most the
/// node StatefulSet has or is about to have), and says how to call its control API.
pub async fn ensure(
    c: &DpuKvCluster,
    client: &Client,
    operator: &OperatorCerts,
    ids: u32,
    now: OffsetDateTime,
) -> Result<ClusterTls, TlsError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &ns(c));
    let source = c.spec.tls.source();
    if source != TlsSource::Disabled {
        etcd(&api, c, now).await?;
    }
    match source {
        TlsSource::Disabled => Ok(ClusterTls {
            control: None,
            secure: false,
            reason: "PlaintextOptIn",
            message: "tls.mode is Disabled: every connection of this cluster is plain text, unauthenticated".into(),
        }),
        TlsSource::Operator => {
            let cn = format!("dpukv {}/{}", ns(c), c.name_any());
            let (ca, bundle) = ca(&api, c, &render::ca_secret(c), &cn, now).await?;
            let nodes: Vec<(String, String, Leaf)> =
                (1..=ids).map(|id| (format!("node-{id}.crt"), format!("node-{id}.key"), node_leaf(c, id))).collect();
            leaves(&api, c, (&render::node_tls_secret(c), "Opaque"), (&ca, &bundle), &nodes, now).await?;
            let gw = vec![("tls.crt".to_string(), "tls.key".to_string(), gateway_leaf(c))];
            leaves(&api, c, (&render::gateway_tls_secret(c), "kubernetes.io/tls"), (&ca, &bundle), &gw, now).await?;
            if render::front_door(c).is_some() {
                // The front doors' gateway identities: a Secret of their own, for the devices only.
                let fronts: Vec<(String, String, Leaf)> = (1..=ids)
                    .map(|id| (format!("front-{id}.crt"), format!("front-{id}.key"), front_leaf(c, id)))
                    .collect();
                leaves(&api, c, (&render::front_tls_secret(c), "Opaque"), (&ca, &bundle), &fronts, now).await?;
            }
            let mine = operator.get(c, &ca, now)?;
            Ok(ClusterTls {
                control: Some(client_config(&bundle, &mine)?),
                secure: true,
                reason: "OperatorIssued",
                message: format!("mutual TLS with certificates of the operator's CA (Secret {})", render::ca_secret(c)),
            })
        }
        TlsSource::Secrets => {
            let name = operator_secret_name(c);
            let control = from_secret(&api, &name).await?;
            if control.is_none() {
                return Err(TlsError::Missing { secret: name, key: "tls.crt".into() });
            }
            Ok(ClusterTls {
                control,
                secure: true,
                reason: "UserSecrets",
                message: format!("mutual TLS with the certificates of Secret {}", render::node_tls_secret(c)),
            })
        }
        TlsSource::CertManager => {
            let certs_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns(c), &certificate_resource());
            for cert in certificates(c, ids) {
                let name = cert.name_any();
                certs_api
                    .patch(&name, &PatchParams::apply(crate::controller::MANAGER).force(), &Patch::Apply(&cert))
                    .await?;
            }
            // The node pods' one Secret, from cert-manager's per-node ones (once they all exist);
            // with the front door, the front door Secret likewise from its own (apart: a front
            // door certificate that is late holds up no node certificate's renewal).
            let mut pending = Vec::new();
            let mut sets = vec![("node", render::node_tls_secret(c))];
            if render::front_door(c).is_some() {
                sets.push(("front", render::front_tls_secret(c)));
            }
            for (who, secret) in sets {
                let mut data = BTreeMap::new();
                let mut missing = Vec::new();
                for id in 1..=ids {
                    let name = format!("{}-{who}-{id}-tls", c.name_any());
                    match api.get_opt(&name).await? {
                        Some(s) => {
                            data.insert("ca.crt".to_string(), must(&s, "ca.crt")?);
                            data.insert(format!("{who}-{id}.crt"), must(&s, "tls.crt")?);
                            data.insert(format!("{who}-{id}.key"), must(&s, "tls.key")?);
                        }
                        None => missing.push(name),
                    }
                }
                if missing.is_empty() {
                    let live = api.get_opt(&secret).await?;
                    keep(&api, &live, owned_secret(c, &secret, "Opaque", data)).await?;
                }
                pending.extend(missing);
            }
            let control = from_secret(&api, &operator_secret_name(c)).await?;
            let (secure, reason, message) = if pending.is_empty() && control.is_some() {
                (true, "CertManager", "mutual TLS with certificates from cert-manager".to_string())
            } else {
                (false, "CertificatesPending", format!("waiting for cert-manager: {}", pending.join(", ")))
            };
            Ok(ClusterTls { control, secure, reason, message })
        }
    }
}
