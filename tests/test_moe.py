"""Tests of t1kernels.moe: routing with replay (R3) and the fused MoE dispatch on the torch and Triton backends.

Every forward and gradient is compared with `moe_loop_reference` (a masked per-expert, per-slot loop, no sort)
run in float64 under autograd. The Triton kernels run on CPU through the interpreter in a child pytest process
(`test_triton_interpreter_suite`): TRITON_INTERPRET must be set before triton is first imported, and another
test module of the same session may already have imported it, so the child gets a fresh interpreter with the
variable set and runs the `interp`-marked tests below (they skip in the parent).
Tolerance: fp32 results against the fp64 reference, max |diff| <= 2e-5 * max |ref| (reductions here are
over <= 64 terms, fp32 rounding gives ~1e-6 relative).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from t1kernels.moe import fused_moe, route
from t1kernels.moe_torch import moe_bwd, moe_fwd, moe_loop_reference
from tests.aot import aot_rows

_CHILD = os.environ.get("T1_MOE_INTERP_CHILD") == "1"
interp = pytest.mark.skipif(not _CHILD, reason="runs in the interpreter child of test_triton_interpreter_suite")
RTOL = 2e-5


def _ids(T: int, E: int, K: int, gen: torch.Generator, mode: str = "random") -> torch.Tensor:
    if mode == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    if mode == "one_expert":  # every token's first slot on expert E-1, the rest on the lowest ids
        return torch.tensor([[E - 1] + list(range(K - 1)) for _ in range(T)])
    if mode == "skewed":  # experts >= 2K never used
        return torch.stack([torch.randperm(min(E, 2 * K), generator=gen)[:K] for _ in range(T)])
    raise ValueError(mode)


def _problem(T: int, D: int, F: int, E: int, K: int, *, seed: int = 0, mode: str = "random",
             dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    w13 = torch.randn(E, 2 * F, D, generator=gen, dtype=torch.float64) / D ** 0.5
    w2 = torch.randn(E, D, F, generator=gen, dtype=torch.float64) / F ** 0.5
    ids = _ids(T, E, K, gen, mode)
    w = torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1
    dy = torch.randn(T, D, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w13, w2)] + [ids, w.to(dtype), dy.to(dtype)]


def _reference(x, w13, w2, ids, w, dy):
    """fp64 forward and (dx, dw13, dw2, dw) of the loop reference."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w13, w2, w)]
    y = moe_loop_reference(leaves[0], leaves[1], leaves[2], ids, leaves[3])
    grads = torch.autograd.grad(y, leaves, dy.double())
    return y.detach(), grads


def _assert_close(got: torch.Tensor, ref: torch.Tensor, name: str, rtol: float = RTOL) -> None:
    assert got.shape == ref.shape, f"{name}: shape {got.shape} vs {ref.shape}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref.double()).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-12)
    assert err <= rtol * scale, f"{name}: max |diff| {err:.3e} > {rtol} * max |ref| {scale:.3e}"


# (T, D, F, E, K, ids mode): T not a multiple of 16, T < block, K == E, E = 64, K = 1..8, unused experts,
# every token on one expert.
SHAPES = [
    (37, 24, 20, 8, 3, "random"),
    (5, 16, 16, 8, 2, "random"),
    (40, 16, 8, 4, 4, "random"),
    (33, 16, 16, 64, 8, "random"),
    (20, 16, 16, 6, 1, "random"),
    (45, 16, 16, 4, 1, "one_expert"),
    (29, 16, 16, 16, 5, "skewed"),
]


@pytest.mark.parametrize("T,D,F,E,K,mode", SHAPES)
def test_torch_path_matches_reference(T, D, F, E, K, mode):
    x, w13, w2, ids, w, dy = _problem(T, D, F, E, K, mode=mode)
    y_ref, grads_ref = _reference(x, w13, w2, ids, w, dy)
    _assert_close(moe_fwd(x, w13, w2, ids, w), y_ref, "y")
    for name, got, ref in zip(("dx", "dw13", "dw2", "dw"), moe_bwd(dy, x, w13, w2, ids, w), grads_ref):
        _assert_close(got, ref, name)


