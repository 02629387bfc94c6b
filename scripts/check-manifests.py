#!/usr/bin/env python3
"""Checks the Kubernetes manifests with the real tools:
- every custom resource in manifests/examples/ (and below) against its generated CRD's openAPIV3Schema
  (jsonschema; Kubernetes' x-kubernetes-* keywords are ignored here — the CEL rules are run by
  operator/tests/crd.rs), and that the schema refuses a few wrong objects (a schema accepting
  anything would fail this);
- the objects the operator makes of each example (`dpukv-render`, with and without a DPU in the
  cluster) against Kubernetes 1.37's schemas, strictly (`kubernetes-validate --strict`: unknown
  fields are errors) — NetworkPolicies included —, and the cert-manager `Certificate`s it makes for
  `tls.certManager` against cert-manager's CRD schema (charts/test-schemas/), unknown fields
  refused.
Installs jsonschema, PyYAML and kubernetes-validate with pip when they are missing. Run from the
repository's root after `cargo build -p dpukv-operator --bins` (scripts/test.sh does)."""
import copy
import glob
import json
import subprocess
import sys


from kubetools import ensure  # noqa: E402  (scripts/kubetools.py)

KV = ensure()
import jsonschema  # noqa: E402
import yaml  # noqa: E402

crd = yaml.safe_load(open("manifests/crds/dpukv.io_dpukvclusters.yaml"))
version = crd["spec"]["versions"][0]
schema = version["schema"]["openAPIV3Schema"]
# Every generated CRD's schema, by kind: each example resource is checked against its own.
validators = {}
for path in sorted(glob.glob("manifests/crds/*.yaml")):
    c = yaml.safe_load(open(path))
    v = c["spec"]["versions"][0]
    validators[c["spec"]["names"]["kind"]] = (f"{c['spec']['group']}/{v['name']}", jsonschema.Draft4Validator(v["schema"]["openAPIV3Schema"]))
errors = []
examples = sorted(glob.glob("manifests/examples/**/*.yaml", recursive=True))
checked = 0
for path in examples:
    for doc in yaml.safe_load_all(open(path)):
        if not doc or doc.get("kind") not in validators:
            continue
        api_version, validator = validators[doc["kind"]]
        if doc.get("apiVersion") != api_version:
            errors.append(f"{path}: apiVersion {doc.get('apiVersion')}")
        for e in validator.iter_errors(doc):
            errors.append(f"{path}: {'/'.join(map(str, e.absolute_path))}: {e.message}")
        checked += 1
if checked < 9:
    errors.append(f"only {checked} example resources found")

base = yaml.safe_load(open("manifests/examples/minimal-emulator.yaml"))
bad = {
    "nodes as a string": lambda s: s.__setitem__("nodes", "three"),
    "nodes below 1": lambda s: s.__setitem__("nodes", 0),
    "an unknown device mode": lambda s: s.__setitem__("device", {"mode": "Fpga"}),
    "storage without a size": lambda s: s.__setitem__("storage", {}),
    "a backupIndex that is not send or build": lambda s: s.__setitem__("backupIndex", "copy"),
    "a gateway port out of range": lambda s: s.__setitem__("gateway", {"ports": {"http": 70000}}),
}
for what, change in bad.items():
    doc = copy.deepcopy(base)
    change(doc["spec"])
    if not list(validator.iter_errors(doc)):
        errors.append(f"the schema accepted {what}")
CERT_SCHEMA = json.load(open("charts/test-schemas/cert-manager.io_v1.json"))["Certificate"]


def strict(schema):
    """Unknown fields refused wherever properties are listed (as strict field validation does)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


cert_schema = strict(copy.deepcopy(CERT_SCHEMA))
cert_schema["properties"]["metadata"] = {"type": "object"}
cert_validator = jsonschema.Draft4Validator(cert_schema)
certificates = 0
rendered = 0
clusters = [p for p in examples if any(d and d.get("kind") == "DpuKvCluster" for d in yaml.safe_load_all(open(p)))]
for path in clusters:
    for dpu in ([], ["--dpu"]):
        objs = subprocess.run(["target/debug/dpukv-render", path, *dpu], capture_output=True, text=True)
        if objs.returncode != 0:
            errors.append(f"dpukv-render {path}: {objs.stderr.strip()}")
            continue
        docs = [d for d in yaml.safe_load_all(objs.stdout) if d]
        for d in docs:
            if d.get("apiVersion") == "cert-manager.io/v1":
                errs = [f"{path}: Certificate {d['metadata']['name']}: {'/'.join(map(str, e.absolute_path))}: "
                        f"{e.message}" for e in cert_validator.iter_errors(d)]
                errors.extend(errs)
                certificates += not errs
        builtin = yaml.safe_dump_all([d for d in docs if d.get("apiVersion") != "cert-manager.io/v1"])
        v = subprocess.run([KV, "--strict", "-k", "1.37.0", "-"], input=builtin, capture_output=True, text=True)
        out = (v.stdout + v.stderr).splitlines()
        rendered += sum(1 for line in out if "passed for resource" in line)
        if v.returncode != 0:
            errors += [f"{path} {' '.join(dpu)}: {line}" for line in out if "passed" not in line]
if errors:
    print("manifests invalid:\n  " + "\n  ".join(errors), file=sys.stderr)
    sys.exit(1)
print(f"manifests ok ({checked} example resources valid, {len(bad)} wrong ones refused; "
      f"{rendered} rendered objects valid for Kubernetes 1.37, {certificates} cert-manager Certificates valid "
      f"against cert-manager's schema)")
if certificates == 0:
    sys.exit("no cert-manager Certificate was rendered (manifests/examples/cert-manager.yaml?)")
