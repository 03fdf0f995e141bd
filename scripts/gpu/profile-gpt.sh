#!/usr/bin/env bash
# profile-gpt.sh [CARRY] [SIZE] ["LEVEL:COMPUTE ..."]: where a GPT step's GPU
# time goes. Per run, the GPT example once plainly (its JSON line: tokens/s,
# step and forward time), then under `ncu --clock-control none --csv
# --metrics gpu__time_duration.sum` (one replay pass per kernel);
# ncu_summary.py sums the GPU time by kernel name, per step, largest first
# (model initialisation and one validation batch included).
# CARRY (default .carry/gpu) holds gpt.gz (or PROG.gz). Env: STEPS (2: the
# profiled steps, which divide the totals), EXTRA (more gpt arguments),
# DETAIL (a regex: ncu_summary.py also splits the kernels it matches by
# grid size), PROG (gpt; llama profiles the Llama example), VOCAB (50304),
# BATCH (8), SEQ (1024), CACHE (all: ncu flushes the caches before each
# kernel, every kernel timed cold; none: each kernel finds what the one
# before left in L2, as in a run), STEP (1: ncu_summary.py also splits out
# one whole step, its forward and one layer's forward; needs STEPS >= 2).
# NCU_TIMEOUT (300): seconds for the profiled run.
#
#   STEPS=2 EXTRA="--activations bf16" bash scripts/gpu/profile-gpt.sh .carry/gpu 125m O2:fp8-current
set -uo pipefail
CARRY=${1:-.carry/gpu}
SIZE=${2:-125m}
RUNS=${3:-"O0:native O2:fp8-current"}
STEPS=${STEPS:-2}
source "$(dirname "$0")/lib.sh"
PROG=${PROG:-gpt}
unpack "$PROG"; need "$PROG"
for r in $RUNS; do
  level=${r%%:*}; compute=${r#*:}
  # shellcheck disable=SC2206 # EXTRA is a list of arguments
  args=(--device cuda --size "$SIZE" --vocab "${VOCAB:-50304}" --batch "${BATCH:-8}" --seq "${SEQ:-1024}" --eval-every 1000
        --eval-batches 1 --level "$level" --compute "$compute" --json ${EXTRA:-})
  echo "== plain $SIZE $level $compute" | tee -a "$OUT/profile.log"
  timeout 120 "$BIN/$PROG" "${args[@]}" --steps 6 --timing-skip 2 2>&1 | grep '^{' | tee -a "$OUT/profile.log"
  echo "== ncu $SIZE $level $compute ($STEPS steps)" | tee -a "$OUT/profile.log"
  timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none --cache-control "${CACHE:-all}" --csv --metrics gpu__time_duration.sum \
    "$BIN/$PROG" "${args[@]}" --steps "$STEPS" > "$BIN/ncu-$level.csv" 2> "$BIN/ncu-$level.err"
  echo "rc=$?" | tee -a "$OUT/profile.log"
  tail -3 "$BIN/ncu-$level.err" | tee -a "$OUT/profile.log"
  python3 "$HERE/ncu_summary.py" "$BIN/ncu-$level.csv" "$STEPS" | tee -a "$OUT/profile.log"
  gzip -c "$BIN/ncu-$level.csv" > "$OUT/ncu-$level.csv.gz"
done
