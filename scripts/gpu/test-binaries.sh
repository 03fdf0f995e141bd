#!/usr/bin/env bash
# test-binaries.sh [CARGO TEST ARGS...]: builds test binaries with the CUDA
# feature here (through build-cuda.sh) and puts each one, stripped and
# gzipped, into ${CARRY:-.carry}/tests/ for `run`'s carry; run-tests.sh
# runs them on the GPU machine. The arguments go to `cargo test --release
# --features cuda --no-run` and default to `--test gpu` (tests/gpu/main.rs: the
# CUDA-against-CPU checks, one binary).
#
#   scripts/gpu/test-binaries.sh                  # tests/gpu/main.rs
#   scripts/gpu/test-binaries.sh --workspace      # every test binary (big)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest="${CARRY:-.carry}/tests"
[ "$#" -gt 0 ] || set -- --test gpu
json=$(mktemp)
trap 'rm -f "$json"' EXIT
"$here/build-cuda.sh" cargo test --release --features cuda --no-run --message-format=json "$@" > "$json"
mkdir -p "$dest"
# One line per test executable: its target's name, then its path. Names
# that repeat (tests of the same name in two packages) get the package's
# folder in front.
python3 - "$json" <<'PY' > "$json.list"
import json, os, sys
found = []
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"].get("test"):
        folder = os.path.basename(os.path.dirname(m["manifest_path"]))
        found.append((m["target"]["name"], folder, m["executable"]))
names = [n for n, _, _ in found]
for name, folder, exe in found:
    print(name if names.count(name) == 1 else f"{folder}-{name}", exe)
PY
[ -s "$json.list" ] || { echo "cargo built no test executable" >&2; rm -f "$json.list"; exit 1; }
while read -r name exe; do
  strip -o "$dest/$name" "$exe"
  gzip -9f "$dest/$name"
  echo "$dest/$name.gz $(du -h "$dest/$name.gz" | cut -f1)  (from $exe)"
done < "$json.list"
rm -f "$json.list"
