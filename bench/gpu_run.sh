#!/usr/bin/env bash
# The device check: one command that measures production on a lent H100/H200 and fits a 15-minute lease with room
# to rerun it (cold Triton cache included).
#
#   bash bench/gpu_run.sh [--dry-run] [--only moe,logprob,model,pytest,vllm,train]
#
# Parts, each under its own time limit (seconds; they sum to under 10 minutes, one device command: with the
# machine's start it fits the 15-minute lease, and a failed part reruns alone with --only):
#   env      GPU, driver, torch and triton versions
#   moe      bench/gpu_check_moe.py: fp32/bf16 correctness, no host sync and bitwise repeats (uniform and skewed
#            routing), then fwd+bwd TFLOP/s at the 30B shape (T=8192, D=2048, F=768, E=128, K=8) and a 122B-class
#            shape (T=16384, D=4096, F=1536, E=256, K=8), each with uniform and skewed routing
#   logprob  bench/gpu_check_logprob.py: correctness (fp64 reference), then fwd+bwd with entropy at N=65536,
#            D=2048, V=151936 against the LM-head matmul
#   model    bench/gpu_check_model.py --deterministic: parity, replay, decode, engine gap, speed, bitwise repeat,
#            host syncs under replay
#   pytest   the CUDA tests of tests/test_moe.py and tests/test_logprob.py
#   vllm     bench/gpu_check_vllm.py: VLLMEngine against a real vLLM 0.33 (TITO, log-probs with R3, routing
#            agreement, prefix cache, weight update inside a 2-rank trainer world). Needs vLLM installed on the
#            device; without it the part says so and is reported as skipped (exit 77), not failed.
#   train    bench/gpu_check_train.py: two RL steps of python -m t1core.train, tiny model, run.device=cuda, torch
#            engine (critic-only, then actor+critic). Without a Docker daemon (the lent device) its episodes are
#            replayed from bench/fixtures/train_replay (bench/train_replay.py), recorded on a CPU box. Its 65 s came from moe (-30), logprob (-10) and model (-10), cut without a
#            device measurement: a part that runs out of time reruns alone with --only.
# No tuning sweeps: tiles are chosen ahead of time (python -m t1kernels.aot_report checks them for spills on a CPU).
# Every part writes $OUT/<part>.log (and .jsonl rows where the check emits them); $OUT/summary.json holds each
# part's exit status and time. Exit status: 0 when every part passed, 1 otherwise (a part that hits its time limit
# fails). --dry-run prints the plan (parts, limits, the scripts' own shape plans) without touching a GPU.
set -u -o pipefail
cd "$(dirname "$0")/.."

declare -A LIMIT_S=([env]=20 [moe]=160 [logprob]=100 [model]=100 [pytest]=40 [vllm]=110 [train]=65)
PARTS=(env moe logprob model pytest vllm train)
BUDGET_S=600  # one device command's limit
SKIPPED=77    # a part's exit status for "cannot run here" (gpu_check_vllm.py without vLLM)
PY=${PYTHON:-python3}
DRY=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) shift; ONLY=${1:-} ;;
    --only=*) ONLY=${1#--only=} ;;
    *) echo "gpu_run.sh: unknown argument '$1' (expected --dry-run, --only PART[,PART])" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$ONLY" ]; then
  for p in ${ONLY//,/ }; do
    [ -n "${LIMIT_S[$p]+x}" ] || { echo "gpu_run.sh: --only: unknown part '$p' (parts: ${PARTS[*]})" >&2; exit 2; }
  done
  PARTS=(${ONLY//,/ })
fi
OUT=${OUT:-bench/gpu_logs/run-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

part_cmd() {  # the command of one part; $1 = part, $2 = extra flag (--dry-run or empty)
  case "$1" in
    env) echo "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv && $PY -c \
\"import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)\"" ;;
    moe) echo "$PY bench/gpu_check_moe.py --iters 10 --json-out $OUT/moe.jsonl $2" ;;
    logprob) echo "$PY bench/gpu_check_logprob.py --json-out $OUT/logprob.jsonl $2" ;;
    model) echo "$PY bench/gpu_check_model.py --device cuda --deterministic $2" ;;
    pytest) echo "$PY -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_logprob.py -k cuda" ;;
    vllm) echo "$PY bench/gpu_check_vllm.py $2" ;;
    train) echo "$PY bench/gpu_check_train.py --out $OUT/train-run $2" ;;
  esac
}

total=0
for p in "${PARTS[@]}"; do total=$((total + LIMIT_S[$p])); done
if [ "$total" -ge "$BUDGET_S" ]; then
  echo "gpu_run.sh: part limits sum to ${total} s, over the ${BUDGET_S} s budget" >&2
  exit 2
fi

if [ "$DRY" = 1 ]; then
  status=0
  echo "PLAN parts=${PARTS[*]} total_limit_s=${total} out=${OUT}" | tee "$OUT/plan.log"
  for p in "${PARTS[@]}"; do
    echo "PART ${p} limit_s=${LIMIT_S[$p]} cmd: $(part_cmd "$p" "")" | tee -a "$OUT/plan.log"
    case "$p" in
      moe|logprob|model|vllm|train) bash -c "$(part_cmd "$p" --dry-run)" 2>&1 | tee -a "$OUT/plan.log" || status=1 ;;
    esac
  done
  exit "$status"
fi

failed=()
skipped=()
summary="{"
for p in "${PARTS[@]}"; do
  echo "==== ${p} (limit ${LIMIT_S[$p]} s)"
  t0=$(date +%s)
  timeout --kill-after=10 "${LIMIT_S[$p]}" bash -c "$(part_cmd "$p" "")" 2>&1 | tee "$OUT/${p}.log"
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq "$SKIPPED" ]; then
    skipped+=("$p")
  elif [ "$rc" -ne 0 ]; then
    failed+=("${p}(rc=${rc})")
  fi
  summary+="\"${p}\": {\"rc\": ${rc}, \"seconds\": ${secs}, \"limit_s\": ${LIMIT_S[$p]}}, "
done
summary+="\"skipped\": \"${skipped[*]:-}\", \"failed\": \"${failed[*]:-}\"}"
echo "$summary" > "$OUT/summary.json"
echo "==== SUMMARY"
grep -h -E "FAIL|SKIPPED|TFLOP|fraction_of_matmul|ALL CHECKS|host syncs|deterministic|bitwise|Traceback|Error" \
  "$OUT"/*.log 2>/dev/null | cut -c1-400
cat "$OUT/summary.json"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED PARTS: ${failed[*]}"
  exit 1
fi
[ ${#skipped[@]} -eq 0 ] || echo "SKIPPED PARTS: ${skipped[*]}"
echo "ALL PARTS PASSED"
