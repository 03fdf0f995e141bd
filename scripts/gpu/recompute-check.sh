#!/usr/bin/env bash
# recompute-check.sh [CARRY] [SIZE]: on the device, whether `--recompute
# selective` and `full` are the run without recomputation bit for bit:
# our GPT (default 125m, 8 x 1024, BF16 activations) for STEPS steps at
# each COMPUTE path (default "fp8-current fp8-delayed") and LEVEL (O2),
# the losses of the `--json` line and the final checkpoint (weights,
# optimizer state, scales, amax histories) compared with those of `none`:
# one line each, SAME or DIFFERENT.
# CARRY (default .carry/gpu) holds gpt.gz.
#
#   bash scripts/gpu/recompute-check.sh .carry/gpu 125m
set -uo pipefail
CARRY=${1:-.carry/gpu}
SIZE=${2:-125m}
source "$(dirname "$0")/lib.sh"
unpack gpt; need gpt
facts
# the losses of a run's --json line
curve() { grep '^{' "$1" | head -1 | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
print(j['first_loss'], j['final_loss'], j['val_loss'])"; }
# whether two safetensors files hold the same metadata and tensors, byte
# for byte (their order in the file may differ)
same_tensors() { python3 - "$1" "$2" <<'PY'
import json, struct, sys
def read(path):
    with open(path, 'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    meta = head.pop('__metadata__', None)
    return meta, {k: (v['dtype'], v['shape'], data[v['data_offsets'][0]:v['data_offsets'][1]])
                  for k, v in head.items()}
a, b = read(sys.argv[1]), read(sys.argv[2])
sys.exit(0 if a == b else 1)
PY
}
for compute in ${COMPUTE:-fp8-current fp8-delayed}; do
  for mode in none selective full; do
    label="check_${SIZE}_${LEVEL:-O2}_${compute}_${mode}"
    timeout 300 "$BIN/gpt" --device cuda --size "$SIZE" --vocab 50304 --batch 8 --seq 1024 \
      --steps "${STEPS:-20}" --eval-every 10 --eval-batches 1 --level "${LEVEL:-O2}" \
      --compute "$compute" --activations bf16 --recompute "$mode" \
      --save "$OUT/$label.safetensors" --json > "$OUT/$label.log" 2>&1
    echo "rc=$? $(show "$OUT/$label.log" "$label")"
  done
  base="check_${SIZE}_${LEVEL:-O2}_${compute}_none"
  for mode in selective full; do
    label="check_${SIZE}_${LEVEL:-O2}_${compute}_${mode}"
    if [ "$(curve "$OUT/$base.log")" = "$(curve "$OUT/$label.log")" ] &&
      same_tensors "$OUT/$base.safetensors" "$OUT/$label.safetensors"; then
      echo "SAME $compute $mode: losses and checkpoint bit for bit those of none"
    else
      echo "DIFFERENT $compute $mode"; curve "$OUT/$base.log"; curve "$OUT/$label.log"
    fi
  done
  rm -f "$OUT"/check_*.safetensors
done
