#!/usr/bin/env bash
# Refresh a lock: the exact version of every Python distribution a set-up installs. scripts/setup.sh installs
# with '-c LOCK', so every machine gets the set CI tested. Run the tests before committing a new lock.
#   bash scripts/lock.sh         # locks/cpu.txt: the CPU set-up resolved afresh in a throwaway venv (~3 min)
#   bash scripts/lock.sh --gpu   # locks/gpu.txt: '.[gpu,dev]' resolved by pip (--dry-run: nothing CUDA is
#                                # installed or run here) with vLLM 0.33's torch; flash-attn added by hand
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU=${TORCH_CPU:-torch==2.13.0}
TORCH_GPU=${TORCH_GPU:-torch==2.14.0}    # vllm 0.33.0 requires torch==2.14.0
FLASH_ATTN=${FLASH_ATTN:-flash-attn==2.8.3.post2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip

if [ "${1:-}" = "--gpu" ]; then
  out=locks/gpu.txt
  # Every requirement of the package and its gpu + dev extras, flash-attn aside (an sdist that compiles against
  # the installed CUDA torch: it cannot be resolved without one).
  mapfile -t reqs < <("$tmp/venv/bin/python" - <<'PY'
import ast, pathlib
tree = ast.parse(pathlib.Path("setup.py").read_text())
kw = {k.arg: k.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords}
reqs = ast.literal_eval(kw["install_requires"]) + [r for e in ("gpu", "dev")
                                                   for r in ast.literal_eval(kw["extras_require"])[e]]
print("\n".join(r for r in dict.fromkeys(reqs) if not r.startswith(("flash-attn", "torch>", "torch=", "torch<"))))
PY
)
  "${pip[@]}" install -q --dry-run --ignore-installed --report "$tmp/report.json" "$TORCH_GPU" "${reqs[@]}"
  header="'.[gpu,dev]' resolved by 'pip install --dry-run' with $TORCH_GPU; $FLASH_ATTN added by hand (sdist)"
  pins=$("$tmp/venv/bin/python" -c "
import json, sys
r = json.load(open(sys.argv[1]))
print('\n'.join(f\"{i['metadata']['name']}=={i['metadata']['version']}\" for i in r['install']))
print(sys.argv[2])" "$tmp/report.json" "$FLASH_ATTN")
else
  out=locks/cpu.txt
  "${pip[@]}" install -q "$TORCH_CPU"
  "${pip[@]}" install -q -e ".[dev]"
  header="the CPU set-up ($TORCH_CPU, then '.[dev]') installed in a fresh virtualenv"
  pins=$("${pip[@]}" freeze --exclude-editable --all)
fi
{
  echo "# Exact versions of every Python distribution a set-up installs (scripts/setup.sh: pip install -c $out)."
  echo "# $header; made by 'bash scripts/lock.sh${1:+ $1}' on $(date -u +%Y-%m-%d) with $("$tmp/venv/bin/python" -V)."
  echo "$pins" | grep -viE '^(pip|setuptools|wheel)==' | LC_ALL=C sort -f
} > "$out.new"
diff -u "$out" "$out.new" 2>/dev/null || true
mv "$out.new" "$out"
echo "$out: $(grep -vc '^#' "$out") pins"
