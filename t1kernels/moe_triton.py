"""Triton kernels of the fused MoE dispatch: alignment, forward, and the pieces the backward shares
(`t1kernels.moe_triton_bwd`), grouped by expert, no host synchronisation.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k, P = T*K (token, slot) pairs,
M = padded row count (pairs sorted by expert, each expert's rows padded to a multiple of BLOCK_M).

Layout: `align_by_expert` sorts the P pairs by expert on device and gives every expert a BLOCK_M-aligned
segment of a row buffer sized by the upper bound P + min(E, P) * (BLOCK_M - 1), so no count is read on the host.
Blocks past the last expert's segment exit at once. Each program of the grouped GEMMs handles BLOCK_M rows of a
single expert. Outputs per pair are written to the sorted rows and reduced over K by a gather-sum kernel
(fixed order: deterministic, no float atomics). A training forward keeps the alignment and the pre-activations
h [M, 2F] for the backward (no second sort, no recomputed up projection); `fused_moe(..., recompute=True)` keeps
neither and the backward recomputes both. Pointer offsets are int64 (packed RL batches pass 2^31 elements). fp32
inputs use IEEE dots (PREC="ieee": TF32 would miss fp32 tolerances); bf16/fp16 take the default tensor-core path
(PREC="tf32", which only affects fp32 operands) and accumulate in fp32. Scratch comes from `t1kernels.scratch`: not
NaN-filled under deterministic mode, since every element a kernel reads was written by an earlier kernel. E and
TOPK are runtime arguments, not constexprs: one compile serves every expert count and top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from t1kernels.backend import interpreter_on
from t1kernels.scratch import empty_unfilled, scratch


@dataclass(frozen=True)
class ExpertAlignment:
    """Pairs grouped by expert into BLOCK_M-aligned segments of a row buffer (all tensors on device)."""

    sorted_pair_M: torch.Tensor
    """int32 [M]: pair index (t * K + k) of each row; -1 for padding rows."""
    block_expert_B: torch.Tensor
    """int32 [M / BLOCK_M]: expert of each row block; E for blocks past the last segment (they exit)."""
    seg_start_E1: torch.Tensor
    """int64 [E + 1]: first row of each expert's segment; the last entry ends the last segment."""
    row_of_pair_P: torch.Tensor
    """int64 [P]: row of each pair (the gather index of the combine)."""
    block_m: int
    """Rows per block (segment alignment)."""
    top_k: int
    """K: slots per token (pair p belongs to token p // K); every kernel that maps rows to tokens reads it."""


