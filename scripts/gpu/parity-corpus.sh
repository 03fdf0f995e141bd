#!/usr/bin/env bash
# parity-corpus.sh [DEST]: the whole King James text (4.3 MB, public
# domain) into DEST/kjv.txt (default .carry/parity), from the Debian
# packages the bundled Genesis-to-Ruth excerpt comes from
# (examples/data/README.md), for parity.sh: 125M GPT runs of 900 steps of
# 16 x 512 bytes stay under 1.9 epochs of it. Runs here (the GPU machine
# cannot download); needs apt-get and dpkg.
#
#   scripts/gpu/parity-corpus.sh .carry/parity
set -euo pipefail
DEST=${1:-.carry/parity}
mkdir -p "$DEST"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download bible-kjv-text bible-kjv >/dev/null 2>&1)
for f in "$work"/*.deb; do dpkg -x "$f" "$work/root"; done
# the program opens its data file only by a relative path
out=$(cd "$DEST" && pwd)/kjv.txt
(cd "$work" && root/usr/bin/bible -d root/usr/lib/bible.data "Gen1:1-Rev22:21" > "$out")
sed -i '1{/^$/d}' "$out"   # the leading empty line
echo "$out: $(wc -c < "$out") bytes"
