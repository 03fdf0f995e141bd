#!/usr/bin/env bash
# ab-optim.sh [CARRY_DIR]: one device call comparing two builds of the
# optimizer kernels: `cuda_check_old`/`gpt_old` (the previous build) and
# `cuda_check`/`gpt` (the new one), all gzipped in CARRY_DIR.
#   1. the new build's optimizer tests (`optim::` and `codecs::` of the GPU
#      tests, gpu-tests.gz, see run-tests.sh; CODECS=1 adds the step codecs
#      over all 2^32 f32 inputs), unless NO_CHECK=1;
#   2. the optimizer bench, old and new alternating, REPS (3) times each;
#   3. with NCU=1, each bench under ncu (time and instructions of every
#      optimizer kernel, per step: the steps are counted by their
#      lowbit_step launches);
#   4. GPT_PAIRS (2) pairs of GPT 350M O2 runs (BF16 activations), old then
#      new, their JSON lines in $OUT/gpt.jsonl (validation must match).
set -uo pipefail
C=${1:-.carry/gpu}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$C/device-env.sh"
for b in gpt gpt_old cuda_check cuda_check_old; do
  [ -f "$C/$b.gz" ] && gzip -dc "$C/$b.gz" > "/tmp/$b" && chmod +x "/tmp/$b"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/facts.log"
if [ -z "${NO_CHECK:-}" ]; then
  for f in optim:: codecs::; do
    TIMEOUT=330 OUT=$OUT bash "$C/run-tests.sh" "$C" "$f" ${CODECS:+--include-ignored} > /dev/null
    echo "tests $f rc=$?"; grep -E "^test result|FAILED|panicked" "$OUT/gpu-tests.log"
  done
fi
for i in $(seq "${REPS:-3}"); do
  for b in cuda_check_old cuda_check; do
    echo "$b $(/tmp/$b --optim-only --bench-only | grep BENCH)"
  done
done
if [ -n "${NCU:-}" ]; then
  for b in cuda_check_old cuda_check; do
    ncu --clock-control none --csv -k 'regex:lowbit|sumsq|clip|gather' \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      "/tmp/$b" --optim-only --bench-only > "$OUT/ncu_$b.csv" 2>&1
    steps=$(grep -c 'lowbit_step.*gpu__time_duration' "$OUT/ncu_$b.csv")
    echo "== ncu $b ($steps steps)"; python3 "$C/ncu_summary.py" "$OUT/ncu_$b.csv" "$steps" | head -12
    python3 - "$OUT/ncu_$b.csv" "$steps" <<'PY'
import csv, sys, collections
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
steps = float(sys.argv[2])
s = collections.defaultdict(float)
for r in csv.DictReader(rows):
    if r["Metric Name"] != "gpu__time_duration.sum":
        s[(r["Kernel Name"][:24], r["Metric Name"])] += float(r["Metric Value"].replace(",", "")) / steps
for (k, m), v in sorted(s.items()):
    print(f"  {k:24} {m:28} {v:,.0f}")
PY
  done
fi
for i in $(seq "${GPT_PAIRS:-2}"); do
  for b in gpt_old gpt; do
    timeout 150 "/tmp/$b" --device cuda --size 350m --vocab 50304 --batch 8 --seq 1024 --steps 14 \
      --timing-skip 4 --eval-every 1000 --level O2 --compute fp8-current --activations bf16 --json 2>&1 \
      | grep '^{' | tee -a "$OUT/gpt.jsonl" | python3 -c "import json,sys; j=json.loads(sys.stdin.read()); print('$b', 'step %.2f ms' % j['step_ms_median'], 'val %.7f' % j['val_loss'])"
  done
done
