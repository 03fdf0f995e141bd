#!/usr/bin/env bash
# ddp-scaling.sh [CARRY] [SIZES]: data-parallel scaling on a machine with 2
# GPUs, ours beside PyTorch DDP, in one device call, most important first,
# each run under `timeout` with its log in $OUT:
#   1. 256 MiB of F32-equivalent gradients: our F32 all-reduce, FP8
#      all-reduce and bucketed FP8 reduction (nccl_check --bench), and
#      NCCL's F32 and BF16 all-reduce through PyTorch (torch_allreduce.py);
#   2. per size (default 350m): GPT O2 and O3 (fp8-current, BF16
#      activations) with 8 sequences x 1024 per rank on 1 GPU and on 2
#      (weak scaling, --batch 16), and gpt_old (a build to compare with,
#      when CARRY holds one) at OLD_LEVELS (default O2); torch_gpt.py
#      on 1 GPU and torch_ddp.py on 2, eager (and with COMPILE=1,
#      compiled);
#   3. strong scaling (--batch 8 on 2 GPUs), the shell-loop launch, and a
#      two-node launch simulated on one host (torchrun --nnodes 2, one GPU
#      each), at O2 (unless LAUNCH=0);
#   4. VARIANTS: more runs on 2 GPUs, each LEVEL:ARGS with commas for
#      spaces, e.g. "O2:--no-overlap O2:--bucket-mb,25".
# CARRY (default .carry/nccl) holds gpt.gz, nccl_check.gz (and gpt_old.gz)
# built with `--features nccl`. NVLink SHARP (multicast) stays off.
# Env: STEPS (25), SKIP (5), COMPILE (0), BENCH (1: section 1), LAUNCH (1),
# VARIANTS (none), EXTRA (more gpt arguments, for every run of ours),
# LEVELS (O2 O3: ours in section 2; empty: none), OLD_LEVELS (O2), TORCH (1: PyTorch's
# runs of section 2),
# NPROC (2: the GPU counts of sections 1, 2 and 4, a list such as "2 4"
# on a larger host, 8 sequences a rank; section 3 always uses 2).
#
#   bash scripts/gpu/ddp-scaling.sh .carry/nccl "350m 1.3b"
set -uo pipefail
CARRY=${1:-.carry/nccl}
SIZES=${2:-350m}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack gpt gpt_old nccl_check; need gpt
[ "${BENCH:-1}" = 1 ] && need nccl_check
facts
STEPS=${STEPS:-25}; SKIP=${SKIP:-5}; NS=${NPROC:-2}
if [ "${BENCH:-1}" = 1 ]; then
for N in $NS; do
echo "== 1. 256 MiB on $N GPUs: ours (nccl_check --bench), then PyTorch's NCCL all-reduce"
timeout 150 $TORCHRUN --no-python --nproc-per-node "$N" --master-port 29500 "$BIN/nccl_check" --bench \
  > "$OUT/nccl_bench_x$N.log" 2>&1; echo "rc=$?"
echo "checks: $(grep -c ' PASS ' "$OUT/nccl_bench_x$N.log") PASS, $(grep -c ' FAIL ' "$OUT/nccl_bench_x$N.log") FAIL"
grep -E "BENCH|FAIL" "$OUT/nccl_bench_x$N.log" | grep "rank 0" | head -12
timeout 90 $TORCHRUN --nproc-per-node "$N" --master-port 29510 "$HERE/torch_allreduce.py" --mib 256 \
  2>&1 | tee "$OUT/torch_allreduce_x$N.log" | grep '^{'