def test_fused_moe_autograd_float64_matches_reference():
    x, w13, w2, ids, w, dy = _problem(23, 12, 10, 8, 3, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
    y = fused_moe(leaves[0], leaves[1], leaves[2], ids.to(torch.uint8), leaves[3])
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref, grads_ref = _reference(x, w13, w2, ids, w, dy)
    _assert_close(y, y_ref, "y", rtol=1e-12)
    for name, got, ref in zip(("dx", "dw13", "dw2", "dw"), grads, grads_ref):
        _assert_close(got, ref, name, rtol=1e-12)


def test_torch_path_gradcheck_float64():
    x, w13, w2, ids, w, _ = _problem(7, 5, 3, 4, 2, dtype=torch.float64, seed=3)
    inputs = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
    assert torch.autograd.gradcheck(lambda a, b, c, d: fused_moe(a, b, c, ids, d), inputs)


def test_bf16_torch_path_close_to_reference():
    x, w13, w2, ids, w, dy = _problem(31, 32, 16, 8, 2, dtype=torch.bfloat16)
    y_ref, grads_ref = _reference(x, w13, w2, ids, w, dy)
    y = fused_moe(x, w13, w2, ids, w)
    assert y.dtype == torch.bfloat16
    _assert_close(y, y_ref, "y", rtol=3e-2)  # bf16 inputs and outputs: 8 mantissa bits
    for name, got, ref in zip(("dx", "dw13", "dw2", "dw"), moe_bwd(dy, x, w13, w2, ids, w), grads_ref):
        _assert_close(got, ref, name, rtol=5e-2)


def test_torch_path_deterministic_and_empty_batch():
    x, w13, w2, ids, w, dy = _problem(37, 24, 20, 8, 3)
    assert torch.equal(moe_fwd(x, w13, w2, ids, w), moe_fwd(x, w13, w2, ids, w))
    for a, b in zip(moe_bwd(dy, x, w13, w2, ids, w), moe_bwd(dy, x, w13, w2, ids, w)):
        assert torch.equal(a, b)
    x0 = x[:0].clone().requires_grad_()
    y0 = fused_moe(x0, w13, w2, ids[:0], w[:0])
    assert y0.shape == (0, 24)
    y0.sum().backward()
    assert x0.grad.shape == (0, 24)


# ---- routing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("T,E,K,mode", [(1, 16, 2, "random"), (3, 16, 2, "random"), (8, 4, 2, "random"),
                                        (40, 16, 2, "skewed"), (64, 8, 8, "random"), (20, 16, 4, "one_expert")])
def test_host_layout_equals_tensor_layout(T, E, K, mode, invariant, monkeypatch):
    """The decode steps' Python layout (few pairs) is the tensor path's, element for element (so the same bits)."""
    from t1kernels import moe_torch
    from t1kernels.rows import batch_invariant_mode
    ids_TK = _ids(T, E, K, torch.Generator().manual_seed(T * E + K), mode)
    with batch_invariant_mode(invariant):
        host = moe_torch.expert_layout(ids_TK, E)
        monkeypatch.setattr(moe_torch, "HOST_LAYOUT_MAX_PAIRS", -1)
        ref = moe_torch.expert_layout(ids_TK, E)
    assert (host.groups, host.capacity) == (ref.groups, ref.capacity)
    assert torch.equal(host.row_P, ref.row_P) and torch.equal(host.token_R, ref.token_R)


