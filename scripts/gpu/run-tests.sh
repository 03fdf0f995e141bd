#!/usr/bin/env bash
# run-tests.sh [CARRY_DIR] [test args...]: the GPU tests (tests/gpu.rs) on
# the device. CARRY_DIR (default .carry) holds device-env.sh and
# gpu-tests.gz, the test binary built here with
#   scripts/gpu/build-cuda.sh cargo test --release --features cuda --no-run --test gpu
# (cargo prints its path), stripped and gzipped. The arguments go to the
# test binary: a name filter (`optim::`, `_cuda`), `--include-ignored` (the
# 2^32 sweeps, about 6 minutes more on an H100), `--nocapture
# --test-threads 1` (every case's line, in order). Output in
# $OUT/gpu-tests.log; exit status the binary's (TIMEOUT, default 540 s).
set -uo pipefail
C=${1:-.carry}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$C/device-env.sh"
gzip -dc "$C/gpu-tests.gz" > /tmp/gpu-tests && chmod +x /tmp/gpu-tests
timeout "${TIMEOUT:-540}" /tmp/gpu-tests "$@" 2>&1 | tee "$OUT/gpu-tests.log"
exit "${PIPESTATUS[0]}"
