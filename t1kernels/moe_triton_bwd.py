"""Triton kernels of the fused MoE backward: combine-weight and activation gradients, dx, and the expert weight
gradients split into fixed row chunks. No host synchronisation.

Legend as in `t1kernels.moe_triton` (T tokens, D model dim, F expert hidden dim, E experts, K top-k, M padded rows),
plus C chunks and S partial slots. The rows of each expert's segment are cut into chunks of a fixed size
(`dw_chunks`: max(dw_step, M / dw_splits) rounded up to dw_step, known on the host from M alone). One program per
(chunk, tile) sums its chunk's rows into an fp32 tile. An expert with one chunk (every expert under uniform
routing) writes dW[e] directly; a hot expert's chunks write fp32 partial slots, which `_moe_dw_reduce_kernel` sums
in chunk order. The chunk table is built on the device from an upper bound on the chunk count (C <= E + M / chunk),
so nothing is read on the host, and the reduction order depends only on the routing: deterministic.

dx: the per-row products dh @ w13[e] are kept in the input dtype ([M, D] bf16 for bf16 inputs, half the fp32
buffer) and summed over K in fp32 by the same gather-sum as the forward's combine, whose per-row outputs are
rounded to the input dtype the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from t1kernels.moe_triton import (ExpertAlignment, MoEConfig, MoESavedTriton, _combine, _new, _row_block, _row_slice,
                                _rows_gemm, _sigmoid, _up, align_by_expert, moe_config)
from t1kernels.scratch import empty_unfilled

_REDUCE_BLOCK = 1024


@triton.jit
def _moe_dact_kernel(dy_ptr, w2_ptr, h_ptr, weights_ptr, dh_ptr, dwp_ptr, sorted_pair_ptr, block_expert_ptr,
                     D, F, s_yt, s_yd, s_we, s_wd, s_wf, s_hm, s_hf, s_pm, s_pn,
                     E, TOPK,
                     PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows r of expert e: s = w2[e]^T dy[token(r)]; partial dtopk_weights = <s, a> over this F tile;
    dh = [w s u silu'(g); w s silu(g)] with [g; u] = h[r] and w = topk_weights[pair(r)]."""
    e, rows, pair, valid, tok, offs_f = _row_block(block_expert_ptr, sorted_pair_ptr, F, TOPK, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    pid_n = tl.program_id(0) % tl.cdiv(F, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    f_ok = offs_f < F
    dy_ptrs = dy_ptr + tok[:, None] * s_yt + offs_k[None, :] * s_yd  # [BLOCK_M, BLOCK_K]
    w_ptrs = w2_ptr + e * s_we + offs_k[:, None].to(tl.int64) * s_wd + offs_f[None, :] * s_wf  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        dyt = tl.load(dy_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None] & f_ok[None, :], other=0.0)
        acc = tl.dot(dyt, wt, acc, input_precision=PREC)
        dy_ptrs += BLOCK_K * s_yd
        w_ptrs += BLOCK_K * s_wd
    h_ptrs = h_ptr + rows[:, None] * s_hm + offs_f[None, :] * s_hf
    hm = valid[:, None] & f_ok[None, :]
    g = tl.load(h_ptrs, mask=hm, other=0.0).to(tl.float32)
    u = tl.load(h_ptrs + F * s_hf, mask=hm, other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    silu = g * sig
    tl.store(dwp_ptr + rows * s_pm + pid_n * s_pn, tl.sum(acc * silu * u, axis=1), mask=valid)
    da = acc * tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)[:, None]
    dh_ptrs = dh_ptr + rows[:, None] * s_hm + offs_f[None, :] * s_hf
    tl.store(dh_ptrs, (da * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask=hm)
    tl.store(dh_ptrs + F * s_hf, (da * silu).to(dh_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _dw_chunk(chunk_expert_ptr, chunk_row0_ptr, chunk_row1_ptr, chunk_slot_ptr, NI, NJ,
              BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Program -> (expert, rows [r0, r1), partial slot (-1: write dW[e] itself), offsets [BLOCK_I], [BLOCK_J]) of
    one (chunk, tile) of a per-expert weight gradient."""
    pid = tl.program_id(0)
    num_i = tl.cdiv(NI, BLOCK_I)
    num_j = tl.cdiv(NJ, BLOCK_J)
    c = pid // (num_i * num_j)
    tile = pid % (num_i * num_j)
    e = tl.load(chunk_expert_ptr + c).to(tl.int64)
    r0 = tl.load(chunk_row0_ptr + c)
    r1 = tl.load(chunk_row1_ptr + c)
    slot = tl.load(chunk_slot_ptr + c).to(tl.int64)
    offs_i = (tile // num_j) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = (tile % num_j) * BLOCK_J + tl.arange(0, BLOCK_J)
    return e, r0, r1, slot, offs_i, offs_j


@triton.jit
def _store_dw(acc, e, slot, out_ptr, part_ptr, offs_i, offs_j, NI, NJ, s_oe, s_oi, s_oj):
    """A chunk's [BLOCK_I, BLOCK_J] fp32 sum: into dW[e] when it is the expert's only chunk, else into its fp32
    partial slot ([slots, NI, NJ], contiguous) for `_moe_dw_reduce_kernel`."""
    mask = (offs_i < NI)[:, None] & (offs_j < NJ)[None, :]
    if slot < 0:
        out = out_ptr + e * s_oe + offs_i[:, None].to(tl.int64) * s_oi + offs_j[None, :] * s_oj
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + slot * NI * NJ + offs_i[:, None].to(tl.int64) * NJ + offs_j[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit
def _moe_dw2_kernel(dy_ptr, h_ptr, weights_ptr, dw2_ptr, part_ptr, sorted_pair_ptr,
                    chunk_expert_ptr, chunk_row0_ptr, chunk_row1_ptr, chunk_slot_ptr,
                    D, F, s_yt, s_yd, s_hm, s_hf, s_ge, s_gd, s_gf,
                    E, TOPK, PREC: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """dw2[e, d, f] = sum over expert e's rows r of w[pair(r)] dy[token(r), d] * silu(g[r, f]) u[r, f]; this
    program sums the rows of one chunk."""
    e, start, end, slot, offs_d, offs_f = _dw_chunk(chunk_expert_ptr, chunk_row0_ptr, chunk_row1_ptr,
                                                    chunk_slot_ptr, D, F, BLOCK_I, BLOCK_J)
    if e >= E:
        return
    d_ok = offs_d < D
    f_ok = offs_f < F
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)  # [BLOCK_I (d), BLOCK_J (f)]
    for r0 in range(start, end, BLOCK_R):
        rows, pair, valid, tok = _row_slice(sorted_pair_ptr, r0, end, TOPK, BLOCK_R)
        wt_r = tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        dyt = tl.load(dy_ptr + tok[None, :] * s_yt + offs_d[:, None] * s_yd,
                      mask=valid[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_I, BLOCK_R]
        do_t = (dyt.to(tl.float32) * wt_r[None, :]).to(dyt.dtype)
        h_ptrs = h_ptr + rows[:, None] * s_hm + offs_f[None, :] * s_hf  # [BLOCK_R, BLOCK_J]
        hm = valid[:, None] & f_ok[None, :]
        g = tl.load(h_ptrs, mask=hm, other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + F * s_hf, mask=hm, other=0.0).to(tl.float32)
        a = (g * _sigmoid(g) * u).to(dyt.dtype)
        acc = tl.dot(do_t, a, acc, input_precision=PREC)
    _store_dw(acc, e, slot, dw2_ptr, part_ptr, offs_d, offs_f, D, F, s_ge, s_gd, s_gf)


@triton.jit
def _moe_dw13_kernel(dh_ptr, x_ptr, dw13_ptr, part_ptr, sorted_pair_ptr,
                     chunk_expert_ptr, chunk_row0_ptr, chunk_row1_ptr, chunk_slot_ptr,
                     F2, D, s_hm, s_hf, s_xt, s_xd, s_ge, s_gf, s_gd,
                     E, TOPK, PREC: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """dw13[e, j, d] = sum over expert e's rows r of dh[r, j] * x[token(r), d]; this program sums one chunk."""
    e, start, end, slot, offs_f, offs_d = _dw_chunk(chunk_expert_ptr, chunk_row0_ptr, chunk_row1_ptr,
                                                    chunk_slot_ptr, F2, D, BLOCK_I, BLOCK_J)
    if e >= E:
        return
    f_ok = offs_f < F2
    d_ok = offs_d < D
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)  # [BLOCK_I (2F), BLOCK_J (d)]
    for r0 in range(start, end, BLOCK_R):
        rows, pair, valid, tok = _row_slice(sorted_pair_ptr, r0, end, TOPK, BLOCK_R)
        dht = tl.load(dh_ptr + rows[None, :] * s_hm + offs_f[:, None] * s_hf,
                      mask=valid[None, :] & f_ok[:, None], other=0.0)  # [BLOCK_I, BLOCK_R]
        xt = tl.load(x_ptr + tok[:, None] * s_xt + offs_d[None, :] * s_xd,
                     mask=valid[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_J]
        acc = tl.dot(dht, xt, acc, input_precision=PREC)
    _store_dw(acc, e, slot, dw13_ptr, part_ptr, offs_f, offs_d, F2, D, s_ge, s_gf, s_gd)


@triton.jit
def _moe_dw_reduce_kernel(part_ptr, out_ptr, num_chunks_ptr, slot_first_ptr, NUMEL, BLOCK: tl.constexpr):
    """out[e] = sum of expert e's fp32 partial slots in chunk order, for experts split into several chunks
    (the others were written by their only chunk). out is [E, NUMEL] contiguous."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.load(num_chunks_ptr + e)
    if n <= 1:
        return
    first = tl.load(slot_first_ptr + e)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, n):
        acc += tl.load(part_ptr + (first + s) * NUMEL + offs, mask=mask, other=0.0)
    tl.store(out_ptr + e * NUMEL + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class DWChunks:
    """Row chunks of the weight gradients (device tensors, built without a host read) and their partial slots."""

    chunk_rows: int
    """Rows per chunk (the last chunk of an expert may be shorter)."""
    expert_C: torch.Tensor
    """int32 [C]: expert of each chunk; E for chunks past the last (their programs exit)."""
    row0_C: torch.Tensor
    """int64 [C]: first row of each chunk."""
    row1_C: torch.Tensor
    """int64 [C]: end row of each chunk (exclusive)."""
    slot_C: torch.Tensor
    """int32 [C]: fp32 partial slot of the chunk; -1 when it is its expert's only chunk (written to dW[e])."""
    num_chunks_E: torch.Tensor
    """int32 [E]: chunks per expert (1 for an empty expert: its one chunk writes zeros)."""
    slot_first_E: torch.Tensor
    """int64 [E]: first partial slot of each split expert."""
    num_slots: int
    """Host bound on the partial slots in use: 2 * ceil(M / chunk_rows) (a split expert has > chunk_rows rows)."""


def dw_chunk_rows(num_rows: int, cfg: MoEConfig) -> int:
    """Rows per weight-gradient chunk for a row buffer of num_rows rows: a multiple of cfg.dw_step."""
    per_split = triton.cdiv(num_rows, cfg.dw_splits)
    return max(cfg.dw_step, triton.cdiv(per_split, cfg.dw_step) * cfg.dw_step)


def dw_chunks(al: ExpertAlignment, cfg: MoEConfig) -> DWChunks:
    """Cut every expert's segment into chunks of `dw_chunk_rows` rows, with device ops only."""
    dev, M = al.seg_start_E1.device, al.sorted_pair_M.numel()
    E = al.seg_start_E1.numel() - 1
    ch = dw_chunk_rows(M, cfg)
    seg_E1 = al.seg_start_E1
    n_E = ((seg_E1.diff() + ch - 1) // ch).clamp_min(1)
    end_E = torch.cumsum(n_E, 0)
    split_E = torch.where(n_E > 1, n_E, 0)
    slot_first_E = torch.cumsum(split_E, 0) - split_E
    c = torch.arange(E + triton.cdiv(M, ch), device=dev)
    e_C = torch.searchsorted(end_E, c, right=True)
    e_in = e_C.clamp_max(E - 1)
    local_C = c - (end_E - n_E)[e_in]
    row0_C = seg_E1[e_in] + local_C * ch
    row1_C = torch.minimum(row0_C + ch, seg_E1[e_in + 1])
    slot_C = torch.where(n_E[e_in] > 1, slot_first_E[e_in] + local_C, -1)
    return DWChunks(ch, e_C.to(torch.int32), row0_C, row1_C, slot_C.to(torch.int32), n_E.to(torch.int32),
                    slot_first_E, 2 * triton.cdiv(M, ch))


def moe_bwd_triton(dy: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, saved: MoESavedTriton | None = None,
                   scratch_fill: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw13, dw2, dtopk_weights). Uses the forward's alignment and h when given (`saved`), else sorts
    again and recomputes h = w13 x per row. Scratch: [M, 2F] (dh) + [M, D] in x's dtype (+ [M, 2F] when
    recomputing) + fp32 partials of split experts (at most 2 * dw_splits dW-sized buffers per weight)."""
    T, D = x.shape
    E = w13.shape[0]
    if T == 0:
        return x.new_zeros((0, D)), torch.zeros_like(w13), torch.zeros_like(w2), torch.zeros_like(topk_weights)
    cfg = moe_config(x.dtype)
    if saved is not None:
        al, h = saved.alignment, saved.h
    else:
        al = align_by_expert(topk_ids, E, cfg.block_m)
        h, _ = _up(x, w13, al, cfg, store_h=True, store_act=False, fill=scratch_fill)
    dh, dwp = _dact(dy, w2, h, topk_weights, al, cfg, scratch_fill)
    # Per-pair sum over the F tiles in tile order (deterministic), then back to (token, slot) order.
    dtopk_w = dwp.sum(dim=1)[al.row_of_pair_P].view(T, al.top_k).to(topk_weights.dtype)
    # dx rows: W[e, n=d, j] = w13[e, j, d], i.e. w13 read with its last two strides swapped. Rows in x's dtype
    # (fp32 accumulation inside each row's GEMM and in the gather-sum over K).
    dxs = _rows_gemm(dh, w13, (w13.stride(0), w13.stride(2), w13.stride(1)), D, None, al, cfg, cfg.dx,
                     x.dtype, scratch_fill)
    dx = _combine(dxs, al, T, x.dtype, cfg)
    del dxs
    chunks = dw_chunks(al, cfg)
    dw2 = _dw2(dy, h, topk_weights, al, chunks, cfg, w2, scratch_fill)
    dw13 = _dw13(dh, x, al, chunks, cfg, w13, scratch_fill)
    return dx, dw13, dw2, dtopk_w


def _dact(dy, w2, h, topk_weights, al: ExpertAlignment, cfg: MoEConfig, fill: float | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh [M, 2F], per-row partial combine-weight gradients [M, F / dact.block_n] in fp32; padding rows of the
    latter are not written and never read back: only real pairs' rows are gathered)."""
    E, D, F = w2.shape
    M, t = al.sorted_pair_M.numel(), cfg.dact
    dh = _new((M, 2 * F), h, h.dtype, fill)
    num_fn = triton.cdiv(F, t.block_n)
    dwp = _new((M, num_fn), h, torch.float32, fill)
    _moe_dact_kernel[(al.block_expert_B.numel() * num_fn,)](
        dy, w2, h, topk_weights, dh, dwp, al.sorted_pair_M, al.block_expert_B, D, F,
        dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), h.stride(0), h.stride(1),
        dwp.stride(0), dwp.stride(1), E, al.top_k, PREC=cfg.prec, BLOCK_M=cfg.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages)
    return dh, dwp


def _partials(w: torch.Tensor, chunks: DWChunks, fill: float | None) -> torch.Tensor:
    """fp32 partial slots [S, dW of one expert] (slot 0 stands in when there are none: never written)."""
    return _new((max(chunks.num_slots, 1), *w.shape[1:]), w, torch.float32, fill)


def _reduce(part: torch.Tensor, out: torch.Tensor, chunks: DWChunks) -> None:
    """out[e] = sum of e's partial slots in chunk order, for split experts (one program per (expert, block))."""
    numel = out[0].numel()
    _moe_dw_reduce_kernel[(out.shape[0], triton.cdiv(numel, _REDUCE_BLOCK))](
        part, out, chunks.num_chunks_E, chunks.slot_first_E, numel, BLOCK=_REDUCE_BLOCK)


def _dw2(dy, h, topk_weights, al: ExpertAlignment, chunks: DWChunks, cfg: MoEConfig, w2,
         fill: float | None = None) -> torch.Tensor:
    E, D, F = w2.shape
    t = cfg.dw
    dw2 = empty_unfilled(tuple(w2.shape), dtype=w2.dtype, device=w2.device)  # every element written once
    part = _partials(w2, chunks, fill)
    _moe_dw2_kernel[(chunks.expert_C.numel() * triton.cdiv(D, t.block_n) * triton.cdiv(F, t.block_k),)](
        dy, h, topk_weights, dw2, part, al.sorted_pair_M, chunks.expert_C, chunks.row0_C, chunks.row1_C,
        chunks.slot_C, D, F, dy.stride(0), dy.stride(1), h.stride(0), h.stride(1),
        dw2.stride(0), dw2.stride(1), dw2.stride(2), E, al.top_k,
        PREC=cfg.prec, BLOCK_R=cfg.dw_step, BLOCK_I=t.block_n, BLOCK_J=t.block_k, num_warps=t.num_warps,
        num_stages=t.num_stages)
    _reduce(part, dw2, chunks)
    return dw2


def _dw13(dh, x, al: ExpertAlignment, chunks: DWChunks, cfg: MoEConfig, w13,
          fill: float | None = None) -> torch.Tensor:
    E, F2, D = w13.shape
    t = cfg.dw
    dw13 = empty_unfilled(tuple(w13.shape), dtype=w13.dtype, device=w13.device)  # every element written once
    part = _partials(w13, chunks, fill)
    _moe_dw13_kernel[(chunks.expert_C.numel() * triton.cdiv(F2, t.block_n) * triton.cdiv(D, t.block_k),)](
        dh, x, dw13, part, al.sorted_pair_M, chunks.expert_C, chunks.row0_C, chunks.row1_C, chunks.slot_C,
        F2, D, dh.stride(0), dh.stride(1), x.stride(0), x.stride(1),
        dw13.stride(0), dw13.stride(1), dw13.stride(2), E, al.top_k,
        PREC=cfg.prec, BLOCK_R=cfg.dw_step, BLOCK_I=t.block_n,
        BLOCK_J=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages)
    _reduce(part, dw13, chunks)
    return dw13
