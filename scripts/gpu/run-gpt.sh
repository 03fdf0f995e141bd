#!/usr/bin/env bash
# run-gpt.sh [CARRY] [SIZE] ["LEVEL:COMPUTE ..."]: the GPT example per level
# against PyTorch, in one device call. First `cuda_check --optim-only
# --bench` (the fused low-bit AdamW step's time over its bandwidth floor;
# its checks against the CPU are the GPU tests, run-tests.sh), then per run `gpt --device cuda --size SIZE --vocab 50304 --batch
# 8 --seq 1024 ... --json`, then torch_gpt.py on the same GPU. Every program
# under `timeout`; logs and JSON lines in $OUT; summary.py prints the lines
# BENCHMARKS.md quotes.
#
# CARRY (default .carry/gpu) holds gpt.gz and cuda_check.gz, and the
# torchao wheel for `fp8-torchao` (lib.sh's `wheels` says how to fetch it).
# SIZE default 350m; runs default: O0 native (BF16 GEMMs), O0 + fp8-delayed (the TE
# path), O1, O2, O3 with fp8-current.
# Env: STEPS (20), SKIP (5: steps left out of the timing), TORCH_MODES
# (bf16,bf16-compile,fp8-torchao; empty: none), NO_CHECK=1 (no cuda_check),
# EXTRA (more gpt arguments, e.g. "--activations bf16").
#
#   STEPS=14 SKIP=4 EXTRA="--activations bf16" bash scripts/gpu/run-gpt.sh .carry/gpu 350m
set -uo pipefail
CARRY=${1:-.carry/gpu}
SIZE=${2:-350m}
RUNS=${3:-"O0:native O0:fp8-delayed O1:fp8-current O2:fp8-current O3:fp8-current"}
STEPS=${STEPS:-20}
SKIP=${SKIP:-5}
TORCH_MODES=${TORCH_MODES-bf16,bf16-compile,fp8-torchao}
source "$(dirname "$0")/lib.sh"
unpack gpt cuda_check; need gpt
facts
wheels
if [ -z "${NO_CHECK:-}" ] && [ -x "$BIN/cuda_check" ]; then
  timeout 150 "$BIN/cuda_check" --optim-only --bench --watchdog 140 2>&1 | tee "$OUT/optim_check.log"
fi
: > "$OUT/gpt.log"
for r in $RUNS; do
  level=${r%%:*}; compute=${r#*:}
  echo "== gpt $SIZE $level $compute" | tee -a "$OUT/gpt.log"
  # shellcheck disable=SC2086 # EXTRA is a list of arguments
  timeout 150 "$BIN/gpt" --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
    --steps "$STEPS" --timing-skip "$SKIP" --eval-every 1000 --level "$level" --compute "$compute" \
    --json ${EXTRA:-} 2>&1 | tee -a "$OUT/gpt.log"
  echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpt.log"
done
grep '^{' "$OUT/gpt.log" > "$OUT/gpt.jsonl"
: > "$OUT/torch_gpt.log"
if [ -n "$TORCH_MODES" ]; then
  timeout 330 python3 "$HERE/torch_gpt.py" --size "$SIZE" --modes "$TORCH_MODES" 2>&1 | tee "$OUT/torch_gpt.log"
fi
python3 "$HERE/summary.py" "$OUT/gpt.jsonl" "$OUT/torch_gpt.log"
