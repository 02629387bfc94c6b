#!/usr/bin/env bash
# dpukv vs etcd: YCSB-A and YCSB-C on a local 3-node dpukv cluster with replication factor 3
# (`dpukv local --nodes 3 --replication 3`, one region: one node's host is its primary, the
# other two are backups, as etcd has one leader and two followers; default `--fsync always`: a
# write is acknowledged once it is synced on its primary and held by both backups) and on a 3-member etcd cluster (etcd from PATH, fsync on — etcd's default: a write is
# acknowledged once a majority has synced it to its WAL; reads linearizable, etcd's default).
# Both on this machine, loaded with the same records, driven by the same client (`dpukv-bench`,
# `--target etcd://` for etcd) at the same concurrency; the systems alternate within each round
# (the other one idles meanwhile) and the table reports medians over the rounds.
# Knobs: RECORDS, SECONDS_RUN, THREADS, DEPTH, RUNS (rounds), ETCD_ENDPOINTS (leader, the
# default: the client talks to the leader, as dpukv's client talks to each region's primary;
# all: it balances over the three members, slower here: followers forward to the leader),
# ETCD_RESTART (1, the default: restart the etcd members after loading; see below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --workspace --bins
BIN=target/release
RECORDS=${RECORDS:-200000}
SECONDS_RUN=${SECONDS_RUN:-10}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
RUNS=${RUNS:-3}
ETCD_ENDPOINTS=${ETCD_ENDPOINTS:-leader}
ETCD_RESTART=${ETCD_RESTART:-1}

