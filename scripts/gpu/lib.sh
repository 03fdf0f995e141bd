# lib.sh: what the device-side scripts share. Sourced by them, never run.
# Before sourcing, a script sets CARRY (the folder of its gzipped binaries).
# Sets HERE (this folder), OUT (the output folder: `run` sets it; default
# out/, git-ignored), BIN (a fresh folder the binaries are unpacked into,
# removed on exit) and TORCHRUN; sources device-env.sh.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CARRY=${CARRY:-.carry/gpu}
OUT=${OUT:-out}
mkdir -p "$OUT"
# shellcheck source=device-env.sh
source "$HERE/device-env.sh"
export PYTHONUNBUFFERED=1
BIN=$(mktemp -d)
trap 'rm -rf "$BIN"' EXIT
TORCHRUN=$(command -v torchrun || echo "python3 -m torch.distributed.run")

# unpack NAME...: $CARRY/NAME.gz to $BIN/NAME, executable; names without a
# .gz in CARRY are skipped (a script then checks for the binary it needs).
unpack() {
  local b
  for b in "$@"; do
    if [ -f "$CARRY/$b.gz" ]; then gzip -dc "$CARRY/$b.gz" > "$BIN/$b" && chmod +x "$BIN/$b"; fi
  done
}

# wheels: installs every Python wheel carried in $CARRY (the GPU machine
# reaches no package index), without dependencies: torchao for the
# `fp8-torchao` mode of torch_gpt.py. Fetch it beside the binaries first,
# on the build machine: `pip download --no-deps -d .carry/X torchao==0.18.0`.
# Quiet when there is none; an install that fails is reported, not fatal.
wheels() {
  local w
  for w in "$CARRY"/*.whl; do
    [ -f "$w" ] || continue
    python3 -m pip install --quiet --no-deps --no-index "$w" 2>&1 | tail -2
    echo "installed $(basename "$w")"
  done
}

# facts: the GPUs, their driver and clocks, into $OUT/facts.log and the output.
facts() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total \
    --format=csv,noheader | tee "$OUT/facts.log"
}

# need NAME...: fail unless each binary was unpacked.
need() {
  local b
  for b in "$@"; do
    [ -x "$BIN/$b" ] || { echo "missing $CARRY/$b.gz (see scripts/gpu/README.md)" >&2; exit 2; }
  done
}

# show LOG LABEL: one line from the GPT example's `--json` line in LOG.
show() { grep '^{' "$1" | head -1 | python3 -c "
import json, sys
for l in sys.stdin:
    j = json.loads(l)
    print('$2', 'tok/s(median) %.0f' % j['tokens_per_s_median'], 'step %.1f ms' % j['step_ms_median'],
          'peak %.2f GiB' % (j.get('peak_device_bytes', 0) / 2**30), 'world', j.get('world_size'),
          'val %.4f' % j['val_loss'], 'mfu', j.get('mfu') and round(j['mfu'], 3), 'recompute', j.get('recompute'), 'lean', j.get('lean_step'), 'exposed', j.get('comm_exposed_ms'), 'gather', j.get('comm_gather_ms'), 'buckets', j.get('buckets_per_step'),
          'early', j.get('overlapped_buckets_per_step'),
          'wire/step %.0f' % j.get('wire_bytes_per_step', 0),
          'step2 GiB start/fwd/step', [round(b / 2**30, 2) for b in j.get('second_step_device_bytes') or []])"; }
