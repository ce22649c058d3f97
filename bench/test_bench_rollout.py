"""Rollout engine throughput on CPU: TorchEngine (routing capture on/off) vs transformers' generate on the
same tiny Qwen3-MoE weights, in the same run.

Run: `python -m pytest bench/test_bench_rollout.py -q -s`. Gates on correctness first (the HF model's
log-probs of our sampled tokens equal ours), prints tokens/s, never asserts on speed.
Targets (issue 4): batch 8 with capture >= 2x transformers at batch 8; capture overhead <= 3%.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

from rollout.engine import SamplingParams
from rollout.torch_engine import EngineConfig, TorchEngine
from t1model.hf_io import save_pretrained
from t1model.model import ModelConfig, MoEModel

PROMPT_LEN, NEW_TOKENS, REPEATS = 32, 64, 3


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


def _hf_tok_s(hf_model: torch.nn.Module, prompts: list[list[int]], num_threads: int) -> float:
    return _in_thread(_hf_generate_tok_s, hf_model, prompts, num_threads)


def _hf_generate_tok_s(hf_model: torch.nn.Module, prompts: list[list[int]], num_threads: int) -> float:
    torch.set_num_threads(num_threads)  # set in every fresh thread: torch gives new threads the last value set
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS, top_k=0, pad_token_id=0)
    dt = time.perf_counter() - t0
    return (out.shape[1] - PROMPT_LEN) * out.shape[0] / dt


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[MoEModel, torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    ours = MoEModel(ModelConfig.tiny(), seed=0)
    path = Path(tmp_path_factory.mktemp("tiny"))
    save_pretrained(ours, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def test_bench_engine_vs_transformers(models: tuple[MoEModel, torch.nn.Module], benchmark, capsys) -> None:
    ours, hf = models
    torch.manual_seed(0)  # transformers' sampler uses the global RNG (ours does not)
    prompts = _prompts(8)
    cfg = EngineConfig(max_batch=8, num_slots=8, max_seq_len=PROMPT_LEN + NEW_TOKENS + 1, prefix_reuse=False)
    with TorchEngine(ours, cfg) as engine:
        # Correctness gate: transformers' log-probs of our sampled tokens equal the engine's.
        comps = engine.generate(prompts[:2], SamplingParams(max_new_tokens=16, seed=1))
        for p, c in zip(prompts, comps):
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids).logits[0, len(p) - 1:-1].float(), -1)
            ref = logp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(c.logprobs, ref, rtol=0, atol=1e-4)

        # transformers twice: as it runs by default (all intra-op threads), and on one thread, which is what our
        # engine does for small steps (a sleeping OpenMP team costs more per small op than it saves; see
        # EngineConfig.cpu_parallel_min_tokens), so that the engine's thread policy is not all of the comparison.
        full = torch.get_num_threads()
        rows: dict[str, list[float]] = {k: [] for k in ("hf_b1", "hf_b8", "hf_b8_1thread", "ours_b1", "ours_b8_nocap",
                                                        "ours_b8_cap", "ours_b8_invariant")}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        _engine_tok_s(engine, prompts, capture=True, seed=99)  # warm-up
        _hf_tok_s(hf, prompts[:1], full)
        for r in range(REPEATS):
            rows["hf_b1"].append(_hf_tok_s(hf, prompts[:1], full))
            rows["hf_b8"].append(_hf_tok_s(hf, prompts, full))
            rows["hf_b8_1thread"].append(_hf_tok_s(hf, prompts, 1))
            rows["ours_b1"].append(_engine_tok_s(engine, prompts[:1], capture=True, seed=r))
        for r in range(2 * REPEATS):
            # Interleaved in ABBA order so that load from other processes hits both variants alike.
            for capture in ((False, True) if r % 2 == 0 else (True, False)):
                wall, per_cpu = _engine_run(engine, prompts, capture=capture, seed=r)
                rows["ours_b8_cap" if capture else "ours_b8_nocap"].append(wall)
                cpu[capture].append(per_cpu)
        # The batch-invariant mode (bit-for-bit rollouts whatever the batching), same prompts and sampling.
        # Interleaved with the default engine (ABBA), also per CPU second: on a shared box the wall clock of two
        # runs minutes apart compares the load more than the engines (issue 43 asks for >= 0.8x the default).
        inv_cpu: dict[str, list[float]] = {"default": [], "invariant": []}
        with TorchEngine(ours, dataclasses.replace(cfg, batch_invariant=True)) as inv_engine:
            _engine_tok_s(inv_engine, prompts, capture=True, seed=99)  # warm-up
            for r in range(2 * REPEATS):
                for name in (("default", "invariant") if r % 2 == 0 else ("invariant", "default")):
                    wall, per_cpu = _engine_run(inv_engine if name == "invariant" else engine, prompts, capture=True,
                                                seed=r)
                    inv_cpu[name].append(per_cpu)
                    if name == "invariant":
                        rows["ours_b8_invariant"].append(wall)
        before = dict(engine.stats)
        _engine_run(engine, prompts, capture=True, seed=11)
        stats = {k: engine.stats[k] - before[k] for k in before}  # one batch-8 run with capture
        benchmark.pedantic(_engine_tok_s, args=(engine, prompts), kwargs={"capture": True, "seed": 7},
                           rounds=2, iterations=1)
    med = {k: statistics.median(v) for k, v in rows.items()}
    best = {k: max(v) for k, v in rows.items()}
    with capsys.disabled():
        print(f"\nrollout throughput (load average {os.getloadavg()[0]:.1f}), tiny Qwen3-MoE ({sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M params), "
              f"prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, {torch.get_num_threads()} threads, median of {REPEATS}:")
        for k in rows:
            print(f"  {k:14s} {med[k]:8.0f} tok/s   (best {best[k]:.0f})")
        print(f"  ours b8 (capture) / transformers b8: {med['ours_b8_cap'] / med['hf_b8']:.2f}x  (target >= 2x)")
        print(f"  ours b8 (capture) / transformers b8 on one thread: {med['ours_b8_cap'] / med['hf_b8_1thread']:.2f}x")
        print(f"  engine time in model.extend: {100 * stats['model_s'] / stats['step_s']:.0f}% of step time "
              f"(the rest: batching, sampling, bookkeeping)")
        print(f"  ours b1 / transformers b1:           {med['ours_b1'] / med['hf_b1']:.2f}x")
        overhead = best["ours_b8_nocap"] / best["ours_b8_cap"] - 1
        cpu_overhead = max(cpu[False]) / max(cpu[True]) - 1
        capture_share = stats["capture_s"] / (stats["step_s"] - stats["capture_s"])
        print(f"  routing capture overhead, batch 8 (best of {2 * REPEATS}): wall {100 * overhead:+.1f}%, "
              f"CPU time {100 * cpu_overhead:+.1f}%  (target <= 3%)")
        inv_ratio = statistics.median(inv_cpu["invariant"]) / statistics.median(inv_cpu["default"])
        print(f"  batch-invariant / default b8 (capture), wall: {med['ours_b8_invariant'] / med['ours_b8_cap']:.2f}x, "
              f"CPU time interleaved (median of {2 * REPEATS}): {inv_ratio:.2f}x  (target >= 0.8x)")
        print(f"  routing capture cost measured inside the engine (timed code path, load-independent): "
              f"{100 * capture_share:.2f}% of the rest of the step time")
