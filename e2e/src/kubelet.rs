//! A test kubelet, with the workload controllers a scenario needs, over the API-server double
//! (`apiserver`): what turns the objects the operator applies into running processes.
//!
//! - **StatefulSet controller**: pods `NAME-0..replicas` (all at once, as `Parallel` does), one
//!   `PersistentVolumeClaim` per claim template and ordinal (`TEMPLATE-NAME-ORDINAL`), rolling
//!   updates held by the partition (one pod at a time, highest ordinal first, as Kubernetes'
//!   controller walks them: the first pod off the update revision is deleted, an unhealthy one
//!   on it stops the walk), scale-in deleting the highest ordinals and then — `whenScaled: Delete` —
//!   their claims; status (`replicas`, `readyReplicas`, `currentRevision`, `updateRevision`,
//!   `updatedReplicas`, `observedGeneration`); claims owned by the StatefulSet when
//!   `whenDeleted: Delete`.
//! - **Deployment controller**: pods `NAME-HASH-N` owned by the Deployment directly (no
//!   ReplicaSet); a new template's pods start next to the old ones, which go once all the new
//!   ones are ready.
//! - **kubelet**: every Pod's containers run as real processes (the workspace's binaries, named
//!   by the container's `command`) in a network namespace of the pod's own (`netns`), so each
//!   pod has its own IP and ports as in a cluster; the environment as Kubernetes builds it
//!   (`envFrom` ConfigMaps, `env` values with `$(VAR)` expansion, the downward API's
//!   `metadata.name`, `metadata.namespace`, `metadata.labels['..']`, `status.podIP`); volumes are
//!   directories (`emptyDir` per pod — under `/dev/shm` with `medium: Memory` —, a claim's
//!   directory kept while the claim exists, a `configMap`'s keys as files kept current) and a
//!   container's mount paths in its command and environment are rewritten to them (no mount
//!   namespaces); readiness from the `httpGet`/`tcpSocket` probes; exited containers restarted
//!   with a (scaled-down) CrashLoopBackOff; an image whose tag ends `-broken` — a failed
//!   release — runs as a container that exits at once;
//!   a deleted pod's containers get SIGTERM, then SIGKILL after its grace period (at most 10 s),
//!   before the pod object goes (a finalizer of the kubelet's holds it until then).
//! - **DNS**: `/etc/netns/NS/hosts` of every namespace (`ip netns exec` mounts it over
//!   `/etc/hosts`) names each pod with a hostname and subdomain
//!   (`POD.SUBDOMAIN.NAMESPACE.svc[.cluster.local]`) and each Service with a cluster IP (the
//!   first ready pod it selects: no kube-proxy).
//!
//! A hook sees every pod the StatefulSet controller is about to delete (a test checks what must
//! hold before a pod goes), and every deletion is recorded.

use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::apiserver::ApiServer;
use crate::procs::Proc;

/// The finalizer the kubelet puts on the pods it runs (removed once their processes ended).
pub const FINALIZER: &str = "e2e.dpukv.io/kubelet";

/// A pod's network: a namespace and its address.
#[derive(Debug, Clone)]
pub struct Slot {
    /// `ip netns` name.
    pub netns: String,
    /// The pod IP.
    pub ip: String,
}

/// What the kubelet runs with.
pub struct KubeletConfig {
    /// The namespaces pods run in (one pod each at a time).
    pub slots: Vec<Slot>,
    /// Other namespaces whose `/etc/netns/NS/hosts` the kubelet keeps (the operator's).
    pub dns_only: Vec<String>,
    /// Where the binaries are (`procs::bin_dir`).
    pub bins: PathBuf,
    /// Where volumes and logs go.
    pub root: PathBuf,
}

/// A pod a controller deleted, and why (StatefulSets: `ScaledIn`, `Updated`; Deployments:
/// `Replaced` by a new template's pod, `ScaledDown`).
#[derive(Debug, Clone)]
pub struct Deletion {
    /// Namespace/name.
    pub pod: String,
    /// Why.
    pub reason: &'static str,
}

