"""Plain-torch MoE expert dispatch: the CPU path and the per-expert loop reference.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, P = T*K (token, slot) pairs, R work rows,
C capacity (rows per expert in the padded layout). w13_EFD is [E, 2F, D] (gate rows then up rows), w2_EDF is
[E, D, F].

`moe_fwd_saving` / `moe_bwd_saved` are the torch backend of `t1kernels.moe.fused_moe`. Pairs are laid out by expert
once (`expert_layout`, one host sync); the expert GEMMs then run either as batched matmuls over a padded
[E, C, .] layout (few large ops; chosen while padding costs little) or as one matmul per expert over the packed
sorted rows (skewed routing, where padding would multiply the work). The forward keeps the gathered inputs and
the pre-activation h = [g; u] of every row, so the backward does no GEMM recompute. Gathers are index_select,
the combine (and dx) is one [T, D] gather per slot summed over K in index order, and no float scatter or atomic
is used: results do not depend on thread scheduling. In `t1kernels.rows.batch_invariant_mode` (the CPU engine)
the forward multiplies by cached row-major weight copies and never runs fewer than `t1kernels.rows.MIN_ROWS` rows,
so a token's result does not depend on how many others its expert got either. `moe_loop_reference` is the
naive per-expert, per-slot loop for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from t1kernels.rows import MIN_ROWS, batch_invariant, pad_rows, t_cached

# The padded layout is used while E * C <= PAD_LIMIT * P: up to this much extra GEMM work costs less than the
# per-expert loop's op count (measured on the tiny model, 2 cores: about 9% padding at T=2048, E=16, K=2).
PAD_LIMIT = 1.5


@dataclass(frozen=True)
class ExpertLayout:
    """Where each (token, slot) pair sits in the expert-major work rows. Stable: pair order kept per expert."""

    token_R: torch.Tensor
    """Token of each work row (0 on padding rows, whose combine weight is 0 and whose output is never read)."""
    row_P: torch.Tensor
    """Work row of each pair, in flat pair order t * K + k."""
    groups: tuple[tuple[int, int, int, int], ...] | None
    """Packed layout: (expert, first row, end of its pairs' rows, end of its rows) per non-empty expert; the rows
    between the last two are padding (batch-invariant mode only). None: padded layout of E x capacity."""
    capacity: int
    """Rows per expert in the padded layout (the largest expert's pair count)."""


HOST_LAYOUT_MAX_PAIRS = 256
"""Up to this many (token, slot) pairs on the CPU, `expert_layout` is computed in Python on the host: a decode step's
few pairs cost a dozen tiny tensor ops otherwise (the same layout, element for element)."""


def expert_layout(topk_ids_TK: torch.Tensor, num_experts: int) -> ExpertLayout:
    """Group the T*K pairs by expert (stable sort) and pick the padded or the packed layout."""
    ids_P = topk_ids_TK.reshape(-1).long()
    num_p, dev = ids_P.numel(), ids_P.device
    if dev.type == "cpu" and num_p <= HOST_LAYOUT_MAX_PAIRS:
        return _host_layout(ids_P.tolist(), num_experts, topk_ids_TK.shape[1])  # sync: none (a CPU tensor)
    order_S = torch.sort(ids_P, stable=True).indices
    ids_S = ids_P.index_select(0, order_S)
    counts_E = torch.bincount(ids_P, minlength=num_experts)
    counts = counts_E.tolist()  # sync: the layout (capacity, per-expert slices) is chosen on the host
    cap = max(counts, default=0)
    if batch_invariant():  # fewer rows per batch entry would take BLAS's small-matrix paths (t1kernels.rows)
        cap = max(cap, MIN_ROWS)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    padded = num_experts * cap <= PAD_LIMIT * num_p
    token_S = order_S // topk_ids_TK.shape[1]
    if padded:
        row_S = ids_S * cap + (torch.arange(num_p, device=dev) - start_E.index_select(0, ids_S))
        row_P = torch.empty_like(row_S).scatter_(0, order_S, row_S)  # inverse permutation (unique targets)
        token_R = torch.zeros(num_experts * cap, dtype=torch.long, device=dev).scatter_(0, row_S, token_S)
        return ExpertLayout(token_R=token_R, row_P=row_P, groups=None, capacity=cap)
    if not batch_invariant():
        row_P = torch.empty_like(order_S).scatter_(0, order_S, torch.arange(num_p, device=dev))
        ends = torch.cumsum(counts_E, 0).tolist()
        groups = tuple((e, ends[e] - c, ends[e], ends[e]) for e, c in enumerate(counts) if c)
        return ExpertLayout(token_R=token_S, row_P=row_P, groups=groups, capacity=cap)
    # Batch-invariant: each expert that got pairs gets at least MIN_ROWS rows, its pairs first, then padding rows
    # (token 0, combine weight 0). The rows are gathered there directly, so the expert products need no pad copy.
    rows = [max(c, MIN_ROWS) if c else 0 for c in counts]
    firsts = [0]
    for r in rows:
        firsts.append(firsts[-1] + r)
    first_E = torch.tensor(firsts[:-1], dtype=torch.long, device=dev)
    row_S = first_E.index_select(0, ids_S) + (torch.arange(num_p, device=dev) - start_E.index_select(0, ids_S))
    row_P = torch.empty_like(row_S).scatter_(0, order_S, row_S)
    token_R = torch.zeros(firsts[-1], dtype=torch.long, device=dev).scatter_(0, row_S, token_S)
    groups = tuple((e, firsts[e], firsts[e] + c, firsts[e + 1]) for e, c in enumerate(counts) if c)
    return ExpertLayout(token_R=token_R, row_P=row_P, groups=groups, capacity=cap)


def _host_layout(ids: list[int], num_experts: int, top_k: int) -> ExpertLayout:
    """`expert_layout` for few pairs, in plain Python: the same rows, groups and capacity as the tensor path."""
    counts = [0] * num_experts
    for e in ids:
        counts[e] += 1
    cap = max(counts, default=0)
    if batch_invariant():
        cap = max(cap, MIN_ROWS)
    padded = num_experts * cap <= PAD_LIMIT * len(ids)
    if padded:
        rows = [cap] * num_experts
    elif batch_invariant():
        rows = [max(c, MIN_ROWS) if c else 0 for c in counts]
    else:
        rows = counts
    firsts = [0]
    for r in rows:
        firsts.append(firsts[-1] + r)
    fill = firsts[:-1]  # next free row of each expert
    row_P, token_R = [0] * len(ids), [0] * firsts[-1]
    for p, e in enumerate(ids):  # pair order is kept within an expert (the stable sort)
        row_P[p], token_R[fill[e]] = fill[e], p // top_k
        fill[e] += 1
    groups = None if padded else tuple((e, firsts[e], firsts[e] + c, firsts[e + 1]) for e, c in enumerate(counts) if c)
    return ExpertLayout(token_R=torch.tensor(token_R, dtype=torch.long), row_P=torch.tensor(row_P, dtype=torch.long),
                        groups=groups, capacity=cap)


def _rows_mm(a_RX: torch.Tensor, w_EXY: torch.Tensor, lay: ExpertLayout, *, padding: bool) -> torch.Tensor:
    """out[r] = a[r] @ w[expert of r], [R, Y]. padding=False (the backward) multiplies only the pairs' rows of a
    packed layout (their padding rows come out 0), as it did before the forward padded in the layout."""
    num_e, _, y = w_EXY.shape
    if lay.groups is None:
        return torch.bmm(a_RX.view(num_e, lay.capacity, a_RX.shape[1]), w_EXY).view(a_RX.shape[0], y)
    if padding:  # in batch-invariant mode every group spans >= MIN_ROWS rows (`expert_layout`)
        out_RY = torch.empty(a_RX.shape[0], y, dtype=a_RX.dtype, device=a_RX.device)
        for e, lo, _, hi in lay.groups:
            torch.mm(a_RX[lo:hi], w_EXY[e], out=out_RY[lo:hi])
        return out_RY
    alloc = torch.zeros if any(end != hi for _, _, end, hi in lay.groups) else torch.empty
    out_RY = alloc(a_RX.shape[0], y, dtype=a_RX.dtype, device=a_RX.device)
    pad = batch_invariant()  # fewer rows would take BLAS's small-matrix paths (t1kernels.rows)
    for e, lo, hi, _ in lay.groups:
        if pad and hi - lo < MIN_ROWS:
            out_RY[lo:hi] = torch.mm(pad_rows(a_RX[lo:hi]), w_EXY[e])[:hi - lo]
        else:
            torch.mm(a_RX[lo:hi], w_EXY[e], out=out_RY[lo:hi])
    return out_RY


def _expert_outer(a_RX: torch.Tensor, b_RY: torch.Tensor, num_experts: int, lay: ExpertLayout) -> torch.Tensor:
    """out[e] = sum over rows r of expert e of a[r]^T b[r], [E, X, Y] (zero for unused experts)."""
    x, y = a_RX.shape[1], b_RY.shape[1]
    if lay.groups is None:
        return torch.bmm(a_RX.view(num_experts, lay.capacity, x).transpose(1, 2), b_RY.view(num_experts, lay.capacity, y))
    out_EXY = torch.empty(num_experts, x, y, dtype=a_RX.dtype, device=a_RX.device)  # each block written once
    for e, lo, hi, _ in lay.groups:  # the pairs' rows only (padding rows would change the sum's blocking)
        torch.mm(a_RX[lo:hi].t(), b_RY[lo:hi], out=out_EXY[e])
    for e in sorted(set(range(num_experts)) - {e for e, *_ in lay.groups}):
        out_EXY[e].zero_()
    return out_EXY


def _combine(rows_RD: torch.Tensor, row_TK: torch.Tensor, weights_TK: torch.Tensor | None,
             acc: torch.dtype) -> torch.Tensor:
    """out[t] = sum over k in index order of weights[t, k] * rows[row_TK[t, k]] (weight 1 when None), in `acc`.

    One [T, D] gather per slot, accumulated in place: no [T, K, D] intermediate (half the memory traffic).
    """
    out_TD = None
    for k in range(row_TK.shape[1]):
        r_TD = rows_RD.index_select(0, row_TK[:, k]).to(acc)
        if weights_TK is None:
            out_TD = r_TD if out_TD is None else out_TD.add_(r_TD)
        else:
            w_T1 = weights_TK[:, k, None]
            out_TD = r_TD.mul_(w_T1) if out_TD is None else out_TD.addcmul_(r_TD, w_T1)
    return out_TD


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_weights(topk_weights_TK: torch.Tensor, lay: ExpertLayout, dtype: torch.dtype) -> torch.Tensor:
    """Combine weight of each work row in `dtype`; 0 on padding rows (this is what keeps their gradients 0)."""
    w_R = torch.zeros(lay.token_R.shape[0], dtype=dtype, device=topk_weights_TK.device)
    return w_R.scatter_(0, lay.row_P, topk_weights_TK.reshape(-1).to(dtype))


@dataclass(frozen=True)
class MoESaved:
    """What the forward keeps for the backward: O(R * (D + 2F)) per layer, no recompute needed."""

    xs_RD: torch.Tensor
    """Input row of each work row."""
    h_RF2: torch.Tensor
    """Pre-activation [g; u] = w13[e] @ x of each work row."""
    layout: ExpertLayout


def moe_fwd_saving(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, topk_ids_TK: torch.Tensor,
                   topk_weights_TK: torch.Tensor) -> tuple[torch.Tensor, MoESaved]:
    """Forward of the fused MoE on the torch path (see `t1kernels.moe.fused_moe`) and the state its backward needs."""
    T, K = topk_ids_TK.shape
    num_e, num_f = w13_EFD.shape[0], w2_EDF.shape[2]
    lay = expert_layout(topk_ids_TK, num_e)
    xs_RD = x_TD.index_select(0, lay.token_R)
    # Batch-invariant mode: row-major copies of the weights, whose products do not depend on the row count.
    w13_EDF, w2_EFD = ((t_cached(w13_EFD), t_cached(w2_EDF)) if batch_invariant()
                       else (w13_EFD.transpose(1, 2), w2_EDF.transpose(1, 2)))
    h_RF2 = _rows_mm(xs_RD, w13_EDF, lay, padding=True)
    a_RF = F.silu(h_RF2[:, :num_f]).mul_(h_RF2[:, num_f:])
    o_RD = _rows_mm(a_RF, w2_EFD, lay, padding=True)
    acc = _acc_dtype(x_TD.dtype)  # fp32 / fp64 accumulation of the weighted sum over K
    y_TD = _combine(o_RD, lay.row_P.view(T, K), topk_weights_TK.to(acc), acc).to(x_TD.dtype)
    return y_TD, MoESaved(xs_RD=xs_RD, h_RF2=h_RF2, layout=lay)


def moe_bwd_saved(dy_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, topk_weights_TK: torch.Tensor,
                  saved: MoESaved) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx, dw13, dw2, dtopk_weights) of the fused MoE from the forward's saved state.

    Per row (pair (t, k) on expert e, weight w) with h = [g; u], a = silu(g) u, o = w2[e] a, s = w2[e]^T dy[t]:
    dw[t,k] = <dy[t], o> = <s, a>, dW2[e] += dy[t] (w a)^T, da = w s,
    dg = da u silu'(g), du = da silu(g), dW13[e] += [dg; du] x[t]^T, dx[t] += w13[e]^T [dg; du].
    Padding rows have w = 0, so they add exactly zero to dW2, dW13; their dx and dw rows are never read.
    """
    T, K = topk_weights_TK.shape
    num_e, num_f = w13_EFD.shape[0], w2_EDF.shape[2]
    lay, xs_RD, h_RF2 = saved.layout, saved.xs_RD, saved.h_RF2
    dtype, acc = xs_RD.dtype, _acc_dtype(xs_RD.dtype)
    w_R1 = _row_weights(topk_weights_TK, lay, dtype).unsqueeze(1)
    g_RF, u_RF = h_RF2[:, :num_f], h_RF2[:, num_f:]
    silu_RF = F.silu(g_RF)
    a_RF = silu_RF * u_RF
    dys_RD = dy_TD.index_select(0, lay.token_R)
    s_RF = _rows_mm(dys_RD, w2_EDF, lay, padding=False)
    dw_R = (s_RF.to(acc) * a_RF.to(acc)).sum(-1)
    dw2_EDF = _expert_outer(dys_RD, a_RF.mul_(w_R1), num_e, lay)
    da_RF = s_RF.mul_(w_R1)
    dh_RF2 = torch.empty_like(h_RF2)
    torch.mul(da_RF, silu_RF, out=dh_RF2[:, num_f:])
    # dg = da u silu'(g): autograd's own fused silu backward, one pass instead of five elementwise ops.
    torch.ops.aten.silu_backward.grad_input(da_RF.mul_(u_RF), g_RF, grad_input=dh_RF2[:, :num_f])
    dw13_EFD = _expert_outer(dh_RF2, xs_RD, num_e, lay)
    dxs_RD = _rows_mm(dh_RF2, w13_EFD, lay, padding=False)
    dx_TD = _combine(dxs_RD, lay.row_P.view(T, K), None, acc).to(dtype)
    dtopk_w = dw_R.index_select(0, lay.row_P).view(T, K).to(topk_weights_TK.dtype)
    return dx_TD, dw13_EFD, dw2_EDF, dtopk_w


def moe_fwd(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, topk_ids_TK: torch.Tensor,
            topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Forward of the fused MoE on the torch path (see `t1kernels.moe.fused_moe`)."""
    return moe_fwd_saving(x_TD, w13_EFD, w2_EDF, topk_ids_TK, topk_weights_TK)[0]


def moe_bwd(dy_TD: torch.Tensor, x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor,
            topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx, dw13, dw2, dtopk_weights) from the inputs alone: reruns the forward, then `moe_bwd_saved`."""
    _, saved = moe_fwd_saving(x_TD, w13_EFD, w2_EDF, topk_ids_TK, topk_weights_TK)
    return moe_bwd_saved(dy_TD, w13_EFD, w2_EDF, topk_weights_TK, saved)


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
