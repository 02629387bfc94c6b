//! The source primary's side of a split or merge (docs/cluster.md §9): fence the moving range in
//! the source's writer, empty the range in the target (left over from an aborted attempt), copy
//! the range and the source's exactly-once sessions into the target through its replicated write
//! path, and report the copy done (under this node's lease, naming the handoff by its key's create
//! revision). The master then commits; until the handoff is gone from the map the fence stays.
//!
//! Also the size reports the master splits and merges by (`region-stats/<region>`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use dpukv_cluster::handoff::RegionLoad;
use dpukv_cluster::keys::Keys;
use dpukv_cluster::{EtcdStore, LeaseId, MetaStore};
use dpukv_proto::regionmap::Handoff;
use tokio::sync::{mpsc, oneshot};

use super::worker::{Control, ImportItem, KeyRange};

/// Items per copied batch.
const COPY_ITEMS: usize = 1000;
/// About the most bytes per copied batch.
const COPY_BYTES: usize = 1 << 20;
/// Exactly-once entries per copied batch.
const SESSION_ENTRIES: usize = 1000;

async fn ask<T>(ctl: &mpsc::Sender<Control>, make: impl FnOnce(oneshot::Sender<T>) -> Control) -> Result<T> {
    let (tx, rx) = oneshot::channel();
    ctl.send(make(tx)).await.map_err(|_| anyhow!("the region's writer is gone"))?;
    rx.await.map_err(|_| anyhow!("the region's writer dropped the request"))
}

async fn export(ctl: &mpsc::Sender<Control>, from: &[u8], end: &Option<Vec<u8>>) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let (from, end) = (from.to_vec(), end.clone());
    ask(ctl, |done| Control::Export { from, end, limit: COPY_ITEMS, max_bytes: COPY_BYTES, done })
        .await?
        .map_err(|e| anyhow!("reading the range: {e}"))
}

async fn import(
    ctl: &mpsc::Sender<Control>,
    items: Vec<ImportItem>,
    entries: Vec<dpukv_storage::region::SessionEntry>,
) -> Result<()> {
    ask(ctl, |done| Control::Import { items, entries, done }).await?.map_err(|e| anyhow!("writing the copy: {e}"))
}

/// What a handoff copied.
#[derive(Debug, Default, Clone, Copy)]
pub struct Copied {
    /// Keys copied.
    pub keys: u64,
    /// Bytes of keys and values copied.
    pub bytes: u64,
    /// Exactly-once entries copied.
    pub sessions: u64,
    /// Keys the target held in the range before (deleted first).
    pub cleared: u64,
}

/// Runs the source primary's part of handoff `h` (named by `create`): see the module
/// documentation. Returns once the copy is reported.
#[allow(clippy::too_many_arguments)]
pub async fn drive(
    h: Handoff,
    create: i64,
    source: mpsc::Sender<Control>,
    target: mpsc::Sender<Control>,
    store: EtcdStore,
    keys: Keys,
    lease: LeaseId,
) -> Result<Copied> {
    let started = Instant::now();
    let range = KeyRange { start: h.start.clone(), end: h.end.clone() };
    // 1. From now on the source applies no write to the range: what it holds there is final.
    ask(&source, |done| Control::Fence { range: Some(range.clone()), done }).await?;
    let mut copied = Copied::default();
    // 2. The target holds nothing of the range (an aborted attempt may have left some).
    loop {
        let stale = export(&target, &range.start, &range.end).await?;
        if stale.is_empty() {
            break;
        }
        copied.cleared += stale.len() as u64;
        import(&target, stale.into_iter().map(|(k, _)| (k, None)).collect(), vec![]).await?;
    }
    // 3. The exactly-once sessions: a retry of a write the source applied is answered by the
    //    target, not applied again. (Entries ride on a batch: each carries a delete of the range's
    //    first key, which the target does not hold yet — the copy comes after.)
    let entries = ask(&source, Control::Sessions).await?;
    copied.sessions = entries.len() as u64;
    for chunk in entries.chunks(SESSION_ENTRIES) {
        import(&target, vec![(range.start.clone(), None)], chunk.to_vec()).await?;
    }
    // 4. The range, batch by batch, each acknowledged by the target's backups.
    let mut from = range.start.clone();
    loop {
        let items = export(&source, &from, &range.end).await?;
        let Some((last, _)) = items.last() else { break };
        from = dpukv_proto::regionmap::key_after(last);
        copied.keys += items.len() as u64;
        copied.bytes += items.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum::<u64>();
        import(&target, items.into_iter().map(|(k, v)| (k, Some(v))).collect(), vec![]).await?;
    }
    // 5. Report (under this node's lease: if it dies, the report goes and the master aborts).
    store
        .put(&keys.handoff_done(h.source), create.to_string().as_bytes(), Some(lease))
        .await
        .context("reporting the copy done")?;
    tracing::info!(source = h.source, target = h.target, kind = ?h.kind, keys = copied.keys, bytes = copied.bytes,
        sessions = copied.sessions, cleared = copied.cleared, took = ?started.elapsed(), "handoff copied");
    Ok(copied)
}

