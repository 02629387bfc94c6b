//! Cluster nodes for a test: a node pod (host and device processes) that joins a cluster in a
//! real etcd, on free loopback ports, with its logs in its directory; it can be SIGKILLed and
//! started again on the same data.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use dpukv_client::Client;
use dpukv_proto::regionmap::RegionMap;
use dpukv_proto::{Request, Response, decode_responses, encode_requests, frame_header};

use crate::procs::{Proc, bin_dir, free_port};

/// One node of a test cluster.
pub struct ClusterNode {
    /// Its id.
    pub id: u32,
    /// Its directory (data, shared memory, logs).
    pub dir: tempfile::TempDir,
    /// Its device's data port.
    pub device: String,
    /// Its host's admin endpoint.
    pub admin: String,
    host_args: Vec<String>,
    device_args: Vec<String>,
    /// Environment variables of both processes.
    env: Vec<(String, String)>,
    /// Runs the processes in a namespace (`ip netns exec NS`), or nothing.
    prefix: Vec<String>,
    host: Option<Proc>,
    dev: Option<Proc>,
    /// Its data directory is a tmpfs this test mounted (unmounted on drop).
    small_disk: bool,
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.kill();
        if self.small_disk {
            let _ = Command::new("umount").arg("-l").arg(self.dir.path().join("data")).status();
        }
    }
}

impl ClusterNode {
    /// Starts node `id` of cluster `cluster` on etcd `etcd` (host flags `extra` added).
    pub fn start(id: u32, cluster: &str, etcd: &str, extra: &[&str]) -> Result<ClusterNode> {
        let device = format!("127.0.0.1:{}", free_port()?);
        let admin = format!("127.0.0.1:{}", free_port()?);
        Self::start_at(id, cluster, etcd, extra, &[], Vec::new(), Vec::new(), "127.0.0.1", device, admin, None)
    }

    /// Like [`ClusterNode::start`], with its data directory on a tmpfs of `mib` MiB: a disk the
    /// test can fill ([`ClusterNode::fill_disk`]). Needs root (to mount).
    pub fn start_on_small_disk(id: u32, cluster: &str, etcd: &str, extra: &[&str], mib: u64) -> Result<ClusterNode> {
        let device = format!("127.0.0.1:{}", free_port()?);
        let admin = format!("127.0.0.1:{}", free_port()?);
        Self::start_at(id, cluster, etcd, extra, &[], Vec::new(), Vec::new(), "127.0.0.1", device, admin, Some(mib))
    }

