#!/usr/bin/env bash
# Node benchmarks over loopback, all in one run (ratios are what count on a shared machine):
#   YCSB-C and YCSB-E with reads on the device vs --serve-reads-on-host;
#   hot single-key fetch_add through the reservation station vs one read-modify-write per op
#   (fsync always);
#   YCSB-A on dpukv with --fsync always, interval:5 and never;
#   YCSB-C, -E and -A on Redis with no persistence, with --appendonly yes --appendfsync always and
#   with --appendonly yes --appendfsync everysec, driven by the same dpukv-bench with the same
#   settings (same connections, requests in flight, records, keys and values); Redis's data dir
#   sits next to dpukv's, on the same file system;
#   redis-benchmark -t get,set against the Redis with no persistence, as an outside reference for
#   dpukv-bench's Redis driver.
# Prints one JSON object per run (dpukv-bench --json), every run in a table, and the ratios.
# Installs redis-server and redis-tools if they are missing; stops every process it starts.
# Settings: RECORDS (1000000), SECONDS_RUN (5), THREADS (4), DEPTH (16), VALUE_SIZE (64),
# CLIENT_THREADS (1: dpukv-bench on a single-threaded runtime, like redis-benchmark, so the
# client takes as little of the shared cores as it can — for every system alike),
# BENCH_DIR (where the data dirs go: a new temp dir under /tmp by default; not tmpfs, or fsync
# costs nothing), BIN (the binaries; target/release by default, built first; when set, nothing is
# built).
set -euo pipefail
cd "$(dirname "$0")/.."
RECORDS=${RECORDS:-1000000}
SECONDS_RUN=${SECONDS_RUN:-5}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
VALUE=${VALUE_SIZE:-64}
CLIENT_THREADS=${CLIENT_THREADS:-1}
bash scripts/setup.sh redis-server=redis-server redis-benchmark=redis-tools redis-cli=redis-tools
if [ -z "${BIN:-}" ]; then
  BIN=target/release
  cargo build --release --quiet --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu
fi
DIR=$(mktemp -d "${BENCH_DIR:-/tmp}/dpukv-bench.XXXXXX")
OUT="$DIR/results.jsonl"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ "$(stat -f -c %T "$DIR")" = tmpfs ]; then
  echo "warning: $DIR is on tmpfs, where fsync costs nothing; set BENCH_DIR to a directory on a disk" >&2
fi
echo "== data dirs in $DIR ($(df -P "$DIR" | awk 'NR == 2 {print $1}'), $(stat -f -c %T "$DIR"))" >&2
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
start_redis() { # name, redis-server flags...
  local name=$1; shift
  RPORT=$(free_port)
  mkdir -p "$DIR/redis-$name"
  redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --dir "$DIR/redis-$name" --daemonize no "$@" \
    >"$DIR/redis-$name.log" 2>&1 &
  REDIS=$!; PIDS+=("$REDIS")
  for _ in $(seq 1 100); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && return; sleep 0.1; done
  echo "redis ($name) did not start" >&2; exit 1
}
stop() { # pid: stops it and forgets it (so cleanup never signals a reused pid)
  kill "$1"; wait "$1" 2>/dev/null || true
  local keep=() p
  for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
  PIDS=("${keep[@]}")
}
bench() { # dpukv-bench flags; the settings every run and load shares
  $BIN/dpukv-bench --client-threads "$CLIENT_THREADS" --records "$RECORDS" --value-size "$VALUE" --depth "$DEPTH" "$@"
}
load() { bench --threads 8 --load-only "$@" >&2; }
run() { # label, then dpukv-bench flags
  local label=$1; shift
  bench --json --threads "$THREADS" --duration "$SECONDS_RUN" "$@" | sed "s/^{/{\"label\":\"$label\",/" | tee -a "$OUT"
}

