//! The certificates the operator issues itself when a cluster names no Secret and no cert-manager
//! issuer (docs/security.md §2, §5): a CA per cluster, and leaf certificates whose URI SAN is the
//! holder's identity `spiffe://dpukv/<namespace>/<cluster>/<role>/<id>` and whose DNS names are
//! the ones peers dial. Pure functions over PEM text (rcgen to issue, x509-parser to read back):
//! the reconciler (`tls`) keeps them in Secrets and asks here whether each is still good.
//!
//! Lifetimes: a CA lives [`CA_LIFETIME`], a leaf [`LEAF_LIFETIME`]; each is renewed once
//! [`RENEW_AT`] of its lifetime has passed, so a renewal never races the expiry. A renewed CA
//! keeps being trusted (the bundle holds the old and the new one) until the old one expires, so
//! leaves issued by either verify while they are replaced.
//!
//! Keys are ECDSA P-256 (what rustls and etcd both take), PKCS#8 PEM.

use std::net::IpAddr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData, SanType,
};
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// How long a CA lives (ten years).
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a leaf certificate lives (90 days).
pub const LEAF_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);
/// The share of its lifetime after which a certificate is renewed (2/3).
pub const RENEW_AT: (u32, u32) = (2, 3);
/// How far back `notBefore` is set (clocks of the pods may be a little behind the operator's).
const BACKDATE: Duration = Duration::from_secs(3600);

/// Why a certificate could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen refused (a malformed name, a key it cannot use).
    #[error("issuing a certificate: {0}")]
    Issue(#[from] rcgen::Error),
    /// PEM or DER that does not parse.
    #[error("reading a certificate: {0}")]
    Parse(String),
}

/// A certificate and its key, PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    /// The certificate (PEM).
    pub cert: String,
    /// Its private key (PKCS#8 PEM).
    pub key: String,
}

/// What a leaf certificate says: the identity (URI SAN), the names it is reached at, and what it
/// is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    /// The subject's common name (informational; identities are URI SANs).
    pub common_name: String,
    /// The URI SAN (`spiffe://dpukv/...`), if any.
    pub uri: Option<String>,
    /// DNS SANs.
    pub dns: Vec<String>,
    /// IP SANs.
    pub ips: Vec<IpAddr>,
    /// Usable by a server (`serverAuth`).
    pub server: bool,
    /// Usable by a client (`clientAuth`).
    pub client: bool,
}

/// The identity of a process of cluster `cluster` in `namespace` (docs/security.md §2).
pub fn spiffe(namespace: &str, cluster: &str, role: &str, id: &str) -> String {
    format!("spiffe://dpukv/{namespace}/{cluster}/{role}/{id}")
}

fn now_minus(now: OffsetDateTime, d: Duration) -> OffsetDateTime {
    now - time::Duration::try_from(d).unwrap_or(time::Duration::ZERO)
}

fn now_plus(now: OffsetDateTime, d: Duration) -> OffsetDateTime {
    now + time::Duration::try_from(d).unwrap_or(time::Duration::ZERO)
}

fn ca_params(common_name: &str, now: OffsetDateTime) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "dpukv");
    dn.push(DnType::CommonName, common_name);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    p.not_before = now_minus(now, BACKDATE);
    p.not_after = now_plus(now, CA_LIFETIME);
    p
}

/// A new CA named `common_name`, valid from now for [`CA_LIFETIME`].
pub fn new_ca(common_name: &str, now: OffsetDateTime) -> Result<Pair, CertError> {
    let key = KeyPair::generate()?;
    let cert = ca_params(common_name, now).self_signed(&key)?;
    Ok(Pair { cert: cert.pem(), key: key.serialize_pem() })
}

