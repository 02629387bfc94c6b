#!/usr/bin/env python3
"""Validates every custom resource in manifests/examples/ against the generated CRD's
openAPIV3Schema (jsonschema; Kubernetes' x-kubernetes-* keywords are ignored here — the CEL rules
are run by operator/tests/crd.rs), and checks that the schema refuses a few wrong objects (so a
schema that accepted anything would fail this check). Installs python3-jsonschema and
python3-yaml (Debian) when they are missing."""
import copy
import glob
import subprocess
import sys

try:
    import jsonschema
    import yaml
except ImportError:
    subprocess.check_call(["bash", "-c", "SUDO=; [ \"$(id -u)\" -eq 0 ] || SUDO=sudo; "
                           "$SUDO apt-get install -y -qq python3-jsonschema python3-yaml >/dev/null"])
    import jsonschema
    import yaml

crd = yaml.safe_load(open("manifests/crds/dpukv.io_dpukvclusters.yaml"))
version = crd["spec"]["versions"][0]
schema = version["schema"]["openAPIV3Schema"]
validator = jsonschema.Draft4Validator(schema)
errors = []
examples = sorted(glob.glob("manifests/examples/*.yaml"))
checked = 0
for path in examples:
    for doc in yaml.safe_load_all(open(path)):
        if not doc or doc.get("kind") != "DpuKvCluster":
            continue
        if doc.get("apiVersion") != f"{crd['spec']['group']}/{version['name']}":
            errors.append(f"{path}: apiVersion {doc.get('apiVersion')}")
        for e in validator.iter_errors(doc):
            errors.append(f"{path}: {'/'.join(map(str, e.absolute_path))}: {e.message}")
        checked += 1
if checked < 4:
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
if errors:
    print("manifests invalid:\n  " + "\n  ".join(errors), file=sys.stderr)
    sys.exit(1)
print(f"manifests ok ({checked} example resources valid, {len(bad)} wrong ones refused)")
