"""Rollout engine throughput on CPU: TorchEngine (routing capture on/off) vs transformers' generate on the
same tiny Qwen3-MoE weights, in the same run.

Run: `python -m pytest bench/test_bench_rollout.py -q -s`. Gates on correctness first (the HF model's
log-probs of our sampled tokens equal ours), prints tokens/s, never asserts on speed.
Targets (issue 60): with routing capture on, >= 1.5x transformers' generate at batch 1 and >= 2.5x at batch 8;
the batch-invariant engine >= 0.8x the default one at batch 1 and 2 (batch 8: its ratio and floor); capture
overhead <= 3% (issue 4). Ratios are taken per round of paired runs (the order alternates), printed as the median
and quartiles over the rounds: on a shared box the load drifts between rounds, much less within one.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from rollout.engine import SamplingParams
from rollout.torch_engine import EngineConfig, TorchEngine
from t1model.hf_io import save_pretrained
from t1model.model import ModelConfig, MoEModel

PROMPT_LEN, NEW_TOKENS = 32, 64
ROUNDS = 3 if os.environ.get("T1_BENCH_QUICK") == "1" else 7


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 4096, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def _engine_tok_s(engine: TorchEngine, prompts: list[list[int]], *, capture: bool, seed: int) -> float:
    return _engine_run(engine, prompts, capture=capture, seed=seed)[0]


def _engine_run(engine: TorchEngine, prompts: list[list[int]], *, capture: bool, seed: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed, return_routing=capture)
    t0, c0 = time.perf_counter(), time.process_time()
    comps = engine.generate(prompts, params)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(c.token_ids) for c in comps)
    if capture:
        assert all(c.routing is not None and c.routing.shape[0] == len(c.token_ids) for c in comps)
    return n / dt, n / dc


def _in_thread(fn, *args):
    """Run fn in a fresh thread, like the engine's own thread. On a CPU shared with other busy processes,
    libgomp's barrier in the main thread's OpenMP team stalls badly (measured here: 10-50x slower matmuls
    on the main thread than on a worker thread at load 12 on 2 cores); timing both sides in worker threads
    compares like with like."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def _hf_run(hf_model: torch.nn.Module, prompts: list[list[int]], num_threads: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process) of transformers' generate."""
    return _in_thread(_hf_generate, hf_model, prompts, num_threads)


def _hf_generate(hf_model: torch.nn.Module, prompts: list[list[int]], num_threads: int) -> tuple[float, float]:
    torch.set_num_threads(num_threads)  # set in every fresh thread: torch gives new threads the last value set
    ids = torch.tensor(prompts)
    t0, c0 = time.perf_counter(), time.process_time()
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS, top_k=0, pad_token_id=0)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = (out.shape[1] - PROMPT_LEN) * out.shape[0]
    return n / dt, n / dc


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoEModel, torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    ours = MoEModel(ModelConfig.tiny(), seed=0)
    path = Path(tmp_path_factory.mktemp("tiny"))
    save_pretrained(ours, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def _ratio(num: list[float], den: list[float]) -> str:
    """Median and quartiles of the per-round ratios num / den."""
    ratios = sorted(n / d for n, d in zip(num, den))
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{statistics.median(ratios):.2f}x (quartiles {q1:.2f}-{q3:.2f}, {len(ratios)} rounds)"


def _check_against_hf(engine: TorchEngine, hf: torch.nn.Module, prompts: list[list[int]]) -> None:
    """Correctness gate: transformers' log-probs of our sampled tokens equal the engine's."""
    comps = engine.generate(prompts[:2], SamplingParams(max_new_tokens=16, seed=1))
    for p, c in zip(prompts, comps):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, len(p) - 1:-1].float(), -1)
        ref = logp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(c.logprobs, ref, rtol=0, atol=1e-4)


