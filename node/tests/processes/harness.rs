//! Starts `dpukv-node` and `dpukv-dpu` on temp dirs and talks to the device with raw frames.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dpukv_proto::{Op, Request, Response, decode_responses, encode_requests, frame_header};

/// A child process killed and reaped on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A node pod: host and device processes.
pub struct Pod {
    pub dir: tempfile::TempDir,
    pub host: Option<Proc>,
    pub device: Option<Proc>,
    pub addr: String,
    /// The device's fabric endpoint (`fabric://...`; empty without `--fabric-listen`).
    pub fabric: String,
    pub extra_host_args: Vec<String>,
    /// Environment variables of the host process.
    pub host_env: Vec<(String, String)>,
}

impl Pod {
    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }
    pub fn shm(&self) -> PathBuf {
        self.dir.path().join("shm")
    }

    /// Starts a pod (host first, then the device on a free port).
    pub fn start(host_args: &[&str], device_args: &[&str]) -> Pod {
        Pod::start_env(host_args, device_args, &[])
    }

    /// Like [`Pod::start`], the host with these environment variables.
    pub fn start_env(host_args: &[&str], device_args: &[&str], host_env: &[(&str, &str)]) -> Pod {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut pod = Pod {
            dir,
            host: None,
            device: None,
            addr: String::new(),
            fabric: String::new(),
            extra_host_args: host_args.iter().map(|s| s.to_string()).collect(),
            host_env: host_env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        };
        pod.start_host();
        let (device, addr, fabric) = spawn_device(&pod.shm(), device_args);
        pod.device = Some(device);
        (pod.addr, pod.fabric) = (addr, fabric);
        pod
    }

    pub fn start_host(&mut self) {
        self.host = Some(spawn_host(&self.data(), &self.shm(), &self.extra_host_args, &self.host_env));
    }

    /// Starts a new device (on a new port: `addr` changes).
    pub fn start_device(&mut self) {
        let (device, addr, _) = spawn_device(&self.shm(), &[]);
        self.device = Some(device);
        self.addr = addr;
    }

    /// Starts a host on data directory `data` with `args` (a replacement host for this pod).
    pub fn start_host_at(&mut self, data: &Path, args: &[&str]) {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        self.host = Some(spawn_host(data, &self.shm(), &args, &self.host_env));
    }

    pub fn device_pid(&self) -> u32 {
        self.device.as_ref().expect("device").0.id()
    }

    pub fn host_pid(&self) -> u32 {
        self.host.as_ref().expect("host").0.id()
    }

    pub fn connect(&self) -> Conn {
        Conn::connect(&self.addr)
    }

    /// A connection to the device's fabric endpoint (started with `--fabric-listen`).
    pub fn connect_fabric(&self) -> Conn {
        Conn::connect_fabric(&self.fabric)
    }
}

/// A connection's transport: TCP, or a libfabric endpoint driven by a runtime of its own (the
/// tests are blocking code).
pub enum Transport {
    Tcp(TcpStream),
    Fabric(Box<(tokio::runtime::Runtime, dpukv_net::fabric::FabricStream)>),
}

/// How long one blocking read or write on a fabric connection may take.
const FABRIC_IO_TIMEOUT: Duration = Duration::from_secs(20);

/// Runs one read or write of a fabric connection on its runtime, within [`FABRIC_IO_TIMEOUT`].
fn blocking<T>(rt: &tokio::runtime::Runtime, io: impl Future<Output = std::io::Result<T>>) -> std::io::Result<T> {
    rt.block_on(async { tokio::time::timeout(FABRIC_IO_TIMEOUT, io).await })
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

impl Read for Transport {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use tokio::io::AsyncReadExt;
        match self {
            Transport::Tcp(s) => s.read(buf),
            Transport::Fabric(f) => {
                let (rt, s) = &mut **f;
                blocking(rt, s.read(buf))
            }
        }
    }
}

