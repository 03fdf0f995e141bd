#!/usr/bin/env bash
# ab-option.sh [CARRY] [SIZE] [LEVEL] [OPTION] [PAIRS]: one build's GPT
# example with and without OPTION (e.g. --producer-amax), alternated
# (off, on) PAIRS times on the same GPU: a change that a switch keeps off
# until measured, timed against itself. 8 x 1024, BF16 activations,
# fp8-current; one line a run (tokens/s, step, peak, validation loss: the
# same where the option keeps the values). An empty OPTION runs the
# build alone twice a pair (a baseline); a word VAR=VALUE in OPTION sets
# the environment instead (e.g. AMP_SIDE_STREAM_PRIORITY=high).
#
# CARRY (default .carry/gpu) holds gpt.gz. Env: STEPS (20), SKIP (5),
# NPROC (1; more: that many GPUs under torchrun, 8 sequences a rank).
#
#   bash scripts/gpu/ab-option.sh .carry/gpu 350m O2 "--producer-amax false" 3
#   NPROC=2 bash scripts/gpu/ab-option.sh .carry/gpu 1.3b O2 "--casts-ahead false" 2
set -uo pipefail
CARRY=${1:-.carry/gpu}; SIZE=${2:-350m}; LEVEL=${3:-O2}; OPTION=${4---producer-amax}; PAIRS=${5:-3}
NPROC=${NPROC:-1}
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
launch=; [ "$NPROC" -gt 1 ] && launch="$TORCHRUN --no-python --nproc-per-node $NPROC --master-port 29650"
run() { # LABEL WORDS... (VAR=VALUE words set the environment, the others are arguments)
  local label=$1; shift
  local envs=() args=() w
  for w in "$@"; do case $w in [A-Z_]*=*) envs+=("$w") ;; *) args+=("$w") ;; esac; done
  # shellcheck disable=SC2086 # the launcher's words
  env ${envs[@]+"${envs[@]}"} timeout 200 $launch "$BIN/gpt" --device cuda --size "$SIZE" --vocab 50304 \
    --batch $((8 * NPROC)) --seq 1024 --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 \
    --eval-batches 1 --activations bf16 --compute fp8-current --level "$LEVEL" --json ${args[@]+"${args[@]}"} \
    > "$OUT/$label.log" 2>&1
  echo "rc=$? $(show "$OUT/$label.log" "$label")"
}
for rep in $(seq "$PAIRS"); do
  run "${SIZE}_${LEVEL}_x${NPROC}_off_$rep"
  # shellcheck disable=SC2086 # the option may be several words
  run "${SIZE}_${LEVEL}_x${NPROC}_on_$rep" $OPTION
done
