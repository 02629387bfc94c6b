//! This process's own CPU time and resident memory, from `/proc/self` (Linux): what the device's
//! `stats` and the host's `/cluster/host` report for the console.

/// The process's CPU time (user + system) in milliseconds and its resident bytes (None where
/// `/proc/self` is not there).
pub fn usage() -> (Option<u64>, Option<u64>) {
    let cpu = std::fs::read_to_string("/proc/self/stat").ok().and_then(|s| {
        // The fields after the command (which may hold spaces) start after its last ')':
        // utime and stime are the 14th and 15th fields of the line, the 12th and 13th after it.
        let rest = s.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some(ticks * 10) // USER_HZ is 100 on every Linux (the kernel's ABI for /proc)
    });
    // VmRSS is in kB whatever the page size (64 KiB on some arm64 kernels).
    let rss = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    });
    (cpu, rss)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_process_uses_some_cpu_and_memory() {
        let busy = std::time::Instant::now();
        let mut x = 0u64;
        while busy.elapsed() < std::time::Duration::from_millis(50) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        let (cpu, rss) = super::usage();
        assert!(cpu.is_some_and(|c| c >= 10), "{cpu:?}");
        assert!(rss.is_some_and(|r| r > 1 << 20), "{rss:?}");
    }
}
