//! The cluster's key layout in the metadata store, under `/dpukv/<cluster>/` (docs/cluster.md §2),
//! and the cluster's stored configuration.

use crate::meta::MetaError;

/// Keys of one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: Vec<u8>,
}

fn id_key(prefix: &[u8], id: u32) -> Vec<u8> {
    // Zero-padded so that key order is id order.
    let mut k = prefix.to_vec();
    k.extend_from_slice(format!("{id:010}").as_bytes());
    k
}

/// The id at the end of a key made by [`Keys`], if it is one.
pub fn id_of(key: &[u8], prefix: &[u8]) -> Option<u32> {
    std::str::from_utf8(key.strip_prefix(prefix)?).ok()?.parse().ok()
}

impl Keys {
    /// The layout of cluster `name` (letters, digits, `-`, `_`, `.`; 1–253 characters: the
    /// operator names a cluster `NAMESPACE.NAME`, a Kubernetes namespace and resource name).
    pub fn new(name: &str) -> Result<Keys, MetaError> {
        let ok = (1..=253).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(MetaError::Invalid(format!("cluster name {name:?}: 1-253 letters, digits, '-', '_' or '.'")));
        }
        Ok(Keys { root: format!("/dpukv/{name}/").into_bytes() })
    }

    /// Everything of the cluster.
    pub fn root(&self) -> &[u8] {
        &self.root
    }

    fn under(&self, s: &str) -> Vec<u8> {
        let mut k = self.root.clone();
        k.extend_from_slice(s.as_bytes());
        k
    }

    /// Prefix of the live nodes' registrations.
    pub fn nodes(&self) -> Vec<u8> {
        self.under("nodes/")
    }

    /// A node's registration (bound to its lease).
    pub fn node(&self, id: u32) -> Vec<u8> {
        id_key(&self.nodes(), id)
    }

    /// Prefix of the regions.
    pub fn regions(&self) -> Vec<u8> {
        self.under("regions/")
    }

    /// A region.
    pub fn region(&self, id: u32) -> Vec<u8> {
        id_key(&self.regions(), id)
    }

    /// The master election's name.
    pub fn master(&self) -> Vec<u8> {
        self.under("master")
    }

    /// The master's last completed round: `<node> <unix ms>`, bound to the master's lease and
    /// written at most every [`crate::master::ROUND_MARK_EVERY`] — whether a master loop is alive,
    /// not only elected (`/cluster/summary`).
    pub fn master_round(&self) -> Vec<u8> {
        self.under("master-round")
    }

    /// The cluster's configuration.
    pub fn config(&self) -> Vec<u8> {
        self.under("config")
    }

    /// Prefix of drain requests (`drains/<node>`).
    pub fn drains(&self) -> Vec<u8> {
        self.under("drains/")
    }

    /// A drain request for a node.
    pub fn drain(&self, node: u32) -> Vec<u8> {
        id_key(&self.drains(), node)
    }

    /// Prefix of step-down requests (`step-downs/<node>`: the node's primaries move to backups
    /// elsewhere, its copies stay; the operator asks this before restarting a pod).
    pub fn step_downs(&self) -> Vec<u8> {
        self.under("step-downs/")
    }

    /// A step-down request for a node.
    pub fn step_down(&self, node: u32) -> Vec<u8> {
        id_key(&self.step_downs(), node)
    }

    /// Prefix of the catch-ups nodes report finished (`caught-up/<region>/<node>`, value the
    /// region's epoch; bound to the reporting node's lease).
    pub fn caught_up(&self) -> Vec<u8> {
        self.under("caught-up/")
    }

    /// Prefix of backups' log positions (`positions/<region>/<node>`, value `<epoch> <position>`:
    /// how far the node's copy of the region's log reaches, written once the region's primary is
    /// gone, bound to the reporting node's lease); the master promotes the furthest.
    pub fn positions(&self) -> Vec<u8> {
        self.under("positions/")
    }

    /// A backup's position report for a region.
    pub fn position_of(&self, region: u32, node: u32) -> Vec<u8> {
        let mut k = id_key(&self.positions(), region);
        k.push(b'/');
        k.extend_from_slice(format!("{node:010}").as_bytes());
        k
    }

    /// Prefix of backup fences (`fences/<id>`, and each primary's report
    /// `fences/<id>/<region>`, value `<epoch> <position>`), all bound to the lease of the
    /// fence's coordinator (docs/backup.md §2, [`crate::fence`]).
    pub fn fences(&self) -> Vec<u8> {
        self.under("fences/")
    }

    /// A backup fence.
    pub fn fence(&self, id: u64) -> Vec<u8> {
        let mut k = self.fences();
        k.extend_from_slice(format!("{id:020}").as_bytes());
        k
    }

    /// A primary's report of its cut for a fence.
    pub fn fence_report(&self, id: u64, region: u32) -> Vec<u8> {
        let mut k = self.fence(id);
        k.push(b'/');
        k.extend_from_slice(format!("{region:010}").as_bytes());
        k
    }

    /// Prefix of backup jobs (`backup-jobs/<fence id>`, the job's description, written by a
    /// fence's commit; and each primary's part `backup-jobs/<fence id>/<region>`), all bound to
    /// the lease of the backup's coordinator (docs/backup.md §3).
    pub fn backup_jobs(&self) -> Vec<u8> {
        self.under("backup-jobs/")
    }

    /// A backup job.
    pub fn backup_job(&self, id: u64) -> Vec<u8> {
        let mut k = self.backup_jobs();
        k.extend_from_slice(format!("{id:020}").as_bytes());
        k
    }

    /// A primary's report of its region's part of backup job `id`.
    pub fn backup_part(&self, id: u64, region: u32) -> Vec<u8> {
        let mut k = self.backup_job(id);
        k.push(b'/');
        k.extend_from_slice(format!("{region:010}").as_bytes());
        k
    }

    /// The cluster's backup schedule (`crate::schedule::BackupSchedule`): the master takes a
    /// backup every so often — each one a restore point (docs/backup.md §4).
    pub fn backup_schedule(&self) -> Vec<u8> {
        self.under("backup-schedule")
    }

    /// The last backup that finished (`crate::schedule::LastBackup`), written by its
    /// coordinator after the manifest.
    pub fn last_backup(&self) -> Vec<u8> {
        self.under("last-backup")
    }

    /// A restore under way (`restore-job`: where from, which backup; docs/backup.md §5),
    /// written by the restore's cut together with the backup's regions, deleted by the master
    /// once every region is open and copied (or by an abort). Bound to no lease: a restore
    /// outlives whoever began it.
    pub fn restore_job(&self) -> Vec<u8> {
        self.under("restore-job")
    }

    /// Prefix of the regions a restore makes (`restores/<region>`, value the backup's region
    /// id whose part it is, then the node that must fetch it if the region was given to
    /// another node; and `restores/<region>/<node>`, the node's report, bound to its
    /// lease: `opened` or `failed <why>`). A region here is not served until the restore ends.
    pub fn restores(&self) -> Vec<u8> {
        self.under("restores/")
    }

    /// A region being restored.
    pub fn restore_region(&self, region: u32) -> Vec<u8> {
        id_key(&self.restores(), region)
    }

    /// A node's report on a region it restores.
    pub fn restore_report(&self, region: u32, node: u32) -> Vec<u8> {
        let mut k = self.restore_region(region);
        k.push(b'/');
        k.extend_from_slice(format!("{node:010}").as_bytes());
        k
    }

    /// Prefix of stalled streams (`stalled/<region>/<node>`, value the region's epoch): the
    /// region's primary reports a backup or joining node that took no data for longer than its
    /// bound; bound to the primary's lease. The master demotes such a backup to joining (one
    /// fenced, epoch-bumping transaction), so writes go on without it.
    pub fn stalled(&self) -> Vec<u8> {
        self.under("stalled/")
    }

    /// A primary's report that `node` stalled in `region`.
    pub fn stalled_of(&self, region: u32, node: u32) -> Vec<u8> {
        let mut k = id_key(&self.stalled(), region);
        k.push(b'/');
        k.extend_from_slice(format!("{node:010}").as_bytes());
        k
    }

    /// Prefix of primary handovers not yet released (`handovers/<region>/<node>`, value the
    /// region's new epoch): the master writes one, bound to the old primary's lease, when it
    /// moves a region's primary away from a live node; that node deletes it once its device no
    /// longer serves the region. The new primary serves only when none names another node
    /// (docs/cluster.md §4, step 5).
    pub fn handovers(&self) -> Vec<u8> {
        self.under("handovers/")
    }

    /// A region's handover away from `node`.
    pub fn handover(&self, region: u32, node: u32) -> Vec<u8> {
        let mut k = id_key(&self.handovers(), region);
        k.push(b'/');
        k.extend_from_slice(format!("{node:010}").as_bytes());
        k
    }

    /// Prefix of running handoffs (`handoffs/<source region>`: a split or merge, docs/cluster.md §9).
    pub fn handoffs(&self) -> Vec<u8> {
        self.under("handoffs/")
    }

    /// The handoff a region gives its range in.
    pub fn handoff(&self, source: u32) -> Vec<u8> {
        id_key(&self.handoffs(), source)
    }

    /// Prefix of copied handoffs (`handoff-done/<source>`, value the handoff key's create
    /// revision; bound to the source primary's lease).
    pub fn handoffs_done(&self) -> Vec<u8> {
        self.under("handoff-done/")
    }

    /// The source primary's report that a handoff's range is copied.
    pub fn handoff_done(&self, source: u32) -> Vec<u8> {
        id_key(&self.handoffs_done(), source)
    }

    /// Prefix of region statistics (`region-stats/<region>`, reported by the primary under its
    /// lease: size, write rate, middle key).
    pub fn region_stats(&self) -> Vec<u8> {
        self.under("region-stats/")
    }

    /// A region's statistics.
    pub fn region_stat(&self, region: u32) -> Vec<u8> {
        id_key(&self.region_stats(), region)
    }

    /// Prefix of split requests (`split-requests/<region>`, value the key to split at).
    pub fn split_requests(&self) -> Vec<u8> {
        self.under("split-requests/")
    }

    /// A request to split a region.
    pub fn split_request(&self, region: u32) -> Vec<u8> {
        id_key(&self.split_requests(), region)
    }

    /// Prefix of merge requests (`merge-requests/<region>`: merge it into its left neighbour).
    pub fn merge_requests(&self) -> Vec<u8> {
        self.under("merge-requests/")
    }

    /// A request to merge a region into its left neighbour.
    pub fn merge_request(&self, region: u32) -> Vec<u8> {
        id_key(&self.merge_requests(), region)
    }

    /// The largest region id ever given (ids are never reused: a node may still hold files of a
    /// merged region).
    pub fn last_region_id(&self) -> Vec<u8> {
        self.under("last-region-id")
    }

    /// The custom resource's status as the operator last mirrored it (JSON; the console's).
    pub fn kubernetes(&self) -> Vec<u8> {
        self.under("kubernetes")
    }

    /// Prefix of the event log (`events/<seq>`, module `events`).
    pub fn events(&self) -> Vec<u8> {
        self.under("events/")
    }

    /// An event (zero-padded: key order is sequence order).
    pub fn event(&self, seq: u64) -> Vec<u8> {
        let mut k = self.events();
        k.extend_from_slice(format!("{seq:020}").as_bytes());
        k
    }

    /// A node's report that it finished copying a region.
    pub fn caught_up_of(&self, region: u32, node: u32) -> Vec<u8> {
        let mut k = id_key(&self.caught_up(), region);
        k.push(b'/');
        k.extend_from_slice(format!("{node:010}").as_bytes());
        k
    }
}

