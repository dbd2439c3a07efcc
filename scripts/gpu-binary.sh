#!/usr/bin/env bash
# Build what a GPU machine runs and check that it can be carried there: the release binary
# with the CUDA backend, stripped, plus the working tree the device tool copies, within
# 60 MiB (the tool carries 64 MiB at most; the rest is headroom for the tree to grow).
#
#   scripts/gpu-binary.sh            # builds target/release/piper (--features cuda), strips it
#
# then, through the device tool (see scripts/gpu-check.sh's head):
#   run(command="scripts/gpu-check.sh $OUT/gpu", carry=["target/release/piper"], timeout_s=580)
#
# Prints the binary's size, the tree's (tracked and untracked files git does not ignore) and
# their sum; exits non-zero when the build fails or the sum is past the limit.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=$((60 * 1024 * 1024))
cargo build --release -p piper --features cuda
bin=target/release/piper
strip "$bin"
binary=$(stat -c %s "$bin")
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true) |
  awk '{ s += $1 } END { print s + 0 }')
total=$((binary + tree))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "release binary (cuda, stripped): $(mib "$binary")"
echo "working tree the device tool copies: $(mib "$tree")"
echo "together: $(mib "$total") of the $(mib "$limit") allowed"
if [ "$total" -gt "$limit" ]; then
  echo "gpu-binary: $(mib "$total") is past $(mib "$limit"): the device tool cannot carry it" >&2
  exit 1
fi
