#!/usr/bin/env bash
# watchdog.sh [CARRY]: NCCL's watchdog on 2 GPUs. Two ranks of the GPT
# example started by a shell loop (so that nothing ends the group for
# them), AMP_NCCL_TIMEOUT_S=${TIMEOUT:-15}; WARMUP (60) seconds later,
# once both train, rank 1 is killed with SIGKILL. Rank 0 must abort,
# naming the collective, about TIMEOUT seconds later instead of hanging.
# (Its first run, with WARMUP=30 on a fresh machine, ended at the call's
# time limit with both logs empty: not yet seen working.) CARRY (default
# .carry/nccl) holds gpt.gz built with `--features nccl`.
#
#   bash scripts/gpu/watchdog.sh .carry/nccl
set -uo pipefail
CARRY=${1:-.carry/nccl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
export AMP_NCCL_TIMEOUT_S=${TIMEOUT:-15}
args=(--device cuda --size 125m --vocab 50304 --batch 8 --seq 512 --steps 100000 --eval-every 1000000
      --compute fp8-current --activations bf16 --level O2)
pids=()
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29650 \
    timeout 300 "$BIN/gpt" "${args[@]}" > "$OUT/watchdog_$r.log" 2>&1 &
  pids+=($!)
done
sleep "${WARMUP:-60}"
kill -9 "${pids[1]}"
killed=$(date +%s)
wait "${pids[0]}"; rc=$?
echo "rank 0 exited rc=$rc $(( $(date +%s) - killed )) s after rank 1 was killed (timeout $AMP_NCCL_TIMEOUT_S s)"
grep -E "error|NCCL" "$OUT/watchdog_0.log" | tail -3
