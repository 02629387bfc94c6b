//! A region's part of a backup (docs/backup.md §3, §5): a region's snapshot at a cut
//! (`storage::region::RegionSnapshot`) uploaded as content-named objects, and a region directory
//! made again from such a part.
//!
//! Uploading reads one file at a time (a level segment, or a log segment up to its share of the
//! snapshot) off the async runtime, takes its bytes from the node's bandwidth cap, and puts it
//! only if the location lacks it — so a backup after another uploads only what changed since:
//! new level segments, newly sealed log segments, and the cut's segment. Memory holds one file.
//!
//! Restoring fetches every object of the part, checks it against its digest (a corrupt or
//! missing object stops the restore, naming it), and writes the directory with
//! `storage::region::RestoreDir` — the manifest last, so a directory without one is not a
//! restored region and is made again from the start.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use dpukv_backup::manifest::{IndexObjects, LevelObject, LogObject, hex, unhex};
use dpukv_backup::throttle::Throttle;
use dpukv_backup::{BackupError, Hashed, Location, RegionPart};
use dpukv_proto::regionmap::RegionInfo;
use dpukv_storage::levels::Manifest;
use dpukv_storage::region::{RegionSnapshot, RestoreDir};

/// What uploading a region's part did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uploaded {
    /// The part, for the backup's manifest.
    pub part: RegionPart,
    /// Bytes put (objects the location did not hold yet).
    pub uploaded: u64,
}

/// Uploads `snap` — region `region` at its cut — to `loc`, at most at `throttle`'s rate.
pub async fn upload_region(
    loc: &Location,
    throttle: &Throttle,
    region: &RegionInfo,
    snap: &RegionSnapshot,
) -> Result<Uploaded, BackupError> {
    let mut uploaded = 0;
    let mut put = async |hashed: Hashed| -> Result<dpukv_backup::ObjectRef, BackupError> {
        let len = hashed.object().len;
        let (object, fresh) = loc.put_object_throttled(hashed, throttle).await?;
        if fresh {
            uploaded += len;
        }
        Ok(object)
    };
    let index = match &snap.index {
        None => None,
        Some(ix) => {
            let manifest = put(Hashed::new(Bytes::from(ix.manifest.encode()))).await?;
            let sessions = put(Hashed::new(Bytes::from(ix.sessions.clone()))).await?;
            let mut levels = Vec::new();
            for id in ix.levels.iter().flat_map(|l| l.segments.iter().copied()) {
                let bytes = read(ix.segment_path(id), None).await?;
                levels.push(LevelObject { id, object: put(bytes).await? });
            }
            Some(IndexObjects { manifest, sessions, levels })
        }
    };
    let mut log = Vec::with_capacity(snap.log.len());
    for f in &snap.log {
        let bytes = read(f.path.clone(), Some(f.len)).await?;
        log.push(LogObject { id: f.id, object: put(bytes).await?, size: f.size });
    }
    let part = RegionPart {
        id: region.id,
        start: hex(&region.start),
        end: region.end.as_deref().map(hex),
        epoch: region.epoch,
        cut: snap.cut.0,
        index,
        log,
    };
    Ok(Uploaded { part, uploaded })
}

/// Reads `path` (its first `len` bytes, if given) and hashes them, off the async runtime.
async fn read(path: PathBuf, len: Option<u64>) -> Result<Hashed, BackupError> {
    let shown = path.display().to_string();
    let r = tokio::task::spawn_blocking(move || -> std::io::Result<Hashed> {
        use std::io::Read;
        let f = std::fs::File::open(&path)?;
        let mut bytes = Vec::new();
        match len {
            Some(n) => {
                bytes.reserve_exact(usize::try_from(n).unwrap_or(0));
                f.take(n).read_to_end(&mut bytes)?;
                if (bytes.len() as u64) < n {
                    return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "shorter than its snapshot"));
                }
            }
            None => {
                let mut f = f;
                f.read_to_end(&mut bytes)?;
            }
        }
        Ok(Hashed::new(Bytes::from(bytes)))
    })
    .await;
    match r {
        Ok(Ok(h)) => Ok(h),
        Ok(Err(e)) => Err(BackupError::Io(format!("reading {shown}: {e}"))),
        Err(e) => Err(BackupError::Io(format!("reading {shown}: {e}"))),
    }
}

