#!/usr/bin/env bash
# The fast-feedback figures side by side with an earlier commit, in one run on this
# machine (docs/contributing.md): for this checkout's HEAD and then COMMIT, a fresh clone
# runs `.ci/run` with every line of its output stamped with the seconds since it started,
# and the phases are read off the stamps:
#   first build  from the start to the first line after the featureless `cargo build -p
#                piper` (the README's first command, less its ~2 s to the first loss,
#                which is printed too)
#   test command from `== tests` to `== the book` (the README's second command after the
#                first, its installs included where that commit does them there)
#   CI           the whole of `.ci/run`
#
#   scripts/feedback-against.sh [COMMIT]     default COMMIT: 5d9eb77, before issue 75
#
# Each clone lives in /tmp and is removed after its run (a full one takes ~10 GB); the
# registry cache (~/.cargo/registry) is shared, so neither run downloads crates. The
# stamped logs stay in target/feedback/.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
rev=${1:-5d9eb77}
out=$root/target/feedback
mkdir -p "$out"

stamp() { # prefix each line with the seconds since START (date +%s%N)
  local start=$1 line ms
  while IFS= read -r line; do
    ms=$((($(date +%s%N) - start) / 1000000))
    printf '%d.%03d %s\n' $((ms / 1000)) $((ms % 1000)) "$line"
  done
}

run_one() { # NAME REV
  local name=$1 commit=$2 dir=/tmp/piper-feedback-$1
  rm -rf "$dir"
  git clone -q "$root" "$dir"
  git -C "$dir" checkout -q "$commit"
  local start
  start=$(date +%s%N)
  (cd "$dir" && ./.ci/run) 2>&1 | stamp "$start" >"$out/$name.log" || {
    tail -30 "$out/$name.log"
    echo "FAIL: .ci/run of $commit"
    rm -rf "$dir"
    exit 1
  }
  # The README's first command in the built clone: the seconds to the first loss.
  local t0 first
  t0=$(date +%s%N)
  first=$( (cd "$dir" && target/debug/piper train --steps 1 2>&1) | stamp "$t0" | grep -m1 -E "loss" | awk '{print $1}')
  echo "$first" >"$out/$name.first-loss"
  rm -rf "$dir"
}

run_one after "$(git -C "$root" rev-parse HEAD)"
run_one before "$rev"

python3 - "$out" "$rev" <<'EOF'
import sys
out, rev = sys.argv[1], sys.argv[2]
def phases(name):
    lines = [l.rstrip("\n") for l in open(f"{out}/{name}.log")]
    t = lambda l: float(l.split(None, 1)[0])
    text = lambda l: l.split(None, 1)[1] if len(l.split(None, 1)) > 1 else ""
    first = next(t(l) for l in lines if "== first build" in text(l))
    # The featureless build ends where the next phase prints its header.
    built = next(t(l) for l in lines if text(l).startswith("== ") and t(l) > first
                 and "first build" not in text(l))
    tests = next(t(l) for l in lines if text(l).startswith("== tests"))
    book = next(t(l) for l in lines if text(l).startswith("== the book"))
    total = t(lines[-1])
    loss = float(open(f"{out}/{name}.first-loss").read() or 0)
    return built, loss, book - tests, total
b, a = phases("before"), phases("after")
print(f"{'':28s} {'before (' + rev + ')':>18s} {'after':>10s} {'ratio':>7s}")
rows = [("first build (to .ci/run's next phase)", 0), ("test command", 2), (".ci/run", 3)]
for label, i in rows:
    print(f"{label:28s} {b[i] / 60:15.1f} min {a[i] / 60:7.1f} min {a[i] / b[i]:7.2f}")
print(f"{'first loss after the build':28s} {b[1]:16.1f} s {a[1]:8.1f} s")
EOF
