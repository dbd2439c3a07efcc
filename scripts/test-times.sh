#!/usr/bin/env bash
# Where the time of the README's two commands goes: the first build's critical path and
# the slowest tests of the suite, for the fast-feedback goals (docs/contributing.md).
#
#   scripts/test-times.sh [build] [tests] [N]
#
#   build  a cold `cargo build -p piper --timings` into its own target directory
#          (target/cold-build, removed first; the registry cache is kept, so nothing is
#          downloaded twice), then the build's wall time, the sum of its compile units,
#          the 20 longest units and the critical path: the chain of units, each waiting on
#          the one before, that ends with the last unit to finish.
#   tests  builds the test binaries of `scripts/test.sh` (`cargo test --no-run`, the same
#          feature set) and runs each with libtest's JSON report (RUSTC_BOOTSTRAP=1 is set
#          for the test binaries only, so no crate is rebuilt), then prints each binary's
#          wall time and the N slowest tests (default 20). The guest toolchains, PyTorch,
#          NVRTC and ptxas come from scripts/test.sh's installers, as there.
#
# Without arguments: both. Reports go to target/test-times/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/target/test-times
mkdir -p "$out"
do_build=0 do_tests=0 top=20
for a in "$@"; do
  case $a in
  build) do_build=1 ;;
  tests) do_tests=1 ;;
  [1-9]*) top=$a ;;
  *) echo "usage: scripts/test-times.sh [build] [tests] [N]" >&2; exit 2 ;;
  esac
done
[ $do_build = 1 ] || [ $do_tests = 1 ] || { do_build=1; do_tests=1; }

if [ $do_build = 1 ]; then
  cold=$root/target/cold-build
  rm -rf "$cold"
  start=$(date +%s)
  CARGO_TARGET_DIR=$cold cargo build -q -p piper --timings
  end=$(date +%s)
  cp "$cold"/cargo-timings/cargo-timing.html "$out/cold-build.html"
  rm -rf "$cold"
  echo "== cold build: $((end - start)) s wall (cargo build -p piper, report $out/cold-build.html)"
  python3 - "$out/cold-build.html" <<'EOF'
import json, re, sys
html = open(sys.argv[1]).read()
units = json.loads(re.search(r"const UNIT_DATA = (\[.*?\]);\n", html, re.S).group(1))
def name(u):
    what = {"run-custom-build": " (build script run)", "build-script": " (build script)"}
    kind = what.get(u["mode"], "") if u["target"].strip() == "" or "build" in u["mode"] else ""
    return f'{u["name"]} {u["version"]}{u["target"]}{kind}'.strip()
print(f"compile units: {len(units)}, {sum(u['duration'] for u in units):.0f} s in all")
print("longest units:")
for u in sorted(units, key=lambda u: -u["duration"])[:20]:
    print(f'  {u["duration"]:7.1f} s  {name(u)}')
# A unit starts when the last unit it waits on finishes (or its metadata does): walk back
# from the last unit to finish through the unit that unblocked each.
by = {u["i"]: u for u in units}
unblocker = {}
for u in units:
    for j in u.get("unblocked_units", []) + u.get("unblocked_rmeta_units", []):
        unblocker[j] = u["i"]
u = max(units, key=lambda u: u["start"] + u["duration"])
chain = []
while True:
    chain.append(u)
    if u["i"] not in unblocker:
        break
    u = by[unblocker[u["i"]]]
chain.reverse()
total = chain[-1]["start"] + chain[-1]["duration"]
print(f"critical path ({len(chain)} units, ends at {total:.0f} s):")
for u in chain:
    print(f'  {u["start"]:6.1f} s +{u["duration"]:6.1f} s  {name(u)}')
EOF
fi

if [ $do_tests = 1 ]; then
  # The same environment and feature set as scripts/test.sh.
  ./scripts/guest-toolchains.sh >/dev/null
  export PATH="$root/target/guest-venv/bin:$PATH"
  hf_python=$(./scripts/hf-python.sh)
  if [ -n "$hf_python" ]; then export PIPER_HF_PYTHON="$hf_python"; fi
  nvrtc=$(./scripts/nvrtc.sh)
  export LD_LIBRARY_PATH="${nvrtc:+$nvrtc:}${LD_LIBRARY_PATH:-}"
  PIPER_PTXAS=$(./scripts/ptxas.sh)
  export PIPER_PTXAS
  features=$(./scripts/test.sh --features)
  cargo test --workspace $features --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["profile"]["test"] and m.get("executable"):
        print(m["manifest_path"].rsplit("/", 1)[0], m["executable"])
' >"$out/binaries.txt"
  : >"$out/tests.jsonl"
  while read -r dir exe; do
    start=$(date +%s.%N)
    (cd "$dir" && RUSTC_BOOTSTRAP=1 "$exe" -Z unstable-options --format json --report-time </dev/null) \
      | python3 -c '
import json, sys
binary = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("type") == "test" and m.get("event") in ("ok", "failed", "ignored"):
        print(json.dumps({"binary": binary, "name": m["name"], "event": m["event"],
                          "seconds": m.get("exec_time", 0.0)}))
        if m["event"] == "failed":
            print("FAILED " + m["name"] + ":\n" + m.get("stdout", ""), file=sys.stderr)
' "$(basename "$exe")" >>"$out/tests.jsonl" || true
    end=$(date +%s.%N)
    echo "$(basename "$exe") $(python3 -c "print(f'{$end - $start:.1f}')")" >>"$out/binaries.txt.times"
  done <"$out/binaries.txt"
  python3 - "$out/tests.jsonl" "$out/binaries.txt.times" "$top" <<'EOF'
import json, sys
tests = [json.loads(l) for l in open(sys.argv[1])]
times = [l.split() for l in open(sys.argv[2])]
top = int(sys.argv[3])
print(f"== tests: {len(tests)} ({sum(t['event'] == 'ok' for t in tests)} passed, "
      f"{sum(t['event'] == 'failed' for t in tests)} failed, "
      f"{sum(t['event'] == 'ignored' for t in tests)} ignored), "
      f"{sum(t['seconds'] for t in tests):.0f} s of test time")
print("binaries (wall):")
for b, s in sorted(times, key=lambda x: -float(x[1])):
    if float(s) >= 1.0:
        print(f"  {float(s):7.1f} s  {b}")
print(f"the {top} slowest tests:")
for t in sorted(tests, key=lambda t: -t["seconds"])[:top]:
    print(f"  {t['seconds']:7.1f} s  {t['binary'].rsplit('-', 1)[0]} {t['name']}")
EOF
  rm -f "$out/binaries.txt.times"
fi