impl Write for Transport {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use tokio::io::AsyncWriteExt;
        match self {
            Transport::Tcp(s) => s.write(buf),
            Transport::Fabric(f) => {
                let (rt, s) = &mut **f;
                blocking(rt, s.write(buf))
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        match self {
            Transport::Tcp(s) => s.flush(),
            Transport::Fabric(f) => {
                let (rt, s) = &mut **f;
                blocking(rt, s.flush())
            }
        }
    }
}

fn spawn_host(data: &Path, shm: &Path, extra: &[String], env: &[(String, String)]) -> Proc {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dpukv-node"));
    c.envs(env.iter().map(|(k, v)| (k, v)));
    c.arg("--data-dir").arg(data).arg("--shm-dir").arg(shm).args(extra).stderr(Stdio::piped()).stdout(Stdio::null());
    let mut child = c.spawn().expect("spawn dpukv-node");
    wait_for_line(&mut child, "host serving");
    Proc(child)
}

/// Starts a device; its process, data port and fabric endpoint (empty if none), from its log.
fn spawn_device(shm: &Path, extra: &[&str]) -> (Proc, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dpukv-dpu"));
    c.arg("--shm-dir")
        .arg(shm)
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null());
    let mut child = c.spawn().expect("spawn dpukv-dpu");
    let line = wait_for_line(&mut child, "device serving");
    let addr = line
        .split("listen=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("listen address in the log")
        .to_string();
    let fabric = line.split("fabric=").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or("").to_string();
    (Proc(child), addr, fabric)
}

/// Reads the child's stderr until a line containing `what` (then keeps draining it in a thread).
fn wait_for_line(child: &mut Child, what: &str) -> String {
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "process did not log {what:?}");
        match lines.next() {
            Some(Ok(l)) if l.contains(what) => {
                std::thread::spawn(move || for _ in lines.by_ref() {});
                return strip_ansi(&l);
            }
            Some(Ok(_)) => {}
            _ => panic!("process exited before logging {what:?}"),
        }
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in s.chars() {
        match (esc, c) {
            (false, '\u{1b}') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

/// A field of `/proc/<pid>/status` in KiB (`VmRSS`, `RssAnon`, ...); 0 if unreadable.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A blocking protocol connection.
pub struct Conn {
    pub s: Transport,
    next_id: u64,
}

impl Conn {
    pub fn connect(addr: &str) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        Conn { s: Transport::Tcp(s), next_id: 1 }
    }

    /// Connects to a fabric endpoint (`fabric://PROVIDER/HOST:PORT`).
    pub fn connect_fabric(addr: &str) -> Conn {
        use dpukv_net::fabric::{FabricAddr, FabricStream, Options};
        let at = FabricAddr::parse(addr).expect("a fabric address");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let s = rt
            .block_on(FabricStream::connect(
                &at.provider,
                &at.host,
                at.port,
                Options::PROTOCOL,
                Duration::from_secs(10),
            ))
            .expect("connect over the fabric");
        Conn { s: Transport::Fabric(Box::new((rt, s))), next_id: 1 }
    }

    /// Sends one frame with `ops` and returns the responses in request order.
    pub fn call(&mut self, ops: Vec<Op>) -> Vec<Response> {
        let reqs: Vec<Request> = ops.into_iter().map(|op| Request::new(0, op)).collect();
        self.send(reqs)
    }

    /// Sends one frame with `reqs` (their ids replaced) and returns the responses in order.
    pub fn send(&mut self, reqs: Vec<Request>) -> Vec<Response> {
        let reqs: Vec<Request> = reqs
            .into_iter()
            .map(|mut r| {
                self.next_id += 1;
                r.id = self.next_id;
                r
            })
            .collect();
        let mut buf = Vec::new();
        encode_requests(&reqs, &mut buf);
        self.s.write_all(&buf).expect("send");
        let mut got: Vec<Response> = Vec::new();
        while got.len() < reqs.len() {
            got.extend(self.read_frame().expect("response frame"));
        }
        reqs.iter().map(|r| got.iter().find(|g| g.id == r.id).cloned().expect("a response per request")).collect()
    }

    pub fn one(&mut self, op: Op) -> Response {
        self.call(vec![op]).remove(0)
    }

    /// Reads one response frame (None at end of stream).
    pub fn read_frame(&mut self) -> Option<Vec<Response>> {
        let mut h = [0u8; 8];
        self.s.read_exact(&mut h).ok()?;
        let total = frame_header(&h).expect("header").expect("complete").total;
        let mut buf = h.to_vec();
        buf.resize(total, 0);
        self.s.read_exact(&mut buf[8..]).ok()?;
        Some(decode_responses(&buf).expect("response frame decodes"))
    }
}
