"""Batch-invariant Triton kernels: the GPU half of algo.bitwise (plan: ARCHITECTURE.md, "Bitwise mode on GPUs").

Legend: M rows, K inner dim, N output columns, Q queries, S keys, H query heads, Hkv KV heads, G = H / Hkv, Dh head
dim.

What makes a kernel batch-invariant is that no tile size, split or loop bound of a row's reduction depends on
the call's shape. Both kernels here fix every block size as a constant (no autotuning, no heuristics on M or
Q, no split-K, no split-KV) and walk the reduced axis in ascending blocks, so a row computes the same sequence
of operations in a decode step of one token, a prefill chunk, or the trainer's full forward:
- `invariant_matmul`: y = x @ w^T, one [BLOCK_M, BLOCK_N] tile per program, K in BLOCK_K steps, fp32 accumulator.
- `invariant_causal_attention`: queries at given positions of one sequence; each program walks the key blocks
  from 0 up to the last key any of its queries sees, with an online softmax. A key block entirely after a
  query's position adds exactly nothing to it (p = 0, the running max and the rescale factor stay as they
  were: alpha = exp(0) = 1), so the extra blocks a training tile walks for its earlier queries leave their bits
  alone, and a query decoded alone against its cached prefix gets the bits it gets inside the packed forward.
Their torch references (float64) sit beside them. `tests/test_bitwise_triton.py` runs them in the Triton
interpreter; on a GPU the same property additionally needs the MMA instruction shape fixed per tile, which
fixed block sizes and num_warps give (what the device check would assert: ARCHITECTURE.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MATMUL_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
"""Fixed tiles of `invariant_matmul` (never chosen from the shape: that would change a row's order)."""
ATTN_BLOCKS = {"BLOCK_Q": 16, "BLOCK_S": 32}
"""Fixed query and key blocks of `invariant_causal_attention`."""


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_ym, s_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # ascending, whole K: no split, so no cross-program sum
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * s_xm + offs_k[None, :] * s_xk,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)     # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk,
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)     # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None] * s_ym + offs_n[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def invariant_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x @ w^T, [M, N] in x's dtype (fp32 accumulation); row m's bits depend on x[m] and w only."""
    if x_MK.dim() != 2 or w_NK.dim() != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"invariant_matmul: expected x [M, K] and w [N, K], got {list(x_MK.shape)} and "
                         f"{list(w_NK.shape)}")
    M, K = x_MK.shape
    N = w_NK.shape[0]
    y_MN = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    b = MATMUL_BLOCKS
    grid = (triton.cdiv(M, b["BLOCK_M"]), triton.cdiv(N, b["BLOCK_N"]))
    _matmul_kernel[grid](x_MK, w_NK, y_MN, M, N, K, *x_MK.stride(), *w_NK.stride(), *y_MN.stride(), **b)
    return y_MN


def invariant_matmul_reference(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    return (x_MK.double() @ w_NK.double().T).to(x_MK.dtype)


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, Q, S, scale,
                      s_qq, s_qh, s_qd, s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, s_oq, s_oh, s_od,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
    pid_q, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q_mask = offs_q < Q
    pos = tl.load(pos_ptr + offs_q, mask=q_mask, other=-1)                             # [BLOCK_Q]
    q = tl.load(q_ptr + offs_q[:, None] * s_qq + head * s_qh + offs_d[None, :] * s_qd, mask=q_mask[:, None],
                other=0.0).to(tl.float32) * scale                                      # [BLOCK_Q, Dh]
    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, HEAD_DIM), dtype=tl.float32)
    end = tl.minimum(tl.max(pos) + 1, S)  # the last key this tile's latest query sees
    for s0 in range(0, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < S
        k = tl.load(k_ptr + offs_s[None, :] * s_ks + kv_head * s_kh + offs_d[:, None] * s_kd, mask=s_mask[None, :],
                    other=0.0).to(tl.float32)                                          # [Dh, BLOCK_S]
        v = tl.load(v_ptr + offs_s[:, None] * s_vs + kv_head * s_vh + offs_d[None, :] * s_vd, mask=s_mask[:, None],
                    other=0.0).to(tl.float32)                                          # [BLOCK_S, Dh]
        scores = tl.dot(q, k, input_precision="ieee")                                  # [BLOCK_Q, BLOCK_S]
        seen = (offs_s[None, :] <= pos[:, None]) & s_mask[None, :]
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Rows with nothing seen yet (padding queries) keep m = -inf: use 0 there so no inf - inf appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + offs_q[:, None] * s_oq + head * s_oh + offs_d[None, :] * s_od, out.to(o_ptr.dtype.element_ty),
             mask=q_mask[:, None])


def invariant_causal_attention(q_QHD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                               positions_Q: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Attention of queries at `positions_Q` of one sequence to its keys 0 .. position (inclusive), [Q, H, Dh].

    k/v hold the sequence's keys from position 0 (a KV cache's prefix, or the whole training document); query h
    uses KV head h // G. A query's bits depend on its own q, its position and the keys up to it only.
    """
    if q_QHD.dim() != 3 or k_SKD.shape != v_SKD.shape or k_SKD.dim() != 3 or q_QHD.shape[2] != k_SKD.shape[2]:
        raise ValueError(f"invariant_causal_attention: expected q [Q, H, Dh], k/v [S, Hkv, Dh], got "
                         f"{list(q_QHD.shape)}, {list(k_SKD.shape)}, {list(v_SKD.shape)}")
    num_q, num_h, head_dim = q_QHD.shape
    num_s, num_kv = k_SKD.shape[:2]
    if num_h % num_kv or head_dim & (head_dim - 1):
        raise ValueError(f"invariant_causal_attention: expected H a multiple of Hkv and Dh a power of two, got "
                         f"H={num_h}, Hkv={num_kv}, Dh={head_dim}")
    if positions_Q.shape != (num_q,) or (num_q and int(positions_Q.max()) >= num_s):
        raise ValueError(f"positions_Q: expected [{num_q}] positions below S={num_s}, got {positions_Q.tolist()}")
    o_QHD = torch.empty_like(q_QHD)
    b = ATTN_BLOCKS
    grid = (triton.cdiv(num_q, b["BLOCK_Q"]), num_h)
    _attention_kernel[grid](q_QHD, k_SKD, v_SKD, positions_Q.to(torch.int32).contiguous(), o_QHD, num_q, num_s,
                            float(scale), *q_QHD.stride(), *k_SKD.stride(), *v_SKD.stride(), *o_QHD.stride(),
                            GROUP=num_h // num_kv, HEAD_DIM=head_dim, **b)
    return o_QHD


def invariant_causal_attention_reference(q_QHD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                                         positions_Q: torch.Tensor, *, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale, causal by position) v, the plain way."""
    group = q_QHD.shape[1] // k_SKD.shape[1]
    q, k, v = (x.double().transpose(0, 1) for x in (q_QHD, k_SKD, v_SKD))        # [H, Q, Dh], [Hkv, S, Dh]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores_HQS = q @ k.transpose(1, 2) * scale
    seen_QS = torch.arange(k_SKD.shape[0], device=q_QHD.device)[None, :] <= positions_Q[:, None]
    p_HQS = torch.softmax(scores_HQS.masked_fill(~seen_QS, float("-inf")), dim=-1)
    return (p_HQS @ v).transpose(0, 1).to(q_QHD.dtype)
