//! Fuzzes the cluster's decoders — region maps, handoffs and replication frames: arbitrary bytes never
//! panic; whatever decodes is valid and re-encodes to the same bytes.
#![no_main]

use dpukv_proto::regionmap::{Handoff, NodeInfo, RegionInfo, RegionMap};
use dpukv_proto::replication::ReplMessage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = RegionMap::decode(data) {
        m.validate().expect("a decoded map is valid");
        let mut b = Vec::new();
        m.encode(&mut b);
        assert_eq!(b, data);
    }
    if let Ok(r) = RegionInfo::decode(data) {
        assert_eq!(r.encode(), data);
    }
    if let Ok(h) = Handoff::decode(data) {
        assert_eq!(h.encode(), data);
    }
    if let Ok(n) = NodeInfo::decode(data) {
        assert_eq!(n.encode(), data);
    }
    if let Ok((m, used)) = ReplMessage::decode(data) {
        let mut b = Vec::new();
        m.encode(&mut b);
        assert_eq!(b, &data[..used]);
    }
});
