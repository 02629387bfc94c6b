//! How big a region's L0 may be when the operator does not say: sized to the memory the pod has
//! (the Honeycomb tree in L0 is the fastest place to read from, so it should hold as much as
//! the pod can afford), within bounds.
//!
//! The budget is the smaller of an eighth of the memory limit (the cgroup's `memory.max`, else
//! the machine's memory) and a quarter of the shared directory's file system (the arenas live
//! there), divided among the regions, then clamped to [`MIN_L0`, `MAX_L0`]. An L0 can take up
//! to its budget twice over while the previous one is compacted, and the log it covers stays
//! replayable: recovery after a crash replays up to four budgets of log.

use std::path::Path;

/// The smallest automatic L0 budget.
pub const MIN_L0: u64 = 64 << 20;
/// The largest automatic L0 budget (bounds recovery's replay).
pub const MAX_L0: u64 = 4 << 30;

/// The automatic L0 budget per region for `regions` regions with arenas under `shm`.
pub fn auto_l0_budget(shm: &Path, regions: usize) -> u64 {
    let mem = memory_limit().unwrap_or(MIN_L0 * 8);
    let by_mem = mem / 8;
    let by_shm = fs_size(shm).map_or(u64::MAX, |b| b / 4);
    let per_region = by_mem.min(by_shm) / regions.max(1) as u64;
    (per_region.clamp(MIN_L0, MAX_L0) >> 20) << 20
}

/// The memory this process may use: its cgroup's limit (v2, then v1), else the machine's.
pub fn memory_limit() -> Option<u64> {
    let cgroup = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .filter_map(|s| s.trim().parse::<u64>().ok())
        .next();
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib << 10)
    });
    match (cgroup, total) {
        (Some(c), Some(t)) => Some(c.min(t)),
        (c, t) => c.or(t),
    }
}

/// The size of the file system holding `dir` (or its nearest existing ancestor).
fn fs_size(dir: &Path) -> Option<u64> {
    let existing = dir.ancestors().find(|p| p.exists())?;
    let st = rustix::fs::statvfs(existing).ok()?;
    Some(st.f_blocks.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_bounded_and_shared_among_regions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let one = auto_l0_budget(dir.path(), 1);
        assert!((MIN_L0..=MAX_L0).contains(&one), "{one}");
        assert_eq!(one % (1 << 20), 0);
        let many = auto_l0_budget(dir.path(), 1000);
        assert_eq!(many, MIN_L0, "a thousandth of the memory is below the floor");
        assert!(auto_l0_budget(dir.path(), 2) <= one);
        assert!(memory_limit().is_some_and(|m| m > 0));
    }
}
