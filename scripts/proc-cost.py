#!/usr/bin/env python3
"""What server processes spent, for per-request figures in the benchmarks (issue 29).

  proc-cost.py snapshot NAME...          -> JSON: CPU seconds (user + system) and context switches
                                            (voluntary + involuntary, every thread) summed over
                                            every process whose command name is one of NAME
  proc-cost.py per-request BEFORE AFTER N -> JSON: CPU microseconds and context switches per
                                            request between two snapshots, over N requests

Counts come from /proc/<pid>/stat (utime, stime: clock ticks) and /proc/<pid>/task/*/status
(voluntary_ctxt_switches, nonvoluntary_ctxt_switches). A process that exited between two
snapshots is not counted in the second: snapshot the servers while they run.
"""
import json
import os
import sys


def snapshot(names):
    tick = os.sysconf("SC_CLK_TCK")
    cpu, switches, pids = 0.0, 0, []
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
        cpu += (int(fields[11]) + int(fields[12])) / tick
        pids.append(int(pid))
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{pid}/task/{t}/status") as f:
                    for line in f:
                        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                            switches += int(line.split()[1])
            except OSError:
                continue
    return {"cpu_s": cpu, "ctxt": switches, "pids": sorted(pids)}


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "snapshot":
        print(json.dumps(snapshot(set(sys.argv[2:]))))
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "per-request":
        a, b, n = json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
        print(
            json.dumps(
                {
                    "server_cpu_us_per_req": round((b["cpu_s"] - a["cpu_s"]) * 1e6 / max(n, 1), 2),
                    "ctxt_per_req": round((b["ctxt"] - a["ctxt"]) / max(n, 1), 3),
                }
            )
        )
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