    /// Cuts its power: both processes SIGKILLed, then its data directory turned into what its
    /// disk would hold (`dpukv-store power-cut`, seeded: synced data stays, a random part of the
    /// rest is lost) and its shared memory emptied. Its host must have run with
    /// `DPUKV_FAULT_JOURNAL=1`. Returns the cut's report.
    pub fn power_cut(&mut self, seed: u64) -> Result<String> {
        self.kill();
        let out = Command::new(bin_dir()?.join("dpukv-store"))
            .arg("power-cut")
            .arg(self.dir.path().join("data"))
            .args(["--seed", &seed.to_string()])
            .output()
            .context("running dpukv-store power-cut")?;
        if !out.status.success() {
            bail!("power-cut failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Fills its data directory's disk (a file written until the disk is full); returns the
    /// bytes written.
    pub fn fill_disk(&self) -> Result<u64> {
        use std::io::Write;
        let mut f = std::fs::File::create(self.dir.path().join("data").join("FILLER"))?;
        let chunk = vec![0xA5u8; 1 << 20];
        let mut n = 0u64;
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(k) => n += k as u64,
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                Err(e) => return Err(e.into()),
            }
        }
        Ok(n)
    }

    /// Frees what [`ClusterNode::fill_disk`] took.
    pub fn free_disk(&self) -> Result<()> {
        std::fs::remove_file(self.dir.path().join("data").join("FILLER"))?;
        Ok(())
    }

    /// Like [`ClusterNode::start`], with flags `both` given to the host and the device alike
    /// (TLS, say), and environment variables `env` set for both.
    pub fn start_with(
        id: u32,
        cluster: &str,
        etcd: &str,
        extra: &[&str],
        both: &[&str],
        env: &[(&str, &str)],
    ) -> Result<ClusterNode> {
        let device = format!("127.0.0.1:{}", free_port()?);
        let admin = format!("127.0.0.1:{}", free_port()?);
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::start_at(id, cluster, etcd, extra, both, env, Vec::new(), "127.0.0.1", device, admin, None)
    }

    /// Like [`ClusterNode::start`], in the network namespace `prefix` enters (`ip netns exec
    /// NS`; see [`crate::netns`]) at `ip` (the namespace's ports are all free: fixed ones).
    pub fn start_in(
        id: u32,
        cluster: &str,
        etcd: &str,
        extra: &[&str],
        prefix: Vec<String>,
        ip: &str,
    ) -> Result<ClusterNode> {
        let (device, admin) = (format!("{ip}:7070"), format!("{ip}:7071"));
        Self::start_at(id, cluster, etcd, extra, &[], Vec::new(), prefix, ip, device, admin, None)
    }

    /// Like [`ClusterNode::start_in`], with environment variables `env` for both processes and,
    /// with `disk_mib`, its data directory on a tmpfs of that size (root only).
    #[allow(clippy::too_many_arguments)]
    pub fn start_in_with(
        id: u32,
        cluster: &str,
        etcd: &str,
        extra: &[&str],
        prefix: Vec<String>,
        ip: &str,
        env: &[(&str, &str)],
        disk_mib: Option<u64>,
    ) -> Result<ClusterNode> {
        let (device, admin) = (format!("{ip}:7070"), format!("{ip}:7071"));
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::start_at(id, cluster, etcd, extra, &[], env, prefix, ip, device, admin, disk_mib)
    }

    #[allow(clippy::too_many_arguments)]
    fn start_at(
        id: u32,
        cluster: &str,
        etcd: &str,
        extra: &[&str],
        both: &[&str],
        env: Vec<(String, String)>,
        prefix: Vec<String>,
        ip: &str,
        device: String,
        admin: String,
        disk_mib: Option<u64>,
    ) -> Result<ClusterNode> {
        let dir = tempfile::tempdir()?;
        if let Some(mib) = disk_mib {
            let data = dir.path().join("data");
            std::fs::create_dir_all(&data)?;
            let status = Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
                .arg(&data)
                .status()
                .context("mounting a tmpfs (a full-disk test needs root)")?;
            if !status.success() {
                bail!("mounting a tmpfs at {} failed (a full-disk test needs root)", data.display());
            }
        }
        // The host binds any free port for replication and registers the one it got.
        let repl = format!("{ip}:0");
        let mut host_args: Vec<String> = [
            "--admin",
            &admin,
            "--cluster",
            cluster,
            "--node-id",
            &id.to_string(),
            "--etcd",
            etcd,
            "--replication-listen",
            &repl,
            "--advertise-device",
            &device,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        host_args.extend(extra.iter().chain(both).map(|s| s.to_string()));
        let device_args = both.iter().map(|s| s.to_string()).collect();
        let mut n = ClusterNode {
            id,
            dir,
            device,
            admin,
            host_args,
            device_args,
            env,
            prefix,
            host: None,
            dev: None,
            small_disk: disk_mib.is_some(),
        };
        n.resume()?;
        Ok(n)
    }

    /// Starts the host and device processes (again), on the same data and ports.
    pub fn resume(&mut self) -> Result<()> {
        let (data, shm) = (self.dir.path().join("data"), self.dir.path().join("shm"));
        let log = |name: &str| -> Result<std::fs::File> {
            Ok(std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join(name))?)
        };
        let command = |program: &str| -> Result<Command> {
            let path = bin_dir()?.join(program);
            Ok(match self.prefix.split_first() {
                Some((first, rest)) => {
                    let mut c = Command::new(first);
                    c.args(rest).arg(path);
                    c
                }
                None => Command::new(path),
            })
        };
        let mut h = command("dpukv-node")?;
        h.arg("--data-dir").arg(&data).arg("--shm-dir").arg(&shm).args(&self.host_args);
        h.envs(self.env.iter().map(|(k, v)| (k, v)));
        h.env("RUST_LOG", std::env::var("DPUKV_E2E_LOG").unwrap_or_else(|_| "info".into()))
            .stdout(Stdio::null())
            .stderr(log("host.log")?);
        self.host = Some(Proc(h.spawn().context("starting dpukv-node")?));
        self.start_device()
    }

    fn start_device(&mut self) -> Result<()> {
        let shm = self.dir.path().join("shm");
        let path = bin_dir()?.join("dpukv-dpu");
        let mut d = match self.prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(path);
                c
            }
            None => Command::new(path),
        };
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("device.log"))?;
        d.arg("--shm-dir").arg(&shm).args(["--listen", &self.device]).args(&self.device_args);
        d.envs(self.env.iter().map(|(k, v)| (k, v)));
        d.env("RUST_LOG", "info").stdout(Stdio::null()).stderr(log);
        self.dev = Some(Proc(d.spawn().context("starting dpukv-dpu")?));
        Ok(())
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the host, and with `device` to the device too.
    pub fn signal(&self, signal: &str, device: bool) -> Result<()> {
        let procs = self.host.iter().chain(self.dev.iter().filter(|_| device));
        for p in procs {
            let status = Command::new("kill").arg(format!("-{signal}")).arg(p.0.id().to_string()).status()?;
            if !status.success() {
                bail!("kill -{signal} {} failed", p.0.id());
            }
        }
        Ok(())
    }

    /// SIGKILLs the host only (the device goes on).
    pub fn kill_host(&mut self) {
        self.host = None;
    }

    /// SIGKILLs the host and the device.
    pub fn kill(&mut self) {
        self.host = None;
        self.dev = None;
    }

    /// The body of `GET path` at its host's admin endpoint (HTTP/1.0, within 5 s).
    pub fn admin_get(&self, path: &str) -> Result<String> {
        self.admin_call("GET", path, Duration::from_secs(5))
    }

    /// POSTs to `path` at its host's admin endpoint; the body of a 200 answer (within 10 s).
    pub fn admin_post(&self, path: &str) -> Result<String> {
        self.admin_call("POST", path, Duration::from_secs(10))
    }

    /// DELETEs `path` at its host's admin endpoint; the body of a 200 answer (within 10 s).
    pub fn admin_delete(&self, path: &str) -> Result<String> {
        self.admin_call("DELETE", path, Duration::from_secs(10))
    }

    /// One HTTP/1.0 request without a body to its host's admin endpoint; the body of a 200
    /// answer, else an error with the status line.
    fn admin_call(&self, method: &str, path: &str, timeout: Duration) -> Result<String> {
        http_call(&self.admin, method, path, timeout).with_context(|| format!("node {}", self.id))
    }

    /// The value of the metric sample `sample` (name with its labels, as exposed) at its host's
    /// `/metrics`, if exposed.
    pub fn metric(&self, sample: &str) -> Result<Option<f64>> {
        let body = self.admin_get("/metrics")?;
        Ok(body.lines().find_map(|l| {
            let (name, v) = l.rsplit_once(' ')?;
            (name == sample).then(|| v.parse().ok()).flatten()
        }))
    }

    /// Its logs (host then device), for a failing test's message.
    pub fn logs(&self) -> String {
        let read = |n: &str| std::fs::read_to_string(self.dir.path().join(n)).unwrap_or_default();
        format!(
            "--- node {} host ---\n{}\n--- node {} device ---\n{}",
            self.id,
            read("host.log"),
            self.id,
            read("device.log")
        )
    }
}

