//! Fuzzes the protocol decoders: arbitrary bytes must never panic, and whatever decodes must
//! re-encode to a frame that decodes to the same thing.
#![no_main]

use dpukv_proto::{decode_requests, decode_responses, encode_requests, encode_responses, frame_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = frame_header(data);
    if let Ok(entries) = decode_requests(data) {
        let reqs: Vec<_> = entries.into_iter().flatten().collect();
        let mut buf = Vec::new();
        encode_requests(&reqs, &mut buf);
        let again: Vec<_> = decode_requests(&buf).expect("re-encoded frame decodes").into_iter().flatten().collect();
        assert_eq!(again, reqs);
    }
    if let Ok(resps) = decode_responses(data) {
        let mut buf = Vec::new();
        encode_responses(&resps, &mut buf);
        assert_eq!(decode_responses(&buf).expect("re-encoded frame decodes"), resps);
    }
});
