#!/usr/bin/env bash
# largest-zero.sh [CARRY] [SIZES]: the largest GPT at O3 (ZeRO) on the
# GPUs of one host, in one device call: per size of SIZES (default
# "6.7b 13b") and recompute MODE (default "selective full"), our GPT at
# LEVEL (O3) on NPROC GPUs (default 2) under torchrun, 8 x 1024 per rank,
# fp8-current, BF16 activations; a configuration the memory estimate
# refuses says so (with the estimate) and the next goes on; then PyTorch
# FSDP (FULL_SHARD, torch_fsdp.py) without and with `--checkpoint` on the
# same GPUs (a run out of memory says so).
# CARRY (default .carry/nccl) holds gpt.gz built with `--features nccl`.
# Env: STEPS (20), SKIP (5), LEVEL (O3), MODES, NPROC (2), OURS (1), TORCH (1),
# CKS (PyTorch's modes: "none checkpoint").
#
#   bash scripts/gpu/largest-zero.sh .carry/nccl "6.7b 13b"
set -uo pipefail
CARRY=${1:-.carry/nccl}
SIZES=${2:-6.7b 13b}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
facts
N=${NPROC:-2}; port=29700
for size in $SIZES; do
  [ "${OURS:-1}" = 1 ] && for mode in ${MODES:-selective full}; do
    label="${size}_${LEVEL:-O3}_${mode}_x$N"; port=$((port + 10))
    timeout 300 $TORCHRUN --no-python --nproc-per-node "$N" --master-port "$port" "$BIN/gpt" \
      --device cuda --size "$size" --vocab 50304 --batch $((8 * N)) --seq 1024 \
      --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 \
      --level "${LEVEL:-O3}" --compute fp8-current --activations bf16 --recompute "$mode" \
      --json > "$OUT/$label.log" 2>&1
    echo "rc=$? $(show "$OUT/$label.log" "$label")"; grep -iE "^error|panick|needs about" "$OUT/$label.log" | head -2
  done
  [ "${TORCH:-1}" = 1 ] || continue
  for mode in ${CKS:-none checkpoint}; do
    ck=""; [ "$mode" = checkpoint ] && ck=--checkpoint
    port=$((port + 10))
    timeout 300 $TORCHRUN --nproc-per-node "$N" --master-port "$port" "$HERE/torch_fsdp.py" --size "$size" \
      --steps "${STEPS:-20}" --warmup "${SKIP:-5}" $ck > "$OUT/${size}_fsdp${ck}_x$N.log" 2>&1
    echo "rc=$? $(grep '^{' "$OUT/${size}_fsdp${ck}_x$N.log" | tail -1)"
  done
done
