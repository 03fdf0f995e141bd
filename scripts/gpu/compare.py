"""Joins cuda_check's BENCH lines and torch_gemm.py's TORCH lines (one device
call) into the table of BENCHMARKS.md: ours over torch per shape."""
import sys


def kv(line):
    return dict(p.split("=", 1) for p in line.split()[2:] if "=" in p)


ours, torch_ = {}, {}
for path in sys.argv[1:]:
    for line in open(path):
        if line.startswith("BENCH gemm"):
            d = kv(line); ours[d["shape"]] = d
        elif line.startswith("TORCH gemm"):
            d = kv(line); torch_[d["shape"]] = d
print("| shape (M x K x N) | ours FP8 | ours FP8 fast | ours BF16 | torch _scaled_mm | torch fast | torch BF16 | FP8/torch | fast/torch fast | FP8 fast/our BF16 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for s, o in ours.items():
    t = torch_.get(s)
    if not t:
        continue
    f = lambda a: float(a)
    print(f"| {s} ({o['m']}x{o['k']}x{o['n']}) | {o['fp8_tflops']} | {o['fp8_fast_tflops']} | {o['bf16_tflops']} | "
          f"{t['scaled_mm_tflops']} | {t['scaled_mm_fast_tflops']} | {t['bf16_tflops']} | "
          f"{f(o['fp8_tflops']) / f(t['scaled_mm_tflops']):.3f} | "
          f"{f(o['fp8_fast_tflops']) / f(t['scaled_mm_fast_tflops']):.3f} | "
          f"{f(o['fp8_fast_tflops']) / f(o['bf16_tflops']):.2f} |")
