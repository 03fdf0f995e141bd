#!/usr/bin/env bash
# nccl-only.sh: nccl_check on 2 GPUs (torchrun, then a shell loop), no bench; carry .carry/nccl.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=.carry/nccl; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source $C/device-env.sh; gzip -dc $C/nccl_check.gz > /tmp/nccl_check; chmod +x /tmp/nccl_check
TORCHRUN=$(command -v torchrun || echo "python3 -m torch.distributed.run")
timeout 100 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29500 /tmp/nccl_check > $OUT/nccl_torchrun.log 2>&1; echo "torchrun rc=$?"
grep -c " PASS " $OUT/nccl_torchrun.log; grep -E " FAIL | SKIP " $OUT/nccl_torchrun.log | head
for r in 0 1; do RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 timeout 90 /tmp/nccl_check > $OUT/nccl_loop_$r.log 2>&1 & done; wait
for r in 0 1; do echo "loop rank $r: $(grep -c ' PASS ' $OUT/nccl_loop_$r.log) PASS, $(grep -c ' FAIL ' $OUT/nccl_loop_$r.log) FAIL"; done
