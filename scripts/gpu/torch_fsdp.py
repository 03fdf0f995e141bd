"""torch_fsdp.py: the PyTorch reference for sharded (ZeRO-3) GPT training.

torch_gpt.py's model under FullyShardedDataParallel (FULL_SHARD: weights,
gradients and AdamW states sharded over the ranks, each block gathered in
BF16 for its forward and backward), one process per GPU, launched by
torchrun. BF16 parameters in compute and F32 gradient reduction
(MixedPrecision), F32 master weights and AdamW(foreach) states sharded;
`--checkpoint` recomputes every block in backward (torch.utils.checkpoint).
Weak scaling as torch_ddp.py: every rank trains on its own fixed random
batch of `--batch` sequences.

Rank 0 prints one JSON line: the group's tokens/s and step time (the
slowest rank's median) and its own peak memory; a rank that runs out of
memory prints a line with "out of memory".

  torchrun --nproc-per-node 2 scripts/gpu/torch_fsdp.py --size 6.7b --checkpoint
"""
import json
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from torch_ddp import parser, timed_training
from torch_gpt import Block, build


def main():
    args = parser().parse_args()
    if args.compile:
        raise SystemExit("--compile: not with FSDP here")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(0)  # the same initial weights on every rank
    line = {"mode": "fsdp-bf16" + ("-checkpoint" if args.checkpoint else ""), "size": args.size,
            "world_size": world, "batch_per_rank": args.batch, "seq": args.seq,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        with torch.device("cuda"):
            model = build(args)
        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           buffer_dtype=torch.bfloat16),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=torch.cuda.current_device(),
            use_orig_params=True,
        )
        torch.cuda.empty_cache()
        # BF16 compute by FSDP's MixedPrecision, not autocast
        times = timed_training(args, rank, model, model.parameters(), autocast=False)
    except torch.OutOfMemoryError as e:
        # every rank says so (torchrun stops the others when one exits)
        line["error"] = f"rank {rank}: out of memory: " + str(e).split("\n")[0]
        print(json.dumps(line), flush=True)
        os._exit(1)
    slowest = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        step_s = slowest.item()
        line.update({"tokens_per_s": world * args.batch * args.seq / step_s, "step_ms": step_s * 1e3,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
