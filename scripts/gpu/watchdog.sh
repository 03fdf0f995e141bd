#!/usr/bin/env bash
# watchdog.sh [CARRY]: NCCL's watchdog on 2 GPUs. Two ranks of the GPT
# example started by a shell loop (so that nothing ends the group for
# them), AMP_NCCL_TIMEOUT_S=${TIMEOUT:-15}; WARMUP (30) seconds later,
# once both train, rank 1 is killed with SIGKILL. Rank 0 must abort,
# naming the collective, about TIMEOUT seconds later instead of hanging.
# Each rank's log shows its steps (AMP_STEP_CLOCK), so that a run killed
# before training began shows it. CARRY (default .carry/nccl) holds gpt.gz
# built with `--features nccl`.
#
#   bash scripts/gpu/watchdog.sh .carry/nccl
set -uo pipefail
CARRY=${1:-.carry/nccl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
export AMP_NCCL_TIMEOUT_S=${TIMEOUT:-15} AMP_STEP_CLOCK=1
args=(--device cuda --size 125m --vocab 50304 --batch 8 --seq 512 --steps 100000 --eval-every 1000000
      --compute fp8-current --activations bf16 --level O2)
pids=()
# the ranks themselves (no wrapper: a SIGKILL must reach the process that
# holds the GPU), each killed on exit whatever happened
trap 'kill -9 "${pids[@]}" 2>/dev/null; rm -rf "$BIN"' EXIT
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29650 \
    "$BIN/gpt" "${args[@]}" > "$OUT/watchdog_$r.log" 2>&1 &
  pids+=($!)
done
sleep "${WARMUP:-30}"
kill -9 "${pids[1]}"
killed=$(date +%s)
# rank 0 must end within the timeout and a margin
for _ in $(seq $((AMP_NCCL_TIMEOUT_S + 60))); do
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 1
done
if kill -0 "${pids[0]}" 2>/dev/null; then
  echo "FAIL: rank 0 still runs $(( $(date +%s) - killed )) s after rank 1 was killed"; rc=1
else
  wait "${pids[0]}"; code=$?
  echo "rank 0 ended (status $code) $(( $(date +%s) - killed )) s after rank 1 was killed (timeout $AMP_NCCL_TIMEOUT_S s)"
  grep -q "aborting" "$OUT/watchdog_0.log" && rc=0 || rc=1
fi
for r in 0 1; do
  echo "rank $r: $(grep -c '^step' "$OUT/watchdog_$r.log") steps logged; last lines:"
  grep -v '^step' "$OUT/watchdog_$r.log" | tail -4
done
exit "$rc"
