#!/usr/bin/env bash
# The main job on a fresh machine: build dpukv, start a local node pod (`dpukv local`: a host and
# a device process) on a temp directory, load records through the client, run a short YCSB
# workload with dpukv-bench, print the result, and stop the pod.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu
BIN=target/release
DIR=$(mktemp -d /tmp/dpukv-demo.XXXXXX)
PORT=${DPUKV_DEMO_PORT:-7070}
RECORDS=${DPUKV_DEMO_RECORDS:-200000}
SECONDS_RUN=${DPUKV_DEMO_SECONDS:-5}
$BIN/dpukv local --dir "$DIR" --listen "127.0.0.1:$PORT" &
POD=$!
cleanup() { kill -INT "$POD" 2>/dev/null || true; wait "$POD" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
for _ in $(seq 1 100); do
  $BIN/dpukv --endpoint "127.0.0.1:$PORT" get demo:probe >/dev/null 2>&1 && break
  [ $? -eq 1 ] && break
  sleep 0.1
done
echo "== a few operations"
$BIN/dpukv --endpoint "127.0.0.1:$PORT" put greeting "hello from dpukv"
$BIN/dpukv --endpoint "127.0.0.1:$PORT" get greeting
$BIN/dpukv --endpoint "127.0.0.1:$PORT" fetch-add visits 1 >/dev/null
$BIN/dpukv --endpoint "127.0.0.1:$PORT" fetch-add visits 1
echo "== load $RECORDS records, then YCSB-C (reads on the device), YCSB-A and YCSB-E for ${SECONDS_RUN}s each"
$BIN/dpukv-bench --endpoint "127.0.0.1:$PORT" --records "$RECORDS" --load-only --threads 4
$BIN/dpukv-bench --endpoint "127.0.0.1:$PORT" --records "$RECORDS" --workload c --duration "$SECONDS_RUN"
$BIN/dpukv-bench --endpoint "127.0.0.1:$PORT" --records "$RECORDS" --workload a --duration "$SECONDS_RUN"
$BIN/dpukv-bench --endpoint "127.0.0.1:$PORT" --records "$RECORDS" --workload e --duration "$SECONDS_RUN"
