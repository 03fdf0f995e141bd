#!/usr/bin/env bash
# build-probe.sh [OUT_DIR]: compiles scripts/gpu/blockscale_probe.cu (cuBLASLt's
# own speed for the FP8 GEMMs, the floor `cuda_check --block-only` is compared
# with) with the CUDA 13.0 toolkit build-cuda.sh installs, for Hopper (sm_90),
# into OUT_DIR (default .carry/probe) as a gzipped binary to carry. On the
# GPU machine: `gzip -dc blockscale_probe.gz > p && chmod +x p && ./p`
# after `source scripts/gpu/device-env.sh` (it finds libcublasLt there).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-.carry/probe}
mkdir -p "$OUT"
eval "$("$HERE/build-cuda.sh" --print-env)"
"${NVCC:-nvcc}" -O2 -std=c++17 -arch=sm_90 -o "$OUT/blockscale_probe" "$HERE/blockscale_probe.cu" \
  -L"$CUDA_ROOT/lib" -lcublasLt -lcudart
strip "$OUT/blockscale_probe" 2>/dev/null || true
gzip -f "$OUT/blockscale_probe"
echo "build-probe.sh: $OUT/blockscale_probe.gz"