def test_route_topk_matches_softmax_topk():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 16, generator=gen)
    w, ids = route(logits, 4)
    p = torch.softmax(logits.double(), -1)
    ref_w, ref_ids = p.topk(4, dim=-1)
    assert torch.equal(ids, ref_ids)
    _assert_close(w, ref_w / ref_w.sum(-1, keepdim=True), "weights", rtol=1e-6)
    w_raw, _ = route(logits, 4, renormalize=False)
    _assert_close(w_raw, ref_w, "raw weights", rtol=1e-6)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("id_dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_route_replay_of_own_topk_is_bitwise_equal(renormalize, id_dtype):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 32, generator=gen, dtype=torch.bfloat16)
    logits[3, :] = 0.5  # an all-tie row: the replay must still reproduce torch.topk's pick
    logits_a = logits.clone().requires_grad_()
    logits_b = logits.clone().requires_grad_()
    w, ids = route(logits_a, 8, renormalize=renormalize)
    w_r, ids_r = route(logits_b, 8, replay_ids=ids.to(id_dtype), renormalize=renormalize)
    assert torch.equal(ids, ids_r) and torch.equal(w, w_r)
    g = torch.randn(w.shape, generator=gen)
    (w * g).sum().backward()
    (w_r * g).sum().backward()
    assert torch.equal(logits_a.grad, logits_b.grad)


def test_route_replay_uses_replayed_experts_and_router_grad_only_there():
    T, D, F, E, K = 24, 16, 8, 8, 2
    x, w13, w2, _, _, dy = _problem(T, D, F, E, K, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64, requires_grad=True)
    _, own_ids = route(logits, K)
    # Replay the experts the router ranks lowest: certainly different from its own top-k.
    replay = torch.topk(logits.detach(), K, dim=-1, largest=False).indices.to(torch.uint8)
    assert not (replay.long().sort(-1).values == own_ids.sort(-1).values).all(-1).any()
    w, ids = route(logits, K, replay_ids=replay)
    assert torch.equal(ids, replay.long())
    y = fused_moe(x, w13, w2, ids, w)
    p = torch.softmax(logits.detach(), -1).gather(-1, replay.long())
    _assert_close(y, moe_loop_reference(x, w13, w2, replay, p / p.sum(-1, keepdim=True)), "y", rtol=1e-12)
    (y * dy).sum().backward()
    replayed = torch.zeros(T, E, dtype=torch.bool).scatter_(1, replay.long(), True)
    assert (logits.grad[~replayed] == 0).all()
    assert (logits.grad[replayed] != 0).all()


def test_route_replay_without_renormalize_reaches_all_logits():
    # Without renormalisation the gathered probabilities depend on every logit through the softmax.
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    replay = torch.tensor([[0, 4]] * 6)
    w, _ = route(logits, 2, replay_ids=replay, renormalize=False)
    assert torch.autograd.gradcheck(lambda z: route(z, 2, replay_ids=replay, renormalize=False)[0], (logits,))
    assert torch.autograd.gradcheck(lambda z: route(z, 2, replay_ids=replay)[0], (logits,))
    w.sum().backward()
    assert (logits.grad[:, 1:4] != 0).all()


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([[0, 8]] * 4), r"replay_ids: expected expert ids in \[0, 8\)"),
    (torch.tensor([[0, -1]] * 4), r"replay_ids: expected expert ids in \[0, 8\)"),
    (torch.tensor([[1, 2], [3, 3], [0, 1], [4, 5]]), r"replay_ids: expected 2 distinct .* row 1"),
    (torch.tensor([[0, 1, 2]] * 4), r"replay_ids: expected shape \[T, K\]"),
    (torch.tensor([[0, 1]] * 3), r"replay_ids: expected shape \[T, K\]"),
    (torch.tensor([[0.0, 1.0]] * 4), r"replay_ids: expected an integer dtype"),
])
def test_route_rejects_bad_replay_ids(bad, match):
    with pytest.raises(ValueError, match=match):
        route(torch.randn(4, 8), 2, replay_ids=bad)


def test_route_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(4, 8), 9)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(4, 8), 0)
    with pytest.raises(ValueError, match="router_logits"):
        route(torch.randn(4, 8, 2), 2)


# ---- fused_moe input checks and backend switch --------------------------------------------------------------

def _bad_inputs():
    x, w13, w2, ids, w, _ = _problem(6, 8, 4, 4, 2)
    ok = dict(x=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=w)
    yield dict(ok, topk_ids=torch.full((6, 2), 4)), r"topk_ids: expected expert ids in \[0, 4\)"
    yield dict(ok, topk_ids=torch.zeros(6, 2, dtype=torch.int64)), "topk_ids: expected 2 distinct"
    yield dict(ok, topk_ids=ids.float()), "topk_ids: expected an integer dtype"
    yield dict(ok, topk_ids=ids[:5]), r"topk_ids: expected \[T=6, K\]"
    yield dict(ok, topk_weights=w[:, :1]), r"topk_weights: expected a floating \[T, K\]"
    yield dict(ok, w13=w13[:, :7]), r"w13: expected \[E, 2F, D=8\]"
    yield dict(ok, w2=w2[:, :, :3]), r"w2: expected \[E, D, F\]"
    yield dict(ok, w2=w2.double()), "w2: expected dtype torch.float32"
    yield dict(ok, x=x[None]), r"x: expected a floating \[T, D\]"


