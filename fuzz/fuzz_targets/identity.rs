//! Fuzzes the identity parsers (`dpukv_net::identity`), which read what a peer's certificate
//! says: arbitrary bytes as a URI and as a DER certificate never panic; an identity that parses
//! prints back to a URI that parses to the same identity.
#![no_main]

use dpukv_net::identity::Identity;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(uri) = std::str::from_utf8(data)
        && let Ok(id) = Identity::parse(uri)
    {
        assert_eq!(id.uri(), uri);
        assert_eq!(Identity::parse(&id.uri()), Ok(id));
    }
    if let Ok(id) = Identity::from_certificate(data) {
        assert_eq!(Identity::parse(&id.uri()), Ok(id));
    }
});
