#!/usr/bin/env bash
# What an idle cluster costs: `dpukv local --nodes 3` holding EVENTS stored events of 300 bytes
# in its event log (put straight into etcd through its HTTP gateway, as the master writes them),
# then the CPU of every server process (hosts, devices, gateway, etcd) over IDLE_SECONDS, RUNS times,
# by scripts/proc-cost.py (its "µs per request" over 1,000,000 requests is then the CPU seconds
# of the interval). Knobs: EVENTS (256), IDLE_SECONDS (10), RUNS (2), PORT (the gateway's,
# 27370), BIN (prebuilt binaries; else target/release, built first).
set -euo pipefail
cd "$(dirname "$0")/.."
EVENTS=${EVENTS:-256}
IDLE_SECONDS=${IDLE_SECONDS:-10}
PORT=${PORT:-27370}
RUNS=${RUNS:-2}
bash scripts/setup.sh # etcd, which dpukv local starts, prebuilt binaries or not
if [ -z "${BIN:-}" ]; then
  cargo build --release --locked --bins -p dpukv-node -p dpukv-client -p dpukv-gateway
  BIN=target/release
fi
DIR=$(mktemp -d)
"$BIN/dpukv" local --nodes 3 --dir "$DIR" --listen "127.0.0.1:$PORT" > /dev/null 2> "$DIR/local.log" &
LOCAL=$!
trap 'kill -INT $LOCAL 2>/dev/null || true; wait $LOCAL 2>/dev/null || true; rm -rf "$DIR"' EXIT
for _ in $(seq 1 300); do [ -s "$DIR/cluster.json" ] && break; sleep 0.1; done
ETCD=$(python3 -c "import json; print(json.load(open('$DIR/cluster.json'))['etcd'])")
sleep 8 # laid out, every node's first rounds done
python3 - "$ETCD" "$EVENTS" <<'PY'
import base64, json, sys, urllib.request
etcd, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    key = base64.b64encode(b"/dpukv/local/events/%020d" % (10**6 + i)).decode()
    value = base64.b64encode(b"e" * 300).decode()
    body = json.dumps({"key": key, "value": value}).encode()
    urllib.request.urlopen(urllib.request.Request(etcd + "/v3/kv/put", body), timeout=10).read()
PY
sleep 5
for _ in $(seq 1 "$RUNS"); do
  python3 scripts/proc-cost.py run --count 1000000 dpukv-node dpukv-dpu dpukv-gateway etcd -- sleep "$IDLE_SECONDS" 2>&1 | tail -1
done
