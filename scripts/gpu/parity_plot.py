"""parity_plot.py JSONL SVG [RUN...]: the validation curves of
parity.sh's runs (only the RUNs named, if any), each run's mean over its
seeds, as one SVG (no plotting library needed).
"""
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
if sys.argv[3:]:
    rows = [r for r in rows if r["run"] in sys.argv[3:]]
runs = {}
for r in rows:
    for step, loss in r["val_curve"]:
        runs.setdefault(r["run"], {}).setdefault(step, []).append(loss)
curves = {run: sorted((s, statistics.mean(v)) for s, v in pts.items()) for run, pts in runs.items()}
steps = [s for c in curves.values() for s, _ in c[1:]] or [0, 1]
losses = [l for c in curves.values() for _, l in c[1:]] or [0.0, 1.0]
x0, x1 = min(steps, default=0), max(steps, default=1)
y0, y1 = min(losses), max(losses)
W, H, M = 900, 560, 70
colors = ["#000000", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8"]


def px(s):
    return M + (s - x0) / max(x1 - x0, 1) * (W - 2 * M)


def py(l):
    return H - M - (l - y0) / max(y1 - y0, 1e-9) * (H - 2 * M)


out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="13">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{W / 2}" y="24" text-anchor="middle" font-size="15">Validation loss, GPT 125M, mean over '
       f'{len({r["seed"] for r in rows})} seeds at most (parity.sh)</text>',
       f'<line x1="{M}" y1="{H - M}" x2="{W - M}" y2="{H - M}" stroke="black"/>',
       f'<line x1="{M}" y1="{M}" x2="{M}" y2="{H - M}" stroke="black"/>',
       f'<text x="{W / 2}" y="{H - 25}" text-anchor="middle">step</text>']
for i in range(5):
    s = x0 + (x1 - x0) * i / 4
    l = y0 + (y1 - y0) * i / 4
    out.append(f'<text x="{px(s)}" y="{H - M + 18}" text-anchor="middle">{s:.0f}</text>')
    out.append(f'<text x="{M - 8}" y="{py(l) + 4}" text-anchor="end">{l:.3f}</text>')
for k, (run, c) in enumerate(curves.items()):
    color = colors[k % len(colors)]
    pts = " ".join(f"{px(s):.1f},{py(min(max(l, y0), y1)):.1f}" for s, l in c[1:])
    out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
    seeds = len({r["seed"] for r in rows if r["run"] == run})
    out.append(f'<text x="{W - M - 260}" y="{M + 18 * k}" fill="{color}">{run}: {c[-1][1]:.4f} ({seeds} seeds)</text>')
out.append("</svg>")
open(sys.argv[2], "w").write("\n".join(out))
print(f"{sys.argv[2]}: {len(curves)} curves")
