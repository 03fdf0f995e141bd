#!/usr/bin/env bash
# ab-option.sh [CARRY] [SIZE] [LEVEL] [OPTION] [PAIRS]: one build's GPT
# example with and without OPTION (e.g. --producer-amax), alternated
# (off, on) PAIRS times on the same GPU: a change that a switch keeps off
# until measured, timed against itself. 8 x 1024, BF16 activations,
# fp8-current; one line a run (tokens/s, step, peak, validation loss: the
# same where the option keeps the values).
#
# CARRY (default .carry/gpu) holds gpt.gz. Env: STEPS (20), SKIP (5).
#
#   bash scripts/gpu/ab-option.sh .carry/gpu 350m O2 "--producer-amax false" 3
set -uo pipefail
CARRY=${1:-.carry/gpu}; SIZE=${2:-350m}; LEVEL=${3:-O2}; OPTION=${4:---producer-amax}; PAIRS=${5:-3}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
run() { # LABEL ARGS...
  local label=$1; shift
  timeout 200 "$BIN/gpt" --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
    --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 \
    --activations bf16 --compute fp8-current --level "$LEVEL" --json "$@" > "$OUT/$label.log" 2>&1
  echo "rc=$? $(show "$OUT/$label.log" "$label")"
}
for rep in $(seq "$PAIRS"); do
  run "${SIZE}_${LEVEL}_off_$rep"
  # shellcheck disable=SC2086 # the option may be several words
  run "${SIZE}_${LEVEL}_on_$rep" $OPTION
done
