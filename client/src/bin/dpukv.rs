//! `dpukv`: the command-line client, and `dpukv local`, which runs a node pod (host and device
//! processes) on a data directory in the foreground.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use dpukv_client::Client;
use dpukv_client::control::ControlClient;
use dpukv_client::proto::control::{Action, ControlRoute};
use dpukv_client::proto::{Cmp, Elem, ReduceOp, VecOp};

#[derive(Parser)]
#[command(name = "dpukv", version, about = "dpukv client")]
struct Cli {
    /// The device (or gateway) to talk to.
    #[arg(long, env = "DPUKV_ENDPOINT", default_value = "127.0.0.1:7070", global = true)]
    endpoint: String,
    /// A bearer token for a gateway that asks for one (prefer the environment variable: a flag
    /// shows in the process list).
    #[arg(long, env = "DPUKV_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// TLS to the endpoint (and to a host's control API for `dpukv cluster`, presenting the
    /// certificate given — one of role admin).
    #[command(flatten)]
    tls: dpukv_net::tls::ClientTlsArgs,
    /// A bearer token for the hosts' control API (`dpukv cluster`; hosts with
    /// `--admin-token-file`), instead of an admin certificate (prefer the environment variable).
    #[arg(long, env = "DPUKV_ADMIN_TOKEN", global = true, hide_env_values = true)]
    admin_token: Option<String>,
    /// The control API `dpukv cluster` calls (`host:port`; default: one a node advertises in the
    /// region map).
    #[arg(long, env = "DPUKV_CONTROL", global = true)]
    control: Option<String>,
    /// How gets may be served: `linearizable` (the primary), `bounded:MS` (a hot key's replica
    /// no staler than MS), `extended` (replicas when the primary is busy), `interleaved`
    /// (spread over primary and replicas). docs/hot-keys.md.
    #[arg(long, env = "DPUKV_CONSISTENCY", global = true, default_value = "linearizable")]
    consistency: dpukv_client::proto::Consistency,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the value of KEY (exit 1 if absent).
    Get { key: String },
    /// Set KEY to VALUE.
    Put { key: String, value: String },
    /// Delete KEY.
    Delete { key: String },
    /// Print `key<TAB>value` for keys in [START, END].
    Scan {
        start: String,
        end: String,
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Start at the largest key <= START (Honeycomb's SCAN).
        #[arg(long)]
        floor: bool,
    },
    /// Add DELTA to the u64 value of KEY; print the old value.
    FetchAdd { key: String, delta: u64 },
    /// Replace KEY's value with NEW if it is EXPECTED (or absent with --absent).
    Cas {
        key: String,
        expected: String,
        new: String,
        #[arg(long)]
        absent: bool,
    },
    /// Apply OP (add, sub, mul, min, max, set) with a u64 scalar to every u64 element of KEY.
    VectorAdd { key: String, op: String, scalar: u64 },
    /// Reduce the u64 elements of KEY (sum, min, max).
    Reduce { key: String, op: String },
    /// Print the u64 elements of KEY that compare (lt, le, eq, ne, ge, gt) to VALUE.
    Filter { key: String, cmp: String, value: u64 },
    /// Bulk-load COUNT keys `<prefix><n>` with VALUE-SIZE byte values.
    Load {
        #[arg(long, default_value_t = 100_000)]
        count: u64,
        #[arg(long, default_value = "key")]
        prefix: String,
        #[arg(long, default_value_t = 16)]
        value_size: usize,
        #[arg(long, default_value_t = 8)]
        connections: usize,
    },
    /// Print one line per region: `id<TAB>start<TAB>end<TAB>primary<TAB>backups<TAB>epoch`
    /// (keys as `scan` prints them; empty for unbounded; backups comma-separated).
    Regions,
    /// Print one line per node: `id<TAB>device<TAB>replication<TAB>admin<TAB>zone`, the master's
    /// line ending with `<TAB>master`.
    Nodes,
    /// Cluster administration.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Backups to object storage (docs/backup.md): `create` asks the cluster for one; `list`,
    /// `describe`, `verify`, `delete` and `sweep` work on the location alone. Locations:
    /// `file:///dir` or `s3://bucket/prefix` (endpoint and credentials from the `AWS_*`
    /// variables).
    Backup {
        #[command(subcommand)]
        cmd: BackupCmd,
    },
    /// Restore a backup into the cluster, which must hold no key (docs/backup.md §5): prints
    /// the progress as JSON lines and `restored <id>` last. Run again, it follows a restore of
    /// the same backup under way (an interrupted one goes on). The cluster serves none of the
    /// backup's regions until every one is open and copied.
    Restore {
        /// The location (`file:///dir` or `s3://bucket/prefix`).
        #[arg(long, required_unless_present = "abort")]
        from: Option<String>,
        /// The backup's id (the latest at the location if not given).
        #[arg(long, conflicts_with = "at")]
        backup: Option<String>,
        /// Restore to this moment (RFC 3339, UTC: `2026-11-26T10:00:00Z`): the latest backup (a
        /// restore point of the schedule) taken at or before it (docs/backup.md §4).
        #[arg(long)]
        at: Option<String>,
        /// Abandon the restore under way instead: its regions go, and the cluster lays out empty
        /// ones.
        #[arg(long, conflicts_with_all = ["from", "backup", "at"])]
        abort: bool,
        /// Give up following after this many seconds (the restore goes on in the cluster).
        #[arg(long, default_value_t = 3600)]
        timeout_secs: u64,
    },
    /// Print a node's metrics (from its admin endpoint).
    Stats {
        /// Admin address (host or device).
        #[arg(long)]
        admin: String,
    },
    /// Run a node pod (a host and a device) on DIR and a gateway in front of it, serving the
    /// binary protocol on LISTEN, until interrupted; with `--nodes N` (N > 1), a cluster of N
    /// node pods on an etcd (started from PATH unless `--etcd` is given). DIR/cluster.json
    /// describes what runs where.
    Local {
        #[arg(long)]
        dir: PathBuf,
        /// The gateway's binary protocol port.
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: String,
        /// The gateway's HTTP/JSON port (none by default).
        #[arg(long)]
        http: Option<String>,
        /// The gateway's Redis protocol port (none by default).
        #[arg(long)]
        resp: Option<String>,
        /// Node pods (1: a standalone node, no etcd).
        #[arg(long, default_value_t = 1)]
        nodes: u32,
        /// Replicas per region (default: 3, or the number of nodes if fewer).
        #[arg(long)]
        replication: Option<usize>,
        /// An etcd to use instead of starting one (client URL).
        #[arg(long)]
        etcd: Option<String>,
        /// How backups index their copies: send (Send Index) or build (Build Index, the
        /// baseline).
        #[arg(long, default_value = "send", value_parser = ["send", "build"])]
        backup_index: String,
        /// A cluster's node lease, in milliseconds (the hosts' `--lease-ttl-ms`: how long a
        /// failed node keeps its regions before they fail over). Default: the hosts' own.
        #[arg(long)]
        lease_ttl_ms: Option<u64>,
        /// A cluster's replication ports: node N listens on this port + N - 1 (default: free
        /// ports). Listed in DIR/cluster.json as each node's `replication`.
        #[arg(long)]
        replication_base_port: Option<u16>,
        /// Log durability: always (acknowledged once synced), interval:MS (acknowledged once
        /// written, synced within MS) or never.
        #[arg(long, default_value = "always")]
        fsync: String,
        /// Region split keys (comma separated).
        #[arg(long, default_value = "")]
        split_keys: String,
        /// Forward reads to the host (the benchmark baseline).
        #[arg(long)]
        serve_reads_on_host: bool,
        /// TLS everywhere: makes a local CA and a certificate per role in DIR/tls (kept across
        /// runs): node-<id>, front-<id> (its device's front door), gateway, admin (for `dpukv
        /// cluster`), client; runs the devices, the replication links and the control API with
        /// mutual TLS, the gateway's front ends with TLS, and etcd (started here) with TLS and
        /// client certificates of a CA of its own. Clients then trust DIR/tls/ca.pem
        /// (`--tls-ca`). Without it, every listener is on 127.0.0.1.
        #[arg(long)]
        tls: bool,
        /// Every node's device serves the Redis protocol and HTTP itself too (the front door
        /// in the device's process: its own regions with no second hop; other keys forwarded),
        /// on free ports listed in DIR/cluster.json as each node's `resp` and `http`. With
        /// `--tls` they speak TLS, each with a gateway certificate of its own
        /// (DIR/tls/front-<id>.pem).
        #[arg(long)]
        device_fronts: bool,
        /// Every node's device also serves the binary protocol on a libfabric endpoint of this
        /// provider (`tcp` here; `verbs` on RDMA NICs), on a free port listed in
        /// DIR/cluster.json as each node's `fabric` (`fabric://PROVIDER/HOST:PORT`) and
        /// registered in the region map: clients that dial one route over the fabric.
        #[arg(long, value_name = "PROVIDER")]
        fabric: Option<String>,
    },
}

/// `dpukv cluster ...`.
#[derive(Debug, clap::Subcommand)]
enum ClusterCmd {
    /// Drain NODE: hand its primaries over to backups, then move its copies to other nodes (no
    /// acknowledged write is lost; clients see retryable errors at most). Prints the progress as
    /// JSON lines until the node holds nothing (or at once with --no-wait).
    Drain {
        node: u32,
        #[arg(long)]
        no_wait: bool,
        /// Stop draining NODE instead.
        #[arg(long)]
        cancel: bool,
    },
    /// Split REGION at KEY: the keys from KEY on go to a new region on the same nodes (writes to
    /// them are refused, retryable, while they are copied). Waits until the map shows it.
    Split {
        region: u32,
        key: String,
        #[arg(long)]
        no_wait: bool,
    },
    /// Merge REGION into its left neighbour (both must be on the same nodes; if another node
    /// leads REGION, its primary moves to the neighbour's first). Waits until the map shows it.
    Merge {
        region: u32,
        #[arg(long)]
        no_wait: bool,
    },
}

/// `dpukv backup ...`.
#[derive(Debug, clap::Subcommand)]
enum BackupCmd {
    /// Take a backup of the cluster to the location: a consistent cut of every region, uploaded
    /// from the primaries (only what the location does not hold yet), the manifest last. Prints
    /// the progress as JSON lines, and the backup's id on the last line.
    Create {
        #[arg(long)]
        to: String,
    },
    /// Print the ids of the location's backups, oldest first.
    List {
        #[arg(long)]
        to: String,
    },
    /// Print a backup's manifest (JSON).
    Describe {
        id: String,
        #[arg(long)]
        to: String,
    },
    /// Read back every object of a backup and check its digest; exit 1 naming the first missing
    /// or corrupt one.
    Verify {
        id: String,
        #[arg(long)]
        to: String,
    },
    /// Delete a backup (its manifest; its objects go with the next sweep that no backup names
    /// them in).
    Delete {
        id: String,
        #[arg(long)]
        to: String,
    },
    /// Delete the objects no backup names that are older than GRACE seconds (an upload under
    /// way is younger).
    Sweep {
        #[arg(long)]
        to: String,
        #[arg(long, default_value_t = 3600)]
        grace_secs: u64,
    },
    /// Delete the backups a retention policy does not keep (their manifests; objects go with
    /// the next sweep): those not among the last N, and not younger than SECS; never the latest.
    Expire {
        #[arg(long)]
        to: String,
        #[arg(long)]
        keep_last: Option<usize>,
        #[arg(long)]
        keep_within_secs: Option<u64>,
    },
    /// The cluster's backup schedule (docs/backup.md §4): with --to, the master takes a backup
    /// there every EVERY seconds, or at the times of a 5-field cron expression (UTC) — each one
    /// a restore point for `dpukv restore --at` — and applies the retention after each; --off
    /// stops it; alone, prints it and the last backup.
    Schedule {
        #[arg(long)]
        to: Option<String>,
        #[arg(long, requires = "to", conflicts_with = "cron")]
        every_secs: Option<f64>,
        #[arg(long, requires = "to")]
        cron: Option<String>,
        #[arg(long, requires = "to")]
        keep_last: Option<usize>,
        #[arg(long, requires = "to")]
        keep_within_secs: Option<u64>,
        #[arg(long, conflicts_with = "to")]
        off: bool,
    },
}

/// `dpukv backup` commands that need only the location.
async fn backup_location_cmd(cmd: &BackupCmd) -> Result<Option<i32>> {
    let open = |to: &str| dpukv_backup::Location::open(to).map_err(|e| anyhow::anyhow!("{}: {e}", e.code()));
    let fail = |e: dpukv_backup::BackupError| anyhow::anyhow!("{}: {e}", e.code());
    match cmd {
        BackupCmd::Create { .. } | BackupCmd::Schedule { .. } => return Ok(None),
        BackupCmd::Expire { to, keep_last, keep_within_secs } => {
            let keep = dpukv_backup::Retention {
                last: *keep_last,
                within: keep_within_secs.map(std::time::Duration::from_secs),
            };
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64;
            for id in open(to)?.expire(keep, now).await.map_err(fail)? {
                println!("expired {id}");
            }
        }
        BackupCmd::List { to } => {
            for id in open(to)?.list().await.map_err(fail)? {
                println!("{id}");
            }
        }
        BackupCmd::Describe { id, to } => {
            let m = open(to)?.manifest(id).await.map_err(fail)?;
            println!("{}", String::from_utf8_lossy(&m.encode()));
        }
        BackupCmd::Verify { id, to } => {
            let loc = open(to)?;
            let m = loc.manifest(id).await.map_err(fail)?;
            let (mut objects, mut bytes) = (0u64, 0u64);
            for r in &m.regions {
                for o in r.objects() {
                    if let Err(e) = loc.verify_object(o).await {
                        eprintln!("dpukv: backup {id}: region {}: {}: {e}", r.id, e.code());
                        return Ok(Some(1));
                    }
                    objects += 1;
                    bytes += o.len;
                }
            }
            println!("backup {id}: {objects} objects, {bytes} bytes, every digest checked");
        }
        BackupCmd::Delete { id, to } => {
            open(to)?.delete_backup(id).await.map_err(fail)?;
            println!("deleted backup {id}");
        }
        BackupCmd::Sweep { to, grace_secs } => {
            let (n, freed) = open(to)?.sweep(std::time::Duration::from_secs(*grace_secs)).await.map_err(fail)?;
            println!("deleted {n} objects no backup names ({freed} bytes)");
        }
    }
    Ok(Some(0))
}

/// `dpukv backup create`: asks a host's control API for a backup and follows it.
async fn backup_create(c: &Client, to: &str, ctl: &ControlClient) -> Result<i32> {
    let addr = ctl.endpoint(&c.region_map().await?, None)?;
    let body = ctl.must(&addr, &ControlRoute::Backup { to: to.to_string() }).await?;
    print!("{body}");
    let parse = |b: &str| serde_json::from_str::<serde_json::Value>(b).context("the control API answered no JSON");
    let mut last = parse(&body)?;
    let job = last["job"].as_u64().context("the control API's answer names no job")?;
    loop {
        match last["state"].as_str() {
            Some("done") => {
                println!("{}", last["backup"].as_str().unwrap_or_default());
                return Ok(0);
            }
            Some("failed") => bail!("the backup failed: {}", last["error"].as_str().unwrap_or("no reason given")),
            _ => {}
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let body = ctl.must(&addr, &ControlRoute::BackupStatus { job }).await?;
        let now = parse(&body)?;
        if now != last {
            print!("{body}");
        }
        last = now;
    }
}

/// Errors a restore does not get past by trying again: the backup itself is damaged or gone.
const FINAL_RESTORE_ERRORS: &[&str] = &[
    "backup_object_missing",
    "backup_object_corrupt",
    "backup_not_found",
    "backup_manifest_invalid",
    "restore_part_missing",
];

/// `dpukv restore`: begins (or follows) a restore through a host's control API until it ends.
async fn restore(
    addr: &str,
    from: &str,
    backup: Option<String>,
    timeout: Duration,
    ctl: &ControlClient,
) -> Result<i32> {
    let body = ctl.must(addr, &ControlRoute::Restore { from: from.to_string(), backup }).await?;
    print!("{body}");
    let parse = |b: &str| serde_json::from_str::<serde_json::Value>(b).context("the control API answered no JSON");
    let mut last = parse(&body)?;
    let id = last["backup"].as_str().unwrap_or_default().to_string();
    let began = std::time::Instant::now();
    loop {
        if last["state"].as_str() == Some("none") {
            println!("restored {id}");
            return Ok(0);
        }
        let errors: Vec<&str> = last["errors"].as_array().into_iter().flatten().filter_map(|e| e.as_str()).collect();
        if let Some(e) = errors.iter().find(|e| FINAL_RESTORE_ERRORS.iter().any(|c| e.contains(&format!(": {c}:")))) {
            bail!(
                "the restore cannot finish: {e} (repair the location and run this again to go on, or `dpukv restore --abort`)"
            );
        }
        if began.elapsed() > timeout {
            bail!(
                "the restore did not end within {timeout:?}; it goes on in the cluster (run this again to follow it)"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let body = ctl.must(addr, &ControlRoute::RestoreStatus { action: Action::Progress }).await?;
        let now = parse(&body)?;
        if now != last {
            print!("{body}");
        }
        last = now;
    }
}

/// Writes a new random control token (32 hex digits from the kernel's generator) to
/// `dir/control-token`, readable by its owner only; its path.
fn control_token(dir: &std::path::Path) -> Result<PathBuf> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut raw = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
    let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let path = dir.join("control-token");
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
    std::io::Write::write_all(&mut f, token.as_bytes())?;
    Ok(path)
}

/// Waits (up to the master's handoff timeout and a margin) until `done` holds for the map.
async fn wait_for_map(
    c: &Client,
    what: &str,
    done: impl Fn(&dpukv_client::proto::regionmap::RegionMap) -> bool,
) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    loop {
        if let Ok(m) = c.region_map().await
            && done(&m)
        {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("{what} did not happen within 180 s (the master aborts a split or merge that cannot finish)");
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

async fn cluster_cmd(c: &Client, cmd: ClusterCmd, ctl: &ControlClient) -> Result<i32> {
    match cmd {
        ClusterCmd::Split { region, key, no_wait } => {
            let addr = ctl.endpoint(&c.region_map().await?, None)?;
            ctl.must(&addr, &ControlRoute::Split { region, key: key.as_bytes().to_vec() }).await?;
            if !no_wait {
                let k = key.as_bytes().to_vec();
                wait_for_map(c, "the split", |m| m.regions.iter().any(|r| r.start == k)).await?;
                println!("split region {region} at {key}");
            }
            Ok(0)
        }
        ClusterCmd::Merge { region, no_wait } => {
            let addr = ctl.endpoint(&c.region_map().await?, None)?;
            ctl.must(&addr, &ControlRoute::Merge { region }).await?;
            if !no_wait {
                wait_for_map(c, "the merge", |m| m.region(region).is_none()).await?;
                println!("merged region {region} into its left neighbour");
            }
            Ok(0)
        }
        ClusterCmd::Drain { node, no_wait, cancel } => {
            let map = c.region_map().await?;
            if map.node(node).is_none() && !cancel {
                bail!("node {node} is not registered in the cluster");
            }
            // Any host's control API will do; prefer one that is not being drained.
            let addr = ctl.endpoint(&map, Some(node))?;
            let action = if cancel { Action::Cancel } else { Action::Request };
            let body = ctl.must(&addr, &ControlRoute::Drain { node, action }).await?;
            print!("{body}");
            if no_wait || cancel {
                return Ok(0);
            }
            let mut last = body;
            while !last.contains("\"done\": true") {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                let body = ctl.must(&addr, &ControlRoute::Drain { node, action: Action::Progress }).await?;
                if body != last {
                    print!("{body}");
                }
                last = body;
            }
            Ok(0)
        }
    }
}

fn vec_op(s: &str) -> Result<VecOp> {
    Ok(match s {
        "add" => VecOp::Add,
        "sub" => VecOp::Sub,
        "mul" => VecOp::Mul,
        "min" => VecOp::Min,
        "max" => VecOp::Max,
        "set" => VecOp::Set,
        _ => bail!("unknown vector operation {s:?}"),
    })
}

fn u64s(v: &[u8]) -> String {
    v.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])).to_string()).collect::<Vec<_>>().join(" ")
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("dpukv: {e:#}");
            std::process::exit(2);
        }
    }
}

