#!/usr/bin/env bash
# Backups under YCSB-A on real processes (issue 28, docs/benchmarks.md "Backups"): a local
# 3-node cluster (replication 3, every write synced) loaded with RECORDS records, then
#  1. YCSB-A through the gateway for SECONDS_RUN s alone, while full backups run back to back
#     (each to a fresh directory under DURING_DIR, default the run's own), and alone again: the
#     foreground's throughput during against the mean of the two alone;
#  2. a full backup to a directory and to an S3 server (moto's, started here) with nothing else
#     running: bytes and MB/s;
#  3. YCSB-A with every write recorded (dpukv-bench --history): a full backup to a directory and
#     to S3, UPDATES more writes, an incremental to each: what it uploaded against the full;
#  4. each of the four restored into a fresh 3-node cluster (`dpukv restore`): its time, and the
#     restored state checked against the history (scripts/check-backup-history.py).
# A backup's time is its coordinator's, from the request to the manifest (`took_ms` of the
# cluster's last-backup record). Knobs: RECORDS, UPDATES, VALUE_SIZE, SECONDS_RUN, THREADS, DEPTH,
# RATE (the nodes' upload cap in MiB/s while idle, --backup-mib-per-sec: 200 unless set), BUSY
# (the cap while busy, --backup-busy-mib-per-sec: 20 unless set), DURING_DIR, ONLY=ratio (stop
# after 1) or ONLY=history (3 and 4 only), KEEP=1 (keep the run's directory), PERF=DIR (a whole-machine perf record of 8 s inside each of the first two runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -c 'import moto' 2>/dev/null || pip install --quiet 'moto[server]'
cargo build --release --bin dpukv --bin dpukv-bench --bin dpukv-node --bin dpukv-dpu --bin dpukv-gateway
BIN=target/release
RECORDS=${RECORDS:-1000000}
UPDATES=${UPDATES:-100000}
VALUE_SIZE=${VALUE_SIZE:-100}
SECONDS_RUN=${SECONDS_RUN:-20}
THREADS=${THREADS:-4}
DEPTH=${DEPTH:-16}
DIR=$(mktemp -d /tmp/dpukv-bench-backup.XXXXXX)
if [ -n "${RATE:-}" ]; then export DPUKV_BACKUP_MIB_PER_SEC=$RATE; fi
if [ -n "${BUSY:-}" ]; then export DPUKV_BACKUP_BUSY_MIB_PER_SEC=$BUSY; fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
S3_PORT=$(free_port)
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1 \
  AWS_ENDPOINT="http://127.0.0.1:$S3_PORT" AWS_ALLOW_HTTP=true
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ -z "${KEEP:-}" ]; then rm -rf "$DIR"; else echo "kept $DIR"; fi
}
trap cleanup EXIT
python3 -m moto.server -H 127.0.0.1 -p "$S3_PORT" >"$DIR/moto.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do curl -s -o /dev/null "http://127.0.0.1:$S3_PORT/" && break; sleep 0.1; done
curl -s -X PUT "http://127.0.0.1:$S3_PORT/backups" >/dev/null

# A local cluster in DIR/$1 serving on $2; waits until every region is served.
start_cluster() {
  $BIN/dpukv local --dir "$DIR/$1" --listen "$2" --nodes 3 --replication 3 >"$DIR/$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 600); do
    if $BIN/dpukv --endpoint "$2" regions 2>/dev/null | awk -F'\t' '$4 == 0 || $5 !~ /,/ {bad=1} END {exit bad || NR == 0}'; then
      $BIN/dpukv --endpoint "$2" put bench:probe ok >/dev/null 2>&1 && $BIN/dpukv --endpoint "$2" delete bench:probe >/dev/null && return
    fi
    sleep 0.1
  done
  echo "the cluster in $DIR/$1 did not start"; tail -20 "$DIR/$1.log"; exit 1
}
ycsb_a() { $BIN/dpukv-bench --endpoint "$1" --records "$RECORDS" --value-size "$VALUE_SIZE" --workload a \
  --threads "$THREADS" --depth "$DEPTH" --duration "$SECONDS_RUN" --json; }
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }
# `dpukv backup create` to $2 against the cluster at $1: prints "<seconds> <bytes> <uploaded> <id>"
# (the seconds its coordinator took, from the cluster's last-backup record).
backup() {
  local out last
  out=$($BIN/dpukv --endpoint "$1" backup create --to "$2")
  last=$($BIN/dpukv --endpoint "$1" backup schedule)
  python3 - "$out" "$last" <<'EOF'
import json, sys
out, last = sys.argv[1].splitlines(), json.loads(sys.argv[2])["last_backup"]
assert last["id"] == out[-1], (last, out[-1])
print(f"{last['took_ms'] / 1000:.3f} {last['bytes']} {last['uploaded_bytes']} {out[-1]}")
EOF
}

