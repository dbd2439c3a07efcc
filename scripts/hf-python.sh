#!/usr/bin/env bash
# Python with PyTorch and Hugging Face transformers for the interop tests
# (a Piper checkpoint opens with `from_pretrained` and gives Piper's loss; an
# HF model trains under `piper train --init-from`): a virtual environment in
# target/hf-venv, pinned, kept for the next run (pip's cache makes a fresh
# clone's install a copy). PyPI's torch imports only with its nvidia-* wheels:
# about 4 GB and 5 minutes the first time on a machine. Prints the python to
# use, or says on stderr what it could not install (the interop tests then
# are reported as not run, a failure under CI=true as in .ci/run).
set -uo pipefail
cd "$(dirname "$0")/.."
TORCH=2.11.0
TRANSFORMERS=5.25.0
venv=target/hf-venv
py=$venv/bin/python
want="$TORCH $TRANSFORMERS"
have=$("$py" -c 'import torch, transformers; print(torch.__version__.split("+")[0], transformers.__version__)' 2>/dev/null)
if [ "$have" != "$want" ]; then
  if python3 -m venv "$venv" >/dev/null 2>&1 \
    && "$venv/bin/pip" install -q --disable-pip-version-check "torch==$TORCH" "transformers==$TRANSFORMERS" >&2 \
    && "$py" -c 'import torch, transformers' >&2; then
    echo "installed torch $TORCH and transformers $TRANSFORMERS in $venv" >&2
  else
    echo "NOT INSTALLED: torch $TORCH and transformers $TRANSFORMERS (pip install torch==$TORCH transformers==$TRANSFORMERS)" >&2
    exit 0
  fi
fi
# The venv's own path: resolving its symlink would name the base interpreter.
echo "$PWD/$py"
