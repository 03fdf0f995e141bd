"""torch_ddp.py: the PyTorch reference for data-parallel GPT training.

torch_gpt.py's model under DistributedDataParallel, one process per GPU,
launched by torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, as for our GPT example). Weak scaling: every rank trains on
its own fixed random batch of `--batch` sequences, so a step covers
world * batch sequences. BF16 autocast, AdamW(foreach), DDP's default
gradient buckets (25 MB, reduced while the backward runs); `--compile`
wraps the DDP model in torch.compile.

The step time of a rank is the median of its timed steps; the group's is
the slowest rank's. Rank 0 prints one JSON line: the group's tokens/s and
step time and its own peak memory. Run it with --nproc-per-node 1 too, for
the one-GPU figure the scaling is measured against.

  torchrun --nproc-per-node 2 scripts/gpu/torch_ddp.py --size 350m
  torchrun --nproc-per-node 2 scripts/gpu/torch_ddp.py --size 350m --compile
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torch_gpt import SIZES, build, timed_steps


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="350m", choices=SIZES)
    p.add_argument("--batch", type=int, default=8, help="sequences a rank and step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--checkpoint", action="store_true", help="recompute every block in backward")
    p.add_argument("--bias", action="store_true", help="biases in the blocks' Linears, as ours")
    p.add_argument("--untied-head", action="store_true", help="a head of its own, as ours")
    return p


def timed_training(args, rank, forward, params, autocast=True):
    """AdamW(foreach) over `params`, on this rank's fixed random batch,
    `forward(x, y)` returning the loss (under BF16 autocast with
    `autocast`): the timed steps' seconds, the peak memory counted from
    the first step."""
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    torch.cuda.reset_peak_memory_stats()
    times, _ = timed_steps(step, args.warmup, args.steps)
    return times


def main():
    args = parser().parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build(args).cuda()
    ddp = DistributedDataParallel(model)
    forward = torch.compile(ddp) if args.compile else ddp
    times = timed_training(args, rank, forward, model.parameters())
    slowest = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        step_s = slowest.item()
        print(json.dumps({
            "mode": "ddp-bf16" + ("-compile" if args.compile else "") + ("-checkpoint" if args.checkpoint else ""),
            "size": args.size,
            "world_size": world, "batch_per_rank": args.batch, "seq": args.seq,
            "tokens_per_s": world * args.batch * args.seq / step_s, "step_ms": step_s * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
