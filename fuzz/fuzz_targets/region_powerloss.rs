//! A region under a simulated power loss, driven by the fuzzer's bytes (the scenario and its
//! checks are `dpukv_storage::workload::powerloss`): every promised write survives, the state is
//! a prefix of the history, recovery never fails.
#![no_main]

use dpukv_storage::vlog::FsyncPolicy;
use dpukv_storage::workload::powerloss::{self, FromBytes};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&p, rest)) = data.split_first() else { return };
    let policy = match p % 3 {
        0 => FsyncPolicy::Always,
        1 => FsyncPolicy::Interval(std::time::Duration::from_millis(2)),
        _ => FsyncPolicy::Never,
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = rest.iter().fold(0u64, |h, &b| h.rotate_left(5) ^ b as u64);
    if let Err(e) = powerloss::run(dir.path(), policy, &mut FromBytes::new(rest), seed) {
        panic!("{policy:?}: {e}");
    }
});
