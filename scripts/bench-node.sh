#!/usr/bin/env bash
# Node benchmarks over loopback, all in one run (ratios are what count on a shared machine):
#   YCSB-C and YCSB-E with reads on the device vs --serve-reads-on-host,
#   hot single-key fetch_add through the reservation station vs one read-modify-write per op,
#   YCSB-C, -E and -A against Redis (no persistence) with the same concurrency and depth.
# Prints one JSON object per run (dpukv-bench --json) and a summary. Installs redis-server if
# needed. Settings: RECORDS (1000000), SECONDS_RUN (5), THREADS (4), DEPTH (16).
set -euo pipefail
cd "$(dirname "$0")/.."
RECORDS=${RECORDS:-1000000}
SECONDS_RUN=${SECONDS_RUN:-5}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
VALUE=${VALUE_SIZE:-64}
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
cargo build --release --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu >/dev/null 2>&1
BIN=target/release
DIR=$(mktemp -d /tmp/dpukv-bench.XXXXXX)
OUT="$DIR/results.jsonl"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_host() { # fsync policy, extra flags...
  local fsync=$1; shift
  $BIN/dpukv-node --data-dir "$DIR/data" --shm-dir "$DIR/shm" --fsync "$fsync" "$@" 2>"$DIR/host.log" &
  HOST=$!; PIDS+=("$HOST")
  for _ in $(seq 1 100); do grep -q "host serving" "$DIR/host.log" 2>/dev/null && return; sleep 0.1; done
  echo "host did not start" >&2; exit 1
}
start_device() { # extra flags...
  PORT=$(free_port)
  $BIN/dpukv-dpu --shm-dir "$DIR/shm" --listen "127.0.0.1:$PORT" "$@" 2>"$DIR/device.log" &
  DEVICE=$!; PIDS+=("$DEVICE")
  for _ in $(seq 1 100); do grep -q "device serving" "$DIR/device.log" 2>/dev/null && return; sleep 0.1; done
  echo "device did not start" >&2; exit 1
}
stop() { kill "$1"; wait "$1" 2>/dev/null || true; }
run() { # label, then dpukv-bench flags
  local label=$1; shift
  $BIN/dpukv-bench --json --records "$RECORDS" --value-size "$VALUE" --threads "$THREADS" --depth "$DEPTH" --duration "$SECONDS_RUN" "$@" \
    | sed "s/^{/{\"label\":\"$label\",/" | tee -a "$OUT"
}

echo "== dpukv (fsync interval:5): load $RECORDS records" >&2
start_host interval:5
start_device
$BIN/dpukv-bench --endpoint "127.0.0.1:$PORT" --records "$RECORDS" --value-size "$VALUE" --threads 8 --load-only >&2
for w in c e a; do run "dpukv_device_$w" --endpoint "127.0.0.1:$PORT" --workload $w; done
stop "$DEVICE"
start_device --serve-reads-on-host
for w in c e; do run "dpukv_host_$w" --endpoint "127.0.0.1:$PORT" --workload $w; done
stop "$DEVICE"; stop "$HOST"
# Writes without syncing, like the Redis below (no persistence).
start_host never
start_device
run dpukv_device_a_nofsync --endpoint "127.0.0.1:$PORT" --workload a
stop "$DEVICE"; stop "$HOST"
# Atomics: every acknowledged fetch_add durable (fsync always), merged vs one append per op.
start_host always
start_device
run dpukv_fetch_add_station --endpoint "127.0.0.1:$PORT" --workload counter --hot-keys 1
stop "$DEVICE"; stop "$HOST"
start_host always --no-reservation-station
start_device
run dpukv_fetch_add_per_op --endpoint "127.0.0.1:$PORT" --workload counter --hot-keys 1
stop "$DEVICE"; stop "$HOST"

echo "== redis: load $RECORDS records" >&2
RPORT=$(free_port)
redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >/dev/null &
REDIS=$!; PIDS+=("$REDIS")
sleep 0.5
$BIN/dpukv-bench --target "redis://127.0.0.1:$RPORT" --records "$RECORDS" --value-size "$VALUE" --threads 8 --load-only >&2
for w in c e a; do run "redis_$w" --target "redis://127.0.0.1:$RPORT" --workload $w; done
stop "$REDIS"

python3 - "$OUT" <<'PY'
import json, sys
r = {j["label"]: j for j in map(json.loads, open(sys.argv[1]))}
t = lambda k: r[k]["throughput_ops"]
print()
print("| comparison | dpukv | peer | ratio |")
print("|---|---|---|---|")
for name, a, b in [
    ("YCSB-C: reads on the device vs on the host", "dpukv_device_c", "dpukv_host_c"),
    ("YCSB-E: reads on the device vs on the host", "dpukv_device_e", "dpukv_host_e"),
    ("hot fetch_add (fsync always): reservation station vs per-op", "dpukv_fetch_add_station", "dpukv_fetch_add_per_op"),
    ("YCSB-C vs Redis", "dpukv_device_c", "redis_c"),
    ("YCSB-E vs Redis", "dpukv_device_e", "redis_e"),
    ("YCSB-A (fsync interval:5) vs Redis (no persistence)", "dpukv_device_a", "redis_a"),
    ("YCSB-A (fsync never) vs Redis (no persistence)", "dpukv_device_a_nofsync", "redis_a"),
]:
    print(f"| {name} | {t(a):,.0f} ops/s | {t(b):,.0f} ops/s | {t(a)/t(b):.2f}x |")
PY