async fn run(cli: Cli) -> Result<i32> {
    if let Cmd::Local {
        dir,
        listen,
        http,
        resp,
        nodes,
        replication,
        etcd,
        backup_index,
        lease_ttl_ms,
        replication_base_port,
        fsync,
        split_keys,
        serve_reads_on_host,
        tls,
        device_fronts,
        fabric,
    } = &cli.cmd
    {
        let cluster = (*nodes > 1).then(|| LocalCluster {
            nodes: *nodes,
            replication: replication.unwrap_or(3).min(*nodes as usize),
            etcd: etcd.clone(),
            backup_index: backup_index.clone(),
            lease_ttl_ms: *lease_ttl_ms,
            replication_base_port: *replication_base_port,
        });
        let gateway = LocalGateway {
            binary: listen.clone(),
            http: http.clone(),
            resp: resp.clone(),
            device_fronts: *device_fronts,
            fabric: fabric.clone(),
        };
        return local(dir, &gateway, fsync, split_keys, *serve_reads_on_host, *tls, cluster).await;
    }
    if let Cmd::Stats { admin } = &cli.cmd {
        return stats(admin).await;
    }
    if let Cmd::Backup { cmd } = &cli.cmd
        && let Some(code) = backup_location_cmd(cmd).await?
    {
        return Ok(code);
    }
    let connections = if let Cmd::Load { connections, .. } = &cli.cmd { *connections } else { 1 };
    let tls = cli.tls.client().map_err(anyhow::Error::msg)?;
    let control = ControlClient { tls: tls.clone(), token: cli.admin_token.clone(), addr: cli.control.clone() };
    let opts = dpukv_client::Options {
        pool: connections,
        token: cli.token.as_deref().map(|t| std::sync::Arc::from(t.as_bytes())),
        tls,
        consistency: cli.consistency,
        ..Default::default()
    };
    let c =
        Client::connect_with(&cli.endpoint, opts).await.with_context(|| format!("connecting to {}", cli.endpoint))?;
    let mut out = std::io::stdout().lock();
    match cli.cmd {
        Cmd::Get { key } => match c.get(key.as_bytes()).await? {
            Some(v) => {
                out.write_all(&v)?;
                out.write_all(b"\n")?;
            }
            None => return Ok(1),
        },
        Cmd::Put { key, value } => {
            c.put(key.as_bytes(), value.as_bytes()).await?;
        }
        Cmd::Delete { key } => {
            c.delete(key.as_bytes()).await?;
        }
        Cmd::Scan { start, end, limit, floor } => {
            let items = if floor {
                c.floor_scan(start.as_bytes(), end.as_bytes(), limit).await?
            } else {
                c.scan(start.as_bytes(), end.as_bytes(), limit).await?
            };
            for (k, v) in items {
                out.write_all(&k)?;
                out.write_all(b"\t")?;
                out.write_all(&v)?;
                out.write_all(b"\n")?;
            }
        }
        Cmd::FetchAdd { key, delta } => writeln!(out, "{}", c.fetch_add(key.as_bytes(), delta).await?)?,
        Cmd::Cas { key, expected, new, absent } => {
            let exp = (!absent).then_some(expected.as_bytes());
            let (swapped, current) = c.compare_and_swap(key.as_bytes(), exp, new.as_bytes()).await?;
            writeln!(out, "{}", if swapped { "swapped" } else { "not swapped" })?;
            if !swapped {
                return Ok(match current {
                    Some(v) => {
                        out.write_all(&v)?;
                        writeln!(out)?;
                        3
                    }
                    None => 3,
                });
            }
        }
        Cmd::VectorAdd { key, op, scalar } => {
            c.vector_scalar(key.as_bytes(), Elem::U64, vec_op(&op)?, scalar.to_le_bytes()).await?
        }
        Cmd::Reduce { key, op } => {
            let op = match op.as_str() {
                "sum" => ReduceOp::Sum,
                "min" => ReduceOp::Min,
                "max" => ReduceOp::Max,
                _ => bail!("reduce takes sum, min or max"),
            };
            writeln!(out, "{}", u64::from_le_bytes(c.reduce(key.as_bytes(), Elem::U64, op).await?))?;
        }
        Cmd::Filter { key, cmp, value } => {
            let cmp = match cmp.as_str() {
                "lt" => Cmp::Lt,
                "le" => Cmp::Le,
                "eq" => Cmp::Eq,
                "ne" => Cmp::Ne,
                "ge" => Cmp::Ge,
                "gt" => Cmp::Gt,
                _ => bail!("filter takes lt, le, eq, ne, ge or gt"),
            };
            writeln!(out, "{}", u64s(&c.filter(key.as_bytes(), Elem::U64, cmp, value.to_le_bytes()).await?))?;
        }
        Cmd::Load { count, prefix, value_size, .. } => load(&c, count, &prefix, value_size).await?,
        Cmd::Cluster { cmd } => return cluster_cmd(&c, cmd, &control).await,
        Cmd::Backup { cmd: BackupCmd::Create { to } } => return backup_create(&c, &to, &control).await,
        Cmd::Backup { cmd: BackupCmd::Schedule { to, every_secs, cron, keep_last, keep_within_secs, off } } => {
            let addr = control.endpoint(&c.region_map().await?, None)?;
            let route = match to {
                Some(to) => {
                    let mut spec = format!("to={to}\n");
                    match (every_secs, cron) {
                        (Some(every), None) if every.is_finite() && every >= 1.0 => {
                            spec += &format!("every_ms={}\n", (every * 1000.0) as u64);
                        }
                        (None, Some(cron)) => spec += &format!("cron={cron}\n"),
                        _ => bail!("--to needs --every-secs (at least 1) or --cron"),
                    }
                    if let Some(n) = keep_last {
                        spec += &format!("keep_last={n}\n");
                    }
                    if let Some(secs) = keep_within_secs {
                        spec += &format!("keep_within_ms={}\n", secs * 1000);
                    }
                    ControlRoute::SetBackupSchedule { spec: spec.into_bytes() }
                }
                _ if off => ControlRoute::BackupSchedule { action: Action::Cancel },
                _ => ControlRoute::BackupSchedule { action: Action::Progress },
            };
            print!("{}", control.must(&addr, &route).await?);
        }
        Cmd::Backup { .. } => unreachable!("answered above"),
        Cmd::Restore { from, backup, at, abort, timeout_secs } => {
            let addr = control.endpoint(&c.region_map().await?, None)?;
            if abort {
                let body = control.must(&addr, &ControlRoute::RestoreStatus { action: Action::Cancel }).await?;
                print!("{body}");
                return Ok(0);
            }
            let from = from.context("--from is required")?;
            let backup = match at {
                Some(t) => Some(format!(
                    "at-{}",
                    dpukv_backup::manifest::parse_utc(&t)
                        .with_context(|| format!("--at {t:?}: not an RFC 3339 time in UTC (2026-11-26T10:00:00Z)"))?
                )),
                None => backup,
            };
            return restore(&addr, &from, backup, Duration::from_secs(timeout_secs), &control).await;
        }
        Cmd::Regions => {
            for r in c.region_map().await?.regions {
                out.write_all(format!("{}\t", r.id).as_bytes())?;
                out.write_all(&r.start)?;
                out.write_all(b"\t")?;
                out.write_all(r.end.as_deref().unwrap_or_default())?;
                let backups: Vec<String> = r.backups.iter().map(u32::to_string).collect();
                writeln!(out, "\t{}\t{}\t{}", r.primary, backups.join(","), r.epoch)?;
            }
        }
        Cmd::Nodes => {
            let m = c.region_map().await?;
            for n in &m.nodes {
                let master = if n.id == m.master { "\tmaster" } else { "" };
                writeln!(out, "{}\t{}\t{}\t{}\t{}{master}", n.id, n.device, n.replication, n.admin, n.zone)?;
            }
        }
        Cmd::Stats { .. } | Cmd::Local { .. } => unreachable!("handled above"),
    }
    Ok(0)
}

