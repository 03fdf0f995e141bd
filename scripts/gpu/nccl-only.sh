#!/usr/bin/env bash
# nccl-only.sh [CARRY]: nccl_check's checks on 2 GPUs, no timings: under
# torchrun, then started by a shell loop. CARRY (default .carry/nccl) holds
# nccl_check.gz built with `--features nccl`.
#
#   bash scripts/gpu/nccl-only.sh .carry/nccl
set -uo pipefail
CARRY=${1:-.carry/nccl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack nccl_check; need nccl_check
timeout 100 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29500 "$BIN/nccl_check" \
  > "$OUT/nccl_torchrun.log" 2>&1; echo "torchrun rc=$?"
echo "torchrun: $(grep -c ' PASS ' "$OUT/nccl_torchrun.log") PASS"
grep -E " FAIL | SKIP " "$OUT/nccl_torchrun.log" | head
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 \
    timeout 90 "$BIN/nccl_check" > "$OUT/nccl_loop_$r.log" 2>&1 &
done; wait
for r in 0 1; do
  echo "loop rank $r: $(grep -c ' PASS ' "$OUT/nccl_loop_$r.log") PASS, $(grep -c ' FAIL ' "$OUT/nccl_loop_$r.log") FAIL"
done
