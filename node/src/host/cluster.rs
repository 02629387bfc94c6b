//! The host as a member of a cluster (docs/cluster.md): it connects to etcd (retrying with
//! backoff while etcd is unreachable), writes the cluster's configuration if it is the first,
//! registers under a lease (keeping its authority current), runs for master, serves replication
//! connections as a backup, and then follows the region map: it opens the regions it leads (with
//! senders to their backups and joining nodes), backs the ones it is a backup of, hands regions
//! over when the map moves them, reports finished catch-ups, holds its regions for backup fences
//! (docs/backup.md §2), and publishes the map for its device.
//! For splits and merges (docs/cluster.md §9) it leads a split's new region before the map has
//! it, drives the copy of the regions it leads (module `handoff`), tells each writer the ranges
//! its region keeps, and reports its regions' sizes.
//!
//! What this node may do never depends on its own guesses: it serves a region only while the map
//! in etcd names it primary *and* its lease-bound authority holds; a node that lost a region
//! throws its copy away (its log may hold records the new primary never had) and copies again if
//! it is given the region back.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use dpukv_backup::Location;
use dpukv_backup::job::{JobSpec, PartReport};
use dpukv_backup::throttle::{Pace, Throttle};
use dpukv_cluster::fence::{FenceHolder, FenceStep};
use dpukv_cluster::keys::{BackupIndex, ClusterConfig, Keys};
use dpukv_cluster::master::{self, Snapshot};
use dpukv_cluster::membership::{Authority, Member, Timing, register_with};
use dpukv_cluster::meta::{Compare, Txn, TxnOp, Watch, WatchEvent};
use dpukv_cluster::{EtcdOptions, EtcdStore, MetaError, MetaStore};
use dpukv_proto::regionmap::{HandoffKind, NodeInfo, RegionInfo, RegionState};
use dpukv_storage::region::RegionSnapshot;
use dpukv_storage::vlog::LogTail;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::cluster_metrics::ClusterMetrics;
use super::handoff::{self, ReportThresholds};
use super::worker::{Control, Job, KeyRange, Replicated};
use super::{Opener, SharedServed};
use crate::pod;
use crate::regions::RegionMap;
use crate::replication::{Acks, BackupHost, Feed, Peers, ReplStats, SenderConfig, SenderEnd, spawn_sender_after};

/// How this host joins a cluster.
#[derive(Debug, Clone)]
pub struct ClusterArgs {
    /// The cluster's name.
    pub name: String,
    /// This node's id (unique in the cluster, not 0).
    pub node_id: u32,
    /// How to reach etcd (its URLs, TLS).
    pub etcd: EtcdOptions,
    /// Where this host accepts replication connections.
    pub replication_listen: SocketAddr,
    /// The address clients reach this node's device at.
    pub advertise_device: String,
    /// Where clients reach its device over libfabric ("" = nowhere).
    pub advertise_fabric: String,
    /// The address primaries reach this host's replication port at.
    pub advertise_replication: String,
    /// The host's control API address (or, without one, its admin address), advertised: what
    /// `dpukv cluster` calls.
    pub advertise_admin: String,
    /// Failure domain ("" = none).
    pub zone: String,
    /// Without `zone`: the file holding this node's zone (the operator's zones ConfigMap,
    /// mounted, by Kubernetes node name), read at start.
    pub zone_file: Option<std::path::PathBuf>,
    /// How long to wait for `zone_file` to appear.
    pub zone_wait: Duration,
    /// Lease TTL (failover takes about this long).
    pub lease_ttl: Duration,
    /// The configuration to write if the cluster has none yet.
    pub bootstrap: ClusterConfig,
    /// How long a write waits for its backups before its outcome is declared unknown.
    pub replication_timeout: Duration,
    /// A backup or joining node that took no log for this long is reported stalled (None:
    /// never).
    pub stall_timeout: Option<Duration>,
    /// How long a copy of a region this node stops backing is kept aside (zero: deleted).
    pub retain_copies: Duration,
    /// How long a SIGTERM waits for this node's primaries to move elsewhere (`leave`; zero: no
    /// wait).
    pub leave_timeout: Duration,
    /// Most log bytes a primary keeps from collection for backups behind or away.
    pub retain_log: u64,
    /// The node's cap on bytes per second sent to backups catching up, shared by all its
    /// senders (None: no cap).
    pub catch_up: Option<Arc<crate::replication::CatchUpCap>>,
    /// The node's cap on bytes per second uploaded to backup locations (0: none) while its
    /// writers are not busy, and while they are.
    pub backup_rate: u64,
    /// See `backup_rate`.
    pub backup_busy_rate: u64,
    /// TLS on this host's replication listener.
    pub tls_server: Option<Arc<dpukv_net::tls::ServerTls>>,
    /// TLS to the backups this host streams to.
    pub tls_client: Option<Arc<dpukv_net::tls::ClientTls>>,
}

/// A region this node leads.
struct Led {
    epoch: u64,
    queue: mpsc::Sender<Job>,
    /// Its writer's controls (splits, merges).
    control: mpsc::Sender<Control>,
    /// The ranges last told to keep.
    keep: Option<Vec<KeyRange>>,
    thread: std::thread::JoinHandle<()>,
    acks: Arc<Acks>,
    feed: Arc<Feed>,
    tail: LogTail,
    /// The log's end when this node began to lead the region.
    base: dpukv_storage::vlog::Lsn,
    /// This life as the region's leader: drawn when it began to lead (a restart, or leading it
    /// again, is a new life), so backups cut what they hold past `base` from an earlier life
    /// whose log end this one may have lost.
    life: u64,
    region_dir: std::path::PathBuf,
    senders: Vec<(u32, Arc<AtomicBool>, std::thread::JoinHandle<SenderEnd>)>,
    /// The node's replication figures (its senders count into them).
    stats: Arc<ReplStats>,
    /// Ship the index to backups (Send Index), or let them build their own.
    send_index: bool,
    /// Whether its device serves it: once every backup holds the log up to `base`. A promoted
    /// copy may hold a tail (written, never acknowledged) another backup lacks; serving it
    /// before that backup holds it would let a second failover take back what a read returned.
    serving: bool,
    /// Joining nodes whose catch-up was reported (at this epoch).
    reported: BTreeSet<u32>,
    /// Nodes reported stalled (at this epoch).
    stalled: BTreeSet<u32>,
    /// Its backups and joining nodes at this epoch.
    members: BTreeSet<u32>,
}

