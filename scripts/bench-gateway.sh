#!/usr/bin/env bash
# The gateway against its peers, same clients, same machine (docs/benchmarks.md):
#  1. redis-benchmark, unchanged, against the gateway's Redis port and the front door in the
#     device of the node leading the keys (1-node and 3-node dpukv, `--fsync always` and
#     `--fsync interval:1000`) and against redis-server (no persistence, `appendfsync everysec`,
#     `appendfsync always`), each preloaded with the same keys: `-t get,set,incr -r 1000000 -n N -d 64` with `-c 50 -P 1` and
#     `-c 4 -P 16`; one CSV line per test, with the servers' CPU microseconds, context switches
#     and system calls per request (every server process: redis-server; dpukv's nodes, devices,
#     gateway and etcd);
#  2. wrk against `GET /v1/kv/{key}` (random keys of a loaded set), through the gateway and the
#     device's front door, vs etcd's HTTP gateway
#     (`POST /v3/kv/range`, the same keys) — same threads and connections;
#  3. dpukv-bench YCSB-C and E through the gateway vs straight to the devices;
#  parts 2 and 3 with the servers' CPU microseconds and context switches per request too;
#  4. TLS's cost: dpukv-bench YCSB-C and A through the gateway of `dpukv local --nodes 3` with and
#     without `--tls` (TLS on the client's hop, the gateway's hops to the devices and replication);
#  5. scans of 10,000 records inside one region: the gateway cutting them at the region's pivots
#     and reading the pieces in parallel vs a gateway reading them whole (`--scan-split-min 0`),
#     one scan at a time and four at once.
# Knobs: N (redis-benchmark requests per test, 2,000,000), WRK_SECONDS (10), RECORDS (100,000),
# SECONDS_RUN (8), PARTS (which parts to run: "1 2 3 4 5"); part 1 only: NODES (dpukv's node
# counts, "1 3"), REDIS (0: no Redis runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh redis-server=redis-server redis-benchmark=redis-tools wrk=wrk perf=linux-perf
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu --bin dpukv-gateway
BIN=target/release
N=${N:-2000000}
WRK_SECONDS=${WRK_SECONDS:-10}
RECORDS=${RECORDS:-100000}
SECONDS_RUN=${SECONDS_RUN:-8}
PARTS=${PARTS:-"1 2 3 4 5"}
TMP=$(mktemp -d /tmp/dpukv-bench-gateway.XXXXXX)
LOCAL=
cleanup() {
  set +e
  [ -n "$LOCAL" ] && { kill -INT "$LOCAL"; wait "$LOCAL"; }
  [ -n "${GW2_PID:-}" ] && { kill "$GW2_PID"; wait "$GW2_PID"; }
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1
  [ -n "${ETCD_PID:-}" ] && { kill "$ETCD_PID"; wait "$ETCD_PID"; }
  rm -rf "$TMP"
}
trap cleanup EXIT
read -r REDIS_PORT RESP_PORT BIN_PORT HTTP_PORT ETCD_C ETCD_P GW2_PORT < <(python3 - <<'EOF'
import random, socket
ports = []
while len(ports) < 7:
    p = random.randint(20000, 31999)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); ports.append(p)
    except OSError:
        pass
    finally:
        s.close()
print(*ports)
EOF
)

# redis-benchmark against port $2, one test at a time, with what the servers (every process
# named in $3...) spent per request: CPU microseconds, context switches and system calls
# (scripts/proc-cost.py: /proc, and `perf stat` where it can count; "" where it cannot).
rb() { # label port server-process-names...
  local label=$1 port=$2 conf t out
  shift 2
  for conf in "-c 50 -P 1" "-c 4 -P 16"; do
    for t in get set incr; do
      out=$(python3 scripts/proc-cost.py run --count "$N" "$@" -- \
        redis-benchmark -h 127.0.0.1 -p "$port" -t "$t" -r 1000000 -n "$N" -d 64 $conf --csv)
      python3 - "$label" "$conf" "$out" <<'EOF'
import json, sys
label, conf, out = sys.argv[1:4]
lines = out.splitlines()
cost = json.loads(lines[-1].split(":", 1)[1])
for line in lines[1:-1]:  # redis-benchmark's CSV, its header first
    print(f'"{label}","{conf}",{line},{cost["server_cpu_us_per_req"]},{cost["ctxt_per_req"]},{cost.get("syscalls_per_req", "")}')
EOF
    done
  done
}

# The same keys in every system before its GETs: redis-benchmark's own SET over the key space
# (64-byte values, `-r 1000000 -n 1000000`: about 632,000 distinct keys), pipelined.
preload() { # port
  redis-benchmark -h 127.0.0.1 -p "$1" -t set -r 1000000 -n 1000000 -d 64 -c 4 -P 16 -q >/dev/null
}