TMP=$(mktemp -d /tmp/dpukv-bench-etcd.XXXXXX)
ETCD_PIDS=()
DPUKV_PID=
cleanup() {
  set +e
  # What was started: dpukv local (which stops its pods and its metadata etcd on SIGINT), the pods'
  # processes as cluster.json names them last, the etcd members.
  local started=("${ETCD_PIDS[@]}") left
  if [ -n "$DPUKV_PID" ]; then
    started+=("$DPUKV_PID")
    if [ -f "$TMP/dpukv/cluster.json" ]; then
      started+=($(python3 -c 'import json,sys; print(*[p for n in json.load(open(sys.argv[1]))["nodes"] for p in (n["host_pid"], n["device_pid"])])' "$TMP/dpukv/cluster.json"))
    fi
    kill -INT "$DPUKV_PID" 2>/dev/null
    wait "$DPUKV_PID" 2>/dev/null
  fi
  stop_etcd
  # Nothing may be left: neither those pids nor anything with the temp dir on its command line
  # (every process started here has it: data dirs).
  left=$( (pgrep -f "$TMP"; for p in "${started[@]}"; do kill -0 "$p" 2>/dev/null && echo "$p"; done) | sort -u)
  if [ -n "$left" ]; then
    echo "bench-etcd: processes left behind: $left" >&2
    ps -o pid,args -p "$(echo "$left" | paste -sd,)" >&2
  else
    echo "bench-etcd: every process it started has exited" >&2
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

# Seven free loopback ports outside the kernel's ephemeral range (as the e2e harness picks them):
# dpukv's entry point, then a client and a peer port per etcd member.
read -r DPUKV_PORT C1 P1 C2 P2 C3 P3 < <(python3 - <<'EOF'
import random, socket
ports = []
while len(ports) < 7:
    p = random.randrange(20000, 32000)
    if p in ports:
        continue
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
        ports.append(p)
    except OSError:
        pass
    finally:
        s.close()
print(*ports)
EOF
)

# --- etcd: three members, data dirs in TMP (the same ext4 disk as dpukv's), fsync on (the
# default), an 8 GiB backend quota (the default 2 GiB could fill with the runs' revisions), no
# auto compaction (the default).
CLUSTER="e1=http://127.0.0.1:$P1,e2=http://127.0.0.1:$P2,e3=http://127.0.0.1:$P3"
ETCD_URLS=("127.0.0.1:$C1" "127.0.0.1:$C2" "127.0.0.1:$C3")
start_etcd() {
  local i c p healthy st
  ETCD_PIDS=()
  for i in 1 2 3; do
    c=C$i p=P$i
    etcd --name "e$i" --data-dir "$TMP/etcd-e$i" \
      --listen-client-urls "http://127.0.0.1:${!c}" --advertise-client-urls "http://127.0.0.1:${!c}" \
      --listen-peer-urls "http://127.0.0.1:${!p}" --initial-advertise-peer-urls "http://127.0.0.1:${!p}" \
      --initial-cluster "$CLUSTER" --initial-cluster-state new --initial-cluster-token "dpukv-bench-etcd" \
      --quota-backend-bytes $((8 << 30)) --logger zap --log-level warn 2>>"$TMP/etcd-e$i.log" &
    ETCD_PIDS+=($!)
  done
  for _ in $(seq 1 300); do
    healthy=0
    for u in "${ETCD_URLS[@]}"; do
      curl -sf "http://$u/health" 2>/dev/null | grep -q '"health":"true"' && healthy=$((healthy + 1))
    done
    [ "$healthy" -eq 3 ] && break
    sleep 0.1
  done
  [ "$healthy" -eq 3 ] || { echo "bench-etcd: etcd did not become healthy" >&2; cat "$TMP"/etcd-e*.log >&2; exit 1; }
  # The leader: the member whose status names itself leader.
  LEADER=
  for u in "${ETCD_URLS[@]}"; do
    st=$(curl -sf -X POST -d '{}' "http://$u/v3/maintenance/status")
    if python3 -c 'import json,sys; s=json.loads(sys.argv[1]); sys.exit(s["leader"] != s["header"]["member_id"])' "$st"; then
      LEADER=$u
    fi
  done
  [ -n "$LEADER" ] || { echo "bench-etcd: no etcd member says it leads" >&2; exit 1; }
  case $ETCD_ENDPOINTS in
    all) ETCD_TARGET="etcd://$(IFS=,; echo "${ETCD_URLS[*]}")" ;;
    leader) ETCD_TARGET="etcd://$LEADER" ;;
    *) echo "ETCD_ENDPOINTS must be leader or all" >&2; exit 1 ;;
  esac
}
stop_etcd() {
  local p
  for p in "${ETCD_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${ETCD_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  ETCD_PIDS=()
}
start_etcd
echo "etcd $(etcd --version | head -1 | awk '{print $3}'): 3 members on ${ETCD_URLS[*]}, leader $LEADER"

# --- dpukv: three node pods, replication 3, one region (`--split-keys ""`; dpukv-bench loads in
# batches of 64 records, which must stay within one region), default --fsync always.
# `dpukv local` starts its own etcd for the cluster's metadata (idle during the runs).
DPUKV_EP="127.0.0.1:$DPUKV_PORT"
mkdir -p "$TMP/dpukv"
$BIN/dpukv local --dir "$TMP/dpukv" --listen "$DPUKV_EP" --nodes 3 --replication 3 --split-keys "" \
  2>"$TMP/dpukv-local.log" &
DPUKV_PID=$!
ready=
for _ in $(seq 1 600); do
  if [ -f "$TMP/dpukv/cluster.json" ] && $BIN/dpukv --endpoint "$DPUKV_EP" regions 2>/dev/null |
    awk -F'\t' '$4 == 0 || split($5, b, ",") != 2 {bad=1} END {exit bad || NR != 1}'; then
    $BIN/dpukv --endpoint "$DPUKV_EP" put probe ok >/dev/null 2>&1 && { ready=1; break; }
  fi
  sleep 0.1