/// Runs the member until `shutdown`; returns the writer threads of the regions it still led
/// (their queues are dropped: they close their regions).
pub async fn run(
    args: ClusterArgs,
    served: SharedServed,
    opener: Opener,
    metrics: Arc<ClusterMetrics>,
    shutdown: CancellationToken,
) -> Result<Vec<std::thread::JoinHandle<()>>> {
    let keys = Keys::new(&args.name).map_err(|e| anyhow::anyhow!("{e}"))?;
    // A map this pod published in an earlier life may still name it primary: until the cluster
    // says what this node serves now, its device serves nothing.
    let mut announcement: Option<dpukv_storage::announce::Announcement> = None;
    if let Ok((old, _)) = pod::open_map(&opener.shm_dir) {
        let mut none = old.cluster().clone();
        for r in &mut none.regions {
            r.primary = 0;
        }
        let rmap = RegionMap::new(none, args.node_id)?;
        let a = pod::publish_map(&opener.shm_dir, &rmap, 0)?;
        announcement = Some(a);
        served.write().unwrap_or_else(|e| e.into_inner()).map = rmap;
    }
    let opts = args.etcd.clone();
    let store = connect(&opts, &shutdown).await?;
    let Some(store) = store else { return Ok(vec![]) };
    // The configuration, written if the cluster has none (etcd may go away again: retried).
    let mut backoff = dpukv_cluster::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        match master::bootstrap_config(&store, &keys, &args.bootstrap).await {
            Ok(_) => break,
            Err(e @ MetaError::Invalid(_)) => return Err(e).context("the cluster's configuration"),
            Err(e) => tracing::warn!(error = %e, "writing the cluster's configuration failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.wait()) => {}
            _ = shutdown.cancelled() => return Ok(vec![]),
        }
    }
    // Backups: accept replication connections (port 0: any free port, advertised as bound).
    let listener = std::net::TcpListener::bind(args.replication_listen)
        .with_context(|| format!("binding the replication port {}", args.replication_listen))?;
    let advertise_replication =
        if args.replication_listen.port() == 0 && args.advertise_replication == args.replication_listen.to_string() {
            listener.local_addr()?.to_string()
        } else {
            args.advertise_replication.clone()
        };
    let Some(zone) = resolve_zone(&args, &shutdown).await else { return Ok(vec![]) };
    let info = NodeInfo {
        id: args.node_id,
        device: args.advertise_device.clone(),
        replication: advertise_replication,
        admin: args.advertise_admin.clone(),
        zone,
        fabric: args.advertise_fabric.clone(),
    };
    let timing = Timing { ttl: args.lease_ttl, ..Timing::default() };
    let authority = metrics.authority.clone();
    let backups = BackupHost::with_stats(&args.name, opener.data_dir.clone(), metrics.repl.clone());
    // Copies are synced like the node's own log (`--fsync`): under `always`, a backup says it
    // holds a write only once it is on its disk.
    backups.set_fsync(opener.fsync());
    backups.set_retain_for(args.retain_copies);
    let stop_backups = Arc::new(AtomicBool::new(false));
    backups.serve(listener, args.tls_server.clone(), stop_backups.clone())?;
    let member = register_loop(&store, &keys, &info, timing, &authority, &shutdown).await;
    let Some(mut member) = member else { return Ok(vec![]) };
    tracing::info!(node = args.node_id, cluster = %args.name, lease = member.lease, "registered");
    // Back after leaving on purpose (`leave`): this node may lead again. (An operator stepping it
    // down for a rollout asks again if it still must.)
    if let Err(e) = store.delete(&keys.step_down(args.node_id)).await {
        tracing::warn!(error = %e, "lifting this node's own step-down failed");
    }
    // The lease is given back only after the device stopped trusting the map (`Unvouch`), never
    // on the shutdown signal itself: the master fails over on the lease's end.
    let lease_stop = CancellationToken::new();
    let status = metrics.master.clone();
    let mut keeper = spawn_keeper(&store, &member, timing, &lease_stop);
    let mut candidate = spawn_candidate(&store, &keys, &info, member.lease, &shutdown, &status);
    // The device trusts the published map only while the authority of the lease life it was
    // read in lasts.
    let vouched: Arc<Vouched> = Arc::new(std::sync::Mutex::new(announcement.take().map(|a| (a, u64::MAX))));
    // However `run` ends (an error too): the device stops trusting the map, then the lease goes.
    let unvouch = Unvouch { vouched: vouched.clone(), lease_stop: lease_stop.clone() };
    let voucher = {
        let (vouched, authority, stop) = (vouched.clone(), authority.clone(), shutdown.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                if let Some((a, life)) = vouched.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                    let _ = a.set_valid_until(authority_ns(&authority, *life));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let mut led: HashMap<u32, Led> = HashMap::new();
    let peers = Peers::default();
    // Handoffs this node drives, by source region: (the handoff's create revision, the task).
    let mut driving: HashMap<u32, (i64, tokio::task::JoinHandle<()>)> = HashMap::new();
    let mut reporting: Option<tokio::task::JoinHandle<()>> = None;
    let mut last_report = std::time::Instant::now();
    let reported_loads = Arc::new(std::sync::Mutex::new(HashMap::new()));
    let mut published: Option<dpukv_proto::regionmap::RegionMap> = None;
    let mut first_map = true;
    // (region, epoch) whose position this node reported (its primary gone).
    let mut reported_positions: BTreeSet<(u32, u64)> = BTreeSet::new();
    // Backup fences this node's regions hold (docs/backup.md §2).
    let mut fencing = Fencing::new(args.backup_rate, args.backup_busy_rate);
    // Regions a restore gives this node, fetched from the backup (docs/backup.md §5).
    let mut restoring = super::restoring::Restoring::default();
    // Changes to the cluster's state wake the loop at once; it also runs every `BUSY_TICK` while
    // this node has something in progress that no change in etcd announces (a region not serving
    // yet, catch-ups, handoffs, fences, restores), else every `QUIET_TICK`.
    let mut changes: Option<Watch> = None;
    let mut busy = true;
    // The revision of the last read: changes up to it are already acted on.
    let mut seen: i64 = 0;
    loop {
        // Without a watch (not opened yet, or it ended) nothing else wakes the loop: the busy pace.
        let tick = if busy || changes.is_none() { BUSY_TICK } else { QUIET_TICK };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(tick) => {}
            _ = next_change(&mut changes, &keys, seen) => {}
            // The lease ended: register again now, not at the next tick.
            _ = &mut keeper, if !keeper.is_finished() => {}
        }
        // The lease ended (etcd unreachable past the TTL, or this process was paused): register
        // again, as a new member.
        if keeper.is_finished() {
            candidate.abort();
            match register_loop(&store, &keys, &info, timing, &authority, &shutdown).await {
                Some(m) => member = m,
                None => break,
            }
            tracing::warn!(node = args.node_id, lease = member.lease, "registered again after losing the lease");
            keeper = spawn_keeper(&store, &member, timing, &lease_stop);
            candidate = spawn_candidate(&store, &keys, &info, member.lease, &shutdown, &status);
        } else if candidate.is_finished() && !shutdown.is_cancelled() {
            // The lease lives but the candidacy ended (it only ends by itself when the lease
            // did; a panic would end it too): a node is always a candidate while registered.
            tracing::warn!(node = args.node_id, "the master candidacy ended while the lease lives; starting it again");
            candidate = spawn_candidate(&store, &keys, &info, member.lease, &shutdown, &status);
        }
        // Read before the map: a map read in this life is vouched for only while it lasts.
        let life = authority.life();
        let snap = match master::read(&store, &keys).await {
            Ok(s) => s,
            // etcd unreachable: keep serving what the last map said (writes stop by themselves
            // once the authority runs out).
            Err(e) => {
                tracing::debug!(error = %e, "reading the region map failed");
                busy = true;
                continue;
            }
        };
        seen = snap.map.revision as i64;
        *metrics.last_backup.lock().unwrap_or_else(|e| e.into_inner()) = snap.last_backup.clone();
        if snap.map.regions.is_empty() {
            continue;
        }
        let me = args.node_id;
        // Senders dial each node where it is registered now.
        for moved in peers.update(&snap.map.nodes) {
            tracing::info!(node = moved, "a node's replication address changed: its streams follow it");
        }
        // How backups index their copies (the cluster's configuration; Send Index by default).
        let send_index = snap.config.as_ref().is_none_or(|c| c.backup_index == BackupIndex::Send);
        backups.set_build_index(!send_index);
        if first_map {
            // What this node kept from an earlier life: a region it still leads is its own;
            // a backup copy of a region it still backs goes on; anything else (a region it led
            // before a failover, a region it no longer holds) may hold records no one else
            // has, and goes.
            first_map = false;
            for r in &snap.map.regions {
                let backing = r.backups.contains(&me) || r.joining.contains(&me);
                let is_backup_copy = opener.dir(r.id).join("LOGMAP").exists();
                if r.primary != me && !(backing && is_backup_copy) {
                    // A backup copy is kept aside for a while (given the region back, this node
                    // resumes from it); a copy of a region it led may hold records the new
                    // primary never had, and goes.
                    let (b, id) = (backups.clone(), r.id);
                    if !(is_backup_copy && blocking(move || b.retire(id)).await) {
                        remove_region_files(&opener, r.id).await;
                    }
                }
            }
        }
        // A split's new region exists before the map has it: placed like its source, led and
        // backed while the range is copied into it.
        let split_targets: Vec<RegionInfo> = snap
            .handoffs
            .running
            .iter()
            .filter(|run| run.handoff.kind == HandoffKind::Split)
            .filter_map(|run| Some(run.handoff.new_region(snap.map.region(run.handoff.source)?)))
            .collect();
        // Regions this node gives up: publish first (stop serving), then close.
        let keep = |r: &RegionInfo| r.primary == me;
        let losing: Vec<u32> = led
            .keys()
            .copied()
            .filter(|id| !snap.map.regions.iter().chain(&split_targets).any(|r| r.id == *id && keep(r)))
            .collect();
        // A new life (the lease ended, the node registered again) vouches for no map published
        // before: publish this one, read in it.
        let vouched_life = vouched.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|(_, l)| *l);
        let mut changed = published.as_ref() != Some(&snap.map) || vouched_life != Some(life);
        if !losing.is_empty() {
            publish(&served, &snap.map, me, &led, &losing, &opener, &vouched, (&authority, life))?;
            for id in losing {
                let l = led.remove(&id).expect("led");
                metrics.unlead(id);
                // Its copy may hold records the new primary never had: throw it away.
                if close_led(l).await {
                    remove_region_files(&opener, id).await;
                }
                tracing::info!(region = id, "handed the region over");
            }
        }
        for r in snap.map.regions.iter().chain(&split_targets) {
            let backing = r.backups.contains(&me) || r.joining.contains(&me);
            if r.primary == me {
                // A region a restore makes opens once its part is fetched (docs/backup.md §5).
                let (dir, shm) = (opener.dir(r.id), pod::region_dir(&opener.shm_dir, r.id));
                if !led.contains_key(&r.id) && backups.backs(r.id) && restoring.must_refetch(&snap, r.id, me, &dir) {
                    // Given this region after its primary died with the only full copy: the
                    // copy here was joining (partial) and goes; the part is fetched instead.
                    let (b, id) = (backups.clone(), r.id);
                    blocking(move || b.release(id)).await;
                    tracing::info!(region = r.id, "dropped a partial copy of a restored region: fetching it");
                }
                if !led.contains_key(&r.id) && !backups.backs(r.id) && !restoring.ready(&snap, r.id, &dir, &shm) {
                    continue;
                }
                if backups.backs(r.id) {
                    // Promotion: the backup's copy becomes the region (it replays its log tail;
                    // a Build Index copy first adopts the index it built).
                    let (b, id) = (backups.clone(), r.id);
                    if let Err(e) = blocking(move || b.promote(id)).await {
                        tracing::error!(region = r.id, error = %e, "adopting the built index failed; replaying the whole copy");
                    }
                    metrics.promotions.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(region = r.id, epoch = r.epoch, "promoted");
                }
                match led.get_mut(&r.id) {
                    None => {
                        // Opening replays the region's log tail: seconds for a large one, off the
                        // async runtime (its threads keep the lease alive meanwhile).
                        let (a, o, rr, p) = (args.clone(), opener.clone(), r.clone(), peers.clone());
                        let (au, st) = (authority.clone(), metrics.repl.clone());
                        let opened = blocking(move || open_led(&a, &o, &rr, &p, &au, &st, send_index)).await;
                        match opened {
                            Ok(l) => {
                                metrics.lead(r.id, l.acks.clone(), l.feed.clone(), l.tail.clone());
                                led.insert(r.id, l);
                                changed = true;
                            }
                            Err(e) => {
                                tracing::error!(region = r.id, error = %format!("{e:#}"), "opening the region failed")
                            }
                        }
                    }
                    Some(l) if l.epoch != r.epoch => {
                        retarget(&args, l, r, &peers);
                        changed = true;
                    }
                    Some(_) => {}
                }
            } else if backing {
                backups.back(r.id, r.epoch, r.primary);
            } else if backups.backs(r.id) {
                // Kept aside for a while: given the region back, this node resumes from it.
                let (b, id) = (backups.clone(), r.id);
                if !blocking(move || b.retire(id)).await {
                    remove_region_files(&opener, r.id).await;
                }
            }
        }
        fencing.holder.set_reporter(member.lease);
        if let Some(rate) = fencing.pace.observe(opener.stats.writes.load(Ordering::Relaxed), std::time::Instant::now())
        {
            fencing.throttle.set_rate(rate);
        }
        hold_fences(&snap, &led, &mut fencing, &store, &keys).await;
        restoring.report(&snap, me, |id| led.contains_key(&id), (&store, &keys, member.lease)).await;
        report_positions(&snap, me, &backups, &store, &keys, member.lease, &mut reported_positions).await;
        {
            let (b, ids): (_, BTreeSet<u32>) =
                (backups.clone(), snap.map.regions.iter().chain(&split_targets).map(|r| r.id).collect());
            blocking(move || b.sweep_retained(|id| !ids.contains(&id))).await;
        }
        // Copies of regions that are gone (a merge's source, an aborted split's new region).
        for id in backups.backed_ids() {
            if !snap.map.regions.iter().chain(&split_targets).any(|r| r.id == id) {
                let b = backups.clone();
                blocking(move || b.release(id)).await;
                remove_region_files(&opener, id).await;
                tracing::info!(region = id, "dropped the copy of a region that is gone");
            }
        }
        if last_report.elapsed() >= handoff::REPORT_EVERY && reporting.as_ref().is_none_or(|t| t.is_finished()) {
            let t = ReportThresholds {
                split_bytes: snap.config.as_ref().map_or(0, |c| c.split_bytes),
                split_writes_per_sec: snap.config.as_ref().map_or(0, |c| c.split_writes_per_sec),
            };
            // Regions at rest this node serves (not those in a handoff: their figures move).
            let regions: Vec<(u32, mpsc::Sender<Control>)> = snap
                .map
                .regions
                .iter()
                .filter(|r| r.primary == me && r.state == RegionState::Serving)
                .filter_map(|r| led.get(&r.id).filter(|l| l.serving).map(|l| (r.id, l.control.clone())))
                .collect();
            let elapsed = last_report.elapsed();
            last_report = std::time::Instant::now();
            let (store, keys, lease, last) = (store.clone(), keys.clone(), member.lease, reported_loads.clone());
            reporting = Some(tokio::spawn(handoff::report(regions, t, elapsed, store, keys, lease, last)));
        }
        metrics.regions_backed.store(backups.backed() as u64, Ordering::Relaxed);
        let mut waiting = 0;
        for (id, l) in led.iter_mut().filter(|(_, l)| !l.serving) {
            // A restore's region is served only once the whole restore ended: until then its
            // copy may still be thrown away and fetched again elsewhere.
            if snap.restoring(*id) {
                continue;
            }
            // The old primary, if alive, may still serve the region by its old map: not before
            // it said it stopped (a write acknowledged here could be missing from its reads).
            if let Some(old) = snap.unreleased(*id, me) {
                tracing::debug!(region = id, old, "waiting for the old primary to release the region");
                waiting += 1;
                continue;
            }
            if l.acks.holds(l.base) {
                l.serving = true;
                changed = true;
                tracing::info!(region = id, base = ?l.base, "serving: every backup holds the log this node began to lead from");
            }
        }
        metrics.handovers_waiting.store(waiting, Ordering::Relaxed);
        if changed {
            publish(&served, &snap.map, me, &led, &[], &opener, &vouched, (&authority, life))?;
            published = Some(snap.map.clone());
        }
        // The device serves by this map now: release the regions handed away from this node (their
        // new primaries wait for it). The map holds every handover this snapshot names.
        // (Compared: a later handover of a region given back in between is not this map's.)
        let released: Vec<(Vec<u8>, i64)> = snap
            .handovers
            .iter()
            .filter(|&(&(_, n), _)| n == me)
            .map(|(&(r, _), &rev)| (keys.handover(r, me), rev))
            .collect();
        for (key, rev) in released {
            let txn = Txn {
                when: vec![Compare::ModRevision(key.clone(), rev)],
                then: vec![TxnOp::Delete { key }],
                otherwise: vec![],
            };
            if let Err(e) = store.txn(txn).await {
                tracing::debug!(error = %e, "releasing a handed-over region failed; retrying");
            }
        }
        // Only once the device and the dispatch route by this map: a source may take writes to
        // a range again (and trim what it gave away) only when no request can reach it by the
        // map it had before the handoff ended.
        steer_handoffs(&snap, me, &mut led, &mut driving, &split_targets, &store, &keys, member.lease);
        // Joining nodes that hold the whole index and the log to its end: report them caught up
        // (under this node's lease: the report goes with it).
        for r in snap.map.regions.iter().filter(|r| r.primary == me) {
            let Some(l) = led.get_mut(&r.id) else { continue };
            for &j in &r.joining {
                let caught_up = |l: &Led| {
                    let end = l.tail.end();
                    l.acks.installed(j) && l.acks.position(j).is_some_and(|h| h >= end)
                };
                if l.reported.contains(&j) || !caught_up(l) {
                    continue;
                }
                // From now on writes wait for it too; then it holds everything acknowledged
                // before (checked again) and after — only then may the master count on it
                // (a promotion may pick it as soon as it is a backup).
                l.acks.require_also(j);
                if !caught_up(l) {
                    continue;
                }
                let key = keys.caught_up_of(r.id, j);
                if store.put(&key, r.epoch.to_string().as_bytes(), Some(member.lease)).await.is_ok() {
                    metrics.catch_ups.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(region = r.id, node = j, epoch = r.epoch, "catch-up finished");
                    l.reported.insert(j);
                }
            }
        }
        if let Some(bound) = args.stall_timeout {
            report_stalled(&snap, me, &mut led, &store, &keys, member.lease, bound).await;
        }
        metrics.under_replicated.store(snap.health().under_replicated as u64, Ordering::Relaxed);
        busy = in_progress(&snap, me, &led, &split_targets, &reported_positions, &backups)
            || !driving.is_empty()
            || (args.stall_timeout.is_some() && led.values().any(|l| !l.acks.holds(l.tail.end())));
        if changes.is_none() {
            // Changes after this read wake the loop (a watch that ended is opened again here,
            // at most once a round; opening it waits for nothing the round had to do).
            changes = store.watch(keys.root(), seen + 1).await.ok();
        }
    }
    // Leaving: stop serving, stop replicating, give the lease back (the master fails over now
    // rather than after the TTL).
    candidate.abort();
    keeper.abort();
    voucher.abort();
    for (_, (_, task)) in driving.drain() {
        task.abort();
    }
    if let Some(t) = reporting {
        t.abort();
    }
    drop(unvouch);
    stop_backups.store(true, Ordering::Release);
    let mut threads = Vec::new();
    for (id, l) in led.drain() {
        metrics.unlead(id);
        for (_, stop, _) in &l.senders {
            stop.store(true, Ordering::Release);
        }
        drop(l.queue);
        threads.push(l.thread);
    }
    served.write().unwrap_or_else(|e| e.into_inner()).writers.clear();
    let _ = store.revoke(member.lease).await;
    Ok(threads)
}

