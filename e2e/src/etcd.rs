//! A real etcd for a test: one member on free loopback ports with its own data directory, fast
//! elections (heartbeat 25 ms, election timeout 250 ms) so leases as short as 375 ms are allowed,
//! killed and removed on drop. It can be stopped and started again on the same ports and data.
//! [`Etcd::start_in`] runs it in a network namespace instead (a partition test's host);
//! [`Etcd::start_tls`] speaks https on both ports and wants client certificates of its CA.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::procs::{Proc, free_port};

/// etcd's TLS: its CA (which client and peer certificates must chain to), its server
/// certificate, and a client certificate for the health check.
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    /// The CA.
    pub ca: PathBuf,
    /// The server's (and peer's) certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// A client certificate of the CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
}

/// One etcd member.
pub struct Etcd {
    dir: tempfile::TempDir,
    tls: Option<EtcdTlsFiles>,
    ip: String,
    /// Runs the program in a namespace (`ip netns exec NS`), or nothing.
    prefix: Vec<String>,
    client_port: u16,
    peer_port: u16,
    proc: Option<Proc>,
}

/// Whether etcd answers `/health` with `"health":"true"` (it has a leader); over TLS with the
/// client certificate of `tls`.
fn healthy(ip: &str, port: u16, tls: Option<&EtcdTlsFiles>) -> bool {
    let Ok(addr) = format!("{ip}:{port}").parse::<std::net::SocketAddr>() else { return false };
    let Ok(tcp) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = tcp.set_read_timeout(Some(Duration::from_millis(500)));
    let mut s: Box<dyn ReadWrite> = match tls {
        None => Box::new(tcp),
        Some(t) => {
            let Ok(c) = dpukv_net::tls::ClientTls::load(&t.ca, Some((&t.client_cert, &t.client_key))) else {
                return false;
            };
            let Ok(s) = c.connect_blocking(tcp, &addr.to_string()) else { return false };
            let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
            Box::new(s)
        }
    };
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

impl Etcd {
    /// Starts a fresh member (retrying on other ports if one was taken meanwhile).
    pub fn start() -> Result<Etcd> {
        if Command::new("etcd").arg("--version").output().is_err() {
            bail!("etcd is not installed (Debian: apt-get install -y etcd-server)");
        }
        let mut last = None;
        for _ in 0..3 {
            let mut e = Etcd {
                dir: tempfile::tempdir()?,
                tls: None,
                ip: "127.0.0.1".into(),
                prefix: Vec::new(),
                client_port: free_port()?,
                peer_port: free_port()?,
                proc: None,
            };
            match e.resume() {
                Ok(()) => return Ok(e),
                Err(err) => last = Some(err),
            }
        }
        Err(last.expect("three attempts"))
    }

    /// Starts a fresh member at `ip` (its standard ports) in the namespace `prefix` enters
    /// (`ip netns exec NS`; see [`crate::netns`]).
    pub fn start_in(prefix: Vec<String>, ip: &str) -> Result<Etcd> {
        let mut e = Etcd {
            dir: tempfile::tempdir()?,
            tls: None,
            ip: ip.into(),
            prefix,
            client_port: 2379,
            peer_port: 2380,
            proc: None,
        };
        e.resume()?;
        Ok(e)
    }

    /// Starts a fresh member on free loopback ports speaking TLS on both ports, wanting client
    /// (and peer) certificates of `tls.ca` (`--client-cert-auth`).
    pub fn start_tls(tls: EtcdTlsFiles) -> Result<Etcd> {
        let mut e = Etcd {
            dir: tempfile::tempdir()?,
            tls: Some(tls),
            ip: "127.0.0.1".into(),
            prefix: Vec::new(),
            client_port: free_port()?,
            peer_port: free_port()?,
            proc: None,
        };
        e.resume()?;
        Ok(e)
    }

    /// The client URL (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.ip, self.client_port)
    }

    /// Its data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the member.
    pub fn signal(&self, signal: &str) -> Result<()> {
        let Some(p) = &self.proc else { bail!("etcd is not running") };
        let status = Command::new("kill").arg(format!("-{signal}")).arg(p.0.id().to_string()).status()?;
        if !status.success() {
            bail!("kill -{signal} etcd failed");
        }
        Ok(())
    }

    /// Kills the member (SIGKILL); its data stays for [`Etcd::resume`].
    pub fn stop(&mut self) {
        self.proc = None;
    }

    /// Starts the member (again) on its ports and data, and waits until it has a leader.
    pub fn resume(&mut self) -> Result<()> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let peer = format!("{scheme}://{}:{}", self.ip, self.peer_port);
        let client = self.url();
        let mut c = match self.prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg("etcd");
                c
            }
            None => Command::new("etcd"),
        };
        c.arg("--name")
            .arg("t")
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .arg("--initial-cluster")
            .arg(format!("t={peer}"))
            .args(["--initial-cluster-state", "new", "--heartbeat-interval", "25", "--election-timeout", "250"]);
        if let Some(t) = &self.tls {
            c.arg("--cert-file").arg(&t.cert).arg("--key-file").arg(&t.key);
            c.arg("--trusted-ca-file").arg(&t.ca).arg("--client-cert-auth");
            c.arg("--peer-cert-file").arg(&t.cert).arg("--peer-key-file").arg(&t.key);
            c.arg("--peer-trusted-ca-file").arg(&t.ca).arg("--peer-client-cert-auth");
        }
        c.stdout(Stdio::null()).stderr(std::fs::File::create(self.dir.path().join("etcd.log"))?);
        let mut proc = Proc(c.spawn().context("starting etcd")?);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = proc.0.try_wait()? {
                let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
                let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join("\n");
                bail!("etcd exited ({status}): {tail}");
            }
            if healthy(&self.ip, self.client_port, self.tls.as_ref()) {
                self.proc = Some(proc);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("etcd did not become healthy within 30 s")
    }
}
