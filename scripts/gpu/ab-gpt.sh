#!/usr/bin/env bash
# ab-gpt.sh [CARRY] [SIZE] ["LEVEL:COMPUTE ..."] [PAIRS]: GPT runs of an old
# and a new build in one call (gpt_old.gz and gpt.gz in CARRY), old then new
# in each pair, one line a run: the step's median and max, tokens/s by the
# median step, the validation loss (which must match when the change keeps
# the values). The 125M step varies by about 10% between runs of one call:
# compare pairs, not single runs.
# Env: STEPS (14), SKIP (4), EXTRA (default "--activations bf16").
#
#   bash scripts/gpu/ab-gpt.sh .carry/gpu 350m O2:fp8-current 3
set -uo pipefail
CARRY=${1:-.carry/gpu}; SIZE=${2:-125m}; RUNS=${3:-"O2:fp8-current"}; PAIRS=${4:-3}
source "$(dirname "$0")/lib.sh"
unpack gpt gpt_old; need gpt gpt_old
for r in $RUNS; do
  for _ in $(seq "$PAIRS"); do
    for b in gpt_old gpt; do
      # shellcheck disable=SC2086 # EXTRA is a list of arguments
      timeout 200 "$BIN/$b" --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
        --steps "${STEPS:-14}" --timing-skip "${SKIP:-4}" --eval-every 1000 --level "${r%%:*}" \
        --compute "${r#*:}" --json ${EXTRA:---activations bf16} 2>&1 | grep '^{' | tee -a "$OUT/ab.jsonl" \
        | python3 -c "import json,sys; j=json.loads(sys.stdin.read()); print('$b $r', 'step %.2f max %.1f ms' % (j['step_ms_median'], j['step_ms_max']), 'tok/s(median) %.0f' % j['tokens_per_s_median'], 'val %.7f' % j['val_loss'])"
    done
  done
done