/// How often the cluster loop runs while this node has work in progress that no change in the
/// metadata store announces (see [`in_progress`]).
const BUSY_TICK: Duration = Duration::from_millis(50);
/// How often it runs otherwise (changes in the store wake it at once): what time alone moves —
/// load reports, stalled backups, copies kept aside — is checked at this pace.
const QUIET_TICK: Duration = Duration::from_millis(250);

/// Whether this node has work in progress whose next step a local event takes (a backup's
/// acknowledgement, a copy's end, a writer's cut) or a retry (a write to etcd that failed), not
/// a change in the metadata store: a region it leads that is not open or not serving yet, or has
/// joining nodes not reported caught up; a handover from it not released yet; a region it backs
/// whose primary is gone and whose position it has not reported; a split target, a handoff, a
/// fence, a backup job or a restore anywhere in the cluster.
fn in_progress(
    snap: &Snapshot,
    me: u32,
    led: &HashMap<u32, Led>,
    split_targets: &[RegionInfo],
    reported_positions: &BTreeSet<(u32, u64)>,
    backups: &BackupHost,
) -> bool {
    led.values().any(|l| !l.serving)
        || snap.map.regions.iter().filter(|r| r.primary == me).any(|r| match led.get(&r.id) {
            None => true,
            Some(l) => r.joining.iter().any(|j| !l.reported.contains(j)),
        })
        || snap.handovers.keys().any(|&(_, n)| n == me)
        || positions_due(snap, me, backups, reported_positions).next().is_some()
        || !split_targets.is_empty()
        || !snap.handoffs.running.is_empty()
        || !snap.fences.is_empty()
        || !snap.backup_jobs.is_empty()
        || snap.restore.is_some()
}

