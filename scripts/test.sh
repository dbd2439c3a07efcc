#!/usr/bin/env bash
# Runs every test of the workspace (unit, integration and doc tests). The README's second command.
# First installs the guest toolchains for Python and JavaScript strategies into the
# repository (scripts/guest-toolchains.sh); C strategies need clang with wasi-libc,
# the registry tests Debian's docker-registry and htpasswd (apache2-utils).
# With Open MPI installed (openmpi-bin libopenmpi-dev libclang-dev), also the
# multi-process tests: real `mpirun` jobs of `piper train --features mpi`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/guest-toolchains.sh
export PATH="$PWD/target/guest-venv/bin:$PATH"
cargo test --workspace
if command -v mpirun >/dev/null && command -v mpicc >/dev/null; then
  cargo test -p piper --features mpi --lib --test mpi
else
  echo "NOT RUN: the MPI tests need Open MPI (apt install openmpi-bin libopenmpi-dev libclang-dev); .ci/run installs it"
fi