async fn load(c: &Client, count: u64, prefix: &str, value_size: usize) -> Result<()> {
    use dpukv_client::proto::WriteOp;
    // Atomic batches of 64 keys (one version and one durability wait each), 64 in flight.
    let start = std::time::Instant::now();
    let (batch, in_flight) = (64u64, 64usize);
    let mut next = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    let (mut done, mut shown) = (0u64, u64::MAX);
    while done < count {
        while next < count && tasks.len() < in_flight {
            let end = (next + batch).min(count);
            let ops = (next..end)
                .map(|n| WriteOp::Put { key: format!("{prefix}{n:012}").into_bytes(), value: vec![b'v'; value_size] })
                .collect();
            let c = c.clone();
            tasks.spawn(async move { c.batch(ops).await.map(|_| end - next) });
            next = end;
        }
        if let Some(r) = tasks.join_next().await {
            done += r??;
        }
        let pct = done * 100 / count.max(1);
        if pct != shown {
            shown = pct;
            eprint!("\rloading {done}/{count} ({pct}%)");
        }
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!("\rloaded {count} keys in {secs:.2}s ({:.0} keys/s)", count as f64 / secs);
    Ok(())
}

async fn stats(admin: &str) -> Result<i32> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(admin).await.with_context(|| format!("connecting to {admin}"))?;
    s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    let text = body.split("\r\n\r\n").nth(1).unwrap_or("");
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        println!("{line}");
    }
    Ok(0)
}

