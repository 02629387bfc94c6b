//! The backup location: an object store opened from a URL — `file:///path` (a directory) or
//! `s3://bucket/prefix` (endpoint and credentials from the usual `AWS_*` variables) — and the
//! content-named objects and manifests in it (docs/backup.md §3).
//!
//! Every object is put only if absent (create-if-absent: an object is never overwritten, so a
//! backup running beside another cannot damage what the other's manifest names) and read back
//! checked against its length and SHA-256. Every request has a deadline ([`REQUEST_TIMEOUT`]).
//! A manifest is put only if absent too, and read only up to [`MAX_MANIFEST`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutPayload};

use crate::BackupError;
use crate::manifest::{BACKUPS_PREFIX, BackupManifest, MAX_MANIFEST, OBJECTS_PREFIX, ObjectRef, hex, manifest_path};
use crate::throttle::Throttle;

/// The deadline of one request to the store (an object is at most a log segment: 64 MiB).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// A backup location.
#[derive(Clone)]
pub struct Location {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    /// For `file://`: the directory (objects are synced there: the store's own put does not).
    local: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Location").field("url", &self.url).finish_non_exhaustive()
    }
}

impl Location {
    /// Opens `url`: `file:///absolute/dir` (made if absent) or `s3://bucket[/prefix]` (the
    /// `AWS_*` variables: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// `AWS_REGION`, `AWS_ALLOW_HTTP`, ...).
    pub fn open(url: &str) -> Result<Location, BackupError> {
        Location::open_with(url, std::env::vars())
    }

