#!/usr/bin/env bash
# Runs every test of the workspace (unit, end-to-end and doc tests) in one build: the
# README's second command.
#
# First installs, pinned and inside the repository, what the tests need beyond Rust:
# the guest toolchains for Python and JavaScript strategies (scripts/guest-toolchains.sh),
# PyTorch and transformers for the Hugging Face interop tests (scripts/hf-python.sh,
# target/hf-venv, about 4 GB), NVRTC and ptxas for the CUDA backend's compile checks
# (scripts/nvrtc.sh, scripts/ptxas.sh; no GPU needed). C strategies need clang with
# wasi-libc, the registry tests Debian's docker-registry and htpasswd, the report test
# chromium, the multi-process tests Open MPI (openmpi-bin libopenmpi-dev libclang-dev).
#
# One feature set for everything: `cuda` always (it builds without CUDA), `mpi` where
# Open MPI is installed. A suite whose tool is missing is reported at the end, one line
# each, outside the tests' captured output; under CI=true that is a failure.
#
#   scripts/test.sh [CARGO TEST ARGS...]   e.g. scripts/test.sh -p piper --test it cli::
#   scripts/test.sh --features             prints the feature flag the tests build with
set -euo pipefail
cd "$(dirname "$0")/.."

features=piper/cuda
if command -v mpirun >/dev/null && command -v mpicc >/dev/null; then
  features=$features,piper/mpi
fi
if [ "${1:-}" = --features ]; then
  echo "--features=$features"
  exit 0
fi

# Suites that did not run append `suite<TAB>why` here (piper::test_support::not_run).
PIPER_NOT_RUN=$(mktemp)
export PIPER_NOT_RUN
summary() {
  local rc=$?
  echo "== what did not run"
  if [ -s "$PIPER_NOT_RUN" ]; then
    sort -u "$PIPER_NOT_RUN" | while IFS=$'\t' read -r suite why; do
      echo "NOT RUN: $suite: $why"
    done
    if [ "${CI:-}" = true ] && [ $rc = 0 ]; then
      echo "FAIL: CI runs every suite, and the ones above did not run"
      rc=1
    fi
  else
    echo "everything ran"
  fi
  rm -f "$PIPER_NOT_RUN"
  exit $rc
}
trap summary EXIT

./scripts/guest-toolchains.sh
export PATH="$PWD/target/guest-venv/bin:$PATH"
hf_python=$(./scripts/hf-python.sh)
if [ -n "$hf_python" ]; then export PIPER_HF_PYTHON="$hf_python"; fi
nvrtc=$(./scripts/nvrtc.sh)
export LD_LIBRARY_PATH="${nvrtc:+$nvrtc:}${LD_LIBRARY_PATH:-}"
# ptxas assembles every kernel for sm_80 and sm_90: no register spills.
PIPER_PTXAS=$(./scripts/ptxas.sh)
export PIPER_PTXAS
if [[ $features != *mpi* ]]; then
  printf 'mpi\tthe multi-process tests need Open MPI (apt-get install openmpi-bin libopenmpi-dev libclang-dev); .ci/run installs it\n' >>"$PIPER_NOT_RUN"
fi

if [ $# = 0 ]; then set -- --workspace; fi
cargo test "--features=$features" "$@"
