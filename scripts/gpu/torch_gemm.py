"""PyTorch side of cuda_check --bench, timed the same way (run on the device,
in the same call): CUDA events around 30 back-to-back calls after 5 warm-ups,
a new output per call (torch's caching allocator), random normal data,
per-tensor scales (amax -> 448), and rowwise scales (one per row of each
operand, torchao's `rowwise` recipe: `scale_a` [m, 1], `scale_b` [1, n],
F32), bf16 output.

    python3 torch_gemm.py
"""
import torch

WARMUP, REPS = 5, 30
SHAPES = [
    ("8192^3", 8192, 8192, 8192),
    ("350m.qkv", 8192, 1024, 3072),
    ("350m.proj", 8192, 1024, 1024),
    ("350m.fc1", 8192, 1024, 4096),
    ("350m.fc2", 8192, 4096, 1024),
    ("1.3b.qkv", 8192, 2048, 6144),
    ("1.3b.proj", 8192, 2048, 2048),
    ("1.3b.fc1", 8192, 2048, 8192),
    ("1.3b.fc2", 8192, 8192, 2048),
]


def event_ms(f):
    for _ in range(WARMUP):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPS):
        f()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPS


def quantize(x):
    scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().max()
    return (x * scale).to(torch.float8_e4m3fn), (1.0 / scale).float().reshape(())


def quantize_rows(x):
    scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().amax(dim=1, keepdim=True)
    return (x * scale).to(torch.float8_e4m3fn), (1.0 / scale).float()


def main():
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    for name, m, k, n in SHAPES:
        x = torch.randn(m, k, device=dev)
        w = torch.randn(n, k, device=dev)
        xq, sx = quantize(x)
        wq, sw = quantize(w)
        xr, sxr = quantize_rows(x)
        wr, swr = quantize_rows(w)
        xb, wb = x.bfloat16(), w.bfloat16()
        del x, w
        fp8 = event_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
        fast = event_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                                                 use_fast_accum=True))
        rows = event_ms(lambda: torch._scaled_mm(xr, wr.t(), scale_a=sxr, scale_b=swr.t(),
                                                 out_dtype=torch.bfloat16))
        bf16 = event_ms(lambda: xb @ wb.t())
        tf = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12
        print(f"TORCH gemm shape={name} m={m} k={k} n={n} scaled_mm_tflops={tf(fp8):.1f} "
              f"scaled_mm_fast_tflops={tf(fast):.1f} scaled_mm_rowwise_tflops={tf(rows):.1f} "
              f"bf16_tflops={tf(bf16):.1f}")
    n = 1 << 28
    src = torch.zeros(n, device=dev)
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src))
    print(f"TORCH copy bytes={8 * n} ms={ms:.3f} gbs={8 * n / (ms * 1e-3) / 1e9:.0f}")


if __name__ == "__main__":
    main()
