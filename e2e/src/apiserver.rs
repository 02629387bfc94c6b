//! A test double of the Kubernetes API server for the kinds dpukv's operator uses, speaking the
//! real REST and watch protocol over HTTP/1.1, so the real `dpukv-operator` binary (kube-rs) runs
//! against it through a kubeconfig. No kube-apiserver can be installed here; this is the part of
//! one the scenario needs:
//!
//! - paths `/api/v1/...` and `/apis/GROUP/VERSION/...`, namespaced and across namespaces, for the
//!   resources in [`RESOURCES`] (anything else: 404 `NotFound`);
//! - `GET` (one object; a list with `labelSelector`/`fieldSelector` equality terms; `watch=true`
//!   streams `{"type","object"}` lines from a `resourceVersion`, 410 `Expired` when it is older
//!   than the retained changes; a selector watch gets `DELETED` for an object that stops
//!   matching and `ADDED` for one that starts), `POST` (create, `generateName`, 409
//!   `AlreadyExists`), `PUT` (replace), `PATCH` (server-side apply — creates when absent —, JSON
//!   merge patch and JSON patch), `DELETE` (with `DeleteOptions`);
//! - optimistic concurrency on every write path: a `metadata.resourceVersion` sent with a PUT,
//!   set by a patch (merge, JSON, apply) or given in a DELETE's `preconditions` (with `uid`) must
//!   be the live object's, else 409 `Conflict` in the real server's words;
//! - one global, increasing `resourceVersion`; `uid`, `creationTimestamp`, `generation` (bumped
//!   when anything but metadata and status changes); a status subresource (`.../status`) for the
//!   kinds that have one — writes to the main resource keep the status, writes to `/status`
//!   change nothing else;
//! - deletion as Kubernetes does it: an object with finalizers gets a `deletionTimestamp` and
//!   goes when the last finalizer is removed; then the garbage collector deletes every object
//!   whose owner references name it ([`Propagation`]: background by default; foreground keeps
//!   the owner with finalizer `foregroundDeletion` until every dependent with
//!   `blockOwnerDeletion` is gone; orphan drops the dependents' references);
//! - custom resources admitted by their CRD: once a `CustomResourceDefinition` is created, its
//!   resources are pruned, defaulted and validated on every create and update, status included,
//!   CEL rules and all (`crd_schema`); a CRD whose schema or rules the double cannot hold is
//!   refused (422);
//! - Pod Security admission at level `restricted` in the namespaces a test names
//!   ([`ApiServer::enforce_restricted`]; pods that violate it: 403 with the admission's words);
//! - validation of updates where the real one refuses them (422 `Invalid`, its messages):
//!   immutable StatefulSet spec fields, claims' specs (but their storage request, which only
//!   grows), a Service's `clusterIP`.
//!
//! Simplifications, on purpose: a server-side apply merges the applied object into the live one
//! (maps key by key, lists replaced whole) instead of tracking field ownership per manager — the
//! operator is the only manager of what it applies; no other admission and no schema for the
//! built-in kinds; no authentication. Changes kept for watches are bounded ([`MAX_CHANGES`]).
//!
//! The test reads and writes objects in process ([`ApiServer::get`], [`ApiServer::create`],
//! [`ApiServer::mutate`], ...), as the test kubelet (`kubelet`) does; `mutate` is the test's own
//! hand and skips admission.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use serde_json::{Value, json};

use crate::crd_schema::{self, CrdSchema, Quantity};

/// How many changes are kept for watches to resume from.
pub const MAX_CHANGES: usize = 100_000;

/// A resource the double serves.
#[derive(Debug, Clone, Copy)]
pub struct Resource {
    /// API group ("" for core).
    pub group: &'static str,
    /// Version.
    pub version: &'static str,
    /// Plural (the path segment; unique here).
    pub plural: &'static str,
    /// Kind.
    pub kind: &'static str,
    /// Namespaced (else cluster-scoped).
    pub namespaced: bool,
    /// Has a status subresource.
    pub status: bool,
}

const fn r(
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    status: bool,
) -> Resource {
    Resource { group, version, plural, kind, namespaced, status }
}

/// What the double serves.
pub const RESOURCES: &[Resource] = &[
    r("", "v1", "pods", "Pod", true, true),
    r("", "v1", "services", "Service", true, true),
    r("", "v1", "configmaps", "ConfigMap", true, false),
    r("", "v1", "secrets", "Secret", true, false),
    r("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", true, true),
    r("", "v1", "nodes", "Node", false, true),
    r("apps", "v1", "statefulsets", "StatefulSet", true, true),
    r("apps", "v1", "deployments", "Deployment", true, true),
    r("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", true, true),
    r("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", true, false),
    r("coordination.k8s.io", "v1", "leases", "Lease", true, false),
    r("events.k8s.io", "v1", "events", "Event", true, false),
    r("dpukv.io", "v1alpha1", "dpukvclusters", "DpuKvCluster", true, true),
    r("dpukv.io", "v1alpha1", "dpukvoperations", "DpuKvOperation", true, true),
    r("dpukv.io", "v1alpha1", "dpukvbackups", "DpuKvBackup", true, true),
    r("dpukv.io", "v1alpha1", "dpukvbackupschedules", "DpuKvBackupSchedule", true, true),
    r("dpukv.io", "v1alpha1", "dpukvrestores", "DpuKvRestore", true, true),
    r("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", false, true),
];

/// The plural of CRDs: creating one makes the double admit its custom resources by its schema.
const CRDS: &str = "customresourcedefinitions";

/// The resource named `plural`, or 404.
fn known(plural: &str) -> Result<&'static Resource, ApiError> {
    resource(plural).ok_or_else(|| err(404, "NotFound", format!("the server could not find the resource {plural}")))
}

/// The resource named `plural`.
pub fn resource(plural: &str) -> Option<&'static Resource> {
    RESOURCES.iter().find(|r| r.plural == plural)
}

impl Resource {
    fn api_version(&self) -> String {
        if self.group.is_empty() { self.version.to_string() } else { format!("{}/{}", self.group, self.version) }
    }
}

/// An object's place: (plural, namespace — "" when cluster-scoped —, name).
type Key = (String, String, String);

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    plural: String,
    namespace: String,
    type_: &'static str,
    object: Value,
    /// The object before a `MODIFIED` change (a selector watch turns a change that makes it stop
    /// or start matching into `DELETED` or `ADDED`).
    previous: Option<Value>,
}

#[derive(Debug, Default)]
struct Store {
    rv: u64,
    uids: u64,
    objects: BTreeMap<Key, Value>,
    changes: std::collections::VecDeque<Change>,
    /// Changes up to this resourceVersion are no longer kept (a watch from before: 410).
    expired_through: u64,
    /// Requests served: "METHOD path?query" (bounded like the changes).
    requests: std::collections::VecDeque<String>,
    /// Namespaces whose pods must pass Pod Security `restricted` (`enforce` label).
    restricted: std::collections::BTreeSet<String>,
    /// The schemas of the CRDs created, by the plural they define.
    crds: BTreeMap<String, Arc<CrdSchema>>,
}

/// How a deletion treats the objects the deleted one owns (`DeleteOptions.propagationPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    /// The owner goes at once; the garbage collector deletes what it owned afterwards.
    Background,
    /// The owner stays (`deletionTimestamp`, finalizer `foregroundDeletion`) until every object
    /// it owns with `blockOwnerDeletion` is gone.
    Foreground,
    /// What it owned stays, its owner reference to it removed.
    Orphan,
}

impl Propagation {
    /// From a `DeleteOptions` body or the `propagationPolicy` query parameter.
    fn from_options(body: &Value, q: &BTreeMap<String, String>) -> Result<Propagation, ApiError> {
        let policy = body["propagationPolicy"].as_str().or_else(|| q.get("propagationPolicy").map(String::as_str));
        let orphan = body["orphanDependents"] == true || q.get("orphanDependents").is_some_and(|v| v == "true");
        match (policy, orphan) {
            (Some("Foreground"), _) => Ok(Propagation::Foreground),
            (Some("Orphan"), _) | (None, true) => Ok(Propagation::Orphan),
            (Some("Background") | None, _) => Ok(Propagation::Background),
            (Some(other), _) => Err(err(
                422,
                "Invalid",
                format!(
                    "propagationPolicy: Unsupported value: {other:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
                ),
            )),
        }
    }
}

