#!/usr/bin/env bash
# Every GPU check in one go, for a lent H100/H200 (bench/gpu_check_{moe,logprob,model}.py; each prints its own
# table). Logs go to $OUT (the device tool's output folder) or ./gpu_logs. Per-script time limits keep one hang
# from eating the rest; the summary at the end repeats every verdict and throughput line.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  2>&1 | tee "$OUT/env.log"
timeout "${T1_GPU_MOE_S:-240}" python3 bench/gpu_check_moe.py --big --sweep --iters 10 2>&1 | tee "$OUT/moe.log"
timeout "${T1_GPU_LOGPROB_S:-110}" python3 bench/gpu_check_logprob.py --sweep 2>&1 | tee "$OUT/logprob.log"
timeout "${T1_GPU_MODEL_S:-110}" python3 bench/gpu_check_model.py --only "${T1_GPU_MODEL_ONLY:-}" 2>&1 \
  | tee "$OUT/model.log"
# The CUDA-only tests and benchmarks of the pytest suites (they skip on the CPU CI).
timeout "${T1_GPU_PYTEST_S:-120}" python3 -m pytest -q -s -p no:cacheprovider tests/test_moe.py -k "cuda or gpu" \
  bench/test_bench_moe.py bench/test_bench_logprob.py 2>&1 | tee "$OUT/pytest.log"
echo "==== SUMMARY"
grep -h -E "FAIL|^\[ok|TFLOP|BEST|ALL CHECKS|FAILED|host syncs|deterministic|recompute|\"ok\"|Traceback|Error" \
  "$OUT/moe.log" "$OUT/logprob.log" "$OUT/model.log" | cut -c1-400
tail -n 3 "$OUT/pytest.log"
