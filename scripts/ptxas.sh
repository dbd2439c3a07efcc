#!/usr/bin/env bash
# ptxas for the CUDA backend's register and spill check on machines without
# CUDA: PyPI's nvidia-cuda-nvcc (its bin/ptxas assembles PTX for any sm_XX
# with no GPU and no driver), pinned by version and hash; only ptxas is
# unpacked, into target/ptxas (kept for the next run). Prints the path of
# ptxas, or says on stderr what it could not install (the check is then
# reported as not run, a failure under CI=true as in .ci/run).
set -uo pipefail
cd "$(dirname "$0")/.."
dir=target/ptxas
bin=$dir/nvidia/cu13/bin/ptxas
if [ ! -x "$bin" ]; then
  mkdir -p "$dir/wheel"
  printf 'nvidia-cuda-nvcc==13.0.88 --hash=sha256:56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03\n' >"$dir/requirements.txt"
  if python3 -m pip download -q --disable-pip-version-check --no-deps --require-hashes \
      -r "$dir/requirements.txt" -d "$dir/wheel" >&2 \
    && python3 - "$dir" >&2 <<'PY'
import glob, os, sys, zipfile
d = sys.argv[1]
whl = glob.glob(os.path.join(d, "wheel", "nvidia_cuda_nvcc-13.0.88-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    z.extract("nvidia/cu13/bin/ptxas", d)
os.chmod(os.path.join(d, "nvidia/cu13/bin/ptxas"), 0o755)
PY
  then
    rm -rf "$dir/wheel"
    echo "installed ptxas 13.0.88 in $bin" >&2
  else
    echo "NOT INSTALLED: ptxas (pip download nvidia-cuda-nvcc==13.0.88)" >&2
    exit 0
  fi
fi
realpath "$bin"
