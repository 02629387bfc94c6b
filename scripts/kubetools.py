"""The Python side of the Kubernetes checks (scripts/check-manifests.py, scripts/check-chart.py):
installs what they need with pip when it is missing — jsonschema, PyYAML and
kubernetes-validate — and says where kubernetes-validate is."""
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
