//! A real etcd for a test: one member on free loopback ports with its own data directory, fast
//! elections (heartbeat 25 ms, election timeout 250 ms) so leases as short as 375 ms are allowed,
//! killed and removed on drop. It can be stopped and started again on the same ports and data.
//! [`Etcd::start_in`] runs it in a network namespace instead (a partition test's host).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::procs::{Proc, free_port};

/// One etcd member.
pub struct Etcd {
    dir: tempfile::TempDir,
    ip: String,
    /// Runs the program in a namespace (`ip netns exec NS`), or nothing.
    prefix: Vec<String>,
    client_port: u16,
    peer_port: u16,
    proc: Option<Proc>,
}

/// Whether etcd answers `/health` with `"health":"true"` (it has a leader).
fn healthy(ip: &str, port: u16) -> bool {
    let Ok(addr) = format!("{ip}:{port}").parse::<std::net::SocketAddr>() else { return false };
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

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
        let mut e =
            Etcd { dir: tempfile::tempdir()?, ip: ip.into(), prefix, client_port: 2379, peer_port: 2380, proc: None };
        e.resume()?;
        Ok(e)
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.ip, self.client_port)
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
        let peer = format!("http://{}:{}", self.ip, self.peer_port);
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
            .args(["--initial-cluster-state", "new", "--heartbeat-interval", "25", "--election-timeout", "250"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.path().join("etcd.log"))?);
        let mut proc = Proc(c.spawn().context("starting etcd")?);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = proc.0.try_wait()? {
                let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
                let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join("\n");
                bail!("etcd exited ({status}): {tail}");
            }
            if healthy(&self.ip, self.client_port) {
                self.proc = Some(proc);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("etcd did not become healthy within 30 s")
    }
}
