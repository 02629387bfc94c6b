//! A gateway for a test: the `dpukv-gateway` process on free loopback ports (binary, HTTP and
//! RESP front ends) in front of a cluster's devices; killed on drop.

use std::process::{Command, Stdio};

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::procs::{Proc, bin_dir, free_port};

/// A running gateway.
pub struct Gateway {
    /// The binary protocol's address.
    pub binary: String,
    /// The HTTP front end's address.
    pub http: String,
    /// The RESP front end's address.
    pub resp: String,
    log: tempfile::NamedTempFile,
    _proc: Proc,
}

impl Gateway {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self._proc.0.id()
    }

    /// Starts a gateway learning the cluster from `seeds` (node devices), with `extra` flags;
    /// returns once it serves.
    pub fn start(seeds: &[&str], extra: &[&str]) -> Result<Gateway> {
        Self::start_env(seeds, extra, &[])
    }

    /// Like [`Gateway::start`], with environment variables `env` set.
    pub fn start_env(seeds: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Result<Gateway> {
        let addr = || -> Result<String> { Ok(format!("127.0.0.1:{}", free_port()?)) };
        let (binary, http, resp) = (addr()?, addr()?, addr()?);
        let log = tempfile::NamedTempFile::new()?;
        let mut c = Command::new(bin_dir()?.join("dpukv-gateway"));
        c.args(["--seeds", &seeds.join(","), "--listen", &binary, "--http", &http, "--resp", &resp])
            .args(extra)
            .envs(env.iter().copied())
            .env("RUST_LOG", std::env::var("DPUKV_E2E_LOG").unwrap_or_else(|_| "info".into()))
            .stderr(log.reopen()?)
            .stdout(Stdio::null());
        let mut child = Proc(c.spawn().context("starting dpukv-gateway")?);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read_to_string(log.path())?.contains("gateway serving") {
            if let Some(status) = child.0.try_wait()? {
                bail!("dpukv-gateway exited ({status}):\n{}", std::fs::read_to_string(log.path())?);
            }
            if Instant::now() > deadline {
                bail!("dpukv-gateway did not serve within 30 s:\n{}", std::fs::read_to_string(log.path())?);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Gateway { binary, http, resp, log, _proc: child })
    }

    /// What the gateway logged so far.
    pub fn logs(&self) -> String {
        format!("--- gateway ---\n{}", std::fs::read_to_string(self.log.path()).unwrap_or_default())
    }

    /// The HTTP front end's URL for `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// The RESP front end's port.
    pub fn resp_port(&self) -> &str {
        self.resp.rsplit(':').next().unwrap_or_default()
    }
}
