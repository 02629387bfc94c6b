#!/usr/bin/env bash
# The main job on a fresh machine: build dpukv, start a local 3-node cluster with replication
# factor 3 on etcd (`dpukv local --nodes 3`: an etcd and three node pods, each a host and a
# device process), run a few CLI operations, load records, run short YCSB workloads, then SIGKILL
# the pod that leads the data and show the cluster healing: a backup is promoted, writes go on,
# every record is still there, and the killed pod comes back as a backup.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu
BIN=target/release
DIR=$(mktemp -d /tmp/dpukv-demo.XXXXXX)
PORT=${DPUKV_DEMO_PORT:-7070}
RECORDS=${DPUKV_DEMO_RECORDS:-100000}
SECONDS_RUN=${DPUKV_DEMO_SECONDS:-5}
EP="127.0.0.1:$PORT"
$BIN/dpukv local --dir "$DIR" --listen "$EP" --nodes 3 --replication 3 --split-keys user5 &
LOCAL=$!
cleanup() { kill -INT "$LOCAL" 2>/dev/null || true; wait "$LOCAL" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
# Until the first layout is written and every region's primary serves.
for _ in $(seq 1 300); do
  if $BIN/dpukv --endpoint "$EP" regions 2>/dev/null | awk -F'\t' '$4 == 0 || $5 !~ /,/ {bad=1} END {exit bad || NR == 0}'; then
    $BIN/dpukv --endpoint "$EP" put demo:probe ok >/dev/null 2>&1 && break
  fi
  sleep 0.1
done
echo "== the cluster: nodes (id, device, replication, admin, zone) and regions (id, start, end, primary, backups, epoch)"
$BIN/dpukv --endpoint "$EP" nodes
$BIN/dpukv --endpoint "$EP" regions
echo "== a few operations (the client routes each key to its region's primary)"
$BIN/dpukv --endpoint "$EP" put greeting "hello from dpukv"
$BIN/dpukv --endpoint "$EP" get greeting
$BIN/dpukv --endpoint "$EP" fetch-add visits 1 >/dev/null
$BIN/dpukv --endpoint "$EP" fetch-add visits 1
echo "== load $RECORDS records, then YCSB-C and YCSB-A for ${SECONDS_RUN}s each (every write on 3 nodes before it is acknowledged)"
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --load-only --threads 4
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --workload c --duration "$SECONDS_RUN"
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --workload a --duration "$SECONDS_RUN"
# The pod leading region 1 (keys before "user5"), from the region map and DIR/cluster.json.
LEADER=$($BIN/dpukv --endpoint "$EP" regions | awk -F'\t' '$1 == 1 {print $4}')
PIDS=$(python3 -c "import json,sys; n=[n for n in json.load(open('$DIR/cluster.json'))['nodes'] if n['id']==$LEADER][0]; print(n['host_pid'], n['device_pid'])")
OTHER=$(python3 -c "import json; print([n['device'] for n in json.load(open('$DIR/cluster.json'))['nodes'] if n['id']!=$LEADER][0])")
echo "== SIGKILL node $LEADER (host and device: pids $PIDS), which leads region 1"
START=$(date +%s.%N)
kill -9 $PIDS
until $BIN/dpukv --endpoint "$OTHER" put user0000000001 after-failover >/dev/null 2>&1; do sleep 0.05; done
echo "first acknowledged write to region 1 after $(python3 -c "print(round($(date +%s.%N) - $START, 2))") s"
$BIN/dpukv --endpoint "$OTHER" regions
echo "== every record is still there (count of keys in the whole key space):"
$BIN/dpukv --endpoint "$OTHER" scan "" "" --limit 10000000 | wc -l
echo "== the killed pod came back (dpukv local restarts it); once it has caught up it is a backup again:"
for _ in $(seq 1 300); do
  $BIN/dpukv --endpoint "$OTHER" regions | awk -F'\t' -v n="$LEADER" '$5 !~ n {bad=1} END {exit bad}' && break
  sleep 0.1
done
$BIN/dpukv --endpoint "$OTHER" regions
