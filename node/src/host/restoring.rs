//! A node's side of a restore (docs/backup.md §5): fetching the part of each region a restore
//! gives it to lead, and its reports.
//!
//! A region of a restore under way is opened here only once its directory holds the backup's
//! part: its marker file ([`MARKER`], naming the backup and the part) is written and synced
//! after every file of the part, so a directory without it — a fetch killed halfway — is
//! emptied and fetched again. At most [`FETCHES`] regions are fetched at once; one that fails
//! (the location unreachable, an object missing or corrupt) is reported under the restore
//! (`failed <code>: <why>`) and tried again after [`RETRY`]. A region open here is reported
//! `opened` — fetched here, or promoted from a copy that caught up with the primary before it
//! died; the master ends the restore on those reports.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dpukv_backup::{BackupManifest, Location};
use dpukv_cluster::keys::Keys;
use dpukv_cluster::master::Snapshot;
use dpukv_cluster::restore::{RestoreJob, RestoreReport, report_txn};
use dpukv_cluster::{EtcdStore, LeaseId, MetaStore};
use tokio::sync::{Mutex, Semaphore};
use tokio::task::JoinHandle;

/// The file that says a region directory holds a backup's part in full.
pub const MARKER: &str = "RESTORED";
/// Regions fetched at once by a node.
pub const FETCHES: usize = 2;
/// How long a node waits before fetching a region again after a failure.
pub const RETRY: Duration = Duration::from_secs(3);

fn marker_text(job: &RestoreJob, part: u32) -> String {
    format!("{} {part}\n", job.backup)
}

/// Whether `dir` holds `job`'s part `part` in full.
pub fn restored(dir: &Path, job: &RestoreJob, part: u32) -> bool {
    std::fs::read_to_string(dir.join(MARKER)).is_ok_and(|m| m == marker_text(job, part))
}

/// The last manifest read, with the job it belongs to (shared by a node's fetches).
type CachedManifest = Arc<Mutex<Option<(RestoreJob, Arc<BackupManifest>)>>>;

/// The fetches of this node, and the manifest they read.
pub struct Restoring {
    fetches: HashMap<u32, JoinHandle<Result<u64, String>>>,
    failed: HashMap<u32, Instant>,
    slots: Arc<Semaphore>,
    /// The last manifest read, by (location, backup id): every region of a restore reads the same.
    manifest: CachedManifest,
}

impl Default for Restoring {
    fn default() -> Restoring {
        Restoring {
            fetches: HashMap::new(),
            failed: HashMap::new(),
            slots: Arc::new(Semaphore::new(FETCHES)),
            manifest: Arc::default(),
        }
    }
}

impl Restoring {
    /// Whether region `region` — led by this node by the map, not open here, not promoted from
    /// a copy — may be opened now: yes unless a restore makes it and `dir` does not hold its
    /// part yet; then a fetch into `dir` (and `shm`, emptied) runs, unless one runs already or
    /// failed less than [`RETRY`] ago.
    pub fn ready(&mut self, snap: &Snapshot, region: u32, dir: &Path, shm: &Path) -> bool {
        let Some(restore) = &snap.restore else { return true };
        let Some(rr) = restore.region(region) else { return true };
        if restored(dir, &restore.job, rr.part) {
            return true;
        }
        let recent = self.failed.get(&region).is_some_and(|t| t.elapsed() < RETRY);
        if !self.fetches.contains_key(&region) && !recent {
            let (job, part, dir, shm) = (restore.job.clone(), rr.part, dir.to_path_buf(), shm.to_path_buf());
            let (slots, manifest) = (self.slots.clone(), self.manifest.clone());
            tracing::info!(region, backup = %job.backup, part, "fetching a region's part of a backup");
            self.fetches.insert(region, tokio::spawn(fetch(job, part, dir, shm, slots, manifest)));
        }
        false
    }

    /// Whether this node (`me`) must fetch region `region` though it holds a copy: the restore
    /// gave it the region after its primary died, and `dir` holds no fetched part yet.
    pub fn must_refetch(&self, snap: &Snapshot, region: u32, me: u32, dir: &Path) -> bool {
        let Some(restore) = &snap.restore else { return false };
        restore.region(region).is_some_and(|rr| rr.fetch_by == Some(me) && !restored(dir, &restore.job, rr.part))
    }

