#!/usr/bin/env bash
# final.sh: one device call for BENCHMARKS.md's GPT tables (run with carry
# [".carry"], binaries and scripts in .carry/gpu/). The GPU tests (no 2^32
# sweep; gpu-tests.gz, see run-tests.sh), the optimizer's bench, then run-gpt.sh at 125M
# and 350M: the five levels with F32 activations, O0 native and O2 with BF16
# activations, PyTorch (eager at both sizes, compiled and torchao at 350M).
# Summary lines go to the output (a call returns only a few files).
set -uo pipefail
C=.carry/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source $C/device-env.sh
gzip -dc $C/cuda_check.gz > /tmp/cuda_check && chmod +x /tmp/cuda_check
# SIZES (default "125m 350m"), NO_TESTS=1 (no GPU tests), CHECK_ARGS
# (cuda_check's timings, e.g. --bench; default empty: none), TORCH350
# (torch modes at 350M).
SIZES=${SIZES:-"125m 350m"}
CHECK_ARGS=${CHECK_ARGS:-}
if [ -z "${NO_TESTS:-}" ]; then
  TIMEOUT=200 OUT=$OUT bash $C/run-tests.sh $C > /dev/null; echo "gpu tests rc=$?"
  grep -E "^test result|FAILED|panicked" $OUT/gpu-tests.log
fi
if [ -n "$CHECK_ARGS" ]; then
  timeout 200 /tmp/cuda_check $CHECK_ARGS --watchdog 190 > $OUT/check.log 2>&1; echo "cuda_check rc=$?"
  grep -E "^CHECK|FAIL|ERROR|panic" $OUT/check.log | tr '\n' ' '; echo
  grep -E "^BENCH (copy|cast|pool)" $OUT/check.log
  if [[ " $CHECK_ARGS " == *" --bench"* ]]; then
    PYTHONUNBUFFERED=1 timeout 140 python3 $C/torch_gemm.py > $OUT/torch_gemm.log 2>&1
    python3 $C/compare.py $OUT/check.log $OUT/torch_gemm.log
  fi
fi
RUNS="O0:native O0:fp8-delayed O1:fp8-current O2:fp8-current O3:fp8-current"
for size in $SIZES; do
  modes=bf16; [ $size = 350m ] && modes=${TORCH350:-bf16,bf16-compile,fp8-torchao}
  skip=; [ $size != "${SIZES%% *}" ] && skip=1   # the optimizer's check and bench once
  NO_CHECK=$skip STEPS=8 SKIP=3 TORCH_MODES=$modes OUT=/tmp/$size bash $C/run-gpt.sh $C $size "$RUNS" > /tmp/$size.log 2>&1
  NO_CHECK=1 STEPS=8 SKIP=3 TORCH_MODES= EXTRA="--activations bf16" OUT=/tmp/$size-bf16 \
    bash $C/run-gpt.sh $C $size "O0:native O2:fp8-current" > /tmp/$size-bf16.log 2>&1
  [ -f /tmp/$size/optim_check.log ] && grep -E "BENCH|CHECK" /tmp/$size/optim_check.log
  cat /tmp/$size/gpt.jsonl /tmp/$size-bf16/gpt.jsonl > $OUT/gpt-$size.jsonl
  python3 $C/summary.py $OUT/gpt-$size.jsonl /tmp/$size/torch_gpt.log
  cp /tmp/$size/torch_gpt.log $OUT/torch-$size.log
  grep -h -B3 "rc=[1-9]" /tmp/$size/gpt.log /tmp/$size-bf16/gpt.log | head -12
done
