//! The `DevicePlugin` service the kubelet calls: the inventory (every device seen, healthy while
//! present and its probe passes — drivers bound, a link up: `FoundDevice::probe`), `ListAndWatch`
//! streaming the list whenever a device's health changes, `GetPreferredAllocation` choosing
//! NUMA-aligned devices, `Allocate` answering what the device container needs
//! (`DPUKV_DEVICE_IDS`, the VFIO device nodes of the functions bound to `vfio-pci` — a function a
//! kernel driver runs has none to give —, every function's sysfs directory read-only), and
//! `PreStartContainer` (nothing to do: not requested).
//!
//! Bounds: the inventory holds at most [`MAX_DEVICES`] devices (more found are not offered, and
//! said so in the log); each `ListAndWatch` stream has a queue of [`STREAM_QUEUE`] lists and
//! always sends the newest (a slow kubelet sees fewer, never stale, lists); streams end when the
//! plugin stops.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::api::device_plugin_server::DevicePlugin;
use crate::api::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, DeviceSpec, Empty, ListAndWatchResponse, Mount, NumaNode, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse, TopologyInfo,
};
use crate::metrics::Metrics;
use crate::sysfs::{FoundDevice, VFIO_DRIVER};

/// The kubelet's health strings (constants.go of the API).
pub const HEALTHY: &str = "Healthy";
/// See [`HEALTHY`].
pub const UNHEALTHY: &str = "Unhealthy";

/// Most devices offered by one plugin.
pub const MAX_DEVICES: usize = 256;

/// Lists queued per `ListAndWatch` stream.
pub const STREAM_QUEUE: usize = 4;

/// Environment variable naming the allocated devices (comma-separated ids) in the container.
pub const ENV_DEVICE_IDS: &str = "DPUKV_DEVICE_IDS";

/// Where an allocated PCI function's sysfs directory is mounted (read-only), `/<address>`
/// appended (`dpukv-dpu` checks its devices there).
pub const SYSFS_MOUNT: &str = "/run/dpukv/devices";

/// A device as the plugin knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// What was found last time it was present.
    pub found: FoundDevice,
    /// Present at the last scan, and its probe passed.
    pub healthy: bool,
}

/// Every device seen since the plugin started, by id; published to the streams on change.
#[derive(Debug)]
pub struct Inventory {
    tx: watch::Sender<BTreeMap<String, Known>>,
}

impl Default for Inventory {
    fn default() -> Self {
        Inventory { tx: watch::channel(BTreeMap::new()).0 }
    }
}

impl Inventory {
    /// Takes a scan: present devices are healthy when their probe passes (new ones added),
    /// missing ones unhealthy. Returns whether anything changed.
    pub fn update(&self, scan: BTreeMap<String, FoundDevice>) -> bool {
        self.tx.send_if_modified(|known| {
            let mut changed = false;
            for k in known.values_mut() {
                if k.healthy && !scan.contains_key(&k.found.id) {
                    k.healthy = false;
                    changed = true;
                }
            }
            for (id, found) in scan {
                let full = known.len() >= MAX_DEVICES;
                let healthy = match found.probe() {
                    Ok(()) => true,
                    Err(why) => {
                        if known.get(&id).is_none_or(|k| k.healthy) {
                            tracing::warn!(device = %id, why, "device unhealthy");
                        }
                        false
                    }
                };
                match known.get_mut(&id) {
                    Some(k) if k.healthy == healthy && k.found == found => {}
                    Some(k) => {
                        *k = Known { found, healthy };
                        changed = true;
                    }
                    None if full => {
                        tracing::warn!(device = %id, max = MAX_DEVICES, "too many devices: not offered");
                    }
                    None => {
                        known.insert(id, Known { found, healthy });
                        changed = true;
                    }
                }
            }
            changed
        })
    }

    /// The devices now.
    pub fn snapshot(&self) -> BTreeMap<String, Known> {
        self.tx.borrow().clone()
    }