/// The finalizer a foreground deletion puts on the owner.
const FOREGROUND: &str = "foregroundDeletion";

/// The 409 the real API server answers a write whose precondition (`resourceVersion`) is stale.
fn conflict(res: &Resource, name: &str, why: &str) -> ApiError {
    let what = if res.group.is_empty() { res.plural.to_string() } else { format!("{}.{}", res.plural, res.group) };
    err(409, "Conflict", format!("Operation cannot be fulfilled on {what} {name:?}: {why}"))
}

const MODIFIED_SINCE: &str =
    "the object has been modified; please apply your changes to the latest version and try again";

/// The volume types Pod Security `restricted` allows.
const RESTRICTED_VOLUMES: &[&str] =
    &["configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"];

/// What Pod Security admission at level `restricted` (latest) finds wrong with a pod, in its
/// words (https://kubernetes.io/docs/concepts/security/pod-security-standards/): the baseline
/// controls (host namespaces, privileged, capabilities beyond the default set, host paths and
/// ports) and the restricted ones (volume types, privilege escalation, non-root, seccomp,
/// capabilities dropped to ALL, only NET_BIND_SERVICE added).
pub fn restricted_violations(pod: &Value) -> Vec<String> {
    let spec = &pod["spec"];
    let psc = &spec["securityContext"];
    let mut out = Vec::new();
    for f in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[f] == true {
            out.push(format!("host namespaces ({f}=true)"));
        }
    }
    let containers: Vec<&Value> = ["initContainers", "containers", "ephemeralContainers"]
        .iter()
        .flat_map(|k| spec[*k].as_array().map(|a| a.iter().collect::<Vec<_>>()).unwrap_or_default())
        .collect();
    let name = |c: &Value| c["name"].as_str().unwrap_or_default().to_string();
    for c in &containers {
        let sc = &c["securityContext"];
        if sc["privileged"] == true {
            out.push(format!("privileged (container {:?} must not set securityContext.privileged=true)", name(c)));
        }
        if sc["allowPrivilegeEscalation"] != false {
            out.push(format!(
                "allowPrivilegeEscalation != false (container {:?} must set securityContext.allowPrivilegeEscalation=false)",
                name(c)
            ));
        }
        let drops = sc["capabilities"]["drop"].as_array().is_some_and(|d| d.iter().any(|x| x == "ALL"));
        if !drops {
            out.push(format!(
                "unrestricted capabilities (container {:?} must set securityContext.capabilities.drop=[\"ALL\"])",
                name(c)
            ));
        }
        if let Some(add) = sc["capabilities"]["add"].as_array()
            && add.iter().any(|x| x != "NET_BIND_SERVICE")
        {
            out.push(format!("unrestricted capabilities (container {:?} must not include {add:?} in securityContext.capabilities.add)", name(c)));
        }
        let non_root = sc["runAsNonRoot"] == true || (sc["runAsNonRoot"].is_null() && psc["runAsNonRoot"] == true);
        if !non_root {
            out.push(format!(
                "runAsNonRoot != true (container {:?} must set securityContext.runAsNonRoot=true)",
                name(c)
            ));
        }
        if sc["runAsUser"] == 0 || (sc["runAsUser"].is_null() && psc["runAsUser"] == 0) {
            out.push(format!("runAsUser=0 (container {:?} must not set runAsUser=0)", name(c)));
        }
        let seccomp = |v: &Value| matches!(v["seccompProfile"]["type"].as_str(), Some("RuntimeDefault" | "Localhost"));
        if !(seccomp(sc) || (sc["seccompProfile"].is_null() && seccomp(psc))) {
            out.push(format!(
                "seccompProfile (container {:?} must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")",
                name(c)
            ));
        }
        for p in c["ports"].as_array().into_iter().flatten() {
            if p["hostPort"].as_i64().unwrap_or(0) != 0 {
                out.push(format!("hostPort (container {:?} uses hostPort {})", name(c), p["hostPort"]));
            }
        }
    }
    for v in spec["volumes"].as_array().into_iter().flatten() {
        let kind = v.as_object().and_then(|o| o.keys().find(|k| *k != "name").cloned()).unwrap_or_default();
        if !RESTRICTED_VOLUMES.contains(&kind.as_str()) {
            out.push(format!("restricted volume types (volume {:?} uses restricted volume type {kind:?})", v["name"]));
        }
    }
    out
}

struct Shared {
    store: Mutex<Store>,
    changed: tokio::sync::watch::Sender<u64>,
}

/// An API-server error: an HTTP status and a Kubernetes `Status` reason.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Invalid`, `BadRequest`, `Expired`,
    /// `MethodNotAllowed`.
    pub reason: &'static str,
    /// What.
    pub message: String,
}

fn err(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError { code, reason, message: message.into() }
}

/// `now` as RFC 3339 (UTC, seconds).
pub fn timestamp(now: SystemTime) -> String {
    let secs = now.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Maps merged key by key (`null` in `patch` removes), everything else replaced: RFC 7386.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (_, Some(p)) => {
            *target = Value::Object(Default::default());
            merge_patch(target, &Value::Object(p.clone()));
        }
        _ => *target = patch.clone(),
    }
}

/// The applied object merged into the live one: maps key by key, lists and scalars replaced
/// (see the module documentation for how this differs from field ownership).
fn apply_merge(target: &mut Value, applied: &Value) {
    match (target.as_object_mut(), applied.as_object()) {
        (Some(t), Some(a)) => {
            for (k, v) in a {
                apply_merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        _ => *target = applied.clone(),
    }
}

fn pointer_parts(path: &str) -> Result<Vec<String>, ApiError> {
    let rest = path.strip_prefix('/').ok_or_else(|| err(422, "Invalid", format!("bad JSON pointer {path:?}")))?;
    Ok(rest.split('/').map(|p| p.replace("~1", "/").replace("~0", "~")).collect())
}

/// RFC 6902 `add`, `remove`, `replace` and `test` (`move`/`copy`: 422); `test` of a missing
/// member against `null` passes, as in Kubernetes.
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<(), ApiError> {
    let ops = ops.as_array().ok_or_else(|| err(400, "BadRequest", "a JSON patch is an array"))?;
    for op in ops {
        let kind = op["op"].as_str().unwrap_or_default();
        let path = op["path"].as_str().unwrap_or_default();
        let mut parts = pointer_parts(path)?;
        let last = parts.pop().ok_or_else(|| err(422, "Invalid", "empty path"))?;
        let mut parent = &mut *target;
        for p in &parts {
            parent = match parent {
                Value::Object(m) => m.get_mut(p),
                Value::Array(a) => p.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
                _ => None,
            }
            .ok_or_else(|| err(422, "Invalid", format!("{path}: no such location")))?;
        }
        let missing = || err(422, "Invalid", format!("{kind} {path}: no such location"));
        match kind {
            "test" => {
                let found = match &*parent {
                    Value::Object(m) => m.get(&last),
                    Value::Array(a) => last.parse::<usize>().ok().and_then(|i| a.get(i)),
                    _ => None,
                };
                // As the API server's JSON patch library does: a missing member tests as null
                // (kube's finalizer helper relies on it).
                if found.unwrap_or(&Value::Null) != &op["value"] {
                    return Err(err(422, "Invalid", format!("test {path} failed")));
                }
            }
            "add" | "replace" => {
                let value = op["value"].clone();
                match parent {
                    Value::Object(m) => {
                        if kind == "replace" && !m.contains_key(&last) {
                            return Err(missing());
                        }
                        m.insert(last, value);
                    }
                    Value::Array(a) if last == "-" && kind == "add" => a.push(value),
                    Value::Array(a) => {
                        let i = last.parse::<usize>().map_err(|_| missing())?;
                        if kind == "add" && i <= a.len() {
                            a.insert(i, value);
                        } else if kind == "replace" && i < a.len() {
                            a[i] = value;
                        } else {
                            return Err(missing());
                        }
                    }
                    _ => return Err(missing()),
                }
            }
            "remove" => match parent {
                Value::Object(m) => {
                    m.remove(&last).ok_or_else(missing)?;
                }
                Value::Array(a) => {
                    let i = last.parse::<usize>().map_err(|_| missing())?;
                    if i >= a.len() {
                        return Err(missing());
                    }
                    a.remove(i);
                }
                _ => return Err(missing()),
            },
            other => return Err(err(422, "Invalid", format!("JSON patch op {other:?} is not supported"))),
        }
    }
    Ok(())
}

/// A label selector's terms: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`.
pub fn labels_match(selector: &str, labels: &Value) -> bool {
    let get = |k: &str| labels.get(k).and_then(Value::as_str);
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in selector.char_indices() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms.into_iter().map(str::trim).filter(|t| !t.is_empty()).all(|t| {
        if let Some((k, v)) = t.split_once("!=") {
            get(k.trim()) != Some(v.trim())
        } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
            get(k.trim()) == Some(v.trim())
        } else if let Some((k, set)) = t.split_once(" notin ") {
            let set = set.trim().trim_start_matches('(').trim_end_matches(')');
            !get(k.trim()).is_some_and(|v| set.split(',').any(|s| s.trim() == v))
        } else if let Some((k, set)) = t.split_once(" in ") {
            let set = set.trim().trim_start_matches('(').trim_end_matches(')');
            get(k.trim()).is_some_and(|v| set.split(',').any(|s| s.trim() == v))
        } else if let Some(k) = t.strip_prefix('!') {
            get(k.trim()).is_none()
        } else {
            get(t).is_some()
        }
    })
}

fn fields_match(selector: &str, obj: &Value) -> bool {
    selector.split(',').map(str::trim).filter(|t| !t.is_empty()).all(|t| {
        let (neg, (path, want)) = match t.split_once("!=") {
            Some(kv) => (true, kv),
            None => (false, t.split_once("==").or_else(|| t.split_once('=')).unwrap_or((t, ""))),
        };
        let mut v = obj;
        for p in path.split('.') {
            v = &v[p];
        }
        (v.as_str().unwrap_or_default() == want) != neg
    })
}

fn status_body(e: &ApiError) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": e.message, "reason": e.reason, "code": e.code})
}