/// How replicas build their index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackupIndex {
    /// The primary ships each compaction's index segments (Tebis Send Index).
    Send,
    /// Backups replay their log copy and compact themselves (the baseline).
    Build,
}

/// The cluster's configuration (stored as `key=value` lines, readable with `etcdctl get`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// Replicas per region, primary included.
    pub replication: usize,
    /// The first layout's region boundaries.
    pub split_keys: Vec<Vec<u8>>,
    /// Send Index or Build Index.
    pub backup_index: BackupIndex,
    /// Most regions catching up at once for balancing.
    pub max_moves: usize,
    /// Split a region whose estimated size passes this many bytes (0: never by size).
    pub split_bytes: u64,
    /// Split a region taking more writes per second than this (0: never by load).
    pub split_writes_per_sec: u64,
    /// Merge neighbours that are both smaller than this many bytes, hold less than half of
    /// `split_bytes` together and are placed alike (0: never merge by themselves).
    pub merge_bytes: u64,
}

impl ClusterConfig {
    /// A configuration with this replication factor and split keys, and the defaults otherwise
    /// (Send Index, 2 moves at once, splits past [`DEFAULT_SPLIT_BYTES`], none by load, no
    /// merges by themselves).
    pub fn new(replication: usize, split_keys: Vec<Vec<u8>>) -> ClusterConfig {
        ClusterConfig {
            replication,
            split_keys,
            backup_index: BackupIndex::Send,
            max_moves: 2,
            split_bytes: DEFAULT_SPLIT_BYTES,
            split_writes_per_sec: 0,
            merge_bytes: 0,
        }
    }
}

