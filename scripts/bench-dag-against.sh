#!/usr/bin/env bash
# Plan-compile speed side by side: this checkout's `cargo bench -p piper --bench dag` against
# the same bench built at an earlier commit, run alternately in one session. This machine's
# speed drifts by half between quiet and loaded stretches; a ratio taken pair by pair does
# not. The default commit, deac197, is the code issue 14's plan-compile goals were set
# against (its dag bench already printed them): 1F1B 365 -> 200 ms (0.55x) and ZeRO-3 x 8
# 1.2 s -> 600 ms (0.50x), measured on a faster machine than this one.
#
#   scripts/bench-dag-against.sh [COMMIT] [PAIRS]      (defaults: deac197, 5)
#
# Builds COMMIT in a temporary git worktree into its own target directory, target/against
# (kept for the next run: the first build of an old commit compiles its dependencies in
# release, about 17 minutes on 2 cores, later runs only its piper crate, about 2; this
# checkout's own build is left as it is), then runs PAIRS pairs, which of the two goes
# first alternating, and prints each pair's totals and the median ratio per workload (this
# checkout's total / COMMIT's).
set -euo pipefail

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
rev=${1:-deac197}
pairs=${2:-5}
if ! [[ $pairs =~ ^[1-9][0-9]{0,2}$ ]]; then
    echo "bench-dag-against: PAIRS must be a whole number from 1 to 999, got '$pairs'" >&2
    exit 2
fi
if ! git -C "$root" rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
    echo "bench-dag-against: no commit '$rev' in $root" >&2
    exit 2
fi
target=$(realpath -m "${CARGO_TARGET_DIR:-$root/target}")
work=$(mktemp -d)
cleanup() {
    git -C "$root" worktree remove --force "$work/old" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
git -C "$root" worktree add --detach "$work/old" "$rev" >/dev/null 2>&1

# The bench executable built in checkout $1 into target directory $2, copied to $3.
build() {
    local log exe
    log=$(cd "$1" && CARGO_TARGET_DIR=$2 cargo bench -p piper --bench dag --no-run 2>&1) || {
        echo "$log" >&2
        echo "bench-dag-against: the dag bench did not build in $1" >&2
        exit 1
    }
    exe=$(sed -n 's/.*Executable benches\/dag.rs (\(.*\))$/\1/p' <<<"$log" | tail -1)
    # Cargo names it relative to the checkout when the target directory is inside it.
    [[ -z $exe || $exe == /* ]] || exe=$1/$exe
    if [[ -z $exe || ! -x $exe ]]; then
        echo "$log" >&2
        echo "bench-dag-against: cargo named no dag bench executable in $1" >&2
        exit 1
    fi
    cp "$exe" "$3"
}
echo "building the dag bench at $rev and at this checkout ..." >&2
build "$work/old" "$target/against" "$work/dag-old"
build "$root" "$target" "$work/dag-new"
here=$(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD || echo "+changes")

# The totals one run prints, one per workload (1F1B, then ZeRO-3 x 8).
totals() {
    local out
    out=$("$1" --bench) || {
        echo "bench-dag-against: $1 failed" >&2
        exit 1
    }
    local t
    t=$(sed -n 's/.*| total \([0-9.]*\) ms.*/\1/p' <<<"$out" | tr '\n' ' ')
    if [[ $(wc -w <<<"$t") -ne 2 ]]; then
        echo "$out" >&2
        echo "bench-dag-against: expected two totals (1F1B, ZeRO-3) from $1" >&2
        exit 1
    fi
    echo "$t"
}

echo "dag bench, $pairs alternating pairs: $rev against $here (total ms, best of 3 per run)"
results=()
for ((i = 1; i <= pairs; i++)); do
    if ((i % 2)); then
        old=$(totals "$work/dag-old")
        new=$(totals "$work/dag-new")
    else
        new=$(totals "$work/dag-new")
        old=$(totals "$work/dag-old")
    fi
    read -r o1 o2 <<<"$old"
    read -r n1 n2 <<<"$new"
    results+=("$o1 $n1 $o2 $n2")
    awk -v i="$i" -v o1="$o1" -v n1="$n1" -v o2="$o2" -v n2="$n2" 'BEGIN {
        printf "  pair %d: 1F1B %.1f -> %.1f (%.2fx) | ZeRO-3 x 8 %.1f -> %.1f (%.2fx)\n",
            i, o1, n1, n1 / o1, o2, n2, n2 / o2 }'
done
printf '%s\n' "${results[@]}" | awk -v rev="$rev" -v here="$here" '
    function median(a, n,    i, j, t) {
        for (i = 2; i <= n; i++)
            for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
        return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    { n++; o1[n] = $1; n1[n] = $2; o2[n] = $3; n2[n] = $4; r1[n] = $2 / $1; r2[n] = $4 / $3 }
    END {
        printf "median: 1F1B %s %.1f ms, %s %.1f ms, ratio %.2fx | ZeRO-3 x 8 %s %.1f ms, %s %.1f ms, ratio %.2fx\n",
            rev, median(o1, n), here, median(n1, n), median(r1, n),
            rev, median(o2, n), here, median(n2, n), median(r2, n)
    }'
if [[ $rev == deac197* ]]; then
    echo "issue 14's goals as ratios to this code: 1F1B 0.55x (200 of 365 ms), ZeRO-3 x 8 0.50x (600 of 1,200 ms)"
fi
