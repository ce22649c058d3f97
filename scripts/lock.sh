#!/usr/bin/env bash
# Refresh locks/cpu.txt: resolve the CPU set-up afresh (today's releases, torch's CPU wheel) in a throwaway
# virtualenv and write down the exact version of every distribution it installed. Then run the tests
# (`bash scripts/test.sh`) before committing the new lock: setup.sh installs exactly this set on every machine.
#   bash scripts/lock.sh            # ~3 min; prints the diff against the current lock
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU=${TORCH_CPU:-torch==2.13.0}
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
$PY -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "$TORCH_CPU"
"$venv/bin/python" -m pip install -q -e ".[dev]"
{
  echo "# Exact versions of every Python distribution the CPU set-up installs (scripts/setup.sh installs with"
  echo "# '-c locks/cpu.txt'). Made by 'bash scripts/lock.sh' on $(date -u +%Y-%m-%d) with $("$venv/bin/python" -V)."
  "$venv/bin/python" -m pip freeze --exclude-editable --all | grep -viE '^(pip|setuptools|wheel)==' | LC_ALL=C sort -f
} > locks/cpu.txt.new
diff -u locks/cpu.txt locks/cpu.txt.new 2>/dev/null || true
mv locks/cpu.txt.new locks/cpu.txt
echo "locks/cpu.txt: $(grep -vc '^#' locks/cpu.txt) pins"
