//! The plugin binary against a fake kubelet that speaks the real gRPC API (the `Registration`
//! service on `kubelet.sock`, and a `DevicePlugin` client on the plugin's socket), in a temp
//! directory, with a fake sysfs tree: registration, the device list stream, allocation, a
//! device going unhealthy and coming back, a kubelet restart followed by a new registration,
//! `/healthz` and `/metrics`, and a clean shutdown that removes the plugin's socket.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dpukv_device_plugin::api::device_plugin_client::DevicePluginClient;
use dpukv_device_plugin::api::registration_server::{Registration, RegistrationServer};
use dpukv_device_plugin::api::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty, ListAndWatchResponse,
    PreferredAllocationRequest, RegisterRequest,
};
use dpukv_device_plugin::kubelet;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Default)]
struct Registrations(Arc<Mutex<Vec<RegisterRequest>>>);

#[tonic::async_trait]
impl Registration for Registrations {
    async fn register(&self, req: tonic::Request<RegisterRequest>) -> Result<tonic::Response<Empty>, tonic::Status> {
        let req = req.into_inner();
        if req.version != "v1beta1" {
            return Err(tonic::Status::invalid_argument("unsupported version"));
        }
        self.0.lock().expect("lock").push(req);
        Ok(tonic::Response::new(Empty {}))
    }
}

/// A kubelet's registration endpoint in `dir`.
struct FakeKubelet {
    dir: PathBuf,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl FakeKubelet {
    fn start(dir: &Path, seen: Registrations) -> FakeKubelet {
        let listener = tokio::net::UnixListener::bind(dir.join("kubelet.sock")).expect("bind kubelet.sock");
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(seen))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move { s.cancelled().await })
                .await
                .expect("fake kubelet");
        });
        FakeKubelet { dir: dir.to_path_buf(), stop, task }
    }

    /// Stops as a restarting kubelet does: its socket and every plugin's socket go.
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
        for e in std::fs::read_dir(&self.dir).expect("dir") {
            let p = e.expect("entry").path();
            if p.extension().is_some_and(|x| x == "sock") {
                std::fs::remove_file(p).expect("remove socket");
            }
        }
    }
}

struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn fake_function(sysfs: &Path, addr: &str, device: &str, numa: &str, iommu: Option<&str>, driver: &str) {
    let d = sysfs.join("bus/pci/devices").join(addr);
    std::fs::create_dir_all(&d).expect("dir");
    std::fs::write(d.join("vendor"), "0x15b3\n").expect("vendor");
    std::fs::write(d.join("device"), device).expect("device");
    std::fs::write(d.join("numa_node"), numa).expect("numa");
    if let Some(g) = iommu {
        std::os::unix::fs::symlink(format!("../../../kernel/iommu_groups/{g}"), d.join("iommu_group")).expect("link");
    }
    std::os::unix::fs::symlink(format!("../../../bus/pci/drivers/{driver}"), d.join("driver")).expect("driver");
}

/// A network interface of a function, its link `state` (`up`, `down`).
fn fake_link(sysfs: &Path, addr: &str, name: &str, state: &str) {
    let d = sysfs.join("bus/pci/devices").join(addr).join("net").join(name);
    std::fs::create_dir_all(&d).expect("dir");
    std::fs::write(d.join("operstate"), format!("{state}\n")).expect("operstate");
}

async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn http_get(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    out
}

/// A port for a child process, reserved machine-wide (outside the kernel's ephemeral range, which
/// could hand a released port to an outgoing connection before the child binds it).
fn free_port() -> u16 {
    dpukv_net::ports::reserve().expect("a free port")
}

