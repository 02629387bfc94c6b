#!/usr/bin/env python3
"""What server processes spent, for per-request figures in the benchmarks (issue 29).

  proc-cost.py snapshot NAME...          -> JSON: for every process whose command name is one
                                            of NAME, its CPU seconds (user + system) and context
                                            switches (voluntary + involuntary, every thread)
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
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1 : st.rindex(")")]
        if name not in names:
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
                with open(f"/proc/{pid}/task/{t}/status") as f:
                    for line in f:
                        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                            switches += int(line.split()[1])
            except OSError:
                continue
        procs[key] = [cpu, switches]
    return {"procs": procs, "pids": sorted(int(k.split(":")[0]) for k in procs)}


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "snapshot":
        print(json.dumps(snapshot(set(sys.argv[2:]))))
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "per-request":
        a, b, n = json.loads(sys.argv[2])["procs"], json.loads(sys.argv[3])["procs"], int(sys.argv[4])
        # Processes in both snapshots only (one that started or ended between them is not
        # the server under measurement).
        both = a.keys() & b.keys()
        cpu = sum(b[k][0] - a[k][0] for k in both)
        switches = sum(b[k][1] - a[k][1] for k in both)
        print(
            json.dumps(
                {
                    "server_cpu_us_per_req": round(cpu * 1e6 / max(n, 1), 2),
                    "ctxt_per_req": round(switches / max(n, 1), 3),
                }
            )
        )
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
