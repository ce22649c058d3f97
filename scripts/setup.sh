#!/usr/bin/env bash
# One-time set-up on a fresh machine: Python deps (CPU torch unless one is installed), Docker, the sandbox
# base image. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! $PY -c "import torch" 2>/dev/null; then
  # Take the CPU wheel that lies on disk here; a bare 'torch' would resolve to a multi-GB CUDA build.
  $PY -m pip install -q "torch==2.13.0" || $PY -m pip install -q torch
fi
$PY -m pip install -q -e ".[dev]"
bash scripts/ensure_docker.sh
$PY -m sandbox.base_image build
