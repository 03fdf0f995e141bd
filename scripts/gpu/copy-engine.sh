#!/usr/bin/env bash
# copy-engine.sh [CARRY]: `nccl_check --bench-ce` on NPROC GPUs (default 2)
# under torchrun: NCCL's copy-engine all-to-all + all-gather (zero-CTA
# communicator, symmetric windows) against the same calls on NCCL's
# kernels and against the backend's grouped sends and receives, alone and
# beside GEMMs / memory-bound kernels. CARRY (default .carry/nccl) holds
# nccl_check.gz built with `--features nccl`. NVLink SHARP stays off.
# CE_MIB: MiB a peer (default 16).
#
#   bash scripts/gpu/copy-engine.sh .carry/nccl
set -uo pipefail
CARRY=${1:-.carry/nccl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack nccl_check; need nccl_check
facts
N=${NPROC:-2}
NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT} \
  timeout 150 $TORCHRUN --no-python --nproc-per-node "$N" --master-port 29820 \
  "$BIN/nccl_check" --bench-ce --ce-mib "${CE_MIB:-16}" > "$OUT/ce.log" 2>&1
echo "rc=$?"
grep -c " PASS " "$OUT/ce.log" | sed 's/^/checks passed: /'
grep -E " FAIL |rror" "$OUT/ce.log" | head
grep -iE "Symmetric" "$OUT/ce.log" | sort | uniq -c | head -4
grep "rank 0/" "$OUT/ce.log" | grep " CE " | sed "s/^.*CE //"