/// Waits for a change under the cluster's root that the loop acts on (the event log, the
/// master's round marks and the regions' load reports are not); with no watch, never. A watch
/// that ended (lagged, compacted, the store gone) is dropped: the loop opens another after its
/// next read.
async fn next_change(changes: &mut Option<Watch>, keys: &Keys, seen: i64) {
    let ended = match changes.as_mut() {
        None => return std::future::pending().await,
        Some(w) => wait_for_change(w, keys, seen).await,
    };
    if ended {
        // Not a wake-up: the loop's busy pace reads and opens another (a watch that ends at
        // once cannot spin the loop).
        *changes = None;
        std::future::pending::<()>().await;
    }
}

/// [`next_change`] on one watch (changes at or before revision `seen`, already read, are
/// not): whether the watch ended.
async fn wait_for_change(w: &mut Watch, keys: &Keys, seen: i64) -> bool {
    let ignored = [keys.events(), keys.master_round(), keys.region_stats()];
    let acted_on = |e: &WatchEvent| e.revision() > seen && !ignored.iter().any(|p| e.key().starts_with(p));
    loop {
        match w.next().await {
            Some(Ok(e)) if !acted_on(&e) => continue,
            Some(Ok(_)) => break,
            Some(Err(_)) | None => return true,
        }
    }
    // Whatever else is queued now is read by the same round.
    while let Some(e) = w.try_next() {
        if e.is_err() {
            return true;
        }
    }
    false
}

