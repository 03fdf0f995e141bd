#!/usr/bin/env bash
# options26.sh [CARRY] [SIZE]: issue 26's two options against their
# defaults in one device call, each pair alternated (A B A B) on the same
# GPU: O0's products through the layers' op (the default) against
# candle's BF16 matmul and graph (`--native-op false`), and O2 with the MLP's activation input kept as
# E4M3 tiles (`--fp8-activation-inputs`) against O2; then PyTorch eager
# BF16 (torch_gpt.py) as the anchor. The GPT example, 8 x 1024, BF16
# activations; one line per run (tokens/s, step, peak, validation loss).
#
# CARRY (default .carry/gpu) holds gpt.gz. Env: STEPS (14), SKIP (4),
# TORCH_MODES (bf16; empty: none).
#
#   bash scripts/gpu/options26.sh .carry/gpu 350m
set -uo pipefail
CARRY=${1:-.carry/gpu}
SIZE=${2:-350m}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
facts
run() { # LABEL ARGS...: one run of the example, its summary line
  local label=$1; shift
  timeout 200 "$BIN/gpt" --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
    --steps "${STEPS:-14}" --timing-skip "${SKIP:-4}" --eval-every 1000 --eval-batches 2 \
    --activations bf16 --json "$@" > "$OUT/$label.log" 2>&1
  echo "rc=$? $(show "$OUT/$label.log" "$label")"
}
for rep in 1 2; do
  run "o0_graph_$rep" --level O0 --native-op false
  run "o0_native_op_$rep" --level O0
done
for rep in 1 2; do
  run "o2_$rep" --level O2
  run "o2_fp8_act_$rep" --level O2 --fp8-activation-inputs
done
TORCH_MODES=${TORCH_MODES-bf16}
if [ -n "$TORCH_MODES" ]; then
  timeout 300 python3 "$HERE/torch_gpt.py" --size "$SIZE" --modes "$TORCH_MODES" \
    > "$OUT/torch_gpt.log" 2>&1
  echo "rc=$?"; grep '^{' "$OUT/torch_gpt.log"
fi
