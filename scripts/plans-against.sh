#!/usr/bin/env bash
# Compare `piper plan --json` between two builds on the configurations the
# tests compile (every bundled strategy, alone and composed, on GPT-2, Llama
# and MoE models, and the example run configs): byte for byte, hashes
# included. For refactors that must not change plans.
#   scripts/plans-against.sh OLD_PIPER [NEW_PIPER]   (NEW: target/debug/piper)
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: scripts/plans-against.sh OLD_PIPER [NEW_PIPER]}
new=${2:-target/debug/piper}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIPER_HOME="$work/home"
# name|arguments
cases=(
  "dp|--model tiny --devices 2 --strategy dp"
  "zero1|--model tiny --devices 2 --strategy zero:stage=1"
  "zero2|--model tiny --devices 2 --strategy zero:stage=2"
  "zero3|--model tiny --devices 2 --strategy zero:stage=3"
  "gpipe|--model tiny --devices 2 --strategy gpipe:microbatches=4"
  "1f1b|--model tiny --devices 4 --strategy 1f1b:microbatches=8"
  "interleaved|--model tiny --devices 2 --strategy interleaved-1f1b:microbatches=4"
  "zb-h1|--model tiny --devices 2 --strategy zb-h1:microbatches=4"
  "dualpipev|--model tiny --devices 2 --strategy dualpipev:microbatches=4"
  "dualpipe|--model tiny --devices 2 --strategy dualpipe:microbatches=4"
  "dp-1f1b|--model tiny --devices 4 --strategy dp:degree=2 --strategy 1f1b:microbatches=4"
  "zero3-1f1b|--model tiny --devices 4 --strategy zero:stage=3,dp=2 --strategy 1f1b:microbatches=4"
  "zero1-dualpipev|--model tiny --devices 4 --strategy zero:stage=1,dp=2 --strategy dualpipev:microbatches=4"
  "tp|--model tiny --devices 2 --strategy tp:tp=2"
  "tp-1f1b|--model tiny --devices 4 --strategy tp:tp=2 --strategy 1f1b:microbatches=4"
  "llama-zb|--model llama-tiny --devices 2 --strategy zb-h1:microbatches=4"
  "llama-tp|--model llama-tiny --devices 2 --strategy tp:tp=2"
  "llama-zero3|--model llama-tiny --devices 4 --strategy zero:stage=3,dp=2 --strategy 1f1b:microbatches=4"
  "moe-ep|--model examples/models/tiny-moe.toml --devices 2 --strategy ep"
  "moe-dp-ep-dualpipev|--model examples/models/tiny-moe.toml --devices 4 --strategy dp:degree=2 --strategy ep --strategy dualpipev:microbatches=4"
  "moe-ep-inop|--model examples/models/tiny-moe.toml --devices 2 --strategy ep:stream=compute --strategy 1f1b:microbatches=4"
  "gpt2-1f1b|--model gpt2-small --devices 8 --strategy zero:stage=1,dp=2 --strategy interleaved-1f1b:microbatches=8"
  "zero1-tp-sp|--model tiny --devices 4 --strategy zero:stage=1,dp=2 --strategy tp:tp=2,sequence-parallel=true"
  "zero3-tp-1f1b|--model llama-tiny --devices 8 --strategy zero:stage=3,dp=2 --strategy tp:tp=2 --strategy 1f1b:microbatches=4"
  "moe-tp-ep|--model examples/models/tiny-moe.toml --devices 4 --strategy dp:degree=2 --strategy tp:tp=2 --strategy ep"
  "tp-then-dp|--model tiny --devices 4 --strategy tp:tp=2 --strategy dp:degree=2"
)
for c in examples/*.toml examples/layouts/*.toml; do cases+=("$(basename "$c" .toml)|--config $c"); done
same=0
differ=0
for case in "${cases[@]}"; do
  name=${case%%|*}
  read -r -a args <<<"${case#*|}"
  "$old" plan --offline --json "${args[@]}" >"$work/$name.old" 2>"$work/$name.olderr" || echo "old failed: $name: $(tail -1 "$work/$name.olderr")"
  "$new" plan --offline --json "${args[@]}" >"$work/$name.new" 2>"$work/$name.newerr" || echo "new failed: $name: $(tail -1 "$work/$name.newerr")"
  if cmp -s "$work/$name.old" "$work/$name.new" && cmp -s "$work/$name.olderr" "$work/$name.newerr"; then
    same=$((same + 1))
  else
    differ=$((differ + 1))
    echo "DIFFERENT: $name (${case#*|})"
  fi
done
echo "$same identical, $differ different, of ${#cases[@]} configurations"
[ "$differ" -eq 0 ]
