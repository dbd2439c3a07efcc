#!/usr/bin/env bash
# NVRTC for the CUDA backend's compile tests on machines without CUDA: PyPI's
# nvidia-cuda-nvrtc (libnvrtc.so.13 compiles CUDA C to PTX with no GPU and no
# driver), pinned by version and hash, unpacked into target/nvrtc (kept for the
# next run). Prints the directory to put on LD_LIBRARY_PATH, or says on stderr
# what it could not install (the compile tests are then reported as not run, a
# failure under CI=true as in .ci/run).
set -uo pipefail
cd "$(dirname "$0")/.."
dir=target/nvrtc
lib=$dir/nvidia/cu13/lib
if [ ! -e "$lib/libnvrtc.so.13" ]; then
  mkdir -p "$dir/wheel"
  printf 'nvidia-cuda-nvrtc==13.0.88 --hash=sha256:ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575\n' >"$dir/requirements.txt"
  if python3 -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
      -r "$dir/requirements.txt" -d "$dir/wheel" >&2 \
    && python3 -m zipfile -e "$dir"/wheel/nvidia_cuda_nvrtc-13.0.88-*.whl "$dir" >&2; then
    echo "installed NVRTC 13.0.88 in $lib" >&2
  else
    echo "NOT INSTALLED: NVRTC (pip download nvidia-cuda-nvrtc==13.0.88)" >&2
    exit 0
  fi
fi
realpath "$lib"