/// Makes region directory `dir` (absent or empty) from `part`, every object checked. Returns
/// the bytes written.
pub async fn restore_region(loc: &Location, part: &RegionPart, dir: &Path) -> Result<u64, BackupError> {
    let io =
        |e: dpukv_storage::Error| BackupError::Io(format!("restoring region {} into {}: {e}", part.id, dir.display()));
    let rd = RestoreDir::create(dir).map_err(io)?;
    let mut written = 0;
    let mut index = None;
    if let Some(ix) = &part.index {
        let manifest = loc.get_object(&ix.manifest).await?;
        let manifest = Manifest::decode(&manifest, Path::new(&ix.manifest.path())).map_err(io)?;
        let sessions = loc.get_object(&ix.sessions).await?;
        for l in &ix.levels {
            let bytes = loc.get_object(&l.object).await?;
            written += bytes.len() as u64;
            rd.level_segment(l.id, &bytes).map_err(io)?;
        }
        index = Some((manifest, sessions));
    }
    for l in &part.log {
        let bytes = loc.get_object(&l.object).await?;
        written += bytes.len() as u64;
        rd.log_segment(l.id, &bytes, l.size).map_err(io)?;
    }
    rd.finish(index.as_ref().map(|(m, s)| (m, s.as_ref()))).map_err(io)?;
    Ok(written)
}

/// The key range of a part: (start, end), decoded from hex.
pub fn part_range(part: &RegionPart) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
    let start = unhex(&part.start)?;
    let end = match &part.end {
        Some(e) => Some(unhex(e)?),
        None => None,
    };
    Some((start, end))
}

/// How a backup job goes, as `GET /cluster/backups/{job}` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct JobProgress {
    /// The job's number on this node.
    pub job: u64,
    /// `running`, `done` or `failed`.
    pub state: &'static str,
    /// The location.
    pub to: String,
    /// The backup's id, once its cut is taken.
    pub backup: Option<String>,
    /// Regions in the cut.
    pub regions: usize,
    /// Regions whose part is uploaded.
    pub parts: usize,
    /// Bytes uploaded (objects the location did not hold).
    pub uploaded_bytes: u64,
    /// Bytes the backup holds.
    pub bytes: u64,
    /// How long the fence held acknowledgements back (ms).
    pub fence_held_ms: u64,
    /// Why it failed.
    pub error: Option<String>,
}

impl JobProgress {
    /// Job `job` to `to`, just started: running, nothing done yet.
    pub fn running(job: u64, to: &str) -> JobProgress {
        JobProgress {
            job,
            state: "running",
            to: to.to_string(),
            backup: None,
            regions: 0,
            parts: 0,
            uploaded_bytes: 0,
            bytes: 0,
            fence_held_ms: 0,
            error: None,
        }
    }
}

/// How long a backup job may take before it fails.
pub const JOB_DEADLINE: Duration = Duration::from_secs(3600);
/// How often the coordinator looks at the parts and keeps its lease alive.
const JOB_POLL: Duration = Duration::from_millis(200);