# CPU seconds (user + system) of every process on the machine by command name, for the
# per-phase accounting of where the CPU went: "name seconds" lines.
cpu_by_name() {
  python3 - <<'PYEOF'
import os, collections
tot = collections.Counter()
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        st = open(f'/proc/{pid}/stat').read()
    except OSError:
        continue
    name = st[st.index('(') + 1:st.rindex(')')]
    f = st[st.rindex(')') + 2:].split()
    tot[name] += (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')
for k, v in tot.items():
    print(k, v)
PYEOF
}
# The CPU each command took between two cpu_by_name outputs ($1 before, $2 after), over $3 s.
cpu_delta() {
  python3 - "$1" "$2" "$3" <<'PYEOF'
import sys
parse = lambda t: {l.rsplit(' ', 1)[0]: float(l.rsplit(' ', 1)[1]) for l in t.splitlines() if l.strip()}
a, b, secs = parse(sys.argv[1]), parse(sys.argv[2]), float(sys.argv[3])
d = sorted(((b[k] - a.get(k, 0), k) for k in b), reverse=True)
print("  cpu (cores):", ", ".join(f"{k} {v / secs:.2f}" for v, k in d if v / secs >= 0.01), f"| total {sum(v for v, _ in d) / secs:.2f}")
PYEOF
}
SRC=127.0.0.1:$(free_port)
start_cluster src "$SRC"
echo "== load $RECORDS records of $VALUE_SIZE B"
$BIN/dpukv-bench --endpoint "$SRC" --records "$RECORDS" --value-size "$VALUE_SIZE" --load-only --threads "$THREADS"
$BIN/dpukv --endpoint "$SRC" regions
echo "== YCSB-A alone, ${SECONDS_RUN}s"
if [ "${ONLY:-}" != history ]; then
# PERF=DIR: a whole-machine `perf record -g` of 8 s inside each of the first two phases.
perf_phase() { if [ -n "${PERF:-}" ]; then (sleep 3; perf record -a -g -o "$PERF/$1.data" -- sleep 8 >/dev/null 2>&1) & fi; }
perf_phase alone
C0=$(cpu_by_name); ALONE=$(ycsb_a "$SRC"); C1=$(cpu_by_name); echo "$ALONE"; cpu_delta "$C0" "$C1" "$SECONDS_RUN"
echo "== YCSB-A while full backups run back to back, each to a fresh directory"
perf_phase during
C0=$(cpu_by_name)
ycsb_a "$SRC" >"$DIR/during.json" &
BENCH=$!
N=0
while kill -0 "$BENCH" 2>/dev/null; do
  N=$((N + 1))
  R=$(backup "$SRC" "file://${DURING_DIR:-$DIR}/during-$N") || break
  rm -rf "${DURING_DIR:-$DIR}/during-$N"
  echo "full backup $N under load: $R (s, bytes, uploaded, id)"
done
wait "$BENCH"
C1=$(cpu_by_name)
DURING=$(cat "$DIR/during.json"); echo "$DURING"; cpu_delta "$C0" "$C1" "$SECONDS_RUN"
echo "== YCSB-A alone again, ${SECONDS_RUN}s (the ratio is against the mean of both: the store drifts)"
C0=$(cpu_by_name); AFTER=$(ycsb_a "$SRC"); C1=$(cpu_by_name); echo "$AFTER"; cpu_delta "$C0" "$C1" "$SECONDS_RUN"
python3 -c "import json,sys; a,d,b=(json.loads(x)['throughput_ops'] for x in sys.argv[1:]); print(f'ratio {d / ((a + b) / 2):.2f}x (alone {a:.0f} and {b:.0f}, during {d:.0f} ops/s)')" "$ALONE" "$DURING" "$AFTER"
if [ "${ONLY:-}" = ratio ]; then exit 0; fi
echo "== full backups with nothing else running"
FULL_DIR=$(backup "$SRC" "file://$DIR/store"); echo "directory: $FULL_DIR"
FULL_S3=$(backup "$SRC" "s3://backups/demo"); echo "s3 (moto): $FULL_S3"
else
  # ONLY=history: phases 3 and 4 alone (the rate of writes measured on a short run).
  ALONE=$(SECONDS_RUN=5 ycsb_a "$SRC"); DURING=$ALONE; AFTER=$ALONE; FULL_DIR="1 1 1 -"; FULL_S3=$FULL_DIR
fi

# Issue 28's "Done when": YCSB-A running (every write recorded, --history), a full backup to each
# location, then — once UPDATES more writes were made — an incremental to each; every one of the
# four restored into a fresh cluster and checked against the history (check-backup-history.py:
# the source's keys, and a cut closed under real-time order holding every write acknowledged
# before the backup was asked for and none invoked after it ended).
echo "== under YCSB-A with every write recorded: a full backup to each location, $UPDATES more writes, an incremental to each"
now_us() { python3 -c 'import time; print(time.time_ns() // 1000)'; }
$BIN/dpukv --endpoint "$SRC" scan "" "" --limit 100000000 >"$DIR/src.before"
$BIN/dpukv-bench --endpoint "$SRC" --records "$RECORDS" --value-size "$VALUE_SIZE" --workload a \
  --threads "$THREADS" --depth "$DEPTH" --duration 900 --json --history "$DIR/history" >"$DIR/history.json" &
HBENCH=$!
sleep 2
declare -A WINDOW RESULT
timed_backup() { # name location
  local s e r
  s=$(now_us); r=$(backup "$SRC" "$2"); e=$(now_us)
  WINDOW[$1]="$s $e"; RESULT[$1]="$r"; echo "$1 ($2): $r (s, bytes, uploaded, id)"
}
timed_backup full-dir "file://$DIR/hstore"
timed_backup full-s3 "s3://backups/hist"
# UPDATES writes after the full backup to the directory ended, at the rate of the run with
# backups (a YCSB-A operation is a write half the time), the time of the S3 backup included.
read -r _ FULL_END <<<"${WINDOW[full-dir]}"
WAIT=$(python3 -c "import json,sys,time; print(max(0.0, round($UPDATES / (json.loads(sys.argv[1])['throughput_ops'] / 2) - (time.time() - $FULL_END / 1e6), 1)))" "$DURING")
echo "waiting ${WAIT}s more for $UPDATES writes after the full backup to the directory"
sleep "$WAIT"
timed_backup inc-dir "file://$DIR/hstore"
timed_backup inc-s3 "s3://backups/hist"
kill -INT "$HBENCH"; wait "$HBENCH"
cat "$DIR/history.json"
# Writes acknowledged between the end of each full backup and the start of its incremental.
between() { # full inc
  local a b
  read -r _ a <<<"${WINDOW[$1]}"; read -r b _ <<<"${WINDOW[$2]}"
  awk -v a="$a" -v b="$b" '$5 == "ok" && $3 > a && $4 < b {n++} END {print n + 0}' "$DIR/history"
}
BETWEEN_DIR=$(between full-dir inc-dir); BETWEEN_S3=$(between full-s3 inc-s3)
echo "writes between the full and the incremental backup: $BETWEEN_DIR (directory), $BETWEEN_S3 (s3)"

echo "== each of the four restored into a fresh cluster and checked against the history"
CHECKS=()
for name in full-dir full-s3 inc-dir inc-s3; do
  case $name in *-dir) loc="file://$DIR/hstore" ;; *) loc="s3://backups/hist" ;; esac
  id=$(echo "${RESULT[$name]}" | cut -d' ' -f4)
  EP=127.0.0.1:$(free_port)
  start_cluster "dst-$name" "$EP"
  CL=${PIDS[-1]}
  t0=$(date +%s.%N)
  $BIN/dpukv --endpoint "$EP" restore --from "$loc" --backup "$id" >"$DIR/dst-$name.restore"
  t1=$(date +%s.%N)
  $BIN/dpukv --endpoint "$EP" scan "" "" --limit 100000000 >"$DIR/dst-$name.dump"
  kill -INT "$CL"; wait "$CL" 2>/dev/null || true
  read -r S E <<<"${WINDOW[$name]}"
  if ! C=$(python3 scripts/check-backup-history.py --history "$DIR/history" --dump "$DIR/dst-$name.dump" \
      --started "$S" --finished "$E" --before "$DIR/src.before"); then
    echo "$name: the restored state is not the source's at a cut: $C"; exit 1
  fi
  SECS=$(python3 -c "print(round($t1 - $t0, 2))")
  echo "$name: restored in $SECS s; $C"
  CHECKS+=("$name restored in $SECS s: $C")
  if [ -z "${KEEP:-}" ]; then rm -f "$DIR/dst-$name.dump"; fi
