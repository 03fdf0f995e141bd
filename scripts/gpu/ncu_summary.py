#!/usr/bin/env python3
"""ncu_summary.py CSV [STEPS]: total GPU time per kernel name from an
`ncu --csv --metrics gpu__time_duration.sum` log (one row per launch),
largest first, with launch counts; STEPS divides the totals (per step).
Env DETAIL (a regex): for the kernels it matches, the same per grid size
("Grid Size" column: blocks x threads tells the element count)."""
import csv
import os
import re
import sys
from collections import defaultdict

path = sys.argv[1]
steps = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
total = defaultdict(float)
count = defaultdict(int)
total_g = defaultdict(float)
count_g = defaultdict(int)
with open(path, newline="") as f:
    lines = [l for l in f if l.startswith('"')]
for row in csv.DictReader(lines):
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = row["Kernel Name"][:90]
    v = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "nsecond")
    scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(unit, 1e-6)
    total[name] += v * scale
    count[name] += 1
    if os.environ.get("DETAIL") and re.search(os.environ["DETAIL"], name):
        key = (name[:30], row.get("Grid Size", "?"), row.get("Block Size", "?"))
        total_g[key] += v * scale
        count_g[key] += 1
grand = sum(total.values())
print(f"kernels: {sum(count.values())} launches, {grand / steps:.2f} ms of GPU time per step")
print(f"{'ms/step':>9} {'share':>6} {'launches':>8}  kernel")
for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:45]:
    print(f"{ms / steps:9.3f} {100 * ms / grand:5.1f}% {count[name] / steps:8.0f}  {name}")
if total_g:
    print(f"{'ms/step':>9} {'launches':>8}  kernel, grid, block")
    for key, ms in sorted(total_g.items(), key=lambda kv: -kv[1])[:40]:
        print(f"{ms / steps:9.3f} {count_g[key] / steps:8.1f}  {key[0]} grid {key[1]} block {key[2]}")
