//! Power-loss simulation of a region under every fsync policy (`workload::powerloss` describes
//! the scenario and what it checks). `kill -9` never loses the page cache, so only this kind of
//! test exercises an fsync policy; the `region_powerloss` fuzz target runs the same scenario on
//! arbitrary inputs.
//!
//! `DPUKV_POWERLOSS_SEEDS` sets how many seeds run per policy (default 30).

use std::time::Duration;

use dpukv_storage::vlog::FsyncPolicy;
use dpukv_storage::workload::powerloss::{self, Seeded};

#[test]
fn power_loss_keeps_every_promised_write_and_only_a_prefix() {
    let seeds: u64 = std::env::var("DPUKV_POWERLOSS_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    for policy in [FsyncPolicy::Always, FsyncPolicy::Interval(Duration::from_millis(2)), FsyncPolicy::Never] {
        let (mut promised, mut failed_syncs) = (0, 0);
        for seed in 1..=seeds {
            let dir = tempfile::tempdir().expect("tempdir");
            let out = powerloss::run(dir.path(), policy, &mut Seeded::new(seed), seed)
                .unwrap_or_else(|e| panic!("seed {seed}, {policy:?}: {e}"));
            if std::env::var("DPUKV_POWERLOSS_VERBOSE").is_ok() {
                eprintln!("seed {seed}, {policy:?}: {out:?}");
            }
            promised += out.promised;
            failed_syncs += out.failed_syncs;
        }
        // The scenario must have had something to lose and faults to survive.
        assert!(promised > 100 && failed_syncs > 0, "{policy:?}: {promised} promised, {failed_syncs} failed syncs");
    }
}
