#!/usr/bin/env bash
# ab-optim.sh [CARRY]: an old and a new build of the optimizer's kernels in
# one device call. CARRY (default .carry/gpu) holds cuda_check_old.gz and
# gpt_old.gz (the previous build) beside cuda_check.gz and gpt.gz (the new).
#   1. the new build's optimizer tests (`optim::` and `codecs::` of the GPU
#      tests in .carry/tests, see run-tests.sh; CODECS=1 adds the step's
#      codecs over all 2^32 f32 inputs, about 4 minutes), unless NO_CHECK=1;
#   2. the optimizer bench, old and new alternating, REPS (3) times each;
#   3. with NCU=1, each bench under ncu (time, instructions and DRAM bytes
#      of every optimizer kernel per step; steps counted by their
#      lowbit_step launches);
#   4. GPT_PAIRS (2) pairs of GPT 350M O2 runs (BF16 activations), old then
#      new, their JSON lines in $OUT/gpt.jsonl (the validation must match).
#
#   NCU=1 bash scripts/gpu/ab-optim.sh .carry/gpu
set -uo pipefail
CARRY=${1:-.carry/gpu}
source "$(dirname "$0")/lib.sh"
unpack gpt gpt_old cuda_check cuda_check_old; need cuda_check cuda_check_old
facts
if [ -z "${NO_CHECK:-}" ]; then
  for f in optim:: codecs::; do
    TEST_TIMEOUT=330 bash "$HERE/run-tests.sh" .carry/tests "$f" ${CODECS:+--include-ignored} > "$OUT/tests.log" 2>&1
    echo "tests $f rc=$?"; grep -E "^test result|FAILED|panicked" "$OUT/tests.log"
  done
fi
for _ in $(seq "${REPS:-3}"); do
  for b in cuda_check_old cuda_check; do
    echo "$b $("$BIN/$b" --optim-only --bench-only | grep BENCH)"
  done
done
if [ -n "${NCU:-}" ]; then
  for b in cuda_check_old cuda_check; do
    ncu --clock-control none --csv -k 'regex:lowbit|sumsq|clip|gather' \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      "$BIN/$b" --optim-only --bench-only > "$OUT/ncu_$b.csv" 2>&1
    steps=$(grep -c 'lowbit_step.*gpu__time_duration' "$OUT/ncu_$b.csv")
    echo "== ncu $b ($steps steps)"; python3 "$HERE/ncu_summary.py" "$OUT/ncu_$b.csv" "$steps" | head -12
    python3 - "$OUT/ncu_$b.csv" "$steps" <<'PY'
import collections, csv, sys
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
steps = float(sys.argv[2])
per_step = collections.defaultdict(float)
for r in csv.DictReader(rows):
    if r["Metric Name"] != "gpu__time_duration.sum":
        per_step[(r["Kernel Name"][:24], r["Metric Name"])] += float(r["Metric Value"].replace(",", "")) / steps
for (k, m), v in sorted(per_step.items()):
    print(f"  {k:24} {m:28} {v:,.0f}")
PY
  done
fi
if [ -x "$BIN/gpt" ] && [ -x "$BIN/gpt_old" ]; then
  for _ in $(seq "${GPT_PAIRS:-2}"); do
    for b in gpt_old gpt; do
      timeout 150 "$BIN/$b" --device cuda --size 350m --vocab 50304 --batch 8 --seq 1024 --steps 14 \
        --timing-skip 4 --eval-every 1000 --level O2 --compute fp8-current --activations bf16 --json 2>&1 \
        | grep '^{' | tee -a "$OUT/gpt.jsonl" \
        | python3 -c "import json,sys; j=json.loads(sys.stdin.read()); print('$b', 'step %.2f ms' % j['step_ms_median'], 'val %.7f' % j['val_loss'])"
    done
  done
fi
