#!/usr/bin/env bash
# block.sh [CARRY]: the block-scaled FP8 path in one device call (issue:
# fine-grained FP8): cuBLASLt's own block-scaled GEMM speed (the probe),
# ours beside per-tensor FP8 and BF16 at the same shapes
# (`cuda_check --block-only`: GEMMs and the block casts' bandwidth), and the
# GPT example at each SIZE, O2, BF16 activations, with fp8-current and
# fp8-block, 8 x 1024 tokens a step.
# CARRY (default .carry/block) holds gpt.gz, cuda_check.gz and
# blockscale_probe.gz (scripts/gpu/build-probe.sh); an earlier build's
# gpt_old.gz and cuda_check_old.gz, where carried, run beside them in the
# same call (the old GPT for every compute but fp8-current). Env: SIZES
# (350m 1.3b), STEPS (20), SKIP (5), COMPUTES (fp8-current fp8-block).
#
#   bash scripts/gpu/block.sh .carry/block
set -uo pipefail
CARRY=${1:-.carry/block}
source "$(dirname "$0")/lib.sh"
unpack gpt gpt_old cuda_check cuda_check_old blockscale_probe; need cuda_check
facts
if [ -x "$BIN/blockscale_probe" ]; then
  timeout 200 "$BIN/blockscale_probe" 2>&1 | tee "$OUT/probe.log"
fi
for prog in cuda_check_old cuda_check; do
  [ -x "$BIN/$prog" ] || continue
  echo "== $prog"
  timeout 300 "$BIN/$prog" --block-only 2>&1 | tee "$OUT/${prog}_block.log" | grep -E "BENCH|CHECK|ERROR"
done
[ -x "$BIN/gpt" ] || exit 0
for size in ${SIZES:-350m 1.3b}; do
  for compute in ${COMPUTES:-fp8-current fp8-block}; do
    for prog in gpt gpt_old; do
      [ -x "$BIN/$prog" ] || continue
      [ "$prog" = gpt_old ] && [ "$compute" = fp8-current ] && continue
      label="${prog}_${size}_O2_${compute}"
      timeout 300 "$BIN/$prog" --device cuda --size "$size" --vocab 50304 --batch 8 --seq 1024 \
        --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 \
        --level O2 --compute "$compute" --activations bf16 --json > "$OUT/$label.log" 2>&1
      echo "rc=$? $(show "$OUT/$label.log" "$label")"; grep -iE "^error|panick" "$OUT/$label.log" | head -3
    done
  done
done