/// `dpukv local --nodes N`: the cluster to run.
struct LocalCluster {
    nodes: u32,
    replication: usize,
    etcd: Option<String>,
    backup_index: String,
    lease_ttl_ms: Option<u64>,
    replication_base_port: Option<u16>,
}

/// Where `dpukv local`'s gateway listens.
struct LocalGateway {
    binary: String,
    http: Option<String>,
    resp: Option<String>,
    /// Every device serves RESP and HTTP too.
    device_fronts: bool,
    /// Every device serves a fabric endpoint of this provider too.
    fabric: Option<String>,
}

/// With a provider, gives the device of `cmd` a fabric endpoint on a free port of 127.0.0.1,
/// and says where (`fabric://PROVIDER/127.0.0.1:PORT`; empty: none).
fn device_fabric(cmd: &mut tokio::process::Command, provider: Option<&str>) -> Result<String> {
    for var in ["DPUKV_FABRIC_LISTEN", "DPUKV_FABRIC_PROVIDER"] {
        cmd.env_remove(var);
    }
    let Some(p) = provider else { return Ok(String::new()) };
    let at = format!("127.0.0.1:{}", free_port()?);
    cmd.args(["--fabric-listen", &at, "--fabric-provider", p]);
    Ok(format!("fabric://{p}/{at}"))
}

