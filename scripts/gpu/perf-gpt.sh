#!/usr/bin/env bash
# perf-gpt.sh CARRY SIZE FROM TO [STEPS]: where the host's time goes in the
# GPT example's steps FROM..TO (O2, fp8-current, BF16 activations): perf
# record (cpu-clock samples, DWARF call stacks) over a whole run, its report
# cut to those steps by the step starts that AMP_STEP_CLOCK prints (perf's
# clock is CLOCK_MONOTONIC, as Rust's Instant). The device has no perf:
# CARRY/perf.tgz holds one with its libraries (scripts/gpu/README.md).
# Writes phases.txt (the step starts), flat.txt (self time by symbol),
# children.txt (time including callees) and dso.txt to $OUT.
set -uo pipefail
C=${1:-.carry/gpu}; SIZE=${2:-350m}; FROM=${3:-4}; TO=${4:-13}; STEPS=${5:-$((TO + 1))}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$C/device-env.sh"
tar xzf "$C/perf.tgz" -C /tmp
P="env LD_LIBRARY_PATH=/tmp/perfpkg/lib /tmp/perfpkg/perf"
gzip -dc "$C/gpt.gz" > /tmp/gpt && chmod +x /tmp/gpt
A="--device cuda --size $SIZE --vocab 50304 --batch 8 --seq 1024 --eval-every 1000 --eval-batches 1
   --level O2 --compute fp8-current --json --activations bf16"
/tmp/gpt $A --steps 2 > /dev/null 2>&1   # fills the PTX JIT cache first
AMP_STEP_CLOCK=1 $P record -k CLOCK_MONOTONIC -e cpu-clock -F 2000 --call-graph dwarf,16384 \
  -o /tmp/perf.data -- /tmp/gpt $A --steps "$STEPS" --timing-skip 2 2> /tmp/gpt.err > /tmp/gpt.out
at() { grep "^step $1 starts" /tmp/gpt.err | sed -E 's/.*tv_sec: ([0-9]+), tv_nsec: ([0-9]+).*/\1 \2/' \
  | awk '{printf "%d.%09d", $1, $2}'; }
t0=$(at "$FROM"); t1=$(at "$TO")
grep "starts at" /tmp/gpt.err > "$OUT/phases.txt"; echo "window $t0 $t1" | tee -a "$OUT/phases.txt"
R="$P report -i /tmp/perf.data --time $t0,$t1 --stdio -g none"
$R --no-children --sort dso,sym --percent-limit 0.3 2>/dev/null | grep -v '^#' | grep -v '^$' | head -80 > "$OUT/flat.txt"
$R --children --sort sym --percent-limit 0.8 2>/dev/null | grep -v '^#' | grep -v '^$' | head -200 > "$OUT/children.txt"
$R --no-children --sort dso --percent-limit 0.3 2>/dev/null | grep -v '^#' | grep -v '^$' | head -20 > "$OUT/dso.txt"
cat "$OUT/dso.txt"; head -30 "$OUT/flat.txt"
