#!/usr/bin/env bash
# profile-gpt.sh CARRY SIZE "LEVEL:COMPUTE ...": per-kernel GPU time of the
# GPT example's steps under ncu (one metric, gpu__time_duration.sum, so one
# pass per kernel), summed by kernel name (ncu_summary.py), next to the same
# run's own wall-clock step time without the profiler. Env: STEPS (2), OUT,
# EXTRA (more gpt arguments).
set -uo pipefail
C=${1:-.carry/gpu}
SIZE=${2:-125m}
RUNS=${3:-"O0:native O2:fp8-current"}
STEPS=${STEPS:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$C/device-env.sh"
[ -f "$C/gpt.gz" ] && gzip -dc "$C/gpt.gz" > /tmp/gpt && chmod +x /tmp/gpt
for r in $RUNS; do
  level=${r%%:*}; compute=${r#*:}
  args=(--device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 --eval-every 1000 --eval-batches 1
        --level "$level" --compute "$compute" --json ${EXTRA:-})
  echo "== plain $SIZE $level $compute" | tee -a "$OUT/profile.log"
  timeout 120 /tmp/gpt "${args[@]}" --steps 6 --timing-skip 2 2>&1 | grep '^{' | tee -a "$OUT/profile.log"
  echo "== ncu $SIZE $level $compute ($STEPS steps)" | tee -a "$OUT/profile.log"
  timeout 300 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
    /tmp/gpt "${args[@]}" --steps "$STEPS" > "/tmp/ncu-$level.csv" 2> "/tmp/ncu-$level.err"
  echo "rc=$?" | tee -a "$OUT/profile.log"
  tail -3 "/tmp/ncu-$level.err" | tee -a "$OUT/profile.log"
  python3 "$C/ncu_summary.py" "/tmp/ncu-$level.csv" "$STEPS" | tee -a "$OUT/profile.log"
  gzip -c "/tmp/ncu-$level.csv" > "$OUT/ncu-$level.csv.gz"
done