fn name_of(o: &Value) -> String {
    o["metadata"]["name"].as_str().unwrap_or_default().to_string()
}

fn spec_part(o: &Value) -> Value {
    let mut o = o.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

impl Store {
    fn record(&mut self, type_: &'static str, plural: &str, namespace: &str, object: Value, previous: Option<Value>) {
        self.changes.push_back(Change {
            rv: self.rv,
            plural: plural.into(),
            namespace: namespace.into(),
            type_,
            object,
            previous,
        });
        while self.changes.len() > MAX_CHANGES {
            if let Some(c) = self.changes.pop_front() {
                self.expired_through = c.rv;
            }
        }
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn create(&mut self, res: &Resource, ns: &str, mut obj: Value) -> Result<Value, ApiError> {
        let ns = if res.namespaced { ns } else { "" };
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        if name_of(&obj).is_empty() {
            let Some(prefix) = obj["metadata"]["generateName"].as_str().map(String::from) else {
                return Err(err(422, "Invalid", "metadata.name or metadata.generateName is required"));
            };
            self.uids += 1;
            obj["metadata"]["name"] = json!(format!("{prefix}{:05x}", self.uids));
        }
        if res.plural == "pods" && self.restricted.contains(ns) {
            let v = restricted_violations(&obj);
            if !v.is_empty() {
                return Err(err(
                    403,
                    "Forbidden",
                    format!(
                        "pods {:?} is forbidden: violates PodSecurity \"restricted:latest\": {}",
                        name_of(&obj),
                        v.join(", ")
                    ),
                ));
            }
        }
        self.admit(res, &mut obj, None)?;
        let key = (res.plural.to_string(), ns.to_string(), name_of(&obj));
        if self.objects.contains_key(&key) {
            return Err(err(409, "AlreadyExists", format!("{} {:?} already exists", res.plural, key.2)));
        }
        self.uids += 1;
        let rv = self.next_rv();
        let m = &mut obj["metadata"];
        m["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.uids));
        m["resourceVersion"] = json!(rv.to_string());
        m["creationTimestamp"] = json!(timestamp(SystemTime::now()));
        if res.namespaced {
            m["namespace"] = json!(ns);
        }
        if obj.get("spec").is_some() {
            obj["metadata"]["generation"] = json!(1);
        }
        obj["apiVersion"] = json!(res.api_version());
        obj["kind"] = json!(res.kind);
        self.objects.insert(key, obj.clone());
        self.record("ADDED", res.plural, ns, obj.clone(), None);
        self.written(res, &obj);
        Ok(obj)
    }

    /// Admission of a write (`old`: the live object on an update): a custom resource whose CRD
    /// the double holds is pruned, defaulted and validated by its schema; a CRD must have a
    /// schema the double can hold. 422 `Invalid` with the real server's words otherwise.
    fn admit(&self, res: &Resource, obj: &mut Value, old: Option<&Value>) -> Result<(), ApiError> {
        if res.plural == CRDS {
            return CrdSchema::from_crd(obj).map(|_| ()).map_err(|e| {
                err(
                    422,
                    "Invalid",
                    format!("CustomResourceDefinition.apiextensions.k8s.io {:?} is invalid: {e}", name_of(obj)),
                )
            });
        }
        let Some(schema) = self.crds.get(res.plural) else { return Ok(()) };
        schema.admit(obj, old).map_err(|errors| {
            err(422, "Invalid", crd_schema::invalid_message(schema.kind(), schema.group(), &name_of(obj), &errors))
        })
    }

    /// After a write: a CRD's schema is what its custom resources are admitted by from now on.
    fn written(&mut self, res: &Resource, obj: &Value) {
        if res.plural == CRDS
            && let Ok(schema) = CrdSchema::from_crd(obj)
        {
            self.crds.insert(schema.plural().to_string(), Arc::new(schema));
        }
    }

    /// Stores `new` in place of the live object (bookkeeping: resourceVersion, generation);
    /// deletes it when it is being deleted and has no finalizer left.
    fn replace(&mut self, key: &Key, new: Value) -> Value {
        self.store_change(key, new, false)
    }

    fn replace_deleting(&mut self, key: &Key, new: Value) -> Value {
        self.store_change(key, new, true)
    }

    fn store_change(&mut self, key: &Key, mut new: Value, deleting: bool) -> Value {
        let old = self.objects.get(key).cloned().unwrap_or(Value::Null);
        let mut generation = old["metadata"]["generation"].as_i64();
        if generation.is_some() && spec_part(&old) != spec_part(&new) {
            generation = generation.map(|g| g + 1);
        }
        for field in ["uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"] {
            let deleted_now = deleting && field == "deletionTimestamp";
            if !old["metadata"][field].is_null() && !deleted_now {
                new["metadata"][field] = old["metadata"][field].clone();
            }
        }
        if let Some(g) = generation {
            new["metadata"]["generation"] = json!(g);
        }
        for field in ["apiVersion", "kind"] {
            new[field] = old[field].clone();
        }
        // A write that changes nothing is no change (no new resourceVersion, no watch event):
        // controllers apply what they want on every reconcile.
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if new == old {
            return old;
        }
        let rv = self.next_rv();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        let finalizers = new["metadata"]["finalizers"].as_array().is_some_and(|f| !f.is_empty());
        if !new["metadata"]["deletionTimestamp"].is_null() && !finalizers {
            self.objects.remove(key);
            self.record("DELETED", &key.0, &key.1, new.clone(), None);
            if key.0 == CRDS {
                self.crds.retain(|_, s| s.plural() != new["spec"]["names"]["plural"].as_str().unwrap_or_default());
            }
            self.collect_garbage(&new);
            self.release_owners(&new);
            return new;
        }
        self.objects.insert(key.clone(), new.clone());
        self.record("MODIFIED", &key.0, &key.1, new.clone(), Some(old));
        new
    }

    fn delete(&mut self, key: &Key, propagation: Propagation) -> Result<Value, ApiError> {
        let Some(obj) = self.objects.get(key).cloned() else {
            return Err(err(404, "NotFound", format!("{} {:?} not found", key.0, key.2)));
        };
        if !obj["metadata"]["deletionTimestamp"].is_null() {
            return Ok(obj);
        }
        let uid = obj["metadata"]["uid"].clone();
        let mut new = obj;
        new["metadata"]["deletionTimestamp"] = json!(timestamp(SystemTime::now()));
        match propagation {
            Propagation::Background => Ok(self.replace_deleting(key, new)),
            Propagation::Orphan => {
                for k in self.owned_by(&uid) {
                    if let Some(mut o) = self.objects.get(&k).cloned()
                        && let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut()
                    {
                        refs.retain(|r| r["uid"] != uid);
                        self.replace(&k, o);
                    }
                }
                Ok(self.replace_deleting(key, new))
            }
            Propagation::Foreground => {
                // The garbage collector's part: the owner waits (finalizer), what it owns is
                // deleted — in the foreground too when it owns things itself —, and the owner
                // goes once nothing that blocks it is left.
                let mut finalizers = new["metadata"]["finalizers"].as_array().cloned().unwrap_or_default();
                if !finalizers.contains(&json!(FOREGROUND)) {
                    finalizers.push(json!(FOREGROUND));
                }
                new["metadata"]["finalizers"] = json!(finalizers);
                let out = self.replace_deleting(key, new);
                for k in self.owned_by(&uid) {
                    let own_uid = self.objects.get(&k).map(|o| o["metadata"]["uid"].clone()).unwrap_or_default();
                    let policy = if self.owned_by(&own_uid).is_empty() {
                        Propagation::Background
                    } else {
                        Propagation::Foreground
                    };
                    let _ = self.delete(&k, policy);
                }
                self.release_foreground(&uid);
                Ok(self.objects.get(key).cloned().unwrap_or(out))
            }
        }
    }

    /// The objects with an owner reference to `uid`.
    fn owned_by(&self, uid: &Value) -> Vec<Key> {
        self.objects
            .iter()
            .filter(|(_, o)| {
                o["metadata"]["ownerReferences"].as_array().is_some_and(|refs| refs.iter().any(|r| r["uid"] == *uid))
            })
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Background cascading deletion: every object owned by `gone` is deleted (in turn).
    fn collect_garbage(&mut self, gone: &Value) {
        for k in self.owned_by(&gone["metadata"]["uid"]) {
            let _ = self.delete(&k, Propagation::Background);
        }
    }

    /// `gone` left: an owner of it deleted in the foreground may now go too.
    fn release_owners(&mut self, gone: &Value) {
        for r in gone["metadata"]["ownerReferences"].as_array().cloned().unwrap_or_default() {
            self.release_foreground(&r["uid"]);
        }
    }

    /// The object `uid`, waiting in a foreground deletion, loses its `foregroundDeletion`
    /// finalizer once no object it owns with `blockOwnerDeletion: true` is left.
    fn release_foreground(&mut self, uid: &Value) {
        let Some((key, owner)) =
            self.objects.iter().find(|(_, o)| o["metadata"]["uid"] == *uid).map(|(k, o)| (k.clone(), o.clone()))
        else {
            return;
        };
        let waiting = owner["metadata"]["finalizers"].as_array().is_some_and(|f| f.contains(&json!(FOREGROUND)));
        let blocked = self.objects.values().any(|o| {
            o["metadata"]["ownerReferences"]
                .as_array()
                .is_some_and(|refs| refs.iter().any(|r| r["uid"] == *uid && r["blockOwnerDeletion"] == true))
        });
        if !waiting || blocked {
            return;
        }
        let mut new = owner;
        if let Some(f) = new["metadata"]["finalizers"].as_array_mut() {
            f.retain(|x| x != FOREGROUND);
        }
        self.replace(&key, new);
    }
}

/// The API-server double, serving until dropped.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A request path's parts.
struct Target<'a> {
    plural: &'a str,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    subresource: Option<&'a str>,
}

fn split_path(path: &str) -> Option<Target<'_>> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest = match *segs.first()? {
        "api" => segs.get(2..)?,
        "apis" => segs.get(3..)?,
        _ => return None,
    };
    let (ns, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(*ns), rest),
        _ => (None, rest),
    };
    let (plural, name, subresource) = match rest {
        [plural] => (plural, None, None),
        [plural, name] => (plural, Some(*name), None),
        [plural, name, sub] => (plural, Some(*name), Some(*sub)),
        _ => return None,
    };
    Some(Target { plural, namespace: ns, name, subresource })
}