@pytest.mark.parametrize("kwargs,match", list(_bad_inputs()))
def test_fused_moe_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fused_moe(**kwargs)


def test_backend_switch(monkeypatch):
    x, w13, w2, ids, w, _ = _problem(6, 8, 4, 4, 2)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("T1_KERNEL_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="fused_moe: Triton backend requested for CPU tensors"):
        fused_moe(x, w13, w2, ids, w)
    monkeypatch.setenv("T1_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="T1_KERNEL_BACKEND must be"):
        fused_moe(x, w13, w2, ids, w)
    monkeypatch.setenv("T1_KERNEL_BACKEND", "torch")
    assert torch.equal(fused_moe(x, w13, w2, ids, w), moe_fwd(x, w13, w2, ids, w))


# ---- model-level: recompute from the config, one routing check per batch, unfilled scratch -------------------

def _tiny_run_models(overrides: list[str]):
    from t1core import models
    from t1core.config_toml import load_config
    cfg = load_config(None, ["--model.name=tiny", *overrides])
    return models.load_models(cfg, models.load_tokenizer(cfg))


def _moe_kept(model, ids_T: torch.Tensor) -> list[object]:
    """What each MoE layer's autograd node holds between forward and backward (its `moe_saved`)."""
    from t1model.model import SparseMoE
    kept: list[object] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: kept.append(out[0].grad_fn.moe_saved))
             for m in model.modules() if isinstance(m, SparseMoE)]
    try:
        model(ids_T).float().pow(2).mean().backward()
    finally:
        for h in hooks:
            h.remove()
    return kept


def test_moe_recompute_from_config_keeps_nothing_and_changes_no_bit():
    from t1model.model import SparseMoE
    ids_T = torch.randint(0, 4096, (48,), generator=torch.Generator().manual_seed(3))
    runs = {}
    for on in (False, True):
        policy, critic = _tiny_run_models([f"--model.moe_recompute={str(on).lower()}"])
        layers = [m for model in (policy, critic) for m in model.modules() if isinstance(m, SparseMoE)]
        assert layers and all(m.recompute is on for m in layers)
        kept = _moe_kept(policy, ids_T)
        assert len(kept) == policy.config.num_hidden_layers
        assert all((k is None) == on for k in kept), kept  # recompute: only the inputs are kept
        runs[on] = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    assert runs[False].keys() == runs[True].keys()
    assert all(torch.equal(runs[False][n], runs[True][n]) for n in runs[False]), "recompute changed a gradient"