/// How long the cluster loop waits for a writer to fence its region and snapshot it.
const CUT_WAIT: Duration = Duration::from_secs(2);

/// The backup fences this node's regions hold, each region's files at its cut, and the uploads
/// of those a backup job asked for.
struct Fencing {
    holder: FenceHolder,
    /// (fence, region) -> the region's snapshot at the cut; once the fence is lifted it goes to
    /// an upload if the commit started a job, else it is dropped (its pins with it). At most
    /// one per fence a region holds, and a fence is held at most its hold time.
    snapshots: HashMap<(u64, u32), RegionSnapshot>,
    /// (job, region) -> its upload: one per region of a job, ended (aborted) once the job is
    /// gone (its coordinator's lease ended).
    uploads: HashMap<(u64, u32), tokio::task::JoinHandle<()>>,
    /// The node's bandwidth cap for uploads ...
    throttle: Arc<Throttle>,
    /// ... set by how busy its writers are.
    pace: Pace,
}

impl Fencing {
    fn new(idle_rate: u64, busy_rate: u64) -> Fencing {
        Fencing {
            holder: FenceHolder::default(),
            snapshots: HashMap::new(),
            uploads: HashMap::new(),
            throttle: Arc::new(Throttle::new(idle_rate)),
            pace: Pace::new(idle_rate, busy_rate),
        }
    }
}

/// Backup fences (docs/backup.md §2, `dpukv_cluster::fence`): a region this node leads at a
/// fence's epoch has its writer fence it at the log's written end and snapshot it there
/// ([`Control::Cut`]), and reports that cut; it lifts once the fence key is gone (committed,
/// aborted, or broken — by this node itself once the fence's hold ran out). Without etcd nothing
/// is lifted: the region's writes wait, as they would anyway once the lease runs out.
async fn hold_fences(snap: &Snapshot, led: &HashMap<u32, Led>, fencing: &mut Fencing, store: &EtcdStore, keys: &Keys) {
    // Uploads of jobs that are gone (their coordinator's lease ended) stop; finished ones go.
    fencing.uploads.retain(|(job, _), task| {
        let live = snap.backup_jobs.iter().any(|j| j.id == *job);
        if !live {
            task.abort();
        }
        live && !task.is_finished()
    });
    let now = std::time::Instant::now();
    let steps = fencing.holder.poll(keys, &snap.fences, |r| led.get(&r).map(|l| l.epoch), now);
    for step in steps {
        let report = match step {
            FenceStep::Fence { fence, region, epoch } => {
                let Some(l) = led.get(&region) else { continue };
                let (tx, rx) = tokio::sync::oneshot::channel();
                let until = std::time::Instant::now() + CUT_WAIT;
                if l.control
                    .send(Control::Cut { id: fence.id, check_empty: fence.spec.check_empty, until, done: tx })
                    .await
                    .is_err()
                {
                    continue; // the writer is gone: the region closes
                }
                let (snapshot, empty) = match tokio::time::timeout_at(tokio::time::Instant::from_std(until), rx).await {
                    Ok(Ok(Ok(s))) => s,
                    Ok(Ok(Err(e))) => {
                        tracing::warn!(region, fence = fence.id, error = %e, "fencing for a backup failed");
                        continue;
                    }
                    // No answer in time (or the writer went): it may still fence later, so the
                    // fence is held without a report — the coordinator gives up on it, and the
                    // lift comes when its key goes.
                    _ => {
                        tracing::warn!(region, fence = fence.id, "the writer did not fence in time");
                        fencing.holder.held_unreported(&fence, region, epoch, std::time::Instant::now());
                        continue;
                    }
                };
                let at = snapshot.cut;
                tracing::info!(region, fence = fence.id, cut = ?at, bytes = snapshot.bytes(), "fenced for a backup");
                fencing.snapshots.insert((fence.id, region), snapshot);
                let txn = fencing.holder.fenced(keys, &fence, region, (epoch, at.0, empty), std::time::Instant::now());
                (fence.id, region, txn)
            }
            FenceStep::Report { id, region, txn } => (id, region, txn),
            FenceStep::Break { id, txn } => {
                match store.txn(txn).await {
                    Ok(t) if t.succeeded => tracing::warn!(fence = id, "broke a backup fence whose hold ran out"),
                    Ok(_) => {}
                    Err(e) => tracing::debug!(fence = id, error = %e, "breaking a backup fence failed; retrying"),
                }
                continue;
            }
            FenceStep::Lift { id, region } => {
                let snapshot = fencing.snapshots.remove(&(id, region));
                if let Some(l) = led.get(&region)
                    && l.acks.lift(id)
                {
                    tracing::info!(region, fence = id, "lifted a backup fence");
                }
                // The commit started a backup job (in the same transaction that lifted the
                // fence): upload the region's files at the cut.
                let job = snap.backup_jobs.iter().find(|j| j.id == id);
                let info = snap.map.regions.iter().find(|r| r.id == region);
                if let (Some(snapshot), Some(job), Some(info)) = (snapshot, job, info)
                    && !job.parts.contains_key(&region)
                {
                    let task = upload_part(
                        store.clone(),
                        keys.clone(),
                        job.clone(),
                        info.clone(),
                        snapshot,
                        fencing.throttle.clone(),
                    );
                    fencing.uploads.insert((id, region), tokio::spawn(task));
                }
                continue;
            }
        };
        let (id, region, txn) = report;
        match store.txn(txn).await {
            // Written, or the fence key is gone (the next poll lifts).
            Ok(_) => fencing.holder.reported(id, region),
            Err(e) => tracing::debug!(fence = id, region, error = %e, "reporting a fenced cut failed; retrying"),
        }
    }
}