/// A leaf certificate for `leaf`, signed by `ca`, valid from now for [`LEAF_LIFETIME`].
pub fn issue(ca: &Pair, leaf: &Leaf, now: OffsetDateTime) -> Result<Pair, CertError> {
    let ca_key = KeyPair::from_pem(&ca.key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)?;
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "dpukv");
    dn.push(DnType::CommonName, leaf.common_name.as_str());
    p.distinguished_name = dn;
    let mut sans = Vec::new();
    if let Some(uri) = &leaf.uri {
        sans.push(SanType::URI(uri.as_str().try_into()?));
    }
    for d in &leaf.dns {
        sans.push(SanType::DnsName(d.as_str().try_into()?));
    }
    sans.extend(leaf.ips.iter().map(|ip| SanType::IpAddress(*ip)));
    p.subject_alt_names = sans;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages =
        [(leaf.server, ExtendedKeyUsagePurpose::ServerAuth), (leaf.client, ExtendedKeyUsagePurpose::ClientAuth)]
            .into_iter()
            .filter_map(|(on, u)| on.then_some(u))
            .collect();
    p.use_authority_key_identifier_extension = true;
    p.not_before = now_minus(now, BACKDATE);
    p.not_after = now_plus(now, LEAF_LIFETIME);
    let cert = p.signed_by(&key, &issuer)?;
    Ok(Pair { cert: cert.pem(), key: key.serialize_pem() })
}

/// The first certificate of a PEM text, as DER.
fn der(pem_text: &str) -> Result<Vec<u8>, CertError> {
    let (_, pem) =
        x509_parser::pem::parse_x509_pem(pem_text.as_bytes()).map_err(|e| CertError::Parse(e.to_string()))?;
    Ok(pem.contents)
}

fn parse(der: &[u8]) -> Result<X509Certificate<'_>, CertError> {
    X509Certificate::from_der(der).map(|(_, c)| c).map_err(|e| CertError::Parse(e.to_string()))
}

/// A certificate's validity, as Unix seconds (`notBefore`, `notAfter`).
pub fn validity(cert_pem: &str) -> Result<(i64, i64), CertError> {
    let d = der(cert_pem)?;
    let c = parse(&d)?;
    Ok((c.validity().not_before.timestamp(), c.validity().not_after.timestamp()))
}

/// Whether a certificate valid from `from` to `to` is due for renewal at `now` (past
/// [`RENEW_AT`] of its lifetime, or not yet valid).
fn due(from: i64, to: i64, now: OffsetDateTime) -> bool {
    let now = now.unix_timestamp();
    let (n, d) = RENEW_AT;
    now < from || now >= from + (to - from) * i64::from(n) / i64::from(d)
}

/// Whether the CA `ca` is still good at `now`: it parses, its key matches, and it is not due for
/// renewal.
pub fn ca_good(ca: &Pair, now: OffsetDateTime) -> bool {
    let check = || -> Result<bool, CertError> {
        let key = KeyPair::from_pem(&ca.key)?;
        let d = der(&ca.cert)?;
        let c = parse(&d)?;
        let (from, to) = (c.validity().not_before.timestamp(), c.validity().not_after.timestamp());
        Ok(c.is_ca() && c.public_key().raw == key.subject_public_key_info().as_slice() && !due(from, to, now))
    };
    check().unwrap_or(false)
}

/// Whether `cert_pem` has not expired at `now` (a previous CA stays in the trust bundle until
/// then).
pub fn unexpired(cert_pem: &str, now: OffsetDateTime) -> bool {
    validity(cert_pem).is_ok_and(|(_, to)| now.unix_timestamp() < to)
}