    /// Ends fetches of regions no restore gives this node any more, collects finished ones, and
    /// writes this node's reports: a failure for each fetch that failed, `opened` for each
    /// region of the restore that is open here (`open`) and not reported so yet.
    pub async fn report(
        &mut self,
        snap: &Snapshot,
        me: u32,
        open: impl Fn(u32) -> bool,
        (store, keys, lease): (&EtcdStore, &Keys, LeaseId),
    ) {
        let Some(restore) = &snap.restore else {
            for (_, t) in self.fetches.drain() {
                t.abort();
            }
            self.failed.clear();
            return;
        };
        let mine = |id: u32| restore.region(id).is_some() && snap.map.region(id).is_some_and(|r| r.primary == me);
        self.fetches.retain(|&id, t| {
            let keep = mine(id);
            if !keep {
                t.abort();
            }
            keep
        });
        let done: Vec<u32> = self.fetches.iter().filter(|(_, t)| t.is_finished()).map(|(id, _)| *id).collect();
        for id in done {
            let t = self.fetches.remove(&id).expect("listed");
            let outcome = t.await.unwrap_or_else(|e| Err(format!("restore_fetch_failed: the fetch ended: {e}")));
            match outcome {
                Ok(bytes) => {
                    self.failed.remove(&id);
                    tracing::info!(region = id, bytes, "fetched a region's part of a backup");
                }
                Err(why) => {
                    tracing::warn!(region = id, error = %why, "fetching a region's part of a backup failed; trying again");
                    self.failed.insert(id, Instant::now());
                    let txn = report_txn(keys, restore, id, me, &RestoreReport::Failed(why), lease);
                    if let Err(e) = store.txn(txn).await {
                        tracing::debug!(region = id, error = %e, "reporting a failed fetch failed");
                    }
                }
            }
        }
        for (&id, rr) in &restore.regions {
            if mine(id) && open(id) && rr.reports.get(&me) != Some(&RestoreReport::Opened) {
                let txn = report_txn(keys, restore, id, me, &RestoreReport::Opened, lease);
                match store.txn(txn).await {
                    Ok(_) => tracing::info!(region = id, "restored region open"),
                    Err(e) => tracing::debug!(region = id, error = %e, "reporting a restored region failed; retrying"),
                }
            }
        }
    }
}

/// Empties `dir` and `shm`, then makes `dir` from the part (every object checked) and writes
/// its marker last. The error starts with its code.
async fn fetch(
    job: RestoreJob,
    part: u32,
    dir: PathBuf,
    shm: PathBuf,
    slots: Arc<Semaphore>,
    manifest: CachedManifest,
) -> Result<u64, String> {
    let _slot = slots.acquire_owned().await.map_err(|e| format!("restore_fetch_failed: {e}"))?;
    let coded = |e: dpukv_backup::BackupError| format!("{}: {e}", e.code());
    let loc = Location::open(&job.from).map_err(coded)?;
    let m = {
        let mut cached = manifest.lock().await;
        match cached.as_ref().filter(|(j, _)| *j == job) {
            Some((_, m)) => m.clone(),
            None => {
                let m = Arc::new(loc.manifest(&job.backup).await.map_err(coded)?);
                *cached = Some((job.clone(), m.clone()));
                m
            }
        }
    };
    let p = m.regions.iter().find(|p| p.id == part).ok_or_else(|| {
        format!(
            "restore_part_missing: backup {} has no region {part} (its manifest names {} regions)",
            job.backup,
            m.regions.len()
        )
    })?;
    let (d, s) = (dir.clone(), shm);
    blocking(move || {
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(&s);
    })
    .await?;
    let bytes = crate::backup::restore_region(&loc, p, &dir).await.map_err(coded)?;
    let text = marker_text(&job, part);
    blocking(move || -> std::io::Result<()> {
        use std::io::Write;
        let path = dir.join(MARKER);
        let mut f = std::fs::File::create(&path)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::File::open(&dir)?.sync_all()
    })
    .await?
    .map_err(|e| format!("backup_io: writing the restore's marker: {e}"))?;
    Ok(bytes)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f).await.map_err(|e| format!("restore_fetch_failed: {e}"))
}