    fn subscribe(&self) -> watch::Receiver<BTreeMap<String, Known>> {
        self.tx.subscribe()
    }
}

/// The list the kubelet is sent.
pub fn listed(known: &BTreeMap<String, Known>) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: known
            .values()
            .map(|k| Device {
                id: k.found.id.clone(),
                health: if k.healthy { HEALTHY } else { UNHEALTHY }.to_string(),
                topology: k.found.numa.map(|n| TopologyInfo { nodes: vec![NumaNode { id: n as i64 }] }),
            })
            .collect(),
    }
}

/// See the module documentation.
#[derive(Clone)]
pub struct Plugin {
    inventory: Arc<Inventory>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
}

impl Plugin {
    /// A service over `inventory`; its streams end when `stop` is cancelled.
    pub fn new(inventory: Arc<Inventory>, metrics: Arc<Metrics>, stop: CancellationToken) -> Plugin {
        Plugin { inventory, metrics, stop }
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

/// Chooses `size` of `available`, `must` first, then devices on the NUMA nodes `must` uses, then
/// on the node with the most available devices, then the rest — by id within each (stable).
pub fn prefer(
    known: &BTreeMap<String, Known>,
    available: &[String],
    must: &[String],
    size: usize,
) -> Result<Vec<String>, Status> {
    let avail: BTreeSet<&str> = available.iter().map(String::as_str).collect();
    if size > avail.len() {
        return Err(Status::invalid_argument(format!("allocation of {size} devices from {} available", avail.len())));
    }
    let mut out: Vec<String> = Vec::new();
    for m in must {
        if !avail.contains(m.as_str()) {
            return Err(Status::invalid_argument(format!("must-include device {m} is not available")));
        }
        if !out.contains(m) {
            out.push(m.clone());
        }
    }
    let numa = |id: &str| known.get(id).and_then(|k| k.found.numa);
    let mut per_node: BTreeMap<Option<u32>, usize> = BTreeMap::new();
    for a in &avail {
        *per_node.entry(numa(a)).or_default() += 1;
    }
    let wanted: BTreeSet<Option<u32>> = out.iter().map(|m| numa(m)).collect();
    let busiest = per_node.iter().max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n))).map(|(n, _)| *n);
    let rank = |id: &str| {
        let n = numa(id);
        if wanted.contains(&n) {
            0
        } else if wanted.is_empty() && Some(n) == busiest {
            1
        } else {
            2
        }
    };
    let mut rest: Vec<&str> = avail.iter().copied().filter(|a| !out.iter().any(|o| o == a)).collect();
    rest.sort_by_key(|a| (rank(a), numa(a), a.to_string()));
    out.extend(rest.into_iter().map(str::to_string));
    out.truncate(size.max(must.len()));
    Ok(out)
}

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<ListStream>, Status> {
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let mut watch = self.inventory.subscribe();
        let stop = self.stop.clone();
        self.metrics.streams.inc();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            loop {
                let list = listed(&watch.borrow_and_update());
                tokio::select! {
                    sent = tx.send(Ok(list)) => if sent.is_err() { break },
                    _ = stop.cancelled() => break,
                }
                tokio::select! {
                    changed = watch.changed() => if changed.is_err() { break },
                    _ = tx.closed() => break,
                    _ = stop.cancelled() => break,
                }
            }
            metrics.streams.dec();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let known = self.inventory.snapshot();
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            let size =
                usize::try_from(c.allocation_size).map_err(|_| Status::invalid_argument("negative allocation size"))?;
            let device_i_ds = prefer(&known, &c.available_device_i_ds, &c.must_include_device_i_ds, size)?;
            container_responses.push(ContainerPreferredAllocationResponse { device_i_ds });
        }
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, req: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        let known = self.inventory.snapshot();
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            if c.devices_ids.is_empty() {
                return Err(Status::invalid_argument("a container request names no device"));
            }
            let mut resp = ContainerAllocateResponse::default();
            let mut vfio = false;
            for id in &c.devices_ids {
                let Some(k) = known.get(id) else {
                    self.metrics.allocation_errors.inc();
                    return Err(Status::not_found(format!("unknown device {id}")));
                };
                if !k.healthy {
                    self.metrics.allocation_errors.inc();
                    return Err(Status::failed_precondition(format!("device {id} is unhealthy")));
                }
                for f in &k.found.functions {
                    // Only a function bound to vfio-pci has device nodes user space may use (a
                    // BlueField's functions run mlx5_core: its group's node would fail the start).
                    if let (Some(g), Some(VFIO_DRIVER)) = (&f.iommu_group, f.driver.as_deref()) {
                        resp.devices.push(DeviceSpec {
                            container_path: format!("/dev/vfio/{g}"),
                            host_path: format!("/dev/vfio/{g}"),
                            permissions: "rw".into(),
                        });
                        vfio = true;
                    }
                    resp.mounts.push(Mount {
                        container_path: format!("{SYSFS_MOUNT}/{}", f.address),
                        host_path: f.sysfs.display().to_string(),
                        read_only: true,
                    });
                }
            }
            if vfio {
                resp.devices.push(DeviceSpec {
                    container_path: "/dev/vfio/vfio".into(),
                    host_path: "/dev/vfio/vfio".into(),
                    permissions: "rw".into(),
                });
            }
            resp.envs.insert(ENV_DEVICE_IDS.into(), c.devices_ids.join(","));
            container_responses.push(resp);
            self.metrics.allocations.inc();
        }
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// What the plugin asks of the kubelet: no PreStartContainer calls; preferred allocations on.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, numa: Option<u32>) -> (String, FoundDevice) {
        (id.into(), FoundDevice { id: id.into(), numa, functions: Vec::new() })
    }

    fn inv(devs: &[(&str, Option<u32>)]) -> BTreeMap<String, Known> {
        let inv = Inventory::default();
        inv.update(devs.iter().map(|(i, n)| dev(i, *n)).collect());
        inv.snapshot()
    }

    #[test]
    fn missing_devices_turn_unhealthy_and_come_back() {
        let inv = Inventory::default();
        assert!(inv.update([dev("a", None), dev("b", None)].into_iter().collect()));
        assert!(!inv.update([dev("a", None), dev("b", None)].into_iter().collect()), "same: no change");
        assert!(inv.update([dev("a", None)].into_iter().collect()));
        let s = inv.snapshot();
        assert!(s["a"].healthy && !s["b"].healthy);
        assert_eq!(listed(&s).devices[1].health, UNHEALTHY);
        assert!(inv.update([dev("a", None), dev("b", None)].into_iter().collect()));
        assert!(inv.snapshot()["b"].healthy);
    }

    #[test]
    fn the_inventory_is_bounded() {
        let inv = Inventory::default();
        inv.update((0..MAX_DEVICES + 10).map(|i| dev(&format!("d{i:04}"), None)).collect());
        assert_eq!(inv.snapshot().len(), MAX_DEVICES);
    }

    #[test]
    fn preferred_allocations_stay_on_one_numa_node() {
        let k = inv(&[("a0", Some(0)), ("a1", Some(0)), ("b0", Some(1)), ("b1", Some(1)), ("b2", Some(1))]);
        let all: Vec<String> = k.keys().cloned().collect();
        // Must-include b0: the rest from node 1.
        assert_eq!(prefer(&k, &all, &["b0".into()], 2).expect("ok"), ["b0", "b1"]);
        assert_eq!(prefer(&k, &all, &["a1".into()], 2).expect("ok"), ["a1", "a0"]);
        // Nothing required: the node with the most free devices.
        assert_eq!(prefer(&k, &all, &[], 3).expect("ok"), ["b0", "b1", "b2"]);
        assert!(prefer(&k, &all, &[], 6).is_err());
        assert!(prefer(&k, &all[..2], &["b0".into()], 1).is_err(), "must-include not available");
    }
}
