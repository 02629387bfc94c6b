//! Who is on the other end of a connection, and what it may do (docs/security.md §2–3).
//!
//! Every process of a cluster holds a certificate whose URI SAN names it:
//! `spiffe://dpukv/<namespace>/<cluster>/<role>/<id>` ([`Identity`]). A server knows its own
//! identity from its own certificate; a peer is a *member* when its identity has the same
//! `spiffe://dpukv/<namespace>/<cluster>/` prefix. A server that accepted a connection knows
//! the peer as a [`Peer`] (`tls::ServerTls::peer`, `tls::accept_peer`,
//! `tls::ServerTls::accept_blocking`), and checks it per operation with [`Peer::allow`] and
//! [`Peer::allow_node`], which answer a [`Refusal`] (`unauthorized`: no usable credential;
//! `forbidden`: a credential that does not grant it).
//!
//! Without TLS nothing can be checked: the peer is [`Peer::Unchecked`] and everything is
//! allowed — plain mode is the documented opt-in (bind such listeners to loopback or a pod
//! network you trust).

use std::fmt;

/// The URI prefix of every dpukv identity.
pub const SCHEME_PREFIX: &str = "spiffe://dpukv/";

/// The longest identity URI accepted (a certificate's SAN is attacker-chosen text).
pub const MAX_URI: usize = 1024;

/// The longest segment (namespace, cluster, id): a Kubernetes name is at most 253 bytes.
const MAX_SEGMENT: usize = 253;

/// A process's role in a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// A node pod's host or device (id: the node id).
    Node,
    /// A gateway (id: its name).
    Gateway,
    /// The operator (id: its name).
    Operator,
    /// A person or tool administering the cluster (`dpukv cluster`).
    Admin,
    /// A client of the data (reads and writes at the devices).
    Client,
}

impl Role {
    /// The role's name in the URI.
    pub fn name(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Gateway => "gateway",
            Role::Operator => "operator",
            Role::Admin => "admin",
            Role::Client => "client",
        }
    }

    /// The role named `s`.
    pub fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "node" => Role::Node,
            "gateway" => Role::Gateway,
            "operator" => Role::Operator,
            "admin" => Role::Admin,
            "client" => Role::Client,
            _ => return None,
        })
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a URI or a certificate names no identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The certificate could not be parsed.
    #[error("the certificate does not parse: {0}")]
    Certificate(String),
    /// No URI SAN starts with `spiffe://dpukv/`.
    #[error("the certificate has no spiffe://dpukv/<namespace>/<cluster>/<role>/<id> URI SAN")]
    Missing,
    /// More than one `spiffe://dpukv/` URI SAN: which one counts is not clear.
    #[error("the certificate has more than one spiffe://dpukv/ URI SAN")]
    Ambiguous,
    /// A `spiffe://dpukv/` URI that is not `<namespace>/<cluster>/<role>/<id>` with known role.
    #[error("{0}")]
    Malformed(String),
}

impl IdentityError {
    /// A stable code naming it.
    pub fn code(&self) -> &'static str {
        match self {
            IdentityError::Certificate(_) => "identity_certificate",
            IdentityError::Missing => "identity_missing",
            IdentityError::Ambiguous => "identity_ambiguous",
            IdentityError::Malformed(_) => "identity_malformed",
        }
    }
}

/// A dpukv identity: `spiffe://dpukv/<namespace>/<cluster>/<role>/<id>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The Kubernetes namespace (`local` outside Kubernetes).
    pub namespace: String,
    /// The cluster's name (the `DpuKvCluster`'s).
    pub cluster: String,
    /// The role.
    pub role: Role,
    /// For a node its id (decimal); for the others a name.
    pub id: String,
}

fn segment_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_SEGMENT
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && s != "."
        && s != ".."
}

impl Identity {
    /// An identity from its parts (checked as [`Identity::parse`] checks them).
    pub fn new(namespace: &str, cluster: &str, role: Role, id: &str) -> Result<Identity, IdentityError> {
        Identity::parse(&format!("{SCHEME_PREFIX}{namespace}/{cluster}/{}/{id}", role.name()))
    }

