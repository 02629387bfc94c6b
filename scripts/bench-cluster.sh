#!/usr/bin/env bash
# Replication cost: YCSB-A and YCSB-C on a local 3-node cluster with replication factor 3 and
# with replication factor 1 (same machine, same client, same concurrency). Prints dpukv-bench's
# lines per run. Knobs: RECORDS, SECONDS_RUN, THREADS, DEPTH, RUNS (runs per setting,
# alternating).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu --bin dpukv-gateway
BIN=target/release
RECORDS=${RECORDS:-200000}
SECONDS_RUN=${SECONDS_RUN:-10}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
RUNS=${RUNS:-2}
run() {
  local rf=$1 dir port ep
  dir=$(mktemp -d /tmp/dpukv-bench.XXXXXX)
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  ep="127.0.0.1:$port"
  $BIN/dpukv local --dir "$dir" --listen "$ep" --nodes 3 --replication "$rf" --split-keys user033,user066 2>/dev/null &
  local pid=$!
  for _ in $(seq 1 600); do
    if $BIN/dpukv --endpoint "$ep" regions 2>/dev/null | awk -F'\t' -v rf="$rf" '$4 == 0 || (rf > 1 && split($5, b, ",") != rf - 1) {bad=1} END {exit bad || NR != 3}'; then
      $BIN/dpukv --endpoint "$ep" put probe ok >/dev/null 2>&1 && break
    fi
    sleep 0.1
  done
  # The benchmark talks to node 1's device (the client routes to each region's primary device),
  # not through the gateway dpukv local starts on the --listen address.
  ep=$(python3 -c "import json; print(json.load(open('$dir/cluster.json'))['nodes'][0]['device'])")
  $BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --load-only --threads 4 >/dev/null
  for w in a c; do
    echo "rf=$rf $($BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --workload $w --duration "$SECONDS_RUN" --threads "$THREADS" --depth "$DEPTH")"
  done
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
}
for _ in $(seq 1 "$RUNS"); do
  run 3
  run 1
done
