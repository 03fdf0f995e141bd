#!/usr/bin/env bash
# reduction-ab.sh [CARRY] [SIZES]: a change to the FP8 reduction checked
# and measured in one call on a machine with 2 GPUs: the GPU test
# binary's bucket kernels against the CPU (CARRY/../tests), nccl_check
# (NCCL's results bitwise the in-process backend's) and its benchmark at
# 100 and 25 MiB buckets, then the GPT example's 2-GPU step, the build
# in CARRY (gpt) and the one before (gpt_old) alternated twice per size
# and level, and one 1-GPU run per size and level for the ratio.
# CARRY (default .carry/nccl) holds gpt.gz, gpt_old.gz and nccl_check.gz
# built with `--features nccl`. Env: STEPS (15), SKIP (5), LEVELS (O2 O3).
#
#   bash scripts/gpu/reduction-ab.sh .carry/nccl "1.3b 350m"
set -uo pipefail
CARRY=${1:-.carry/nccl}
SIZES=${2:-1.3b}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack gpt gpt_old nccl_check; need gpt gpt_old nccl_check
facts
if [ -f "$(dirname "$CARRY")/tests/gpu.gz" ]; then
  TEST_TIMEOUT=100 timeout 110 bash "$HERE/run-tests.sh" "$(dirname "$CARRY")/tests" bucket 2>&1 \
    | grep -E "test result|FAIL|differ|device 0x" | head -8
fi
timeout 90 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29400 "$BIN/nccl_check" \
  > "$OUT/nccl_check.log" 2>&1
echo "nccl_check rc=$? PASS $(grep -c ' PASS ' "$OUT/nccl_check.log") FAIL $(grep -c ' FAIL ' "$OUT/nccl_check.log")"
grep " FAIL " "$OUT/nccl_check.log" | head -3
for mb in 100 25; do
  timeout 90 $TORCHRUN --no-python --nproc-per-node 2 --master-port 2941$((mb / 25)) "$BIN/nccl_check" --bench \
    --bucket-mb "$mb" > "$OUT/nccl_bench_$mb.log" 2>&1
  grep "BENCH" "$OUT/nccl_bench_$mb.log" | grep "rank 0" | grep -E "f32 all_reduce|bucketed|ratios|host us"
done
port=29700
run() { # run NPROC BIN SIZE LEVEL TAG
  port=$((port + 10))
  local launch="$TORCHRUN --no-python --nproc-per-node $1 --master-port $port"
  [ "$1" = 1 ] && launch=
  local log="$OUT/$3_$4_$2_x$1_$5.log"
  # shellcheck disable=SC2086 # the launcher's words
  timeout 150 $launch "$BIN/$2" --device cuda --size "$3" --vocab 50304 --batch $((8 * $1)) --seq 1024 \
    --steps "${STEPS:-15}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 \
    --compute fp8-current --activations bf16 --json --level "$4" > "$log" 2>&1
  echo "rc=$? $(show "$log" "$3_$4_$2_x$1_$5")"
}
for size in $SIZES; do
  for lv in ${LEVELS:-O2 O3}; do
    run 1 gpt "$size" "$lv" 0
    for rep in 1 2; do for b in gpt_old gpt; do run 2 "$b" "$size" "$lv" "$rep"; done; done
  done
done
