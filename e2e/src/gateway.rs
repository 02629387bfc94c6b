//! A gateway for a test: the `dpukv-gateway` process on free loopback ports (binary, HTTP and
//! RESP front ends) in front of a cluster's devices; killed on drop.

use std::process::{Command, Stdio};

use anyhow::{Context, Result};

use crate::procs::{Proc, bin_dir, free_port, wait_for};

/// A running gateway.
pub struct Gateway {
    /// The binary protocol's address.
    pub binary: String,
    /// The HTTP front end's address.
    pub http: String,
    /// The RESP front end's address.
    pub resp: String,
    _proc: Proc,
}

impl Gateway {
    /// Starts a gateway learning the cluster from `seeds` (node devices), with `extra` flags;
    /// returns once it serves.
    pub fn start(seeds: &[&str], extra: &[&str]) -> Result<Gateway> {
        let addr = || -> Result<String> { Ok(format!("127.0.0.1:{}", free_port()?)) };
        let (binary, http, resp) = (addr()?, addr()?, addr()?);
        let mut c = Command::new(bin_dir()?.join("dpukv-gateway"));
        c.args(["--seeds", &seeds.join(","), "--listen", &binary, "--http", &http, "--resp", &resp])
            .args(extra)
            .env("RUST_LOG", std::env::var("DPUKV_E2E_LOG").unwrap_or_else(|_| "info".into()))
            .stderr(Stdio::piped())
            .stdout(Stdio::null());
        let mut child = c.spawn().context("starting dpukv-gateway")?;
        wait_for(&mut child, "gateway serving")?;
        Ok(Gateway { binary, http, resp, _proc: Proc(child) })
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