    /// Parses `spiffe://dpukv/<namespace>/<cluster>/<role>/<id>`: four non-empty segments of
    /// ASCII letters, digits, `-`, `.` and `_` (at most 253 bytes each), a known role, nothing
    /// else (no query, no fragment, no empty or extra segment).
    pub fn parse(uri: &str) -> Result<Identity, IdentityError> {
        let bad = |what: &str| IdentityError::Malformed(format!("{what}: {:?}", truncate(uri)));
        if uri.len() > MAX_URI {
            return Err(bad("an identity URI too long"));
        }
        let Some(rest) = uri.strip_prefix(SCHEME_PREFIX) else {
            return Err(bad("not a spiffe://dpukv/ URI"));
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let [namespace, cluster, role, id] = parts[..] else {
            return Err(bad("not <namespace>/<cluster>/<role>/<id>"));
        };
        if ![namespace, cluster, role, id].iter().all(|s| segment_ok(s)) {
            return Err(bad("a segment empty, too long or with other characters than letters, digits, '-', '.', '_'"));
        }
        let Some(role) = Role::parse(role) else {
            return Err(bad("an unknown role (node, gateway, operator, admin, client)"));
        };
        Ok(Identity { namespace: namespace.into(), cluster: cluster.into(), role, id: id.into() })
    }

    /// The identity a certificate (DER) names in its URI SANs: exactly one must start with
    /// `spiffe://dpukv/` (other URIs are ignored).
    pub fn from_certificate(der: &[u8]) -> Result<Identity, IdentityError> {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der).map_err(|e| IdentityError::Certificate(e.to_string()))?;
        let san = cert.subject_alternative_name().map_err(|e| IdentityError::Certificate(e.to_string()))?;
        let mut found = None;
        for name in san.iter().flat_map(|s| s.value.general_names.iter()) {
            if let x509_parser::extensions::GeneralName::URI(u) = name
                && u.starts_with(SCHEME_PREFIX)
            {
                if found.is_some() {
                    return Err(IdentityError::Ambiguous);
                }
                found = Some(Identity::parse(u)?);
            }
        }
        found.ok_or(IdentityError::Missing)
    }

    /// The URI.
    pub fn uri(&self) -> String {
        format!("{SCHEME_PREFIX}{}/{}/{}/{}", self.namespace, self.cluster, self.role.name(), self.id)
    }

    /// Whether `other` belongs to the same cluster (same namespace and cluster name).
    pub fn same_cluster(&self, other: &Identity) -> bool {
        self.namespace == other.namespace && self.cluster == other.cluster
    }

    /// The node id, for a node identity whose id is a node id (decimal, not 0).
    pub fn node_id(&self) -> Option<u32> {
        if self.role != Role::Node || self.id.starts_with('0') {
            return None;
        }
        self.id.parse().ok().filter(|&n| n != 0)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

fn truncate(s: &str) -> String {
    let mut end = s.len().min(80);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// Who is on the other end of an accepted connection, as far as the server can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// The listener speaks no TLS: nothing can be checked (plain mode, an explicit opt-in).
    Unchecked,
    /// TLS, but the peer presented no certificate.
    Anonymous,
    /// The peer's certificate (signed by the CA) names no dpukv identity, or this server's own
    /// certificate names none (then no peer can be placed in a cluster): why.
    Unrecognized(String),
    /// A certificate naming another cluster's identity.
    Stranger(Identity),
    /// A certificate naming an identity of this server's cluster.
    Member(Identity),
}

/// Why a peer may not do something: a typed refusal with a stable code (the binary protocol's
/// `unauthorized` and `forbidden`, HTTP's 401 and 403).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No credential that could grant it: no client certificate, or one that names no identity.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// A credential that does not grant it: another role, another cluster, another node.
    #[error("forbidden: {0}")]
    Forbidden(String),
}

impl Refusal {
    /// `unauthorized` or `forbidden` (as `dpukv_proto::ErrorCode::name`).
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Unauthorized(_) => "unauthorized",
            Refusal::Forbidden(_) => "forbidden",
        }
    }

    /// What it says, without the code.
    pub fn message(&self) -> &str {
        match self {
            Refusal::Unauthorized(m) | Refusal::Forbidden(m) => m,
        }
    }
}

fn names(roles: &[Role]) -> String {
    roles.iter().map(|r| r.name()).collect::<Vec<_>>().join(", ")
}

impl Peer {
    /// The peer of a TLS connection: `own` is the server's identity (None: its certificate
    /// names none), `certificate` the first certificate the peer presented (DER).
    pub fn of(own: Option<&Identity>, certificate: Option<&[u8]>) -> Peer {
        let Some(der) = certificate else { return Peer::Anonymous };
        match Identity::from_certificate(der) {
            Err(e) => Peer::Unrecognized(e.to_string()),
            Ok(id) => match own {
                None => Peer::Unrecognized("this server's own certificate names no dpukv identity".into()),
                Some(o) if o.same_cluster(&id) => Peer::Member(id),
                Some(_) => Peer::Stranger(id),
            },
        }
    }

    /// The member's identity, if the peer is one.
    pub fn identity(&self) -> Option<&Identity> {
        match self {
            Peer::Member(id) => Some(id),
            _ => None,
        }
    }

    /// Whether nothing can be checked (no TLS).
    pub fn unchecked(&self) -> bool {
        matches!(self, Peer::Unchecked)
    }