/// Regions split past this estimated size by default: 64 MiB. A split copies the upper half
/// through the write path while writes to it are refused (retryable), so the size bounds that
/// pause: about 1.3 s for a 46 MB half on the development machine (docs/benchmarks.md).
pub const DEFAULT_SPLIT_BYTES: u64 = 64 << 20;

/// Bytes as lowercase hex (how keys are written in the text values of the layout): the control
/// API's paths' encoder.
pub use dpukv_proto::control::hex;

/// Hex back to bytes (None if malformed).
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

impl ClusterConfig {
    /// Encodes as `key=value` lines (split keys in hex, comma-separated).
    pub fn encode(&self) -> Vec<u8> {
        let splits: Vec<String> = self.split_keys.iter().map(|k| hex(k)).collect();
        let bi = match self.backup_index {
            BackupIndex::Send => "send",
            BackupIndex::Build => "build",
        };
        format!(
            "replication={}\nsplit_keys={}\nbackup_index={bi}\nmax_moves={}\nsplit_bytes={}\n\
             split_writes_per_sec={}\nmerge_bytes={}\n",
            self.replication,
            splits.join(","),
            self.max_moves,
            self.split_bytes,
            self.split_writes_per_sec,
            self.merge_bytes
        )
        .into_bytes()
    }

