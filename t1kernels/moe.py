"""MoE routing (with rollout routing replay, R3) and the fused expert dispatch.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k.
`route` turns router logits into (weights, ids), optionally forcing replayed ids; `fused_moe` runs the SwiGLU
experts for precomputed (ids, weights). CUDA tensors run the Triton kernels (`t1kernels.moe_triton`), CPU
tensors the vectorised torch path (`t1kernels.moe_torch`); `T1_KERNEL_BACKEND` forces one (`t1kernels.backend`).
"""

from __future__ import annotations

import torch

from t1kernels.backend import select_backend
from t1kernels.moe_torch import moe_bwd, moe_bwd_saved, moe_fwd, moe_fwd_saving

_ID_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def _check_ids(name: str, ids_TK: torch.Tensor, *, num_tokens: int, top_k: int, num_experts: int) -> None:
    """Shape, dtype, range and per-row uniqueness of an expert-id tensor; ValueError naming `name`."""
    if ids_TK.dtype not in _ID_DTYPES:
        raise ValueError(f"{name}: expected an integer dtype in {_ID_DTYPES}, got {ids_TK.dtype}")
    if tuple(ids_TK.shape) != (num_tokens, top_k):
        raise ValueError(f"{name}: expected shape [T, K] = {[num_tokens, top_k]}, got {list(ids_TK.shape)}")
    if ids_TK.numel() == 0:
        return
    ids = ids_TK.long()
    bad_range = (ids < 0) | (ids >= num_experts)
    srt = torch.sort(ids, dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
    # sync: one host read for both checks; boundary validation, skippable with validate=False.
    n_range, n_dup = torch.stack([bad_range.any(dim=1).sum(), dup.sum()]).tolist()
    if n_range:
        raise ValueError(f"{name}: expected expert ids in [0, {num_experts}), got {n_range} rows with ids "
                         f"outside (min {int(ids.min())}, max {int(ids.max())})")
    if n_dup:
        row = int(torch.nonzero(dup).flatten()[0])
        raise ValueError(f"{name}: expected {top_k} distinct expert ids per token, got duplicates in {n_dup} "
                         f"rows (first: row {row} = {ids_TK[row].tolist()})")


def check_routing(routing_TLK: torch.Tensor, *, num_experts: int) -> None:
    """Range and per-row uniqueness of a whole replayed routing [T, L_moe, K], with one host read.

    Meant for the batch before the forward (on the tensor where it lives: a CPU routing costs no device sync),
    so that the MoE layers can take the ids with `route(..., validate=False)` instead of one sync each.
    Raises ValueError (as `route`) on a non-integer dtype, a tensor that is not 3-D, ids outside [0, E) or a
    repeated id within a (token, layer).
    """
    if routing_TLK.dim() != 3:
        raise ValueError(f"routing_TLK: expected [T, L_moe, K], got shape {list(routing_TLK.shape)}")
    T, L, K = routing_TLK.shape
    _check_ids("routing_TLK (row = token * L_moe + layer)", routing_TLK.reshape(T * L, K), num_tokens=T * L,
               top_k=K, num_experts=num_experts)


def route(router_logits: torch.Tensor, top_k: int, *, replay_ids: torch.Tensor | None = None,
          renormalize: bool = True, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing over softmax(router_logits), or the weights of replayed expert ids (R3).

    Args:
        router_logits: [T, E] floating router logits. The softmax runs over all E in fp32.
        top_k: K, experts per token, 1 <= K <= E.
        replay_ids: optional [T, K] expert ids (uint8/int16/int32/int64) recorded at rollout. When given,
            exactly these experts are used (selection frozen); their weights are still the trainer's own
            probabilities, so gradients reach `router_logits` (only at the replayed columns).
        renormalize: divide the K gathered probabilities by their sum (Qwen3-MoE `norm_topk_prob`); computed
            as the softmax over the K chosen logits (equal in exact arithmetic).
        validate: check replay_ids' range and per-row uniqueness (one host sync). False when the caller checked
            them already (`check_routing` once per batch); shape, dtype and device are checked either way.

    Returns:
        (topk_weights [T, K] float32 (float64 for float64 logits), topk_ids [T, K] int64). Without replay,
        ids come from `torch.topk` of the probabilities (descending; ties resolved as torch.topk does). With
        replay_ids equal to that top-k, the result is bitwise equal to the non-replay call.

    Raises:
        ValueError: bad logits shape/dtype, top_k out of range, or replay_ids with the wrong shape/dtype,
            ids outside [0, E) or duplicate ids within a row (the last two only with validate=True).
    """
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits: expected a floating [T, E] tensor, got {router_logits.dtype} "
                         f"{list(router_logits.shape)}")
    T, E = router_logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected an int in [1, E={E}], got {top_k!r}")
    # fp32 softmax (fp64 stays fp64 so that gradcheck can run through it).
    logits_TE = router_logits.to(torch.promote_types(router_logits.dtype, torch.float32))
    if replay_ids is None:
        # Select on probabilities, as inference engines do (ties after rounding go to the lower index).
        ids_TK = torch.topk(torch.softmax(logits_TE, dim=-1), top_k, dim=-1).indices
    else:
        if replay_ids.device != router_logits.device:
            raise ValueError(f"replay_ids: expected device {router_logits.device}, got {replay_ids.device}")
        if validate:
            _check_ids("replay_ids", replay_ids, num_tokens=T, top_k=top_k, num_experts=E)
        elif replay_ids.dtype not in _ID_DTYPES or tuple(replay_ids.shape) != (T, top_k):
            raise ValueError(f"replay_ids: expected an integer [T, K] = {[T, top_k]} tensor, got "
                             f"{replay_ids.dtype} {list(replay_ids.shape)}")
        ids_TK = replay_ids.long()
    # Both modes compute the weights by one formula from the trainer's own logits at the chosen ids, so a
    # replay of the own top-k reproduces the same bits. Renormalised top-k probabilities equal a softmax over
    # the K chosen logits; computing them that way keeps the gradient of unchosen logits exactly zero (the
    # full-softmax form leaves ~1e-16 there). Never gather from a masked copy: its zeros would kill the grad.
    if renormalize:
        weights_TK = torch.softmax(logits_TE.gather(-1, ids_TK), dim=-1)
    else:
        weights_TK = torch.softmax(logits_TE, dim=-1).gather(-1, ids_TK)
    return weights_TK, ids_TK


def _check_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, *, validate_ids: bool) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: expected a floating [T, D] tensor, got {x.dtype} {list(x.shape)}")
    T, D = x.shape
    if w13.dim() != 3 or w13.shape[2] != D or w13.shape[1] % 2:
        raise ValueError(f"w13: expected [E, 2F, D={D}], got {list(w13.shape)}")
    E, num_f = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (E, D, num_f):
        raise ValueError(f"w2: expected [E, D, F] = {[E, D, num_f]}, got {list(w2.shape)}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name}: expected dtype {x.dtype} (the dtype of x), got {t.dtype}")
    for name, t in (("w13", w13), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (the device of x), got {t.device}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected [T={T}, K], got {list(topk_ids.shape)}")
    K = topk_ids.shape[1]
    if not 1 <= K <= E:
        raise ValueError(f"topk_ids: expected 1 <= K <= E={E}, got K={K}")
    if tuple(topk_weights.shape) != (T, K) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights: expected a floating [T, K] = {[T, K]} tensor, got "
                         f"{topk_weights.dtype} {list(topk_weights.shape)}")
    if validate_ids:
        _check_ids("topk_ids", topk_ids, num_tokens=T, top_k=K, num_experts=E)
    elif topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids: expected an integer dtype in {_ID_DTYPES}, got {topk_ids.dtype}")


class FusedMoEFunction(torch.autograd.Function):
    """Autograd over (x, w13, w2, topk_weights). With `keep`, Triton keeps the expert alignment and pre-activations
    of a training forward (`moe_triton.MoESavedTriton`) and the torch path its gathered inputs and pre-activations
    (`moe_torch.MoESaved`); without it both keep only the inputs and the backward recomputes the rest."""

    @staticmethod
    def forward(ctx, x, w13, w2, topk_ids, topk_weights, backend, keep):  # type: ignore[override]
        ctx.backend = backend
        if backend == "triton":
            from t1kernels.moe_triton import moe_fwd_triton
            ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights)
            y, ctx.moe_saved = moe_fwd_triton(x, w13, w2, topk_ids, topk_weights, save=keep)
            return y
        if not keep:
            ctx.save_for_backward(x, w13, w2, topk_ids, topk_weights)
            ctx.moe_saved = None
            return moe_fwd(x, w13, w2, topk_ids, topk_weights)
        y, saved = moe_fwd_saving(x, w13, w2, topk_ids, topk_weights)
        ctx.save_for_backward(w13, w2, topk_weights)
        ctx.moe_saved = saved  # intermediates only (neither inputs nor outputs): safe to hold on ctx
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        dy = dy.contiguous()
        if ctx.backend == "triton":
            from t1kernels.moe_triton_bwd import moe_bwd_triton
            x, w13, w2, topk_ids, topk_weights = ctx.saved_tensors
            dx, dw13, dw2, dw = moe_bwd_triton(dy, x, w13, w2, topk_ids, topk_weights, saved=ctx.moe_saved)
        elif ctx.moe_saved is None:
            x, w13, w2, topk_ids, topk_weights = ctx.saved_tensors
            dx, dw13, dw2, dw = moe_bwd(dy, x, w13, w2, topk_ids, topk_weights)
        else:
            w13, w2, topk_weights = ctx.saved_tensors
            dx, dw13, dw2, dw = moe_bwd_saved(dy, w13, w2, topk_weights, ctx.moe_saved)
        needs = ctx.needs_input_grad
        return (dx if needs[0] else None, dw13 if needs[1] else None, dw2 if needs[2] else None, None,
                dw if needs[4] else None, None, None)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, validate: bool = True, recompute: bool = False) -> torch.Tensor:
    """SwiGLU mixture-of-experts for precomputed routing: y[t] = sum_k w[t,k] w2[e] (silu(g) * u).

    With e = topk_ids[t, k], [g; u] = w13[e] @ x[t] (g the first F rows, u the last F).

    Args:
        x: [T, D] activations, fp32 / bf16 / fp16 (fp64 on the torch path).
        w13: [E, 2F, D], x's dtype: gate_proj rows then up_proj rows (HF Qwen3-MoE / Mixtral w1, w3 stacked).
        w2: [E, D, F], x's dtype: down_proj.
        topk_ids: [T, K] expert ids, uint8/int16/int32/int64, distinct within a row.
        topk_weights: [T, K] floating combine weights (any float dtype; the combine accumulates in fp32).
        validate: check ids for range and duplicates (one host sync); `route` output is already valid.
        recompute: keep nothing but the inputs for the backward, which then sorts again and recomputes the up
            projection (one more [T*K, 2F] GEMM; the torch path reruns its forward). Saves the [T*K, 2F]
            pre-activations per layer between forward and backward (~78 GB over the 48 layers of the 30B shape at
            T = 64k in bf16). Set for a model by `model.moe_recompute`. Default: keep them.

    Returns:
        y [T, D] in x's dtype. Differentiable w.r.t. x, w13, w2 and topk_weights. Memory kept for the backward
        besides the inputs (nothing with recompute=True, or when no input requires grad): Triton, the
        pre-activations [T*K (padded), 2F] and the alignment; the torch (CPU) path, its gathered inputs and
        pre-activations, O(T*K*(D + 2F)) per layer.

    Raises:
        ValueError: shape/dtype/device mismatches, or (validate=True) ids outside [0, E) / duplicate ids.
        RuntimeError: the Triton backend was asked for (CUDA tensors or T1_KERNEL_BACKEND=triton) but cannot run.
    """
    _check_moe_inputs(x, w13, w2, topk_ids, topk_weights, validate_ids=validate)
    backend = select_backend(x, w13, w2, op="fused_moe")
    if backend == "triton" and x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: the Triton backend takes float32/bfloat16/float16, got {x.dtype} "
                         f"(float64 runs on the torch path: T1_KERNEL_BACKEND=torch)")
    # Keep h only when a backward can come: needs_input_grad inside forward stays True under no_grad.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w13, w2, topk_weights))
    if backend == "torch" and not grad:  # inference (the engine's steps): the same forward, no autograd bookkeeping
        return moe_fwd(x.contiguous(), w13.contiguous(), w2.contiguous(), topk_ids.contiguous(),
                       topk_weights.contiguous())
    keep = not recompute and grad
    return FusedMoEFunction.apply(x.contiguous(), w13.contiguous(), w2.contiguous(), topk_ids.contiguous(),
                                  topk_weights.contiguous(), backend, keep)
