"""Standalone GPU check of kernels.logprob on CUDA: correctness against a float64 reference, determinism, then
fwd+bwd throughput and memory at N=8192, D=4096, V=151,936 (bf16) against the plain LM-head matmul.

Run from the repository root:  python bench/gpu_check_logprob.py [--quick]
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
from kernels.logprob import token_logprobs  # noqa: E402
from kernels.logprob_torch import reference_token_logprobs  # noqa: E402

# (N, D, V, dtype, temperature). fp32 runs use input_precision="ieee", so they are held to fp32 tolerances.
CHECK_CASES = [
    (7, 64, 50_257, torch.float32, 0.6),
    (300, 512, 151_936, torch.float32, 1.0),
    (1000, 1024, 151_936, torch.bfloat16, 1.3),
    (129, 4096, 32_003, torch.bfloat16, 1.0),
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


def measure_throughput(N: int = 8192, D: int = 4096, V: int = 151_936, dtype: torch.dtype = torch.bfloat16,
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


# (BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages) for bf16 on the GPU; the first is kernels.logprob_triton's.
SWEEP = [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 4),
         (128, 256, 128, 8, 2)]


def sweep_configs(N: int = 8192, D: int = 4096, V: int = 151_936, *, iters: int = 3) -> list[dict]:
    """Per tile configuration (bf16): the forward kernel alone, the backward's dz kernel alone (no GEMMs), and
    token_logprobs fwd+bwd with that tile in both kernels, against the LM-head matmul's FLOPs."""
    from kernels import logprob_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, D, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, D, generator=g, device="cuda") * D**-0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g, device="cuda")
    g_N = torch.randn(N, generator=g, device="cuda")
    flops = 3 * 2 * N * D * V
    base = logprob_triton._config
    kw = dict(temperature=1.0, ignore_index=-100)
    rows = []
    for bn, bv, bd, warps, stages in SWEEP:
        cfg = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, DOT_PRECISION="tf32", num_warps=warps, num_stages=stages,
                   vocab_per_split=8192)
        logprob_triton._config = lambda dtype, kernel="fwd", cfg=cfg: dict(cfg)
        try:
            with torch.no_grad():
                _, _, lse, mz = logprob_triton.triton_logprob_fwd(hidden, weight, targets, with_entropy=False, **kw)

                def fwd() -> None:
                    logprob_triton.triton_logprob_fwd(hidden, weight, targets, with_entropy=False, **kw)

                def dz_only(lse=lse, mz=mz) -> None:
                    logprob_triton.triton_logprob_bwd(hidden, weight, targets, lse, mz, g_N, None,
                                                      need_hidden=False, need_weight=False, **kw)

                ms_f, ms_dz = _time_ms(fwd, iters=iters), _time_ms(dz_only, iters=iters)

            def fwd_bwd() -> None:
                hidden.grad = weight.grad = None
                (token_logprobs(hidden, weight, targets) * g_N).sum().backward()
                hidden.grad = weight.grad = None

            ms_fb = _time_ms(fwd_bwd, iters=iters)
            rows.append(dict(check="sweep", config=[bn, bv, bd, warps, stages], fwd_kernel_ms=round(ms_f, 3),
                             dz_kernel_ms=round(ms_dz, 3), fwd_bwd_ms=round(ms_fb, 3),
                             lm_head_equiv_tflops=round(flops / ms_fb / 1e9, 1)))
        except Exception as e:  # a tile that does not fit shared memory / registers: report and go on
            rows.append(dict(check="sweep", config=[bn, bv, bd, warps, stages],
                             error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
        finally:
            logprob_triton._config = base
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness only, no throughput")
    parser.add_argument("--sweep", action="store_true", help="also time a few tile configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps(dict(error="no CUDA device")))
        return 1
    import triton
    print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                          triton=triton.__version__)))
    rows = check_correctness()
    for row in rows:
        print(json.dumps(row), flush=True)
    if not args.quick:
        for row in measure_throughput():
            print(json.dumps(row), flush=True)
        if args.sweep:
            sweep_configs()
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
