"""Plain-torch MoE expert dispatch: the vectorised CPU path and the per-expert loop reference.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, P = T*K (token, slot) pairs.
w13_EFD is [E, 2F, D] (gate rows then up rows), w2_EDF is [E, D, F].

`moe_fwd` / `moe_bwd` are the torch backend of `kernels.moe.fused_moe`: pairs are sorted by expert once, then
one matmul per expert (a loop over experts, never over tokens), and the weighted combine is a gather-sum over
K in a fixed order, so results do not depend on thread scheduling. `moe_loop_reference` is the naive
per-expert, per-slot loop that tests and benchmarks compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertSort:
    """(token, slot) pairs of a routing tensor grouped by expert (stable: pair order kept within an expert)."""

    order_P: torch.Tensor
    """Flat pair index (t * K + k) of each sorted row."""
    token_P: torch.Tensor
    """Token of each sorted row."""
    bounds: list[int]
    """Row offsets of each expert in the sorted order, length E + 1 (host list: the torch path loops over it)."""


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> ExpertSort:
    """Group the T*K pairs by expert with a stable sort (ties keep pair order: deterministic)."""
    ids_P = topk_ids_TK.reshape(-1).long()
    order_P = torch.sort(ids_P, stable=True).indices
    counts_E = torch.bincount(ids_P, minlength=num_experts)
    bounds = [0] + torch.cumsum(counts_E, 0).tolist()  # sync: the torch path slices on the host
    return ExpertSort(order_P=order_P, token_P=order_P // topk_ids_TK.shape[1], bounds=bounds)


def _swiglu(h_NF2: torch.Tensor, num_f: int) -> torch.Tensor:
    return F.silu(h_NF2[:, :num_f]) * h_NF2[:, num_f:]


def _unsort(rows_PD: torch.Tensor, order_P: torch.Tensor) -> torch.Tensor:
    out_PD = torch.empty_like(rows_PD)
    out_PD[order_P] = rows_PD
    return out_PD


def moe_expert_outputs(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                       srt: ExpertSort) -> torch.Tensor:
    """Unweighted expert outputs w2[e] @ swiglu(w13[e] @ x[t]) of every pair, in flat pair order [T*K, D]."""
    num_f = w2_EDF.shape[2]
    xs_PD = x_TD[srt.token_P]
    o_PD = torch.empty_like(xs_PD)
    for e in range(w13_EFD.shape[0]):
        lo, hi = srt.bounds[e], srt.bounds[e + 1]
        if hi == lo:
            continue
        a_NF = _swiglu(xs_PD[lo:hi] @ w13_EFD[e].t(), num_f)
        o_PD[lo:hi] = a_NF @ w2_EDF[e].t()
    return _unsort(o_PD, srt.order_P)


def combine(o_PD: torch.Tensor, topk_weights_TK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y[t] = sum_k w[t,k] o[t,k] in fp32 (or fp64), summed over K in index order: deterministic."""
    T, K = topk_weights_TK.shape
    acc = torch.float64 if o_PD.dtype == torch.float64 else torch.float32
    o_TKD = o_PD.view(T, K, o_PD.shape[-1]).to(acc)
    return (o_TKD * topk_weights_TK.to(acc).unsqueeze(-1)).sum(1).to(out_dtype)


def moe_fwd(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, topk_ids_TK: torch.Tensor,
            topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Forward of the fused MoE on the torch path (see `kernels.moe.fused_moe`)."""
    srt = sort_by_expert(topk_ids_TK, w13_EFD.shape[0])
    o_PD = moe_expert_outputs(x_TD, w13_EFD, w2_EDF, srt)
    return combine(o_PD, topk_weights_TK, x_TD.dtype)


def moe_bwd(dy_TD: torch.Tensor, x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor,
            topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx, dw13, dw2, dtopk_weights) of the fused MoE, recomputing activations per expert.

    Per pair p = (t, k) on expert e with h = w13[e] x[t] = [g; u], a = silu(g) u, o = w2[e] a, s = w2[e]^T dy[t]:
    dw[t,k] = <dy[t], o> = <s, a>, dW2[e] += w[t,k] dy[t] a^T, da = w[t,k] s,
    dg = da u silu'(g), du = da silu(g), dW13[e] += [dg; du] x[t]^T, dx[t] += w13[e]^T [dg; du].
    """
    T, K = topk_ids_TK.shape
    E, num_f2, _ = w13_EFD.shape
    num_f = num_f2 // 2
    srt = sort_by_expert(topk_ids_TK, E)
    # Weight products in the compute dtype; fp32 sums for the per-pair dot product dtopk_weights.
    w_P = topk_weights_TK.reshape(-1)[srt.order_P].to(x_TD.dtype)
    xs_PD = x_TD[srt.token_P]
    dys_PD = dy_TD[srt.token_P]
    dxs_PD = torch.empty_like(xs_PD)
    dw_P = torch.empty(T * K, dtype=torch.float64 if x_TD.dtype == torch.float64 else torch.float32,
                       device=x_TD.device)
    dw13 = torch.zeros_like(w13_EFD)
    dw2 = torch.zeros_like(w2_EDF)
    for e in range(E):
        lo, hi = srt.bounds[e], srt.bounds[e + 1]
        if hi == lo:
            continue
        h_NF2 = xs_PD[lo:hi] @ w13_EFD[e].t()
        g_NF, u_NF = h_NF2[:, :num_f], h_NF2[:, num_f:]
        sig_NF = torch.sigmoid(g_NF)
        silu_NF = g_NF * sig_NF
        a_NF = silu_NF * u_NF
        s_NF = dys_PD[lo:hi] @ w2_EDF[e]  # w2^T dy: gives <dy, o> = <s, a> without forming o
        dw_P[lo:hi] = (s_NF.to(dw_P.dtype) * a_NF.to(dw_P.dtype)).sum(-1)
        dw2[e] = (dys_PD[lo:hi] * w_P[lo:hi, None]).t() @ a_NF
        da_NF = s_NF * w_P[lo:hi, None]
        dh_NF2 = torch.cat([da_NF * u_NF * sig_NF * (1 + g_NF * (1 - sig_NF)), da_NF * silu_NF], dim=1)
        dw13[e] = dh_NF2.t() @ xs_PD[lo:hi]
        dxs_PD[lo:hi] = dh_NF2 @ w13_EFD[e]
    acc = dw_P.dtype
    dx = _unsort(dxs_PD, srt.order_P).view(T, K, x_TD.shape[1]).to(acc).sum(1).to(x_TD.dtype)
    dtopk_w = _unsort(dw_P, srt.order_P).view(T, K).to(topk_weights_TK.dtype)
    return dx, dw13, dw2, dtopk_w


def moe_loop_reference(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                       topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Naive reference: for each expert and slot, mask the tokens routed there. Differentiable by autograd.

    Written independently of the sorted path (no sort, no gather-by-order) so tests compare two methods.
    """
    num_f = w2_EDF.shape[2]
    y_TD = torch.zeros_like(x_TD)
    ids_TK = topk_ids_TK.long()
    for e in range(w13_EFD.shape[0]):
        for k in range(ids_TK.shape[1]):
            tok = torch.nonzero(ids_TK[:, k] == e).flatten()
            if tok.numel() == 0:
                continue
            h = x_TD[tok] @ w13_EFD[e].t()
            o = (F.silu(h[:, :num_f]) * h[:, num_f:]) @ w2_EDF[e].t()
            y_TD = y_TD.index_add(0, tok, o * topk_weights_TK[tok, k, None].to(o.dtype))
    return y_TD
