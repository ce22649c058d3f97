"""Triton kernels for log-probs of exact token IDs (CUDA, or the interpreter with TRITON_INTERPRET=1).

Legend: N rows (tokens), D model dim, V vocab, S vocabulary splits. z = hidden @ weight.T / temperature.

Forward: grid (row blocks, vocabulary splits). Each program walks its split in BLOCK_V columns, computes the
[BLOCK_N, BLOCK_V] logits tile with tl.dot over D, and keeps an online max / sum-exp / sum-exp*(z - max) in
fp32, plus the target logit. Splits write partial state [S, N]; a fixed-order torch combine merges them. The
split width is a constant, not a function of N, so each row's result does not depend on the batch around it.

Backward: one vocabulary chunk at a time (width SCRATCH_BYTES / (N * itemsize), at least BLOCK_V), a kernel
recomputes the logits tiles and writes dz = (g_logp * (onehot - p) + g_ent * p * (E_p[z] - z)) / temperature
into a bounded scratch [N, chunk]; two plain GEMMs then give d_weight[chunk] = dz.T @ hidden (complete, written
once) and d_hidden += dz @ weight[chunk], accumulated by the GEMM itself into an fp32 [N, D] (bf16/fp16 operands,
fp32 output: `addmm(..., out_dtype=float32)`), so no chunk's partial product is rounded to bf16 or takes a
separate add pass. The entropy term is compiled in only when an entropy gradient arrives (HAS_GEN): the trainer
skips it when the entropy coefficient is 0. No float atomics anywhere: the result is deterministic run to run.
Scratch is allocated without torch's deterministic NaN fill (`t1kernels.scratch`): the kernels write every element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from t1kernels.backend import interpreter_on
from t1kernels.scratch import empty_unfilled, scratch

# Backward scratch for dz ([N, chunk] in the input dtype): at most this many bytes unless N * BLOCK_V exceeds it.
SCRATCH_BYTES = 256 * 2**20


@triton.jit
def _logits_tile(h_rows, w_cols, n_mask, v_mask, D, stride_hd, stride_wd,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """hidden[rows] @ weight[cols].T as a [BLOCK_N, BLOCK_V] fp32 tile; masked rows/columns give 0."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        h = tl.load(h_rows + offs_d[None, :] * stride_hd,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)        # [BLOCK_N, BLOCK_D]
        w = tl.load(w_cols + offs_d[:, None] * stride_wd,
                    mask=v_mask[None, :] & d_mask[:, None], other=0.0)        # [BLOCK_D, BLOCK_V]
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _logprob_fwd_kernel(h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr,
                        N, V, D, stride_hn, stride_hd, stride_wv, stride_wd,
                        inv_t, ignore_index, vocab_per_split,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                        WITH_ENTROPY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BLOCK_N]
    n_mask = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=ignore_index).to(tl.int32)
    v_start = pid_s * vocab_per_split
    v_end = tl.minimum(v_start + vocab_per_split, V)
    # Finite initial max: alpha * s_i * (m_i - m_new) must be 0 on the first block, not 0 * inf = NaN.
    m_i = tl.full([BLOCK_N], -1.0e30, dtype=tl.float32)
    s_i = tl.zeros([BLOCK_N], dtype=tl.float32)
    t_i = tl.zeros([BLOCK_N], dtype=tl.float32)
    zt_i = tl.zeros([BLOCK_N], dtype=tl.float32)
    h_rows = h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn              # [BLOCK_N, 1]
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)                               # [BLOCK_V]
        v_mask = offs_v < v_end
        w_cols = w_ptr + offs_v.to(tl.int64)[None, :] * stride_wv          # [1, BLOCK_V]
        acc = _logits_tile(h_rows, w_cols, n_mask, v_mask, D, stride_hd, stride_wd,
                           BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION)           # [BLOCK_N, BLOCK_V]
        # Columns past the split (and past V) must not count: a padded column would add exp(0) mass.
        z = tl.where(v_mask[None, :], acc * inv_t, float("-inf"))           # [BLOCK_N, BLOCK_V]
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        alpha = tl.exp(m_i - m_new)
        zs = z - m_new[:, None]
        e = tl.exp(zs)                                                    # 0 on masked columns
        if WITH_ENTROPY:
            # Re-basing the shifted sum from m_i to m_new adds s_i * (m_i - m_new).
            ez = e * tl.where(v_mask[None, :], zs, 0.0)                     # no 0 * -inf
            t_i = alpha * (t_i + s_i * (m_i - m_new)) + tl.sum(ez, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        m_i = m_new
        hit = (tgt[:, None] == offs_v[None, :]) & v_mask[None, :]
        zt_i += tl.sum(tl.where(hit, z, 0.0), axis=1)                       # at most one hit per row overall
    out = pid_s.to(tl.int64) * N + offs_n
    tl.store(m_ptr + out, m_i, mask=n_mask)
    tl.store(s_ptr + out, s_i, mask=n_mask)
    tl.store(t_ptr + out, t_i, mask=n_mask)
    tl.store(zt_ptr + out, zt_i, mask=n_mask)


@triton.jit
def _logprob_bwd_dz_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, mz_ptr, glp_ptr, gen_ptr, dz_ptr,
                           N, D, v_lo, v_hi, stride_hn, stride_hd, stride_wv, stride_wd, stride_dzn,
                           inv_t, ignore_index,
                           HAS_GLP: tl.constexpr, HAS_GEN: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BLOCK_N]
    n_mask = offs_n < N
    offs_v = v_lo + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)               # [BLOCK_V]
    v_mask = offs_v < v_hi
    h_rows = h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn
    w_cols = w_ptr + offs_v.to(tl.int64)[None, :] * stride_wv
    acc = _logits_tile(h_rows, w_cols, n_mask, v_mask, D, stride_hd, stride_wd,
                       BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION)
    z = acc * inv_t                                                       # [BLOCK_N, BLOCK_V]
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=ignore_index).to(tl.int32)
    valid = (tgt != ignore_index) & n_mask
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    p = tl.exp(z - lse[:, None])
    # dz / p = g_ent * (E_p[z] - z) - g_logp; the onehot term g_logp is added at the target column.
    coef = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if HAS_GEN:
        g_en = tl.where(valid, tl.load(gen_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32), 0.0)
        mz = tl.load(mz_ptr + offs_n, mask=n_mask, other=0.0)
        coef = g_en[:, None] * (mz[:, None] - z)
    dz = p * coef
    if HAS_GLP:
        g_lp = tl.where(valid, tl.load(glp_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32), 0.0)
        onehot = tgt[:, None] == offs_v[None, :]
        dz = dz - p * g_lp[:, None] + tl.where(onehot, g_lp[:, None], 0.0)
    dz = dz * inv_t
    dz_ptrs = dz_ptr + offs_n.to(tl.int64)[:, None] * stride_dzn + (offs_v - v_lo)[None, :]
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=n_mask[:, None] & v_mask[None, :])


