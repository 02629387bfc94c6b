//! Ports on 127.0.0.1 for the processes `dpukv local` and the test suites start, picked so that
//! two pickers on one machine never choose the same one.
//!
//! A port is picked at random in 20000–31999, outside the kernel's ephemeral range
//! (32768–60999 on Linux, where it hands out ports to outgoing connections by itself), and
//! reserved by an advisory lock on a file named after it in `$TMPDIR/dpukv-ports`, held until
//! this process exits: every picker here takes the lock before it probes the port, so a port
//! one process picked for a child it will (re)start is never picked by another, even while
//! nothing is bound to it (between a child's death and its restart). A port that cannot be
//! bound now (someone else's) is skipped.

use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;

/// The locks of the ports this process picked (held for its life).
static HELD: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());

/// The first port picked from, and how many.
const FIRST: u16 = 20_000;
const COUNT: u16 = 12_000;

/// A port free on 127.0.0.1 now and reserved for this process (see the module documentation);
/// after 256 tries that all find ports taken, one the kernel chooses (unreserved).
pub fn reserve() -> std::io::Result<u16> {
    let dir = std::env::temp_dir().join("dpukv-ports");
    std::fs::create_dir_all(&dir)?;
    for _ in 0..256 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
        let port = FIRST + (h.finish() % u64::from(COUNT)) as u16;
        let lock =
            std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(port.to_string()))?;
        if lock.try_lock().is_err() {
            continue; // another process holds it
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            HELD.lock().unwrap_or_else(|e| e.into_inner()).push(lock);
            return Ok(port);
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_port_is_not_picked_again_by_another_process() {
        let mine: std::collections::HashSet<u16> = (0..200).map(|_| reserve().expect("port")).collect();
        assert_eq!(mine.len(), 200, "a process picked a port twice");
        // Another process sees each of them locked (the lock is per open file description,
        // so a second open here stands for another process).
        let dir = std::env::temp_dir().join("dpukv-ports");
        for p in &mine {
            let f = std::fs::OpenOptions::new().write(true).open(dir.join(p.to_string())).expect("lock file");
            assert!(f.try_lock().is_err(), "port {p} is not reserved");
        }
    }
}