/// Uploads a region's snapshot for backup job `job` and reports its part (or why not) under the
/// job (docs/backup.md §3). Aborted if the job goes.
async fn upload_part(
    store: EtcdStore,
    keys: Keys,
    job: dpukv_cluster::fence::Job,
    region: RegionInfo,
    snapshot: RegionSnapshot,
    throttle: Arc<Throttle>,
) {
    let began = std::time::Instant::now();
    let report = match JobSpec::decode(&job.spec) {
        Err(e) => PartReport::Failed { error: e },
        Ok(spec) => match Location::open(&spec.to) {
            Err(e) => PartReport::Failed { error: format!("{}: {e}", e.code()) },
            Ok(loc) => match crate::backup::upload_region(&loc, &throttle, &region, &snapshot).await {
                Ok(u) => {
                    tracing::info!(region = region.id, job = job.id, uploaded = u.uploaded, bytes = u.part.bytes(), took = ?began.elapsed(), "uploaded a region's part of a backup");
                    PartReport::Done { part: u.part, uploaded: u.uploaded }
                }
                Err(e) => {
                    tracing::warn!(region = region.id, job = job.id, error = %e, "uploading a region's part of a backup failed");
                    PartReport::Failed { error: format!("{}: {e}", e.code()) }
                }
            },
        },
    };
    drop(snapshot);
    let txn = dpukv_cluster::fence::part_txn(&keys, &job, region.id, report.encode());
    let mut backoff = dpukv_cluster::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    for _ in 0..20 {
        match store.txn(txn.clone()).await {
            Ok(_) => return,
            Err(e) => tracing::debug!(job = job.id, error = %e, "reporting a backup part failed; retrying"),
        }
        tokio::time::sleep(backoff.wait()).await;
    }
}

/// This node's zone: `--zone`, else its line in the zones directory (the operator's ConfigMap,
/// by Kubernetes node name), waited for up to `zone_wait` — then none, said loudly (placement
/// then cannot keep this node's copies apart from others in its zone). None on shutdown.
async fn resolve_zone(args: &ClusterArgs, shutdown: &CancellationToken) -> Option<String> {
    let Some(file) = args.zone_file.as_ref().filter(|_| args.zone.is_empty()) else { return Some(args.zone.clone()) };
    let began = std::time::Instant::now();
    loop {
        if let Ok(z) = std::fs::read_to_string(file) {
            let z = z.trim();
            if !z.is_empty() {
                tracing::info!(zone = z, file = %file.display(), "zone");
                return Some(z.to_string());
            }
        }
        if began.elapsed() >= args.zone_wait {
            tracing::warn!(file = %file.display(), waited_s = args.zone_wait.as_secs(), "no zone for this node: registering without one");
            return Some(String::new());
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = shutdown.cancelled() => return None,
        }
    }
}

/// Leaving on purpose (SIGTERM: a pod deleted or evicted, a rolling restart, a node drained by
/// Kubernetes): asks the master to move this node's primaries to backups elsewhere — its own
/// step-down request — and waits, `timeout` at most, until it leads nothing a backup could take
/// and every handover from it is released; only then does the shutdown go on. Writers then see
/// one handover per region (as in an upgrade step) instead of a failover once the lease expires.
/// The request is lifted when the node registers again. With nothing to hand over (no backups)
/// it is done at once; etcd unreachable, the wait ends at `timeout` and the shutdown goes on.
pub async fn leave(args: &ClusterArgs, timeout: Duration) {
    if timeout.is_zero() {
        return;
    }
    let node = args.node_id;
    let work = async {
        let keys = Keys::new(&args.name).map_err(|e| anyhow::anyhow!("{e}"))?;
        let store = EtcdStore::connect(&args.etcd).await?;
        store.put(&keys.step_down(node), b"leaving", None).await?;
        loop {
            let p = master::read(&store, &keys).await?.step_down_progress(node);
            if p.done {
                return anyhow::Ok(p);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let began = std::time::Instant::now();
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(p)) => tracing::info!(
            node,
            regions_led = p.led,
            elapsed_ms = began.elapsed().as_millis() as u64,
            "left: primaries handed over"
        ),
        Ok(Err(e)) => {
            tracing::warn!(node, error = %format!("{e:#}"), "leaving: the step-down could not be asked; stopping anyway")
        }
        Err(_) => tracing::warn!(
            node,
            timeout_s = timeout.as_secs(),
            "leaving: primaries not all handed over in time; stopping anyway"
        ),
    }
}

/// For every region this node leads, reports the backups and joining nodes that took no log
/// for `bound` while it reaches past what they hold (`stalled/<region>/<node>` = the epoch,
/// under this node's lease): the master takes a stalled backup out of the write set, and writes
/// waiting for it are acknowledged by the others (docs/cluster.md §5, "Stalled backups"). A node
/// that moves again has its report withdrawn.
async fn report_stalled(
    snap: &master::Snapshot,
    me: u32,
    led: &mut HashMap<u32, Led>,
    store: &EtcdStore,
    keys: &Keys,
    lease: dpukv_cluster::LeaseId,
    bound: Duration,
) {
    for r in snap.map.regions.iter().filter(|r| r.primary == me) {
        let Some(l) = led.get_mut(&r.id).filter(|l| l.epoch == r.epoch) else { continue };
        let streamed: Vec<u32> = r.backups.iter().chain(&r.joining).copied().collect();
        let stalled: BTreeSet<u32> = l.acks.stalled(&streamed, l.tail.end(), bound).into_iter().collect();
        for &n in stalled.difference(&l.stalled.clone()) {
            let value = r.epoch.to_string();
            match store.put(&keys.stalled_of(r.id, n), value.as_bytes(), Some(lease)).await {
                Ok(_) => {
                    tracing::warn!(region = r.id, node = n, epoch = r.epoch, after = ?bound, "a replica took no log: reported stalled");
                    l.stalled.insert(n);
                }
                Err(e) => tracing::debug!(error = %e, "reporting a stalled replica failed; will retry"),
            }
        }
        for n in l.stalled.clone().difference(&stalled) {
            if store.delete(&keys.stalled_of(r.id, *n)).await.is_ok() {
                tracing::info!(region = r.id, node = n, "a replica reported stalled takes the log again");
                l.stalled.remove(n);
            }
        }
    }
}

/// The positions this node owes the master (region, epoch, what it holds): regions it backs
/// whose primary is gone, not reported yet under their epoch, of which it holds a copy.
fn positions_due<'a>(
    snap: &'a Snapshot,
    me: u32,
    backups: &'a BackupHost,
    reported: &'a BTreeSet<(u32, u64)>,
) -> impl Iterator<Item = (u32, u64, u64)> + 'a {
    snap.map
        .regions
        .iter()
        .filter(move |r| r.backups.contains(&me) && snap.map.node(r.primary).is_none())
        .filter(|r| !reported.contains(&(r.id, r.epoch)))
        .filter_map(|r| Some((r.id, r.epoch, backups.held(r.id)?.0)))
}

/// Position reports per transaction (etcd allows 128 operations in one by default).
const REPORTS_PER_TXN: usize = 100;

/// For every region this node backs whose primary is gone (its registration ended), says once
/// per epoch how far this node's copy of the log reaches (`positions/<region>/<node>`, under its
/// lease): the master promotes the backup that reaches furthest (docs/cluster.md §3a).
async fn report_positions(
    snap: &master::Snapshot,
    me: u32,
    backups: &BackupHost,
    store: &EtcdStore,
    keys: &Keys,
    lease: dpukv_cluster::LeaseId,
    reported: &mut BTreeSet<(u32, u64)>,
) {
    reported.retain(|(id, epoch)| snap.map.region(*id).is_some_and(|r| r.epoch == *epoch));
    let due: Vec<(u32, u64, u64)> = positions_due(snap, me, backups, reported).collect();
    for chunk in due.chunks(REPORTS_PER_TXN) {
        let then = chunk
            .iter()
            .map(|&(id, epoch, held)| dpukv_cluster::TxnOp::Put {
                key: keys.position_of(id, me),
                value: format!("{epoch} {held}").into_bytes(),
                lease: Some(lease),
            })
            .collect();
        match store.txn(dpukv_cluster::Txn { when: vec![], then, otherwise: vec![] }).await {
            Ok(_) => reported.extend(chunk.iter().map(|&(id, epoch, _)| (id, epoch))),
            Err(e) => tracing::debug!(error = %e, "reporting log positions failed; will retry"),
        }
    }
}

