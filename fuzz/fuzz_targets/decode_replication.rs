//! Fuzzes the replication protocol's decoder (what a backup reads from whoever connects to its
//! replication port, and a primary from its backups): arbitrary bytes must never panic or
//! allocate past the frame, and whatever decodes must re-encode to a frame that decodes to the
//! same message.
#![no_main]

use dpukv_proto::replication::ReplMessage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((m, used)) = ReplMessage::decode(data) {
        assert!(used <= data.len());
        let mut buf = Vec::new();
        m.encode(&mut buf);
        let (again, n) = ReplMessage::decode(&buf).expect("a re-encoded message decodes");
        assert_eq!(n, buf.len());
        assert_eq!(again, m);
    }
});