done
fi
port=29600
ours() { # ours LABEL NPROC BIN BATCH LEVEL [gpt args...]
  local label=$1 nproc=$2 bin=$3 batch=$4 level=$5; shift 5
  port=$((port + 10))
  # shellcheck disable=SC2206 # EXTRA is a list of arguments
  local args=(--device cuda --size "$size" --vocab 50304 --batch "$batch" --seq 1024 --steps "$STEPS"
              --timing-skip "$SKIP" --eval-every 1000 --eval-batches 1 --compute fp8-current
              --activations bf16 --json --level "$level" ${EXTRA:-} "$@")
  if [ "$nproc" = 1 ]; then
    timeout 200 "$BIN/$bin" "${args[@]}" > "$OUT/$label.log" 2>&1
  else
    timeout 200 $TORCHRUN --no-python --nproc-per-node "$nproc" --master-port "$port" "$BIN/$bin" "${args[@]}" \
      > "$OUT/$label.log" 2>&1
  fi
  echo "rc=$? $(show "$OUT/$label.log" "$label")"; grep -iE "^error|panick" "$OUT/$label.log" | head -3
}
torch() { # torch LABEL NPROC [args...]
  local label=$1 nproc=$2; shift 2
  port=$((port + 10))
  if [ "$nproc" = 1 ]; then
    timeout 300 python3 "$HERE/torch_gpt.py" --size "$size" --batch 8 --steps "$STEPS" "$@" > "$OUT/$label.log" 2>&1
  else
    timeout 300 $TORCHRUN --nproc-per-node "$nproc" --master-port "$port" "$HERE/torch_ddp.py" --size "$size" \
      --batch 8 --steps "$STEPS" "$@" > "$OUT/$label.log" 2>&1
  fi
  echo "rc=$? $label $(grep '^{' "$OUT/$label.log" | tail -1)"
}
for size in $SIZES; do
  echo "== 2. $size, 8 x 1024 a rank"
  for lv in ${LEVELS-O2 O3}; do
    ours "${size}_${lv}_x1" 1 gpt 8 "$lv"
    for N in $NS; do ours "${size}_${lv}_x$N" "$N" gpt $((8 * N)) "$lv"; done
  done
  N=${NS##* }
  for v in ${VARIANTS:-}; do
    lv=${v%%:*}; vargs=${v#*:}
    # shellcheck disable=SC2086 # the variant's arguments, split on commas
    ours "${size}_${lv}_x${N}_$(echo "$vargs" | tr -c 'a-z0-9\n' '_')" "$N" gpt $((8 * N)) "$lv" ${vargs//,/ }
  done
  if [ -x "$BIN/gpt_old" ]; then
    for lv in ${OLD_LEVELS:-O2}; do
      ours "${size}_${lv}_x1_old" 1 gpt_old 8 "$lv"
      for N in $NS; do ours "${size}_${lv}_x${N}_old" "$N" gpt_old $((8 * N)) "$lv"; done
    done
  fi
  [ "${TORCH:-1}" = 1 ] || continue
  torch "${size}_torch_x1" 1 --modes bf16
  for N in $NS; do torch "${size}_torch_ddp_x$N" "$N"; done
  if [ "${COMPILE:-0}" = 1 ]; then
    torch "${size}_torch_compile_x1" 1 --modes bf16-compile
    for N in $NS; do torch "${size}_torch_ddp_compile_x$N" "$N" --compile; done
  fi
done
[ "${LAUNCH:-1}" = 1 ] || exit 0
size=${SIZES%% *}
echo "== 3. $size O2: strong scaling, shell loop, two nodes on one host"
ours "${size}_O2_x2_strong" 2 gpt 8 O2
# shellcheck disable=SC2206
loopargs=(--device cuda --size "$size" --vocab 50304 --batch 16 --seq 1024 --steps "$STEPS" --timing-skip "$SKIP"
          --eval-every 1000 --eval-batches 1 --compute fp8-current --activations bf16 --json --level O2)
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29900 \
    timeout 200 "$BIN/gpt" "${loopargs[@]}" > "$OUT/${size}_O2_loop_$r.log" 2>&1 &
done; wait
echo "loop: $(show "$OUT/${size}_O2_loop_0.log" "${size}_O2_loop")"
for node in 0 1; do
  CUDA_VISIBLE_DEVICES=$node timeout 200 $TORCHRUN --nnodes 2 --node-rank "$node" --nproc-per-node 1 \
    --master-addr 127.0.0.1 --master-port 29950 --no-python "$BIN/gpt" "${loopargs[@]}" \
    > "$OUT/${size}_O2_nodes_$node.log" 2>&1 &
done; wait
echo "two nodes: $(show "$OUT/${size}_O2_nodes_0.log" "${size}_O2_nodes")"
