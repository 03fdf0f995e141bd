"""torch_attention.py: PyTorch's causal attention at the shapes
examples/cuda_check's attention bench times ours, the anchor for our flash
kernels: `F.scaled_dot_product_attention(q, k, v, is_causal=True)` in BF16
on q, k, v viewed out of one packed projection `[b, t, 3 * heads * hd]`
(as our op reads them), forward alone and forward + backward for the
projection with an upstream gradient of ones (as ours: candle seeds a
backward with ones). Each figure the mean of `--iters` calls
back to back between two CUDA events, after 3 warm-ups (as
examples/cuda_check's `event_ms` times ours); one JSON line a shape,
with PyTorch's default choice of kernel and each of its flash
(FlashAttention-2) and cuDNN kernels forced.

  python3 scripts/gpu/torch_attention.py
"""
import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

# 125M, 350M, 350M at 2048, 760M, 2.7B, 6.7B (b, t, heads, hd)
SHAPES = [(8, 1024, 12, 64), (8, 1024, 16, 64), (8, 2048, 16, 64), (8, 1024, 16, 96),
          (8, 1024, 32, 80), (8, 1024, 32, 128)]


def event_ms(fn, iters):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def attention(x, heads, hd):
    b, t, _ = x.shape
    q, k, v = x.view(b, t, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, t, heads * hd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    for b, t, heads, hd in SHAPES:
        x = torch.randn(b, t, 3 * heads * hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ones = torch.ones(b, t, heads * hd, device="cuda", dtype=torch.bfloat16)
        fwd_flops = 4.0 * b * heads * t * t * hd / 2.0
        line = {"b": b, "t": t, "heads": heads, "hd": hd, "torch": torch.__version__}

        def both():
            attention(x, heads, hd).backward(ones)
            x.grad = None

        for name, be in backends.items():
            try:
                with sdpa_kernel([be]) if be is not None else contextlib.nullcontext():
                    with torch.no_grad():
                        fwd = event_ms(lambda: attention(x, heads, hd), args.iters)
                    both_ms = event_ms(both, args.iters)
            except RuntimeError as e:  # a backend that does not take this shape
                line[name] = str(e).splitlines()[0][:80]
                continue
            line[name] = {"fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(both_ms, 4),
                          "fwd_tflops": round(fwd_flops / fwd / 1e9), "fwd_bwd_tflops": round(3.5 * fwd_flops / both_ms / 1e9)}
        print(json.dumps(line), flush=True)

if __name__ == "__main__":
    main()
