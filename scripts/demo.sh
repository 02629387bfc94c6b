#!/usr/bin/env bash
# The main job on a fresh machine: build dpukv, start a local 3-node cluster with replication
# factor 3 on etcd (`dpukv local --nodes 3`: an etcd, three node pods — each a host and a device
# process — and a gateway in front of them), talk to it with the dpukv CLI, curl (HTTP/JSON) and
# redis-cli (the Redis protocol), load records and run short YCSB workloads through the gateway and
# one reading hot keys from replicas,
# then SIGKILL the pod that leads a region and show the cluster healing: a backup is promoted,
# writes go on, every record is still there, and the killed pod comes back as a backup. The web
# console's URL is printed first (DPUKV_DEMO_HOLD=SECONDS keeps the cluster up at the end to look
# at it), and the failover is shown as its events timeline records it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh redis-cli=redis-tools curl=curl
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu --bin dpukv-gateway
BIN=target/release
DIR=$(mktemp -d /tmp/dpukv-demo.XXXXXX)
PORT=${DPUKV_DEMO_PORT:-7070}
HTTP_PORT=${DPUKV_DEMO_HTTP_PORT:-8080}
RESP_PORT=${DPUKV_DEMO_RESP_PORT:-6380}
RECORDS=${DPUKV_DEMO_RECORDS:-100000}
SECONDS_RUN=${DPUKV_DEMO_SECONDS:-5}
EP="127.0.0.1:$PORT"
HTTP="http://127.0.0.1:$HTTP_PORT"
$BIN/dpukv local --dir "$DIR" --listen "$EP" --http "127.0.0.1:$HTTP_PORT" --resp "127.0.0.1:$RESP_PORT" \
  --nodes 3 --replication 3 --split-keys user05 &
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
NODE1=$(python3 -c "import json; print(json.load(open('$DIR/cluster.json'))['nodes'][0]['device'])")
echo "== the web console: open $HTTP/ui/ in a browser (nodes, regions and their heatmap, where reads are served, the failover below on its timeline; docs/console.md)"
echo "== the cluster: nodes (id, device, replication, control API, zone) and regions (id, start, end, primary, backups, epoch)"
$BIN/dpukv --endpoint "$NODE1" nodes
$BIN/dpukv --endpoint "$EP" regions
echo "== one endpoint, three protocols: the dpukv CLI (binary protocol), curl (HTTP/JSON), redis-cli"
$BIN/dpukv --endpoint "$EP" put greeting "hello from dpukv"
curl -s "$HTTP/v1/kv/greeting"; echo
curl -s -X PUT "$HTTP/v1/kv/fruit" -d '{"value": "apple"}'; echo
redis-cli -p "$RESP_PORT" GET fruit
redis-cli -p "$RESP_PORT" INCR visits >/dev/null
redis-cli -p "$RESP_PORT" INCR visits
curl -s "$HTTP/v1/scan?start=f&end=h"; echo
echo "== load $RECORDS records, then YCSB-C and YCSB-A for ${SECONDS_RUN}s each through the gateway (every write on 3 nodes before it is acknowledged)"
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --load-only --threads 4
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --workload c --duration "$SECONDS_RUN"
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --workload a --duration "$SECONDS_RUN"
echo "== hot keys: YCSB-C at zipf 0.99 for ${SECONDS_RUN}s straight to the devices, read 'interleaved': the popular keys' copies on the backups' devices serve a share of the gets (docs/hot-keys.md)"
$BIN/dpukv-bench --endpoint "$NODE1" --records "$RECORDS" --workload c --distribution zipf --duration "$SECONDS_RUN" --consistency interleaved
# The pod leading region 1 (keys before "user05"), from the region map and DIR/cluster.json.
LEADER=$($BIN/dpukv --endpoint "$EP" regions | awk -F'\t' '$1 == 1 {print $4}')
PIDS=$(python3 -c "import json,sys; n=[n for n in json.load(open('$DIR/cluster.json'))['nodes'] if n['id']==$LEADER][0]; print(n['host_pid'], n['device_pid'])")
echo "== SIGKILL node $LEADER (host and device: pids $PIDS), which leads region 1"
START=$(date +%s.%N)
kill -9 $PIDS
until $BIN/dpukv --endpoint "$EP" put user0000000001 after-failover >/dev/null 2>&1; do sleep 0.05; done
echo "first acknowledged write to region 1 (through the gateway) after $(python3 -c "print(round($(date +%s.%N) - $START, 2))") s"
$BIN/dpukv --endpoint "$EP" regions
echo "== the failover as the console's events timeline records it ($HTTP/ui/#events):"
for _ in $(seq 1 50); do
  curl -s "$HTTP/v1/console/events" | python3 -c "
import json, sys
events = [e for e in json.load(sys.stdin)['events'] if e['kind'] in ('node_lost', 'failover')]
for e in events: print(' ', e['kind'], '-', e['detail'])
sys.exit(0 if any(e['kind'] == 'failover' for e in events) else 1)" && break
  sleep 0.2
done
echo "== every record is still there (count of keys in the whole key space):"
$BIN/dpukv --endpoint "$EP" scan "" "" --limit 10000000 | wc -l
echo "== the killed pod came back (dpukv local restarts it); once it has caught up it is a backup again:"
for _ in $(seq 1 300); do
  $BIN/dpukv --endpoint "$EP" regions | awk -F'\t' -v n="$LEADER" '$5 !~ n {bad=1} END {exit bad}' && break
  sleep 0.1
done
$BIN/dpukv --endpoint "$EP" regions
if [ -n "${DPUKV_DEMO_HOLD:-}" ]; then
  echo "== the cluster stays up for ${DPUKV_DEMO_HOLD} s: the console is at $HTTP/ui/"
  sleep "$DPUKV_DEMO_HOLD"
fi