done
[ -n "$ready" ] || { echo "bench-etcd: the dpukv cluster did not become ready" >&2; cat "$TMP/dpukv-local.log" >&2; exit 1; }
# The benchmark talks to node 1's device (the client routes to each region's primary device), not
# through the gateway dpukv local starts on the --listen address.
DPUKV_EP=$(python3 -c "import json; print(json.load(open('$TMP/dpukv/cluster.json'))['nodes'][0]['device'])")
echo "dpukv: 3 nodes, replication 3, entry point $DPUKV_EP; pods (id device host_pid device_pid):"
python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
print("  metadata etcd", c["etcd"])
for n in c["nodes"]:
    print("  ", n["id"], n["device"], n["host_pid"], n["device_pid"])' "$TMP/dpukv/cluster.json"
$BIN/dpukv --endpoint "$DPUKV_EP" regions | sed 's/^/  region /'

# --- load the same records into both, through the same client.
COMMON=(--records "$RECORDS" --threads "$THREADS" --depth "$DEPTH")
echo "dpukv $($BIN/dpukv-bench --endpoint "$DPUKV_EP" "${COMMON[@]}" --load-only)"
echo "etcd $($BIN/dpukv-bench --target "$ETCD_TARGET" "${COMMON[@]}" --load-only)"
# etcd 3.4 copies its read buffer, at the largest size it ever grew to, on every read
# (bucketBuffer.Copy under ConcurrentReadTx); the load's burst of writes grows it, which made
# later reads 2-4x slower. Restarting the members sheds it, as a long-running etcd that
# restarted after a bulk load would. dpukv is not restarted (nothing of the kind to shed).
if [ "$ETCD_RESTART" = 1 ]; then
  stop_etcd
  start_etcd
  echo "etcd restarted after the load; leader $LEADER"
fi
echo "the client reaches etcd at $ETCD_TARGET"

# --- the rounds: workload A then C; dpukv first in odd rounds, etcd first in even ones.
bench() {
  local system=$1 w=$2 round=$3 line
  if [ "$system" = dpukv ]; then
    line=$($BIN/dpukv-bench --endpoint "$DPUKV_EP" "${COMMON[@]}" --workload "$w" --duration "$SECONDS_RUN" --json)
  else
    line=$($BIN/dpukv-bench --target "$ETCD_TARGET" "${COMMON[@]}" --workload "$w" --duration "$SECONDS_RUN" --json)
  fi
  echo "round $round $line"
  echo "{\"round\":$round,${line#\{}" >>"$TMP/results.jsonl"
}
for round in $(seq 1 "$RUNS"); do
  for w in a c; do
    if [ $((round % 2)) -eq 1 ]; then order=(dpukv etcd); else order=(etcd dpukv); fi
    for system in "${order[@]}"; do bench "$system" "$w" "$round"; done
  done
done

python3 - "$TMP/results.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(system, w, field):
    return statistics.median(r[field] for r in rows if r["system"] == system and r["workload"] == w)
print()
print("| workload | system | throughput (ops/s) | p50 (us) | p99 (us) | p99.9 (us) | client CPU (us/op) | errors |")
print("|---|---|---|---|---|---|---|---|")
for w in ("a", "c"):
    for s in ("dpukv", "etcd"):
        errs = sum(r["errors"] for r in rows if r["system"] == s and r["workload"] == w)
        print(f"| YCSB-{w.upper()} | {s} | {med(s, w, 'throughput_ops'):,.0f} | {med(s, w, 'p50_us'):.0f} | "
              f"{med(s, w, 'p99_us'):.0f} | {med(s, w, 'p999_us'):.0f} | {med(s, w, 'client_cpu_us_per_op'):.2f} | {errs} |")
print()
for w in ("a", "c"):
    per = []
    for rnd in sorted({r["round"] for r in rows}):
        t = {r["system"]: r["throughput_ops"] for r in rows if r["round"] == rnd and r["workload"] == w}
        per.append(t["dpukv"] / t["etcd"])
    ratio = med("dpukv", w, "throughput_ops") / med("etcd", w, "throughput_ops")
    verdict = "met" if ratio >= 10 else "MISSED"
    print(f"YCSB-{w.upper()}: dpukv / etcd = {ratio:.2f}x (medians; per round {', '.join(f'{x:.2f}' for x in per)}); target >= 10x: {verdict}")
EOF
