#!/usr/bin/env bash
# parity.sh [CARRY]: loss parity of the FP8 paths with O0 on the GPU, as a
# table (issue 23): the GPT example at 125M on the whole King James text
# (CARRY/kjv.txt, from parity-corpus.sh; 4.3 MB of bytes, 90% to train),
# `--batch BATCH --seq 512 --steps STEPS --lr LR --warmup WARMUP
# --activations bf16`, every RUN for every SEED. The defaults (16 x 512,
# 900 steps: 1.9 epochs; peak rate 5e-4) are the protocol at which O0's
# own seed-to-seed spread of validation loss is 0.2% (at 1e-3, the
# protocol before, 1.4%: the runs' trajectories, not the paths, set the
# comparison there; BENCHMARKS.md). Each FP8 run is paired with O0 of the
# same seed: the mean of the paired differences of the validation loss and
# its standard error, and whether the mean is within 0.5% and within 2
# standard errors of zero. JSON lines (with the validation curves) in
# $OUT/parity.jsonl, the curves (mean over seeds) in $OUT/parity.svg
# (parity_plot.py); parity_table.py and parity_plot.py also take the
# lines of several calls, concatenated.
# Env: SEEDS (1 2 3 4 5), STEPS (900), LR (5e-4), WARMUP (60), BATCH (16
# sequences of 512 bytes), RUNS (a list of LEVEL:COMPUTE[:OPTS], OPTS
# joined by +: fp8m for --fp8-moments; e4m3 or hybrid for the compute
# path's recipe with that fp8_format, hist=N for delayed scaling's amax
# history of N steps (`max` over it), recent for its most recent amax
# alone, margin=N for its margin, cal and te for calibrate_first_step
# true (the default since the lines of docs/gpt-125m-parity-lr5e-4.jsonl
# were measured: those there name `te`) and false (TE's first step); two
# options that set one field are refused; lr=, warmup=, batch=, steps=
# for a run of another protocol than the environment's, which
# parity_table.py pairs only with O0 of the same protocol (read from the names, so lines of several calls combine only
# with the environment's protocol left at its defaults; each line also
# records lr, batch, steps and warmup); default O0 and O2 with each FP8
# path and with FP8 moments),
# EVAL_EVERY (150), EVAL_BATCHES (32: validation windows of 16 x 512, the
# same for every seed).
# JOBS (instead of SEEDS x RUNS: SEED/RUN words, e.g. "6/O0:native
# 1/O3:fp8-current"), GPUS (1): GPUs to use, PER_GPU (1): runs at once
# on each (the values are the same however many share a GPU, and on an
# H100 or an H200), DEADLINE (none): seconds after which no run starts.
# CARRY (default .carry/parity) holds gpt.gz and kjv.txt.
#
#   SEEDS="1 2 3" bash scripts/gpu/parity.sh .carry/parity
#   GPUS=4 PER_GPU=2 SEEDS="1 2 3 4 5 6 7 8 9 10" RUNS="..." bash scripts/gpu/parity.sh .carry/parity
set -uo pipefail
CARRY=${1:-.carry/parity}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
[ -f "$CARRY/kjv.txt" ] || { echo "missing $CARRY/kjv.txt (scripts/gpu/parity-corpus.sh)" >&2; exit 2; }
facts
RUNS=${RUNS:-"O0:native O2:fp8-current O2:fp8-delayed O2:fp8-block O2:fp8-rowwise O2:fp8-current:fp8m"}
# one SEED RUN JSONL: the GPT example's run RUN (LEVEL:COMPUTE[:OPTS]) at
# SEED, its JSON line appended to JSONL.
one() {
  local seed=$1 r=$2 jsonl=$3 level compute opts flag="" o fmt recipe=""
  local lr=${LR:-5e-4} warmup=${WARMUP:-60} batch=${BATCH:-16} steps=${STEPS:-900}
  IFS=: read -r level compute opts <<< "$r"
  for o in ${opts//+/ }; do
    case $o in
      lr=*) lr=${o#*=} ;;
      warmup=*) warmup=${o#*=} ;;
      batch=*) batch=${o#*=} ;;
      steps=*) steps=${o#*=} ;;
      fp8m) flag="$flag --fp8-moments" ;;
      e4m3 | hybrid) # the compute path's recipe with this fp8_format
        fmt=E4M3; [ "$o" = hybrid ] && fmt=HYBRID
        recipe="$recipe, \"fp8_format\": \"$fmt\"" ;;
      hist=*) recipe="$recipe, \"amax_history_len\": ${o#*=}" ;;  # delayed scaling's history
      recent) recipe="$recipe, \"amax_history_len\": 1, \"amax_compute_algo\": \"most_recent\"" ;;
      margin=*) recipe="$recipe, \"margin\": ${o#*=}" ;;
      cal) recipe="$recipe, \"calibrate_first_step\": true" ;;  # the first cast's scale from its amax
      te) recipe="$recipe, \"calibrate_first_step\": false" ;;  # TE's first step, at scale 1
      *) echo "unknown run option $o" >&2; return 2 ;;
    esac
  done
  # two options that set one field (recent and hist=, cal and te, e4m3 and hybrid)
  local dup
  dup=$(grep -o '"[a-z_0-9]*":' <<< "$recipe" | sort | uniq -d)
  if [ -n "$dup" ]; then echo "$r: run options set $dup twice" >&2; return 2; fi
  if [ -n "$recipe" ]; then
    echo "{${recipe#, }}" > "$jsonl.recipe.json"  # a file a worker
    flag="$flag --recipe $jsonl.recipe.json"
  fi
  # shellcheck disable=SC2086 # $flag is flags or none
  timeout 300 "$BIN/gpt" --device cuda --size 125m --data "$CARRY/kjv.txt" --batch "$batch" --seq 512 \
    --steps "$steps" --lr "$lr" --warmup "$warmup" --activations bf16 --eval-every "${EVAL_EVERY:-150}" \
    --eval-batches "${EVAL_BATCHES:-32}" \
    --seed "$seed" --level "$level" --compute "$compute" $flag --json 2>"$jsonl.err" | grep '^{' \
    | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