fn query_map(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), percent_decode(v)))
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn json_response(code: u16, v: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(v).unwrap_or_default()))
        .unwrap_or_default()
}

fn error_response(e: &ApiError) -> Response {
    json_response(e.code, &status_body(e))
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let q = query_map(&uri);
    {
        let mut s = shared.store.lock().expect("store");
        s.requests.push_back(format!("{method} {}", uri.path_and_query().map(|p| p.as_str()).unwrap_or_default()));
        while s.requests.len() > MAX_CHANGES {
            s.requests.pop_front();
        }
    }
    let Some(Target { plural, namespace: ns, name, subresource: sub }) = split_path(uri.path()) else {
        return error_response(&err(404, "NotFound", format!("no route {}", uri.path())));
    };
    let res = match known(plural) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    if sub.is_some_and(|s| s != "status" && s != "scale") {
        return error_response(&err(404, "NotFound", format!("no subresource {sub:?}")));
    }
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return error_response(&err(400, "BadRequest", format!("the body is not JSON: {e}"))),
        }
    };
    let ns = ns.unwrap_or_default();
    let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let result = match (&method, name) {
        (&Method::GET, None) if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) => {
            return watch(shared, res, ns.to_string(), q);
        }
        (&Method::GET, None) => Ok((200, list(&shared, res, ns, &q))),
        (&Method::GET, Some(name)) => get_one(&shared, res, ns, name).map(|o| (200, o)),
        (&Method::POST, None) => create(&shared, res, ns, body).map(|o| (201, o)),
        (&Method::PUT, Some(name)) => put(&shared, res, ns, name, sub, body).map(|o| (200, o)),
        (&Method::PATCH, Some(name)) => patch(&shared, res, ns, name, sub, &content_type, body),
        (&Method::DELETE, Some(name)) => Propagation::from_options(&body, &q)
            .and_then(|p| delete(&shared, res, ns, name, &body, p))
            .map(|o| (200, o)),
        _ => Err(err(405, "MethodNotAllowed", format!("{method} {}", uri.path()))),
    };
    match result {
        Ok((code, v)) => json_response(code, &v),
        Err(e) => error_response(&e),
    }
}

fn key_of(res: &Resource, ns: &str, name: &str) -> Key {
    (res.plural.to_string(), if res.namespaced { ns.to_string() } else { String::new() }, name.to_string())
}

fn list(shared: &Shared, res: &Resource, ns: &str, q: &BTreeMap<String, String>) -> Value {
    let s = shared.store.lock().expect("store");
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|((p, n, _), o)| p == res.plural && (ns.is_empty() || n == ns) && selected(q, o))
        .map(|(_, o)| o.clone())
        .collect();
    json!({"apiVersion": res.api_version(), "kind": format!("{}List", res.kind),
           "metadata": {"resourceVersion": s.rv.to_string()}, "items": items})
}

fn selected(q: &BTreeMap<String, String>, o: &Value) -> bool {
    q.get("labelSelector").is_none_or(|l| labels_match(l, &o["metadata"]["labels"]))
        && q.get("fieldSelector").is_none_or(|f| fields_match(f, o))
}

fn get_one(shared: &Shared, res: &Resource, ns: &str, name: &str) -> Result<Value, ApiError> {
    let s = shared.store.lock().expect("store");
    s.objects
        .get(&key_of(res, ns, name))
        .cloned()
        .ok_or_else(|| err(404, "NotFound", format!("{} {name:?} not found", res.plural)))
}

fn notify(shared: &Shared, s: &Store) {
    shared.changed.send_replace(s.rv);
}

fn create(shared: &Shared, res: &Resource, ns: &str, body: Value) -> Result<Value, ApiError> {
    let mut s = shared.store.lock().expect("store");
    let out = s.create(res, ns, body);
    notify(shared, &s);
    out
}

