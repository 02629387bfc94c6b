#!/usr/bin/env bash
# Hot-key replicas (docs/hot-keys.md): YCSB-C and YCSB-B at zipf 0.99 on a local 3-node cluster
# (replication factor 3, three regions: each node leads one and holds copies of the others'
# popular keys), the same client and concurrency reading `linearizable` (primaries only: the
# baseline) and `interleaved` / `extended` / `bounded:50` (replicas allowed). Prints
# dpukv-bench's lines, with the share of gets replicas served. Knobs: RECORDS, SECONDS_RUN,
# THREADS, DEPTH, RUNS, CAPACITY (popular keys per region: default 1% of RECORDS over the three
# regions), WINDOW (the admission window, hKVS's N), MODES.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu --bin dpukv-gateway
BIN=target/release
RECORDS=${RECORDS:-1000000}
SECONDS_RUN=${SECONDS_RUN:-10}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
RUNS=${RUNS:-1}
CAPACITY=${CAPACITY:-$((RECORDS / 100 / 3 + 1))}
WINDOW=${WINDOW:-800000}
MODES=${MODES:-"linearizable interleaved extended bounded:50"}
export DPUKV_POPULAR_CAPACITY=$CAPACITY DPUKV_POPULAR_WINDOW=$WINDOW DPUKV_POPULAR_K=4
dir=$(mktemp -d /tmp/dpukv-bench.XXXXXX)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ep="127.0.0.1:$port"
$BIN/dpukv local --dir "$dir" --listen "$ep" --nodes 3 --replication 3 --split-keys user033,user066 2>/dev/null &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 600); do
  if $BIN/dpukv --endpoint "$ep" regions 2>/dev/null | awk -F'\t' '$4 == 0 || split($5, b, ",") != 2 {bad=1} END {exit bad || NR != 3}'; then
    $BIN/dpukv --endpoint "$ep" put probe ok >/dev/null 2>&1 && break
  fi
  sleep 0.1
done
echo "regions (id, start, end, primary, backups, epoch):"
$BIN/dpukv --endpoint "$ep" regions
# Straight to the devices (the client routes each get by its consistency), as bench-cluster.sh.
ep=$(python3 -c "import json; print(json.load(open('$dir/cluster.json'))['nodes'][0]['device'])")
$BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --load-only --threads 4 >/dev/null
for _ in $(seq 1 "$RUNS"); do
  for w in c b; do
    for m in $MODES; do
      # A warm-up fills the popular sets (hKVS warms up too), then the measured run.
      $BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --workload $w --distribution zipf \
        --duration 3 --threads "$THREADS" --depth "$DEPTH" --consistency "$m" >/dev/null
      echo "$($BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --workload $w --distribution zipf \
        --duration "$SECONDS_RUN" --threads "$THREADS" --depth "$DEPTH" --consistency "$m")"
    done
  done
done
