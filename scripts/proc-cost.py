#!/usr/bin/env python3
"""What server processes spent, for per-request figures in the benchmarks (issue 29).

  proc-cost.py snapshot NAME...          -> JSON: for every process whose command name is one
                                            of NAME (or `pid:N`: that process), its CPU seconds (user + system) and context
                                            switches (voluntary + involuntary, every thread)
  proc-cost.py run --regex R | --count N NAME... -- CMD...
                                         -> CMD's output, then what the servers spent per
                                            request (and their system calls, counted by
                                            `perf stat` where it can), over N requests or the
                                            count read from the output by R
  proc-cost.py run-threads ...           -> as `run`, then the same per thread (CPU microseconds
                                            and context switches per request of each thread name
                                            of each process, busiest first)
  proc-cost.py per-request BEFORE AFTER N -> JSON: CPU microseconds and context switches per
                                            request between two snapshots, over N requests,
                                            summed over the processes in both

Counts come from /proc/<pid>/stat (utime, stime: clock ticks) and /proc/<pid>/task/*/status
(voluntary_ctxt_switches, nonvoluntary_ctxt_switches). A process that exited between two
snapshots is not counted.
"""
import json
import os
import sys


def snapshot(names):
    tick = os.sysconf("SC_CLK_TCK")
    procs, threads = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1 : st.rindex(")")]
        if name not in names and f"pid:{pid}" not in names:
            continue
        fields = st[st.rindex(")") + 2 :].split()
        # The start time tells a pid reused by another process apart.
        key = f"{pid}:{fields[19]}"
        cpu, switches = (int(fields[11]) + int(fields[12])) / tick, 0
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tasks = []
        for t in tasks:
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    ts = f.read()
                tf = ts[ts.rindex(")") + 2 :].split()
                tcpu, tswitches = (int(tf[11]) + int(tf[12])) / tick, 0
                with open(f"/proc/{pid}/task/{t}/status") as f:
                    for line in f:
                        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                            tswitches += int(line.split()[1])
            except OSError:
                continue
            switches += tswitches
            # Threads of one name in one process are summed (a pool's workers).
            tkey = f"{name}[{pid}] {ts[ts.index('(') + 1 : ts.rindex(')')]}"
            threads[tkey] = [a + b for a, b in zip(threads.get(tkey, [0, 0]), [tcpu, tswitches])]
        procs[key] = [cpu, switches]
    return {"procs": procs, "threads": threads, "pids": sorted(int(k.split(":")[0]) for k in procs)}


def per_request(a, b, n):
    """Processes in both snapshots only (one that started or ended between them is not the
    server under measurement)."""
    a, b = a["procs"], b["procs"]
    both = a.keys() & b.keys()
    cpu = sum(b[k][0] - a[k][0] for k in both)
    switches = sum(b[k][1] - a[k][1] for k in both)
    return {"server_cpu_us_per_req": round(cpu * 1e6 / max(n, 1), 2), "ctxt_per_req": round(switches / max(n, 1), 3)}


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "snapshot":
        print(json.dumps(snapshot(set(sys.argv[2:]))))
        return 0
    if len(sys.argv) >= 5 and sys.argv[1] in ("run", "run-threads") and sys.argv[2] in ("--regex", "--count"):
        # run --regex R | --count N NAME... -- CMD...: runs CMD, prints its output, then one line
        # of what the servers spent per request, the request count N, or taken from the output
        # by R's first group.
        import re
        import subprocess
        sep = sys.argv.index("--")
        how, arg, names, cmd = sys.argv[2], sys.argv[3], set(sys.argv[4:sep]), sys.argv[sep + 1 :]
        before = snapshot(names)
        # System calls of the servers' threads (perf's raw_syscalls tracepoint), where perf can.
        import signal
        import tempfile
        counted = tempfile.NamedTemporaryFile(suffix=".perf", delete=False).name
        pids = ",".join(map(str, before["pids"]))
        try:
            perf = subprocess.Popen(
                ["perf", "stat", "-e", "raw_syscalls:sys_enter", "-x,", "-p", pids, "-o", counted],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            perf = None
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
        after = snapshot(names)
        calls = None
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait()
            with open(counted) as f:
                for line in f:
                    first = line.split(",")[0]
                    if "sys_enter" in line and first.isdigit():
                        calls = int(first)
        os.unlink(counted)
        sys.stdout.write(out)
        if how == "--count":
            n = int(arg)
        else:
            m = re.search(arg, out)
            n = int(float(m.group(1))) if m else 0
        cost = per_request(before, after, n) | {"requests": n}
        if calls is not None:
            cost["syscalls_per_req"] = round(calls / max(n, 1), 2)
        print("  servers per request:", json.dumps(cost))
        if sys.argv[1] == "run-threads":
            a, b = before["threads"], after["threads"]
            rows = [(k, b[k][0] - a[k][0], b[k][1] - a[k][1]) for k in a.keys() & b.keys()]
            for k, cpu, switches in sorted(rows, key=lambda r: -r[1]):
                if cpu > 0 or switches > 0:
                    per = {"cpu_us_per_req": round(cpu * 1e6 / max(n, 1), 2), "ctxt_per_req": round(switches / max(n, 1), 3)}
                    print(f"  thread {k}:", json.dumps(per))
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "per-request":
        print(json.dumps(per_request(json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