start_dpukv() { # nodes fsync [--tls | --device-fronts]
  local dir="$TMP/dpukv-$1-${2//:/}${3:-}"
  DIR=$dir
  $BIN/dpukv local --dir "$dir" --listen "127.0.0.1:$BIN_PORT" --http "127.0.0.1:$HTTP_PORT" \
    --resp "127.0.0.1:$RESP_PORT" --nodes "$1" --fsync "$2" ${3:-} 2>"$TMP/local.log" &
  LOCAL=$!
  CLIENT_TLS=()
  [ "${3:-}" = --tls ] && CLIENT_TLS=(--tls-ca "$dir/tls/ca.pem")
  for _ in $(seq 1 600); do
    $BIN/dpukv --endpoint "127.0.0.1:$BIN_PORT" "${CLIENT_TLS[@]}" put bench:probe ok >/dev/null 2>&1 && break
    sleep 0.1
  done
  DEVICE=$(python3 -c "import json; print(json.load(open('$dir/cluster.json'))['nodes'][0]['device'])")
}

stop_dpukv() {
  kill -INT "$LOCAL"; wait "$LOCAL" 2>/dev/null || true; LOCAL=
}

if [[ " $PARTS " == *" 1 "* ]]; then
  NODES=${NODES:-"1 3"}
  echo '"system","clients","test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms","server_cpu_us_per_req","ctxt_per_req","syscalls_per_req"'
  if [ "${REDIS:-1}" != 0 ]; then
    # Each Redis in a directory of its own (no append-only file of the run before to load).
    redis_run() { # label dir redis-server-flags...
      local label=$1 dir="$TMP/$2"
      shift 2
      mkdir -p "$dir"
      redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" "$@" --daemonize yes --dir "$dir" >/dev/null
      sleep 0.5
      preload "$REDIS_PORT"
      rb "$label" "$REDIS_PORT" redis-server
      redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null
      sleep 0.5
    }
    redis_run "redis (no persistence)" redis-none --appendonly no
    redis_run "redis (appendfsync everysec)" redis-everysec --appendonly yes --appendfsync everysec
    redis_run "redis (appendfsync always)" redis-always --appendonly yes --appendfsync always
  fi
  for nodes in $NODES; do
    for fsync in always interval:1000; do
      # Through the standalone gateway, then through the front door in the device of the node
      # leading the first region (on 3 nodes the preload splits the region and moves a half to
      # another node: that front door forwards the other half's keys, as the gateway does).
      start_dpukv "$nodes" "$fsync" --device-fronts
      preload "$RESP_PORT"
      rb "dpukv $nodes node(s), fsync $fsync, gateway" "$RESP_PORT" dpukv-node dpukv-dpu dpukv-gateway etcd
      leader=$($BIN/dpukv --endpoint "127.0.0.1:$BIN_PORT" regions | awk -F'\t' 'NR==1 {print $4}')
      front=$(python3 -c "import json,sys; n=[n for n in json.load(open('$DIR/cluster.json'))['nodes'] if n['id']==int(sys.argv[1])][0]; print(n['resp'].split(':')[1])" "$leader")
      rb "dpukv $nodes node(s), fsync $fsync, device front door" "$front" dpukv-node dpukv-dpu dpukv-gateway etcd
      stop_dpukv
    done
  done
fi

if [[ " $PARTS " == *" 2 "* ]]; then
  # etcd 3.4 and its HTTP gateway (POST /v3/kv/range, keys in base64).
  etcd --name b --data-dir "$TMP/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_C" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_C" --listen-peer-urls "http://127.0.0.1:$ETCD_P" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_P" --initial-cluster "b=http://127.0.0.1:$ETCD_P" \
    --initial-cluster-state new >"$TMP/etcd.log" 2>&1 &
  ETCD_PID=$!
  start_dpukv 1 always --device-fronts
  FRONT_HTTP=$(python3 -c "import json; print(json.load(open('$DIR/cluster.json'))['nodes'][0]['http'])")
  python3 - "$ETCD_C" "$HTTP_PORT" <<'EOF'
import base64, json, sys, urllib.request
etcd, http = sys.argv[1], sys.argv[2]
for i in range(1000):
    k, v = f"key{i:04d}", f"value-{i}"
    body = json.dumps({"key": base64.b64encode(k.encode()).decode(), "value": base64.b64encode(v.encode()).decode()})
    for _ in range(50):
        try:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{etcd}/v3/kv/put", body.encode(), method="POST"))
            break
        except Exception:
            import time; time.sleep(0.1)
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{http}/v1/kv/{k}", json.dumps({"value": v}).encode(), method="PUT"))
EOF
  cat > "$TMP/dpukv.lua" <<'EOF'
request = function()
  return wrk.format("GET", string.format("/v1/kv/key%04d", math.random(0, 999)))
end
EOF
  cat > "$TMP/etcd.lua" <<'EOF'
