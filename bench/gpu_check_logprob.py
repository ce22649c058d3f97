"""Standalone GPU check of t1kernels.logprob on CUDA: correctness against a float64 reference (one case with several
backward chunks, whose d_hidden accumulates in fp32 inside the GEMM), determinism, then fwd+bwd throughput and
memory at the production shape (default N=65,536, D=2048, V=151,936, bf16) against the plain LM-head matmul:
with the entropy gradient, and as the trainer runs it with entropy coefficient 0 (entropy computed, no gradient).

Run from the repository root:  python bench/gpu_check_logprob.py [--quick] [--N 65536] [--D 2048] [--dry-run]
Prints one JSON object per line; exits 1 if any correctness check fails (throughput is reported, never gated).
bench/test_bench_logprob.py reuses `measure_throughput` for its GPU section.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from t1kernels.logprob import token_logprobs  # noqa: E402
from t1kernels.logprob_torch import reference_token_logprobs  # noqa: E402

# (N, D, V, dtype, temperature). fp32 runs use input_precision="ieee", so they are held to fp32 tolerances.
CHECK_CASES = [
    (7, 64, 50_257, torch.float32, 0.6),
    (300, 512, 151_936, torch.float32, 1.0),
    (1000, 1024, 151_936, torch.bfloat16, 1.3),
    (129, 4096, 32_003, torch.bfloat16, 1.0),
    (16_384, 1024, 32_003, torch.bfloat16, 1.0),  # 4 backward chunks of the 256 MiB scratch
]
# Value tolerance is relative to 1 + |ref|; gradient tolerance is max-abs error over max-abs reference.
# bf16 gradients pass through a bf16 dz and bf16 GEMM outputs (8-bit mantissa), hence 2e-2.
TOLS = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-3, 2e-2)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _make(N: int, D: int, V: int, dtype: torch.dtype, seed: int, device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, device=device).to(dtype)
    weight = (torch.randn(V, D, generator=g, device=device) * (4 / D**0.5)).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g, device=device)
    targets[::5] = -100
    return hidden, weight, targets, torch.randn(N, generator=g, device=device), torch.randn(N, generator=g,
                                                                                           device=device)


def _fwd_bwd(fn: Callable, hidden, weight, targets, g_logp, g_ent, temperature, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = fn(h, w, targets, temperature=temperature, **kw)
    ((logp * g_logp.to(logp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def check_correctness() -> list[dict]:
    rows = []
    for i, (N, D, V, dtype, temp) in enumerate(CHECK_CASES):
        args = _make(N, D, V, dtype, seed=i)
        ours = _fwd_bwd(token_logprobs, *args, temp, return_entropy=True)
        again = _fwd_bwd(token_logprobs, *args, temp, return_entropy=True)
        ref = _fwd_bwd(reference_token_logprobs, *args, temp, dtype=torch.float64)
        vt, gt = TOLS[dtype]
        errs = dict(logp=float(((ours[0].double() - ref[0]).abs() / (1 + ref[0].abs())).max()),
                    entropy=float(((ours[1].double() - ref[1]).abs() / (1 + ref[1].abs())).max()),
                    d_hidden=_rel(ours[2], ref[2]), d_weight=_rel(ours[3], ref[3]))
        ok = errs["logp"] < vt and errs["entropy"] < vt and errs["d_hidden"] < gt and errs["d_weight"] < gt
        deterministic = all(torch.equal(a, b) for a, b in zip(ours, again))
        ignored = args[2] == -100
        zero_ignored = bool(ours[0][ignored].eq(0).all() and ours[2][ignored].eq(0).all())
        rows.append(dict(check="correctness", shape=[N, D, V], dtype=str(dtype), temperature=temp, **errs,
                         deterministic=deterministic, ignored_rows_zero=zero_ignored,
                         ok=bool(ok and deterministic and zero_ignored)))
        del ours, again, ref, args
        torch.cuda.empty_cache()
    return rows


def _time_ms(fn: Callable[[], None], *, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()  # sync: timing boundary
    return start.elapsed_time(end) / iters


def _peak_extra_bytes(fn: Callable[[], None]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _with_entropy(hidden, weight, targets, g_N, *, entropy_grad: bool) -> None:
    """logp and entropy forward; backward through both, or (the trainer at entropy coefficient 0) logp only."""
    logp, ent = token_logprobs(hidden, weight, targets, return_entropy=True)
    loss = (logp * g_N).sum()
    (loss + (ent * g_N).sum() if entropy_grad else loss).backward()


def _providers(hidden, weight, targets, g_N, g_NV) -> dict[str, Callable[[], None]]:
    """fwd+bwd closures. Gradients are dropped after each call so memory does not build up."""
    def step(backward: Callable[[], None]) -> Callable[[], None]:
        def go() -> None:
            hidden.grad = weight.grad = None
            backward()
            hidden.grad = weight.grad = None
        return go

    providers = {
        # The baseline: materialised [N, V] logits, backward with a given [N, V] upstream gradient.
        "lm_head_matmul": step(lambda: (hidden @ weight.T).backward(g_NV)),
        "t1_token_logprobs": step(lambda: (token_logprobs(hidden, weight, targets) * g_N).sum().backward()),
        "t1_logprobs_entropy_grad": step(lambda: _with_entropy(hidden, weight, targets, g_N, entropy_grad=True)),
        "t1_logprobs_entropy_metric": step(lambda: _with_entropy(hidden, weight, targets, g_N, entropy_grad=False)),
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        providers["liger_flce"] = step(lambda: liger(weight, hidden, targets).backward())
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy
        providers["cut_cross_entropy"] = step(
            lambda: linear_cross_entropy(hidden, weight, targets, reduction="sum").backward())
    except ImportError:
        pass
    return providers


def measure_throughput(N: int = 65_536, D: int = 2048, V: int = 151_936, dtype: torch.dtype = torch.bfloat16,
                       *, iters: int = 5) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, D, generator=g, device="cuda").to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g, device="cuda") * D**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g, device="cuda")
    g_N = torch.randn(N, generator=g, device="cuda")
    g_NV = torch.randn(N, V, generator=g, device="cuda", dtype=dtype)  # the matmul baseline's upstream grad
    flops = 3 * 2 * N * D * V  # logits, d_hidden, d_weight
    rows = []
    providers = _providers(hidden, weight, targets, g_N, g_NV)
    base_ms = None
    for name, fn in providers.items():
        ms = _time_ms(fn, iters=iters)
        mem = _peak_extra_bytes(fn)
        base_ms = ms if name == "lm_head_matmul" else base_ms
        rows.append(dict(check="throughput", provider=name, shape=[N, D, V], dtype=str(dtype), ms=round(ms, 3),
                         lm_head_equiv_tflops=round(flops / ms / 1e9, 1), peak_extra_gib=round(mem / 2**30, 3),
                         fraction_of_matmul=round(base_ms / ms, 3) if base_ms else None,
                         device=torch.cuda.get_device_name(), torch=torch.__version__))
    del g_NV
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only, no throughput")
    parser.add_argument("--N", type=int, default=65_536, help="rows of the throughput run")
    parser.add_argument("--D", type=int, default=2048, help="model dim of the throughput run")
    parser.add_argument("--V", type=int, default=151_936, help="vocabulary of the throughput run")
    parser.add_argument("--json-out", help="append every JSON row to this file too")
    parser.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit (no GPU needed)")
    args = parser.parse_args()
    if min(args.N, args.D, args.V) < 1:
        parser.error(f"--N/--D/--V: expected positive ints, got {args.N}/{args.D}/{args.V}")
    plan = dict(script="logprob", checks=[[N, D, V, str(dt), t] for N, D, V, dt, t in CHECK_CASES],
                throughput=None if args.quick else dict(N=args.N, D=args.D, V=args.V, dtype="torch.bfloat16",
                                                        entropy=True))
    print(json.dumps(plan), flush=True)
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print(json.dumps(dict(error="no CUDA device")))
        return 1
    import triton
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the trainer runs

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(row) + "\n")

    emit(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__))
    rows = check_correctness()
    for row in rows:
        emit(row)
    if not args.quick:
        for row in measure_throughput(args.N, args.D, args.V):
            emit(row)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
