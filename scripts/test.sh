#!/usr/bin/env bash
# Every check and test, as CI runs it: formatting, lints, the dependency-direction rule, and the
# whole test suite (unit, model, concurrency, multi-process, corruption).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh nft=nftables ip=iproute2 redis-cli=redis-tools curl=curl openssl=openssl faketime=faketime  # partitions: network namespaces; the gateway: redis-cli, curl, openssl (TLS)

echo "== rustfmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== dependency direction"
python3 scripts/check-deps.py
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
