#!/usr/bin/env bash
# pack.sh [--symbols] DEST EXAMPLE...: the built examples, stripped and
# gzipped, into DEST (e.g. .carry/gpu), for `run`'s carry. A candle CUDA
# binary is about 40 MiB stripped and about 10 MiB gzipped; a carry holds
# 64 MiB in all. --symbols keeps the symbols (strip --strip-debug), for
# perf-gpt.sh. Reads ${CARGO_TARGET_DIR:-target}/release/examples/.
#
#   scripts/gpu/build-cuda.sh cargo build --release --features cuda --example gpt --example cuda_check
#   scripts/gpu/pack.sh .carry/gpu gpt cuda_check
set -euo pipefail
strip_args=()
if [ "${1:-}" = "--symbols" ]; then strip_args=(--strip-debug); shift; fi
[ "$#" -ge 2 ] || { echo "usage: $0 [--symbols] DEST EXAMPLE..." >&2; exit 2; }
dest=$1; shift
dir="${CARGO_TARGET_DIR:-target}/release/examples"
mkdir -p "$dest"
for ex in "$@"; do
  [ -f "$dir/$ex" ] || { echo "no $dir/$ex: build it first" >&2; exit 1; }
  strip "${strip_args[@]}" -o "$dest/$ex" "$dir/$ex"
  gzip -9f "$dest/$ex"
  echo "$dest/$ex.gz $(du -h "$dest/$ex.gz" | cut -f1)"
done
