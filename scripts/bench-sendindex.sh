#!/usr/bin/env bash
# Send Index vs Build Index on real processes: a local 3-node cluster, one region with three
# replicas (one primary host, two backup hosts), the same YCSB-A run against each mode; reports
# the backup hosts' CPU time (utime + stime from /proc/<pid>/stat) per replicated write
# (the primary's dpukv_host_writes_total), measured from the run's start until SETTLE seconds
# after it (the backups' index work trails the stream in both modes). Knobs: RECORDS,
# SECONDS_RUN, SETTLE, THREADS, DEPTH, VALUE_SIZE, RUNS (runs per mode, alternating).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu --bin dpukv-gateway
BIN=target/release
RECORDS=${RECORDS:-200000}
SECONDS_RUN=${SECONDS_RUN:-20}
SETTLE=${SETTLE:-5}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
VALUE_SIZE=${VALUE_SIZE:-100}
RUNS=${RUNS:-2}

# Prints "<backup host CPU seconds> <writes applied by the primary>" between two snapshots.
snapshot() {
  python3 - "$1" "$2" <<'EOF'
import json, sys, urllib.request
d, ep = sys.argv[1], sys.argv[2]
c = json.load(open(f"{d}/cluster.json"))
regions = [l.split("\t") for l in open(f"{d}/regions.txt").read().splitlines() if l]
primary = int(regions[0][3])
tick = 100.0
cpu = 0.0
for n in c["nodes"]:
    if n["id"] == primary:
        body = urllib.request.urlopen(f"http://{n['admin']}/metrics").read().decode()
        writes = next(float(l.split()[-1]) for l in body.splitlines() if l.startswith("dpukv_host_writes_total"))
    else:
        f = open(f"/proc/{n['host_pid']}/stat").read().rsplit(")", 1)[1].split()
        cpu += (int(f[11]) + int(f[12])) / tick
print(f"{cpu} {writes}")
EOF
}

run() {
  local mode=$1 dir port ep pid
  dir=$(mktemp -d /tmp/dpukv-sendindex.XXXXXX)
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  ep="127.0.0.1:$port"
  $BIN/dpukv local --dir "$dir" --listen "$ep" --nodes 3 --replication 3 --split-keys "" \
    --backup-index "$mode" 2>/dev/null &
  pid=$!
  for _ in $(seq 1 600); do
    if $BIN/dpukv --endpoint "$ep" regions 2>/dev/null | awk -F'\t' '$4 == 0 || split($5, b, ",") != 2 {bad=1} END {exit bad || NR != 1}'; then
      $BIN/dpukv --endpoint "$ep" put probe ok >/dev/null 2>&1 && break
    fi
    sleep 0.1
  done
  # The benchmark talks to node 1's device (the client routes to each region's primary device),
  # not through the gateway dpukv local starts on the --listen address.
  ep=$(python3 -c "import json; print(json.load(open('$dir/cluster.json'))['nodes'][0]['device'])")
  $BIN/dpukv --endpoint "$ep" regions > "$dir/regions.txt"
  $BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --value-size "$VALUE_SIZE" --load-only --threads 4 >/dev/null
  sleep "$SETTLE"
  read -r cpu0 w0 < <(snapshot "$dir" "$ep")
  local line
  line=$($BIN/dpukv-bench --endpoint "$ep" --records "$RECORDS" --value-size "$VALUE_SIZE" --workload a \
    --duration "$SECONDS_RUN" --threads "$THREADS" --depth "$DEPTH")
  sleep "$SETTLE"
  read -r cpu1 w1 < <(snapshot "$dir" "$ep")
  python3 -c "
cpu, w = $cpu1 - $cpu0, $w1 - $w0
print(f'mode=$mode backup_cpu_s={cpu:.2f} writes={w:.0f} backup_cpu_us_per_write={1e6 * cpu / max(w, 1):.2f} | $line')"
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
}
for _ in $(seq 1 "$RUNS"); do
  run send
  run build
done