def align_by_expert(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort pairs by expert (stable) and pad each expert's rows to block_m, with device ops only."""
    dev = topk_ids_TK.device
    P = topk_ids_TK.numel()
    # Narrow keys: the radix sort makes one pass per key byte (uint8 for E <= 256: one pass instead of eight).
    key_dtype = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32
    keys_sorted, order_P = torch.sort(topk_ids_TK.reshape(-1).to(key_dtype), stable=True)
    ids_sorted = keys_sorted.long()
    # First sorted position of every expert (and P at the end): exact, no atomics, no host read.
    first_E1 = torch.searchsorted(ids_sorted, torch.arange(num_experts + 1, device=dev))
    counts_E = first_E1.diff()
    first_E = first_E1[:-1]
    padded_E = (counts_E + block_m - 1) // block_m * block_m
    seg_end_E = torch.cumsum(padded_E, 0)
    seg_start_E1 = torch.cat([seg_end_E.new_zeros(1), seg_end_E])
    row_sorted = seg_start_E1[ids_sorted] + torch.arange(P, device=dev) - first_E[ids_sorted]
    num_rows = triton.cdiv(P + min(num_experts, P) * (block_m - 1), block_m) * block_m
    sorted_pair_M = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    sorted_pair_M[row_sorted] = order_P.to(torch.int32)
    row_of_pair_P = torch.empty_like(row_sorted)
    row_of_pair_P[order_P] = row_sorted
    block_starts = torch.arange(0, num_rows, block_m, device=dev)
    block_expert_B = torch.searchsorted(seg_end_E, block_starts, right=True).to(torch.int32)
    return ExpertAlignment(sorted_pair_M, block_expert_B, seg_start_E1, row_of_pair_P, block_m,
                           topk_ids_TK.shape[1])


@triton.jit
def _sigmoid(g):
    # exp-based (no libdevice): the interpreter cannot run libdevice calls.
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _row_block(block_expert_ptr, sorted_pair_ptr, N, TOPK, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Program -> (expert, rows [BLOCK_M] int64, pair, valid, token int64, column offsets [BLOCK_N])."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    valid = pair >= 0
    tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, rows, pair, valid, tok, offs_n


@triton.jit
def _row_slice(sorted_pair_ptr, r0, end, TOPK, BLOCK_R: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R of one expert's segment, masked at its end -> (rows, pair, valid, token int64).
    The mask lets the weight gradients step through a segment in steps other than its alignment."""
    rows = r0 + tl.arange(0, BLOCK_R)
    pair = tl.load(sorted_pair_ptr + rows, mask=rows < end, other=-1)
    valid = pair >= 0
    return rows, pair, valid, tl.where(valid, pair // TOPK, 0).to(tl.int64)


@triton.jit
def _moe_up_kernel(x_ptr, w13_ptr, h_ptr, act_ptr, sorted_pair_ptr, block_expert_ptr,
                   D, F, s_xt, s_xd, s_we, s_wf, s_wd, s_hm, s_hf, s_am, s_af,
                   E, TOPK, STORE_H: tl.constexpr, STORE_ACT: tl.constexpr,
                   PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows r of one expert e: [g; u] = w13[e] @ x[token(r)]; writes h = [g; u] (STORE_H) to h_ptr and/or
    a = silu(g) u (STORE_ACT) to act_ptr."""
    e, rows, pair, valid, tok, offs_f = _row_block(block_expert_ptr, sorted_pair_ptr, F, TOPK, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * s_xt + offs_k[None, :] * s_xd  # [BLOCK_M, BLOCK_K]
    wg_ptrs = w13_ptr + e * s_we + offs_f[None, :].to(tl.int64) * s_wf + offs_k[:, None] * s_wd  # [BLOCK_K, BLOCK_N]
    wu_ptrs = wg_ptrs + F * s_wf
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        xt = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & (offs_f[None, :] < F)
        wg = tl.load(wg_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(wu_ptrs, mask=w_mask, other=0.0)
        acc_g = tl.dot(xt, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(xt, wu, acc_u, input_precision=PREC)
        x_ptrs += BLOCK_K * s_xd
        wg_ptrs += BLOCK_K * s_wd
        wu_ptrs += BLOCK_K * s_wd
    f_ok = (offs_f < F)[None, :]
    if STORE_H:
        h_ptrs = h_ptr + rows[:, None] * s_hm + offs_f[None, :] * s_hf  # [BLOCK_M, BLOCK_N]
        tl.store(h_ptrs, acc_g.to(h_ptr.dtype.element_ty), mask=f_ok)
        tl.store(h_ptrs + F * s_hf, acc_u.to(h_ptr.dtype.element_ty), mask=f_ok)
    if STORE_ACT:
        a = acc_g * _sigmoid(acc_g) * acc_u
        act_ptrs = act_ptr + rows[:, None] * s_am + offs_f[None, :] * s_af  # [BLOCK_M, BLOCK_N]
        tl.store(act_ptrs, a.to(act_ptr.dtype.element_ty), mask=f_ok)


@triton.jit
def _moe_rows_gemm_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_pair_ptr, block_expert_ptr,
                          N, J, s_am, s_aj, s_we, s_wn, s_wj, s_om, s_on,
                          E, MUL_WEIGHT: tl.constexpr,
                          PREC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows r of one expert e: out[r, n] = (weight[pair(r)] *) sum_j a[r, j] W[e, n, j].

    Forward down projection (a = act, W = w2) and backward input gradient (a = dh, W = w13 read transposed).
    """
    e, rows, pair, valid, _, offs_n = _row_block(block_expert_ptr, sorted_pair_ptr, N, 1, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * s_am + offs_k[None, :] * s_aj  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + e * s_we + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None] * s_wj  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, J, BLOCK_K):
        k_ok = offs_k < J - k0
        at = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(at, wt, acc, input_precision=PREC)
        a_ptrs += BLOCK_K * s_aj
        w_ptrs += BLOCK_K * s_wj
    if MUL_WEIGHT:
        wt_r = tl.load(weights_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        acc = acc * wt_r[:, None]
    out_ptrs = out_ptr + rows[:, None] * s_om + offs_n[None, :] * s_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < N)[None, :])


@triton.jit
def _moe_combine_kernel(src_ptr, row_of_pair_ptr, out_ptr, T, D, s_sm, s_sd, s_ot, s_od,
                        TOPK, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_k src[row(t, k)], summed over k in index order in fp32 (deterministic)."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = offs_t < T
    mask = t_ok[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)  # [BLOCK_T, BLOCK_D]
    for k in range(TOPK):
        rows = tl.load(row_of_pair_ptr + offs_t * TOPK + k, mask=t_ok, other=0)
        acc += tl.load(src_ptr + rows[:, None] * s_sm + offs_d[None, :] * s_sd, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * s_ot + offs_d[None, :] * s_od, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Tile:
    """Launch settings of one kernel: output tile width, reduction step, warps, pipeline depth."""

    block_n: int
    """Output columns per program (for the weight gradients: the tile's first edge)."""
    block_k: int
    """Reduction step (for the weight gradients: the tile's second edge; their reduction step is dw_step)."""
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of one fused_moe call, per kernel (fixed, not autotuned: the interpreter cannot autotune).

    block_m is shared: it is the segment alignment of `align_by_expert`, which every kernel of a call reads.
    """

    block_m: int
    """Rows per block of the grouped GEMMs and the segment alignment."""
    up: Tile
    """x @ w13[e]^T with SwiGLU fused (forward) or stored as h (backward's recompute); two accumulators."""
    down: Tile
    """act @ w2[e]^T times the combine weight (forward)."""
    dact: Tile
    """dy @ w2[e] -> dh and the partial combine-weight gradients (backward)."""
    dx: Tile
    """dh @ w13[e] -> per-row dx (backward)."""
    dw: Tile
    """dW2 and dW13 tiles, [block_n, block_k] per program, looping over one chunk of an expert's rows (backward)."""
    dw_step: int
    """Rows per reduction step of the weight gradients (any power of two: slices are masked at segment ends)."""
    dw_splits: int
    """Chunks a weight gradient may split one expert's rows into: chunks hold max(dw_step, M / dw_splits) rows
    (rounded up to dw_step), so a hot expert gets up to dw_splits times the programs, and the fp32 partials of
    split experts take at most 2 * dw_splits dW-sized buffers."""
    prec: str
    """tl.dot input precision: "ieee" for fp32 operands; bf16/fp16 ignore it (default "tf32")."""
    combine_block_d: int
    """Columns per program of the combine (gather-sum over K)."""


def _same(tile: Tile, block_m: int, dw_step: int, prec: str, combine_block_d: int) -> MoEConfig:
    return MoEConfig(block_m, tile, tile, tile, tile, tile, dw_step, dw_splits=8, prec=prec,
                     combine_block_d=combine_block_d)


def moe_config(dtype: torch.dtype) -> MoEConfig:
    """Tiles for this input dtype. Interpreter: the smallest tiles tl.dot accepts (programs run one by one in
    numpy), with a weight-gradient step twice the alignment so that the tests cross segment ends. GPU (anything
    else: CPU tensors only reach the Triton path through the interpreter): tiles for the H100/H200 class at
    Qwen3-MoE widths, picked from sweeps on an H200 (bench/gpu_check_moe.py --sweep, T=8192, E=128, K=8) among the
    tiles that ptxas compiles for sm_90a without register spills (`python -m t1kernels.aot_report`,
    tests/test_moe.py checks it); fp32 runs IEEE dots (slow path, for tests) with smaller tiles to stay inside
    shared memory."""
    if interpreter_on():
        return _same(Tile(16, 16, num_warps=1, num_stages=1), 16, 32, "ieee", 16)
    if dtype == torch.float32:
        return _same(Tile(64, 32, num_warps=4, num_stages=2), 64, 64, "ieee", 64)
    return MoEConfig(64, up=Tile(256, 64, 8, 3), down=Tile(128, 64, 4, 3), dact=Tile(128, 64, 8, 3),
                     dx=Tile(128, 64, 4, 3), dw=Tile(256, 128, 8, 2), dw_step=64, dw_splits=8, prec="tf32",
                     combine_block_d=64)


def _new(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype, fill: float | None) -> torch.Tensor:
    """Scratch buffer on like's device (`t1kernels.scratch`); tests pass fill=nan so that a read of a row no kernel
    wrote shows up."""
    return scratch(shape, dtype=dtype, device=like.device, fill=fill)


def _up(x, w13, al: ExpertAlignment, cfg: MoEConfig, *, store_h: bool, store_act: bool,
        fill: float | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(h [M, 2F] pre-activations if store_h, act [M, F] = silu(g) u if store_act) of the sorted rows."""
    E, F2, D = w13.shape
    F, M, t = F2 // 2, al.sorted_pair_M.numel(), cfg.up
    h = _new((M, F2), x, x.dtype, fill) if store_h else None
    act = _new((M, F), x, x.dtype, fill) if store_act else None
    h_arg, act_arg = (h if h is not None else act), (act if act is not None else h)  # an unused one: any tensor
    grid = (al.block_expert_B.numel() * triton.cdiv(F, t.block_n),)
    _moe_up_kernel[grid](x, w13, h_arg, act_arg, al.sorted_pair_M, al.block_expert_B, D, F,
                         x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
                         h_arg.stride(0), h_arg.stride(1), act_arg.stride(0), act_arg.stride(1),
                         E, al.top_k, STORE_H=store_h, STORE_ACT=store_act,
                         PREC=cfg.prec, BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                         num_warps=t.num_warps, num_stages=t.num_stages)
    return h, act


def _rows_gemm(a, w, w_strides: tuple[int, int, int], N: int, weights, al: ExpertAlignment, cfg: MoEConfig,
               t: Tile, out_dtype: torch.dtype, fill: float | None) -> torch.Tensor:
    """out[r, n] = (weights[pair(r)] *) sum_j a[r, j] W[e, n, j], W given by its (e, n, j) strides."""
    E, J = w.shape[0], a.shape[1]
    out = _new((a.shape[0], N), a, out_dtype, fill)
    grid = (al.block_expert_B.numel() * triton.cdiv(N, t.block_n),)
    _moe_rows_gemm_kernel[grid](a, w, out, weights if weights is not None else a, al.sorted_pair_M,
                                al.block_expert_B, N, J, a.stride(0), a.stride(1), *w_strides,
                                out.stride(0), out.stride(1), E, MUL_WEIGHT=weights is not None, PREC=cfg.prec,
                                BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def _combine(src: torch.Tensor, al: ExpertAlignment, T: int, out_dtype: torch.dtype, cfg: MoEConfig
             ) -> torch.Tensor:
    """out [T, D] = sum over k of src[row(t, k)] (fp32 sum, in index order); the kernel writes every element."""
    D = src.shape[1]
    out = empty_unfilled((T, D), dtype=out_dtype, device=src.device)
    grid = (triton.cdiv(T, 16), triton.cdiv(D, cfg.combine_block_d))
    _moe_combine_kernel[grid](src, al.row_of_pair_P, out, T, D, src.stride(0), src.stride(1),
                              out.stride(0), out.stride(1), al.top_k,
                              BLOCK_T=16, BLOCK_D=cfg.combine_block_d)
    return out


@dataclass(frozen=True)
class MoESavedTriton:
    """What a training forward keeps for its backward: the alignment and the pre-activations h [M, 2F]."""

    alignment: ExpertAlignment
    h: torch.Tensor


def moe_fwd_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, *, save: bool = False, scratch_fill: float | None = None
                   ) -> tuple[torch.Tensor, MoESavedTriton | None]:
    """Forward of `t1kernels.moe.fused_moe` (inputs contiguous and checked there) -> (y, saved).

    save=True also writes h = [g; u] [M, 2F] and returns it with the alignment, so the backward neither sorts
    again nor recomputes the up projection; save=False (inference, or a memory-bound backward that recomputes)
    keeps scratch at [M, F] + [M, D], freed on return.
    """
    T, D = x.shape
    if T == 0:
        return x.new_zeros((0, D)), None
    cfg = moe_config(x.dtype)
    al = align_by_expert(topk_ids, w13.shape[0], cfg.block_m)
    h, act = _up(x, w13, al, cfg, store_h=save, store_act=True, fill=scratch_fill)
    o = _rows_gemm(act, w2, (w2.stride(0), w2.stride(1), w2.stride(2)), D, topk_weights, al, cfg, cfg.down,
                   x.dtype, scratch_fill)
    return _combine(o, al, T, x.dtype, cfg), (MoESavedTriton(al, h) if save else None)