local keys = {}
local b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local function enc(s)
  return ((s:gsub('.', function(x)
    local r, b = '', x:byte()
    for i = 8, 1, -1 do r = r .. (b % 2 ^ i - b % 2 ^ (i - 1) > 0 and '1' or '0') end
    return r
  end) .. '0000'):gsub('%d%d%d?%d?%d?%d?', function(x)
    if #x < 6 then return '' end
    local c = 0
    for i = 1, 6 do c = c + (x:sub(i, i) == '1' and 2 ^ (6 - i) or 0) end
    return b64:sub(c + 1, c + 1)
  end) .. ({ '', '==', '=' })[#s % 3 + 1])
end
for i = 0, 999 do keys[i] = '{"key":"' .. enc(string.format("key%04d", i)) .. '"}' end
request = function()
  return wrk.format("POST", "/v3/kv/range", nil, keys[math.random(0, 999)])
end
EOF
  echo "== wrk -t2 -c50 -d${WRK_SECONDS}s: dpukv GET /v1/kv/{key} (1 node, fsync always)"
  python3 scripts/proc-cost.py run --regex '([0-9]+) requests in' dpukv-node dpukv-dpu dpukv-gateway -- \
    wrk -t2 -c50 -d"${WRK_SECONDS}s" -s "$TMP/dpukv.lua" "http://127.0.0.1:$HTTP_PORT" | grep -E "Requests/sec|Latency|Non-2xx|per request"
  echo "== wrk -t2 -c50 -d${WRK_SECONDS}s: dpukv GET /v1/kv/{key} through the device's front door (1 node, fsync always)"
  python3 scripts/proc-cost.py run --regex '([0-9]+) requests in' dpukv-node dpukv-dpu -- \
    wrk -t2 -c50 -d"${WRK_SECONDS}s" -s "$TMP/dpukv.lua" "http://$FRONT_HTTP" | grep -E "Requests/sec|Latency|Non-2xx|per request"
  echo "== wrk -t2 -c50 -d${WRK_SECONDS}s: etcd POST /v3/kv/range (1 member)"
  python3 scripts/proc-cost.py run --regex '([0-9]+) requests in' "pid:$ETCD_PID" -- \
    wrk -t2 -c50 -d"${WRK_SECONDS}s" -s "$TMP/etcd.lua" "http://127.0.0.1:$ETCD_C" | grep -E "Requests/sec|Latency|Non-2xx|per request"
  stop_dpukv
  kill "$ETCD_PID"; wait "$ETCD_PID" 2>/dev/null || true; ETCD_PID=
fi

if [[ " $PARTS " == *" 3 "* ]]; then
  start_dpukv 3 always
  $BIN/dpukv-bench --endpoint "127.0.0.1:$BIN_PORT" --records "$RECORDS" --load-only --threads 4 >/dev/null
  for w in c e; do
    for via in "through the gateway:127.0.0.1:$BIN_PORT" "to the devices:$DEVICE"; do
      echo "$w, ${via%%:*}: $(python3 scripts/proc-cost.py run --regex '"ops":([0-9]+)' dpukv-node dpukv-dpu dpukv-gateway -- \
        $BIN/dpukv-bench --endpoint "${via#*:}" --records "$RECORDS" --workload $w --duration "$SECONDS_RUN" --json)"
    done
  done
  stop_dpukv
fi

if [[ " $PARTS " == *" 4 "* ]]; then
  for tls in "" --tls; do
    start_dpukv 3 always $tls
    $BIN/dpukv-bench --endpoint "127.0.0.1:$BIN_PORT" "${CLIENT_TLS[@]}" --records "$RECORDS" --load-only --threads 4 >/dev/null
    for w in c a; do
      echo "3 nodes, ${tls:-plain}, YCSB-$w through the gateway: $($BIN/dpukv-bench --endpoint "127.0.0.1:$BIN_PORT" "${CLIENT_TLS[@]}" --records "$RECORDS" --workload $w --duration "$SECONDS_RUN")"
    done
    stop_dpukv
  done
fi

if [[ " $PARTS " == *" 5 "* ]]; then
  start_dpukv 1 always
  $BIN/dpukv-bench --endpoint "127.0.0.1:$BIN_PORT" --records 200000 --load-only --threads 4 >/dev/null
  $BIN/dpukv-gateway --seeds "$DEVICE" --listen "127.0.0.1:$GW2_PORT" --scan-split-min 0 2>"$TMP/gw2.log" &
  GW2_PID=$!
  for _ in $(seq 1 100); do
    $BIN/dpukv --endpoint "127.0.0.1:$GW2_PORT" get bench:probe >/dev/null 2>&1 && break
    sleep 0.1
  done
  for threads in 1 4; do
    for gw in "cut at pivots:$BIN_PORT" "read whole:$GW2_PORT"; do
      echo "scans of 10,000 records, $threads at a time, ${gw%%:*}: $($BIN/dpukv-bench --endpoint "127.0.0.1:${gw##*:}" --records 200000 --workload scan --scan-length 10000 --threads "$threads" --depth 1 --duration "$SECONDS_RUN")"
    done
  done
  kill "$GW2_PID"; wait "$GW2_PID" 2>/dev/null || true; GW2_PID=
  stop_dpukv
fi
