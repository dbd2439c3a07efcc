#!/usr/bin/env bash
# Runs every test of the workspace (unit, integration and doc tests). The README's second command.
# First installs the guest toolchains for Python and JavaScript strategies into the
# repository (scripts/guest-toolchains.sh); C strategies need clang with wasi-libc,
# the registry tests Debian's docker-registry and htpasswd (apache2-utils).
# PyTorch and transformers for the Hugging Face interop test go into
# target/hf-venv (scripts/hf-python.sh, pinned; about 4 GB, 2 minutes here).
# Then the CUDA backend's tests (no GPU needed; NVRTC and ptxas from PyPI,
# scripts/nvrtc.sh and scripts/ptxas.sh) and, with Open MPI installed (openmpi-bin libopenmpi-dev libclang-dev), the
# multi-process tests: real `mpirun` jobs of `piper train --features mpi`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/guest-toolchains.sh
export PATH="$PWD/target/guest-venv/bin:$PATH"
# PyTorch and transformers for the Hugging Face interop tests (host/tests/hf.rs).
hf_python=$(./scripts/hf-python.sh)
if [ -n "$hf_python" ]; then export PIPER_HF_PYTHON="$hf_python"; fi
cargo test --workspace
# The CUDA backend (--features cuda) builds and tests without a GPU: its
# kernels compile through NVRTC (scripts/nvrtc.sh installs it), and
# `--backend cuda` names what this machine lacks. One build serves it, the
# multi-process tests (real `mpirun` jobs of `piper train --features mpi`)
# and the host boundary again with the release profile's checks (overflow
# checks and debug assertions off in the host crate): the hostile-plugin and
# randomized boundary tests must behave the same there.
nvrtc=$(./scripts/nvrtc.sh)
export LD_LIBRARY_PATH="${nvrtc:+$nvrtc:}${LD_LIBRARY_PATH:-}"
# ptxas (PyPI's nvidia-cuda-nvcc, only its ptxas kept) assembles every kernel
# for sm_80 and sm_90: no register spills, each kernel's registers printed.
PIPER_PTXAS=$(./scripts/ptxas.sh)
export PIPER_PTXAS
release_checks=(--config 'profile.dev.package.piper.overflow-checks=false'
  --config 'profile.dev.package.piper.debug-assertions=false')
boundary=(--test plugins --test boundary)
if command -v mpirun >/dev/null && command -v mpicc >/dev/null; then
  cargo test -p piper --features "mpi cuda" "${release_checks[@]}" --lib --test mpi --test cuda "${boundary[@]}"
else
  echo "NOT RUN: the MPI tests need Open MPI (apt install openmpi-bin libopenmpi-dev libclang-dev); .ci/run installs it"
  cargo test -p piper --features cuda "${release_checks[@]}" --lib --test cuda "${boundary[@]}"
fi
