#!/usr/bin/env bash
# nccl-tuning.sh [CARRY] [SIZE]: NCCL's own settings against our reduction
# on NPROC GPUs (default 2), one line each: for each setting in SETTINGS
# (space-separated; each a comma-separated list of VAR=VALUE, or
# `default`), `nccl_check --bench` (256 MiB: F32 all-reduce, the FP8
# path's collectives alone and each of them, the bucketed reduction) and,
# unless GPT=0, the GPT example at O2 on the NPROC GPUs (8 x 1024 a rank,
# as ddp-scaling.sh runs it), with the 1-GPU step first for the ratio.
# CARRY (default .carry/nccl) holds gpt.gz and nccl_check.gz built with
# `--features nccl`. NVLink SHARP (multicast) stays off. BENCH=0: no
# nccl_check.
#
#   SETTINGS="default NCCL_NCHANNELS_PER_PEER=16" bash scripts/gpu/nccl-tuning.sh .carry/nccl 1.3b
set -uo pipefail
CARRY=${1:-.carry/nccl}
size=${2:-1.3b}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack gpt nccl_check; need gpt nccl_check
facts
N=${NPROC:-2}; STEPS=${STEPS:-15}; SKIP=${SKIP:-5}
SETTINGS=${SETTINGS:-default}
args=(--device cuda --size "$size" --vocab 50304 --seq 1024 --steps "$STEPS" --timing-skip "$SKIP"
      --eval-every 1000 --eval-batches 1 --compute fp8-current --activations bf16 --json --level O2)
if [ "${GPT:-1}" = 1 ]; then
  timeout 200 "$BIN/gpt" "${args[@]}" --batch 8 > "$OUT/${size}_O2_x1.log" 2>&1
  echo "rc=$? $(show "$OUT/${size}_O2_x1.log" "${size}_O2_x1")"
fi
port=29700
for s in $SETTINGS; do
  vars=(); [ "$s" = default ] || IFS=, read -r -a vars <<< "$s"
  tag=$(echo "$s" | tr -c 'A-Za-z0-9\n' '_')
  port=$((port + 10))
  echo "== $s"
  if [ "${BENCH:-1}" = 1 ]; then
  env "${vars[@]}" timeout 150 $TORCHRUN --no-python --nproc-per-node "$N" --master-port "$port" \
    "$BIN/nccl_check" --bench > "$OUT/bench_$tag.log" 2>&1; echo "rc=$?"
  grep "rank 0/" "$OUT/bench_$tag.log" | grep -E "BENCH (f32|fp8|  of it|ratios)" | sed 's/^.*BENCH //'
  fi
  [ "${GPT:-1}" = 1 ] || continue
  port=$((port + 10))
  env "${vars[@]}" timeout 200 $TORCHRUN --no-python --nproc-per-node "$N" --master-port "$port" \
    "$BIN/gpt" "${args[@]}" --batch $((8 * N)) > "$OUT/${size}_O2_x${N}_$tag.log" 2>&1
  echo "rc=$? $(show "$OUT/${size}_O2_x${N}_$tag.log" "${size}_O2_x${N}_$tag")"
done