type Hook = Box<dyn FnMut(&Value, &'static str) + Send>;

struct Shared {
    deletions: Vec<Deletion>,
    hook: Option<Hook>,
    /// Namespace/name of the pods whose processes run.
    running: Vec<String>,
    errors: Vec<String>,
}

/// The kubelet and controllers, on a thread of their own until dropped.
pub struct Kubelet {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Mutex<Shared>>,
    root: PathBuf,
    dns: Vec<PathBuf>,
    memory: PathBuf,
}

struct Container {
    name: String,
    spec: Value,
    proc: Option<Proc>,
    restarts: u32,
    /// Not restarted before this (CrashLoopBackOff).
    not_before: Instant,
    ready: bool,
    log: PathBuf,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
}

struct Running {
    uid: String,
    slot: usize,
    containers: Vec<Container>,
}

struct Loop {
    api: Arc<ApiServer>,
    cfg: KubeletConfig,
    shared: Arc<Mutex<Shared>>,
    pods: HashMap<String, Running>,
    /// Each StatefulSet revision's pod template.
    templates: HashMap<String, Value>,
    /// The slot each pod name had last.
    previous: HashMap<String, usize>,
    hosts: String,
    /// Where `emptyDir` volumes with `medium: Memory` go (a tmpfs: `/dev/shm`).
    memory: PathBuf,
}

/// The shared state, also after a panic elsewhere (the kubelet reports its own panics).
fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The flag a `-broken` image's container is started with (no binary takes it).
const BROKEN_FLAG: &str = "--this-image-is-broken";

/// The wait before restarting a container that exited `restarts` times (the kubelet's
/// CrashLoopBackOff, 10 s doubling to 5 min, scaled down to 100 ms doubling to 5 s).
fn crash_backoff(restarts: u32) -> Duration {
    Duration::from_millis(100u64 << restarts.min(6)).min(Duration::from_secs(5))
}

/// FNV-1a 64 of a value's JSON, as 10 hex digits (a revision's name).
fn hash(v: &Value) -> String {
    let json = serde_json::to_vec(v).unwrap_or_default();
    let h = json.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{:010x}", h & 0xff_ffff_ffff)
}

fn meta<'a>(o: &'a Value, field: &str) -> &'a str {
    o["metadata"][field].as_str().unwrap_or_default()
}

fn key(o: &Value) -> String {
    format!("{}/{}", meta(o, "namespace"), meta(o, "name"))
}

fn owned_by(o: &Value, uid: &str) -> bool {
    o["metadata"]["ownerReferences"].as_array().is_some_and(|r| r.iter().any(|r| r["uid"] == uid))
}

fn terminating(o: &Value) -> bool {
    !o["metadata"]["deletionTimestamp"].is_null()
}