/// The fields of a StatefulSet's spec an update may change (the rest are immutable).
const STATEFULSET_MUTABLE: &[&str] =
    &["replicas", "ordinals", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy", "minReadySeconds"];

/// What the real API server's validation refuses in an update of the main resource, with its
/// messages (422 `Invalid`): a StatefulSet's spec beyond [`STATEFULSET_MUTABLE`]
/// (`ValidateStatefulSetUpdate`), a claim's spec beyond `resources.requests` and
/// `volumeAttributesClassName`, or a claim's storage request lowered
/// (`ValidatePersistentVolumeClaimUpdate`), a Service's `clusterIP` (`ValidateServiceUpdate`).
fn validate_update(res: &Resource, old: &Value, new: &Value) -> Result<(), ApiError> {
    let name = name_of(new);
    let invalid = |kind: &str, detail: String| err(422, "Invalid", format!("{kind} {name:?} is invalid: {detail}"));
    let without = |spec: &Value, keep: &dyn Fn(&str) -> bool| -> Value {
        let mut s = spec.clone();
        if let Some(m) = s.as_object_mut() {
            m.retain(|k, _| !keep(k));
        }
        s
    };
    match res.plural {
        "statefulsets" => {
            let frozen = |o: &Value| without(&o["spec"], &|k| STATEFULSET_MUTABLE.contains(&k));
            if frozen(old) != frozen(new) {
                return Err(invalid(
                    "StatefulSet.apps",
                    "spec: Forbidden: updates to statefulset spec for fields other than 'replicas', 'ordinals', \
                     'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' are \
                     forbidden"
                        .into(),
                ));
            }
        }
        "persistentvolumeclaims" => {
            let frozen = |o: &Value| {
                let mut s = without(&o["spec"], &|k| k == "volumeAttributesClassName");
                if let Some(r) = s.get_mut("resources").and_then(Value::as_object_mut) {
                    r.remove("requests");
                }
                s
            };
            if frozen(old) != frozen(new) {
                return Err(invalid(
                    "PersistentVolumeClaim",
                    "spec: Forbidden: spec is immutable after creation except resources.requests and \
                     volumeAttributesClassName for bound claims"
                        .into(),
                ));
            }
            let storage = |o: &Value| o["spec"]["resources"]["requests"]["storage"].as_str().and_then(Quantity::parse);
            if let (Some(before), Some(after)) = (storage(old), storage(new))
                && after < before
            {
                return Err(invalid(
                    "PersistentVolumeClaim",
                    "spec.resources.requests.storage: Forbidden: field can not be less than previous value".into(),
                ));
            }
        }
        "services" => {
            let ip = |o: &Value| o["spec"]["clusterIP"].as_str().map(String::from);
            if let (Some(before), after) = (ip(old), ip(new))
                && after.as_ref() != Some(&before)
            {
                return Err(invalid(
                    "Service",
                    format!("spec.clusterIP: Invalid value: {:?}: field is immutable", after.unwrap_or_default()),
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// The new object from a write to the main resource or its status: the other part kept.
fn writable(res: &Resource, old: &Value, mut new: Value, sub: Option<&str>) -> Value {
    if sub == Some("status") {
        let mut o = old.clone();
        o["status"] = new["status"].take();
        return o;
    }
    if res.status {
        match old.get("status") {
            Some(st) => new["status"] = st.clone(),
            None => {
                if let Some(m) = new.as_object_mut() {
                    m.remove("status");
                }
            }
        }
    }
    new
}

fn put(
    shared: &Shared,
    res: &Resource,
    ns: &str,
    name: &str,
    sub: Option<&str>,
    body: Value,
) -> Result<Value, ApiError> {
    let mut s = shared.store.lock().expect("store");
    let key = key_of(res, ns, name);
    let Some(old) = s.objects.get(&key).cloned() else {
        return Err(err(404, "NotFound", format!("{} {name:?} not found", res.plural)));
    };
    precondition(res, name, &old, &body)?;
    let mut new = writable(res, &old, body, sub);
    s.admit(res, &mut new, Some(&old))?;
    if sub.is_none() {
        validate_update(res, &old, &new)?;
    }
    let out = s.replace(&key, new);
    s.written(res, &out);
    notify(shared, &s);
    Ok(out)
}

/// An update's optimistic lock: a `metadata.resourceVersion` in what is written (a PUT's body,
/// the result of a patch that sets it) must be the live object's, else 409 `Conflict`.
fn precondition(res: &Resource, name: &str, old: &Value, new: &Value) -> Result<(), ApiError> {
    match new["metadata"]["resourceVersion"].as_str() {
        Some(rv) if rv != old["metadata"]["resourceVersion"].as_str().unwrap_or_default() => {
            Err(conflict(res, name, MODIFIED_SINCE))
        }
        _ => Ok(()),
    }
}

fn patch(
    shared: &Shared,
    res: &Resource,
    ns: &str,
    name: &str,
    sub: Option<&str>,
    content_type: &str,
    body: Value,
) -> Result<(u16, Value), ApiError> {
    let mut s = shared.store.lock().expect("store");
    let key = key_of(res, ns, name);
    let old = s.objects.get(&key).cloned();
    let out = match (content_type.split(';').next().unwrap_or_default().trim(), old) {
        ("application/apply-patch+yaml", None) if sub.is_none() => {
            let mut o = body;
            o["metadata"]["name"] = json!(name);
            s.create(res, ns, o).map(|o| (201, o))
        }
        (_, None) => Err(err(404, "NotFound", format!("{} {name:?} not found", res.plural))),
        (ct, Some(old)) => {
            let mut new = old.clone();
            match ct {
                "application/apply-patch+yaml" => apply_merge(&mut new, &body),
                "application/merge-patch+json" => merge_patch(&mut new, &body),
                "application/json-patch+json" => json_patch(&mut new, &body)?,
                other => return Err(err(415, "UnsupportedMediaType", format!("patch type {other:?}"))),
            }
            precondition(res, name, &old, &new)?;
            let mut new = writable(res, &old, new, sub);
            s.admit(res, &mut new, Some(&old))?;
            if sub.is_none() {
                validate_update(res, &old, &new)?;
            }
            let out = s.replace(&key, new);
            s.written(res, &out);
            Ok((200, out))
        }
    };
    notify(shared, &s);
    out
}

/// A DELETE: its options' preconditions (`uid`, `resourceVersion`; 409 when the live object
/// differs) and propagation policy.
fn delete(
    shared: &Shared,
    res: &Resource,
    ns: &str,
    name: &str,
    options: &Value,
    propagation: Propagation,
) -> Result<Value, ApiError> {
    let mut s = shared.store.lock().expect("store");
    let key = key_of(res, ns, name);
    if let Some(live) = s.objects.get(&key) {
        for (field, what) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            let wanted = &options["preconditions"][field];
            if wanted.is_string() && *wanted != live["metadata"][field] {
                let why = format!(
                    "Precondition failed: {what} in precondition: {}, {what} in object meta: {}",
                    wanted.as_str().unwrap_or_default(),
                    live["metadata"][field].as_str().unwrap_or_default()
                );
                return Err(conflict(res, name, &why));
            }
        }
    }
    let out = s.delete(&key, propagation);
    notify(shared, &s);
    out
}

fn watch(shared: Arc<Shared>, res: &'static Resource, ns: String, q: BTreeMap<String, String>) -> Response {
    let from: u64 = q.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let timeout = Duration::from_secs(q.get("timeoutSeconds").and_then(|v| v.parse().ok()).unwrap_or(300));
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let line = |type_: &str, object: &Value| {
        let mut b = serde_json::to_vec(&json!({"type": type_, "object": object})).unwrap_or_default();
        b.push(b'\n');
        Bytes::from(b)
    };
    // The first batch: everything now (resourceVersion 0 or absent), or 410 when the changes
    // after `from` are no longer all kept.
    let (mut seen, first) = {
        let s = shared.store.lock().expect("store");
        if from == 0 {
            let items: Vec<Bytes> = s
                .objects
                .iter()
                .filter(|((p, n, _), o)| p == res.plural && (ns.is_empty() || *n == ns) && selected(&q, o))
                .map(|(_, o)| line("ADDED", o))
                .collect();
            (s.rv, items)
        } else if from < s.expired_through {
            let e = err(410, "Expired", format!("too old resource version: {from}"));
            return json_response(200, &json!({"type": "ERROR", "object": status_body(&e)}));
        } else {
            (from, Vec::new())
        }
    };
    let mut changed = shared.changed.subscribe();
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + timeout;
        for b in first {
            if tx.send(Ok(b)).await.is_err() {
                return;
            }
        }
        loop {
            let batch: Vec<Bytes> = {
                let s = shared.store.lock().expect("store");
                let out = s
                    .changes
                    .iter()
                    .filter(|c| c.rv > seen && c.plural == res.plural && (ns.is_empty() || c.namespace == ns))
                    .filter_map(|c| {
                        // A selector watch sees an object that stops matching go (DELETED) and
                        // one that starts matching come (ADDED), as the watch cache sends them.
                        let now = selected(&q, &c.object);
                        match (c.previous.as_ref().map(|p| selected(&q, p)), now) {
                            (Some(true), false) => Some(line("DELETED", &c.object)),
                            (Some(false), true) => Some(line("ADDED", &c.object)),
                            (_, true) => Some(line(c.type_, &c.object)),
                            (_, false) => None,
                        }
                    })
                    .collect();
                seen = s.rv;
                out
            };
            for b in batch {
                if tx.send(Ok(b)).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return },
                _ = tokio::time::sleep_until(deadline) => return,
                _ = tx.closed() => return,
            }
        }
    });
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .unwrap_or_default()
}

impl ApiServer {
    /// Serves on `ip` (a free port) from a thread of its own.
    pub fn start(ip: &str) -> Result<ApiServer> {
        let listener = std::net::TcpListener::bind((ip, 0)).with_context(|| format!("binding {ip}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared =
            Arc::new(Shared { store: Mutex::new(Store::default()), changed: tokio::sync::watch::channel(0).0 });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = axum::Router::new().fallback(handle).with_state(shared.clone());
        let thread = std::thread::Builder::new().name("apiserver".into()).spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build();
            let Ok(rt) = rt else { return };
            rt.block_on(async move {
                let Ok(l) = tokio::net::TcpListener::from_std(listener) else { return };
                let _ = axum::serve(l, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await;
            });
            rt.shutdown_timeout(Duration::from_secs(1));
        })?;
        Ok(ApiServer { shared, addr, stop: Some(stop), thread: Some(thread) })
    }

    /// `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig pointing at the double (no credentials), written to `path`.
    pub fn write_kubeconfig(&self, path: &std::path::Path, namespace: &str) -> Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {}\n\
             users:\n- name: test\n  user: {{}}\ncontexts:\n- name: double\n  context:\n    cluster: double\n    \
             user: test\n    namespace: {namespace}\ncurrent-context: double\n",
            self.url()
        );
        std::fs::write(path, text).context("writing the kubeconfig")
    }

    /// The object, if any.
    pub fn get(&self, plural: &str, ns: &str, name: &str) -> Option<Value> {
        let res = resource(plural)?;
        get_one(&self.shared, res, ns, name).ok()
    }

    /// Objects of `plural` (in `ns`, or everywhere when `None`).
    pub fn list(&self, plural: &str, ns: Option<&str>) -> Vec<Value> {
        let Some(res) = resource(plural) else { return Vec::new() };
        list(&self.shared, res, ns.unwrap_or_default(), &BTreeMap::new())["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Creates an object.
    pub fn create(&self, plural: &str, ns: &str, obj: Value) -> Result<Value, ApiError> {
        let res = known(plural)?;
        create(&self.shared, res, ns, obj)
    }

    /// Changes an object in place (`f` gets the live object; the whole of it is stored, status
    /// included — as a controller writing both would), with the usual bookkeeping; `None` when
    /// it does not exist.
    pub fn mutate(&self, plural: &str, ns: &str, name: &str, f: impl FnOnce(&mut Value)) -> Option<Value> {
        let res = resource(plural)?;
        let mut s = self.shared.store.lock().expect("store");
        let key = key_of(res, ns, name);
        let mut o = s.objects.get(&key)?.clone();
        f(&mut o);
        let out = s.replace(&key, o);
        notify(&self.shared, &s);
        Some(out)
    }

    /// A JSON merge patch of the main resource (what `kubectl patch --type merge` does).
    pub fn merge(&self, plural: &str, ns: &str, name: &str, patch_body: &Value) -> Result<Value, ApiError> {
        let res = known(plural)?;
        patch(&self.shared, res, ns, name, None, "application/merge-patch+json", patch_body.clone()).map(|(_, v)| v)
    }

    /// Deletes an object (finalizers and background garbage collection as the module says).
    pub fn delete(&self, plural: &str, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.delete_with(plural, ns, name, Propagation::Background)
    }

    /// Deletes an object with a propagation policy (`kubectl delete --cascade=...`).
    pub fn delete_with(&self, plural: &str, ns: &str, name: &str, p: Propagation) -> Result<Value, ApiError> {
        let res = known(plural)?;
        delete(&self.shared, res, ns, name, &Value::Null, p)
    }

    /// Enforces Pod Security `restricted` on the pods created in `ns` from now on (what the
    /// namespace label `pod-security.kubernetes.io/enforce: restricted` does): a pod that
    /// violates it is refused, 403 with the admission's message.
    pub fn enforce_restricted(&self, ns: &str) {
        self.shared.store.lock().expect("store").restricted.insert(ns.to_string());
    }

    /// The requests served so far ("METHOD path?query").
    pub fn requests(&self) -> Vec<String> {
        self.shared.store.lock().expect("store").requests.iter().cloned().collect()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        // (The graceful shutdown waits for open watches: their clients must be gone by now.)
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_follow_their_rfcs() {
        let mut o = json!({"metadata": {"finalizers": ["a"], "labels": {"x": "1"}}, "spec": {"n": 1}});
        merge_patch(&mut o, &json!({"metadata": {"labels": {"x": null, "y": "2"}}, "spec": {"n": 2}}));
        assert_eq!(o["metadata"]["labels"], json!({"y": "2"}));
        assert_eq!(o["spec"]["n"], 2);
        json_patch(
            &mut o,
            &json!([{"op": "test", "path": "/metadata/finalizers", "value": ["a"]},
                    {"op": "add", "path": "/metadata/finalizers/-", "value": "b"},
                    {"op": "remove", "path": "/metadata/finalizers/0"}]),
        )
        .expect("patch");
        assert_eq!(o["metadata"]["finalizers"], json!(["b"]));
        let failed = json_patch(&mut o, &json!([{"op": "test", "path": "/metadata/finalizers", "value": []}]));
        assert_eq!(failed.map_err(|e| e.code), Err(422));
        json_patch(&mut o, &json!([{"op": "test", "path": "/metadata/missing", "value": null}])).expect("null");
    }

    #[test]
    fn selectors_and_timestamps() {
        let l = json!({"app": "dpukv", "tier": "node"});
        assert!(labels_match("app=dpukv,tier in (node, gateway)", &l));
        assert!(!labels_match("app=dpukv,tier!=node", &l));
        assert!(labels_match("!missing,app", &l));
        assert_eq!(timestamp(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn deletion_waits_for_finalizers_then_collects_what_it_owned() {
        let api = ApiServer::start("127.0.0.1").expect("start");
        let owner = api
            .create("dpukvclusters", "db", json!({"metadata": {"name": "demo", "finalizers": ["f"]}, "spec": {}}))
            .expect("owner");
        let uid = owner["metadata"]["uid"].clone();
        api.create(
            "statefulsets",
            "db",
            json!({"metadata": {"name": "demo-node", "ownerReferences": [{"uid": uid, "name": "demo"}]}, "spec": {}}),
        )
        .expect("child");
        api.delete("dpukvclusters", "db", "demo").expect("delete");
        let held = api.get("dpukvclusters", "db", "demo").expect("held by its finalizer");
        assert!(held["metadata"]["deletionTimestamp"].is_string());
        assert!(api.get("statefulsets", "db", "demo-node").is_some(), "the child stays while the owner does");
        api.merge("dpukvclusters", "db", "demo", &json!({"metadata": {"finalizers": null}})).expect("patch");
        assert!(api.get("dpukvclusters", "db", "demo").is_none());
        assert!(api.get("statefulsets", "db", "demo-node").is_none(), "collected with its owner");
    }

    /// As the real API server: a StatefulSet's claim templates (any spec field but the mutable
    /// ones) never change; a claim's storage request only grows; a Service keeps its clusterIP.
    #[test]
    fn updates_the_real_api_server_refuses_are_422() {
        let api = ApiServer::start("127.0.0.1").expect("start");
        let claim = |size: &str| json!([{"metadata": {"name": "data"}, "spec": {"resources": {"requests": {"storage": size}}}}]);
        api.create(
            "statefulsets",
            "db",
            json!({"metadata": {"name": "s"}, "spec": {"replicas": 1, "volumeClaimTemplates": claim("10Gi")}}),
        )
        .expect("create");
        api.merge("statefulsets", "db", "s", &json!({"spec": {"replicas": 3, "template": {"x": 1}}}))
            .expect("mutable fields");
        let e = api
            .merge("statefulsets", "db", "s", &json!({"spec": {"volumeClaimTemplates": claim("20Gi")}}))
            .expect_err("immutable");
        assert_eq!((e.code, e.reason), (422, "Invalid"));
        assert!(e.message.contains("updates to statefulset spec for fields other than 'replicas'"), "{}", e.message);
        assert_eq!(
            api.get("statefulsets", "db", "s").expect("s")["spec"]["volumeClaimTemplates"],
            claim("10Gi"),
            "unchanged"
        );
        api.create("persistentvolumeclaims", "db", json!({"metadata": {"name": "c"}, "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}))
            .expect("claim");
        api.merge(
            "persistentvolumeclaims",
            "db",
            "c",
            &json!({"spec": {"resources": {"requests": {"storage": "20Gi"}}}}),
        )
        .expect("grows");
        let e = api
            .merge(
                "persistentvolumeclaims",
                "db",
                "c",
                &json!({"spec": {"resources": {"requests": {"storage": "15Gi"}}}}),
            )
            .expect_err("shrinks");
        assert!(e.message.contains("field can not be less than previous value"), "{}", e.message);
        let e = api
            .merge("persistentvolumeclaims", "db", "c", &json!({"spec": {"accessModes": ["ReadWriteMany"]}}))
            .expect_err("immutable");
        assert!(e.message.contains("spec is immutable after creation"), "{}", e.message);
        api.create("services", "db", json!({"metadata": {"name": "v"}, "spec": {"clusterIP": "None"}}))
            .expect("service");
        let e = api.merge("services", "db", "v", &json!({"spec": {"clusterIP": "10.0.0.1"}})).expect_err("clusterIP");
        assert!(e.message.contains("field is immutable"), "{}", e.message);
    }

    /// A `resourceVersion` in what a write sends is a precondition on every path the real API
    /// server takes it on: PUT, merge, JSON and apply patches, the status subresource, and
    /// DELETE's `preconditions` (with `uid`) — 409 `Conflict` with its words when stale.
    #[test]
    fn a_stale_resource_version_conflicts_on_every_write_path() {
        let api = ApiServer::start("127.0.0.1").expect("start");
        let res = resource("configmaps").expect("configmaps");
        let sts = resource("statefulsets").expect("statefulsets");
        let made = api.create("configmaps", "db", json!({"metadata": {"name": "c"}, "data": {"a": "1"}})).expect("c");
        let stale = made["metadata"]["resourceVersion"].as_str().expect("rv").to_string();
        api.merge("configmaps", "db", "c", &json!({"data": {"a": "2"}})).expect("a write moves it on");
        let shared = &api.shared;
        let stale_meta = json!({"metadata": {"resourceVersion": stale}, "data": {"a": "3"}});
        let refused = [
            put(shared, res, "db", "c", None, stale_meta.clone()).map(|_| ()),
            patch(shared, res, "db", "c", None, "application/merge-patch+json", stale_meta.clone()).map(|_| ()),
            patch(shared, res, "db", "c", None, "application/apply-patch+yaml", stale_meta.clone()).map(|_| ()),
            patch(
                shared,
                res,
                "db",
                "c",
                None,
                "application/json-patch+json",
                json!([{"op": "replace", "path": "/metadata/resourceVersion", "value": stale}]),
            )
            .map(|_| ()),
            delete(
                shared,
                res,
                "db",
                "c",
                &json!({"preconditions": {"resourceVersion": stale}}),
                Propagation::Background,
            )
            .map(|_| ()),
            delete(shared, res, "db", "c", &json!({"preconditions": {"uid": "someone-else"}}), Propagation::Background)
                .map(|_| ()),
        ];
        for (i, r) in refused.into_iter().enumerate() {
            let e = r.expect_err("stale");
            assert_eq!((e.code, e.reason), (409, "Conflict"), "write {i}: {}", e.message);
            assert!(e.message.starts_with("Operation cannot be fulfilled on configmaps \"c\": "), "{}", e.message);
        }
        assert_eq!(api.get("configmaps", "db", "c").expect("still there")["data"]["a"], "2", "nothing written");
        let s =
            api.create("statefulsets", "db", json!({"metadata": {"name": "s"}, "spec": {"replicas": 1}})).expect("s");
        let rv = s["metadata"]["resourceVersion"].clone();
        api.mutate("statefulsets", "db", "s", |o| o["status"] = json!({"replicas": 1})).expect("status");
        let e = put(
            shared,
            sts,
            "db",
            "s",
            Some("status"),
            json!({"metadata": {"resourceVersion": rv}, "status": {"replicas": 2}}),
        )
        .expect_err("stale status");
        assert_eq!(e.code, 409);
        assert!(e.message.contains("statefulsets.apps \"s\""), "{}", e.message);
        // With the live resourceVersion, the same writes go through.
        let live = api.get("configmaps", "db", "c").expect("c")["metadata"]["resourceVersion"].clone();
        patch(
            shared,
            res,
            "db",
            "c",
            None,
            "application/merge-patch+json",
            json!({"metadata": {"resourceVersion": live}, "data": {"a": "4"}}),
        )
        .expect("current");
        let live = api.get("configmaps", "db", "c").expect("c")["metadata"]["resourceVersion"].clone();
        delete(shared, res, "db", "c", &json!({"preconditions": {"resourceVersion": live}}), Propagation::Background)
            .expect("current");
        assert!(api.get("configmaps", "db", "c").is_none());
    }

    /// Foreground deletion keeps the owner (finalizer `foregroundDeletion`) until what blocks it
    /// is gone — a dependent held by a finalizer holds its owner —; orphaning keeps the
    /// dependents and drops their owner references.
    #[test]
    fn foreground_deletion_waits_for_blocking_dependents_and_orphaning_keeps_them() {
        let api = ApiServer::start("127.0.0.1").expect("start");
        let owner = |name: &str| {
            let o = api.create("dpukvclusters", "db", json!({"metadata": {"name": name}, "spec": {}})).expect("owner");
            json!([{"uid": o["metadata"]["uid"], "name": name, "blockOwnerDeletion": true}])
        };
        let refs = owner("a");
        api.create("statefulsets", "db", json!({"metadata": {"name": "a-node", "ownerReferences": refs}, "spec": {}}))
            .expect("child");
        let set_uid = api.get("statefulsets", "db", "a-node").expect("set")["metadata"]["uid"].clone();
        api.create(
            "pods",
            "db",
            json!({"metadata": {"name": "a-node-0", "finalizers": ["kubelet"],
                   "ownerReferences": [{"uid": set_uid, "name": "a-node", "blockOwnerDeletion": true}]}, "spec": {}}),
        )
        .expect("grandchild");
        api.delete_with("dpukvclusters", "db", "a", Propagation::Foreground).expect("delete");
        let held = api.get("dpukvclusters", "db", "a").expect("waits for its dependents");
        assert_eq!(held["metadata"]["finalizers"], json!([FOREGROUND]));
        assert!(held["metadata"]["deletionTimestamp"].is_string());
        let set = api.get("statefulsets", "db", "a-node").expect("waits for its pod");
        assert!(set["metadata"]["deletionTimestamp"].is_string());
        assert!(
            api.get("pods", "db", "a-node-0").expect("held by its finalizer")["metadata"]["deletionTimestamp"]
                .is_string()
        );
        api.merge("pods", "db", "a-node-0", &json!({"metadata": {"finalizers": null}})).expect("the kubelet lets go");
        for (plural, name) in [("pods", "a-node-0"), ("statefulsets", "a-node"), ("dpukvclusters", "a")] {
            assert!(api.get(plural, "db", name).is_none(), "{plural}/{name} is gone once what blocked it is");
        }
        let refs = owner("b");
        api.create("configmaps", "db", json!({"metadata": {"name": "b-zones", "ownerReferences": refs}}))
            .expect("child");
        api.delete_with("dpukvclusters", "db", "b", Propagation::Orphan).expect("delete");
        assert!(api.get("dpukvclusters", "db", "b").is_none());
        let kept = api.get("configmaps", "db", "b-zones").expect("orphaned, not deleted");
        assert_eq!(kept["metadata"]["ownerReferences"], json!([]));
        let e =
            Propagation::from_options(&json!({"propagationPolicy": "Sideways"}), &BTreeMap::new()).expect_err("bad");
        assert_eq!(e.code, 422);
    }

    /// The events of a watch over HTTP, read until `n` have come.
    fn watch_events(api: &ApiServer, path_and_query: &str, n: usize) -> Vec<(String, String)> {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(api.addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        write!(c, "GET {path_and_query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("request");
        let mut text = String::new();
        let mut buf = [0u8; 4096];
        let events = |text: &str| -> Vec<(String, String)> {
            text.split("\r\n")
                .filter(|l| l.starts_with('{'))
                .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
                .map(|v| (v["type"].as_str().unwrap_or_default().to_string(), name_of(&v["object"])))
                .collect()
        };
        while events(&text).len() < n {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => text.push_str(&String::from_utf8_lossy(&buf[..k])),
            }
        }
        events(&text)
    }

    /// A watch with a label selector gets `DELETED` when an object stops matching and `ADDED`
    /// when one starts to, as the real watch cache sends them (a controller watching its own
    /// objects by label must forget one relabelled away).
    #[test]
    fn a_selector_watch_sees_objects_stop_and_start_matching() {
        let api = ApiServer::start("127.0.0.1").expect("start");
        let from =
            api.create("configmaps", "db", json!({"metadata": {"name": "x", "labels": {"app": "dpukv"}}})).expect("x");
        let rv = from["metadata"]["resourceVersion"].as_str().expect("rv").to_string();
        api.create("configmaps", "db", json!({"metadata": {"name": "y"}})).expect("y");
        api.merge("configmaps", "db", "x", &json!({"metadata": {"labels": {"app": "other"}}})).expect("relabel x");
        api.merge("configmaps", "db", "y", &json!({"metadata": {"labels": {"app": "dpukv"}}})).expect("label y");
        api.merge("configmaps", "db", "x", &json!({"data": {"k": "v"}})).expect("x, unmatched, changes");
        api.merge("configmaps", "db", "y", &json!({"data": {"k": "v"}})).expect("y, matched, changes");
        let got = watch_events(
            &api,
            &format!(
                "/api/v1/namespaces/db/configmaps?watch=true&labelSelector=app%3Ddpukv&resourceVersion={rv}&timeoutSeconds=5"
            ),
            3,
        );
        let want: Vec<(String, String)> = [("DELETED", "x"), ("ADDED", "y"), ("MODIFIED", "y")]
            .iter()
            .map(|(t, n)| (t.to_string(), n.to_string()))
            .collect();
        assert_eq!(got, want);
    }

    /// A custom resource, once its CRD is created, is admitted by the CRD's schema: unknown
    /// fields pruned, defaults filled, types and CEL rules (transition rules on updates, status
    /// writes too) enforced with a 422 in the real server's words.
    #[test]
    fn custom_resources_are_admitted_by_their_crd_s_schema() {
        let api = ApiServer::start("127.0.0.1").expect("start");
        let crd = json!({"metadata": {"name": "dpukvclusters.dpukv.io"}, "spec": {
            "group": "dpukv.io", "names": {"kind": "DpuKvCluster", "plural": "dpukvclusters"}, "scope": "Namespaced",
            "versions": [{"name": "v1alpha1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                "type": "object", "required": ["spec"], "properties": {
                    "spec": {"type": "object", "required": ["size"],
                             "x-kubernetes-validations": [{"rule": "quantity(self.size).compareTo(quantity(oldSelf.size)) >= 0",
                                                           "message": "size cannot shrink"}],
                             "properties": {"size": {"type": "string"}, "nodes": {"type": "integer", "default": 3, "minimum": 1}}},
                    "status": {"type": "object", "properties": {"phase": {"type": "string", "enum": ["Running", "Failed"]}}}}}}}]}});
        // Before the CRD, anything goes.
        api.create("dpukvclusters", "db", json!({"metadata": {"name": "early"}, "spec": {"nodes": "many"}}))
            .expect("no schema yet");
        let mut bad = crd.clone();
        bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"] =
            json!([{"rule": "self.a <"}]);
        let e = api.create(CRDS, "", bad).expect_err("a rule that does not compile");
        assert!(e.code == 422 && e.message.contains("compilation failed"), "{}", e.message);
        api.create(CRDS, "", crd).expect("CRD");
        let c = api
            .create("dpukvclusters", "db", json!({"metadata": {"name": "c"}, "spec": {"size": "1Gi", "color": "red"}}))
            .expect("valid");
        assert_eq!(c["spec"], json!({"size": "1Gi", "nodes": 3}), "pruned and defaulted");
        let e = api
            .create("dpukvclusters", "db", json!({"metadata": {"name": "d"}, "spec": {"size": "1Gi", "nodes": 0}}))
            .expect_err("minimum");
        assert_eq!((e.code, e.reason), (422, "Invalid"));
        assert_eq!(
            e.message,
            "DpuKvCluster.dpukv.io \"d\" is invalid: spec.nodes: Invalid value: 0: spec.nodes in body should be greater than or equal to 1"
        );
        let e = api.merge("dpukvclusters", "db", "c", &json!({"spec": {"size": "512Mi"}})).expect_err("shrink");
        assert!(e.message.ends_with("spec: Invalid value: \"object\": size cannot shrink"), "{}", e.message);
        api.merge("dpukvclusters", "db", "c", &json!({"spec": {"size": "2Gi"}})).expect("grow");
        let res = resource("dpukvclusters").expect("res");
        let e = patch(
            &api.shared,
            res,
            "db",
            "c",
            Some("status"),
            "application/merge-patch+json",
            json!({"status": {"phase": "Dancing"}}),
        )
        .expect_err("status enum");
        assert!(e.message.contains("status.phase: Unsupported value: \"Dancing\""), "{}", e.message);
        patch(
            &api.shared,
            res,
            "db",
            "c",
            Some("status"),
            "application/merge-patch+json",
            json!({"status": {"phase": "Running"}}),
        )
        .expect("status");
        // An object stored before the CRD is not refused for what it already had (ratcheting)...
        api.merge("dpukvclusters", "db", "early", &json!({"metadata": {"labels": {"a": "b"}}})).expect("metadata only");
        api.delete(CRDS, "", "dpukvclusters.dpukv.io").expect("delete the CRD");
        api.create("dpukvclusters", "db", json!({"metadata": {"name": "late"}, "spec": {"nodes": "many"}}))
            .expect("no schema again");
    }

    /// Pod Security `restricted`: a pod as the operator renders it passes; the same pod with
    /// privilege escalation allowed, a host path, or running as root is refused, with the
    /// admission's words.
    #[test]
    fn pod_security_restricted_refuses_what_the_standard_forbids() {
        let api = ApiServer::start("127.0.0.1").expect("start");
        api.enforce_restricted("db");
        let good = json!({"metadata": {"name": "p"}, "spec": {
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": false,
                            "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true}}],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "x"}}, {"name": "s", "emptyDir": {}}]}});
        api.create("pods", "db", good.clone()).expect("admitted");
        let mut escalating = good.clone();
        escalating["metadata"]["name"] = json!("q");
        escalating["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = json!(true);
        let e = api.create("pods", "db", escalating).expect_err("refused");
        assert_eq!((e.code, e.reason), (403, "Forbidden"));
        assert!(
            e.message.contains("violates PodSecurity \"restricted:latest\": allowPrivilegeEscalation != false"),
            "{}",
            e.message
        );
        let mut host = good.clone();
        host["metadata"]["name"] = json!("r");
        host["spec"]["volumes"] = json!([{"name": "h", "hostPath": {"path": "/"}}]);
        host["spec"]["securityContext"]["runAsUser"] = json!(0);
        let e = api.create("pods", "db", host).expect_err("refused");
        assert!(e.message.contains("restricted volume types") && e.message.contains("runAsUser=0"), "{}", e.message);
        // Other namespaces: not enforced.
        let mut elsewhere = good;
        elsewhere["spec"]["containers"][0]["securityContext"] = json!({});
        api.create("pods", "other", elsewhere).expect("not enforced there");
    }
}
