#!/usr/bin/env bash
# loss-chunks.sh [CARRY] [SIZE] ["ROWS ..."] [ROUNDS]: the GPT example at
# O2 (fp8-current, 8 x 1024, BF16 activations) with each --loss-chunk-rows
# value in turn (0: the whole logits at once), ROUNDS rounds alternated on
# the same GPU: one line a run (tokens/s, step, peak, validation loss,
# device memory at the second step's start / forward's end / step's end).
# CARRY (default .carry/gpu) holds gpt.gz. Env: STEPS (20), SKIP (5),
# EXTRA (more gpt arguments, e.g. --seed 2).
#
#   bash scripts/gpu/loss-chunks.sh .carry/gpu 125m "0 4096 2048" 2
set -uo pipefail
CARRY=${1:-.carry/gpu}; SIZE=${2:-125m}; VALUES=${3:-"0 4096"}; ROUNDS=${4:-2}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
for rep in $(seq "$ROUNDS"); do
  for rows in $VALUES; do
    label="${SIZE}_O2_chunk${rows}$(echo ${EXTRA:-} | tr -d ' ')_$rep"
    timeout 200 "$BIN/gpt" --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
      --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 \
      --activations bf16 --compute fp8-current --level O2 --loss-chunk-rows "$rows" ${EXTRA:-} --json \
      > "$OUT/$label.log" 2>&1
    echo "rc=$? $(show "$OUT/$label.log" "$label")"
  done
done