    /// A member of the cluster, of any role: Ok (also without TLS), else why not.
    fn member(&self, what: &str) -> Result<Option<&Identity>, Refusal> {
        match self {
            Peer::Unchecked => Ok(None),
            Peer::Member(id) => Ok(Some(id)),
            Peer::Anonymous => Err(Refusal::Unauthorized(format!("{what} needs a client certificate"))),
            Peer::Unrecognized(why) => Err(Refusal::Unauthorized(format!("{what}: {why}"))),
            Peer::Stranger(id) => Err(Refusal::Forbidden(format!("{what}: {id} is not of this cluster"))),
        }
    }

    /// Ok if the peer may do `what` as one of `roles` (always without TLS).
    pub fn allow(&self, roles: &[Role], what: &str) -> Result<(), Refusal> {
        match self.member(what)? {
            Some(id) if !roles.contains(&id.role) => {
                Err(Refusal::Forbidden(format!("{what} is for the roles {}, not {id}", names(roles))))
            }
            _ => Ok(()),
        }
    }

    /// Ok if the peer is node `node` (always without TLS): what a backup asks of a stream from
    /// the primary its region map names.
    pub fn allow_node(&self, node: u32, what: &str) -> Result<(), Refusal> {
        match self.member(what)? {
            Some(id) if id.node_id() != Some(node) => {
                Err(Refusal::Forbidden(format!("{what} is for node {node} only, not {id}")))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_parse_strictly_and_print_back() {
        let id = Identity::parse("spiffe://dpukv/db/demo/node/3").expect("parses");
        assert_eq!(
            (id.namespace.as_str(), id.cluster.as_str(), id.role, id.id.as_str()),
            ("db", "demo", Role::Node, "3")
        );
        assert_eq!(id.node_id(), Some(3));
        assert_eq!(id.uri(), "spiffe://dpukv/db/demo/node/3");
        let gw = Identity::parse("spiffe://dpukv/db/demo/gateway/demo-gateway").expect("parses");
        assert_eq!((gw.role, gw.node_id()), (Role::Gateway, None));
        assert!(gw.same_cluster(&id));
        assert!(!gw.same_cluster(&Identity::parse("spiffe://dpukv/db/other/node/3").expect("parses")));
        assert!(!gw.same_cluster(&Identity::parse("spiffe://dpukv/prod/demo/node/3").expect("parses")));
        for bad in [
            "spiffe://dpukv/db/demo/node",
            "spiffe://dpukv/db/demo/node/3/x",
            "spiffe://dpukv/db/demo/root/3",
            "spiffe://dpukv/db//node/3",
            "spiffe://dpukv/db/demo/node/3?x=1",
            "spiffe://other/db/demo/node/3",
            "spiffe://dpukv/../demo/node/3",
            "spiffe://dpukv/db/demo/node/é",
            "",
        ] {
            assert!(Identity::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Identity::parse(&format!("spiffe://dpukv/db/demo/node/{}", "1".repeat(2000))).is_err());
        // Ids that are not node ids.
        for id in ["0", "01", "x", "4294967296", "etcd-client"] {
            let i = Identity::parse(&format!("spiffe://dpukv/db/demo/node/{id}")).expect("parses");
            assert_eq!(i.node_id(), None, "{id}");
        }
    }

    #[test]
    fn peers_are_allowed_by_role_cluster_and_node() {
        let node = |n: u32| Peer::Member(Identity::new("db", "demo", Role::Node, &n.to_string()).expect("id"));
        let gw = Peer::Member(Identity::new("db", "demo", Role::Gateway, "gw").expect("id"));
        let data = [Role::Gateway, Role::Client, Role::Admin];
        assert_eq!(gw.allow(&data, "put"), Ok(()));
        assert!(matches!(node(1).allow(&data, "put"), Err(Refusal::Forbidden(_))));
        assert_eq!(node(1).allow_node(1, "replication"), Ok(()));
        assert!(matches!(node(2).allow_node(1, "replication"), Err(Refusal::Forbidden(_))));
        assert!(matches!(gw.allow_node(1, "replication"), Err(Refusal::Forbidden(_))));
        let stranger = Peer::Stranger(Identity::new("db", "other", Role::Gateway, "gw").expect("id"));
        assert!(matches!(stranger.allow(&data, "put"), Err(Refusal::Forbidden(_))));
        assert!(matches!(Peer::Anonymous.allow(&data, "put"), Err(Refusal::Unauthorized(_))));
        assert!(matches!(Peer::Unrecognized("no".into()).allow_node(1, "x"), Err(Refusal::Unauthorized(_))));
        assert_eq!(Peer::Unchecked.allow(&data, "put"), Ok(()));
        assert_eq!(Peer::Unchecked.allow_node(1, "replication"), Ok(()));
        let r = node(2).allow_node(1, "replication").expect_err("refused");
        assert_eq!(r.code(), "forbidden");
        assert!(r.message().contains("spiffe://dpukv/db/demo/node/2"), "{r}");
    }
}
