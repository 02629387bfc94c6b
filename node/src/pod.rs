//! The pod's shared directory: what the host publishes there for the device, and where. Both
//! halves use this module; neither calls into the other.
//!
//! - `node.ctl`: an announcement (`dpukv_storage::announce`) whose payload is the region map; a
//!   new host marks the previous one closed, which the device notices with one atomic load and
//!   then reloads the map and its readers.
//! - `region-<id>/`: each region's shared memory (its control block, table sets and L0 arenas).
//! - `host.sock`: the host's unix socket, where the device forwards writes and atomics.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use dpukv_storage::announce::Announcement;

use crate::regions::RegionMap;

/// The host's socket.
pub fn socket_path(shm: &Path) -> PathBuf {
    shm.join("host.sock")
}

/// Region `id`'s shared memory.
pub fn region_dir(shm: &Path, id: u32) -> PathBuf {
    shm.join(format!("region-{id}"))
}

fn node_ctl(shm: &Path) -> PathBuf {
    shm.join("node.ctl")
}

/// Publishes the region map (the host, once its regions are open).
pub fn publish_map(shm: &Path, map: &RegionMap, valid_until: u64) -> Result<Announcement> {
    Announcement::publish(&node_ctl(shm), &map.encode(), valid_until).context("publishing the region map")
}

/// The region map the host published, and its announcement (to notice a newer host).
pub fn open_map(shm: &Path) -> Result<(RegionMap, Announcement)> {
    let a = Announcement::open(&node_ctl(shm)).context("opening the node's announcement")?;
    let map = RegionMap::decode(a.payload())?;
    Ok((map, a))
}
