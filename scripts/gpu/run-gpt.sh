#!/usr/bin/env bash
# run-gpt.sh [CARRY_DIR] [SIZE] [LEVELS]: one device call for issue 8's GPT
# comparison. The optimizer step's timing (cuda_check --optim-only
# --bench; its checks are the GPU tests, run-tests.sh), then the GPT example at O0 native (BF16 GEMMs),
# O0 + fp8-delayed (TE path), O1, O2 and O3 with fp8-current, then
# torch_gpt.py (PyTorch eager BF16, compiled BF16, torchao FP8) on the same
# machine. Each under `timeout`; logs and JSON lines go to $OUT.
#
# LEVELS: space-separated `level:compute` pairs (default: the five runs).
# Env: STEPS (20), SKIP (5, steps left out of tokens/s), TORCH_MODES
# (bf16,bf16-compile,fp8-torchao), NO_CHECK=1 skips cuda_check, EXTRA
# (more arguments for every gpt run, e.g. "--activations bf16").
set -uo pipefail
C=${1:-.carry/gpu}
SIZE=${2:-350m}
RUNS=${3:-"O0:native O0:fp8-delayed O1:fp8-current O2:fp8-current O3:fp8-current"}
STEPS=${STEPS:-20}
SKIP=${SKIP:-5}
TORCH_MODES=${TORCH_MODES:-bf16,bf16-compile,fp8-torchao}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source "$C/device-env.sh"
for b in gpt cuda_check; do
  [ -f "$C/$b.gz" ] && gzip -dc "$C/$b.gz" > "/tmp/$b" && chmod +x "/tmp/$b"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/facts.log"
if [ -z "${NO_CHECK:-}" ] && [ -x /tmp/cuda_check ]; then
  timeout 150 /tmp/cuda_check --optim-only --bench --watchdog 140 2>&1 | tee "$OUT/optim_check.log"
fi
for r in $RUNS; do
  level=${r%%:*}; compute=${r#*:}
  echo "== gpt $SIZE $level $compute" | tee -a "$OUT/gpt.log"
  timeout 150 /tmp/gpt --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
    --steps "$STEPS" --timing-skip "$SKIP" --eval-every 1000 --level "$level" --compute "$compute" --json ${EXTRA:-} \
    2>&1 | tee -a "$OUT/gpt.log"
  echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpt.log"
done
grep '^{' "$OUT/gpt.log" > "$OUT/gpt.jsonl"
if [ -n "$TORCH_MODES" ]; then
  timeout 330 python3 "$C/torch_gpt.py" --size "$SIZE" --modes "$TORCH_MODES" 2>&1 | tee "$OUT/torch_gpt.log"
fi