def _config(dtype: torch.dtype, kernel: str = "fwd") -> dict:
    """Tile sizes and launch options of `kernel` ("fwd" or "dz"); a fresh dict per call (callers pop from it).

    The interpreter gets small tiles (it runs programs one at a time). bf16/fp16 on the GPU: a 128 x 128 logits
    tile over 8 warps, the largest that ptxas compiles for sm_90a without register spills in both kernels, with
    and without entropy (`python -m t1kernels.aot_report`; the 128 x 256 tile of the earlier sweep spilled 0.4-0.5
    KiB per thread in the forward).
    """
    precision = "ieee" if dtype == torch.float32 else "tf32"  # fp32 must not silently drop to TF32
    if interpreter_on():
        return dict(BLOCK_N=16, BLOCK_V=64, BLOCK_D=16, DOT_PRECISION=precision, num_warps=4, num_stages=1,
                    vocab_per_split=4096)
    if dtype == torch.float32:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, DOT_PRECISION=precision, num_warps=4, num_stages=2,
                    vocab_per_split=8192)
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, DOT_PRECISION=precision, num_warps=8, num_stages=3,
                vocab_per_split=8192)


def _check_kernel_dtype(hidden: torch.Tensor) -> None:
    if interpreter_on() and hidden.dtype != torch.float32:
        raise ValueError(f"hidden: the Triton interpreter computes tl.dot correctly only in fp32, got "
                         f"{hidden.dtype}; use float32 or T1_KERNEL_BACKEND=torch")