fn pod_ready(o: &Value) -> bool {
    o["status"]["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

fn owner_ref(kind: &str, api_version: &str, o: &Value) -> Value {
    json!({"apiVersion": api_version, "kind": kind, "name": meta(o, "name"), "uid": meta(o, "uid"),
           "controller": true, "blockOwnerDeletion": true})
}

/// `$(VAR)` replaced by `env`'s value (unknown variables stay as written; `$$` is a `$`).
pub fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
            && let Some(v) = env.get(&inner[..end])
        {
            out.push_str(v);
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn field_ref(pod: &Value, path: &str, ip: &str) -> Result<String> {
    let label = |prefix: &str, map: &str| {
        path.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix("']"))
            .map(|k| pod["metadata"][map][k].as_str().unwrap_or_default().to_string())
    };
    Ok(match path {
        "metadata.name" | "metadata.namespace" | "metadata.uid" => meta(pod, &path[9..]).to_string(),
        "status.podIP" => ip.to_string(),
        "spec.nodeName" => pod["spec"]["nodeName"].as_str().unwrap_or("test-kubelet").to_string(),
        _ => label("metadata.labels['", "labels")
            .or_else(|| label("metadata.annotations['", "annotations"))
            .with_context(|| format!("the test kubelet does not support fieldRef {path}"))?,
    })
}

/// An HTTP GET answered with 2xx/3xx, or a TCP connection accepted.
fn probe(ip: &str, spec: &Value, container: &Value) -> bool {
    let port = |p: &Value| {
        p.as_i64().or_else(|| {
            let name = p.as_str()?;
            container["ports"].as_array()?.iter().find(|x| x["name"] == name)?["containerPort"].as_i64()
        })
    };
    let connect = |p: i64| {
        let addr: std::net::SocketAddr = format!("{ip}:{p}").parse().ok()?;
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()
    };
    if let Some(g) = spec.get("httpGet") {
        let Some(mut s) = port(&g["port"]).and_then(connect) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let path = g["path"].as_str().unwrap_or("/");
        if s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n").as_bytes()).is_err() {
            return false;
        }
        let mut head = [0u8; 12];
        return s.read_exact(&mut head).is_ok()
            && matches!(std::str::from_utf8(&head[9..12]).ok().and_then(|c| c.parse::<u16>().ok()), Some(200..=399));
    }
    if let Some(t) = spec.get("tcpSocket") {
        return port(&t["port"]).and_then(connect).is_some();
    }
    true
}

impl Loop {
    fn error(&self, e: String) {
        let mut s = lock(&self.shared);
        if s.errors.last() != Some(&e) {
            s.errors.push(e);
        }
    }

    fn tick(&mut self) {
        self.statefulsets();
        self.deployments();
        self.kubelet();
        self.claims();
        self.dns();
    }

    fn statefulsets(&mut self) {
        for set in self.api.list("statefulsets", None) {
            if terminating(&set) {
                continue;
            }
            if let Err(e) = self.statefulset(&set) {
                self.error(format!("statefulset {}: {e:#}", key(&set)));
            }
        }
    }

    fn statefulset(&mut self, set: &Value) -> Result<()> {
        let (ns, name, uid) = (meta(set, "namespace"), meta(set, "name"), meta(set, "uid"));
        let spec = &set["spec"];
        let replicas = spec["replicas"].as_i64().unwrap_or(1);
        let partition = spec["updateStrategy"]["rollingUpdate"]["partition"].as_i64().unwrap_or(0);
        let update = format!("{name}-{}", hash(&spec["template"]));
        // Each revision's template (Kubernetes keeps them as ControllerRevisions): a pod below
        // the partition is made again from the revision it runs, not from the new template.
        self.templates.entry(update.clone()).or_insert_with(|| spec["template"].clone());
        let current = set["status"]["currentRevision"].as_str().unwrap_or(&update).to_string();
        let pods: BTreeMap<i64, Value> = self
            .api
            .list("pods", Some(ns))
            .into_iter()
            .filter(|p| owned_by(p, uid))
            .filter_map(|p| Some((meta(&p, "name").strip_prefix(&format!("{name}-"))?.parse().ok()?, p)))
            .collect();
        let claims = spec["volumeClaimTemplates"].as_array().cloned().unwrap_or_default();
        let retention = &spec["persistentVolumeClaimRetentionPolicy"];
        // Scale-in: the highest ordinals go, then (whenScaled: Delete) their claims.
        for (&i, p) in pods.range(replicas..) {
            if !terminating(p) {
                self.delete_pod(p, "ScaledIn");
            }
            let _ = i;
        }
        if retention["whenScaled"] == "Delete" {
            for c in self.api.list("persistentvolumeclaims", Some(ns)) {
                let n = meta(&c, "name");
                let ordinal = claims
                    .iter()
                    .find_map(|t| n.strip_prefix(&format!("{}-{name}-", meta(t, "name")))?.parse::<i64>().ok());
                if ordinal.is_some_and(|o| o >= replicas && !pods.contains_key(&o)) && !terminating(&c) {
                    let _ = self.api.delete("persistentvolumeclaims", ns, n);
                }
            }
        }
        // Missing pods (and their claims).
        for i in 0..replicas {
            if pods.contains_key(&i) {
                continue;
            }
            let pod_name = format!("{name}-{i}");
            let rev = if i >= partition { &update } else { &current };
            let template = self.templates.get(rev).cloned().unwrap_or_else(|| spec["template"].clone());
            let mut volumes = template["spec"]["volumes"].as_array().cloned().unwrap_or_default();
            for t in &claims {
                let claim = format!("{}-{pod_name}", meta(t, "name"));
                if self.api.get("persistentvolumeclaims", ns, &claim).is_none() {
                    let mut c = json!({"metadata": {"name": claim, "labels": spec["selector"]["matchLabels"]},
                                       "spec": t["spec"], "status": {"phase": "Bound"}});
                    if retention["whenDeleted"] == "Delete" {
                        c["metadata"]["ownerReferences"] = json!([owner_ref("StatefulSet", "apps/v1", set)]);
                    }
                    self.api.create("persistentvolumeclaims", ns, c)?;
                }
                volumes.push(json!({"name": meta(t, "name"), "persistentVolumeClaim": {"claimName": claim}}));
            }
            let mut labels = template["metadata"]["labels"].clone();
            labels["apps.kubernetes.io/pod-index"] = json!(i.to_string());
            labels["statefulset.kubernetes.io/pod-name"] = json!(pod_name);
            labels["controller-revision-hash"] = json!(rev);
            let mut pod_spec = template["spec"].clone();
            pod_spec["volumes"] = json!(volumes);
            pod_spec["hostname"] = json!(pod_name);
            // The scheduler, as far as a scenario needs: with Node objects, pods go round-robin
            // over them by ordinal (spreading them over zones as the default constraint asks).
            let nodes: Vec<String> = self.api.list("nodes", None).iter().map(|n| meta(n, "name").to_string()).collect();
            if !nodes.is_empty() {
                pod_spec["nodeName"] = json!(nodes[i as usize % nodes.len()]);
            }
            pod_spec["subdomain"] = spec["serviceName"].clone();
            let pod = json!({
                "metadata": {"name": pod_name, "labels": labels,
                             "annotations": template["metadata"]["annotations"],
                             "ownerReferences": [owner_ref("StatefulSet", "apps/v1", set)],
                             "finalizers": [FINALIZER]},
                "spec": pod_spec,
                "status": {"phase": "Pending"},
            });
            self.api.create("pods", ns, pod)?;
        }
        // A rolling update as Kubernetes' StatefulSet controller makes it
        // (`updateStatefulSet`, `pkg/controller/statefulset/stateful_set_control.go`): from the
        // highest ordinal down to the partition, the first pod not on the update revision is
        // deleted — whether or not the others are ready —, and a pod on it that is not healthy
        // (running, ready, not terminating) stops the walk. Pods below the partition are never
        // touched: one broken there waits for ever (the operator lowers the partition to it).
        for i in (partition.clamp(0, replicas.max(0))..replicas.max(0)).rev() {
            // (A pod created in this pass is not healthy yet.)
            let Some(p) = pods.get(&i) else { break };
            if p["metadata"]["labels"]["controller-revision-hash"] != update.as_str() && !terminating(p) {
                self.delete_pod(p, "Updated");
                break;
            }
            if terminating(p) || !pod_ready(p) {
                break;
            }
        }
        // Status: as Kubernetes counts it, pods still terminating are among `replicas` (and
        // `readyReplicas` while ready) — they run until they are gone — but on no revision.
        let all: Vec<Value> = self.api.list("pods", Some(ns)).into_iter().filter(|p| owned_by(p, uid)).collect();
        let pods: Vec<&Value> = all.iter().filter(|p| !terminating(p)).collect();
        let on = |rev: &str| pods.iter().filter(|p| p["metadata"]["labels"]["controller-revision-hash"] == rev).count();
        let updated = on(&update) as i64;
        let current = if updated == replicas && pods.len() as i64 == replicas { update.clone() } else { current };
        let ready = all.iter().filter(|p| pod_ready(p)).count();
        let status = json!({
            "observedGeneration": set["metadata"]["generation"],
            "replicas": all.len(),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": on(&current),
            "updatedReplicas": updated,
            "currentRevision": current,
            "updateRevision": update,
        });
        self.api.mutate("statefulsets", ns, name, |o| o["status"] = status);
        Ok(())
    }

    fn delete_pod(&mut self, pod: &Value, reason: &'static str) {
        // The hook runs without the lock (a panicking hook must not poison it).
        let hook = lock(&self.shared).hook.take();
        if let Some(mut h) = hook {
            h(pod, reason);
            let mut s = lock(&self.shared);
            if s.hook.is_none() {
                s.hook = Some(h);
            }
        }
        lock(&self.shared).deletions.push(Deletion { pod: key(pod), reason });
        let _ = self.api.delete("pods", meta(pod, "namespace"), meta(pod, "name"));
    }

    fn deployments(&mut self) {
        for d in self.api.list("deployments", None) {
            if terminating(&d) {
                continue;
            }
            let (ns, name, uid) = (meta(&d, "namespace").to_string(), meta(&d, "name").to_string(), meta(&d, "uid"));
            let replicas = d["spec"]["replicas"].as_i64().unwrap_or(1);
            let rev = hash(&d["spec"]["template"]);
            let pods: Vec<Value> = self.api.list("pods", Some(&ns)).into_iter().filter(|p| owned_by(p, uid)).collect();
            // A rolling update (surge): the old pods go once the new ones are all ready.
            let new_ready = (0..replicas).all(|j| {
                pods.iter().any(|p| meta(p, "name") == format!("{name}-{rev}-{j}") && pod_ready(p) && !terminating(p))
            });
            for p in &pods {
                let index = meta(p, "name").rsplit('-').next().and_then(|i| i.parse::<i64>().ok()).unwrap_or(0);
                let old = p["metadata"]["labels"]["pod-template-hash"] != rev.as_str();
                if !terminating(p) && ((old && new_ready) || (!old && index >= replicas)) {
                    self.shared
                        .lock()
                        .expect("kubelet")
                        .deletions
                        .push(Deletion { pod: key(p), reason: if old { "Replaced" } else { "ScaledDown" } });
                    let _ = self.api.delete("pods", &ns, meta(p, "name"));
                }
            }
            for j in 0..replicas {
                let pod_name = format!("{name}-{rev}-{j}");
                if pods.iter().any(|p| meta(p, "name") == pod_name) {
                    continue;
                }
                let mut labels = d["spec"]["template"]["metadata"]["labels"].clone();
                labels["pod-template-hash"] = json!(rev);
                let pod = json!({
                    "metadata": {"name": pod_name, "labels": labels,
                                 "ownerReferences": [owner_ref("Deployment", "apps/v1", &d)],
                                 "finalizers": [FINALIZER]},
                    "spec": d["spec"]["template"]["spec"],
                    "status": {"phase": "Pending"},
                });
                if let Err(e) = self.api.create("pods", &ns, pod) {
                    self.error(format!("deployment {ns}/{name}: {e}"));
                }
            }
            let pods: Vec<Value> =
                self.api.list("pods", Some(&ns)).into_iter().filter(|p| owned_by(p, uid) && !terminating(p)).collect();
            let ready = pods.iter().filter(|p| pod_ready(p)).count();
            let updated = pods.iter().filter(|p| p["metadata"]["labels"]["pod-template-hash"] == rev.as_str()).count();
            let status = json!({"observedGeneration": d["metadata"]["generation"], "replicas": pods.len(),
                                "readyReplicas": ready, "availableReplicas": ready, "updatedReplicas": updated});
            self.api.mutate("deployments", &ns, &name, |o| o["status"] = status);
        }
    }

    fn kubelet(&mut self) {
        let pods = self.api.list("pods", None);
        let live: std::collections::HashSet<String> = pods.iter().map(|p| meta(p, "uid").to_string()).collect();
        // Pods gone from the API (not through the kubelet's finalizer): stop them.
        let gone: Vec<String> =
            self.pods.iter().filter(|(_, r)| !live.contains(&r.uid)).map(|(k, _)| k.clone()).collect();
        for k in gone {
            if let Some(r) = self.pods.remove(&k) {
                self.stop(r, 0);
            }
        }
        for pod in pods {
            let k = key(&pod);
            let uid = meta(&pod, "uid").to_string();
            if self.pods.get(&k).is_some_and(|r| r.uid != uid) {
                // Same name, a new pod: the old one's processes go first.
                if let Some(r) = self.pods.remove(&k) {
                    self.stop(r, 0);
                }
            }
            if terminating(&pod) {
                if let Some(r) = self.pods.remove(&k) {
                    let grace = pod["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap_or(30).min(10);
                    self.stop(r, grace);
                }
                self.api.mutate("pods", meta(&pod, "namespace"), meta(&pod, "name"), |o| {
                    if let Some(f) = o["metadata"]["finalizers"].as_array_mut() {
                        f.retain(|f| f != FINALIZER);
                    }
                });
                continue;
            }
            if !self.pods.contains_key(&k) {
                match self.start(&pod) {
                    Ok(r) => {
                        self.pods.insert(k.clone(), r);
                    }
                    Err(e) => {
                        self.error(format!("pod {k}: {e:#}"));
                        continue;
                    }
                }
            }
            self.refresh_config_maps(&pod);
            self.watch_over(&pod);
        }
        let mut s = lock(&self.shared);
        s.running = self.pods.keys().cloned().collect();
    }

    /// A configMap volume's files: one per key (as the kubelet projects them; kept current by
    /// [`Loop::refresh_config_maps`]). A missing ConfigMap is an error unless `optional` (then
    /// the directory is empty).
    fn project_config_map(&self, pod: &Value, v: &Value, dir: &Path) -> Result<()> {
        let cm_name = v["configMap"]["name"].as_str().unwrap_or_default();
        std::fs::create_dir_all(dir)?;
        let data = match self.api.get("configmaps", meta(pod, "namespace"), cm_name) {
            Some(cm) => cm["data"].as_object().cloned().unwrap_or_default(),
            None if v["configMap"]["optional"] == true => Default::default(),
            None => bail!("configMap volume: ConfigMap {cm_name} not found"),
        };
        for (k, val) in &data {
            let text = val.as_str().unwrap_or_default();
            let file = dir.join(k);
            if std::fs::read_to_string(&file).ok().as_deref() != Some(text) {
                // Whole files only (the kubelet swaps a directory of them atomically).
                let tmp = dir.join(format!(".{k}.tmp"));
                std::fs::write(&tmp, text)?;
                std::fs::rename(&tmp, &file)?;
            }
        }
        for e in std::fs::read_dir(dir)?.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if !n.starts_with('.') && !data.contains_key(&n) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(())
    }

    /// Brings every running pod's configMap volumes up to date with their ConfigMaps.
    fn refresh_config_maps(&self, pod: &Value) {
        for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
            if v.get("configMap").is_some() {
                let dir =
                    self.cfg.root.join("pods").join(meta(pod, "uid")).join(v["name"].as_str().unwrap_or_default());
                if let Err(e) = self.project_config_map(pod, v, &dir) {
                    self.error(format!("pod {}: {e:#}", key(pod)));
                }
            }
        }
    }

    fn volumes(&self, pod: &Value) -> Result<BTreeMap<String, PathBuf>> {
        let mut out = BTreeMap::new();
        for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
            let name = v["name"].as_str().unwrap_or_default();
            let dir = if v["emptyDir"]["medium"] == "Memory" {
                self.memory.join(meta(pod, "uid")).join(name)
            } else if v.get("emptyDir").is_some() {
                self.cfg.root.join("pods").join(meta(pod, "uid")).join(name)
            } else if let Some(claim) = v["persistentVolumeClaim"]["claimName"].as_str() {
                self.cfg.root.join("claims").join(meta(pod, "namespace")).join(claim)
            } else if v.get("configMap").is_some() {
                let dir = self.cfg.root.join("pods").join(meta(pod, "uid")).join(name);
                self.project_config_map(pod, v, &dir)?;
                dir
            } else {
                bail!(
                    "volume {name}: the test kubelet supports emptyDir, persistentVolumeClaim and configMap volumes only"
                );
            };
            std::fs::create_dir_all(&dir)?;
            out.insert(name.to_string(), dir);
        }
        Ok(out)
    }

    fn start(&mut self, pod: &Value) -> Result<Running> {
        let used: Vec<usize> = self.pods.values().map(|r| r.slot).collect();
        let free = |i: &usize| !used.contains(i);
        // A pod that comes back under its old name gets another address, as with most network
        // plugins: whatever cached the old one must find the new one by name.
        let previous = self.previous.get(meta(pod, "name")).copied();
        let slot = (0..self.cfg.slots.len())
            .filter(free)
            .find(|i| Some(*i) != previous)
            .or(previous.filter(free))
            .context("no free pod slot (network namespace) left")?;
        let ip = self.cfg.slots[slot].ip.clone();
        let volumes = self.volumes(pod)?;
        let ns = meta(pod, "namespace");
        let mut containers = Vec::new();
        for c in pod["spec"]["containers"].as_array().into_iter().flatten() {
            let cname = c["name"].as_str().unwrap_or_default().to_string();
            let mut env = BTreeMap::new();
            for from in c["envFrom"].as_array().into_iter().flatten() {
                let Some(cm) = from["configMapRef"]["name"].as_str() else {
                    bail!("container {cname}: envFrom supports configMapRef only");
                };
                let Some(map) = self.api.get("configmaps", ns, cm) else {
                    bail!("container {cname}: ConfigMap {cm} not found (CreateContainerConfigError)");
                };
                let prefix = from["prefix"].as_str().unwrap_or_default();
                for (k, v) in map["data"].as_object().into_iter().flatten() {
                    env.insert(format!("{prefix}{k}"), v.as_str().unwrap_or_default().to_string());
                }
            }
            for e in c["env"].as_array().into_iter().flatten() {
                let name = e["name"].as_str().unwrap_or_default().to_string();
                let value = if let Some(v) = e["value"].as_str() {
                    expand(v, &env)
                } else if let Some(path) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                    field_ref(pod, path, &ip)?
                } else if e.get("valueFrom").is_some() {
                    bail!("container {cname}: env {name}: only fieldRef values are supported");
                } else {
                    String::new()
                };
                env.insert(name, value);
            }
            let mut mounts: Vec<(String, PathBuf)> = c["volumeMounts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| Some((m["mountPath"].as_str()?.to_string(), volumes.get(m["name"].as_str()?)?.clone())))
                .collect();
            mounts.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
            let translate = |s: String| {
                for (mp, dir) in &mounts {
                    if s == *mp {
                        return dir.display().to_string();
                    }
                    if let Some(rest) = s.strip_prefix(&format!("{mp}/")) {
                        return dir.join(rest).display().to_string();
                    }
                }
                s
            };
            let env: BTreeMap<String, String> = env.into_iter().map(|(k, v)| (k, translate(v))).collect();
            let argv: Vec<String> = c["command"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(c["args"].as_array().into_iter().flatten())
                .map(|a| translate(expand(a.as_str().unwrap_or_default(), &env)))
                .collect();
            let log = self.cfg.root.join("logs").join(format!("{ns}_{}_{cname}.log", meta(pod, "name")));
            containers.push(Container {
                name: cname,
                spec: c.clone(),
                proc: None,
                restarts: 0,
                not_before: Instant::now(),
                ready: false,
                log,
                argv,
                env,
            });
        }
        let mut r = Running { uid: meta(pod, "uid").to_string(), slot, containers };
        for c in &mut r.containers {
            c.proc = Some(self.spawn(slot, c)?);
        }
        self.previous.insert(meta(pod, "name").to_string(), slot);
        let now = crate::apiserver::timestamp(std::time::SystemTime::now());
        self.api.mutate("pods", ns, meta(pod, "name"), |o| {
            o["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip,
                                 "startTime": now,
                                 "conditions": [{"type": "Ready", "status": "False"}]});
        });
        self.dns();
        Ok(r)
    }

    fn spawn(&self, slot: usize, c: &Container) -> Result<Proc> {
        let Some((program, args)) = c.argv.split_first() else { bail!("container {}: no command", c.name) };
        // A failed release: an image whose tag ends `-broken` runs as a container that exits at
        // once (its binary refusing an unknown flag) — CrashLoopBackOff, never ready.
        let broken = [BROKEN_FLAG.to_string()];
        let args = if c.spec["image"].as_str().is_some_and(|i| i.ends_with("-broken")) { &broken[..] } else { args };
        let bin = self.cfg.bins.join(program);
        if !bin.exists() {
            bail!("container {}: {program} is not one of the workspace's binaries", c.name);
        }
        std::fs::create_dir_all(c.log.parent().unwrap_or(Path::new(".")))?;
        let log = OpenOptions::new().create(true).append(true).open(&c.log)?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.cfg.slots[slot].netns])
            .arg(&bin)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .envs(&c.env)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {program}"))?;
        Ok(Proc(child))
    }

    /// Restarts exited containers and reports readiness.
    fn watch_over(&mut self, pod: &Value) {
        let k = key(pod);
        let Some(mut r) = self.pods.remove(&k) else { return };
        let ip = self.cfg.slots[r.slot].ip.clone();
        for c in &mut r.containers {
            let exited = c.proc.as_mut().is_none_or(|p| !matches!(p.0.try_wait(), Ok(None)));
            if exited {
                c.ready = false;
                if Instant::now() < c.not_before {
                    // CrashLoopBackOff (the kubelet's 10 s doubling to 5 min, scaled down).
                    continue;
                }
                c.restarts += 1;
                c.not_before = Instant::now() + crash_backoff(c.restarts);
                if let Ok(mut f) = OpenOptions::new().append(true).open(&c.log) {
                    let _ = writeln!(f, "--- test kubelet: container exited; restart {}", c.restarts);
                }
                c.proc = self.spawn(r.slot, c).ok();
                continue;
            }
            c.ready = match c.spec.get("readinessProbe") {
                Some(p) => probe(&ip, p, &c.spec),
                None => true,
            };
        }
        let ready = r.containers.iter().all(|c| c.ready);
        let statuses: Vec<Value> = r
            .containers
            .iter()
            .map(|c| json!({"name": c.name, "ready": c.ready, "restartCount": c.restarts, "started": true}))
            .collect();
        self.api.mutate("pods", meta(pod, "namespace"), meta(pod, "name"), |o| {
            o["status"]["conditions"] = json!([{"type": "Ready", "status": if ready { "True" } else { "False" }}]);
            o["status"]["containerStatuses"] = json!(statuses);
        });
        self.pods.insert(k, r);
    }

    /// SIGTERM to every container, SIGKILL after `grace` seconds.
    fn stop(&self, mut r: Running, grace: u64) {
        for c in &r.containers {
            if let Some(p) = &c.proc {
                let _ = Command::new("kill").args(["-TERM", &p.0.id().to_string()]).status();
            }
        }
        let deadline = Instant::now() + Duration::from_secs(grace);
        while Instant::now() < deadline
            && r.containers.iter_mut().any(|c| c.proc.as_mut().is_some_and(|p| matches!(p.0.try_wait(), Ok(None))))
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let uid = r.uid.clone();
        drop(r);
        // The pod's emptyDir volumes go with it (claims stay while their claim does).
        let _ = std::fs::remove_dir_all(self.memory.join(&uid));
        let _ = std::fs::remove_dir_all(self.cfg.root.join("pods").join(&uid));
    }

    /// Claims gone from the API lose their directories (a provisioner's `Delete` reclaim).
    fn claims(&mut self) {
        let dir = self.cfg.root.join("claims");
        let Ok(namespaces) = std::fs::read_dir(&dir) else { return };
        for ns in namespaces.flatten() {
            let Ok(claims) = std::fs::read_dir(ns.path()) else { continue };
            for c in claims.flatten() {
                let (n, name) =
                    (ns.file_name().to_string_lossy().to_string(), c.file_name().to_string_lossy().to_string());
                if self.api.get("persistentvolumeclaims", &n, &name).is_none() {
                    let _ = std::fs::remove_dir_all(c.path());
                }
            }
        }
    }

    fn dns(&mut self) {
        let pods = self.api.list("pods", None);
        let mut lines = vec!["127.0.0.1 localhost".to_string(), "::1 localhost".to_string()];
        for p in &pods {
            let (Some(ip), Some(h), Some(sub)) =
                (p["status"]["podIP"].as_str(), p["spec"]["hostname"].as_str(), p["spec"]["subdomain"].as_str())
            else {
                continue;
            };
            let ns = meta(p, "namespace");
            lines.push(format!("{ip} {h}.{sub}.{ns}.svc {h}.{sub}.{ns}.svc.cluster.local"));
        }
        for s in self.api.list("services", None) {
            let Some(sel) = s["spec"]["selector"].as_object() else { continue };
            if s["spec"]["clusterIP"] == "None" {
                continue;
            }
            let ns = meta(&s, "namespace");
            let target = pods.iter().find(|p| {
                meta(p, "namespace") == ns && pod_ready(p) && sel.iter().all(|(k, v)| &p["metadata"]["labels"][k] == v)
            });
            if let Some(ip) = target.and_then(|p| p["status"]["podIP"].as_str()) {
                let n = meta(&s, "name");
                lines.push(format!("{ip} {n}.{ns}.svc {n}.{ns}.svc.cluster.local"));
            }
        }
        let hosts = lines.join("\n") + "\n";
        if hosts == self.hosts {
            return;
        }
        for ns in self.cfg.slots.iter().map(|s| &s.netns).chain(&self.cfg.dns_only) {
            // Written in place: the namespaces' processes have this very file mounted.
            let _ = std::fs::write(Path::new("/etc/netns").join(ns).join("hosts"), &hosts);
        }
        self.hosts = hosts;
    }
}

