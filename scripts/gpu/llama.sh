#!/usr/bin/env bash
# llama.sh [CARRY] [SIZE]: the Llama example beside a PyTorch Llama of the
# same shape in one device call (issue: Llama-style models). Our Llama at
# each LEVEL (8 x 2048 by default, BF16 activations; O0 native BF16
# products, the others fp8-current), then torch_llama.py eager and
# compiled BF16, both with a head of their own (TIED=1: both tie it to the
# embedding, as Llama-3.2-1B does: --tie-embeddings here, torch_llama.py's
# default there).
# CARRY (default .carry/gpu) holds llama.gz. Env: STEPS (20), SKIP (5),
# LEVELS (O0 O2; empty: none, PyTorch only), BATCH (8), SEQ (2048), VOCAB (128256), TORCH (1),
# TORCH_MODES (bf16,bf16-compile), TORCH_CK (0; 1: eager BF16 with
# --checkpoint too), EXTRA (more llama arguments).
#
#   bash scripts/gpu/llama.sh .carry/gpu 1b
set -uo pipefail
CARRY=${1:-.carry/gpu}
size=${2:-1b}
source "$(dirname "$0")/lib.sh"
unpack llama; need llama
facts
B=${BATCH:-8}; S=${SEQ:-2048}; V=${VOCAB:-128256}
tie=; [ "${TIED:-0}" = 1 ] && tie=--tie-embeddings
for lv in ${LEVELS-O0 O2}; do
  compute=fp8-current; [ "$lv" = O0 ] && compute=native
  label="llama_${size}_${lv}${tie:+_tied}$(echo ${EXTRA:-} | tr -d ' ')"
  timeout 400 "$BIN/llama" --device cuda --size "$size" --vocab "$V" --batch "$B" --seq "$S" \
    --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 --level "$lv" \
    --compute "$compute" --activations bf16 $tie ${EXTRA:-} --json > "$OUT/$label.log" 2>&1
  echo "rc=$? $(show "$OUT/$label.log" "$label")"; grep -iE "^error|panick|needs about" "$OUT/$label.log" | head -3
done
[ "${TORCH:-1}" = 1 ] || exit 0
head_arg=--untied-head; [ "${TIED:-0}" = 1 ] && head_arg=
timeout 500 python3 "$HERE/torch_llama.py" --size "$size" --vocab "$V" --batch "$B" --seq "$S" \
  --steps "${STEPS:-20}" --warmup "${SKIP:-5}" --modes "${TORCH_MODES:-bf16,bf16-compile}" $head_arg \
  > "$OUT/llama_${size}_torch.log" 2>&1
echo "rc=$?"; grep '^{' "$OUT/llama_${size}_torch.log"
if [ "${TORCH_CK:-0}" = 1 ]; then
  timeout 300 python3 "$HERE/torch_llama.py" --size "$size" --vocab "$V" --batch "$B" --seq "$S" \
    --steps "${STEPS:-20}" --warmup "${SKIP:-5}" --modes bf16 --checkpoint $head_arg \
    > "$OUT/llama_${size}_torch_ck.log" 2>&1
  echo "rc=$? (--checkpoint)"; grep '^{' "$OUT/llama_${size}_torch_ck.log"
fi