/// Lifts the fence of a handoff that ended (committed: the range is no longer the source's;
/// aborted: it serves the range again).
pub fn unfence(source: &mpsc::Sender<Control>) {
    let (done, _) = oneshot::channel();
    let _ = source.try_send(Control::Fence { range: None, done });
}

/// How often primaries report their regions' sizes.
pub const REPORT_EVERY: Duration = Duration::from_secs(2);

/// Thresholds a report compares against (to know whether to find a middle key).
#[derive(Debug, Clone, Copy)]
pub struct ReportThresholds {
    /// From the cluster's configuration.
    pub split_bytes: u64,
    /// From the cluster's configuration.
    pub split_writes_per_sec: u64,
}

/// Reports the sizes and loads of `regions` (id, writer) under `lease`. A middle key is looked
/// for only when a region is past a split threshold (it walks the region's keys).
pub async fn report(
    regions: Vec<(u32, mpsc::Sender<Control>)>,
    t: ReportThresholds,
    elapsed: Duration,
    store: EtcdStore,
    keys: Keys,
    lease: LeaseId,
    last: Arc<std::sync::Mutex<std::collections::HashMap<u32, RegionLoad>>>,
) {
    for (id, ctl) in regions {
        let Ok(Ok((bytes, writes, _))) = ask(&ctl, |done| Control::Load { middle: false, done }).await else {
            continue;
        };
        let writes_per_sec = (writes as f64 / elapsed.as_secs_f64().max(0.001)) as u64;
        let due = (t.split_bytes > 0 && bytes >= t.split_bytes)
            || (t.split_writes_per_sec > 0 && writes_per_sec >= t.split_writes_per_sec);
        // Past a threshold by the estimate: the live bytes of its own range decide (dead
        // versions, tombstones and keys it gave away do not make a region big).
        let (bytes, middle) = if due {
            match ask(&ctl, |done| Control::Load { middle: true, done }).await {
                Ok(Ok((live, _, m))) => {
                    let still = (t.split_bytes > 0 && live >= t.split_bytes)
                        || (t.split_writes_per_sec > 0 && writes_per_sec >= t.split_writes_per_sec);
                    (live, m.filter(|_| still))
                }
                _ => (bytes, None),
            }
        } else {
            (bytes, None)
        };
        let load = RegionLoad { bytes, writes_per_sec, middle };
        let prev = last.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned();
        // Written when it changed by a tenth or more, or the middle key changed.
        let changed = prev.as_ref().is_none_or(|p| {
            p.middle != load.middle
                || p.bytes.abs_diff(load.bytes) * 10 > p.bytes.max(1)
                || p.writes_per_sec.abs_diff(load.writes_per_sec) * 10 > p.writes_per_sec.max(1)
        });
        if changed && store.put(&keys.region_stat(id), &load.encode(), Some(lease)).await.is_ok() {
            last.lock().unwrap_or_else(|e| e.into_inner()).insert(id, load);
        }
    }
}
