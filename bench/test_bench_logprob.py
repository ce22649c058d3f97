"""Benchmarks for t1kernels.logprob.token_logprobs (run: pytest bench/test_bench_logprob.py -s).

CPU: the chunked torch path against the materialising fp32 reference, fwd+bwd time and peak extra memory
(peak RSS of a fresh subprocess, minus its baseline and the gradients). GPU (skipped without CUDA): fwd+bwd at
N=8192, D=4096, V=151,936 in bf16 as a fraction of the plain LM-head matmul fwd+bwd, with Liger /
cut-cross-entropy when importable (bench/gpu_check_logprob.py does the work). Correctness gates every timing.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from t1kernels.logprob import token_logprobs
from t1kernels.logprob_torch import reference_token_logprobs

ROOT = Path(__file__).resolve().parents[1]
CPU_SHAPE = (256, 256, 151_936)  # N, D, V: the reference's [N, V] fp32 logits are 148 MiB


def _git_sha() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _peak_extra_mib(N: int, D: int, V: int, provider: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "test_logprob.py"), "--memory", str(N), str(D),
                           str(V), provider], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["extra_bytes"] / 2**20


def _inputs(N: int, D: int, V: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g).to(device).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(device).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g).to(device)
    return hidden, weight, targets


@pytest.mark.parametrize("provider", ["chunked", "materialising"])
def test_bench_cpu_fwd_bwd(benchmark, capsys, provider: str) -> None:
    N, D, V = CPU_SHAPE
    hidden, weight, targets = _inputs(N, D, V)
    with torch.no_grad():
        ours = token_logprobs(hidden, weight, targets)
        ref, _ = reference_token_logprobs(hidden, weight, targets, dtype=torch.float64)
    err = float(((ours.double() - ref).abs() / (1 + ref.abs())).max())
    assert err < 1e-4, f"correctness gate failed: max rel error {err}"

    def step() -> None:
        hidden.grad = weight.grad = None
        if provider == "chunked":
            logp = token_logprobs(hidden, weight, targets)
        else:
            logp, _ = reference_token_logprobs(hidden, weight, targets, dtype=torch.float32)
        logp.sum().backward()

    benchmark.pedantic(step, rounds=2, iterations=1, warmup_rounds=1)
    if benchmark.stats is not None:
        seconds = benchmark.stats.stats.median
    else:  # --benchmark-disable: pedantic ran step once, untimed; time one more run here
        t0 = time.perf_counter()
        step()
        seconds = time.perf_counter() - t0
    mib = _peak_extra_mib(N, D, V, provider)
    row = dict(op="token_logprobs_fwd_bwd", shape=[N, D, V], dtype="float32", provider=provider,
               median_s=round(seconds, 4), gflops=round(3 * 2 * N * D * V / seconds / 1e9, 1),
               peak_extra_mib=round(mib, 1), device=platform.processor() or "cpu", threads=torch.get_num_threads(),
               torch=torch.__version__, git=_git_sha())
    with capsys.disabled():
        print("\n" + json.dumps(row))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_gpu_fraction_of_lm_head_matmul(capsys) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check_logprob

    rows = gpu_check_logprob.check_correctness()
    assert all(r["ok"] for r in rows), rows
    rows += gpu_check_logprob.measure_throughput()
    with capsys.disabled():
        for r in rows:
            print("\n" + json.dumps(dict(r, git=_git_sha())))
