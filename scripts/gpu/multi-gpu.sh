#!/usr/bin/env bash
# multi-gpu.sh [CARRY]: the two-GPU measurements in one device call (a
# machine with 2 GPUs), most important first, each under `timeout` with its
# log in $OUT, so a call cut short still returns what was done:
#   1. nccl_check --bench on 2 GPUs under torchrun (every collective, the
#      FP8 all-reduce against the in-process backend on the CPU, 256 MiB of
#      F32 gradients: F32 all-reduce against FP8);
#   2. the same checks started by a shell loop that sets the variables;
#   3. GPT 350M O2 (BF16 activations, batch 8 in all) on 2 GPUs under
#      torchrun, then on 1 GPU; the same at O3 (ZeRO).
# CARRY (default .carry/nccl) holds gpt.gz and nccl_check.gz built with
# `--features nccl`. NVLink SHARP (multicast) stays off, as in the figures
# of BENCHMARKS.md. Env: STEPS (10), SKIP (3).
#
#   bash scripts/gpu/multi-gpu.sh .carry/nccl
set -uo pipefail
CARRY=${1:-.carry/nccl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack gpt nccl_check; need gpt nccl_check
facts
summ() { grep -c " PASS " "$1" | sed 's/^/PASS lines: /'; grep -E " FAIL |BENCH|rror" "$1" | head -12; }
echo "== 1. nccl_check --bench, torchrun"
timeout 120 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29500 "$BIN/nccl_check" --bench \
  > "$OUT/nccl_torchrun.log" 2>&1; echo "rc=$?"; summ "$OUT/nccl_torchrun.log"
echo "== 2. nccl_check, shell loop"
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 \
    timeout 90 "$BIN/nccl_check" > "$OUT/nccl_loop_$r.log" 2>&1 &
done; wait; summ "$OUT/nccl_loop_0.log"; summ "$OUT/nccl_loop_1.log"
gptargs=(--device cuda --size 350m --vocab 50304 --batch 8 --seq 1024 --steps "${STEPS:-10}"
         --timing-skip "${SKIP:-3}" --eval-every 1000 --compute fp8-current --activations bf16 --json)
show() { grep '^{' "$1" | python3 -c "
import json, sys
for l in sys.stdin:
    j = json.loads(l)
    print('$2', 'tok/s(median) %.0f' % j['tokens_per_s_median'], 'step %.1f ms' % j['step_ms_median'],
          'peak %.2f GiB' % (j['peak_device_bytes'] / 2**30), 'pers %.3f GB' % (j['persistent_bytes']['total'] / 1e9),
          'B/lp %.3f' % j['bytes_per_linear_param'], 'world', j.get('world_size'), 'val %.4f' % j['val_loss'])"; }
for lv in O2 O3; do
  echo "== 3. gpt 350m $lv, 2 GPUs, torchrun"
  timeout 150 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29700 "$BIN/gpt" "${gptargs[@]}" \
    --level "$lv" > "$OUT/gpt_${lv}_2.log" 2>&1
  echo "rc=$?"; show "$OUT/gpt_${lv}_2.log" "$lv x2"; grep -iE "error" "$OUT/gpt_${lv}_2.log" | head -3
  echo "== gpt 350m $lv, 1 GPU"
  timeout 100 "$BIN/gpt" "${gptargs[@]}" --level "$lv" > "$OUT/gpt_${lv}_1.log" 2>&1
  echo "rc=$?"; show "$OUT/gpt_${lv}_1.log" "$lv x1"
done
