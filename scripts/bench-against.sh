#!/usr/bin/env bash
# A bench side by side with the same bench built at an earlier commit, run alternately in
# one session. This machine's speed drifts by half between quiet and loaded stretches; a
# ratio taken pair by pair does not.
#
#   scripts/bench-against.sh BENCH [COMMIT] [PAIRS]
#
# BENCH is one of:
#   dag    plan compile (`cargo bench -p piper --bench dag`): the 1F1B and ZeRO-3 x 8
#          totals, ms (lower is better). Default COMMIT deac197, the code issue 14's
#          plan-compile goals were set against (its dag bench already printed them):
#          1F1B 365 -> 200 ms (0.55x) and ZeRO-3 x 8 1.2 s -> 600 ms (0.50x), measured on a
#          faster machine than this one.
#   train  training throughput (`cargo bench -p piper --bench train`): tokens/s of `tiny`
#          and the mid-size model on one thread and on every core (higher is better).
#          Default COMMIT HEAD (this checkout's uncommitted change against its commit).
# PAIRS defaults to 5.
#
# Builds COMMIT in a temporary git worktree into its own target directory, target/against
# (kept for the next run: the first build of an old commit compiles its dependencies in
# release, about 17 minutes on 2 cores, later runs only its piper crate, about 2; this
# checkout's own build is left as it is), then runs PAIRS pairs, which of the two goes
# first alternating, and prints each pair's figures and the median ratio per figure (this
# checkout's / COMMIT's).
set -euo pipefail

usage() {
    echo "usage: scripts/bench-against.sh dag|train [COMMIT] [PAIRS]" >&2
    exit 2
}
bench=${1:-}
case $bench in
dag) default_rev=deac197 ;;
train) default_rev=HEAD ;;
*) usage ;;
esac
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
rev=${2:-$default_rev}
pairs=${3:-5}
if ! [[ $pairs =~ ^[1-9][0-9]{0,2}$ ]]; then
    echo "bench-against: PAIRS must be a whole number from 1 to 999, got '$pairs'" >&2
    exit 2
fi
if ! git -C "$root" rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
    echo "bench-against: no commit '$rev' in $root" >&2
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
    log=$(cd "$1" && CARGO_TARGET_DIR=$2 cargo bench -p piper --bench "$bench" --no-run 2>&1) || {
        echo "$log" >&2
        echo "bench-against: the $bench bench did not build in $1" >&2
        exit 1
    }
    exe=$(sed -n "s/.*Executable benches\/$bench.rs (\(.*\))$/\1/p" <<<"$log" | tail -1)
    # Cargo names it relative to the checkout when the target directory is inside it.
    [[ -z $exe || $exe == /* ]] || exe=$1/$exe
    if [[ -z $exe || ! -x $exe ]]; then
        echo "$log" >&2
        echo "bench-against: cargo named no $bench bench executable in $1" >&2
        exit 1
    fi
    cp "$exe" "$3"
}
echo "building the $bench bench at $rev and at this checkout ..." >&2
build "$work/old" "$target/against" "$work/old-bench"
build "$root" "$target" "$work/new-bench"
here=$(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD || echo "+changes")

# The figures one run prints, as `label value` lines, in a fixed order.
figures() {
    local out f
    out=$("$1" --bench) || {
        echo "bench-against: $1 failed" >&2
        exit 1
    }
    case $bench in
    dag) f=$(sed -n 's/.*| total \([0-9.]*\) ms.*/\1/p' <<<"$out" |
        paste -d' ' <(printf '%s\n' 1F1B ZeRO-3x8) -) ;;
    train) f=$(sed -n 's/^train \([^ ]*\) .* × \([0-9]*\) thread(s): \([0-9.]*\) tokens\/s.*/\1x\2 \3/p' <<<"$out") ;;
    esac
    if [[ -z $f ]] || grep -qv ' [0-9.][0-9.]*$' <<<"$f"; then
        echo "$out" >&2
        echo "bench-against: no figures from $1" >&2
        exit 1
    fi
    echo "$f"
}

unit=$([[ $bench == dag ]] && echo "total ms, best of 3 per run" || echo "tokens/s, best step per run")
echo "$bench bench, $pairs alternating pairs: $rev against $here ($unit)"
rows=$work/rows
: >"$rows"
for ((i = 1; i <= pairs; i++)); do
    if ((i % 2)); then
        old=$(figures "$work/old-bench")
        new=$(figures "$work/new-bench")
    else
        new=$(figures "$work/new-bench")
        old=$(figures "$work/old-bench")
    fi
    # One row per figure: pair, label, old, new.
    paste -d' ' <(echo "$old") <(echo "$new" | cut -d' ' -f2) | sed "s/^/$i /" | tee -a "$rows" |
        awk -v i="$i" '{ line = line sprintf(" | %s %.1f -> %.1f (%.2fx)", $2, $3, $4, $4 / $3) }
            END { print "  pair " i ":" line }'
done
awk -v rev="$rev" -v here="$here" '
    function median(a, n,    i, j, t) {
        for (i = 2; i <= n; i++)
            for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
        return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    {
        if (!($2 in n)) order[++labels] = $2
        k = ++n[$2]; o[$2, k] = $3; w[$2, k] = $4; r[$2, k] = $4 / $3
    }
    END {
        for (l = 1; l <= labels; l++) {
            name = order[l]
            for (k = 1; k <= n[name]; k++) { a[k] = o[name, k]; b[k] = w[name, k]; c[k] = r[name, k] }
            printf "median %s: %s %.1f, %s %.1f, ratio %.2fx\n", name, rev, median(a, n[name]),
                here, median(b, n[name]), median(c, n[name])
        }
    }' "$rows"
if [[ $bench == dag && $rev == deac197* ]]; then
    echo "issue 14's goals as ratios to this code: 1F1B 0.55x (200 of 365 ms), ZeRO-3 x 8 0.50x (600 of 1,200 ms)"
fi