/// Runs a backup of the cluster to `to` (docs/backup.md §2–3): takes a consistent cut whose
/// commit starts the job, waits for every region's primary to upload its part (keeping the job's
/// lease alive), and writes the manifest last. `progress` follows along. The job's keys go with
/// its lease at the end, however it ends.
pub async fn coordinate<S: dpukv_cluster::MetaStore>(
    s: &S,
    keys: &dpukv_cluster::keys::Keys,
    cluster: &str,
    to: &str,
    progress: &std::sync::Mutex<JobProgress>,
) -> Result<dpukv_backup::BackupManifest, String> {
    use dpukv_cluster::fence::{CutOptions, take_cut};
    let began = std::time::Instant::now();
    let set = |f: &dyn Fn(&mut JobProgress)| f(&mut progress.lock().unwrap_or_else(|e| e.into_inner()));
    let loc = Location::open(to).map_err(|e| format!("{}: {e}", e.code()))?;
    let job = dpukv_backup::job::JobSpec { to: to.to_string() };
    let opts = CutOptions { job: Some(job.encode()), ..CutOptions::default() };
    let cut = take_cut(s, keys, opts).await.map_err(|e| format!("{}: {e}", e.code()))?;
    let lease = cut.lease.ok_or("the cut came without its job's lease")?;
    let taken_at_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let id = dpukv_backup::manifest::backup_id(taken_at_ms, cut.id);
    set(&|p| {
        p.backup = Some(id.clone());
        p.regions = cut.map.regions.len();
        p.fence_held_ms = cut.held.as_millis() as u64;
    });
    let out = collect(s, keys, &cut, lease, progress).await;
    let out = match out {
        Ok(parts) => {
            let replication = match dpukv_cluster::master::read(s, keys).await {
                Ok(snap) => snap.config.map_or(0, |c| c.replication),
                Err(e) => return Err(format!("{}: {e}", e.code())),
            };
            let uploaded_bytes = parts.iter().map(|(_, u)| u).sum();
            let manifest = dpukv_backup::BackupManifest {
                format: dpukv_backup::manifest::FORMAT,
                id: id.clone(),
                cluster: cluster.to_string(),
                taken_at_ms,
                fence: cut.id,
                replication,
                regions: parts.into_iter().map(|(p, _)| p).collect(),
                uploaded_bytes,
            };
            // Last: the backup exists from here on.
            match loc.put_manifest(&manifest).await {
                Ok(()) => {
                    // For every node's metrics and the schedule's next run (a record only: the
                    // backup exists whether or not this is written).
                    let last = dpukv_cluster::schedule::LastBackup {
                        id: manifest.id.clone(),
                        to: to.to_string(),
                        at_ms: taken_at_ms,
                        bytes: manifest.bytes(),
                        uploaded: manifest.uploaded_bytes,
                        took_ms: began.elapsed().as_millis() as u64,
                    };
                    if let Err(e) = s.put(&keys.last_backup(), &last.encode(), None).await {
                        tracing::warn!(error = %e, "recording the last backup failed");
                    }
                    Ok(manifest)
                }
                Err(e) => Err(format!("{}: {e}", e.code())),
            }
        }
        Err(e) => Err(e),
    };
    if let Err(e) = s.revoke(lease).await {
        tracing::debug!(error = %e, "revoking a backup job's lease failed (it ends by itself)");
    }
    out
}

/// Waits for every region's part of the job (cut `cut`), keeping its lease alive: the parts in
/// key order, each with what it uploaded, the key ranges and epochs the cut's map gave them.
async fn collect<S: dpukv_cluster::MetaStore>(
    s: &S,
    keys: &dpukv_cluster::keys::Keys,
    cut: &dpukv_cluster::fence::Cut,
    lease: dpukv_cluster::meta::LeaseId,
    progress: &std::sync::Mutex<JobProgress>,
) -> Result<Vec<(RegionPart, u64)>, String> {
    use dpukv_backup::job::PartReport;
    let began = std::time::Instant::now();
    // Each primary's lease when first looked at.
    let mut lives: std::collections::HashMap<u32, Option<dpukv_cluster::meta::LeaseId>> = Default::default();
    loop {
        s.keep_alive(lease).await.map_err(|e| format!("keeping the backup job alive: {e}"))?;
        // The job's key and its parts (ids are fixed-width: the key is a prefix of nothing else).
        let (kvs, _) = s.range(&keys.backup_job(cut.id)).await.map_err(|e| format!("{}: {e}", e.code()))?;
        let job = dpukv_cluster::fence::jobs_in(&kvs, keys).into_iter().find(|j| j.id == cut.id);
        let job = job.ok_or("the backup job's key is gone (its lease ended)")?;
        let mut reports = std::collections::BTreeMap::new();
        for (region, value) in &job.parts {
            reports.insert(*region, PartReport::decode(value)?);
        }
        let mut parts = Vec::new();
        let (mut uploaded, mut bytes) = (0, 0);
        for r in &cut.map.regions {
            match reports.get(&r.id) {
                Some(PartReport::Failed { error }) => return Err(format!("region {}: {error}", r.id)),
                Some(PartReport::Done { part, uploaded: u }) => {
                    if cut.positions.get(&r.id) != Some(&part.cut) {
                        return Err(format!(
                            "region {}: a part at {} for a cut at {:?}",
                            r.id,
                            part.cut,
                            cut.positions.get(&r.id)
                        ));
                    }
                    let part = RegionPart {
                        start: hex(&r.start),
                        end: r.end.as_deref().map(hex),
                        epoch: r.epoch,
                        ..part.clone()
                    };
                    uploaded += u;
                    bytes += part.bytes();
                    parts.push((part, *u));
                }
                None => {}
            }
        }
        {
            let mut p = progress.lock().unwrap_or_else(|e| e.into_inner());
            p.parts = parts.len();
            p.uploaded_bytes = uploaded;
            p.bytes = bytes;
        }
        if parts.len() == cut.map.regions.len() {
            return Ok(parts);
        }
        // A primary that left or restarted (registered under another lease than the one it
        // fenced under) took its snapshot with it: its part never comes.
        if let Ok(snap) = dpukv_cluster::master::read(s, keys).await {
            for r in cut.map.regions.iter().filter(|r| !reports.contains_key(&r.id)) {
                let now = snap.node_leases.get(&r.primary).map(|(l, _)| *l);
                let fenced_under = cut.reporters.get(&r.id).map(|l| Some(*l));
                let first = *lives.entry(r.primary).or_insert(fenced_under.unwrap_or(now));
                if now.is_none() || now != first {
                    return Err(format!(
                        "node {} left or restarted before uploading region {}'s part: take the backup again",
                        r.primary, r.id
                    ));
                }
            }
        }
        if began.elapsed() > JOB_DEADLINE {
            return Err(format!("not every region's part came within {JOB_DEADLINE:?}"));
        }
        tokio::time::sleep(JOB_POLL).await;
    }
}

