#!/usr/bin/env bash
# Hot-key replicas (docs/hot-keys.md): YCSB-C and YCSB-B at zipf 0.99 on a local 3-node cluster
# (replication factor 3, three regions: each node leads one and holds copies of the others'
# popular keys), the same client and concurrency reading `linearizable` (primaries only: the
# baseline) and `interleaved` / `extended` / `bounded:50` (replicas allowed). Prints
# dpukv-bench's lines, with the share of gets replicas served. Knobs: RECORDS, SECONDS_RUN,
# THREADS, DEPTH, RUNS, CAPACITY (popular keys per region: default 1% of RECORDS over the
# regions), WINDOW (the admission window, hKVS's N), GATE (the popular sets' frequency gate:
# true, or false for the paper's plain LRU), SPLIT_KEYS (default user033,user066: three regions,
# one led by each node; empty: one region led by one node, whose two backups' devices hold the
# copies — hKVS's topology of one primary and helpers), BUSY (`extended`'s threshold: requests in
# flight from one connection's client above which a primary is busy; default the client's, 32 —
# more than DEPTH, so extended then never uses a replica), MODES, PERF_OUT (a directory: `perf
# record` node 1's device during each measured run into it). After each measured run: each
# device's CPU time (from /proc) and the gets per CPU-second of the busiest device.
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
SPLIT_KEYS=${SPLIT_KEYS-user033,user066}
REGIONS=$(( $(echo "$SPLIT_KEYS" | tr ',' '\n' | grep -c . || true) + 1 ))
CAPACITY=${CAPACITY:-$((RECORDS / 100 / REGIONS + 1))}
WINDOW=${WINDOW:-800000}
GATE=${GATE:-true}
BUSY_ARGS=()
if [ -n "${BUSY:-}" ]; then BUSY_ARGS=(--busy-in-flight "$BUSY"); fi
MODES=${MODES:-"linearizable interleaved extended bounded:50"}
export DPUKV_POPULAR_CAPACITY=$CAPACITY DPUKV_POPULAR_WINDOW=$WINDOW DPUKV_POPULAR_K=4 DPUKV_POPULAR_GATE=$GATE
dir=$(mktemp -d /tmp/dpukv-bench.XXXXXX)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ep="127.0.0.1:$port"
$BIN/dpukv local --dir "$dir" --listen "$ep" --nodes 3 --replication 3 --split-keys "$SPLIT_KEYS" 2>/dev/null &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 600); do
  if $BIN/dpukv --endpoint "$ep" regions 2>/dev/null | awk -F'\t' -v n="$REGIONS" '$4 == 0 || split($5, b, ",") != 2 {bad=1} END {exit bad || NR != n}'; then
    $BIN/dpukv --endpoint "$ep" put probe ok >/dev/null 2>&1 && break
  fi
  sleep 0.1
done
echo "regions (id, start, end, primary, backups, epoch):"
$BIN/dpukv --endpoint "$ep" regions
# Straight to the devices (the client routes each get by its consistency), as bench-cluster.sh.
ep=$(python3 -c "import json; print(json.load(open('$dir/cluster.json'))['nodes'][0]['device'])")
DEVICE_PIDS=$(python3 -c "import json; print(' '.join(str(n['device_pid']) for n in json.load(open('$dir/cluster.json'))['nodes']))")
TICK=$(getconf CLK_TCK)
cpus() { for p in $DEVICE_PIDS; do awk '{printf "%s ", $14 + $15}' "/proc/$p/stat"; done; }
$BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --load-only --threads 4 >/dev/null
for run in $(seq 1 "$RUNS"); do
  for w in c b; do
    for m in $MODES; do
      # A warm-up fills the popular sets (hKVS warms up too), then the measured run.
      $BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --workload $w --distribution zipf \
        --duration 3 --threads "$THREADS" --depth "$DEPTH" --consistency "$m" "${BUSY_ARGS[@]}" >/dev/null
      c0=$(cpus)
      PERF=""
      if [ -n "${PERF_OUT:-}" ]; then
        mkdir -p "$PERF_OUT"
        perf record -q -F 999 -p "${DEVICE_PIDS%% *}" -o "$PERF_OUT/device1-$w-${m%%:*}-$run.data" -- sleep "$SECONDS_RUN" 2>/dev/null &
        PERF=$!
      fi
      out=$($BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --workload $w --distribution zipf \
        --duration "$SECONDS_RUN" --threads "$THREADS" --depth "$DEPTH" --consistency "$m" "${BUSY_ARGS[@]}")
      c1=$(cpus)
      if [ -n "$PERF" ]; then wait "$PERF" || true; fi
      echo "$out"
      # Each device's CPU seconds, and what would bound throughput with a machine (or DPU) per
      # device: operations per CPU-second of the busiest device.
      python3 - "$c0" "$c1" "$TICK" "$SECONDS_RUN" "$out" <<'PY'
import re, sys
c0, c1, tick, run, out = sys.argv[1:]
secs = [(float(b) - float(a)) / float(tick) for a, b in zip(c0.split(), c1.split())]
ops = float(re.search(r"([0-9.]+) ops/s", out).group(1)) * float(run)
print("device CPU s: " + ", ".join(f"{s:.2f}" for s in secs) +
      f"; busiest {max(secs) / sum(secs) * 100:.0f}% of the devices' CPU, "
      f"{ops / max(secs):.0f} ops per CPU-second of the busiest device")
PY
    done
  done
done
