#!/usr/bin/env bash
# The CUDA backend's checks on a machine with one NVIDIA GPU, from a release binary built
# beforehand (nothing is built there; no Rust, no network needed):
#
#   scripts/gpu-binary.sh        # here, before: builds the release binary with
#                                # --features cuda, strips it, checks binary + tree <= 60 MiB
#   scripts/gpu-check.sh OUT_DIR # there
#
# Through the device tool: carry the binary, one call under the 600 s limit (the script
# keeps to 540 s), then give the machine back:
#   run(command="scripts/gpu-check.sh $OUT/gpu", carry=["target/release/piper"], timeout_s=580)
#
# A stage that fails is recorded in check.json and the next one runs; after a failure the
# checks run again (1 step) with CUDA_LAUNCH_BLOCKING=1 and PIPER_CUDA_SYNC=1 (a
# synchronisation after every op), under compute-sanitizer when the
# image has it, into OUT_DIR/blocking. Pipeline messages between virtual devices of the GPU
# hand the tensor over on the device; if the multi-device stages disagree with one GPU,
# PIPER_HOST_MESSAGES=1 (messages through host memory) tells that path from the rest.
#
# 1. `piper backend check --backend cuda --bench`: every CUDA kernel against the CPU
#    backend on the same inputs (fp32, 1e-5 of each output's scale); `tiny` for 20 steps on
#    one GPU against the CPU's losses (1e-4 relative); 1f1b, zero:stage=3,dp=2 + 1f1b,
#    dualpipev and ep on the MoE model on 4 virtual devices of the GPU, tp:tp=2 on 2 with and
#    without sequence parallelism (its exchanges beside the products), each
#    against the one-GPU losses (1e-5); bf16: the storage checks among the kernels (casts,
#    copies, a bf16 linear layer through cublasGemmEx and its backward), `tiny` in bf16
#    against the CPU's bf16 losses (1e-2) and ZeRO-3 x 1F1B with bf16 gradient reductions
#    against one GPU (1e-3); then gpt2-small (batch 8 x 1024) on one GPU in fp32 and bf16 and
#    under 1f1b on 4 virtual devices: tokens/s, MFU, peak memory, step-1 loss against the
#    CPU's.
# 2. `piper calibrate --backend cuda`: dp and zb-h1 of gpt2-small on 2 virtual devices of the
#    GPU, traced; each op fitted on its shapes to the H100's (H200's) device class: the pass
#    efficiencies and overheads the simulator should use (OUT_DIR/gpu-local.toml, the traces
#    in OUT_DIR/calibration for `piper calibrate --from-traces` here).
# 3. PyTorch eager and torch.compile on the same gpt2-small step (benches/reference/
#    torch_gpt.py), fp32 and bf16, for the side-by-side figures.
#
# Writes OUT_DIR/check.json (Piper's figures and every check), OUT_DIR/torch.jsonl and
# OUT_DIR/gpu-check.log; exits non-zero when a check fails. The NVIDIA libraries (cuBLAS,
# NVRTC) are those of the machine's PyTorch wheels (site-packages/nvidia/*/lib).
# PIPER_BIN (default target/release/piper) and PIPER_TORCH_PYTHON (default
# /opt/torch/.venv/bin/python, else python3) override where they are.
set -uo pipefail
out=${1:?usage: scripts/gpu-check.sh OUT_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
bin=${PIPER_BIN:-target/release/piper}
py=${PIPER_TORCH_PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$py" ] || py=python3
if [ ! -x "$bin" ]; then
  echo "gpu-check: no piper binary at $bin: build it with scripts/gpu-binary.sh and carry it"
  exit 2
fi
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
libs=""
for d in "$site"/nvidia/*/lib; do
  [ -d "$d" ] && libs="$libs$d:"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:-}"
echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
# One deadline for the whole script (a device call may run 600 s): each stage gets
# what its budget says or what is left, whichever is less, and is skipped under 20 s.
deadline=$((SECONDS + 540))
left() { local l=$((deadline - SECONDS)); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
echo "== piper backend info --backend cuda (versions, libraries loaded, GPUs, a kernel and an SGEMM)"
timeout "$(left 60)" "$bin" backend info --backend cuda || true
status=0
echo "== piper backend check --backend cuda --bench (stages: kernels, one_device, strategies, bf16, bench)"
start=$SECONDS
timeout "$(left 300)" "$bin" backend check --backend cuda --bench --out "$out" || status=$?
echo "piper's checks took $((SECONDS - start)) s (exit $status; check.json holds every stage that ended)"
if [ $status -ne 0 ] && [ "$(left 120)" -ge 20 ]; then
  # Again with every launch synchronous, so a fault names the kernel that made it.
  echo "== again with CUDA_LAUNCH_BLOCKING=1 (1 step), into $out/blocking"
  runner=()
  command -v compute-sanitizer >/dev/null && runner=(compute-sanitizer --print-limit 20)
  CUDA_LAUNCH_BLOCKING=1 PIPER_CUDA_SYNC=1 timeout "$(left 120)" "${runner[@]}" "$bin" backend check \
      --backend cuda --steps 1 --out "$out/blocking" || true
fi
echo "== piper calibrate --backend cuda: the GPU's pass efficiencies from gpt2-small's measured ops"
cluster=h100-8x
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && cluster=h200-1
budget=$(left 60)
if [ "$budget" -ge 20 ]; then
  timeout "$budget" "$bin" calibrate --backend cuda --cluster $cluster --model gpt2-small \
      --devices 2 --steps 5 --save-traces "$out/calibration" --out "$out/gpu-local.toml" \
    || echo "calibrate: did not finish"
else
  echo "calibrate: skipped (${budget} s left of the deadline)"
fi
echo "== PyTorch on gpt2-small, batch 8 x 1024"
: >"$out/torch.jsonl"
for precision in fp32 bf16; do
  for mode in eager compile; do
    flag=""
    [ $mode = compile ] && flag=--compile
    start=$SECONDS
    budget=$(left 100)
    if [ "$budget" -lt 20 ]; then
      echo "torch $precision $mode: skipped (${budget} s left of the deadline)"
      continue
    fi
    if timeout "$budget" "$py" benches/reference/torch_gpt.py --layers 12 --d-model 768 --heads 12 \
        --seq 1024 --batch 8 --vocab 50257 --steps 8 --device cuda --precision $precision $flag \
        >>"$out/torch.jsonl"; then
      echo "torch $precision $mode: $(tail -1 "$out/torch.jsonl") ($((SECONDS - start)) s)"
    else
      echo "torch $precision $mode: did not finish ($((SECONDS - start)) s)"
    fi
  done
done
echo "== done: exit $status"
exit $status
