#!/usr/bin/env bash
# recompute.sh [CARRY] [SIZES]: activation recomputation and the largest
# GPT on one GPU, ours beside PyTorch, in one device call, each program
# under `timeout` with its log in $OUT. Per size of SIZES (default
# "1.3b 2.7b 6.7b"): our GPT at each LEVEL with each recompute MODE
# (8 x 1024, fp8-current, BF16 activations; a configuration the memory
# check refuses says so and goes on), then torch_gpt.py eager BF16
# without and with `--checkpoint` (a mode that runs out of memory prints
# its error line).
# CARRY (default .carry/gpu) holds gpt.gz.
# Env: STEPS (20), SKIP (5), LEVELS (O2), COMPUTE (fp8-current; native for
# the BF16 baseline), MODES (none selective full), TORCH (1), EXTRA (more
# gpt arguments, e.g. --lean-step; they join the log's name).
#
#   bash scripts/gpu/recompute.sh .carry/gpu "2.7b 6.7b"
set -uo pipefail
CARRY=${1:-.carry/gpu}
SIZES=${2:-1.3b 2.7b 6.7b}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
facts
for size in $SIZES; do
  echo "== $size"
  for lv in ${LEVELS:-O2}; do
    for mode in ${MODES:-none selective full}; do
      label="${size}_${lv}_${COMPUTE:-fp8-current}_${mode}$(echo ${EXTRA:-} | tr -d ' ')"
      timeout 300 "$BIN/gpt" --device cuda --size "$size" --vocab 50304 --batch 8 --seq 1024 \
        --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 --level "$lv" \
        --compute "${COMPUTE:-fp8-current}" --activations bf16 --recompute "$mode" ${EXTRA:-} --json \
        > "$OUT/$label.log" 2>&1
      echo "rc=$? $(show "$OUT/$label.log" "$label")"; grep -iE "^error|panick|needs about" "$OUT/$label.log" | head -3
    done
  done
  [ "${TORCH:-1}" = 1 ] || continue
  for ck in "" --checkpoint; do
    timeout 300 python3 "$HERE/torch_gpt.py" --size "$size" --steps "${STEPS:-20}" --warmup "${SKIP:-5}" \
      --modes bf16 $ck > "$OUT/${size}_torch${ck}.log" 2>&1
    echo "rc=$? $(grep '^{' "$OUT/${size}_torch${ck}.log" | tail -1)"
  done
done