    /// Decodes what [`ClusterConfig::encode`] wrote; unknown keys are refused (a newer writer),
    /// missing ones take their defaults (an older writer).
    pub fn decode(b: &[u8]) -> Result<ClusterConfig, MetaError> {
        let bad = |m: String| MetaError::Invalid(format!("cluster config: {m}"));
        let text = std::str::from_utf8(b).map_err(|_| bad("not UTF-8".into()))?;
        let mut c = ClusterConfig::new(0, vec![]);
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let (k, v) = line.split_once('=').ok_or_else(|| bad(format!("line {line:?}")))?;
            match k {
                "replication" => c.replication = v.parse().map_err(|_| bad(format!("replication {v:?}")))?,
                "split_keys" if v.is_empty() => {}
                "split_keys" => {
                    c.split_keys = v
                        .split(',')
                        .map(|h| unhex(h).filter(|k| !k.is_empty()).ok_or_else(|| bad(format!("split key {h:?}"))))
                        .collect::<Result<_, _>>()?
                }
                "backup_index" => {
                    c.backup_index = match v {
                        "send" => BackupIndex::Send,
                        "build" => BackupIndex::Build,
                        _ => return Err(bad(format!("backup_index {v:?} (send or build)"))),
                    }
                }
                "max_moves" => c.max_moves = v.parse().map_err(|_| bad(format!("max_moves {v:?}")))?,
                "split_bytes" => c.split_bytes = v.parse().map_err(|_| bad(format!("split_bytes {v:?}")))?,
                "split_writes_per_sec" => {
                    c.split_writes_per_sec = v.parse().map_err(|_| bad(format!("split_writes_per_sec {v:?}")))?
                }
                "merge_bytes" => c.merge_bytes = v.parse().map_err(|_| bad(format!("merge_bytes {v:?}")))?,
                _ => return Err(bad(format!("unknown setting {k:?}"))),
            }
        }
        if c.replication == 0 {
            return Err(bad("replication must be at least 1".into()));
        }
        if c.split_keys.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad("split keys must ascend".into()));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_by_id_and_parse_back() {
        let k = Keys::new("prod-1").expect("name");
        assert!(k.node(9) < k.node(10), "zero-padded ids sort numerically");
        assert_eq!(id_of(&k.region(42), &k.regions()), Some(42));
        assert_eq!(k.caught_up_of(3, 7), b"/dpukv/prod-1/caught-up/0000000003/0000000007".to_vec());
        assert_eq!(k.position_of(3, 7), b"/dpukv/prod-1/positions/0000000003/0000000007".to_vec());
        assert!(Keys::new("a/b").is_err() && Keys::new("").is_err() && Keys::new(&"x".repeat(254)).is_err());
    }

    /// Regression: the operator names a cluster `NAMESPACE.NAME` (its pods' `DPUKV_CLUSTER`),
    /// which the layout refused (no `.` was allowed): node pods on Kubernetes could not join.
    #[test]
    fn a_cluster_named_by_the_operator_has_a_layout() {
        assert_eq!(Keys::new("db.demo").expect("NAMESPACE.NAME").root(), b"/dpukv/db.demo/");
        let longest = format!("{}.{}", "n".repeat(63), "c".repeat(189));
        assert!(Keys::new(&longest).is_ok());
    }

    #[test]
    fn config_round_trips_and_refuses_what_it_does_not_know() {
        let c = ClusterConfig {
            replication: 3,
            split_keys: vec![b"g".to_vec(), b"p\x00".to_vec()],
            backup_index: BackupIndex::Build,
            max_moves: 4,
            split_bytes: 1 << 20,
            split_writes_per_sec: 5000,
            merge_bytes: 1 << 16,
        };
        assert_eq!(ClusterConfig::decode(&c.encode()), Ok(c));
        // An older writer's configuration takes the defaults for what it did not write.
        let old = ClusterConfig::decode(b"replication=3\nsplit_keys=\nbackup_index=send\nmax_moves=2\n").expect("old");
        assert_eq!(old, ClusterConfig::new(3, vec![]));
        for bad in
            ["replication=0\n", "replication=3\nfuture=1\n", "replication=3\nsplit_keys=62,61\n", "replication=x"]
        {
            assert!(ClusterConfig::decode(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }
}
