//! Hosts on one machine for partition tests: a Linux bridge in the test's namespace and one
//! network namespace per host, each with a veth pair onto the bridge and its own address in a
//! private /24; [`Net::isolate`] cuts a host off with nftables drop rules inside its namespace
//! (everything but the test process itself), [`Net::heal`] removes them; [`Net::cut`] drops one
//! direction between two hosts. Everything is removed on
//! drop, also when the test fails. Needs root (CAP_NET_ADMIN), `ip` and `nft`.

use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The test's address on the bridge: the only peer an isolated host still talks to (so the test
/// can watch it refuse).
pub const TEST_HOST: u8 = 1;

/// A bridge and the namespaces of the hosts on it.
pub struct Net {
    tag: String,
    subnet: String,
    hosts: Vec<u8>,
}

fn run(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn nft(ns: &str, script: &str) -> Result<()> {
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft (Debian: apt-get install -y nftables)")?;
    std::io::Write::write_all(c.stdin.as_mut().expect("stdin"), script.as_bytes())?;
    let out = c.wait_with_output()?;
    if !out.status.success() {
        bail!("nft in {ns} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Net {
    /// A bridge with the test on `.1` and a namespace per host number in `hosts` (2..=254), each
    /// reachable at [`Net::addr`].
    pub fn new(hosts: &[u8]) -> Result<Net> {
        // Names unique per test process (interface names have at most 15 bytes).
        let pid = std::process::id();
        let tag = format!("dk{}", pid % 1_000_000);
        let subnet = format!("10.{}.{}", 100 + (pid / 250) % 150, pid % 250);
        let mut net = Net { tag, subnet, hosts: Vec::new() };
        let br = net.bridge();
        run(&["ip", "link", "add", &br, "type", "bridge"])
            .context("creating a bridge (partition tests need root and iproute2)")?;
        run(&["ip", "addr", "add", &format!("{}/24", net.addr(TEST_HOST)), "dev", &br])?;
        run(&["ip", "link", "set", &br, "up"])?;
        for &h in hosts {
            let (ns, outer, inner) = (net.ns(h), format!("{}h{h}", net.tag), format!("{}i{h}", net.tag));
            run(&["ip", "netns", "add", &ns])?;
            net.hosts.push(h);
            run(&["ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner])?;
            run(&["ip", "link", "set", &inner, "netns", &ns])?;
            run(&["ip", "link", "set", &outer, "master", &br])?;
            run(&["ip", "link", "set", &outer, "up"])?;
            let addr = format!("{}/24", net.addr(h));
            for args in [
                vec!["ip", "link", "set", "lo", "up"],
                vec!["ip", "addr", "add", &addr, "dev", &inner],
                vec!["ip", "link", "set", &inner, "up"],
            ] {
                let mut full = vec!["ip", "netns", "exec", &ns];
                full.extend(args);
                run(&full)?;
            }
        }
        Ok(net)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.tag)
    }

    /// Host `h`'s namespace name.
    pub fn ns(&self, h: u8) -> String {
        format!("{}ns{h}", self.tag)
    }

    /// Host `h`'s address (`TEST_HOST`: the test's own).
    pub fn addr(&self, h: u8) -> String {
        format!("{}.{h}", self.subnet)
    }

    /// The command prefix that runs a program in host `h`'s namespace.
    pub fn exec_prefix(&self, h: u8) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.ns(h)]
    }

    /// Cuts host `h` off from every other host (it still talks to the test process, and to
    /// itself): packets in and out are dropped in its namespace.
    pub fn isolate(&self, h: u8) -> Result<()> {
        let me = self.addr(TEST_HOST);
        nft(
            &self.ns(h),
            &format!(
                "table inet partition {{\n\
                 chain in {{ type filter hook input priority 0; policy accept; iifname \"lo\" accept; ip saddr != {me} drop; }}\n\
                 chain out {{ type filter hook output priority 0; policy accept; oifname \"lo\" accept; ip daddr != {me} drop; }}\n\
                 }}\n"
            ),
        )
    }

    /// Removes host `h`'s drop rules.
    pub fn heal(&self, h: u8) -> Result<()> {
        nft(&self.ns(h), "delete table inet partition\n")
    }

    /// Cuts one way: packets host `from` sends to host `to` are dropped (in `from`'s namespace);
    /// what `to` sends to `from` still arrives. (A TCP connection between them stalls both ways
    /// — its acknowledgements go the cut way — but new ones from `to` are accepted.)
    pub fn cut(&self, from: u8, to: u8) -> Result<()> {
        let to = self.addr(to);
        nft(
            &self.ns(from),
            &format!(
                "table inet cut {{\n\
                 chain out {{ type filter hook output priority 0; policy accept; ip daddr {to} drop; }}\n\
                 }}\n"
            ),
        )
    }

    /// Removes host `from`'s one-way cut.
    pub fn uncut(&self, from: u8) -> Result<()> {
        nft(&self.ns(from), "delete table inet cut\n")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting one end of a veth pair deletes both (a namespace's end alone would go only
        // once nothing holds the namespace any more); the bridge goes last.
        for &h in &self.hosts {
            let _ = run(&["ip", "link", "del", &format!("{}h{h}", self.tag)]);
            let _ = run(&["ip", "netns", "del", &self.ns(h)]);
        }
        let _ = run(&["ip", "link", "del", &self.bridge()]);
    }
}
