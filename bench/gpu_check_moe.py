"""Standalone GPU check of the Triton fused MoE (t1kernels.moe): correctness, no host sync, determinism, speed.

Run on an H100/H200 (bench/gpu_run.sh runs it as one part of the device check):
    python bench/gpu_check_moe.py [--shapes 30b,122b] [--routings uniform,skewed] [--iters 10] [--big]
        [--json-out FILE] [--dry-run]
  1. fp32 Triton (IEEE dots) vs the fp64 loop reference on awkward shapes: forward and all four gradients.
  2. bf16 Triton vs an fp32 reference (the torch path on fp32 copies of the same bf16 inputs).
  3. No host synchronisation inside fused_moe(validate=False) forward+backward (torch sync debug mode), with
     deterministic mode on (torch.use_deterministic_algorithms: the kernels' scratch skips its NaN fill).
  4. Determinism: two forward+backward runs give identical bits, also under skewed routing (split weight
     gradients); recompute=True gives the same bits.
  5. --big: int64 offsets, x with more than 2^31 elements (about 45 GB of GPU memory).
  6. TFLOP/s of forward and forward+backward per production shape (30b: Qwen3-30B-A3B, T=8192, D=2048, F=768,
     E=128, K=8; 122b: a 122B-class MoE, T=16384, D=4096, F=1536, E=256, K=8) and routing (uniform: random
     top-k; skewed: every token's K experts among the first 2K, as replayed routing can be), with per-kernel times.
--dry-run prints the plan (shapes, routings, checks) as JSON without touching a GPU. Exits 1 when a check fails.
FLOPs: forward 6*T*K*D*F, forward+backward 18*T*K*D*F.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from t1kernels import moe_triton, moe_triton_bwd  # noqa: E402
from t1kernels.moe import fused_moe  # noqa: E402
from t1kernels.moe_torch import moe_bwd, moe_fwd, moe_loop_reference  # noqa: E402

FAILURES: list[str] = []


def _problem(T, D, F, E, K, *, dtype, seed=0, mode="random"):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, generator=gen, device="cuda")
    w13 = torch.randn(E, 2 * F, D, generator=gen, device="cuda") / D ** 0.5
    w2 = torch.randn(E, D, F, generator=gen, device="cuda") / F ** 0.5
    logits = torch.randn(T, E, generator=gen, device="cuda")
    if mode == "one_expert":
        logits[:, 0] += 100.0
    if mode == "skewed":
        logits[:, : 2 * K] += 100.0
    ids = torch.topk(logits, K, dim=-1).indices
    w = torch.softmax(logits.gather(1, ids), -1)
    dy = torch.randn(T, D, generator=gen, device="cuda")
    return [t.to(dtype) for t in (x, w13, w2)] + [ids, w, dy.to(dtype)]


def _triton_fwd_bwd(x, w13, w2, ids, w, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, w)]
    y = fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3], validate=False)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy))


def _report(name: str, got: torch.Tensor, ref: torch.Tensor, *, max_rel: float, norm_rel: float) -> None:
    got, ref = got.double(), ref.double()
    finite = bool(torch.isfinite(got).all())
    mr = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    nr = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    ok = finite and mr <= max_rel and nr <= norm_rel
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<8} max_rel {mr:.2e} (<= {max_rel:.0e})  norm_rel {nr:.2e} "
          f"(<= {norm_rel:.0e}){'' if finite else '  NON-FINITE'}")
    if not ok:
        FAILURES.append(name)


SHAPES = [(37, 24, 20, 8, 3, "random"), (5, 64, 64, 8, 2, "random"), (300, 128, 96, 4, 4, "random"),
          (333, 256, 192, 64, 8, "random"), (200, 64, 64, 6, 1, "random"), (1000, 128, 64, 16, 1, "one_expert"),
          (517, 128, 128, 32, 5, "skewed"), (4099, 512, 384, 128, 8, "random")]


def check_fp32() -> None:
    print("fp32 Triton vs fp64 loop reference (max_rel <= 1e-4)")
    for T, D, F, E, K, mode in SHAPES:
        x, w13, w2, ids, w, dy = _problem(T, D, F, E, K, dtype=torch.float32, mode=mode)
        got = _triton_fwd_bwd(x, w13, w2, ids, w, dy)
        leaves = [t.double().requires_grad_() for t in (x, w13, w2, w)]
        y = moe_loop_reference(leaves[0], leaves[1], leaves[2], ids, leaves[3])
        refs = (y.detach(), *torch.autograd.grad(y, leaves, dy.double()))
        print(f" T={T} D={D} F={F} E={E} K={K} {mode}")
        for name, g, r in zip(("y", "dx", "dw13", "dw2", "dw"), got, refs):
            _report(name, g, r, max_rel=1e-4, norm_rel=1e-5)


def check_bf16(T=8192, D=2048, F=768, E=128, K=8) -> None:
    print(f"bf16 Triton vs fp32 torch path on the same inputs, T={T} D={D} F={F} E={E} K={K}")
    x, w13, w2, ids, w, dy = _problem(T, D, F, E, K, dtype=torch.bfloat16)
    got = _triton_fwd_bwd(x, w13, w2, ids, w, dy)
    f32 = [t.float() for t in (x, w13, w2)]
    refs = (moe_fwd(*f32, ids, w), *moe_bwd(dy.float(), *f32, ids, w))
    for name, g, r in zip(("y", "dx", "dw13", "dw2", "dw"), got, refs):
        _report(name, g, r, max_rel=5e-2, norm_rel=1e-2)  # bf16 operands and stored intermediates


def check_no_sync_and_determinism(mode: str = "random") -> None:
    print(f"no host sync / determinism / recompute, routing {mode}")
    x, w13, w2, ids, w, dy = _problem(4096, 1024, 512, 64, 8, dtype=torch.bfloat16, mode=mode)
    _triton_fwd_bwd(x, w13, w2, ids, w, dy)  # compile outside the checked region
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            a = _triton_fwd_bwd(x, w13, w2, ids, w, dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch warns "called a synchronizing CUDA operation" per sync (its one-off note about the debug mode being a
    # prototype is not one).
    syncs = [str(c.message).splitlines()[0] for c in caught if "called a synchronizing" in str(c.message)]
    print(f"host syncs inside fused_moe fwd+bwd: {len(syncs)} {'ok' if not syncs else 'FAIL'} {syncs[:3]}")
    if syncs:
        FAILURES.append("no-sync")
    b = _triton_fwd_bwd(x, w13, w2, ids, w, dy)
    same = all(torch.equal(p, q) for p, q in zip(a, b))
    print(f"deterministic (two runs bitwise equal): {'ok' if same else 'FAIL'}")
    if not same:
        FAILURES.append("determinism")
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, w)]
    y = fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3], validate=False, recompute=True)
    c = (y.detach(), *torch.autograd.grad(y, leaves, dy))
    same = all(torch.equal(p, q) for p, q in zip(a, c))
    print(f"recompute=True gives the same bits as the saved forward: {'ok' if same else 'FAIL'}")
    if not same:
        FAILURES.append("recompute")


def check_big() -> None:
    T, D, F, E, K = 2 ** 20 + 4096, 2048, 64, 8, 2  # x: 2.16e9 elements > 2^31
    print(f"int64 offsets: T={T} D={D} F={F} E={E} K={K} bf16 (x has {T * D / 2 ** 31:.3f} x 2^31 elements)")
    x, w13, w2, ids, w, dy = _problem(T, D, F, E, K, dtype=torch.bfloat16)
    y, dx, *_ = _triton_fwd_bwd(x, w13, w2, ids, w, dy)
    tail = slice(T - 4096, T)
    f32 = [t.float() for t in (x[tail], w13, w2)]
    _report("y tail", y[tail], moe_fwd(*f32, ids[tail], w[tail]), max_rel=5e-2, norm_rel=1e-2)
    _report("dx tail", dx[tail], moe_bwd(dy[tail].float(), *f32, ids[tail], w[tail])[0], max_rel=5e-2,
            norm_rel=1e-2)


def _seconds(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _flops(T, D, F, K) -> int:
    return 6 * T * K * D * F  # forward; the backward counts twice that (recomputing h is not counted)


def bench(iters: int, *, T=8192, D=2048, F=768, E=128, K=8, mode: str = "random", label: str = "",
          details: bool = True) -> dict[str, float]:
    """Times and TFLOP/s of one shape and routing; `details` adds per-kernel times and the reference points."""
    x, w13, w2, ids, w, dy = _problem(T, D, F, E, K, dtype=torch.bfloat16, mode=mode)
    flops = _flops(T, D, F, K)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]

    def fwd():
        return fused_moe(x, w13, w2, ids, w, validate=False)

    def fwd_bwd(recompute=False):
        return torch.autograd.grad(fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3], validate=False,
                                             recompute=recompute), leaves, dy)

    tf, tfb = _seconds(fwd, iters), _seconds(fwd_bwd, iters)
    tfr = _seconds(lambda: fwd_bwd(recompute=True), iters)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(recompute=True)
    peak_r = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"triton {label}: fwd {tf * 1e3:.3f} ms {flops / tf / 1e12:.1f} TFLOP/s | fwd+bwd {tfb * 1e3:.3f} ms "
          f"{3 * flops / tfb / 1e12:.1f} TFLOP/s (peak extra {peak:.2f} GiB) | bwd alone "
          f"{2 * flops / (tfb - tf) / 1e12:.1f} TFLOP/s | fwd+bwd recompute=True {tfr * 1e3:.3f} ms "
          f"{3 * flops / tfr / 1e12:.1f} TFLOP/s (peak extra {peak_r:.2f} GiB)", flush=True)
    result = {"fwd_tflops": flops / tf / 1e12, "fwd_bwd_tflops": 3 * flops / tfb / 1e12,
              "fwd_bwd_recompute_tflops": 3 * flops / tfr / 1e12, "fwd_ms": tf * 1e3, "fwd_bwd_ms": tfb * 1e3,
              "peak_extra_gib": peak, "peak_extra_recompute_gib": peak_r}
    if not details:
        return result
    cfg = moe_triton.moe_config(x.dtype)
    al = moe_triton.align_by_expert(ids, E, cfg.block_m)
    h, act = moe_triton._up(x, w13, al, cfg, store_h=True, store_act=True, fill=None)
    o = moe_triton._rows_gemm(act, w2, w2.stride(), D, w, al, cfg, cfg.down, x.dtype, None)
    saved = moe_triton.MoESavedTriton(al, h)
    chunks = moe_triton_bwd.dw_chunks(al, cfg)
    bwd = moe_triton_bwd
    parts = {"align": lambda: moe_triton.align_by_expert(ids, E, cfg.block_m),
             "up+swiglu": lambda: moe_triton._up(x, w13, al, cfg, store_h=False, store_act=True, fill=None),
             "up (h and act)": lambda: moe_triton._up(x, w13, al, cfg, store_h=True, store_act=True, fill=None),
             "down": lambda: moe_triton._rows_gemm(act, w2, w2.stride(), D, w, al, cfg, cfg.down, x.dtype, None),
             "combine": lambda: moe_triton._combine(o, al, T, x.dtype, cfg),
             "dact": lambda: bwd._dact(dy, w2, h, w, al, cfg),
             "dw chunks": lambda: bwd.dw_chunks(al, cfg),
             "dw2+dw13": lambda: (bwd._dw2(dy, h, w, al, chunks, cfg, w2), bwd._dw13(h, x, al, chunks, cfg, w13)),
             "backward (saved)": lambda: bwd.moe_bwd_triton(dy, x, w13, w2, ids, w, saved=saved),
             "backward (recompute)": lambda: bwd.moe_bwd_triton(dy, x, w13, w2, ids, w)}
    print("  per part: " + ", ".join(f"{k} {_seconds(f, iters) * 1e3:.3f} ms" for k, f in parts.items()))
    tt = _seconds(lambda: moe_fwd(x, w13, w2, ids, w), max(3, iters // 4))
    print(f"torch path: fwd {tt * 1e3:.3f} ms {flops / tt / 1e12:.1f} TFLOP/s")
    grouped_mm_baseline(x, w13, w2, ids, w, dy, iters, flops)
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError as e:
        print(f"vLLM fused_experts not importable ({e})")
        return result
    ref = fwd()
    out = fused_experts(x, w13, w2, w, ids.to(torch.int32))
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    tv = _seconds(lambda: fused_experts(x, w13, w2, w, ids.to(torch.int32)), iters)
    print(f"vLLM fused_experts: fwd {tv * 1e3:.3f} ms {flops / tv / 1e12:.1f} TFLOP/s (norm_rel vs ours {err:.1e})")
    return result


def grouped_mm_baseline(x, w13, w2, ids, w, dy, iters: int, flops: int) -> None:
    """The same MoE through torch._grouped_mm (cuBLAS/CUTLASS grouped GEMM, as torchtitan uses), autograd for the
    backward: a vendor-kernel reference point where vLLM is not installed."""
    if not hasattr(torch, "_grouped_mm"):
        print("torch._grouped_mm: not in this torch")
        return
    T, K = ids.shape
    E, F = w13.shape[0], w13.shape[1] // 2

    def run(x, w13, w2, w):
        order = torch.argsort(ids.flatten(), stable=True)
        offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=E), 0).to(torch.int32)
        xs = x[order // K]
        h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
        a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
        o = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs) * w.flatten()[order, None].to(a.dtype)
        return torch.zeros_like(x).index_add_(0, order // K, o)

    try:
        ref = fused_moe(x, w13, w2, ids, w, validate=False)
        err = ((run(x, w13, w2, w).float() - ref.float()).norm() / ref.float().norm()).item()
        tg = _seconds(lambda: run(x, w13, w2, w), iters)
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
        tgb = _seconds(lambda: torch.autograd.grad(run(*leaves), leaves, dy), iters)
        print(f"torch._grouped_mm: fwd {tg * 1e3:.3f} ms {flops / tg / 1e12:.1f} TFLOP/s | fwd+bwd {tgb * 1e3:.3f} ms "
              f"{3 * flops / tgb / 1e12:.1f} TFLOP/s (norm_rel vs ours {err:.1e})", flush=True)
    except Exception as e:  # an unsupported dtype/arch/alignment: report, it is only a reference point
        print(f"torch._grouped_mm baseline failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


SHAPES_BENCH = {"30b": dict(T=8192, D=2048, F=768, E=128, K=8), "122b": dict(T=16384, D=4096, F=1536, E=256, K=8)}
ROUTINGS = {"uniform": "random", "skewed": "skewed"}


def plan(args: argparse.Namespace) -> dict:
    """What this run will do (printed by --dry-run, and first in every run's log)."""
    shapes = _pick(args.shapes, SHAPES_BENCH, "--shapes")
    routings = _pick(args.routings, ROUTINGS, "--routings")
    checks = ["fp32 vs fp64 loop reference", "bf16 vs fp32 torch path", "no host sync (deterministic mode)",
              "determinism uniform", "determinism skewed", "recompute same bits"] + (["int64 offsets"] if args.big
                                                                                     else [])
    return {"script": "moe", "checks": checks, "iters": args.iters,
            "bench": [{"shape": s, "routing": r, **SHAPES_BENCH[s], "gflop_fwd_bwd": 3 * _flops(
                SHAPES_BENCH[s]["T"], SHAPES_BENCH[s]["D"], SHAPES_BENCH[s]["F"], SHAPES_BENCH[s]["K"]) / 1e9}
                      for s in shapes for r in routings]}


def _pick(csv: str, known: dict, flag: str) -> list[str]:
    names = [n for n in csv.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"{flag}: expected a comma-separated subset of {sorted(known)}, got {csv!r}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", action="store_true", help="int64 offset check (about 45 GB of GPU memory)")
    ap.add_argument("--shapes", default="30b,122b", help=f"benchmark shapes, subset of {sorted(SHAPES_BENCH)}")
    ap.add_argument("--routings", default="uniform,skewed", help=f"benchmark routings, subset of {sorted(ROUTINGS)}")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json-out", help="append one JSON line per benchmark row to this file")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit (no GPU needed)")
    args = ap.parse_args()
    if args.iters < 1:
        ap.error(f"--iters: expected >= 1, got {args.iters}")
    the_plan = plan(args)
    print(json.dumps(the_plan), flush=True)
    if args.dry_run:
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the trainer runs
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {moe_triton.triton.__version__}")
    check_fp32()
    check_bf16()
    check_no_sync_and_determinism("random")
    check_no_sync_and_determinism("skewed")
    if args.big:
        check_big()
    for row in the_plan["bench"]:
        r = bench(args.iters, **SHAPES_BENCH[row["shape"]], mode=ROUTINGS[row["routing"]],
                  label=f"{row['shape']} {row['routing']}", details=(row["shape"], row["routing"]) == ("30b", "uniform"))
        line = {"op": "fused_moe", "shape": row["shape"], "routing": row["routing"], "device":
                torch.cuda.get_device_name(), **{k: round(v, 3) for k, v in r.items()}}
        print("JSON " + json.dumps(line), flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(line) + "\n")
    print("ALL CHECKS PASSED" if not FAILURES else f"FAILED: {FAILURES}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
