#!/usr/bin/env python3
"""Every pod dpukv runs passes Pod Security `restricted`, checked offline.

The controls are those the Kubernetes documentation lists for the Pod Security Standards
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, "latest"), which Pod
Security admission enforces on a namespace labelled `pod-security.kubernetes.io/enforce:
restricted`:
- baseline: HostProcess, host namespaces, privileged containers, capabilities (only the default
  set may be added), hostPath volumes, host ports, host probes and lifecycle hooks, AppArmor,
  SELinux, /proc mount type, seccomp (not Unconfined), sysctls (the safe set only);
- restricted: volume types (configMap, csi, downwardAPI, emptyDir, ephemeral,
  persistentVolumeClaim, projected, secret), privilege escalation (allowPrivilegeEscalation
  false), running as non-root (runAsNonRoot true, at the pod or in every container), running as a
  non-root user (runAsUser not 0), seccomp (RuntimeDefault or Localhost, at the pod or in every
  container), capabilities (drop ALL; add at most NET_BIND_SERVICE).
Plus dpukv's own rules for the pods the operator makes: no service-account token where the API is
not called (node, gateway and etcd pods), a read-only root file system, `fsGroup` where a volume
claim is mounted, and no process namespace shared between a node's host and device.

The pods checked: every pod template the operator renders (`target/debug/dpukv-render` of each
manifests/examples/*.yaml, with and without a DPU) and every one the chart renders (`helm
template` with the default values and each charts/dpukv/ci/*-values.yaml): Deployments,
StatefulSets, DaemonSets, Jobs and Pods. The one exception is the device plugin's DaemonSet: it
needs the kubelet's device-plugin directory (a hostPath) and root to create its socket there,
so it must run in a namespace labelled `pod-security.kubernetes.io/enforce: privileged`
(docs/kubernetes.md); it is checked to break exactly those controls and no other.

The checks are themselves checked: a set of pods each breaking one control must each be refused.
Run from the repository's root after `cargo build -p dpukv-operator --bins` (scripts/test.sh
does)."""
import copy
import glob
import os
import subprocess
import sys

import kubetools  # noqa: E402  (scripts/kubetools.py)

kubetools.ensure()
import yaml  # noqa: E402

os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
RENDER = "target/debug/dpukv-render"
CHART = "charts/dpukv"

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def containers(spec):
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            yield kind, c


