#!/usr/bin/env bash
# A split under load: YCSB-A on a local 3-node RF-3 cluster with one region, once undisturbed and
# once with the region split in half (`dpukv cluster split`) a few seconds in; same client and
# concurrency. Prints both dpukv-bench lines, how long the split command took, and the source
# primary's "handoff copied" line (keys and bytes moved, copy time: writes to the moving half
# are refused, retryable, that long). Knobs: RECORDS, VALUE_SIZE, SECONDS_RUN, SPLIT_AFTER.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu --bin dpukv-gateway
BIN=target/release
RECORDS=${RECORDS:-400000}
VALUE_SIZE=${VALUE_SIZE:-100}
SECONDS_RUN=${SECONDS_RUN:-12}
SPLIT_AFTER=${SPLIT_AFTER:-3}
DIR=$(mktemp -d /tmp/dpukv-split.XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
EP="127.0.0.1:$PORT"
# Automatic splits off: this script splits by hand.
DPUKV_SPLIT_BYTES=0 $BIN/dpukv local --dir "$DIR" --listen "$EP" --nodes 3 --replication 3 2>/dev/null &
LOCAL=$!
cleanup() { kill -INT "$LOCAL" 2>/dev/null || true; wait "$LOCAL" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
for _ in $(seq 1 600); do
  if $BIN/dpukv --endpoint "$EP" regions 2>/dev/null | awk -F'\t' '$4 == 0 || $5 !~ /,/ {bad=1} END {exit bad || NR != 1}'; then
    $BIN/dpukv --endpoint "$EP" put probe ok >/dev/null 2>&1 && break
  fi
  sleep 0.1
done
# The benchmark talks to node 1's device (the client routes to each region's primary device),
# not through the gateway dpukv local starts on the --listen address.
EP=$(python3 -c "import json; print(json.load(open('$DIR/cluster.json'))['nodes'][0]['device'])")
$BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --value-size "$VALUE_SIZE" --load-only --threads 4 >/dev/null
bench() { $BIN/dpukv-bench --endpoint "$EP" --records "$RECORDS" --value-size "$VALUE_SIZE" --workload a --duration "$SECONDS_RUN"; }
echo "no split:    $(bench)"
bench > "$DIR/with-split.txt" &
B=$!
sleep "$SPLIT_AFTER"
# Keys are "user" and 12 digits spread evenly: "user05" is the middle of the key space.
START=$(date +%s.%N)
$BIN/dpukv --endpoint "$EP" cluster split 1 user05 >/dev/null
echo "split command: $(python3 -c "print(round($(date +%s.%N) - $START, 2))") s"
wait "$B"
echo "with split:  $(cat "$DIR/with-split.txt")"
grep -h "handoff copied" "$DIR"/node-*/host.log | sed 's/.*handoff copied/handoff copied/'
$BIN/dpukv --endpoint "$EP" regions
