#!/usr/bin/env bash
# attention.sh [CARRY] [SIZES]: flash attention at the head dimensions it is
# built for (64, 80, 96, 128), in one device call, each program under
# `timeout` with its log in $OUT:
#   1. `cuda_check --fused-only`: the packed causal attention's forward and
#      forward + backward, flash and materialised, at the GPT's shapes; then
#      torch_attention.py (PyTorch's causal scaled_dot_product_attention)
#      at the same shapes;
#   2. per size of SIZES (default 760m, head dimension 96): the GPT example
#      at O2 (fp8-current) with flash attention and with `--no-flash`, and
#      O0 native, BF16 activations, 8 x 1024; then torch_gpt.py eager and
#      compiled (TORCH_MODES).
# CARRY (default .carry/gpu) holds gpt.gz and cuda_check.gz.
# Env: STEPS (14), SKIP (4), TORCH_MODES (bf16,bf16-compile; empty: none),
# RUNS (LEVEL:ARGS with commas for spaces; default "O2:--compute,fp8-current
# O2:--compute,fp8-current,--no-flash O0:--compute,native").
#
#   bash scripts/gpu/attention.sh .carry/gpu "760m 2.7b"
set -uo pipefail
CARRY=${1:-.carry/gpu}
SIZES=${2:-760m}
source "$(dirname "$0")/lib.sh"
unpack gpt cuda_check; need gpt cuda_check
facts
echo "== 1. attention alone"
timeout 200 "$BIN/cuda_check" --fused-only --watchdog 190 > "$OUT/attention.log" 2>&1
echo "rc=$?"; grep -E "b [0-9]+ t|ERROR|CHECK" "$OUT/attention.log"
timeout 200 python3 "$HERE/torch_attention.py" 2>&1 | tee "$OUT/torch_attention.log" | grep '^{'
for size in $SIZES; do
  echo "== 2. $size"
  for r in ${RUNS:-O2:--compute,fp8-current O2:--compute,fp8-current,--no-flash O0:--compute,native}; do
    level=${r%%:*}; args=""; [ "$r" = "$level" ] || args=${r#*:}
    label="${size}_${level}$(echo "$args" | tr -c 'a-z0-9\n' '_')"
    # shellcheck disable=SC2086 # the run's arguments, split on commas
    timeout 200 "$BIN/gpt" --device cuda --size "$size" --vocab 50304 --batch 8 --seq 1024 \
      --steps "${STEPS:-14}" --timing-skip "${SKIP:-4}" --eval-every 1000 --eval-batches 1 --level "$level" \
      --activations bf16 --json ${args//,/ } > "$OUT/$label.log" 2>&1
    echo "rc=$? $(show "$OUT/$label.log" "$label")"; grep -iE "^error|panick" "$OUT/$label.log" | head -3
  done
  if [ -n "${TORCH_MODES-bf16,bf16-compile}" ]; then
    timeout 400 python3 "$HERE/torch_gpt.py" --size "$size" --steps "${STEPS:-14}" --warmup "${SKIP:-4}" \
      --modes "${TORCH_MODES-bf16,bf16-compile}" > "$OUT/${size}_torch.log" 2>&1
    echo "rc=$?"; grep '^{' "$OUT/${size}_torch.log"
  fi
done