/// With `on`, gives the device of `cmd` a front door (`--resp`, `--http`) on free ports of
/// 127.0.0.1, and says where; with `tls` (the local CA's directory), the front door's own
/// gateway certificates (`front-{node}`).
fn device_fronts(
    cmd: &mut tokio::process::Command,
    on: bool,
    tls: Option<&LocalTls>,
) -> Result<(Option<String>, Option<String>)> {
    // The front door's tokens and certificates are given here or not at all.
    for var in ["DPUKV_TOKENS_FILE", "DPUKV_TOKENS", "DPUKV_FRONT_TLS_CERT", "DPUKV_FRONT_TLS_KEY"] {
        cmd.env_remove(var);
    }
    if !on {
        return Ok((None, None));
    }
    let (resp, http) = (format!("127.0.0.1:{}", free_port()?), format!("127.0.0.1:{}", free_port()?));
    cmd.args(["--resp", &resp, "--http", &http]);
    if let Some(t) = tls {
        cmd.arg("--front-tls-cert").arg(t.dir.join("front-{node}.pem"));
        cmd.arg("--front-tls-key").arg(t.dir.join("front-{node}.key"));
    }
    Ok((Some(resp), Some(http)))
}

/// A port for a process of the local cluster, reserved while `dpukv local` runs
/// (dpukv_client::ports: nothing else of ours on this machine picks it, even between a
/// process's death and its restart on the same port).
fn free_port() -> Result<u16> {
    Ok(dpukv_client::ports::reserve()?)
}

/// One node pod of `dpukv local`.
struct LocalNode {
    id: u32,
    device: String,
    admin: String,
    /// Its host's control API (a cluster's nodes only).
    control: String,
    /// Its device's front door (`--device-fronts`): the Redis protocol and HTTP ports.
    resp: Option<String>,
    /// Its device's fabric endpoint (`--fabric`; empty: none).
    fabric: String,
    /// Its device's admin endpoint (`/metrics`, `/healthz`, `/readyz`).
    device_admin: String,
    http: Option<String>,
    /// Its host's replication address (a cluster's nodes only).
    replication: String,
    /// Its processes' logs (empty: this process's standard error).
    host_log: String,
    device_log: String,
    procs: Vec<Supervised>,
}