impl Kubelet {
    /// Starts the kubelet and controllers over `api`.
    pub fn start(api: Arc<ApiServer>, cfg: KubeletConfig) -> Result<Kubelet> {
        let mut dns = Vec::new();
        for ns in cfg.slots.iter().map(|s| &s.netns).chain(&cfg.dns_only) {
            let dir = Path::new("/etc/netns").join(ns);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::write(dir.join("hosts"), "127.0.0.1 localhost\n")?;
            dns.push(dir);
        }
        let shared =
            Arc::new(Mutex::new(Shared { deletions: Vec::new(), hook: None, running: Vec::new(), errors: Vec::new() }));
        let stop = Arc::new(AtomicBool::new(false));
        let root = cfg.root.clone();
        let memory = Path::new("/dev/shm").join(format!(
            "dpukv-kubelet-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos()
        ));
        let mut l = Loop {
            api,
            cfg,
            shared: shared.clone(),
            pods: HashMap::new(),
            previous: HashMap::new(),
            templates: HashMap::new(),
            hosts: String::new(),
            memory: memory.clone(),
        };
        let halt = stop.clone();
        let thread = std::thread::Builder::new().name("kubelet".into()).spawn(move || {
            while !halt.load(Ordering::Acquire) {
                // A bug here must show in the test's report, not stop every pod's care silently.
                if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.tick())) {
                    let what =
                        p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                    l.error(format!("the kubelet panicked: {}", what.unwrap_or_default()));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            for (_, r) in l.pods.drain() {
                drop(r);
            }
        })?;
        Ok(Kubelet { stop, thread: Some(thread), shared, root, dns, memory })
    }

