#!/usr/bin/env python3
"""Turns `cargo bench -p dpukv-storage --bench engine` output (stdin) into the markdown table of
docs/benchmarks.md: throughput per system and the ratios of dpukv to each peer."""
import re
import sys

res, name = {}, None
for line in sys.stdin:
    s = line.strip()
    if s.startswith("dpukv: loaded"):
        print(s + "\n")
    m = re.match(r"^(engine/\S+/\S+)", s)
    if m:
        name = m.group(1)
    if "thrpt:" in s and name:
        v, u = re.findall(r"([\d.]+) (\w?)elem/s", s)[1]
        res[name] = float(v) * {"K": 1e3, "M": 1e6, "G": 1e9, "": 1}[u]
        name = None

workloads = list(dict.fromkeys(k.split("/")[1] for k in res))
print("| workload | dpukv | btreemap | skipmap | dpukv / btreemap | dpukv / skipmap |")
print("|---|---|---|---|---|---|")
for w in workloads:
    d, b, s = (res.get(f"engine/{w}/{x}") for x in ("dpukv", "btreemap", "skipmap"))
    fmt = lambda x: "-" if x is None else f"{x / 1e6:.2f} M/s"
    ratio = lambda x: "-" if None in (d, x) else f"{d / x:.2f}"
    print(f"| {w} | {fmt(d)} | {fmt(b)} | {fmt(s)} | {ratio(b)} | {ratio(s)} |")
for dist in ("uniform", "zipf"):
    for n in (1, 2):
        a, b = res.get(f"engine/readers{n}_writer_{dist}/dpukv"), res.get(f"engine/readers{n}_{dist}/dpukv")
        if a and b:
            print(f"\ndpukv readers{n} with a writer / without ({dist}): {a / b:.2f}", end="")
print()
