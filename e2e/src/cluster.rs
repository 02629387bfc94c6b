//! Cluster nodes for a test: a node pod (host and device processes) that joins a cluster in a
//! real etcd, on free loopback ports, with its logs in its directory; it can be SIGKILLed and
//! started again on the same data. Each host serves its control API (`/cluster/*`) with its
//! cluster's admin token ([`ClusterNode::admin_token`]), which [`ClusterNode::admin_post`] and the others present (and over TLS,
//! trusting the CA of [`ClusterNode::set_control_tls`], when the node runs with TLS).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use dpukv_client::Client;
use dpukv_net::tls::ClientTls;
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
    /// Its host's admin endpoint (`/metrics`, `/healthz`, `/readyz`).
    pub admin: String,
    /// Its host's control API (`/cluster/*`).
    pub control: String,
    /// The admin token its control API takes.
    token: String,
    /// TLS to its control API (with TLS flags), if set.
    control_tls: Option<Arc<ClientTls>>,
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
        Self::start_loopback(id, cluster, etcd, extra, &[], Vec::new(), None)
    }

    /// Starts a node on free loopback ports — again on others if another process took one of
    /// them between the check and the bind (it happens when tests run side by side: a node
    /// once exited with "Address already in use" and its test failed).
    fn start_loopback(
        id: u32,
        cluster: &str,
        etcd: &str,
        extra: &[&str],
        both: &[&str],
        env: Vec<(String, String)>,
        disk_mib: Option<u64>,
    ) -> Result<ClusterNode> {
        let mut attempt = 0;
        loop {
            let (device, admin, control) = loopback_ports()?;
            let ports = [device, admin, control];
            let mut n =
                Self::start_at(id, cluster, etcd, extra, both, env.clone(), Vec::new(), "127.0.0.1", ports, disk_mib)?;
            attempt += 1;
            if attempt >= 4 || !n.lost_a_port_race() {
                return Ok(n);
            }
        }
    }

    /// Whether a process of the node exited at start because its port was taken (waits until
    /// both serve, up to 10 s).
    fn lost_a_port_race(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let serving = |a: &str| {
            a.parse().is_ok_and(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_millis(100)).is_ok())
        };
        while Instant::now() < deadline {
            for (p, log) in [(&mut self.host, "host.log"), (&mut self.dev, "device.log")] {
                if p.as_mut().is_some_and(|p| p.0.try_wait().ok().flatten().is_some()) {
                    let text = std::fs::read_to_string(self.dir.path().join(log)).unwrap_or_default();
                    return text.contains("Address already in use");
                }
            }
            if serving(&self.admin) && serving(&self.device) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Like [`ClusterNode::start`], with its data directory on a tmpfs of `mib` MiB: a disk the
    /// test can fill ([`ClusterNode::fill_disk`]). Needs root (to mount).
    pub fn start_on_small_disk(id: u32, cluster: &str, etcd: &str, extra: &[&str], mib: u64) -> Result<ClusterNode> {
        Self::start_loopback(id, cluster, etcd, extra, &[], Vec::new(), Some(mib))
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
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::start_loopback(id, cluster, etcd, extra, both, env, None)
    }

    /// Like [`ClusterNode::start`], its device also serving a libfabric endpoint (the `tcp`
    /// provider, on a free port) that its host registers in the region map; returns it too
    /// (`fabric://tcp/127.0.0.1:PORT`).
    pub fn start_with_fabric(id: u32, cluster: &str, etcd: &str, extra: &[&str]) -> Result<(ClusterNode, String)> {
        let at = format!("127.0.0.1:{}", free_port()?);
        let fabric = format!("fabric://tcp/{at}");
        let env = [
            ("DPUKV_FABRIC_LISTEN", at.as_str()),
            ("DPUKV_FABRIC_PROVIDER", "tcp"),
            ("DPUKV_ADVERTISE_FABRIC", fabric.as_str()),
        ];
        Ok((Self::start_with(id, cluster, etcd, extra, &[], &env)?, fabric))
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
        let ports = [format!("{ip}:7070"), format!("{ip}:7071"), format!("{ip}:7073")];
        Self::start_at(id, cluster, etcd, extra, &[], Vec::new(), prefix, ip, ports, None)
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
        let ports = [format!("{ip}:7070"), format!("{ip}:7071"), format!("{ip}:7073")];
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::start_at(id, cluster, etcd, extra, &[], env, prefix, ip, ports, disk_mib)
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
        [device, admin, control]: [String; 3],
        disk_mib: Option<u64>,
    ) -> Result<ClusterNode> {
        let dir = tempfile::tempdir()?;
        // The control API's token: one per cluster, so `dpukv cluster` (with DPUKV_ADMIN_TOKEN)
        // may call any of its nodes.
        let token = format!("e2e-admin-token-of-{cluster}");
        let token_file = dir.path().join("admin-token");
        std::fs::write(&token_file, format!("{token}\n"))?;
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
            "--control-listen",
            &control,
            "--admin-token-file",
            token_file.to_str().context("a UTF-8 temporary directory")?,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        host_args.extend(extra.iter().chain(both).map(|s| s.to_string()));
        let mut device_args: Vec<String> = vec!["--node-id".into(), id.to_string()];
        device_args.extend(both.iter().map(|s| s.to_string()));
        let mut n = ClusterNode {
            id,
            dir,
            device,
            admin,
            control,
            token,
            control_tls: None,
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

    /// The host process's pid (to signal it from another task).
    pub fn host_pid(&self) -> Option<u32> {
        self.host.as_ref().map(|p| p.0.id())
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

    /// Speaks TLS to its control API with `tls` (a node started with TLS flags serves it over
    /// HTTPS); the admin token still authenticates.
    pub fn set_control_tls(&mut self, tls: Arc<ClientTls>) {
        self.control_tls = Some(tls);
    }

    /// The admin token its control API takes.
    pub fn admin_token(&self) -> &str {
        &self.token
    }

    /// The body of `GET path` at its host's admin endpoint — the control API for `/cluster/*`
    /// (HTTP/1.0, within 5 s).
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

    /// One HTTP/1.0 request without a body to its host's admin endpoint, or for `/cluster/*`
    /// to its control API with its admin token; the body of a 200 answer, else an error with the
    /// status line.
    fn admin_call(&self, method: &str, path: &str, timeout: Duration) -> Result<String> {
        let answer = if path.starts_with("/cluster/") {
            let auth = format!("Bearer {}", self.token);
            http_request(&self.control, self.control_tls.as_deref(), &[("Authorization", &auth)], method, path, timeout)
        } else {
            http_request(&self.admin, None, &[], method, path, timeout)
        };
        match answer.with_context(|| format!("node {}", self.id))? {
            (200, body) => Ok(body),
            (code, body) => bail!("node {}: {method} {path}: {code}: {}", self.id, body.trim()),
        }
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

/// One HTTP request without a body to `addr` (an IP `host:port`): the body of a 200 answer
/// (connecting within 5 s, answered within `timeout`, at most 16 MiB read).
pub fn http_call(addr: &str, method: &str, path: &str, timeout: Duration) -> Result<String> {
    match http_request(addr, None, &[], method, path, timeout)? {
        (200, body) => Ok(body),
        (code, body) => bail!("{method} {path} at {addr}: {code} {}", body.lines().next().unwrap_or_default()),
    }
}

/// One HTTP request without a body to `addr`: [`http_exchange`].
pub fn http_request(
    addr: &str,
    tls: Option<&ClientTls>,
    headers: &[(&str, &str)],
    method: &str,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String)> {
    http_exchange(addr, tls, headers, method, path, None, timeout)
}

/// The most bytes of an answer read.
const MAX_ANSWER: usize = 16 << 20;

/// One HTTP/1.1 request (`Connection: close`) to `addr` (an IP `host:port`), over TLS with `tls`
/// if given, with `headers` (a `Host` among them replaces `addr`) and a JSON `body` if given: the
/// status and the body — read by its `Content-Length` (a server may keep the connection open:
/// chromedriver does), else chunked or to the end (connecting within 5 s, the TLS handshake
/// within 10 s, each read and write within `timeout`, at most 16 MiB read). An error: no HTTP
/// answer (a refused TLS session, a closed connection).
pub fn http_exchange(
    addr: &str,
    tls: Option<&ClientTls>,
    headers: &[(&str, &str)],
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let sock: std::net::SocketAddr = addr.parse().with_context(|| format!("the address {addr:?}"))?;
    let tcp = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(5))?;
    tcp.set_read_timeout(Some(timeout))?;
    tcp.set_write_timeout(Some(timeout))?;
    let mut s: Box<dyn ReadWrite> = match tls {
        Some(t) => {
            let s = t.connect_blocking(tcp, addr).with_context(|| format!("TLS to {addr}"))?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            Box::new(s)
        }
        None => Box::new(tcp),
    };
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if body.is_some() {
        req.push_str("Content-Type: application/json\r\n");
    }
    let body = body.unwrap_or("");
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes())?;
    // The head, then the body by its length, chunked, or to the end (a refused TLS session ends
    // a read with an error after what was answered).
    let no_answer = |got: &[u8], why: String| {
        anyhow::anyhow!("{method} {path} at {addr}: no HTTP answer ({why}): {:?}", String::from_utf8_lossy(got))
    };
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match s.read(&mut chunk) {
            Ok(n) if n > 0 && buf.len() < MAX_ANSWER => buf.extend_from_slice(&chunk[..n]),
            Ok(_) => return Err(no_answer(&buf, "the connection ended".into())),
            Err(e) => return Err(no_answer(&buf, e.to_string())),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    if !head.starts_with("HTTP/1.") {
        return Err(no_answer(&buf, "not HTTP".into()));
    }
    let status: u16 = head.split(' ').nth(1).and_then(|c| c.parse().ok()).context("a status code")?;
    let lower = head.to_ascii_lowercase();
    let length =
        lower.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse::<usize>().ok());
    let mut body = buf.split_off(head_end + 4);
    let want = length.unwrap_or(MAX_ANSWER).min(MAX_ANSWER);
    while body.len() < want {
        match s.read(&mut chunk) {
            Ok(n) if n > 0 => body.extend_from_slice(&chunk[..n]),
            Ok(_) if length.is_none() => break,
            Ok(_) => bail!("{method} {path} at {addr}: the answer was cut short"),
            Err(_) if length.is_none() => break,
            Err(e) => return Err(e.into()),
        }
    }
    body.truncate(want);
    let body = if lower.contains("transfer-encoding: chunked") { unchunk(&body) } else { body };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// A chunked body's bytes (`Transfer-Encoding: chunked`).
fn unchunk(mut s: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = s.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&s[..eol]);
        let Ok(n) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16) else { break };
        let rest = &s[eol + 2..];
        if n == 0 || rest.len() < n {
            break;
        }
        out.extend_from_slice(&rest[..n]);
        s = rest[n..].strip_prefix(b"\r\n").unwrap_or(&rest[n..]);
    }
    out
}

trait ReadWrite: std::io::Read + std::io::Write {}
impl<T: std::io::Read + std::io::Write> ReadWrite for T {}

/// A device, admin and control address on free loopback ports.
fn loopback_ports() -> Result<(String, String, String)> {
    let a = || -> Result<String> { Ok(format!("127.0.0.1:{}", free_port()?)) };
    Ok((a()?, a()?, a()?))
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

/// Sends `req` over TLS (`tls`, presenting its certificate if it has one) to the node at `addr`
/// itself — not routed, not retried — and returns its answer within `timeout`.
pub async fn call_tls(addr: &str, tls: &ClientTls, req: Request, timeout: Duration) -> Result<Response> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let mut s = tls.connect(tcp, addr).await?;
        let mut buf = Vec::new();
        encode_requests(std::slice::from_ref(&req), &mut buf);
        s.write_all(&buf).await?;
        s.flush().await?;
        let mut h = [0u8; 8];
        s.read_exact(&mut h).await?;
        let total = frame_header(&h)?.context("a complete frame header")?.total;
        if total > 64 << 20 {
            bail!("a response frame of {total} bytes");
        }
        let mut frame = h.to_vec();
        frame.resize(total, 0);
        s.read_exact(&mut frame[8..]).await?;
        decode_responses(&frame)?.into_iter().find(|r| r.id == req.id).context("no response to the request")
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| anyhow::anyhow!("no answer from {addr} within {timeout:?}"))?
}