def test_bench_engine_vs_transformers(models: tuple[MoEModel, torch.nn.Module], benchmark, capsys) -> None:
    ours, hf = models
    torch.manual_seed(0)  # transformers' sampler uses the global RNG (ours does not)
    prompts = _prompts(8)
    cfg = EngineConfig(max_batch=8, num_slots=8, max_seq_len=PROMPT_LEN + NEW_TOKENS + 1, prefix_reuse=False)
    # transformers runs as it does by default (all intra-op threads), and at batch 8 also on one thread, which is
    # what our engine does for small steps (EngineConfig.cpu_parallel_min_tokens), so that the engine's thread
    # policy is not all of the comparison. Each round times every variant once, in alternating order.
    full = torch.get_num_threads()
    wall: dict[str, list[float]] = defaultdict(list)  # tokens per wall second
    cpu: dict[str, list[float]] = defaultdict(list)  # tokens per CPU second of this process
    with TorchEngine(ours, cfg) as engine, \
            TorchEngine(ours, dataclasses.replace(cfg, batch_invariant=True)) as inv_engine:
        _check_against_hf(engine, hf, prompts)
        # Runs that are compared are neighbours in this order (and so in every round, forwards or backwards).
        runs = {}
        for b in (1, 2, 8):
            runs[f"hf_b{b}"] = lambda r, b=b: _hf_run(hf, prompts[:b], full)
            if b == 8:
                runs["hf_b8_1thread"] = lambda r: _hf_run(hf, prompts, 1)
                runs["ours_b8_nocap"] = lambda r: _engine_run(engine, prompts, capture=False, seed=r)
            runs[f"ours_b{b}"] = lambda r, b=b: _engine_run(engine, prompts[:b], capture=True, seed=r)
            runs[f"invariant_b{b}"] = lambda r, b=b: _engine_run(inv_engine, prompts[:b], capture=True, seed=r)
        for name, fn in runs.items():  # warm-up
            fn(99)
        for r in range(ROUNDS):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                w, c = runs[name](r)
                wall[name].append(w)
                cpu[name].append(c)
        before = dict(engine.stats)
        _engine_run(engine, prompts, capture=True, seed=11)
        stats = {k: engine.stats[k] - before[k] for k in before}  # one batch-8 run with capture
        benchmark.pedantic(_engine_tok_s, args=(engine, prompts), kwargs={"capture": True, "seed": 7},
                           rounds=2, iterations=1)
    with capsys.disabled():
        _print_rollout(ours, wall, cpu, stats)


def _print_rollout(ours: MoEModel, wall: dict[str, list[float]], cpu: dict[str, list[float]],
                   stats: dict[str, float]) -> None:
    params = sum(p.numel() for p in ours.parameters()) / 1e6
    print(f"\nrollout throughput (load average {os.getloadavg()[0]:.1f}, shared box), tiny Qwen3-MoE ({params:.1f}M "
          f"params), prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, {torch.get_num_threads()} threads, {ROUNDS} rounds:")
    for k, v in wall.items():
        q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive")
        print(f"  {k:14s} {med:8.0f} tok/s  (quartiles {q1:.0f}-{q3:.0f})")
    targets = {1: "  (target >= 1.5x)", 2: "", 8: "  (target >= 2.5x)"}
    # CPU time beside wall time: under load a process with more threads (transformers uses them all) gets more of
    # the cores than our one-thread decode, so on a busy box the wall ratio says as much about the load.
    for b, target in targets.items():
        print(f"  ours b{b} (capture) / transformers b{b}: wall {_ratio(wall[f'ours_b{b}'], wall[f'hf_b{b}'])}, "
              f"CPU time {_ratio(cpu[f'ours_b{b}'], cpu[f'hf_b{b}'])}{target}")
    one = "hf_b8_1thread"
    print(f"  ours b8 (capture) / transformers b8 on one thread: wall {_ratio(wall['ours_b8'], wall[one])}, "
          f"CPU time {_ratio(cpu['ours_b8'], cpu[one])}")
    print(f"  engine time in model.extend: {100 * stats['model_s'] / stats['step_s']:.0f}% of step time "
          f"(the rest: batching, sampling, bookkeeping)")
    print(f"  routing capture overhead, batch 8: wall {_ratio(wall['ours_b8_nocap'], wall['ours_b8'])}, CPU time "
          f"{_ratio(cpu['ours_b8_nocap'], cpu['ours_b8'])}  (target <= 1.03x)")
    for b in (1, 2, 8):
        target = "  (target >= 0.8x)" if b < 8 else "  (floor: docs/decode-speed.md)"
        inv, ours_b = f"invariant_b{b}", f"ours_b{b}"
        print(f"  batch-invariant / default b{b} (capture): wall {_ratio(wall[inv], wall[ours_b])}, "
              f"CPU time {_ratio(cpu[inv], cpu[ours_b])}{target}")
    capture_share = stats["capture_s"] / (stats["step_s"] - stats["capture_s"])
    print(f"  routing capture cost measured inside the engine (timed code path, load-independent): "
          f"{100 * capture_share:.2f}% of the rest of the step time")