async fn next_list(stream: &mut tonic::Streaming<ListAndWatchResponse>) -> Vec<(String, String)> {
    let msg = tokio::time::timeout(Duration::from_secs(15), stream.next())
        .await
        .expect("a list in time")
        .expect("the stream goes on")
        .expect("a list");
    msg.devices.into_iter().map(|d| (d.id, d.health)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_registers_lists_allocates_tracks_health_and_survives_a_kubelet_restart() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (dir, sysfs) = (tmp.path().join("device-plugins"), tmp.path().join("sys"));
    std::fs::create_dir_all(&dir).expect("dir");
    // A dual-port card (two functions, one DPU): one port bound to vfio-pci (its IOMMU group is
    // given to the container), the other run by mlx5_core (its group is not: nothing in user
    // space may open it).
    fake_function(&sysfs, "0000:03:00.0", "0xa2d6\n", "0\n", Some("7"), "vfio-pci");
    fake_function(&sysfs, "0000:03:00.1", "0xa2d6\n", "0\n", Some("8"), "mlx5_core");
    fake_link(&sysfs, "0000:03:00.1", "p1", "up");
    fake_function(&sysfs, "0000:81:00.0", "0xa2dc\n", "1\n", None, "mlx5_core");
    fake_link(&sysfs, "0000:81:00.0", "p0", "up");
    fake_function(&sysfs, "0000:00:1f.0", "0x1234\n", "0\n", None, "e1000e"); // not a DPU
    let seen = Registrations::default();
    let kubelet = FakeKubelet::start(&dir, seen.clone());
    let port = free_port();
    let mut plugin = Plugin(
        Command::new(env!("CARGO_BIN_EXE_dpukv-device-plugin"))
            .args(["--plugin-dir", dir.to_str().expect("utf-8"), "--sysfs", sysfs.to_str().expect("utf-8")])
            .args(["--health-interval", "1", "--metrics", &format!("127.0.0.1:{port}")])
            .spawn()
            .expect("start the plugin"),
    );

    // Registration: version, our socket, the resource, preferred allocations on.
    let reg = eventually("a registration", || seen.0.lock().expect("lock").first().cloned()).await;
    assert_eq!((reg.version.as_str(), reg.resource_name.as_str()), ("v1beta1", "dpukv.io/dpu"));
    assert_eq!(reg.endpoint, "dpukv-dpu.sock");
    assert!(reg.options.as_ref().is_some_and(|o| o.get_preferred_allocation_available && !o.pre_start_required));
    let sock = dir.join(&reg.endpoint);
    let client = || async {
        DevicePluginClient::new(kubelet::channel(&sock, Duration::from_secs(5)).await.expect("plugin socket"))
    };
    let mut c = client().await;
    let opts = c.get_device_plugin_options(Empty {}).await.expect("options").into_inner();
    assert!(opts.get_preferred_allocation_available);

    // The list: both DPUs (cards, not functions), healthy, with their NUMA nodes.
    let mut stream = c.list_and_watch(Empty {}).await.expect("list and watch").into_inner();
    let healthy = |ids: &[&str]| ids.iter().map(|i| (i.to_string(), "Healthy".to_string())).collect::<Vec<_>>();
    assert_eq!(next_list(&mut stream).await, healthy(&["0000:03:00", "0000:81:00"]));

    // Allocation: the ids in the environment, the VFIO nodes of a function in an IOMMU group,
    // its sysfs directory read-only.
    let alloc = |ids: &[&str]| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids.iter().map(|s| s.to_string()).collect() }],
    };
    let a = c.allocate(alloc(&["0000:03:00"])).await.expect("allocate").into_inner();
    let r = &a.container_responses[0];
    assert_eq!(r.envs["DPUKV_DEVICE_IDS"], "0000:03:00");
    let nodes: Vec<&str> = r.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(nodes, ["/dev/vfio/7", "/dev/vfio/vfio"], "only the vfio-pci function's group");
    let mounts: Vec<&str> = r.mounts.iter().map(|m| m.container_path.as_str()).collect();
    assert_eq!(mounts, ["/run/dpukv/devices/0000:03:00.0", "/run/dpukv/devices/0000:03:00.1"]);
    assert!(r.mounts.iter().all(|m| m.read_only));
    // A card run by kernel drivers only: no VFIO node at all.
    let a = c.allocate(alloc(&["0000:81:00"])).await.expect("allocate").into_inner();
    assert!(a.container_responses[0].devices.is_empty(), "{:?}", a.container_responses[0].devices);
    let unknown = c.allocate(alloc(&["0000:99:00"])).await.expect_err("unknown device");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let pref = c
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["0000:03:00".into(), "0000:81:00".into()],
                must_include_device_i_ds: vec!["0000:81:00".into()],
                allocation_size: 1,
            }],
        })
        .await
        .expect("preferred")
        .into_inner();
    assert_eq!(pref.container_responses[0].device_i_ds, ["0000:81:00"]);

    // A function falls off the bus: unhealthy, and not allocated; back: healthy.
    let gone = sysfs.join("bus/pci/devices/0000:81:00.0");
    let saved = tmp.path().join("saved");
    std::fs::rename(&gone, &saved).expect("remove the function");
    let one_down = |down: &str| {
        ["0000:03:00", "0000:81:00"]
            .iter()
            .map(|i| (i.to_string(), if *i == down { "Unhealthy" } else { "Healthy" }.to_string()))
            .collect::<Vec<_>>()
    };
    assert_eq!(next_list(&mut stream).await, one_down("0000:81:00"));
    let refused = c.allocate(alloc(&["0000:81:00"])).await.expect_err("unhealthy");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    std::fs::rename(&saved, &gone).expect("restore the function");
    assert_eq!(next_list(&mut stream).await, healthy(&["0000:03:00", "0000:81:00"]));
    // Present but not working: every link down (a hung or cut-off DPU), then back up.
    fake_link(&sysfs, "0000:81:00.0", "p0", "down");
    assert_eq!(next_list(&mut stream).await, one_down("0000:81:00"));
    fake_link(&sysfs, "0000:81:00.0", "p0", "up");
    assert_eq!(next_list(&mut stream).await, healthy(&["0000:03:00", "0000:81:00"]));
    // A function whose driver is unbound (a card being reset): unhealthy.
    std::fs::remove_file(sysfs.join("bus/pci/devices/0000:03:00.1/driver")).expect("unbind");
    assert_eq!(next_list(&mut stream).await, one_down("0000:03:00"));
    std::os::unix::fs::symlink("../../../bus/pci/drivers/mlx5_core", sysfs.join("bus/pci/devices/0000:03:00.1/driver"))
        .expect("bind");
    assert_eq!(next_list(&mut stream).await, healthy(&["0000:03:00", "0000:81:00"]));

    // Health and metrics.
    let h = tokio::task::spawn_blocking(move || http_get(port, "/healthz")).await.expect("healthz");
    assert!(h.starts_with("HTTP/1.0 200") || h.starts_with("HTTP/1.1 200"), "{h}");
    let m = tokio::task::spawn_blocking(move || http_get(port, "/metrics")).await.expect("metrics");
    assert!(m.contains("dpukv_device_plugin_registrations_total 1"), "{m}");
    assert!(m.contains("dpukv_device_plugin_healthy_devices 2"), "{m}");
    assert!(m.contains("dpukv_device_plugin_allocations_total 2"), "{m}");

    // The kubelet restarts (removing every socket): the plugin serves on a new socket and
    // registers again; the old stream ends.
    kubelet.stop().await;
    let ended = tokio::time::timeout(Duration::from_secs(15), stream.next()).await.expect("the old stream ends");
    assert!(!matches!(ended, Some(Ok(_))), "no more lists on the old stream: {ended:?}");
    let kubelet = FakeKubelet::start(&dir, seen.clone());
    eventually("a second registration", || (seen.0.lock().expect("lock").len() == 2).then_some(())).await;
    let mut c = client().await;
    let mut stream = c.list_and_watch(Empty {}).await.expect("list and watch again").into_inner();
    assert_eq!(next_list(&mut stream).await, healthy(&["0000:03:00", "0000:81:00"]));

    // A clean shutdown removes the plugin's socket.
    let pid = plugin.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let status = tokio::task::spawn_blocking(move || {
        let s = plugin.0.wait();
        (s, plugin)
    })
    .await
    .expect("wait")
    .0
    .expect("exit status");
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists(), "the plugin's socket is removed on shutdown");
    kubelet.stop().await;
}
