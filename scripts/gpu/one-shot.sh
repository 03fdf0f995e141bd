#!/usr/bin/env bash
# one-shot.sh [CARRY] [SIZES]: the FP8 reduction in one shot
# (`--fp8-one-shot`, `Fp8ReduceConfig::one_shot`: every rank's codes whole
# to every rank, each summing the whole bucket) against the default (an
# exchange and an all-gather a bucket), on 2 GPUs in one call:
# nccl_check's checks (NCCL's results bitwise the in-process backend's)
# and its benchmark at 100 and 25 MiB buckets (both ways, beside NCCL's F32
# all-reduce), PyTorch's F32 and BF16 all-reduce of 256 MiB
# (torch_allreduce.py), then per size the GPT example at O2 on one GPU and
# on two, the option off and on alternated PAIRS times (ab-option.sh).
# CARRY (default .carry/nccl) holds gpt.gz and nccl_check.gz built with
# `--features nccl`. Env: STEPS (15), SKIP (5), PAIRS (2), BENCH (1).
#
#   bash scripts/gpu/one-shot.sh .carry/nccl "1.3b 350m"
set -uo pipefail
CARRY=${1:-.carry/nccl}
SIZES=${2:-1.3b}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack nccl_check; need nccl_check
facts
if [ "${BENCH:-1}" = 1 ]; then
  timeout 90 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29400 "$BIN/nccl_check" \
    > "$OUT/nccl_check.log" 2>&1
  echo "nccl_check rc=$? PASS $(grep -c ' PASS ' "$OUT/nccl_check.log") FAIL $(grep -c ' FAIL ' "$OUT/nccl_check.log")"
  grep " FAIL " "$OUT/nccl_check.log" | head -3
  for mb in 100 25; do
    timeout 120 $TORCHRUN --no-python --nproc-per-node 2 --master-port 2941$((mb / 25)) "$BIN/nccl_check" \
      --bench --bucket-mb "$mb" > "$OUT/nccl_bench_$mb.log" 2>&1
    echo "-- buckets of <= $mb MiB: rc=$?"
    grep "BENCH" "$OUT/nccl_bench_$mb.log" | grep "rank 0" | grep -E "f32 all_reduce|bucketed|ratios"
  done
  timeout 90 $TORCHRUN --nproc-per-node 2 --master-port 29430 "$HERE/torch_allreduce.py" --mib 256 \
    2>&1 | tee "$OUT/torch_allreduce.log" | grep '^{'
fi
for size in $SIZES; do
  NPROC=1 bash "$HERE/ab-option.sh" "$CARRY" "$size" O2 "" 1
  NPROC=2 bash "$HERE/ab-option.sh" "$CARRY" "$size" O2 "--fp8-one-shot" "${PAIRS:-2}"
done
