#!/usr/bin/env python3
"""Checks the workspace's dependency direction (docs/architecture.md §1.2) over `cargo metadata`.

storage, proto, backup (object storage) and fabric (libfabric transport) at the bottom; net
(server connections) on proto and fabric;
cluster on proto; node on storage, proto, net, cluster, backup, and client + gateway (the
device runs the gateway's front ends in its own process: the front door); gateway on proto, net, cluster,
client; client on proto, net (TLS) and backup (the `dpukv backup` commands); only operator
depends on kube; nothing depends on e2e; the
storage engine has no tokio, no sockets framework and no Kubernetes.
"""
import json
import subprocess
import sys

ALLOWED = {
    "dpukv-storage": set(),
    "dpukv-proto": set(),
    "dpukv-fabric": set(),
    "dpukv-net": {"dpukv-proto", "dpukv-fabric"},
    "dpukv-cluster": {"dpukv-proto"},
    "dpukv-backup": set(),
    "dpukv-alloc-count": set(),  # test support (a dev-dependency only)
    "dpukv-node": {
        "dpukv-storage",
        "dpukv-proto",
        "dpukv-net",
        "dpukv-cluster",
        "dpukv-backup",
        "dpukv-client",
        "dpukv-gateway",
    },
    "dpukv-gateway": {"dpukv-proto", "dpukv-net", "dpukv-cluster", "dpukv-client"},
    "dpukv-client": {"dpukv-proto", "dpukv-net", "dpukv-backup"},
    "dpukv-operator": {"dpukv-proto", "dpukv-cluster", "dpukv-net"},
    "dpukv-device-plugin": {"dpukv-proto", "dpukv-net"},
    "dpukv-e2e": None,  # may depend on anything; nothing may depend on it
}
FORBIDDEN_EXTERNAL = {
    "dpukv-storage": {"tokio", "kube", "k8s-openapi", "hyper", "axum", "tonic"},
}
KUBE = {"kube", "k8s-openapi", "kube-runtime", "kube-client"}

meta = json.loads(subprocess.check_output(["cargo", "metadata", "--format-version", "1", "--no-deps", "--locked"]))
members = {p["name"]: p for p in meta["packages"]}
errors = []
for name, pkg in members.items():
    if name not in ALLOWED:
        errors.append(f"{name}: not in the architecture's crate list (add it to scripts/check-deps.py)")
        continue
    normal = {d["name"] for d in pkg["dependencies"] if d.get("kind") in (None, "normal", "build")}
    internal = {d for d in normal if d in members}
    allowed = ALLOWED[name]
    if allowed is not None and not internal <= allowed:
        errors.append(f"{name} depends on {sorted(internal - allowed)}, allowed: {sorted(allowed)}")
    if "dpukv-e2e" in {d["name"] for d in pkg["dependencies"]} and name != "dpukv-e2e":
        errors.append(f"{name} depends on dpukv-e2e")
    if name != "dpukv-operator" and normal & KUBE:
        errors.append(f"{name} depends on {sorted(normal & KUBE)}; only dpukv-operator may")
    bad = normal & FORBIDDEN_EXTERNAL.get(name, set())
    if bad:
        errors.append(f"{name} must not depend on {sorted(bad)}")
if errors:
    print("dependency direction violated:\n  " + "\n  ".join(errors), file=sys.stderr)
    sys.exit(1)
print(f"dependency direction ok ({len(members)} crates)")