def test_replayed_routing_is_checked_once_per_batch(monkeypatch):
    import t1kernels.moe as moe_mod
    from t1model.model import ModelConfig, MoEModel
    cfg = ModelConfig(vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      num_experts=8, num_experts_per_tok=2)
    model = MoEModel(cfg, seed=0)
    ids_T = torch.randint(0, 101, (20,), generator=torch.Generator().manual_seed(0))
    _, routing = model(ids_T, return_routing=True)
    calls = []
    real = moe_mod._check_ids
    monkeypatch.setattr(moe_mod, "_check_ids", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    replayed = model(ids_T, replay_routing=routing)
    assert len(calls) == 1, calls  # one host read for all three MoE layers, not one per layer
    assert torch.equal(replayed, model(ids_T))  # replaying the own routing: same bits
    bad = routing.clone()
    bad[5, 2, 1] = bad[5, 2, 0]
    with pytest.raises(ValueError, match=r"distinct expert ids .* row 17 "):  # token 5, layer 2: 5 * 3 + 2
        model(ids_T, replay_routing=bad)


def test_route_unvalidated_replay_still_checks_shape_and_dtype():
    logits = torch.randn(6, 8)
    with pytest.raises(ValueError, match="replay_ids: expected an integer"):
        route(logits, 2, replay_ids=torch.zeros(6, 3, dtype=torch.int64), validate=False)
    with pytest.raises(ValueError, match="replay_ids: expected an integer"):
        route(logits, 2, replay_ids=torch.zeros(6, 2), validate=False)


def test_kernel_scratch_skips_the_deterministic_fill():
    from t1kernels.scratch import empty_unfilled, scratch
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        n = 16 * 2**20
        # Unfilled memory holds whatever was there (fresh zero pages or an earlier buffer's bytes), which may
        # include a NaN by chance, but never only NaN: that is what the fill writes. Allocated first, so that it
        # cannot be handed the NaN-filled buffer below once that is freed.
        buf = empty_unfilled((n // 1024, 1024), dtype=torch.float32, device=torch.device("cpu"))
        assert buf.shape == (n // 1024, 1024) and buf.is_contiguous() and not buf.isnan().all()
        assert torch.empty(n).isnan().all()  # the fill this mode adds to torch.empty
        assert scratch((3, 5), dtype=torch.bfloat16, device=torch.device("cpu"), fill=float("nan")).isnan().all()
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.slow
def test_production_tiles_compile_for_sm90a_without_spills():
    """ptxas (shipped in the triton wheel) compiles every MoE kernel at the production shapes for sm_90a; none
    may spill registers (`python -m t1kernels.aot_report`)."""
    rows, proc = aot_rows("moe")
    names = {r["kernel"] for r in rows}
    assert {"_moe_up_kernel", "_moe_rows_gemm_kernel", "_moe_combine_kernel", "_moe_dact_kernel", "_moe_dw2_kernel",
            "_moe_dw13_kernel", "_moe_dw_reduce_kernel"} <= names, (names, proc.stderr[-3000:])
    assert all(r["registers"] > 0 for r in rows)
    spilling = [r for r in rows if r["spills"]]
    assert not spilling and proc.returncode == 0, (spilling, proc.stderr[-2000:])


# ---- Triton kernels in the interpreter (child process) -----------------------------------------------------

@pytest.mark.interpreter
def test_triton_interpreter_suite():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", T1_MOE_INTERP_CHILD="1", T1_KERNEL_BACKEND="triton")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interp_",
                           str(Path(__file__).resolve())],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"interpreter suite failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) == _NUM_INTERP_TESTS and "skipped" not in summary, summary


@interp
@pytest.mark.parametrize("T,D,F,E,K,mode", SHAPES)
def test_interp_triton_matches_reference(T, D, F, E, K, mode):
    from t1kernels.moe_triton import moe_fwd_triton
    from t1kernels.moe_triton_bwd import moe_bwd_triton
    x, w13, w2, ids, w, dy = _problem(T, D, F, E, K, mode=mode)
    y_ref, grads_ref = _reference(x, w13, w2, ids, w, dy)
    nan = float("nan")  # scratch buffers start as NaN: a read of an unwritten row poisons the result
    y, saved = moe_fwd_triton(x, w13, w2, ids, w, save=True, scratch_fill=nan)
    _assert_close(y, y_ref, "y")
    y_lean, nothing = moe_fwd_triton(x, w13, w2, ids, w, scratch_fill=nan)
    assert nothing is None and torch.equal(y, y_lean)  # keeping h changes no bit of the output
    # The backward from the forward's alignment and h, and the one that sorts and recomputes: same bits.
    got = moe_bwd_triton(dy, x, w13, w2, ids, w, saved=saved, scratch_fill=nan)
    for name, g, ref in zip(("dx", "dw13", "dw2", "dw"), got, grads_ref):
        _assert_close(g, ref, name)
    again = moe_bwd_triton(dy, x, w13, w2, ids, w, scratch_fill=nan)
    assert all(torch.equal(p, q) for p, q in zip(got, again))


@interp
def test_interp_fused_moe_autograd_on_triton_backend():
    from t1kernels.backend import select_backend
    x, w13, w2, ids, w, dy = _problem(19, 16, 16, 8, 2)
    assert select_backend(x, op="fused_moe") == "triton"
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
    y = fused_moe(leaves[0], leaves[1], leaves[2], ids.to(torch.int16), leaves[3])
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref, grads_ref = _reference(x, w13, w2, ids, w, dy)
    _assert_close(y, y_ref, "y")
    for name, g, ref in zip(("dx", "dw13", "dw2", "dw"), grads, grads_ref):
        _assert_close(g, ref, name)
    y2 = fused_moe(x, w13, w2, ids, w)
    assert torch.equal(y.detach(), y2)  # deterministic: same inputs, same bits
    y3 = fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3], recompute=True)
    assert all(torch.equal(p, q) for p, q in zip(grads, torch.autograd.grad(y3, leaves, dy)))
    # What the forward keeps: h only when a backward can come.
    import t1kernels.moe_triton as mt
    kept = []
    real = mt.moe_fwd_triton
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "moe_fwd_triton", lambda *a, **k: kept.append(k["save"]) or real(*a, **k))
        fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3])
        fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3], recompute=True)
        fused_moe(x, w13, w2, ids, w)
        with torch.no_grad():
            fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3])
    assert kept == [True, False, False, False], kept
    with pytest.raises(ValueError, match="x: the Triton backend takes"):
        fused_moe(x.double(), w13.double(), w2.double(), ids, w)