/// Runs `dpukv-node`, `dpukv-dpu` and `dpukv-gateway` (found next to this binary) until
/// SIGINT/SIGTERM, then stops them; with a cluster, also etcd (unless given) and N pods. Like a
/// kubelet, it restarts a process that exits (with a backoff that doubles from 0.5 s to 30 s,
/// reset once a process has run for a minute), so a crash costs a restart, not the pod; the
/// device follows a restarted host by itself, and the gateway a restarted device.
///
/// Every listener it starts is on 127.0.0.1 (the gateway's too, unless `--tls`: then the
/// gateway's front ends may be given another address).
async fn local(
    dir: &std::path::Path,
    gw: &LocalGateway,
    fsync: &str,
    split_keys: &str,
    on_host: bool,
    tls: bool,
    cluster: Option<LocalCluster>,
) -> Result<i32> {
    use std::time::Duration;

    use tokio::signal::unix::{SignalKind, signal};
    let exe_dir = std::env::current_exe()?.parent().context("binary directory")?.to_path_buf();
    if !tls {
        for (flag, a) in [("--listen", Some(&gw.binary)), ("--http", gw.http.as_ref()), ("--resp", gw.resp.as_ref())] {
            if let Some(a) = a
                && !loopback(a)
            {
                bail!("{flag} {a}: without --tls, dpukv local serves on 127.0.0.1 only (plain text, no credentials)");
            }
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let nodes_wanted = cluster.as_ref().map_or(1, |c| c.nodes);
    let starts_etcd = cluster.as_ref().is_some_and(|c| c.etcd.is_none());
    let tls = if tls { Some(LocalTls::load_or_issue(&dir.join("tls"), nodes_wanted, starts_etcd)?) } else { None };
    // TLS flags for a process: its certificate (a node's by `{node}`), its key and the CA;
    // `mutual` asks peers for theirs. The processes' environment holds no DPUKV_TLS_* of this
    // shell: TLS is as given here.
    let with_tls = |cmd: &mut tokio::process::Command, who: &str, mutual: bool| {
        for var in ["DPUKV_TLS_CERT", "DPUKV_TLS_KEY", "DPUKV_TLS_CA", "DPUKV_TLS_CLIENT_AUTH"] {
            cmd.env_remove(var);
        }
        if let Some(t) = &tls {
            cmd.arg("--tls-cert").arg(t.dir.join(format!("{who}.pem")));
            cmd.arg("--tls-key").arg(t.dir.join(format!("{who}.key")));
            cmd.arg("--tls-ca").arg(t.ca());
            if mutual {
                cmd.arg("--tls-client-auth");
            }
        }
    };
    let node_files = "node-{node}";
    // With TLS the hosts' control API wants an admin certificate or the admin token: the
    // gateway's console acts with a token made here (its certificate only reads).
    let control_token = match (&tls, &cluster) {
        (Some(t), Some(_)) => Some(control_token(&t.dir)?),
        _ => None,
    };
    let mut etcd: Option<Supervised> = None;
    let mut etcd_url = String::new();
    let mut nodes: Vec<LocalNode> = Vec::new();
    match &cluster {
        None => {
            let (data, shm) = (dir.join("data"), dir.join("shm"));
            std::fs::create_dir_all(&data)?;
            let (device, admin) = (format!("127.0.0.1:{}", free_port()?), format!("127.0.0.1:{}", free_port()?));
            let mut host_cmd = tokio::process::Command::new(exe_dir.join("dpukv-node"));
            host_cmd.arg("--data-dir").arg(&data).arg("--shm-dir").arg(&shm);
            host_cmd.args(["--fsync", fsync, "--split-keys", split_keys, "--admin", &admin]).kill_on_drop(true);
            with_tls(&mut host_cmd, "node-1", true);
            // The host publishes its regions before it serves; the device waits for them.
            let mut dev_cmd = tokio::process::Command::new(exe_dir.join("dpukv-dpu"));
            let device_admin = format!("127.0.0.1:{}", free_port()?);
            dev_cmd.arg("--shm-dir").arg(&shm).args(["--listen", &device, "--node-id", "1"]).kill_on_drop(true);
            dev_cmd.args(["--admin", &device_admin]).env_remove("DPUKV_DEVICE_ADMIN");
            with_tls(&mut dev_cmd, node_files, true);
            if on_host {
                dev_cmd.arg("--serve-reads-on-host");
            }
            let (resp, http) = device_fronts(&mut dev_cmd, gw.device_fronts, tls.as_ref())?;
            let fabric = device_fabric(&mut dev_cmd, gw.fabric.as_deref())?;
            let procs = vec![Supervised::new("host".into(), host_cmd), Supervised::new("device".into(), dev_cmd)];
            nodes.push(LocalNode {
                id: 1,
                device,
                admin,
                control: String::new(),
                resp,
                fabric,
                device_admin,
                http,
                replication: String::new(),
                host_log: String::new(),
                device_log: String::new(),
                procs,
            });
        }
        Some(c) => {
            etcd_url = match &c.etcd {
                Some(u) => u.clone(),
                None => {
                    if std::process::Command::new("etcd").arg("--version").output().is_err() {
                        bail!(
                            "`dpukv local --nodes {}` needs etcd on PATH (Debian: apt-get install -y etcd-server), or --etcd URL",
                            c.nodes
                        );
                    }
                    let scheme = if tls.is_some() { "https" } else { "http" };
                    let (cp, pp) = (free_port()?, free_port()?);
                    let (client, peer) = (format!("{scheme}://127.0.0.1:{cp}"), format!("{scheme}://127.0.0.1:{pp}"));
                    let mut cmd = tokio::process::Command::new("etcd");
                    cmd.args(["--name", "local", "--data-dir"]).arg(dir.join("etcd"));
                    cmd.args(["--listen-client-urls", &client, "--advertise-client-urls", &client]);
                    cmd.args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer]);
                    cmd.arg("--initial-cluster").arg(format!("local={peer}"));
                    cmd.args(["--initial-cluster-state", "new"]);
                    if let Some(t) = &tls {
                        // Its own CA: only holders of an etcd client certificate (the hosts) get in.
                        let (cert, key, ca) =
                            (t.dir.join("etcd.pem"), t.dir.join("etcd.key"), t.dir.join("etcd-ca.pem"));
                        cmd.arg("--cert-file").arg(&cert).arg("--key-file").arg(&key);
                        cmd.arg("--trusted-ca-file").arg(&ca).arg("--client-cert-auth");
                        cmd.arg("--peer-cert-file").arg(&cert).arg("--peer-key-file").arg(&key);
                        cmd.arg("--peer-trusted-ca-file").arg(&ca).arg("--peer-client-cert-auth");
                    }
                    cmd.stdout(std::process::Stdio::null()).stderr(std::fs::File::create(dir.join("etcd.log"))?);
                    cmd.kill_on_drop(true);
                    etcd = Some(Supervised::new("etcd".into(), cmd));
                    client
                }
            };
            for id in 1..=c.nodes {
                let nd = dir.join(format!("node-{id}"));
                let (data, shm) = (nd.join("data"), nd.join("shm"));
                std::fs::create_dir_all(&data)?;
                let device = format!("127.0.0.1:{}", free_port()?);
                let repl = match c.replication_base_port {
                    Some(base) => {
                        let port = u16::try_from(u32::from(base) + id - 1).map_err(|_| {
                            anyhow::anyhow!("--replication-base-port {base}: node {id}'s port is past 65535")
                        })?;
                        format!("127.0.0.1:{port}")
                    }
                    None => format!("127.0.0.1:{}", free_port()?),
                };
                let admin = format!("127.0.0.1:{}", free_port()?);
                let control = format!("127.0.0.1:{}", free_port()?);
                let mut host_cmd = tokio::process::Command::new(exe_dir.join("dpukv-node"));
                host_cmd.arg("--data-dir").arg(&data).arg("--shm-dir").arg(&shm);
                host_cmd.args(["--fsync", fsync, "--split-keys", split_keys, "--admin", &admin]);
                host_cmd.args(["--control-listen", &control]);
                host_cmd.args(["--cluster", "local", "--node-id", &id.to_string(), "--etcd", &etcd_url]);
                host_cmd.args(["--replication-listen", &repl, "--advertise-device", &device]);
                host_cmd.args(["--replication-factor", &c.replication.to_string()]).kill_on_drop(true);
                host_cmd.args(["--backup-index", &c.backup_index]);
                if let Some(ms) = c.lease_ttl_ms {
                    host_cmd.args(["--lease-ttl-ms", &ms.to_string()]);
                }
                host_cmd.stderr(std::fs::File::create(nd.join("host.log"))?);
                for var in ["DPUKV_ETCD_CA", "DPUKV_ETCD_CERT", "DPUKV_ETCD_KEY", "DPUKV_ADMIN_TOKEN_FILE"] {
                    host_cmd.env_remove(var);
                }
                if let Some(t) = tls.as_ref().filter(|_| c.etcd.is_none()) {
                    host_cmd.arg("--etcd-ca").arg(t.dir.join("etcd-ca.pem"));
                    host_cmd.arg("--etcd-cert").arg(t.dir.join("etcd-client.pem"));
                    host_cmd.arg("--etcd-key").arg(t.dir.join("etcd-client.key"));
                }
                with_tls(&mut host_cmd, node_files, true);
                if let Some(t) = &control_token {
                    host_cmd.arg("--admin-token-file").arg(t);
                }
                let mut dev_cmd = tokio::process::Command::new(exe_dir.join("dpukv-dpu"));
                let device_admin = format!("127.0.0.1:{}", free_port()?);
                dev_cmd.arg("--shm-dir").arg(&shm).args(["--listen", &device, "--node-id", &id.to_string()]);
                dev_cmd.args(["--admin", &device_admin]).env_remove("DPUKV_DEVICE_ADMIN");
                dev_cmd.kill_on_drop(true);
                with_tls(&mut dev_cmd, node_files, true);
                dev_cmd.stderr(std::fs::File::create(nd.join("device.log"))?);
                let (resp, http) = device_fronts(&mut dev_cmd, gw.device_fronts, tls.as_ref())?;
                let fabric = device_fabric(&mut dev_cmd, gw.fabric.as_deref())?;
                host_cmd.env_remove("DPUKV_ADVERTISE_FABRIC");
                if !fabric.is_empty() {
                    host_cmd.args(["--advertise-fabric", &fabric]);
                }
                let procs = vec![
                    Supervised::new(format!("node {id} host"), host_cmd),
                    Supervised::new(format!("node {id} device"), dev_cmd),
                ];
                nodes.push(LocalNode {
                    id,
                    device,
                    admin,
                    control,
                    resp,
                    fabric,
                    device_admin,
                    http,
                    replication: repl,
                    host_log: nd.join("host.log").display().to_string(),
                    device_log: nd.join("device.log").display().to_string(),
                    procs,
                });
            }
        }
    }
    // The gateway in front of the pods: clients, curl and redis-cli talk to it.
    let gw_admin = format!("127.0.0.1:{}", free_port()?);
    let seeds: Vec<&str> = nodes.iter().map(|n| n.device.as_str()).collect();
    let mut gw_cmd = tokio::process::Command::new(exe_dir.join("dpukv-gateway"));
    gw_cmd.args(["--seeds", &seeds.join(","), "--listen", &gw.binary, "--admin", &gw_admin]);
    if let Some(h) = &gw.http {
        gw_cmd.args(["--http", h]);
    }
    if let Some(r) = &gw.resp {
        gw_cmd.args(["--resp", r]);
    }
    gw_cmd.env_remove("DPUKV_CONTROL_TOKEN_FILE").env_remove("DPUKV_CONTROL");
    if let Some(t) = &control_token {
        gw_cmd.arg("--control-token-file").arg(t);
    }
    gw_cmd.stderr(std::fs::File::create(dir.join("gateway.log"))?).kill_on_drop(true);
    // Clients of the front ends prove themselves with tokens, not certificates; the gateway
    // presents its certificate (role gateway) to the devices.
    with_tls(&mut gw_cmd, "gateway", false);
    let mut gateway = Supervised::new("gateway".into(), gw_cmd);
    if let Some(e) = etcd.as_mut() {
        e.start()?;
    }
    for p in nodes.iter_mut().flat_map(|n| n.procs.iter_mut()) {
        p.start()?;
    }
    gateway.start()?;
    let console = gw
        .http
        .as_ref()
        .map(|h| format!("{}://{h}/ui/", if tls.is_some() { "https" } else { "http" }))
        .unwrap_or_default();
    let write_json = |nodes: &[LocalNode], gateway: &Supervised| -> Result<()> {
        let pid = |p: &Supervised| p.child.as_ref().and_then(|c| c.id()).unwrap_or(0);
        let list: Vec<serde_json::Value> = nodes
            .iter()
            .map(|n| {
                serde_json::json!({
                    "id": n.id,
                    "device": n.device,
                    "admin": n.admin,
                    "control": n.control,
                    "resp": n.resp.as_deref().unwrap_or_default(),
                    "fabric": n.fabric,
                    "device_admin": n.device_admin,
                    "http": n.http.as_deref().unwrap_or_default(),
                    "replication": n.replication,
                    "host_log": n.host_log,
                    "device_log": n.device_log,
                    "host_pid": pid(&n.procs[0]),
                    "device_pid": pid(&n.procs[1]),
                })
            })
            .collect();
        let opt = |a: &Option<String>| a.as_deref().unwrap_or_default().to_string();
        let path = |f: &str| tls.as_ref().map(|t| t.dir.join(f).display().to_string()).unwrap_or_default();
        let etcd_tls = |f: &str| if starts_etcd { path(f) } else { String::new() };
        let doc = serde_json::json!({
            "etcd": etcd_url,
            "tls_ca": path("ca.pem"),
            "tls": {
                "ca": path("ca.pem"),
                "admin_cert": path("admin.pem"),
                "admin_key": path("admin.key"),
                "client_cert": path("client.pem"),
                "client_key": path("client.key"),
                "etcd_ca": etcd_tls("etcd-ca.pem"),
                "etcd_client_cert": etcd_tls("etcd-client.pem"),
                "etcd_client_key": etcd_tls("etcd-client.key"),
            },
            "nodes": list,
            "gateway": {
                "binary": gw.binary,
                "http": opt(&gw.http),
                "console": console,
                "control_token": control_token.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                "resp": opt(&gw.resp),
                "admin": gw_admin,
                "pid": pid(gateway),
            },
        });
        let json = serde_json::to_string_pretty(&doc)? + "\n";
        let tmp = dir.join("cluster.json.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, dir.join("cluster.json"))?;
        Ok(())
    };
    write_json(&nodes, &gateway)?;
    let fronts = format!(
        "{}{}{}",
        gw.http.as_ref().map(|_| format!(", HTTP and the web console on {console}")).unwrap_or_default(),
        gw.resp.as_ref().map(|r| format!(", Redis protocol on {r}")).unwrap_or_default(),
        tls.as_ref()
            .map(|t| format!(
                ", all with TLS (trust {}; `dpukv cluster` takes --tls-cert/--tls-key {}/admin.pem/.key)",
                t.ca().display(),
                t.dir.display()
            ))
            .unwrap_or_default()
    );
    match &cluster {
        None => eprintln!(
            "dpukv local: one node pod (data in {}); the gateway serves on {}{fronts}; {}/cluster.json describes them; Ctrl-C to stop",
            dir.display(),
            gw.binary,
            dir.display()
        ),
        Some(c) => eprintln!(
            "dpukv local: {} nodes, replication {}, etcd {etcd_url}; the gateway serves on {}{fronts}; {}/cluster.json describes them; Ctrl-C to stop",
            c.nodes,
            c.replication,
            gw.binary,
            dir.display()
        ),
    }
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let mut restarted = false;
        for p in etcd.iter_mut().chain(nodes.iter_mut().flat_map(|n| n.procs.iter_mut())) {
            restarted |= p.poll();
        }
        restarted |= gateway.poll();
        if restarted {
            write_json(&nodes, &gateway)?;
        }
    }
    // The gateway first, then the devices (no new requests), then the hosts (they finish their
    // rounds and sync their logs), then etcd.
    gateway.stop(Duration::from_secs(15)).await;
    // Like a kubelet deleting the pods: every container of every pod gets SIGTERM at once (a
    // device serves on while its host still runs, so signalling devices first only made each
    // wait out its grace), then each is waited for.
    for p in nodes.iter_mut().flat_map(|n| n.procs.iter_mut()) {
        p.terminate();
    }
    for p in nodes.iter_mut().flat_map(|n| n.procs.iter_mut()) {
        p.stop(Duration::from_secs(15)).await;
    }
    if let Some(e) = etcd.as_mut() {
        e.stop(Duration::from_secs(15)).await;
    }
    Ok(0)
}

