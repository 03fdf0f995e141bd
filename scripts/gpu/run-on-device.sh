#!/usr/bin/env bash
# run-on-device.sh [CARRY] [cuda_check args...]: cuda_check's timings on the
# GPU (with --bench its GEMM and cast timings, then torch_gemm.py's in the
# same call and compare.py's table of both). The checks against the CPU are
# the GPU tests (run-tests.sh).
# CARRY (default .carry/gpu) holds cuda_check.gz. Logs go to $OUT.
#
#   bash scripts/gpu/run-on-device.sh .carry/gpu --bench
set -uo pipefail
CARRY=${1:-.carry/gpu}; shift || true
source "$(dirname "$0")/lib.sh"
unpack cuda_check; need cuda_check
facts
timeout 580 "$BIN/cuda_check" "$@" 2>&1 | tee "$OUT/cuda_check.log"
rc=${PIPESTATUS[0]}
if [[ " $* " == *" --bench"* ]]; then
  timeout 140 python3 "$HERE/torch_gemm.py" 2>&1 | tee "$OUT/torch.log"
  python3 "$HERE/compare.py" "$OUT/cuda_check.log" "$OUT/torch.log" | tee "$OUT/table.md"
fi
exit "$rc"