/// Whether `pair` is still good at `now` as the certificate `leaf` describes, issued by `ca`: it
/// parses, its key matches it, `ca` signed it, its names are exactly `leaf`'s, and it is not due
/// for renewal. Anything else (a changed name, a new CA, half its life gone) means: issue anew.
pub fn leaf_good(pair: &Pair, ca_cert_pem: &str, leaf: &Leaf, now: OffsetDateTime) -> bool {
    let check = || -> Result<bool, CertError> {
        let key = KeyPair::from_pem(&pair.key)?;
        let d = der(&pair.cert)?;
        let c = parse(&d)?;
        let ca_der = der(ca_cert_pem)?;
        let ca = parse(&ca_der)?;
        if c.public_key().raw != key.subject_public_key_info().as_slice()
            || c.verify_signature(Some(ca.public_key())).is_err()
        {
            return Ok(false);
        }
        let (from, to) = (c.validity().not_before.timestamp(), c.validity().not_after.timestamp());
        if due(from, to, now) {
            return Ok(false);
        }
        let (mut uris, mut dns, mut ips) = (Vec::new(), Vec::new(), Vec::new());
        if let Ok(Some(san)) = c.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::URI(u) => uris.push(u.to_string()),
                    GeneralName::DNSName(d) => dns.push(d.to_string()),
                    GeneralName::IPAddress(b) => match b.len() {
                        4 => ips.push(IpAddr::from(<[u8; 4]>::try_from(*b).unwrap_or_default())),
                        16 => ips.push(IpAddr::from(<[u8; 16]>::try_from(*b).unwrap_or_default())),
                        _ => return Ok(false),
                    },
                    _ => {}
                }
            }
        }
        Ok(uris == leaf.uri.iter().cloned().collect::<Vec<_>>() && dns == leaf.dns && ips == leaf.ips)
    };
    check().unwrap_or(false)
}

/// The CA bundle peers trust: the current CA, and the previous one while it has not expired.
pub fn bundle(current: &str, previous: Option<&str>, now: OffsetDateTime) -> String {
    let mut out = current.trim_end().to_string();
    out.push('\n');
    if let Some(p) = previous.filter(|p| unexpired(p, now)) {
        out.push_str(p.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u32) -> Leaf {
        Leaf {
            common_name: format!("node-{id}"),
            uri: Some(spiffe("db", "demo", "node", &id.to_string())),
            dns: vec![format!("demo-node-{}.demo-node.db.svc", id - 1), "localhost".into()],
            ips: vec!["127.0.0.1".parse().expect("ip")],
            server: true,
            client: true,
        }
    }

    #[test]
    fn a_leaf_is_good_until_two_thirds_of_its_life_and_names_its_identity() {
        let now = OffsetDateTime::now_utc();
        let ca = new_ca("dpukv db/demo", now).expect("ca");
        assert!(ca_good(&ca, now));
        let pair = issue(&ca, &node(2), now).expect("leaf");
        assert!(leaf_good(&pair, &ca.cert, &node(2), now));
        // Another node's names, another CA, a changed name: not good.
        assert!(!leaf_good(&pair, &ca.cert, &node(3), now));
        let other = new_ca("other", now).expect("ca");
        assert!(!leaf_good(&pair, &other.cert, &node(2), now), "signed by another CA");
        let mut renamed = node(2);
        renamed.dns.pop();
        assert!(!leaf_good(&pair, &ca.cert, &renamed, now));
        // A key that is not the certificate's.
        let wrong = Pair { cert: pair.cert.clone(), key: issue(&ca, &node(2), now).expect("leaf").key };
        assert!(!leaf_good(&wrong, &ca.cert, &node(2), now));
        // Renewal: good at 59 days, due at 61 (2/3 of 90 days, less the hour of backdating).
        let day = time::Duration::days(1);
        assert!(leaf_good(&pair, &ca.cert, &node(2), now + day * 59));
        assert!(!leaf_good(&pair, &ca.cert, &node(2), now + day * 61));
        // The CA: due after 2/3 of ten years.
        assert!(ca_good(&ca, now + day * (365 * 6)));
        assert!(!ca_good(&ca, now + day * (365 * 7)));
    }

    #[test]
    fn the_bundle_keeps_the_previous_ca_until_it_expires() {
        let now = OffsetDateTime::now_utc();
        let old = new_ca("old", now).expect("ca");
        let new = new_ca("new", now).expect("ca");
        let b = bundle(&new.cert, Some(&old.cert), now);
        assert_eq!(b.matches("BEGIN CERTIFICATE").count(), 2);
        let later = now + time::Duration::days(365 * 11);
        assert_eq!(bundle(&new.cert, Some(&old.cert), later).matches("BEGIN CERTIFICATE").count(), 1);
    }
}
