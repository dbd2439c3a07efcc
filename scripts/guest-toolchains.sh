#!/usr/bin/env bash
# Installs the guest toolchains for strategies in Python and JavaScript, pinned
# and inside the repository (no root, nothing global):
#   - componentize-py (PyPI) in a virtual environment, target/guest-venv;
#   - @bytecodealliance/componentize-js (npm) in examples/plugins/js/node_modules,
#     from its package-lock.json.
# C needs clang with wasi-libc from the system (Debian: apt-get install clang-19
# lld-19 libclang-rt-19-dev-wasm32 wasi-libc); .ci/run installs it.
# Prints what it could not install and carries on: the tests of that language
# are then reported as not run (a failure under CI=true, as in .ci/run).
set -uo pipefail
cd "$(dirname "$0")/.."
COMPONENTIZE_PY=0.25.1

venv=target/guest-venv
if [ -x "$venv/bin/componentize-py" ] && "$venv/bin/componentize-py" --version 2>/dev/null | grep -q " $COMPONENTIZE_PY"; then
  :
elif command -v python3 >/dev/null && python3 -m venv "$venv" >/dev/null 2>&1 \
  && "$venv/bin/pip" install -q --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY"; then
  echo "installed componentize-py $COMPONENTIZE_PY in $venv"
else
  echo "NOT INSTALLED: componentize-py (needs python3 with venv and pip: pip install componentize-py==$COMPONENTIZE_PY)"
fi

js=examples/plugins/js
if [ -d "$js/node_modules/@bytecodealliance/componentize-js" ]; then
  :
elif command -v npm >/dev/null && (cd "$js" && npm ci --silent --no-audit --no-fund >/dev/null); then
  echo "installed componentize-js in $js/node_modules"
else
  echo "NOT INSTALLED: componentize-js (needs Node.js 20+ and npm: cd $js && npm ci)"
fi