def triton_logprob_fwd(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *,
                       temperature: float, ignore_index: int, with_entropy: bool,
                       vocab_per_split: int | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward without autograd: (logp_N, entropy_N, lse_N, mean_z_N), all fp32 (see logprob_torch)."""
    _check_kernel_dtype(hidden_ND)
    N, D = hidden_ND.shape
    V = weight_VD.shape[0]
    dev = hidden_ND.device
    cfg = _config(hidden_ND.dtype)
    default_split = cfg.pop("vocab_per_split")
    split = triton.cdiv(vocab_per_split or default_split, cfg["BLOCK_V"]) * cfg["BLOCK_V"]
    S = triton.cdiv(V, split)
    part_SN = empty_unfilled((4, S, N), dtype=torch.float32, device=dev)  # m, s, t, z_target: all written
    if N > 0:
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), S)
        _logprob_fwd_kernel[grid](hidden_ND, weight_VD, targets_N.contiguous(), *part_SN.unbind(0), N, V, D,
                                  hidden_ND.stride(0), hidden_ND.stride(1), weight_VD.stride(0),
                                  weight_VD.stride(1), 1.0 / temperature, ignore_index, split,
                                  WITH_ENTROPY=with_entropy, **cfg)
    m_SN, s_SN, t_SN, zt_SN = part_SN.unbind(0)
    # Fixed-order merge of the splits' online states (the same re-basing as inside the kernel).
    m_N = m_SN.amax(dim=0)
    alpha_SN = torch.exp(m_SN - m_N)
    s_N = (alpha_SN * s_SN).sum(dim=0)
    t_N = (alpha_SN * (t_SN + s_SN * (m_SN - m_N))).sum(dim=0)
    log_s_N = torch.log(s_N)
    lse_N = m_N + log_s_N
    mean_z_N = m_N + t_N / s_N
    valid_N = targets_N != ignore_index
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    logp_N = torch.where(valid_N, zt_SN.sum(dim=0) - lse_N, zero)
    ent_N = torch.where(valid_N, log_s_N - t_N / s_N, zero) if with_entropy else torch.zeros_like(logp_N)
    return logp_N, ent_N, lse_N, mean_z_N


def triton_logprob_bwd(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                       lse_N: torch.Tensor, mean_z_N: torch.Tensor, grad_logp_N: torch.Tensor | None,
                       grad_ent_N: torch.Tensor | None, *, temperature: float, ignore_index: int,
                       need_hidden: bool = True, need_weight: bool = True, scratch_bytes: int = SCRATCH_BYTES,
                       scratch_fill: float | None = None,
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward without autograd: (d_hidden_ND, d_weight_VD) in the inputs' dtypes (None where not needed).

    `scratch_bytes` bounds the dz scratch; `scratch_fill` (tests) pre-fills it, e.g. with NaN, so a read of an
    unwritten element shows up in the gradients.
    """
    _check_kernel_dtype(hidden_ND)
    N, D = hidden_ND.shape
    V = weight_VD.shape[0]
    dev = hidden_ND.device
    cfg = _config(hidden_ND.dtype, "dz")
    cfg.pop("vocab_per_split")
    chunk = scratch_columns(N, V, hidden_ND.dtype, scratch_bytes)
    dh_ND = torch.zeros(N, D, dtype=torch.float32, device=dev) if need_hidden else None
    dw_VD = empty_unfilled(tuple(weight_VD.shape), dtype=weight_VD.dtype, device=dev) if need_weight else None
    if N == 0:
        if dw_VD is not None:
            dw_VD.zero_()
        return (dh_ND.to(hidden_ND.dtype) if dh_ND is not None else None), dw_VD
    dz_buf = scratch((N, chunk), dtype=hidden_ND.dtype, device=dev, fill=scratch_fill)
    dummy = lse_N  # stands in for an absent gradient pointer (never read: HAS_* is False)
    for v0 in range(0, V, chunk):
        v1 = min(v0 + chunk, V)
        dz_nv = dz_buf[:, : v1 - v0]
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(v1 - v0, cfg["BLOCK_V"]))
        _logprob_bwd_dz_kernel[grid](
            hidden_ND, weight_VD, targets_N.contiguous(), lse_N, mean_z_N,
            grad_logp_N if grad_logp_N is not None else dummy,
            grad_ent_N if grad_ent_N is not None else dummy, dz_nv,
            N, D, v0, v1, hidden_ND.stride(0), hidden_ND.stride(1), weight_VD.stride(0), weight_VD.stride(1),
            dz_nv.stride(0), 1.0 / temperature, ignore_index,
            HAS_GLP=grad_logp_N is not None, HAS_GEN=grad_ent_N is not None, **cfg)
        if dw_VD is not None:
            # The whole reduction over N happens inside one GEMM (fp32 accumulate), written once: no partials.
            torch.mm(dz_nv.T, hidden_ND, out=dw_VD[v0:v1])
        if dh_ND is not None:
            if hidden_ND.dtype == torch.float32:
                dh_ND.addmm_(dz_nv, weight_VD[v0:v1])
            else:  # bf16/fp16 operands, fp32 accumulate and output, added in place (CUDA; meta for aot_report)
                torch.addmm(dh_ND, dz_nv, weight_VD[v0:v1], out_dtype=torch.float32, out=dh_ND)
    return (dh_ND.to(hidden_ND.dtype) if dh_ND is not None else None), dw_VD


def scratch_columns(num_rows: int, vocab: int, dtype: torch.dtype, scratch_bytes: int = SCRATCH_BYTES) -> int:
    """Vocabulary columns per backward chunk: a multiple of BLOCK_V (except a last, whole-vocab chunk) that
    keeps the [num_rows, columns] dz scratch within `scratch_bytes` (at least one BLOCK_V column block)."""
    bv = _config(dtype, "dz")["BLOCK_V"]
    elem = torch.empty((), dtype=dtype).element_size()
    cols = scratch_bytes // max(1, num_rows * elem)
    return min(max(bv, cols // bv * bv), vocab)
