#!/usr/bin/env bash
# run-tests.sh [CARRY] [TEST ARGS...]: on the GPU machine, every test binary
# test-binaries.sh put into CARRY (default .carry/tests), one after the
# other, each under `timeout`, from the repository root (where cargo would
# run them); the arguments go to each binary (e.g. a name filter,
# --nocapture). Exit status: that of the first binary that failed.
#
#   bash scripts/gpu/run-tests.sh .carry/tests
set -uo pipefail
CARRY=${1:-.carry/tests}; shift || true
source "$(dirname "$0")/lib.sh"
facts
status=0
for gz in "$CARRY"/*.gz; do
  [ -f "$gz" ] || { echo "no test binaries in $CARRY" >&2; exit 2; }
  name=$(basename "$gz" .gz)
  unpack "$name"
  echo "== $name"
  timeout "${TEST_TIMEOUT:-500}" "$BIN/$name" "$@" 2>&1 | tee "$OUT/test-$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc"
  [ "$status" -ne 0 ] || status=$rc
done
exit "$status"