/// Whether `addr` (`host:port`) is a loopback address (`127.0.0.0/8`, `::1`, `localhost`).
fn loopback(addr: &str) -> bool {
    match addr.parse::<std::net::SocketAddr>() {
        Ok(a) => a.ip().is_loopback(),
        Err(_) => addr.rsplit_once(':').is_some_and(|(h, _)| h == "localhost"),
    }
}

/// `dpukv local --tls`'s certificates in one directory, each naming its holder
/// (`spiffe://dpukv/local/local/<role>/<id>`) and valid for 127.0.0.1 and localhost:
/// `ca.pem`; `node-<id>.pem`/`.key` per node; `gateway`, `admin` (for `dpukv cluster`),
/// `client` (data only); with an etcd started here, `etcd-ca.pem` (a CA of its own),
/// `etcd.pem`/`.key` (the server) and `etcd-client.pem`/`.key` (the hosts'). The CAs' keys are
/// never written: a set is kept across runs while it covers what is asked, else a new one is
/// issued whole.
struct LocalTls {
    dir: PathBuf,
}

impl LocalTls {
    fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn load_or_issue(dir: &std::path::Path, nodes: u32, etcd: bool) -> Result<LocalTls> {
        use dpukv_net::identity::{Identity, Role};
        use dpukv_net::tls::{LocalCa, TlsFiles};
        let mut names: Vec<String> = (1..=nodes).map(|i| format!("node-{i}")).collect();
        names.extend((1..=nodes).map(|i| format!("front-{i}")));
        names.extend(["gateway", "admin", "client"].map(String::from));
        if etcd {
            names.extend(["etcd", "etcd-client"].map(String::from));
        }
        let mut files: Vec<PathBuf> = vec![dir.join("ca.pem")];
        if etcd {
            files.push(dir.join("etcd-ca.pem"));
        }
        for n in &names {
            files.extend([dir.join(format!("{n}.pem")), dir.join(format!("{n}.key"))]);
        }
        let t = LocalTls { dir: dir.to_path_buf() };
        if files.iter().all(|f| f.exists()) {
            return Ok(t);
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let e = anyhow::Error::msg;
        let (ca, etcd_ca) = (LocalCa::new().map_err(e)?, LocalCa::new().map_err(e)?);
        let hosts = ["127.0.0.1", "localhost"];
        let pair = |name: &str, ca: Option<PathBuf>| TlsFiles {
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
            ca,
        };
        let id = |role: Role, name: &str| Identity::new("local", "local", role, name).map_err(anyhow::Error::new);
        for i in 1..=nodes {
            let name = format!("node-{i}");
            ca.issue(&hosts, Some(&id(Role::Node, &i.to_string())?), &pair(&name, None)).map_err(e)?;
            // Its device's front door (`--device-fronts`): a gateway of its own.
            let name = format!("front-{i}");
            ca.issue(&hosts, Some(&id(Role::Gateway, &name)?), &pair(&name, None)).map_err(e)?;
        }
        for (name, role, who) in
            [("gateway", Role::Gateway, "gateway"), ("admin", Role::Admin, "cli"), ("client", Role::Client, "cli")]
        {
            ca.issue(&hosts, Some(&id(role, who)?), &pair(name, None)).map_err(e)?;
        }
        if etcd {
            etcd_ca.issue(&hosts, None, &pair("etcd", None)).map_err(e)?;
            etcd_ca.issue(&hosts, Some(&id(Role::Node, "etcd-client")?), &pair("etcd-client", None)).map_err(e)?;
            etcd_ca.write_ca(&dir.join("etcd-ca.pem")).map_err(e)?;
        }
        // The CA last: an interrupted run leaves no complete-looking set.
        ca.write_ca(&dir.join("ca.pem")).map_err(e)?;
        Ok(t)
    }
}

/// A child process kept running (see [`local`]). [`Supervised::poll`] never blocks: it looks at
/// the process and restarts it when due; its state says where it is.
struct Supervised {
    name: String,
    cmd: tokio::process::Command,
    child: Option<tokio::process::Child>,
    started: tokio::time::Instant,
    /// Set while waiting to restart the process.
    restart_at: Option<tokio::time::Instant>,
    backoff: std::time::Duration,
    restarts: u32,
    /// SIGTERM was sent (the process is stopping: not restarted).
    terminated: bool,
}

impl Supervised {
    const FIRST_BACKOFF: std::time::Duration = std::time::Duration::from_millis(500);
    const MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(30);
    const HEALTHY_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