@interp
def test_interp_alignment_layout():
    from t1kernels.moe_triton import align_by_expert
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])
    al = align_by_expert(ids, 5, 4)
    # expert 0: pairs 1, 4; expert 1: pair 3; expert 2: pair 7; expert 3: pairs 0, 2, 5, 6; expert 4: none
    assert al.seg_start_E1.tolist() == [0, 4, 8, 12, 16, 16]
    assert al.sorted_pair_M[:16].tolist() == [1, 4, -1, -1, 3, -1, -1, -1, 7, -1, -1, -1, 0, 2, 5, 6]
    assert (al.sorted_pair_M[16:] == -1).all() and al.sorted_pair_M.numel() % 4 == 0
    assert al.block_expert_B.tolist()[:4] == [0, 1, 2, 3] and (al.block_expert_B[4:] == 5).all()
    assert torch.equal(al.sorted_pair_M[al.row_of_pair_P].long(), torch.arange(8))


@interp
@pytest.mark.parametrize("T,K,hot", [(130, 1, (2,)), (70, 2, (0, 3))])
def test_interp_skewed_routing_splits_hot_experts(T, K, hot):
    """All tokens on K experts: each hot expert's rows span several weight-gradient chunks, whose fp32 partials
    (NaN-filled scratch: an unwritten slot would show) are summed in a fixed order."""
    from t1kernels.moe_triton import align_by_expert, moe_config, moe_fwd_triton
    from t1kernels.moe_triton_bwd import dw_chunks, moe_bwd_triton
    E, D, F = 4, 16, 16
    x, w13, w2, _, w, dy = _problem(T, D, F, E, K, seed=5)
    ids = torch.tensor([list(hot)] * T)
    chunks = dw_chunks(align_by_expert(ids, E, moe_config(x.dtype).block_m), moe_config(x.dtype))
    assert all(int(chunks.num_chunks_E[e]) >= 3 for e in hot), chunks.num_chunks_E  # more rows than one chunk
    assert int(chunks.num_chunks_E.sum()) - len(hot) <= chunks.num_slots
    nan = float("nan")
    y, saved = moe_fwd_triton(x, w13, w2, ids, w, save=True, scratch_fill=nan)
    got = moe_bwd_triton(dy, x, w13, w2, ids, w, saved=saved, scratch_fill=nan)
    y_ref, grads_ref = _reference(x, w13, w2, ids, w, dy)
    _assert_close(y, y_ref, "y")
    for name, g, ref in zip(("dx", "dw13", "dw2", "dw"), got, grads_ref):
        _assert_close(g, ref, name)
    cold = [e for e in range(E) if e not in hot]
    assert (got[1][cold] == 0).all() and (got[2][cold] == 0).all()  # unused experts: written zeros
    again = moe_bwd_triton(dy, x, w13, w2, ids, w, saved=saved, scratch_fill=nan)
    assert all(torch.equal(p, q) for p, q in zip(got, again))  # fixed reduction order


_NUM_INTERP_TESTS = len(SHAPES) + 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check_moe.py checks more)")
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_triton_matches_reference(dtype, rtol, monkeypatch):
    monkeypatch.delenv("T1_KERNEL_BACKEND", raising=False)
    x, w13, w2, ids, w, dy = (t.cuda() for t in _problem(517, 256, 192, 32, 8, dtype=dtype))
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
    y = fused_moe(leaves[0], leaves[1], leaves[2], ids, leaves[3])
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref, grads_ref = _reference(x, w13, w2, ids, w, dy)
    _assert_close(y, y_ref, "y", rtol=rtol)
    for name, g, ref in zip(("dx", "dw13", "dw2", "dw"), grads, grads_ref):
        _assert_close(g, ref, name, rtol=rtol)