/// Connects to etcd, retrying with backoff (and saying so) until it answers or `shutdown`.
async fn connect(opts: &EtcdOptions, shutdown: &CancellationToken) -> Result<Option<EtcdStore>> {
    let mut delay = Duration::from_millis(200);
    loop {
        match EtcdStore::connect_checked(opts).await {
            Ok(s) => return Ok(Some(s)),
            Err(MetaError::Invalid(m)) => anyhow::bail!("etcd: {m}"),
            Err(e) => tracing::error!(error = %e, retry_in = ?delay, "etcd is unreachable; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => return Ok(None),
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// Registers, retrying while the id is still held (by this node's previous life, until its
/// lease ends) or etcd is unreachable.
async fn register_loop(
    store: &EtcdStore,
    keys: &Keys,
    info: &NodeInfo,
    timing: Timing,
    authority: &Authority,
    shutdown: &CancellationToken,
) -> Option<Member> {
    loop {
        match register_with(store, keys, info, timing, authority.clone()).await {
            Ok(m) => return Some(m),
            Err(e) => tracing::warn!(error = %e, "registering failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(timing.ttl / 4) => {}
            _ = shutdown.cancelled() => return None,
        }
    }
}

type Task = tokio::task::JoinHandle<()>;

/// The keep-alive of one registration (its authority); ends when the lease has ended, or gives
/// the lease back on `lease_stop`.
fn spawn_keeper(store: &EtcdStore, member: &Member, timing: Timing, lease_stop: &CancellationToken) -> Task {
    let (s, stop) = (store.clone(), lease_stop.child_token());
    let m = Member { lease: member.lease, authority: member.authority.clone() };
    tokio::spawn(async move {
        if let Err(e) = m.keep_alive(&s, timing, stop).await {
            tracing::warn!(error = %e, "the lease ended");
        }
    })
}

/// The master candidacy under `lease`: it retries every transient error itself and ends only
/// when the lease has ended or on shutdown; the member loop starts it again if it ends while
/// the lease lives (a panic, say), so a node never stops being a candidate.
fn spawn_candidate(
    store: &EtcdStore,
    keys: &Keys,
    info: &NodeInfo,
    lease: dpukv_cluster::LeaseId,
    shutdown: &CancellationToken,
    status: &master::LoopStatus,
) -> Task {
    let (s, k, info, stop, status) =
        (store.clone(), keys.clone(), info.clone(), shutdown.child_token(), status.clone());
    tokio::spawn(async move {
        if let Err(e) = master::run(&s, &k, lease, &info, MASTER_TICK, stop, status).await {
            tracing::warn!(error = %e, "the master candidacy ended");
        }
    })
}

/// How often the master plans at least (it also plans at every change under the cluster's root).
const MASTER_TICK: Duration = Duration::from_millis(500);

fn open_led(
    args: &ClusterArgs,
    opener: &Opener,
    r: &RegionInfo,
    peers: &Peers,
    authority: &Authority,
    stats: &Arc<ReplStats>,
    send_index: bool,
) -> Result<Led> {
    let acks = Acks::new(r.epoch, r.backups.clone());
    let feed = Feed::new();
    let repl = Replicated {
        acks: acks.clone(),
        feed: feed.clone(),
        authority: authority.clone(),
        timeout: args.replication_timeout,
        retain_log: args.retain_log,
    };
    let (started, tail) = opener.open(r.id, Some(repl))?;
    let base = tail.end();
    let mut l = Led {
        epoch: r.epoch,
        queue: started.queue,
        control: started.control,
        keep: None,
        thread: started.thread,
        acks,
        feed,
        tail,
        base,
        life: new_life(),
        region_dir: opener.dir(r.id),
        senders: Vec::new(),
        stats: stats.clone(),
        send_index,
        serving: false,
        reported: BTreeSet::new(),
        stalled: BTreeSet::new(),
        members: r.backups.iter().chain(&r.joining).copied().collect(),
    };
    start_senders(args, &mut l, r, peers, HashMap::new());
    tracing::info!(region = r.id, epoch = r.epoch, backups = ?r.backups, joining = ?r.joining, "leading the region");
    Ok(l)
}

/// A number for a new life as a region's leader: random (the process's hasher keys and the
/// clock), never 0 (what an older primary's Hello stands for).
fn new_life() -> u64 {
    dpukv_cluster::backoff::random_id()
}

/// A new epoch for a region this node still leads: the new backup set, senders under the new
/// epoch.
fn retarget(args: &ClusterArgs, l: &mut Led, r: &RegionInfo, peers: &Peers) {
    // Each new sender takes over from the old one of its backup once that one has ended.
    let mut previous = HashMap::new();
    for (b, stop, h) in l.senders.drain(..) {
        stop.store(true, Ordering::Release);
        previous.insert(b, h);
    }
    l.acks.set_required(r.epoch, r.backups.clone());
    // A node that left the region, or joined it anew, held nothing as far as this region knows
    // until a session of its own says (a node dropped while away deleted its copy; its earlier
    // positions would have it reported caught up at once, with an empty copy).
    let members: BTreeSet<u32> = r.backups.iter().chain(&r.joining).copied().collect();
    for &n in l.members.symmetric_difference(&members) {
        l.acks.forget(n);
    }
    l.members = members;
    l.epoch = r.epoch;
    l.reported.clear();
    l.stalled.clear();
    start_senders(args, l, r, peers, previous);
    tracing::info!(region = r.id, epoch = r.epoch, backups = ?r.backups, joining = ?r.joining, "region changed");
}

/// A sender for every backup and joining node of `r`. Each dials the node where its current
/// registration says (a DNS name on Kubernetes, resolved at each connection); one not
/// registered now is waited for.
fn start_senders(
    args: &ClusterArgs,
    l: &mut Led,
    r: &RegionInfo,
    peers: &Peers,
    mut previous: HashMap<u32, std::thread::JoinHandle<SenderEnd>>,
) {
    for &b in r.backups.iter().chain(&r.joining) {
        let addr = peers.addr(b);
        let cfg = SenderConfig {
            cluster: args.name.clone(),
            region: r.id,
            epoch: r.epoch,
            primary: args.node_id,
            backup: b,
            addr,
            region_dir: l.region_dir.clone(),
            base: l.base,
            life: l.life,
            stats: l.stats.clone(),
            send_index: l.send_index,
            catch_up: args.catch_up.clone(),
            tls: args.tls_client.clone(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let before = previous.remove(&b);
        match spawn_sender_after(cfg, l.tail.clone(), l.feed.clone(), l.acks.clone(), stop.clone(), before) {
            Ok(h) => l.senders.push((b, stop, h)),
            Err(e) => tracing::error!(error = %e, "starting a replication sender failed"),
        }
    }
}

/// How long closing a region waits for its writer to finish (its last group's sync); past it
/// the region's files are left for the next start to remove.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// Stops leading a region: writes waiting for backups fail (the region is someone else's), the
/// senders are told to stop (they end by themselves within a write slice, whatever their backup
/// does — nothing here waits for them), and the writer drains. Returns whether the writer
/// finished within [`CLOSE_WAIT`] (only then may the region's files go).
async fn close_led(l: Led) -> bool {
    l.acks.close();
    for (_, stop, _) in &l.senders {
        stop.store(true, Ordering::Release);
    }
    drop(l.queue);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread = l.thread;
    let joined = std::thread::Builder::new().name("dpukv-close".into()).spawn(move || {
        let _ = thread.join();
        let _ = tx.send(());
    });
    if joined.is_err() {
        return false;
    }
    match tokio::time::timeout(CLOSE_WAIT, rx).await {
        Ok(_) => true,
        Err(_) => {
            tracing::error!(after = ?CLOSE_WAIT, "a region's writer did not finish; its files stay until the next start");
            false
        }
    }
}

/// Splits and merges, on this node's side: tells every led region's writer the ranges it keeps
/// (its own, plus a merge's incoming range while it is copied), starts driving the handoffs whose
/// source this node leads, and lifts the fence of those that ended.
#[allow(clippy::too_many_arguments)]
fn steer_handoffs(
    snap: &master::Snapshot,
    me: u32,
    led: &mut HashMap<u32, Led>,
    driving: &mut HashMap<u32, (i64, tokio::task::JoinHandle<()>)>,
    split_targets: &[RegionInfo],
    store: &EtcdStore,
    keys: &Keys,
    lease: dpukv_cluster::LeaseId,
) {
    let running = &snap.handoffs.running;
    for (id, l) in led.iter_mut() {
        let Some(r) = snap.map.regions.iter().chain(split_targets).find(|r| r.id == *id) else { continue };
        let mut ranges = vec![KeyRange { start: r.start.clone(), end: r.end.clone() }];
        for run in running.iter().filter(|run| run.handoff.target == *id && run.handoff.kind == HandoffKind::Merge) {
            ranges.push(KeyRange { start: run.handoff.start.clone(), end: run.handoff.end.clone() });
        }
        if l.keep.as_ref() != Some(&ranges) && l.control.try_send(Control::Keep(Some(ranges.clone()))).is_ok() {
            l.keep = Some(ranges);
        }
    }
    // Handoffs that ended (or were replaced): stop driving, lift the fence. The map read shows
    // the handoff gone, so it can no longer commit: the source's writer may take the range's
    // writes again (if the range is still its own).
    driving.retain(|source, (create, task)| {
        let current = running.iter().any(|run| run.handoff.source == *source && run.create == *create);
        if !current {
            task.abort();
            if let Some(l) = led.get(source) {
                handoff::unfence(&l.control);
            }
            tracing::info!(region = source, "handoff ended");
        }
        current
    });
    for run in running {
        let h = &run.handoff;
        if driving.contains_key(&h.source) {
            continue;
        }
        let (Some(s), Some(t)) = (led.get(&h.source), led.get(&h.target)) else { continue };
        if snap.map.region(h.source).is_none_or(|r| r.primary != me) || !s.serving {
            continue;
        }
        let (hc, create, sc, tc) = (h.clone(), run.create, s.control.clone(), t.control.clone());
        let (store, keys) = (store.clone(), keys.clone());
        let task = tokio::spawn(async move {
            // Retried until it succeeds or the handoff ends (the master aborts one that takes
            // too long).
            loop {
                match handoff::drive(hc.clone(), create, sc.clone(), tc.clone(), store.clone(), keys.clone(), lease)
                    .await
                {
                    Ok(_) => return,
                    Err(e) => {
                        tracing::warn!(source = hc.source, error = %format!("{e:#}"), "copying a handoff failed; retrying")
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        driving.insert(h.source, (run.create, task));
    }
}

/// Removes a region's files (off the async runtime: a large region takes a while).
async fn remove_region_files(opener: &Opener, id: u32) {
    let (dir, shm) = (opener.dir(id), pod::region_dir(&opener.shm_dir, id));
    blocking(move || {
        let _ = std::fs::remove_dir_all(dir);
        let _ = std::fs::remove_dir_all(shm);
    })
    .await;
}

/// Runs `f` on tokio's blocking threads and waits for it: opening, promoting and removing
/// regions touch files and join threads, and the runtime's own threads must stay free — among
/// other things they keep the node's lease alive, and a late keep-alive ends its authority.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// The published map's announcement, and the authority's life it was read in.
type Vouched = std::sync::Mutex<Option<(dpukv_storage::announce::Announcement, u64)>>;

/// On drop: the device stops trusting the published map (the announcement is taken out under
/// the lock the voucher extends it under, so no extension follows), then the lease's keeper stops
/// and gives the lease back.
struct Unvouch {
    vouched: Arc<Vouched>,
    lease_stop: CancellationToken,
}

impl Drop for Unvouch {
    fn drop(&mut self) {
        if let Some((a, _)) = self.vouched.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = a.set_valid_until(0);
        }
        self.lease_stop.cancel();
    }
}

/// The end of the authority's life `life` as monotonic nanoseconds (0: none, or a later life).
fn authority_ns(a: &Authority, life: u64) -> u64 {
    let now = std::time::Instant::now();
    match a.until_in(life) {
        Some(t) if t > now => dpukv_storage::announce::monotonic_ns().saturating_add((t - now).as_nanos() as u64),
        _ => 0,
    }
}

/// Publishes the map for the device (and this host's dispatch): regions in `led` minus `losing`
/// are served here, vouched for while `authority` lasts.
#[allow(clippy::too_many_arguments)]
fn publish(
    served: &SharedServed,
    map: &dpukv_proto::regionmap::RegionMap,
    me: u32,
    led: &HashMap<u32, Led>,
    losing: &[u32],
    opener: &Opener,
    vouched: &Vouched,
    (authority, life): (&Authority, u64),
) -> Result<()> {
    let mut view = map.clone();
    for r in &mut view.regions {
        // Served here only if open here and its backups hold what it began with; a region the
        // map gives this node but that is not open (or ready) yet is refused as not served, and
        // one being given up is no longer served.
        if r.primary == me && (!led.get(&r.id).is_some_and(|l| l.serving) || losing.contains(&r.id)) {
            r.primary = 0;
        }
    }
    let rmap = RegionMap::new(view, me)?;
    // The device first, then this host's dispatch of writes: once a write is taken by the new
    // map, no read starts by the old one. (After a split's commit, a write to the new region must
    // not be acknowledged while the device still reads the moved keys from the source, whose
    // copy of them is final.)
    let a = pod::publish_map(&opener.shm_dir, &rmap, authority_ns(authority, life))?;
    *vouched.lock().unwrap_or_else(|e| e.into_inner()) = Some((a, life));
    let mut s = served.write().unwrap_or_else(|e| e.into_inner());
    s.writers = led.iter().filter(|(id, _)| !losing.contains(id)).map(|(id, l)| (*id, l.queue.clone())).collect();
    s.map = rmap;
    Ok(())
}
