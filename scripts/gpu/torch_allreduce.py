"""torch_allreduce.py: NCCL's all-reduce through PyTorch, the anchors for
our FP8 gradient reduction: `--mib` MiB of F32 gradients all-reduced as
F32, and the same number of elements as BF16 (what DDP's bf16 compression
hook sends). One process per GPU under torchrun; each figure the median
of `--iters` timed calls (after 3 warm-ups), with a device synchronize
around each, as examples/nccl_check's --bench times ours. Rank 0 prints
one JSON line.

  torchrun --nproc-per-node 2 scripts/gpu/torch_allreduce.py --mib 256
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="gradient size, MiB of F32")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    n = a.mib * (1 << 20) // 4
    out = {"world_size": dist.get_world_size(), "mib": a.mib, "iters": a.iters}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(n, device="cuda", dtype=dtype) * 1e-2
        out[f"{name}_all_reduce_ms"] = timed(lambda: dist.all_reduce(x), a.iters) * 1e3
    out["bf16_over_f32"] = out["bf16_all_reduce_ms"] / out["f32_all_reduce_ms"]
    if dist.get_rank() == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