    /// Supervises what `cmd` runs; the process dies with this one (spawned from the main
    /// thread, where [`local`] runs: see `die_with_parent`).
    fn new(name: String, mut cmd: tokio::process::Command) -> Supervised {
        dpukv_net::process::die_with_parent(&mut cmd);
        Supervised {
            name,
            cmd,
            child: None,
            started: tokio::time::Instant::now(),
            restart_at: None,
            backoff: Self::FIRST_BACKOFF,
            restarts: 0,
            terminated: false,
        }
    }

    fn start(&mut self) -> Result<()> {
        self.started = tokio::time::Instant::now();
        self.child = Some(self.cmd.spawn().with_context(|| format!("starting the {}", self.name))?);
        Ok(())
    }

    /// Notices that the process exited (and schedules its restart), or restarts it when its
    /// restart is due (a process that cannot be started is retried, as a kubelet would).
    /// Returns whether it started a process.
    fn poll(&mut self) -> bool {
        if let Some(child) = self.child.as_mut() {
            match child.try_wait() {
                Ok(None) => return false,
                Ok(Some(status)) => {
                    self.child = None;
                    self.exited(&status.to_string());
                }
                Err(e) => {
                    self.child = None;
                    self.exited(&e.to_string());
                }
            }
        }
        match self.restart_at {
            Some(at) if tokio::time::Instant::now() >= at => {
                self.restart_at = None;
                match self.start() {
                    Ok(()) => true,
                    Err(e) => {
                        self.exited(&format!("{e:#}"));
                        false
                    }
                }
            }
            _ => false,
        }
    }

    /// Schedules the restart of a process that exited (or could not start).
    fn exited(&mut self, why: &str) {
        if self.started.elapsed() >= Self::HEALTHY_AFTER {
            self.backoff = Self::FIRST_BACKOFF;
        }
        self.restarts += 1;
        let pause = self.backoff;
        self.backoff = (self.backoff * 2).min(Self::MAX_BACKOFF);
        self.restart_at = Some(tokio::time::Instant::now() + pause);
        eprintln!(
            "dpukv local: the {} exited ({why}); restart {} in {:.1}s",
            self.name,
            self.restarts,
            pause.as_secs_f64()
        );
    }

    /// SIGTERM (once).
    fn terminate(&mut self) {
        if !self.terminated
            && let Some(pid) = self.child.as_ref().and_then(|c| c.id())
        {
            let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
            self.terminated = true;
        }
    }

    /// SIGTERM (unless sent already), then SIGKILL after `grace`.
    async fn stop(&mut self, grace: std::time::Duration) {
        self.terminate();
        let Some(mut child) = self.child.take() else { return };
        if tokio::time::timeout(grace, child.wait()).await.is_err() {
            eprintln!("dpukv local: the {} did not stop within {grace:?}; killing it", self.name);
            let _ = child.kill().await;
        }
    }
}