/// Begins restoring backup `backup` from `from` into the cluster, which must hold no key
/// (docs/backup.md §5): the latest at the location if None, the latest taken at or before a
/// time for `at-<unix ms>` (§4). Reads the backup's manifest, then takes the restore's cut,
/// whose commit lays the backup's regions out. Following a restore of the same backup already
/// under way is not an error (a restore begun again after an interruption goes on); another
/// one under way is. Errors start with their code.
pub async fn begin_restore<S: dpukv_cluster::MetaStore>(
    s: &S,
    keys: &dpukv_cluster::keys::Keys,
    from: &str,
    backup: Option<&str>,
) -> Result<dpukv_cluster::restore::RestoreJob, String> {
    use dpukv_cluster::fence::{CutOptions, take_cut};
    use dpukv_cluster::restore::{PartRange, RestoreJob, RestorePlan};
    let coded = |e: BackupError| format!("{}: {e}", e.code());
    let loc = Location::open(from).map_err(coded)?;
    let id = match backup {
        Some(at) if at.starts_with("at-") => {
            let ms = at[3..].parse().map_err(|_| format!("restore_refused: {at:?} is not at-<unix ms>"))?;
            loc.backup_at(ms).await.map_err(coded)?
        }
        Some(id) => id.to_string(),
        None => {
            loc.list().await.map_err(coded)?.pop().ok_or_else(|| format!("backup_not_found: no backup at {from}"))?
        }
    };
    let job = RestoreJob { from: from.to_string(), backup: id.clone() };
    let snap = dpukv_cluster::master::read(s, keys).await.map_err(|e| format!("{}: {e}", e.code()))?;
    if snap.restore.as_ref().is_some_and(|r| r.job == job) {
        return Ok(job);
    }
    let manifest = loc.manifest(&id).await.map_err(coded)?;
    let mut parts = Vec::with_capacity(manifest.regions.len());
    for p in &manifest.regions {
        let (start, end) =
            part_range(p).ok_or_else(|| format!("backup_manifest_invalid: region {}'s range is not hex", p.id))?;
        parts.push(PartRange { part: p.id, start, end });
    }
    let plan = RestorePlan { job: job.clone(), parts };
    take_cut(s, keys, CutOptions { restore: Some(plan), ..CutOptions::default() })
        .await
        .map_err(|e| format!("{}: {e}", e.code()))?;
    Ok(job)
}

/// How often the schedule's runner looks whether a backup is due.
const SCHEDULE_POLL: Duration = Duration::from_millis(250);
/// How often the schedule's runner deletes the objects no kept backup names.
const SWEEP_EVERY: Duration = Duration::from_secs(600);

