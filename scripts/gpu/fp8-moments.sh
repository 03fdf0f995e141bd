#!/usr/bin/env bash
# fp8-moments.sh [CARRY]: both Adam moments in FP8 (`--fp8-moments`,
# StateFormat::E4M3Sqrt for the second) in one device call: per SIZE the
# GPT example at O2 with FP16 and with FP8 second moments (tokens/s, peak
# memory, bytes per Linear parameter; 8 x 1024 tokens a step, BF16
# activations), then the loss on the GPU over SEEDS at 125M: O0, O2 and O2
# with FP8 moments, paired by seed (the bundled corpus, `--batch 16 --seq
# 512`, PARITY_STEPS steps). The optimizer's CPU = CUDA checks for the
# format are in the GPU tests (run-tests.sh, `optim`).
# CARRY (default .carry/moments) holds gpt.gz. Env: SIZES (350m 1.3b; empty: none),
# STEPS (20), SKIP (5), SEEDS (11 12 13), PARITY_STEPS (600; 0: none).
#
#   bash scripts/gpu/fp8-moments.sh .carry/moments
set -uo pipefail
CARRY=${1:-.carry/moments}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
facts
for size in ${SIZES-350m 1.3b}; do
  for moments in "" "--fp8-moments"; do
    label="gpt_${size}_O2${moments:+_fp8_moments}"
    # shellcheck disable=SC2086 # $moments is one flag or none
    timeout 300 "$BIN/gpt" --device cuda --size "$size" --vocab 50304 --batch 8 --seq 1024 \
      --steps "${STEPS:-20}" --timing-skip "${SKIP:-5}" --eval-every 1000 --eval-batches 1 \
      --level O2 --activations bf16 $moments --json > "$OUT/$label.log" 2>&1
    echo "rc=$? $(show "$OUT/$label.log" "$label") bytes/linear param $(grep '^{' "$OUT/$label.log" | head -1 | python3 -c 'import json,sys; print(round(json.loads(sys.stdin.read())["bytes_per_linear_param"], 3))')"
    grep -iE "^error|panick" "$OUT/$label.log" | head -3
  done
done
[ "${PARITY_STEPS:-600}" -gt 0 ] || exit 0
: > "$OUT/parity.jsonl"
for seed in ${SEEDS:-11 12 13}; do
  for run in "O0" "O2" "O2 --fp8-moments"; do
    # shellcheck disable=SC2086 # $run is a level and maybe a flag
    timeout 200 "$BIN/gpt" --device cuda --size 125m --batch 16 --seq 512 --steps "${PARITY_STEPS:-600}" \
      --lr 1e-3 --warmup 60 --activations bf16 --eval-every 1000 --seed "$seed" --level $run --json \
      2>/dev/null | grep '^{' | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
print(json.dumps({'seed': $seed, 'run': '$run', 'val_loss': j['val_loss'], 'skipped': j['skipped_steps']}))" \
      | tee -a "$OUT/parity.jsonl"
  done
done
python3 - "$OUT/parity.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
o0 = {r['seed']: r['val_loss'] for r in rows if r['run'] == 'O0'}
for run in ('O2', 'O2 --fp8-moments'):
    d = [100 * (r['val_loss'] / o0[r['seed']] - 1) for r in rows if r['run'] == run and r['seed'] in o0]
    if d:
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float('nan')
        print(f"PARITY {run}: vs O0 by seed {[round(x, 2) for x in d]} %, mean {statistics.mean(d):+.2f} %, se {se:.2f}")
PY
