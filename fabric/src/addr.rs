//! `fabric://PROVIDER/HOST:PORT`: where a fabric endpoint listens, as flags, `cluster.json` and
//! the region map write it.

use crate::FabricError;

/// A parsed fabric address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricAddr {
    /// The libfabric provider (`tcp`, `verbs`, `efa`, ...).
    pub provider: String,
    /// The host (an address or a name; IPv6 in brackets).
    pub host: String,
    /// The port.
    pub port: u16,
}

impl FabricAddr {
    /// The URL scheme.
    pub const SCHEME: &'static str = "fabric://";

    /// Whether `s` names a fabric endpoint (rather than a TCP `host:port`).
    pub fn is_fabric(s: &str) -> bool {
        s.starts_with(Self::SCHEME)
    }

    /// Parses `fabric://PROVIDER/HOST:PORT`.
    pub fn parse(s: &str) -> Result<FabricAddr, FabricError> {
        let bad = |why: &str| FabricError::Address(format!("{s:?}: {why} (want fabric://PROVIDER/HOST:PORT)"));
        let rest = s.strip_prefix(Self::SCHEME).ok_or_else(|| bad("no fabric:// scheme"))?;
        let (provider, hostport) = rest.split_once('/').ok_or_else(|| bad("no provider"))?;
        let valid_provider =
            !provider.is_empty() && provider.bytes().all(|b| b.is_ascii_alphanumeric() || b"_;-".contains(&b));
        if !valid_provider {
            return Err(bad("a provider is letters, digits, '_', '-' and ';'"));
        }
        let (host, port) = hostport.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() || host.contains('/') {
            return Err(bad("no host"));
        }
        let port = port.parse().map_err(|_| bad("the port is not a number below 65536"))?;
        Ok(FabricAddr { provider: provider.to_string(), host: host.to_string(), port })
    }
}

impl std::fmt::Display for FabricAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "{}{}/[{}]:{}", Self::SCHEME, self.provider, self.host, self.port)
        } else {
            write!(f, "{}{}/{}:{}", Self::SCHEME, self.provider, self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_bad_ones_say_why() {
        for s in ["fabric://tcp/127.0.0.1:7000", "fabric://verbs/[fe80::1]:1", "fabric://tcp;ofi_rxm/node-1:65535"] {
            assert_eq!(FabricAddr::parse(s).expect(s).to_string(), s);
        }
        let a = FabricAddr::parse("fabric://tcp/127.0.0.1:7000").expect("parse");
        assert_eq!((a.provider.as_str(), a.host.as_str(), a.port), ("tcp", "127.0.0.1", 7000));
        for s in [
            "tcp/127.0.0.1:1",
            "fabric://127.0.0.1:1",
            "fabric:///h:1",
            "fabric://tcp/h",
            "fabric://tcp/h:70000",
            "fabric://tcp/:1",
            "fabric://t cp/h:1",
        ] {
            assert!(matches!(FabricAddr::parse(s), Err(FabricError::Address(_))), "{s}");
        }
    }
}
