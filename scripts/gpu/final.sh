#!/usr/bin/env bash
# final.sh [CARRY]: the GPU tests and the GPT tables in one device call.
# The GPU tests (test-binaries.sh's, in .carry/tests; no 2^32 sweep), with
# CHECK_ARGS cuda_check's timings, then run-gpt.sh per size:
# the five levels with F32 activations (the optimizer's check and bench with
# the first size only), then O0 native and O2 with BF16 activations, and
# PyTorch (eager; at 350M also compiled and torchao). The summary lines go
# to the output, so the call's output holds the whole table.
# CARRY (default .carry/gpu) holds gpt.gz and cuda_check.gz.
# Env: SIZES ("125m 350m"), NO_TESTS=1 (no GPU tests), CHECK_ARGS (empty:
# no cuda_check; --bench: its timings, and torch_gemm.py and compare.py,
# the GEMM table), TORCH350 (torch modes at 350M).
#
#   SIZES=125m CHECK_ARGS=--bench bash scripts/gpu/final.sh
set -uo pipefail
CARRY=${1:-.carry/gpu}
SIZES=${SIZES:-"125m 350m"}
CHECK_ARGS=${CHECK_ARGS:-}
source "$(dirname "$0")/lib.sh"
unpack cuda_check
facts
if [ -z "${NO_TESTS:-}" ]; then
  TEST_TIMEOUT=200 bash "$HERE/run-tests.sh" .carry/tests > "$OUT/tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "^test result|FAILED|panicked" "$OUT/tests.log"
fi
if [ -n "$CHECK_ARGS" ]; then
  need cuda_check
  # shellcheck disable=SC2086 # CHECK_ARGS is a list of arguments
  timeout 200 "$BIN/cuda_check" $CHECK_ARGS --watchdog 190 > "$OUT/check.log" 2>&1
  echo "cuda_check rc=$?"
  grep -E "FAIL|ERROR|panic" "$OUT/check.log" | tr '\n' ' '; echo
  grep -E "^BENCH (copy|cast|pool)" "$OUT/check.log"
  if [[ " $CHECK_ARGS " == *" --bench"* ]]; then
    timeout 140 python3 "$HERE/torch_gemm.py" > "$OUT/torch_gemm.log" 2>&1
    python3 "$HERE/compare.py" "$OUT/check.log" "$OUT/torch_gemm.log"
  fi
fi
RUNS="O0:native O0:fp8-delayed O1:fp8-current O2:fp8-current O3:fp8-current"
first=${SIZES%% *}
for size in $SIZES; do
  modes=bf16; [ "$size" = 350m ] && modes=${TORCH350:-bf16,bf16-compile,fp8-torchao}
  skip=; [ "$size" != "$first" ] && skip=1
  NO_CHECK=$skip STEPS=8 SKIP=3 TORCH_MODES=$modes OUT="$OUT/$size" \
    bash "$HERE/run-gpt.sh" "$CARRY" "$size" "$RUNS" > "$OUT/$size.log" 2>&1
  NO_CHECK=1 STEPS=8 SKIP=3 TORCH_MODES= EXTRA="--activations bf16" OUT="$OUT/$size-bf16" \
    bash "$HERE/run-gpt.sh" "$CARRY" "$size" "O0:native O2:fp8-current" > "$OUT/$size-bf16.log" 2>&1
  [ -f "$OUT/$size/optim_check.log" ] && grep -E "BENCH|CHECK" "$OUT/$size/optim_check.log"
  cat "$OUT/$size/gpt.jsonl" "$OUT/$size-bf16/gpt.jsonl" > "$OUT/gpt-$size.jsonl"
  python3 "$HERE/summary.py" "$OUT/gpt-$size.jsonl" "$OUT/$size/torch_gpt.log"
  grep -h -B3 "rc=[1-9]" "$OUT/$size/gpt.log" "$OUT/$size-bf16/gpt.log" | head -12
done