/// Runs the cluster's backup schedule (docs/backup.md §4) while this node is the master: a
/// backup to the schedule's location whenever the last one there is `every` old, or a time of
/// its cron expression passed since it (from the
/// `last-backup` record, so a new master goes on where the old one stopped), then the
/// schedule's retention; objects no kept backup names are swept at most every
/// [`SWEEP_EVERY`], once older than a backup may take ([`JOB_DEADLINE`]). A failed backup is
/// tried again after `every`. Ends on `shutdown`.
pub async fn run_schedule(
    etcd: dpukv_cluster::EtcdOptions,
    keys: dpukv_cluster::keys::Keys,
    cluster: String,
    master: dpukv_cluster::master::LoopStatus,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut store = None;
    let mut last_try: Option<std::time::Instant> = None;
    let mut last_sweep: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(SCHEDULE_POLL) => {}
        }
        if !master.leading() {
            continue;
        }
        if store.is_none() {
            store = dpukv_cluster::EtcdStore::connect(&etcd).await.ok();
        }
        let Some(s) = &store else { continue };
        let Ok(snap) = dpukv_cluster::master::read(s, &keys).await else { continue };
        let Some(plan) = snap.backup_schedule else { continue };
        let now_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let last_ms = snap.last_backup.filter(|b| b.to == plan.to).map_or(0, |b| b.at_ms);
        if !plan.due(last_ms, now_ms) || last_try.is_some_and(|t| t.elapsed() < plan.every) || snap.restore.is_some() {
            continue;
        }
        last_try = Some(std::time::Instant::now());
        let progress = std::sync::Mutex::new(JobProgress::running(0, &plan.to));
        match coordinate(s, &keys, &cluster, &plan.to, &progress).await {
            Ok(m) => {
                tracing::info!(backup = %m.id, to = %plan.to, uploaded = m.uploaded_bytes, "scheduled backup done")
            }
            Err(e) => {
                tracing::warn!(to = %plan.to, error = %e, "a scheduled backup failed; trying again after its interval");
                continue;
            }
        }
        let Ok(loc) = Location::open(&plan.to) else { continue };
        let keep = dpukv_backup::Retention { last: plan.keep_last, within: plan.keep_within };
        match loc.expire(keep, now_ms).await {
            Ok(gone) if !gone.is_empty() => {
                tracing::info!(expired = gone.len(), "backups past the schedule's retention deleted")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "applying the schedule's retention failed"),
        }
        if last_sweep.is_none_or(|t| t.elapsed() >= SWEEP_EVERY) {
            last_sweep = Some(std::time::Instant::now());
            match loc.sweep(JOB_DEADLINE + Duration::from_secs(600)).await {
                Ok((n, freed)) if n > 0 => tracing::info!(objects = n, freed, "objects no kept backup names deleted"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "sweeping the backup location failed"),
            }
        }
    }
}

/// A restore's progress, as `GET /cluster/restore` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RestoreProgress {
    /// `running`, or `none` (no restore under way: ended, aborted, or never begun).
    pub state: &'static str,
    /// The location.
    pub from: Option<String>,
    /// The backup's id.
    pub backup: Option<String>,
    /// Regions the restore makes.
    pub regions: usize,
    /// Of those, open at their primaries.
    pub opened: usize,
    /// Of those, open and with every copy.
    pub copied: usize,
    /// The nodes' latest failures, as `region <id> on node <id>: <why>`.
    pub errors: Vec<String>,
}