done

echo "== summary"
python3 - "$ALONE" "$DURING" "$AFTER" "$FULL_DIR" "$FULL_S3" "${RESULT[full-dir]}" "${RESULT[full-s3]}" "${RESULT[inc-dir]}" "${RESULT[inc-s3]}" "$BETWEEN_DIR" "$BETWEEN_S3" <<'EOF'
import json, sys
alone, during, after = (json.loads(x)["throughput_ops"] for x in sys.argv[1:4])
print(f"YCSB-A alone {alone:.0f} and {after:.0f} ops/s, during back-to-back full backups {during:.0f} ops/s: {during / ((alone + after) / 2):.2f}x")
for name, full in [("directory", sys.argv[4]), ("s3 (moto)", sys.argv[5])]:
    fs, fb, _, _ = full.split()
    print(f"{name}, nothing else running: full {int(fb) / 1e6:.1f} MB in {float(fs):.2f} s = {int(fb) / 1e6 / float(fs):.1f} MB/s")
for name, full, inc, n in [("directory", sys.argv[6], sys.argv[8], sys.argv[10]), ("s3 (moto)", sys.argv[7], sys.argv[9], sys.argv[11])]:
    fs, fb, _, _ = full.split(); is_, ib, iu, _ = inc.split()
    print(f"{name}, under YCSB-A: full {int(fb) / 1e6:.1f} MB in {float(fs):.2f} s; after {n} more writes "
          f"the incremental uploaded {int(iu) / 1e6:.1f} MB of {int(ib) / 1e6:.1f} MB in {float(is_):.2f} s = {int(iu) / int(fb):.1%} of the full")
EOF
for c in "${CHECKS[@]}"; do echo "$c"; done
