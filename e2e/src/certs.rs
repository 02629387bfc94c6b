//! Certificates for a test cluster with identities (docs/security.md): a CA, a certificate per
//! role — each node's (`node-<id>`, so `--tls-cert DIR/node-{node}.pem` serves every node), a
//! gateway's, an admin's, a client's, the operator's —, and certificates an attacker could
//! hold: one of the CA without an identity, another cluster's admin, and one of another CA;
//! plus etcd's own CA with a server and a client certificate. All for 127.0.0.1 and localhost.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Result, anyhow};
use dpukv_net::identity::{Identity, Role};
use dpukv_net::tls::{ClientTls, LocalCa, TlsFiles};

/// The namespace of test identities.
pub const NAMESPACE: &str = "local";

/// A test cluster's certificates, in a directory of their own.
pub struct ClusterCerts {
    /// Where they are.
    pub dir: PathBuf,
    /// The cluster's name (its identities' `<cluster>`).
    pub cluster: String,
    ca: LocalCa,
}

impl ClusterCerts {
    /// Issues the set for `nodes` nodes of `cluster` in `dir`.
    pub fn issue(dir: &Path, cluster: &str, nodes: u32) -> Result<ClusterCerts> {
        std::fs::create_dir_all(dir)?;
        let ca = LocalCa::new().map_err(anyhow::Error::msg)?;
        ca.write_ca(&dir.join("ca.pem")).map_err(anyhow::Error::msg)?;
        let c = ClusterCerts { dir: dir.to_path_buf(), cluster: cluster.into(), ca };
        for id in 1..=nodes {
            c.issue_as(&format!("node-{id}"), Some(Role::Node), &id.to_string())?;
        }
        c.issue_as("gateway", Some(Role::Gateway), "gateway")?;
        c.issue_as("admin", Some(Role::Admin), "tester")?;
        c.issue_as("client", Some(Role::Client), "app")?;
        c.issue_as("operator", Some(Role::Operator), "dpukv-operator")?;
        c.issue_as("nameless", None, "")?;
        // Another cluster's admin, signed by the same CA.
        let other = Identity::new(NAMESPACE, "elsewhere", Role::Admin, "tester").map_err(|e| anyhow!("{e}"))?;
        c.ca.issue(&["127.0.0.1", "localhost"], Some(&other), &c.files("stranger")).map_err(anyhow::Error::msg)?;
        // A certificate of another CA naming an admin of this cluster.
        let foreign_ca = LocalCa::new().map_err(anyhow::Error::msg)?;
        foreign_ca.write_ca(&dir.join("foreign-ca.pem")).map_err(anyhow::Error::msg)?;
        let admin = Identity::new(NAMESPACE, cluster, Role::Admin, "tester").map_err(|e| anyhow!("{e}"))?;
        foreign_ca.issue(&["127.0.0.1"], Some(&admin), &c.files("foreign")).map_err(anyhow::Error::msg)?;
        // etcd's own CA: a server certificate and the hosts' client certificate.
        let etcd_ca = LocalCa::new().map_err(anyhow::Error::msg)?;
        etcd_ca.write_ca(&dir.join("etcd-ca.pem")).map_err(anyhow::Error::msg)?;
        etcd_ca.issue(&["127.0.0.1", "localhost"], None, &c.files("etcd")).map_err(anyhow::Error::msg)?;
        let etcd_client = Identity::new(NAMESPACE, cluster, Role::Node, "etcd-client").map_err(|e| anyhow!("{e}"))?;
        etcd_ca.issue(&["127.0.0.1"], Some(&etcd_client), &c.files("etcd-client")).map_err(anyhow::Error::msg)?;
        Ok(c)
    }

    /// (Re-)issues the pair `name` naming `role`/`id` (no identity without a role), replacing
    /// the files atomically.
    pub fn issue_as(&self, name: &str, role: Option<Role>, id: &str) -> Result<()> {
        let identity = match role {
            Some(r) => Some(Identity::new(NAMESPACE, &self.cluster, r, id).map_err(|e| anyhow!("{e}"))?),
            None => None,
        };
        self.ca.issue(&["127.0.0.1", "localhost"], identity.as_ref(), &self.files(name)).map_err(anyhow::Error::msg)
    }

    /// The cluster's CA.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// Another CA (its certificate), which signed the `foreign` pair.
    pub fn foreign_ca(&self) -> PathBuf {
        self.dir.join("foreign-ca.pem")
    }

    /// etcd's CA.
    pub fn etcd_ca(&self) -> PathBuf {
        self.dir.join("etcd-ca.pem")
    }

    /// The pair called `name` (`node-2`, `gateway`, `admin`, ...), with the cluster's CA.
    pub fn files(&self, name: &str) -> TlsFiles {
        TlsFiles {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
            ca: Some(self.ca()),
        }
    }

    /// A client trusting the cluster's CA, presenting the pair `name` (None: no certificate).
    pub fn client(&self, name: Option<&str>) -> Result<Arc<ClientTls>> {
        let f = name.map(|n| self.files(n));
        ClientTls::load(&self.ca(), f.as_ref().map(|f| (f.cert.as_path(), f.key.as_path()))).map_err(|e| anyhow!("{e}"))
    }

    /// The flags of a node's host and device: its certificate by `{node}`, mutual TLS.
    pub fn node_flags(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.dir.join("node-{node}.pem").display().to_string(),
            "--tls-key".into(),
            self.dir.join("node-{node}.key").display().to_string(),
            "--tls-ca".into(),
            self.ca().display().to_string(),
            "--tls-client-auth".into(),
        ]
    }

    /// A host's flags for etcd over TLS with its client certificate.
    pub fn etcd_client_flags(&self) -> Vec<String> {
        vec![
            "--etcd-ca".into(),
            self.etcd_ca().display().to_string(),
            "--etcd-cert".into(),
            self.dir.join("etcd-client.pem").display().to_string(),
            "--etcd-key".into(),
            self.dir.join("etcd-client.key").display().to_string(),
        ]
    }

    /// The gateway's flags: its certificate, the CA (its front ends ask no client certificate).
    pub fn gateway_flags(&self) -> Vec<String> {
        let f = self.files("gateway");
        vec![
            "--tls-cert".into(),
            f.cert.display().to_string(),
            "--tls-key".into(),
            f.key.display().to_string(),
            "--tls-ca".into(),
            self.ca().display().to_string(),
        ]
    }

    /// etcd's own TLS files (server certificate, client CA).
    pub fn etcd_server(&self) -> crate::etcd::EtcdTlsFiles {
        crate::etcd::EtcdTlsFiles {
            ca: self.etcd_ca(),
            cert: self.dir.join("etcd.pem"),
            key: self.dir.join("etcd.key"),
            client_cert: self.dir.join("etcd-client.pem"),
            client_key: self.dir.join("etcd-client.key"),
        }
    }
}
