#!/usr/bin/env bash
# run-on-device.sh [CARRY_DIR] [cuda_check args...]: one device call. The
# timings of cuda_check, then (with --bench) the torch side in the same
# call, then the joined table. Logs go to $OUT. (The checks against the
# CPU are the GPU tests: run-tests.sh.)
set -uo pipefail
C=${1:-.carry}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$C/device-env.sh"
gzip -dc "$C/cuda_check.gz" > /tmp/cuda_check && chmod +x /tmp/cuda_check
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/facts.log"
timeout 430 /tmp/cuda_check "$@" 2>&1 | tee "$OUT/cuda_check.log"
rc=${PIPESTATUS[0]}
if [[ " $* " == *" --bench"* ]]; then
  PYTHONUNBUFFERED=1 timeout 140 python3 "$C/torch_gemm.py" 2>&1 | tee "$OUT/torch.log"
  python3 "$C/compare.py" "$OUT/cuda_check.log" "$OUT/torch.log" | tee "$OUT/table.md"
fi
exit $rc