print(json.dumps({'seed': $seed, 'run': '$r', 'lr': $lr, 'batch': $batch, 'steps': $steps, 'warmup': $warmup,
                  'val_loss': j['val_loss'], 'skipped': j['skipped_steps'],
                  'tokens_per_s': j['tokens_per_s_median'], 'val_curve': j.get('val_curve', [])}))" \
    >> "$jsonl" && tail -1 "$jsonl" | cut -c1-120 || { echo "$r seed $seed failed:"; tail -3 "$jsonl.err"; }
}
# Every (seed, run) pair, dealt round-robin to GPUS x PER_GPU workers,
# worker w on GPU w % GPUS (the runs are independent: the same values
# on any GPU, however many share it).
jobs=()
if [ -n "${JOBS:-}" ]; then
  for j in $JOBS; do jobs+=("${j%%/*} ${j#*/}"); done
else
  for seed in ${SEEDS:-1 2 3 4 5}; do for r in $RUNS; do jobs+=("$seed $r"); done; done
fi
GPUS=${GPUS:-1}
workers=$((GPUS * ${PER_GPU:-1}))
# the workers' lines and logs outside $OUT (a call brings back few
# files), in lib.sh's temporary folder (removed on exit)
WORK=$BIN/work
mkdir -p "$WORK"
for w in $(seq 0 $((workers - 1))); do
  : > "$WORK/parity.$w.jsonl"
  (
    export CUDA_VISIBLE_DEVICES=$((w % GPUS))
    for i in "${!jobs[@]}"; do
      [ $((i % workers)) -eq "$w" ] || continue
      # no new run past DEADLINE seconds (the call's limit)
      [ "$SECONDS" -lt "${DEADLINE:-1000000}" ] || break
      # shellcheck disable=SC2086 # "seed run"
      one ${jobs[$i]} "$WORK/parity.$w.jsonl"
    done
  ) &
done
wait
cat "$WORK"/parity.[0-9]*.jsonl > "$OUT/parity.jsonl"
tail -q -n 3 "$WORK"/*.err > "$OUT/parity.err"
python3 "$HERE/parity_table.py" "$OUT/parity.jsonl"
python3 "$HERE/parity_plot.py" "$OUT/parity.jsonl" "$OUT/parity.svg"
