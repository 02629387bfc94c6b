//! Building the workspace's binaries and running a node pod (host and device processes).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The directory holding this build's binaries, after building them once per test process
/// (`cargo build --bins` for the node, client, gateway and operator packages, same profile).
pub fn bin_dir() -> Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            // target/<profile>/deps/<test binary>
            let dir = exe.parent().and_then(Path::parent).ok_or("unexpected test binary location")?.to_path_buf();
            let release = dir.file_name().is_some_and(|n| n == "release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args([
                "build",
                "--bins",
                "-p",
                "dpukv-node",
                "-p",
                "dpukv-client",
                "-p",
                "dpukv-gateway",
                "-p",
                "dpukv-operator",
                "-p",
                "dpukv-storage",
            ]);
            if release {
                cmd.arg("--release");
            }
            let status = cmd.status().map_err(|e| e.to_string())?;
            if !status.success() {
                return Err(format!("building the binaries failed: {status}"));
            }
            Ok(dir)
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

/// A child process, killed (SIGKILL) and reaped on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits (30 s at most) for `child` to log a line containing `what` on stderr; returns the line
/// (the rest of its stderr is read and dropped).
pub fn wait_for(child: &mut Child, what: &str) -> Result<String> {
    let stderr = child.stderr.take().context("stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        match lines.next() {
            Some(Ok(l)) if l.contains(what) => {
                std::thread::spawn(move || for _ in lines.by_ref() {});
                return Ok(l);
            }
            Some(Ok(_)) => {}
            _ => bail!("process exited before logging {what:?}"),
        }
    }
    bail!("process did not log {what:?} in time")
}

/// A node pod on a temp directory.
pub struct Pod {
    /// The pod's directory (data and shared memory).
    pub dir: tempfile::TempDir,
    /// The host process.
    pub host: Option<Proc>,
    /// The device process.
    pub device: Option<Proc>,
    /// The device's data port.
    pub addr: String,
    host_args: Vec<String>,
}

impl Pod {
    /// Starts a host (with `host_args`) and a device.
    pub fn start(host_args: &[&str]) -> Result<Pod> {
        let dir = tempfile::tempdir()?;
        let mut pod = Pod {
            dir,
            host: None,
            device: None,
            addr: String::new(),
            host_args: host_args.iter().map(|s| s.to_string()).collect(),
        };
        pod.start_host()?;
        let mut c = Command::new(bin_dir()?.join("dpukv-dpu"));
        c.arg("--shm-dir")
            .arg(pod.dir.path().join("shm"))
            .args(["--listen", "127.0.0.1:0"])
            .stderr(Stdio::piped())
            .stdout(Stdio::null());
        let mut child = c.spawn().context("starting dpukv-dpu")?;
        let line = wait_for(&mut child, "device serving")?;
        pod.addr = line
            .split("listen=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .context("device address")?
            .to_string();
        pod.device = Some(Proc(child));
        Ok(pod)
    }

    /// (Re)starts the host.
    pub fn start_host(&mut self) -> Result<()> {
        let mut c = Command::new(bin_dir()?.join("dpukv-node"));
        c.arg("--data-dir").arg(self.dir.path().join("data")).arg("--shm-dir").arg(self.dir.path().join("shm"));
        c.args(&self.host_args).stderr(Stdio::piped()).stdout(Stdio::null());
        let mut child = c.spawn().context("starting dpukv-node")?;
        wait_for(&mut child, "host serving")?;
        self.host = Some(Proc(child));
        Ok(())
    }

    /// SIGKILLs the host.
    pub fn kill_host(&mut self) {
        self.host = None;
    }
}

/// `dpukv local`'s `DIR/cluster.json` (written atomically once its processes are started), read
/// once it exists — waiting up to `within` for it.
pub fn cluster_json(dir: &Path, within: Duration) -> Result<serde_json::Value> {
    let json = dir.join("cluster.json");
    let deadline = Instant::now() + within;
    while !json.exists() {
        if Instant::now() >= deadline {
            bail!("no {} within {within:?}", json.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = std::fs::read_to_string(&json).with_context(|| format!("reading {}", json.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", json.display()))
}

/// A port free on 127.0.0.1 now, for a process to bind next, reserved for the rest of this
/// process's life against every other picker of the machine — test processes and the `dpukv
/// local` clusters they start (dpukv_client::ports): a node that is restarted keeps its ports,
/// and while it was down another test running beside this one once picked its admin port (the
/// restart failed with "Address already in use"); `dpukv local` picking without the reservation
/// once took a port another test then bound, and its device's front door never started.
pub fn free_port() -> Result<u16> {
    Ok(dpukv_client::ports::reserve()?)
}

/// Process `pid`'s established TCP connections to the port of any of `addrs` (`host:port`, or a
/// `fabric://PROVIDER/host:port` endpoint; its sockets among its descriptors, matched by inode
/// with /proc/net/tcp): which of a node's ports a client really uses (a fabric endpoint's `tcp`
/// provider speaks TCP too).
pub fn connections_to(pid: u32, addrs: &[String]) -> usize {
    let ports: Vec<u16> = addrs.iter().filter_map(|a| a.rsplit(':').next()?.parse().ok()).collect();
    let mine: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let remote = f.get(2).and_then(|r| r.split(':').nth(1)).and_then(|p| u16::from_str_radix(p, 16).ok());
            f.get(3) == Some(&"01")
                && remote.is_some_and(|p| ports.contains(&p))
                && f.get(9).is_some_and(|i| mine.contains(*i))
        })
        .count()
}