def restricted(meta, spec):
    """The controls of `restricted` (baseline's included) that pod (meta, spec) breaks, by name."""
    broken = set()
    pod_sc = spec.get("securityContext") or {}
    annotations = (meta or {}).get("annotations") or {}
    every = list(containers(spec))
    scs = [(c.get("securityContext") or {}) for _, c in every]
    # --- baseline ---
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess") or \
            any((sc.get("windowsOptions") or {}).get("hostProcess") for sc in scs):
        broken.add("HostProcess")
    if any(spec.get(f) for f in ("hostNetwork", "hostPID", "hostIPC")):
        broken.add("Host Namespaces")
    if any(sc.get("privileged") for sc in scs):
        broken.add("Privileged Containers")
    if any(set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES for sc in scs):
        broken.add("Capabilities (baseline)")
    if any("hostPath" in v for v in spec.get("volumes") or []):
        broken.add("HostPath Volumes")
    if any(p.get("hostPort") for _, c in every for p in c.get("ports") or []):
        broken.add("Host Ports")
    for _, c in every:
        handlers = [c.get(p) or {} for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [h for h in ((c.get("lifecycle") or {}).get(k) or {} for k in ("postStart", "preStop"))]
        for h in handlers:
            for action in ("httpGet", "tcpSocket"):
                if (h.get(action) or {}).get("host"):
                    broken.add("Host Probes / Lifecycle Hooks")
    for sc in [pod_sc, *scs]:
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            broken.add("AppArmor")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            broken.add("SELinux")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            broken.add("Seccomp (baseline)")
    for k, v in annotations.items():
        if k.startswith("container.apparmor.security.beta.kubernetes.io/") and \
                not (v == "runtime/default" or v.startswith("localhost/")):
            broken.add("AppArmor")
    if any(sc.get("procMount") not in (None, "Default") for sc in scs):
        broken.add("/proc Mount Type")
    if any(s.get("name") not in SAFE_SYSCTLS for s in pod_sc.get("sysctls") or []):
        broken.add("Sysctls")
    # --- restricted ---
    for v in spec.get("volumes") or []:
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES:
            broken.add("Volume Types")
    if any(sc.get("allowPrivilegeEscalation") is not False for sc in scs):
        broken.add("Privilege Escalation")
    pod_nonroot = pod_sc.get("runAsNonRoot") is True
    if any(sc.get("runAsNonRoot") is False or (sc.get("runAsNonRoot") is not True and not pod_nonroot)
           for sc in scs) or (not scs and not pod_nonroot):
        broken.add("Running as Non-root")
    if pod_sc.get("runAsUser") == 0 or any(sc.get("runAsUser") == 0 for sc in scs):
        broken.add("Running as Non-root user")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for sc in scs:
        t = (sc.get("seccompProfile") or {}).get("type")
        if t not in ("RuntimeDefault", "Localhost") and not (t is None and pod_seccomp in ("RuntimeDefault", "Localhost")):
            broken.add("Seccomp")
    for sc in scs:
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            broken.add("Capabilities")
    return broken


def dpukv_rules(meta, spec, component):
    """dpukv's own rules for the pods the operator makes (component node, gateway, etcd)."""
    broken = set()
    if spec.get("automountServiceAccountToken") is not False:
        broken.add("a service-account token is mounted")
    if any((c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True for _, c in containers(spec)):
        broken.add("a writable root file system")
    if spec.get("shareProcessNamespace"):
        broken.add("a shared process namespace")
    return broken


def pod_templates(doc):
    """(where, metadata, spec, volume claim templates) of each pod in a rendered object."""
    kind = doc.get("kind")
    name = f"{kind} {doc.get('metadata', {}).get('name')}"
    if kind == "Pod":
        yield name, doc.get("metadata") or {}, doc["spec"], []
    elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        t = doc["spec"]["template"]
        yield name, t.get("metadata") or {}, t["spec"], doc["spec"].get("volumeClaimTemplates") or []
    elif kind == "CronJob":
        t = doc["spec"]["jobTemplate"]["spec"]["template"]
        yield name, t.get("metadata") or {}, t["spec"], []


# The device plugin: exactly these controls, for its hostPath (the kubelet's socket directory)
# and root (it creates its socket there).
DEVICE_PLUGIN_EXEMPT = {"HostPath Volumes", "Volume Types", "Running as Non-root", "Running as Non-root user"}

errors = []
checked = []


def check_docs(label, docs):
    for doc in docs:
        for where, meta, spec, claims in pod_templates(doc):
            labels = meta.get("labels") or {}
            component = labels.get("app.kubernetes.io/component")
            broken = restricted(meta, spec)
            if component == "device-plugin":
                unexpected = broken - DEVICE_PLUGIN_EXEMPT
                if unexpected:
                    errors.append(f"{label}: {where} (needs the privileged level for its hostPath only) also "
                                  f"breaks {sorted(unexpected)}")
            elif broken:
                errors.append(f"{label}: {where} breaks Pod Security restricted: {sorted(broken)}")
            if labels.get("app.kubernetes.io/managed-by") == "dpukv-operator":
                own = dpukv_rules(meta, spec, component)
                if claims and not (spec.get("securityContext") or {}).get("fsGroup"):
                    own.add("a volume claim without fsGroup (a root-owned disk is not writable)")
                if own:
                    errors.append(f"{label}: {where}: {sorted(own)}")
            checked.append(f"{label}: {where}")


# --- The checks refuse what they are written for. ---
GOOD = {
    "metadata": {},
    "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "d", "emptyDir": {}}],
        "containers": [{"name": "c", "image": "x", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
    },
}
if restricted(GOOD["metadata"], GOOD["spec"]):
    errors.append(f"the checks refuse a restricted pod: {sorted(restricted(GOOD['metadata'], GOOD['spec']))}")


def c0(p):
    return p["spec"]["containers"][0]["securityContext"]


BAD = {
    "Host Namespaces": lambda p: p["spec"].__setitem__("hostPID", True),
    "Privileged Containers": lambda p: c0(p).__setitem__("privileged", True),
    "Capabilities (baseline)": lambda p: c0(p)["capabilities"].__setitem__("add", ["SYS_ADMIN"]),
    "HostPath Volumes": lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "Host Ports": lambda p: p["spec"]["containers"][0].__setitem__("ports", [{"containerPort": 80, "hostPort": 80}]),
    "Host Probes / Lifecycle Hooks": lambda p: p["spec"]["containers"][0].__setitem__(
        "livenessProbe", {"httpGet": {"host": "10.0.0.1", "port": 80}}),
    "AppArmor": lambda p: c0(p).__setitem__("appArmorProfile", {"type": "Unconfined"}),
    "SELinux": lambda p: c0(p).__setitem__("seLinuxOptions", {"type": "spc_t"}),
    "/proc Mount Type": lambda p: c0(p).__setitem__("procMount", "Unmasked"),
    "Sysctls": lambda p: p["spec"]["securityContext"].__setitem__("sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
    "Volume Types": lambda p: p["spec"]["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
    "Privilege Escalation": lambda p: c0(p).pop("allowPrivilegeEscalation"),
    "Running as Non-root": lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"),
    "Running as Non-root user": lambda p: c0(p).__setitem__("runAsUser", 0),
    "Seccomp": lambda p: p["spec"]["securityContext"].pop("seccompProfile"),
    "Seccomp (baseline)": lambda p: c0(p).__setitem__("seccompProfile", {"type": "Unconfined"}),
    "Capabilities": lambda p: c0(p).__setitem__("capabilities", {"drop": ["NET_RAW"]}),
}
for control, breaks in BAD.items():
    pod = copy.deepcopy(GOOD)
    breaks(pod)
    if control not in restricted(pod["metadata"], pod["spec"]):
        errors.append(f"the checks let through a pod that breaks {control}")

# --- The operator's pods. ---
if not os.access(RENDER, os.X_OK):
    sys.exit(f"{RENDER} is not built (cargo build -p dpukv-operator --bins)")
for path in sorted(glob.glob("manifests/examples/*.yaml")):
    for dpu in ([], ["--dpu"]):
        r = subprocess.run([RENDER, path, *dpu], capture_output=True, text=True)
        if r.returncode != 0:
            errors.append(f"dpukv-render {path}: {r.stderr.strip()}")
            continue
        check_docs(f"{path} {' '.join(dpu)}".strip(), [d for d in yaml.safe_load_all(r.stdout) if d])
operator_pods = len(checked)

# --- The chart's pods. ---
helm = kubetools.install_helm()
for values in [None, *sorted(glob.glob(f"{CHART}/ci/*-values.yaml"))]:
    args = [helm, "template", "dpukv", CHART, "--namespace", "dpukv-system", *(["-f", values] if values else [])]
    r = subprocess.run(args, capture_output=True, text=True, env=kubetools.helm_env())
    if r.returncode != 0:
        errors.append(f"helm template {values or '(defaults)'}: {r.stderr.strip()}")
        continue
    check_docs(values or "chart (defaults)", [d for d in yaml.safe_load_all(r.stdout) if d])

if operator_pods < 8:
    errors.append(f"only {operator_pods} pod templates of the operator's were checked")
if errors:
    print("pod security:\n  " + "\n  ".join(errors), file=sys.stderr)
    sys.exit(1)
print(f"pod security ok ({len(BAD)} wrong pods refused; {len(checked)} pod templates pass restricted — "
      f"{operator_pods} the operator's, {len(checked) - operator_pods} the chart's, the device plugin's "
      f"breaking only {sorted(DEVICE_PLUGIN_EXEMPT)})")
