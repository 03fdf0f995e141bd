#!/usr/bin/env bash
# ab-gpt.sh CARRY SIZE "LEVEL:COMPUTE ..." [PAIRS]: GPT runs of an old and a
# new build (`gpt_old.gz`, `gpt.gz` in CARRY), old then new per pair, one
# summary line each (step median and max, tokens/s by the median step,
# validation loss). Env STEPS (14), SKIP (4), EXTRA (default
# "--activations bf16"), OUT.
set -uo pipefail
C=${1:-.carry/gpu}; SIZE=${2:-125m}; RUNS=${3:-"O2:fp8-current"}; PAIRS=${4:-3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$C/device-env.sh"
for b in gpt gpt_old; do gzip -dc "$C/$b.gz" > "/tmp/$b" && chmod +x "/tmp/$b"; done
for r in $RUNS; do
  for i in $(seq "$PAIRS"); do
    for b in gpt_old gpt; do
      timeout 200 "/tmp/$b" --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
        --steps "${STEPS:-14}" --timing-skip "${SKIP:-4}" --eval-every 1000 --level "${r%%:*}" \
        --compute "${r#*:}" --json ${EXTRA:---activations bf16} 2>&1 | grep '^{' | tee -a "$OUT/ab.jsonl" \
        | python3 -c "import json,sys; j=json.loads(sys.stdin.read()); print('$b $r', 'step %.2f max %.1f ms' % (j['step_ms_median'], j['step_ms_max']), 'tok/s(median) %.0f' % j['tokens_per_s_median'], 'val %.7f' % j['val_loss'])"
    done
  done
done
