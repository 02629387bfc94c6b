#!/usr/bin/env bash
# Every check and test, as CI runs it: formatting, lints, the dependency-direction rule, and the
# whole test suite (unit, model, concurrency, multi-process, corruption).
set -euo pipefail
cd "$(dirname "$0")/.."
# On CI (a clean clone built once) incremental compilation only costs disk: 3.8 of the debug
# target's 10.5 GB, enough to fill a small CI disk (a run failed with ENOSPC in etcd's data dir).
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0; fi
bash scripts/setup.sh nft=nftables ip=iproute2 redis-cli=redis-tools curl=curl openssl=openssl faketime=faketime chromium=chromium chromedriver=chromium-driver  # partitions: network namespaces; the gateway: redis-cli, curl, openssl (TLS); the web console's browser tests: headless Chromium and its WebDriver
# The backup tests' S3-protocol server (moto's, from PyPI); pip on a Debian system Python needs
# --break-system-packages.
if ! python3 -c "import moto.server, flask" 2>/dev/null; then
  python3 -m pip --version >/dev/null 2>&1 || bash scripts/setup.sh pip3=python3-pip
  python3 -m pip install -q 'moto[server]' 2>/dev/null || python3 -m pip install -q --break-system-packages 'moto[server]'
fi

echo "== rustfmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== dependency direction"
python3 scripts/check-deps.py
echo "== the backup benchmark's history checker finds what it is for"
python3 scripts/check-backup-history.py --self-test
echo "== manifests (the CRD's schema against the examples; rendered objects against Kubernetes 1.37)"
cargo build --locked -p dpukv-operator --bins
python3 scripts/check-manifests.py
echo "== helm chart (lint, objects against Kubernetes 1.37 and the CRDs, the values schema, install.yaml)"
python3 scripts/check-chart.py
echo "== pod security (every pod the operator and the chart render passes Pod Security restricted)"
python3 scripts/check-pod-security.py
echo "== tests"
if command -v cargo-nextest >/dev/null || cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
echo "== container image (umoci, offline)"
PROFILE=debug OUT=target/oci-ci bash scripts/image.sh