echo "== dpukv (fsync interval:5): load $RECORDS records" >&2
start_host interval:5
start_device
load --endpoint "127.0.0.1:$PORT"
for w in c e; do run "dpukv_device_$w" --endpoint "127.0.0.1:$PORT" --workload $w; done
run dpukv_device_a_interval5 --endpoint "127.0.0.1:$PORT" --workload a
stop "$DEVICE"
start_device --serve-reads-on-host
for w in c e; do run "dpukv_host_$w" --endpoint "127.0.0.1:$PORT" --workload $w; done
stop "$DEVICE"; stop "$HOST"
echo "== dpukv (fsync always): YCSB-A; fetch_add through the reservation station and per op" >&2
start_host always
start_device
run dpukv_device_a_always --endpoint "127.0.0.1:$PORT" --workload a
run dpukv_fetch_add_station --endpoint "127.0.0.1:$PORT" --workload counter --hot-keys 1
stop "$DEVICE"; stop "$HOST"
start_host always --no-reservation-station
start_device
run dpukv_fetch_add_per_op --endpoint "127.0.0.1:$PORT" --workload counter --hot-keys 1
stop "$DEVICE"; stop "$HOST"
echo "== dpukv (fsync never): YCSB-A" >&2
start_host never
start_device
run dpukv_device_a_never --endpoint "127.0.0.1:$PORT" --workload a
stop "$DEVICE"; stop "$HOST"

for mode in none always everysec; do
  echo "== redis (persistence: $mode): load $RECORDS records" >&2
  case $mode in
    none) start_redis $mode --appendonly no ;;
    *) start_redis $mode --appendonly yes --appendfsync $mode ;;
  esac
  load --target "redis://127.0.0.1:$RPORT"
  for w in c e a; do run "redis_${mode}_$w" --target "redis://127.0.0.1:$RPORT" --workload $w; done
  if [ $mode = none ]; then
    echo "== redis-benchmark -c $THREADS -P $DEPTH -t get,set -n $RECORDS -d $VALUE" >&2
    redis-benchmark -p "$RPORT" -c "$THREADS" -P "$DEPTH" -t get,set -n "$RECORDS" -d "$VALUE" --csv \
      | tee "$DIR/redis-benchmark.csv"
  fi
  stop "$REDIS"
done

python3 - "$OUT" "$DIR/redis-benchmark.csv" <<'PY'
import csv, json, sys
r = {j["label"]: j for j in map(json.loads, open(sys.argv[1]))}
t = lambda k: r[k]["throughput_ops"]
print()
print("| label | throughput (ops/s) | p50 (us) | p99 (us) | p99.9 (us) | errors | client CPU (us/op) |")
print("|---|---|---|---|---|---|---|")
for k, j in r.items():
    cpu = j.get("client_cpu_us_per_op")
    cpu = "-" if cpu is None else f"{cpu:.2f}"
    print(f"| {k} | {t(k):,.0f} | {j['p50_us']} | {j['p99_us']} | {j['p999_us']} | {j['errors']} | {cpu} |")
print()
print("| comparison | dpukv | peer | ratio |")
print("|---|---|---|---|")
for name, a, b in [
    ("YCSB-C: reads on the device vs on the host", "dpukv_device_c", "dpukv_host_c"),
    ("YCSB-E: reads on the device vs on the host", "dpukv_device_e", "dpukv_host_e"),
    ("hot fetch_add (fsync always): reservation station vs per-op", "dpukv_fetch_add_station", "dpukv_fetch_add_per_op"),
    ("YCSB-C vs Redis (no persistence)", "dpukv_device_c", "redis_none_c"),
    ("YCSB-E vs Redis (no persistence)", "dpukv_device_e", "redis_none_e"),
    ("YCSB-A: fsync always vs Redis appendfsync always", "dpukv_device_a_always", "redis_always_a"),
    ("YCSB-A: fsync interval:5 vs Redis appendfsync everysec", "dpukv_device_a_interval5", "redis_everysec_a"),
    ("YCSB-A: fsync never vs Redis (no persistence)", "dpukv_device_a_never", "redis_none_a"),
]:
    print(f"| {name} | {t(a):,.0f} ops/s | {t(b):,.0f} ops/s | {t(a)/t(b):.2f}x |")
print()
rows = {row["test"]: float(row["rps"]) for row in csv.DictReader(open(sys.argv[2]))}
print("Outside reference (redis-benchmark, same connections and pipeline depth, Redis with no persistence):")
for test, rps in rows.items():
    print(f"  redis-benchmark {test}: {rps:,.0f} requests/s")
if "GET" in rows:
    print(f"  dpukv-bench's Redis driver, YCSB-C (GET only): {t('redis_none_c'):,.0f} ops/s = {t('redis_none_c') / rows['GET']:.2f}x redis-benchmark GET")
PY
