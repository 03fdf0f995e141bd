#!/usr/bin/env bash
# perf-gpt.sh [CARRY] [SIZE] [FROM] [TO] [STEPS]: where the host's time goes
# in the GPT example's steps FROM..TO (O2, fp8-current, BF16 activations).
# `perf record` (cpu-clock samples, DWARF call stacks) over a whole run; the
# report is cut to those steps by the step starts the example prints with
# AMP_STEP_CLOCK=1 (perf records with -k CLOCK_MONOTONIC, the clock of
# Rust's Instant). The GPU machine has no perf: CARRY/perf.tgz holds one
# with its libraries, and gpt.gz must keep its symbols (`strip
# --strip-debug`); scripts/gpu/README.md says how to make both.
# Writes phases.txt (the step starts), flat.txt (self time by symbol),
# children.txt (time with callees) and dso.txt to $OUT.
#
#   bash scripts/gpu/perf-gpt.sh .carry/gpu 350m 4 13
set -uo pipefail
CARRY=${1:-.carry/gpu}; SIZE=${2:-350m}; FROM=${3:-4}; TO=${4:-13}; STEPS=${5:-$((TO + 1))}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
tar xzf "$CARRY/perf.tgz" -C "$BIN"
PERF=(env LD_LIBRARY_PATH="$BIN/perfpkg/lib" "$BIN/perfpkg/perf")
A=(--device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 --eval-every 1000 --eval-batches 1
   --level O2 --compute fp8-current --json --activations bf16)
"$BIN/gpt" "${A[@]}" --steps 2 > /dev/null 2>&1   # fills the PTX JIT cache first
AMP_STEP_CLOCK=1 "${PERF[@]}" record -k CLOCK_MONOTONIC -e cpu-clock -F 2000 --call-graph dwarf,16384 \
  -o "$BIN/perf.data" -- "$BIN/gpt" "${A[@]}" --steps "$STEPS" --timing-skip 2 \
  2> "$BIN/gpt.err" > "$BIN/gpt.out"
at() { grep "^step $1 starts" "$BIN/gpt.err" | sed -E 's/.*tv_sec: ([0-9]+), tv_nsec: ([0-9]+).*/\1 \2/' \
  | awk '{printf "%d.%09d", $1, $2}'; }
t0=$(at "$FROM"); t1=$(at "$TO")
grep "starts at" "$BIN/gpt.err" > "$OUT/phases.txt"; echo "window $t0 $t1" | tee -a "$OUT/phases.txt"
report() { "${PERF[@]}" report -i "$BIN/perf.data" --time "$t0,$t1" --stdio -g none "$@" 2>/dev/null \
  | grep -v '^#' | grep -v '^$'; }
report --no-children --sort dso,sym --percent-limit 0.3 | head -80 > "$OUT/flat.txt"
report --children --sort sym --percent-limit 0.8 | head -200 > "$OUT/children.txt"
report --no-children --sort dso --percent-limit 0.3 | head -20 > "$OUT/dso.txt"
cat "$OUT/dso.txt"; head -30 "$OUT/flat.txt"