    /// [`Location::open`] with the `AWS_*` settings taken from `env` instead of the process's
    /// environment.
    pub fn open_with(url: &str, env: impl IntoIterator<Item = (String, String)>) -> Result<Location, BackupError> {
        let bad = |why: &str| BackupError::Url(format!("{url}: {why}"));
        if let Some(dir) = url.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(bad("a file URL needs an absolute path (file:///dir)"));
            }
            std::fs::create_dir_all(dir).map_err(|e| bad(&e.to_string()))?;
            let store = object_store::local::LocalFileSystem::new_with_prefix(dir).map_err(|e| bad(&e.to_string()))?;
            return Ok(Location {
                store: Arc::new(store),
                prefix: String::new(),
                url: url.into(),
                local: Some(dir.into()),
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(bad("no bucket"));
            }
            let mut builder = object_store::aws::AmazonS3Builder::new();
            for (k, v) in env.into_iter().filter(|(k, _)| k.starts_with("AWS_")) {
                if k == "AWS_ALLOW_HTTP" {
                    builder = builder.with_allow_http(v == "true");
                } else if let Ok(key) = k.to_ascii_lowercase().parse::<object_store::aws::AmazonS3ConfigKey>() {
                    builder = builder.with_config(key, v);
                }
            }
            let store = builder.with_bucket_name(bucket).build().map_err(|e| bad(&e.to_string()))?;
            let prefix = prefix.trim_matches('/').to_string();
            if prefix.split('/').any(|p| p == "." || p == "..") {
                return Err(bad("'.' or '..' in the prefix"));
            }
            return Ok(Location { store: Arc::new(store), prefix, url: url.into(), local: None });
        }
        Err(bad("only file:///dir and s3://bucket/prefix are supported"))
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, rel: &str) -> Path {
        if self.prefix.is_empty() { Path::from(rel) } else { Path::from(format!("{}/{rel}", self.prefix)) }
    }

    /// Puts `bytes` as a content-named object unless the store holds it already; the object, and
    /// whether it was uploaded (false: the store had it — what makes a backup incremental).
    pub async fn put_object(&self, bytes: Bytes) -> Result<(ObjectRef, bool), BackupError> {
        self.put_object_throttled(Hashed::new(bytes), &Throttle::new(0)).await
    }

    /// [`Location::put_object`] of bytes already hashed (off the async runtime: a log segment's
    /// digest takes tens of milliseconds), taking the bytes of an upload from `throttle` first.
    pub async fn put_object_throttled(
        &self,
        hashed: Hashed,
        throttle: &Throttle,
    ) -> Result<(ObjectRef, bool), BackupError> {
        let Hashed { object, bytes } = hashed;
        let path = self.path(&object.path());
        match timed(self.store.head(&path)).await {
            Ok(meta) if meta.size == object.len => return Ok((object, false)),
            // A short or long object of that name: not what its name says (an interrupted
            // upload to a store without atomic puts); refused rather than trusted.
            Ok(meta) => {
                return Err(BackupError::Corrupt {
                    object: object.path(),
                    why: format!("the store holds {} bytes, its name says {}", meta.size, object.len),
                });
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        throttle.take(object.len).await;
        let put = self.store.put_opts(&path, PutPayload::from(bytes), PutMode::Create.into());
        match timed(put).await {
            Ok(_) => {}
            // Another upload put the same bytes meanwhile.
            Err(object_store::Error::AlreadyExists { .. }) => return Ok((object, false)),
            Err(e) => return Err(e.into()),
        }
        self.sync_local(&object.path())?;
        Ok((object, true))
    }

    /// Reads an object, checked against its length and SHA-256.
    pub async fn get_object(&self, object: &ObjectRef) -> Result<Bytes, BackupError> {
        let path = self.path(&object.path());
        let bytes = match timed(async { self.store.get(&path).await?.bytes().await }).await {
            Ok(b) => b,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(BackupError::Missing { object: object.path() });
            }
            Err(e) => return Err(e.into()),
        };
        check(object, &bytes)?;
        Ok(bytes)
    }

    /// Whether an object is there, whole (read back and its digest checked).
    pub async fn verify_object(&self, object: &ObjectRef) -> Result<(), BackupError> {
        self.get_object(object).await.map(|_| ())
    }

    /// Writes a backup's manifest — last: the backup exists from here on. Never overwrites one.
    pub async fn put_manifest(&self, m: &BackupManifest) -> Result<(), BackupError> {
        let rel = manifest_path(&m.id);
        let path = self.path(&rel);
        let put = self.store.put_opts(&path, PutPayload::from(m.encode()), PutMode::Create.into());
        match timed(put).await {
            Ok(_) => self.sync_local(&rel),
            Err(object_store::Error::AlreadyExists { .. }) => Err(BackupError::Exists(m.id.clone())),
            Err(e) => Err(e.into()),
        }
    }

    /// Backup `id`'s manifest.
    pub async fn manifest(&self, id: &str) -> Result<BackupManifest, BackupError> {
        if !valid_id(id) {
            return Err(BackupError::NotFound(id.into()));
        }
        let path = self.path(&manifest_path(id));
        let read = async {
            let meta = self.store.head(&path).await?;
            if meta.size > MAX_MANIFEST {
                return Ok(Err(BackupError::Corrupt {
                    object: manifest_path(id),
                    why: format!("{} bytes, more than a manifest may hold ({MAX_MANIFEST})", meta.size),
                }));
            }
            self.store.get(&path).await?.bytes().await.map(Ok)
        };
        let bytes = match timed(read).await {
            Ok(b) => b?,
            Err(object_store::Error::NotFound { .. }) => return Err(BackupError::NotFound(id.into())),
            Err(e) => return Err(e.into()),
        };
        let m = BackupManifest::decode(&bytes)?;
        if m.id != id {
            return Err(BackupError::Corrupt { object: manifest_path(id), why: format!("it names backup {}", m.id) });
        }
        Ok(m)
    }

    /// The ids of the backups whose manifests are there, oldest first.
    pub async fn list(&self) -> Result<Vec<String>, BackupError> {
        let listed = timed(self.store.list_with_delimiter(Some(&self.path(BACKUPS_PREFIX)))).await?;
        let mut ids: Vec<String> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(String::from))
            .filter(|id| valid_id(id))
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        ids.sort();
        for id in ids {
            let path = self.path(&manifest_path(&id));
            match timed(self.store.head(&path)).await {
                Ok(_) => out.push(id),
                // A backup that never finished: its manifest was never written.
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Ids name their cut's time to the second, then the fence's random id: backups of one
        // second are put in the order of their cuts, read from their manifests (a manifest that
        // cannot be read goes first: `verify` and `describe` say what is wrong with it).
        let mut i = 0;
        while i < out.len() {
            let second = crate::manifest::id_time_ms(&out[i]);
            let end = match second {
                Some(_) => out[i..]
                    .iter()
                    .position(|id| crate::manifest::id_time_ms(id) != second)
                    .map_or(out.len(), |n| i + n),
                None => i + 1,
            };
            if end - i > 1 {
                let mut group = Vec::with_capacity(end - i);
                for id in &out[i..end] {
                    let at = self.manifest(id).await.map_or(0, |m| m.taken_at_ms);
                    group.push((at, id.clone()));
                }
                group.sort();
                for (slot, (_, id)) in out[i..end].iter_mut().zip(group) {
                    *slot = id;
                }
            }
            i = end;
        }
        Ok(out)
    }

    /// Deletes backup `id`'s manifest: it no longer exists (its objects go with the next
    /// [`Location::sweep`] that no kept manifest names them in).
    pub async fn delete_backup(&self, id: &str) -> Result<(), BackupError> {
        self.manifest(id).await?;
        match timed(self.store.delete(&self.path(&manifest_path(id)))).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The backup to restore for time `at_ms` (Unix milliseconds): the latest whose cut
    /// committed at or before it (docs/backup.md §4).
    pub async fn backup_at(&self, at_ms: u64) -> Result<String, BackupError> {
        let ids = self.list().await?;
        // Ids name their time to the second: only those of `at`'s second need their manifest read.
        for id in ids.iter().rev().filter(|id| crate::manifest::id_time_ms(id).is_some_and(|t| t <= at_ms)) {
            if self.manifest(id).await?.taken_at_ms <= at_ms {
                return Ok(id.clone());
            }
        }
        Err(BackupError::NotFound(format!("at or before {at_ms} ms since the epoch")))
    }

    /// Applies a retention policy at `now_ms`: deletes the manifests of backups `keep` does not
    /// keep (never the latest); returns their ids. Their objects go with the next
    /// [`Location::sweep`].
    pub async fn expire(&self, keep: Retention, now_ms: u64) -> Result<Vec<String>, BackupError> {
        let ids = self.list().await?;
        let mut gone = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let newer = ids.len() - 1 - i;
            let in_last = keep.last.is_some_and(|n| newer < n.max(1));
            let young = keep
                .within
                .is_some_and(|d| crate::manifest::id_time_ms(id).is_none_or(|t| t + d.as_millis() as u64 >= now_ms));
            let nothing_asked = keep.last.is_none() && keep.within.is_none();
            if newer == 0 || in_last || young || nothing_asked {
                continue;
            }
            self.delete_backup(id).await?;
            gone.push(id.clone());
        }
        Ok(gone)
    }

    /// Deletes every object that no manifest there names and that is older than `grace` (an
    /// upload under way has objects its manifest will name once written: the grace covers it).
    /// Returns (objects deleted, bytes freed).
    pub async fn sweep(&self, grace: Duration) -> Result<(u64, u64), BackupError> {
        let mut named = std::collections::HashSet::new();
        for id in self.list().await? {
            for r in self.manifest(&id).await?.regions {
                named.extend(r.objects().map(|o| o.sha256.clone()));
            }
        }
        let cutoff = SystemTime::now() - grace;
        let objects: Vec<object_store::ObjectMeta> =
            timed(self.store.list(Some(&self.path(OBJECTS_PREFIX))).try_collect()).await?;
        let (mut deleted, mut freed) = (0, 0);
        for o in objects {
            let Some(name) = o.location.filename() else { continue };
            let old = SystemTime::from(o.last_modified) < cutoff;
            if named.contains(name) || !old {
                continue;
            }
            match timed(self.store.delete(&o.location)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                    deleted += 1;
                    freed += o.size;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok((deleted, freed))
    }

    /// For a directory location: syncs the file at `rel` and its directory, so a backup said
    /// written survives a power loss of the machine holding it.
    fn sync_local(&self, rel: &str) -> Result<(), BackupError> {
        let Some(root) = &self.local else { return Ok(()) };
        let file = root.join(rel);
        let sync = |p: &std::path::Path| std::fs::File::open(p).and_then(|f| f.sync_all());
        sync(&file).map_err(|e| BackupError::Io(format!("syncing {}: {e}", file.display())))?;
        if let Some(dir) = file.parent() {
            sync(dir).map_err(|e| BackupError::Io(format!("syncing {}: {e}", dir.display())))?;
        }
        Ok(())
    }
}

/// Bytes and the object they make (their SHA-256 and length), computed together so the two
/// cannot disagree.
#[derive(Debug, Clone)]
pub struct Hashed {
    object: ObjectRef,
    bytes: Bytes,
}

impl Hashed {
    /// Hashes `bytes` (CPU-bound: call it off an async runtime for large ones).
    pub fn new(bytes: Bytes) -> Hashed {
        let sha256 = hex(ring::digest::digest(&ring::digest::SHA256, &bytes).as_ref());
        Hashed { object: ObjectRef { sha256, len: bytes.len() as u64 }, bytes }
    }

    /// The object these bytes make.
    pub fn object(&self) -> &ObjectRef {
        &self.object
    }
}

/// Which backups a location keeps (docs/backup.md §3): those among the last `last`, and those
/// younger than `within`; the latest always. Neither given: every backup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// Keep the newest this many.
    pub last: Option<usize>,
    /// Keep those taken within this long.
    pub within: Option<Duration>,
}

/// Whether `bytes` are `object`.
pub fn check(object: &ObjectRef, bytes: &[u8]) -> Result<(), BackupError> {
    if bytes.len() as u64 != object.len {
        return Err(BackupError::Corrupt {
            object: object.path(),
            why: format!("{} bytes, the manifest says {}", bytes.len(), object.len),
        });
    }
    let sha = hex(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
    if sha != object.sha256 {
        return Err(BackupError::Corrupt { object: object.path(), why: format!("its SHA-256 is {sha}") });
    }
    Ok(())
}

/// Whether `id` can be a backup's id (what [`crate::manifest::backup_id`] makes: no path
/// separators or dots, so it cannot name anything outside `backups/`).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

async fn timed<T>(f: impl std::future::Future<Output = object_store::Result<T>>) -> object_store::Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(object_store::Error::Generic {
            store: "backup",
            source: format!("no answer within {REQUEST_TIMEOUT:?}").into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{FORMAT, LogObject, RegionPart, backup_id};

    fn dir_location() -> (tempfile::TempDir, Location) {
        let dir = tempfile::tempdir().expect("dir");
        let url = format!("file://{}", dir.path().join("backups").display());
        let loc = Location::open(&url).expect("open");
        (dir, loc)
    }

    fn manifest(id: &str, log: ObjectRef) -> BackupManifest {
        BackupManifest {
            format: FORMAT,
            id: id.into(),
            cluster: "c".into(),
            taken_at_ms: 1,
            fence: 1,
            replication: 1,
            regions: vec![RegionPart {
                id: 1,
                start: String::new(),
                end: None,
                epoch: 1,
                cut: 10,
                index: None,
                log: vec![LogObject { id: 1, size: 4096, object: log }],
            }],
            uploaded_bytes: 0,
        }
    }

    #[tokio::test]
    async fn an_object_is_uploaded_once_and_read_back_checked() {
        let (dir, loc) = dir_location();
        let (o, uploaded) = loc.put_object(Bytes::from_static(b"segment bytes")).await.expect("put");
        assert!(uploaded);
        let (again, uploaded) = loc.put_object(Bytes::from_static(b"segment bytes")).await.expect("put");
        assert_eq!((again, uploaded), (o.clone(), false), "the store holds it: not uploaded again");
        assert_eq!(loc.get_object(&o).await.expect("get"), Bytes::from_static(b"segment bytes"));
        // Damaged on the store's disk: refused, naming the object.
        let file = dir.path().join("backups").join(o.path());
        std::fs::write(&file, b"segment bytez").expect("damage");
        let e = loc.get_object(&o).await.expect_err("corrupt");
        assert_eq!(e.code(), "backup_object_corrupt", "{e}");
        assert!(e.to_string().contains(&o.sha256), "{e}");
        std::fs::write(&file, b"short").expect("damage");
        assert_eq!(loc.get_object(&o).await.expect_err("short").code(), "backup_object_corrupt");
        let e = loc.put_object(Bytes::from_static(b"segment bytes")).await.expect_err("a short object under its name");
        assert_eq!(e.code(), "backup_object_corrupt");
        std::fs::remove_file(&file).expect("lose it");
        assert_eq!(loc.get_object(&o).await.expect_err("missing").code(), "backup_object_missing");
    }

    #[tokio::test]
    async fn a_backup_exists_once_its_manifest_is_written_and_never_twice() {
        let (dir, loc) = dir_location();
        let (o, _) = loc.put_object(Bytes::from_static(b"log")).await.expect("put");
        let id = backup_id(1_795_784_783_000, 7);
        // An upload that never wrote its manifest (a stray file under backups/<id>/).
        let stray = dir.path().join("backups/backups/20000101T000000Z-00000001");
        std::fs::create_dir_all(&stray).expect("dir");
        std::fs::write(stray.join("part"), b"x").expect("stray");
        assert!(loc.list().await.expect("list").is_empty(), "no manifest, no backup");
        assert_eq!(loc.manifest(&id).await.expect_err("none").code(), "backup_not_found");
        let m = manifest(&id, o);
        loc.put_manifest(&m).await.expect("manifest");
        assert_eq!(loc.list().await.expect("list"), vec![id.clone()]);
        assert_eq!(loc.manifest(&id).await.expect("read"), m);
        assert_eq!(loc.put_manifest(&m).await.expect_err("twice").code(), "backup_exists");
        assert_eq!(loc.manifest("../../etc").await.expect_err("not an id").code(), "backup_not_found");
        loc.delete_backup(&id).await.expect("delete");
        assert!(loc.list().await.expect("list").is_empty());
    }

    #[tokio::test]
    async fn the_sweep_deletes_only_objects_no_backup_names() {
        let (_dir, loc) = dir_location();
        let (kept, _) = loc.put_object(Bytes::from_static(b"kept")).await.expect("put");
        let (orphan, _) = loc.put_object(Bytes::from_static(b"orphan")).await.expect("put");
        loc.put_manifest(&manifest(&backup_id(0, 1), kept.clone())).await.expect("manifest");
        assert_eq!(loc.sweep(Duration::from_secs(3600)).await.expect("sweep"), (0, 0), "too young to go");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(loc.sweep(Duration::ZERO).await.expect("sweep"), (1, 6));
        loc.get_object(&kept).await.expect("the named object stays");
        assert_eq!(loc.get_object(&orphan).await.expect_err("swept").code(), "backup_object_missing");
    }

    /// Backups taken at given times: the one for a time is the latest at or before it (to the
    /// millisecond, though ids name the second); retention keeps the last N or the young ones,
    /// and always the latest.
    #[tokio::test]
    async fn the_backup_for_a_time_and_retention() {
        let (_dir, loc) = dir_location();
        let (o, _) = loc.put_object(Bytes::from_static(b"log")).await.expect("put");
        let base = 1_795_784_783_000;
        let times = [base, base + 400, base + 10_000, base + 20_000];
        let mut ids = Vec::new();
        for (i, t) in times.iter().enumerate() {
            let id = backup_id(*t, i as u64 + 1);
            loc.put_manifest(&BackupManifest { taken_at_ms: *t, ..manifest(&id, o.clone()) }).await.expect("manifest");
            ids.push(id);
        }
        let at = |ms: u64| loc.backup_at(ms);
        assert_eq!(at(base).await.expect("at"), ids[0]);
        assert_eq!(at(base + 399).await.expect("at"), ids[0], "same second, cut later: not that one");
        assert_eq!(at(base + 400).await.expect("at"), ids[1]);
        assert_eq!(at(base + 19_999).await.expect("at"), ids[2]);
        assert_eq!(at(u64::MAX).await.expect("at"), ids[3]);
        assert_eq!(at(base - 1).await.expect_err("before every backup").code(), "backup_not_found");
        let now = base + 25_000;
        let keep_all = Retention::default();
        assert!(loc.expire(keep_all, now).await.expect("expire").is_empty(), "no policy keeps everything");
        let within = Retention { last: None, within: Some(Duration::from_secs(15)) };
        assert_eq!(loc.expire(within, now).await.expect("expire"), ids[..2].to_vec(), "older than 15 s");
        let last = Retention { last: Some(1), within: None };
        assert_eq!(loc.expire(last, u64::MAX).await.expect("expire"), vec![ids[2].clone()]);
        assert_eq!(loc.list().await.expect("list"), vec![ids[3].clone()], "the latest always stays");
        assert!(
            loc.expire(Retention { last: Some(0), within: Some(Duration::ZERO) }, u64::MAX)
                .await
                .expect("expire")
                .is_empty()
        );
    }

    /// Two backups cut in one second were listed in the order of their fences' random ids, not
    /// of their cuts (found by `backup::a_backup_under_chained_writes_restores_to_a_consistent_cut`,
    /// whose second and third backups fell in one second): `backup_at` could then pick the
    /// earlier of the two for a time after both, and retention could keep the older one as the
    /// latest. Backups of one second are now ordered by their cuts.
    #[tokio::test]
    async fn backups_cut_in_one_second_are_listed_in_the_order_of_their_cuts() {
        let (_dir, loc) = dir_location();
        let (o, _) = loc.put_object(Bytes::from_static(b"log")).await.expect("put");
        let base = 1_795_784_783_000;
        // The earlier cut has the larger fence id: by id alone it would sort last.
        let (t1, t2) = (base + 100, base + 900);
        let (first, second) = (backup_id(t1, 0xf000_0000), backup_id(t2, 0x0000_0001));
        assert!(second < first);
        for (id, t) in [(&first, t1), (&second, t2)] {
            loc.put_manifest(&BackupManifest { taken_at_ms: t, ..manifest(id, o.clone()) }).await.expect("manifest");
        }
        assert_eq!(loc.list().await.expect("list"), vec![first.clone(), second.clone()]);
        assert_eq!(loc.backup_at(base + 950).await.expect("at"), second, "the latest cut before the time");
        assert_eq!(loc.backup_at(base + 500).await.expect("at"), first);
        let last = Retention { last: Some(1), within: None };
        assert_eq!(loc.expire(last, u64::MAX).await.expect("expire"), vec![first], "the latest stays");
    }

    #[test]
    fn locations_are_file_or_s3_urls_and_ids_name_nothing_else() {
        for bad in ["ftp://x", "file://relative", "s3://", "/abs", "s3://b/../x"] {
            assert_eq!(Location::open(bad).expect_err(bad).code(), "backup_bad_location", "{bad}");
        }
        assert!(valid_id(&backup_id(0, 1)));
        for bad in ["", "a/b", "..", "a.b", &"x".repeat(65)] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}

/// The location on a real S3-protocol server: moto's, started here (`python3 -m moto.server`;
/// `scripts/test.sh` installs it).
#[cfg(test)]
mod s3_tests {
    use std::io::{Read, Write};
    use std::process::{Child, Command, Stdio};

    use super::*;
    use crate::manifest::{FORMAT, LogObject, RegionPart, backup_id};

    struct Moto(Child, u16);

    impl Drop for Moto {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn moto() -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
        let child = Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m moto.server (pip install 'moto[server]'; scripts/test.sh does)");
        let m = Moto(child, port);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "moto's server did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        m
    }

    /// `PUT /bucket` (path style): S3's CreateBucket, which moto takes unsigned.
    fn create_bucket(port: u16, bucket: &str) {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        write!(s, "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .expect("request");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("answer");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    fn env(port: u16) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}")),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "testing".into()),
            ("AWS_SECRET_ACCESS_KEY", "testing".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    #[tokio::test]
    async fn objects_and_manifests_on_an_s3_server() {
        let m = moto();
        create_bucket(m.1, "dpukv");
        let loc = Location::open_with("s3://dpukv/backups/prod", env(m.1)).expect("open");
        let (o, fresh) = loc.put_object(Bytes::from_static(b"a sealed segment")).await.expect("put");
        assert!(fresh);
        let (again, fresh) = loc.put_object(Bytes::from_static(b"a sealed segment")).await.expect("put");
        assert_eq!((again, fresh), (o.clone(), false), "the store holds it");
        assert_eq!(loc.get_object(&o).await.expect("get"), Bytes::from_static(b"a sealed segment"));
        let id = backup_id(1_795_784_783_000, 9);
        let manifest = BackupManifest {
            format: FORMAT,
            id: id.clone(),
            cluster: "c".into(),
            taken_at_ms: 1,
            fence: 9,
            replication: 3,
            regions: vec![RegionPart {
                id: 1,
                start: String::new(),
                end: None,
                epoch: 1,
                cut: 16,
                index: None,
                log: vec![LogObject { id: 1, object: o.clone(), size: 4096 }],
            }],
            uploaded_bytes: o.len,
        };
        assert!(loc.list().await.expect("list").is_empty());
        loc.put_manifest(&manifest).await.expect("manifest");
        assert_eq!(loc.put_manifest(&manifest).await.expect_err("twice").code(), "backup_exists");
        assert_eq!(loc.list().await.expect("list"), vec![id.clone()]);
        assert_eq!(loc.manifest(&id).await.expect("read"), manifest);
        let (orphan, _) = loc.put_object(Bytes::from_static(b"nobody names me")).await.expect("put");
        tokio::time::sleep(Duration::from_millis(1100)).await; // S3 times are in seconds
        assert_eq!(loc.sweep(Duration::ZERO).await.expect("sweep"), (1, orphan.len));
        loc.get_object(&o).await.expect("a named object stays");
        assert_eq!(loc.get_object(&orphan).await.expect_err("swept").code(), "backup_object_missing");
        loc.delete_backup(&id).await.expect("delete");
        assert!(loc.list().await.expect("list").is_empty());
        // Another bucket that does not exist: a typed store error, not a hang.
        let nowhere = Location::open_with("s3://no-such-bucket", env(m.1)).expect("open");
        let e = nowhere.put_object(Bytes::from_static(b"x")).await.expect_err("no bucket");
        assert_eq!(e.code(), "backup_store_failed", "{e}");
    }
}
