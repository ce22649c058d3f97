#!/usr/bin/env bash
# One-time set-up on a fresh machine: the Python dependencies at the versions CI tested (locks/), Docker, the
# sandbox base image. Idempotent: a second run only checks. PYTHON=/path/to/venv/bin/python sets it up there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The lock: locks/cpu.txt (torch's CPU wheel) unless a CUDA build of torch is installed already, which gets
# locks/gpu.txt (vLLM 0.33's torch and transformers); T1_LOCK=FILE picks one.
lock=${T1_LOCK:-}
if [ -z "$lock" ]; then
  lock=locks/cpu.txt
  if $PY -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then lock=locks/gpu.txt; fi
fi
[ -f "$lock" ] || { echo "setup.sh: lock file $lock not found" >&2; exit 2; }
echo "setup.sh: Python dependencies from $lock into $($PY -c 'import sys; print(sys.prefix)')" >&2
if ! $PY -c "import torch" 2>/dev/null; then
  # Pinned by the lock: a bare 'torch' would resolve to a multi-GB CUDA build.
  $PY -m pip install -q -c "$lock" torch
fi
$PY -m pip install -q -c "$lock" -e ".[dev]"
bash scripts/ensure_docker.sh
$PY -m sandbox.base_image build