/// One HTTP/1.0 request without a body to `addr` (an IP `host:port`): the body of a 200 answer
/// (connecting within 5 s, answered within `timeout`, at most 16 MiB read).
pub fn http_call(addr: &str, method: &str, path: &str, timeout: Duration) -> Result<String> {
    use std::io::{Read, Write};
    let sock: std::net::SocketAddr = addr.parse().with_context(|| format!("the address {addr:?}"))?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(5))?;
    s.set_read_timeout(Some(timeout))?;
    write!(s, "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n")?;
    let mut out = String::new();
    s.take(16 << 20).read_to_string(&mut out)?;
    match out.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.split(' ').nth(1) == Some("200") => {
            Ok(body.to_string())
        }
        _ => bail!("{method} {path} at {addr}: {}", out.lines().next().unwrap_or("no answer")),
    }
}

/// The newest region map `nodes` answer (the highest metadata revision among them), once
/// `ready` holds for it (within `timeout`).
pub async fn wait_for_map(
    nodes: &[&ClusterNode],
    timeout: Duration,
    ready: impl Fn(&RegionMap) -> bool,
) -> Result<RegionMap> {
    let deadline = Instant::now() + timeout;
    let mut last = None;
    while Instant::now() < deadline {
        let mut newest: Option<RegionMap> = None;
        for n in nodes {
            if let Ok(c) = Client::connect(&n.device, 1).await
                && let Ok(m) = c.region_map().await
                && newest.as_ref().is_none_or(|x| m.revision > x.revision)
            {
                newest = Some(m);
            }
        }
        if let Some(m) = newest {
            if ready(&m) {
                return Ok(m);
            }
            last = Some(m);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("no node showed the expected region map within {timeout:?}; last seen: {last:?}")
}

/// [`wait_for_map`] asked of the nodes of `all` that `ask` keeps (the live ones), panicking with
/// every node's logs when the map does not come: a test's assertion.
pub async fn must_see_map(
    all: &[ClusterNode],
    ask: impl Fn(&ClusterNode) -> bool,
    timeout: Duration,
    ready: impl Fn(&RegionMap) -> bool,
) -> RegionMap {
    let asked: Vec<&ClusterNode> = all.iter().filter(|n| ask(n)).collect();
    match wait_for_map(&asked, timeout, ready).await {
        Ok(m) => m,
        Err(e) => panic!("{e}\n{}", all.iter().map(ClusterNode::logs).collect::<String>()),
    }
}

/// Writes `key` = `value` at the primary of its region as the newest map `nodes` answer names
/// it, trying again (after looking the primary up again) on any error until `timeout`: a test's
/// stand-in for a cluster-aware client. A retry may repeat a put that was applied: puts of one
/// value are idempotent. Returns the last error if it never succeeds.
pub async fn put_routed(nodes: &[&ClusterNode], key: &[u8], value: &[u8], timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    while Instant::now() < deadline {
        if let Ok(m) = wait_for_map(nodes, Duration::from_secs(1), |_| true).await
            && let Some(primary) = m.region_of(key).and_then(|r| m.node(r.primary))
        {
            match Client::connect(&primary.device, 1).await {
                Ok(mut p) => {
                    // A short deadline: a primary that does not answer is looked up again.
                    p.retry.deadline = Duration::from_secs(2);
                    match p.put(key, value).await {
                        Ok(_) => return Ok(()),
                        Err(e) => last = format!("at node {}: {e}", primary.id),
                    }
                }
                Err(e) => last = e.to_string(),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("put never succeeded within {timeout:?}: {last}")
}

/// Sends `req` to the node at `addr` itself — not routed, not retried — and returns its answer
/// within `timeout`: what that node (say, one cut off from the rest) answers.
pub fn call_direct(addr: &str, req: Request, timeout: Duration) -> Result<Response> {
    use std::io::{Read, Write};
    let sock: std::net::SocketAddr = addr.parse().context("a node address")?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut buf = Vec::new();
    encode_requests(std::slice::from_ref(&req), &mut buf);
    s.write_all(&buf)?;
    let mut h = [0u8; 8];
    s.read_exact(&mut h)?;
    let total = frame_header(&h)?.context("a complete frame header")?.total;
    if total > 64 << 20 {
        bail!("a response frame of {total} bytes");
    }
    let mut frame = h.to_vec();
    frame.resize(total, 0);
    s.read_exact(&mut frame[8..])?;
    decode_responses(&frame)?.into_iter().find(|r| r.id == req.id).context("no response to the request")
}