    /// Called with every pod the StatefulSet controller is about to delete, and why.
    pub fn before_delete(&self, hook: impl FnMut(&Value, &'static str) + Send + 'static) {
        lock(&self.shared).hook = Some(Box::new(hook));
    }

    /// The pods the controllers deleted.
    pub fn deletions(&self) -> Vec<Deletion> {
        lock(&self.shared).deletions.clone()
    }

    /// Namespace/name of the pods whose processes run.
    pub fn running(&self) -> Vec<String> {
        lock(&self.shared).running.clone()
    }

    /// What failed (a pod that could not start, a controller error), oldest first.
    pub fn errors(&self) -> Vec<String> {
        lock(&self.shared).errors.clone()
    }

    /// The log of one container of a pod (every life of it: restarts append).
    pub fn container_log(&self, namespace: &str, pod: &str, container: &str) -> String {
        let f = self.root.join("logs").join(format!("{namespace}_{pod}_{container}.log"));
        String::from_utf8_lossy(&std::fs::read(f).unwrap_or_default()).into_owned()
    }

    /// Every container's log (the last `tail` bytes of each), for a failing test to print.
    pub fn logs(&self, tail: usize) -> String {
        let mut out = String::new();
        let Ok(files) = std::fs::read_dir(self.root.join("logs")) else { return out };
        let mut files: Vec<_> = files.flatten().map(|f| f.path()).collect();
        files.sort();
        for f in files {
            let text = std::fs::read(&f).unwrap_or_default();
            let text = String::from_utf8_lossy(&text[text.len().saturating_sub(tail)..]).to_string();
            out.push_str(&format!("==> {} <==\n{text}\n", f.display()));
        }
        out
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for d in self.dns.iter().chain([&self.memory]) {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_expand_as_kubernetes_does() {
        let env = BTreeMap::from([("POD_NAME".to_string(), "demo-node-1".to_string())]);
        assert_eq!(expand("$(POD_NAME).demo-node.db.svc:7070", &env), "demo-node-1.demo-node.db.svc:7070");
        assert_eq!(expand("$(MISSING) $$(POD_NAME) $", &env), "$(MISSING) $(POD_NAME) $");
    }
}