/// The restore under way in `snap`, if any.
pub fn restore_progress(snap: &dpukv_cluster::master::Snapshot) -> RestoreProgress {
    use dpukv_cluster::restore::{RestoreReport, Waiting, waiting};
    let Some(r) = &snap.restore else {
        return RestoreProgress {
            state: "none",
            from: None,
            backup: None,
            regions: 0,
            opened: 0,
            copied: 0,
            errors: vec![],
        };
    };
    let waits = waiting(snap, r);
    let opening = waits.iter().filter(|w| matches!(w, Waiting::Opening(_))).count();
    let errors = r
        .regions
        .iter()
        .flat_map(|(id, rr)| {
            rr.reports.iter().filter_map(move |(n, rep)| match rep {
                RestoreReport::Failed(why) => Some(format!("region {id} on node {n}: {why}")),
                RestoreReport::Opened => None,
            })
        })
        .collect();
    RestoreProgress {
        state: "running",
        from: Some(r.job.from.clone()),
        backup: Some(r.job.backup.clone()),
        regions: r.regions.len(),
        opened: r.regions.len() - opening,
        copied: r.regions.len() - waits.len(),
        errors,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use dpukv_storage::region::{Region, RegionConfig};
    use dpukv_storage::vlog::FsyncPolicy;

    use super::*;

    fn config(dir: &Path, name: &str) -> RegionConfig {
        let mut cfg = RegionConfig::tiny(dir.join(name), dir.join(format!("{name}-shm")), FsyncPolicy::Always);
        cfg.l0_budget = 64 << 10;
        cfg.vlog.segment_size = 64 << 10;
        cfg
    }

    fn write(r: &mut Region, m: &mut BTreeMap<Vec<u8>, Vec<u8>>, round: u64) {
        for k in 0..400u64 {
            let key = format!("key{k:04}").into_bytes();
            let v = vec![(k + round) as u8; 100 + ((k * 7 + round) % 300) as usize];
            r.put(&key, &v).expect("put");
            m.insert(key, v);
            if k.is_multiple_of(100) {
                r.maintain().expect("maintain");
            }
        }
    }

    fn contents(r: &Region) -> BTreeMap<Vec<u8>, Vec<u8>> {
        r.scan(b"", b"\xff", usize::MAX).expect("scan").into_iter().collect()
    }

    fn info(id: u32) -> RegionInfo {
        RegionInfo {
            id,
            start: b"a".to_vec(),
            end: Some(b"z".to_vec()),
            primary: 1,
            backups: vec![],
            joining: vec![],
            epoch: 4,
            state: dpukv_proto::regionmap::RegionState::Serving,
        }
    }

    /// A region uploaded at its cut, written on, uploaded again: the second upload puts only the
    /// objects the location lacks (what changed); each restores to exactly its cut; a damaged object stops a restore, naming
    /// it.
    #[tokio::test]
    async fn a_region_s_part_restores_to_its_cut_and_the_next_one_uploads_what_changed() {
        let dir = tempfile::tempdir().expect("dir");
        let loc = Location::open(&format!("file://{}", dir.path().join("store").display())).expect("location");
        let throttle = Throttle::new(0);
        let mut r = Region::open(config(dir.path(), "data")).expect("open").0;
        let mut m = BTreeMap::new();
        for round in 0..6 {
            write(&mut r, &mut m, round);
        }
        let first_state = m.clone();
        let first = upload_region(&loc, &throttle, &info(3), &r.snapshot().expect("snapshot")).await.expect("upload");
        assert!(first.part.index.is_some() && first.part.log.len() > 2, "{:?}", first.part);
        assert_eq!(first.uploaded, first.part.bytes(), "a first upload puts everything");
        assert_eq!((first.part.start.as_str(), first.part.end.as_deref(), first.part.epoch), ("61", Some("7a"), 4));
        write(&mut r, &mut m, 6);
        let second = upload_region(&loc, &throttle, &info(3), &r.snapshot().expect("snapshot")).await.expect("upload");
        // Exactly the objects the first did not have were uploaded — the sealed log segments
        // and level segments it had were not — and that is less than the whole.
        let had: std::collections::HashSet<&str> = first.part.objects().map(|o| o.sha256.as_str()).collect();
        let fresh: std::collections::HashMap<&str, u64> = second
            .part
            .objects()
            .filter(|o| !had.contains(o.sha256.as_str()))
            .map(|o| (o.sha256.as_str(), o.len))
            .collect();
        assert_eq!(second.uploaded, fresh.values().sum::<u64>(), "only what the location lacked");
        assert!(
            second.uploaded > 0 && second.uploaded < second.part.bytes(),
            "an upload after one more round puts what changed, not the whole: {} of {}",
            second.uploaded,
            second.part.bytes()
        );
        for (part, want, name) in [(&first.part, &first_state, "r1"), (&second.part, &m, "r2")] {
            restore_region(&loc, part, &dir.path().join(name)).await.expect("restore");
            let restored = Region::open(config(dir.path(), name)).expect("open the restored region").0;
            assert_eq!(&contents(&restored), want, "{name}: exactly the region at its cut");
        }
        // A damaged object: the restore stops and names it; nothing is opened from it.
        let victim = &second.part.log[0].object;
        std::fs::write(dir.path().join("store").join(victim.path()), b"damaged").expect("damage");
        let e = restore_region(&loc, &second.part, &dir.path().join("r3")).await.expect_err("corrupt");
        assert_eq!(e.code(), "backup_object_corrupt", "{e}");
        assert!(e.to_string().contains(&victim.sha256));
        assert_eq!(part_range(&first.part), Some((b"a".to_vec(), Some(b"z".to_vec()))));
    }
}
