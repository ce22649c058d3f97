"""Fused MoE dispatch throughput: the torch path vs a naive loop on CPU; Triton vs torch (and vLLM) on GPU.

Run: `python -m pytest bench/test_bench_moe.py -q -s`. Each test gates on correctness first, then prints one
row per (op, shape, provider): time, throughput, device, versions, git sha. Never asserts on speed.
FLOPs counted: forward 6*T*K*D*F (up 4, down 2); forward+backward 18*T*K*D*F (the recompute of the up
projection in backward is not counted, as is usual for model FLOPs).
Targets on H200 (issue 7): forward at least vLLM's fused_experts; forward+backward >= 300 TFLOP/s.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from t1kernels.moe import fused_moe
from t1kernels.moe_torch import moe_bwd, moe_fwd, moe_loop_reference

# Qwen3-30B-A3B is D 2048, F 768, E 128, K 8; CPU runs it scaled down.
CPU_SHAPE = dict(T=512, D=256, F=96, E=32, K=4)
GPU_SHAPE = dict(T=8192, D=2048, F=768, E=128, K=8)


def _git_sha() -> str:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _problem(T: int, D: int, F: int, E: int, K: int, *, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    w13 = (torch.randn(E, 2 * F, D, generator=gen) / D ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, D, F, generator=gen) / F ** 0.5).to(device, dtype)
    logits = torch.randn(T, E, generator=gen)
    ids = torch.topk(logits, K, dim=-1).indices.to(device)
    w = torch.softmax(logits.gather(1, ids.cpu()), -1).to(device)
    dy = torch.randn(T, D, generator=gen).to(device, dtype)
    return x, w13, w2, ids, w, dy


def _flops(T: int, D: int, F: int, K: int, mode: str, **_) -> float:
    return (6 if mode == "fwd" else 18) * T * K * D * F


def _row(capsys, *, provider: str, mode: str, shape: dict, seconds: float, dtype: torch.dtype, device: str,
         unit: str) -> None:
    scale = 1e9 if unit == "GFLOP/s" else 1e12
    tput = _flops(mode=mode, **shape) / seconds / scale
    dev = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    shp = ",".join(f"{k}={v}" for k, v in shape.items())
    versions = f"torch={torch.__version__}"
    with capsys.disabled():
        print(f"\nfused_moe | {shp} {str(dtype).removeprefix('torch.')} | {provider:>6} {mode:>8} | "
              f"{seconds * 1e3:9.3f} ms | {tput:8.2f} {unit} | {dev} | {versions} | {_git_sha()}")


def _cpu_fn(provider: str, mode: str, x, w13, w2, ids, w, dy):
    if provider == "loop":
        if mode == "fwd":
            return lambda: moe_loop_reference(x, w13, w2, ids, w)
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        return lambda: torch.autograd.grad(moe_loop_reference(leaves[0], leaves[1], leaves[2], ids, leaves[3]),
                                           leaves, dy)
    if mode == "fwd":
        return lambda: moe_fwd(x, w13, w2, ids, w)
    return lambda: (moe_fwd(x, w13, w2, ids, w), moe_bwd(dy, x, w13, w2, ids, w))


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("provider", ["torch", "loop"])
def test_bench_moe_cpu(provider: str, mode: str, benchmark, capsys) -> None:
    x, w13, w2, ids, w, dy = _problem(**CPU_SHAPE, dtype=torch.float32, device="cpu")
    # Gate: the torch path matches the fp64 loop reference before anything is timed.
    ref = moe_loop_reference(*(t.double() for t in (x, w13, w2)), ids, w.double())
    torch.testing.assert_close(moe_fwd(x, w13, w2, ids, w).double(), ref, rtol=1e-4, atol=1e-5)
    fn = _cpu_fn(provider, mode, x, w13, w2, ids, w, dy)
    benchmark.pedantic(fn, rounds=5, warmup_rounds=1)
    _row(capsys, provider=provider, mode=mode, shape=CPU_SHAPE, seconds=benchmark.stats.stats.median,
         dtype=torch.float32, device="cpu", unit="GFLOP/s")


def _cuda_seconds(fn, *, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _vllm_fused_experts():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError:
        return None
    return fused_experts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("provider", ["triton", "torch", "vllm"])
def test_bench_moe_gpu(provider: str, mode: str, benchmark, capsys, monkeypatch) -> None:
    x, w13, w2, ids, w, dy = _problem(**GPU_SHAPE, dtype=torch.bfloat16, device="cuda")
    ref = moe_fwd(x, w13, w2, ids, w)  # torch path on CUDA tensors: bf16 matmuls, fp32 combine
    if provider == "vllm":
        fused_experts = _vllm_fused_experts()
        if fused_experts is None or mode != "fwd":
            pytest.skip("vLLM not installed" if fused_experts is None else "vLLM fused_experts is forward-only")
        fn = lambda: fused_experts(x, w13, w2, w, ids.to(torch.int32))  # noqa: E731
    else:
        monkeypatch.setenv("T1_KERNEL_BACKEND", provider)
        leaves = [t.clone().requires_grad_(mode != "fwd") for t in (x, w13, w2, w)]
        if mode == "fwd":
            fn = lambda: fused_moe(x, w13, w2, ids, w, validate=False)  # noqa: E731
        else:
            fn = lambda: torch.autograd.grad(  # noqa: E731
                fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3], validate=False), leaves, dy)
    got = fn() if mode == "fwd" else fused_moe(x, w13, w2, ids, w)
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert err < 2e-2, f"{provider}: relative max error {err:.3e} vs the torch path"  # bf16 rounding
    seconds = _cuda_seconds(fn)
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=3, warmup_rounds=0)
    _row(capsys, provider=provider, mode=mode, shape=GPU_SHAPE, seconds=seconds, dtype=torch.bfloat16,
         device="cuda", unit="TFLOP/s")


def test_bench_moe_cpu_loop_vs_torch_ratio(capsys) -> None:
    """Side by side in one test (same load from other processes): the torch path's speed-up over the loop."""
    x, w13, w2, ids, w, dy = _problem(**CPU_SHAPE, dtype=torch.float32, device="cpu")
    for mode in ("fwd", "fwd+bwd"):
        best = {}
        for provider in ("torch", "loop"):
            fn = _cpu_fn(provider, mode, x, w13, w2, ids, w, dy)
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            best[provider] = min(times)
        with capsys.disabled():
            print(f"\nfused_moe cpu {mode}: torch path {best['torch'] * 1e3:.2f} ms, loop {best['loop'] * 1e3:.2f} ms,"
                  f" speed-up x{best['loop'] / best['torch']:.2f}")
