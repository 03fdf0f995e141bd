#!/usr/bin/env python3
"""ncu_summary.py CSV [STEPS]: total GPU time per kernel name from an
`ncu --csv --metrics gpu__time_duration.sum` log (one row per launch),
largest first, with launch counts; STEPS divides the totals (per step).
Env DETAIL (a regex): for the kernels it matches, the same per grid size
("Grid Size" column: blocks x threads tells the element count).
Env STEP=1: also one whole training step alone, the launches after the
first optimizer step's (`lowbit_step*` launches) through the second's,
split at the first `cross_entropy_bwd` into forward and backward with the
optimizer, and one transformer layer's forward launches (between the 6th
and 7th `flash_fwd`): profile at least two steps (STEPS=2)."""
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

if os.environ.get("STEP") == "1":
    launches = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        launches.append((row["Kernel Name"][:60], float(row["Metric Value"].replace(",", "")) * scale))
    # the optimizer's launches come in bursts, one a step
    bursts = []
    for i, (name, _) in enumerate(launches):
        if name.startswith("lowbit_step"):
            if bursts and i - bursts[-1][-1] < 50:
                bursts[-1].append(i)
            else:
                bursts.append([i])
    if len(bursts) < 2:
        print("STEP=1: fewer than two optimizer steps in the profile")
        sys.exit(0)
    step = launches[bursts[0][-1] + 1 : bursts[1][-1] + 1]
    cut = next((i for i, (n, _) in enumerate(step) if n.startswith("cross_entropy_bwd")), len(step))
    fwd, bwd = step[:cut], step[cut:]
    ms = lambda part: sum(t for _, t in part) / 1e3
    print(f"one step: {len(step)} launches, {ms(step):.2f} ms of kernels; forward {len(fwd)} "
          f"launches, {ms(fwd):.2f} ms; backward and optimizer {len(bwd)}, {ms(bwd):.2f} ms")
    by = defaultdict(float)
    n_by = defaultdict(int)
    for name, t in step:
        by[name] += t
        n_by[name] += 1
    for name, t in sorted(by.items(), key=lambda kv: -kv[1])[:45]:
        print(f"{t / 1e3:9.3f} ms {n_by[name]:6d}  {name}")
    flash = [i for i, (n, _) in enumerate(fwd) if n.startswith("flash_fwd")]
    if len(flash) >= 7:
        print("one layer's forward (between the 6th and 7th flash_fwd), us:")
        for name, t in fwd[flash[5] : flash[6]]:
            print(f"{t:9.1f}  {name}")
