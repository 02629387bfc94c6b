//! Fuzzes the HTTP front end's JSON bodies (`POST /v1/batch`, `POST /v1/atomic`, `PUT
//! /v1/kv/{key}`): arbitrary bytes never panic the parsing or the checking that turns a body
//! into operations, and what is accepted is within the protocol's limits (CI form: the
//! proptest `bodies_never_panic` in `gateway/src/http/mod.rs`).
#![no_main]

use dpukv_gateway::http::api::{AtomicBody, BatchBody, PutBody};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = serde_json::from_slice::<BatchBody>(data)
        && let Ok(ops) = b.ops()
    {
        assert!(!ops.is_empty() && ops.len() <= dpukv_proto::limits::MAX_BATCH_OPS);
    }
    if let Ok(a) = serde_json::from_slice::<AtomicBody>(data) {
        let _ = a.op();
    }
    let _ = serde_json::from_slice::<PutBody>(data);
});
