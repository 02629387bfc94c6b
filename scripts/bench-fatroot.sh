#!/usr/bin/env bash
# Fat root and start hints (docs/hot-keys.md §9): one node pod (host + device), RECORDS records,
# YCSB-C at zipf 0.99 and uniform, the same client and concurrency with --fat-root 0 (every get
# from the root) and with fat roots of FAT_ROOTS nodes, alternating, RUNS rounds. Per run: the
# device's node visits per get, the share of gets that used their hint, the device's CPU time per
# get (from /proc), the client's CPU per operation (its own report), and throughput. Knobs: RECORDS, SECONDS_RUN, THREADS, DEPTH, RUNS, FAT_ROOTS,
# DISTRIBUTIONS, WORKLOAD (c; e: YCSB-E, short scans, whose first descent is hinted), BENCH_DIR,
# BIN (prebuilt binaries; else target/release, built first), PERF_OUT (a directory: `perf record`
# the device during each measured run into it).
set -euo pipefail
cd "$(dirname "$0")/.."
RECORDS=${RECORDS:-1000000}
SECONDS_RUN=${SECONDS_RUN:-10}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
RUNS=${RUNS:-2}
FAT_ROOTS=${FAT_ROOTS:-"0 4096 16384"}
DISTRIBUTIONS=${DISTRIBUTIONS:-"zipf uniform"}
WORKLOAD=${WORKLOAD:-c}
bash scripts/setup.sh
if [ -z "${BIN:-}" ]; then
  BIN=target/release
  cargo build --release --quiet --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu
fi
DIR=$(mktemp -d "${BENCH_DIR:-/tmp}/dpukv-bench.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
$BIN/dpukv-node --data-dir "$DIR/data" --shm-dir "$DIR/shm" --fsync never 2>"$DIR/host.log" &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q "host serving" "$DIR/host.log" 2>/dev/null && break; sleep 0.1; done
PORT=$(free_port); ADMIN=$(free_port)
$BIN/dpukv-dpu --shm-dir "$DIR/shm" --listen "127.0.0.1:$PORT" --admin "127.0.0.1:$ADMIN" 2>"$DIR/device.log" &
DEVICE=$!; PIDS+=("$DEVICE")
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$ADMIN/readyz" >/dev/null && break; sleep 0.1; done
EP="127.0.0.1:$PORT"
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --load-only --threads 4 >/dev/null
metric() { curl -s "http://127.0.0.1:$ADMIN/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
cpu() { awk '{print $14 + $15}' "/proc/$DEVICE/stat"; }  # device user + system, in clock ticks
TICK=$(getconf CLK_TCK)
for run in $(seq 1 "$RUNS"); do
  for d in $DISTRIBUTIONS; do
    for f in $FAT_ROOTS; do
      # Warm-up: the client builds its fat roots (in the background) from the gets it sees.
      $BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --workload "$WORKLOAD" --distribution "$d" \
        --duration 3 --threads "$THREADS" --depth "$DEPTH" --fat-root "$f" >/dev/null
      v0=$(metric dpukv_device_node_visits_total); h0=$(metric dpukv_device_hinted_reads_total)
      r0=$(metric dpukv_device_reads_served_total); c0=$(cpu)
      PERF=""
      if [ -n "${PERF_OUT:-}" ]; then  # a profile of the device during the measured run
        mkdir -p "$PERF_OUT"
        perf record -q -F 999 -p "$DEVICE" -o "$PERF_OUT/device-$WORKLOAD-$d-$f-$run.data" -- sleep "$SECONDS_RUN" 2>/dev/null &
        PERF=$!
      fi
      line=$($BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --workload "$WORKLOAD" --distribution "$d" \
        --duration "$SECONDS_RUN" --threads "$THREADS" --depth "$DEPTH" --fat-root "$f")
      v1=$(metric dpukv_device_node_visits_total); h1=$(metric dpukv_device_hinted_reads_total)
      r1=$(metric dpukv_device_reads_served_total); c1=$(cpu)
      if [ -n "$PERF" ]; then wait "$PERF" || true; fi
      python3 - "$d" "$f" "$v0" "$v1" "$h0" "$h1" "$r0" "$r1" "$c0" "$c1" "$TICK" "$line" <<'PY'
import sys
d, f, v0, v1, h0, h1, r0, r1, c0, c1, tick, line = sys.argv[1:]
gets = float(r1) - float(r0)
visits = (float(v1) - float(v0)) / gets
hinted = (float(h1) - float(h0)) / gets
cpu_us = (float(c1) - float(c0)) / float(tick) * 1e6 / gets
tput = line.split(": ")[1].split(" ops/s")[0]
client = line.split("client CPU ")[1].split(" us/op")[0]
print(f"{d:8} fat-root {f:>6}: {visits:.2f} node visits/read, {hinted*100:5.1f}% hinted, device CPU {cpu_us:.2f} us/read, "
      f"client CPU {client} us/op, {tput} ops/s")
PY
    done
  done
done
