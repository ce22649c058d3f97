"""Causal attention for CPU training: key-prefix blocks as batched GEMMs, probabilities kept for the backward.

Legend: B documents, N tokens per document, Hkv KV heads, G query heads per KV head (H = Hkv * G), Dh head dim,
b query block, R = N * G rows per (document, KV head), P = B * Hkv; r = b * G rows of one block, E keys of
its prefix.

Why not torch's CPU flash-attention kernel: it recomputes the probabilities in its backward and runs its small
tiles well below GEMM speed. For the documents the CPU path trains on (a few hundred to a few thousand tokens)
one layer's probabilities fit in tens of MB, so keeping them and running the backward as plain batched GEMMs is
faster: 4 documents x 512 tokens, H=4, Hkv=2, Dh=64, fp32 on 2 cores, 11.8 vs 16.8 ms forward + backward per layer.

How:
- Query block i (positions s..e) attends to keys 0..e only: blocks above the diagonal are never computed (work
  (n_blocks + 1) / (2 n_blocks) of the full square) and only the diagonal block is masked.
- Grouped-query attention without repeating keys: rows are ordered (position, query head within the group), so
  the G heads sharing a KV head are G consecutive rows of one GEMM, and a query block is one contiguous row range.
- Forward saves q * scale, k, v, the output and each block's probabilities; the backward is, per block,
  dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K * scale, dK += dS^T (Q * scale).
Memory kept per layer: B * H * N^2 * (n_blocks + 1) / (2 n_blocks) fp32 probabilities (`saved_bytes`); callers
fall back to SDPA above a budget.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 64
"""Query positions per block (64 was fastest of 32 / 64 / 128 at the shape above)."""


def saved_bytes(num_docs: int, doc_len: int, num_heads: int, dtype: torch.dtype, block: int = BLOCK) -> int:
    """Bytes of probabilities one forward keeps for its backward."""
    n_blocks = -(-doc_len // block)
    rows_kept = sum(min(doc_len, (i + 1) * block) * min(block, doc_len - i * block) for i in range(n_blocks))
    return num_docs * num_heads * rows_kept * torch.tensor([], dtype=dtype).element_size()


@functools.lru_cache(maxsize=64)
def _diag_mask(n: int, group: int) -> torch.Tensor:
    """[n * group, n] True above the diagonal: row (i, g) may not see key j > i."""
    return torch.ones(n, n, dtype=torch.bool).triu_(1).repeat_interleave(group, dim=0)


def _blocks(doc_len: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, doc_len)) for s in range(0, doc_len, block)]


class BlockCausalAttention(torch.autograd.Function):
    """q [B, N, H, Dh], k, v [B, N, Hkv, Dh] -> o [B, N, H, Dh]; internally rows (position, g) per (document, kv).

    The layout changes ride on passes that happen anyway: q is scaled while it is reordered, each block's output
    and dQ are written straight into [B, N, H, Dh], and delta = rowsum(dO * O) is taken in that layout.
    """

    @staticmethod
    def forward(ctx, q_BNHD: torch.Tensor, k_BNKD: torch.Tensor, v_BNKD: torch.Tensor,  # type: ignore[override]
                scale: float, block: int) -> torch.Tensor:
        num_b, num_n, num_heads, head_dim = q_BNHD.shape
        num_kv = k_BNKD.shape[2]
        group, num_p = num_heads // num_kv, num_b * num_kv
        qs_PRD = q_BNHD.new_empty(num_p, num_n * group, head_dim)
        torch.mul(q_BNHD.reshape(num_b, num_n, num_kv, group, head_dim).transpose(1, 2), scale,
                  out=qs_PRD.view(num_b, num_kv, num_n, group, head_dim))
        k_PND = k_BNKD.transpose(1, 2).reshape(num_p, num_n, head_dim)
        v_PND = v_BNKD.transpose(1, 2).reshape(num_p, num_n, head_dim)
        o_BNHD = q_BNHD.new_empty(q_BNHD.shape)
        o_BNKGD = o_BNHD.view(num_b, num_n, num_kv, group, head_dim)
        probs = []
        for s, e in _blocks(num_n, block):
            scores_PrE = torch.bmm(qs_PRD[:, s * group:e * group], k_PND[:, :e].transpose(1, 2))
            scores_PrE[..., s:].masked_fill_(_diag_mask(e - s, group), float("-inf"))
            p_PrE = torch.softmax(scores_PrE, dim=-1)
            o_PrD = torch.bmm(p_PrE, v_PND[:, :e])
            o_BNKGD[:, s:e] = o_PrD.view(num_b, num_kv, e - s, group, head_dim).transpose(1, 2)
            probs.append(p_PrE)
        ctx.save_for_backward(qs_PRD, k_PND, v_PND, o_BNHD, *probs)
        ctx.scale, ctx.block = scale, block
        return o_BNHD

    @staticmethod
    def backward(ctx, do_BNHD: torch.Tensor):  # type: ignore[override]
        qs_PRD, k_PND, v_PND, o_BNHD, *probs = ctx.saved_tensors
        num_b, num_n, num_heads, head_dim = o_BNHD.shape
        num_p = k_PND.shape[0]
        num_kv = num_p // num_b
        group = num_heads // num_kv

        def to_rows(x_BNHX: torch.Tensor) -> torch.Tensor:  # [B, N, H, X] -> [P, R, X]
            x = x_BNHX.reshape(num_b, num_n, num_kv, group, -1).transpose(1, 2)
            return x.reshape(num_p, num_n * group, x.shape[-1])

        do_PRD = to_rows(do_BNHD)
        delta_PR1 = to_rows((do_BNHD * o_BNHD).sum(-1, keepdim=True))
        dq_BNHD = o_BNHD.new_empty(o_BNHD.shape)
        dq_BNKGD = dq_BNHD.view(num_b, num_n, num_kv, group, head_dim)
        dk_PND = dv_PND = None
        # Last block first: it sees every key, so it writes dK and dV whole; earlier blocks add to a prefix.
        for (s, e), p_PrE in reversed(list(zip(_blocks(num_n, ctx.block), probs))):
            rows = slice(s * group, e * group)
            do_PrD, qs_PrD = do_PRD[:, rows], qs_PRD[:, rows]
            # A prefix of dK / dV is a strided view: baddbmm_ into it would split into one addmm per batch entry,
            # so each block's part is one batched GEMM into fresh memory, then one add.
            dv_PED = torch.bmm(p_PrE.transpose(1, 2), do_PrD)
            if dv_PND is None:
                dv_PND = dv_PED
            else:
                dv_PND[:, :e] += dv_PED
            ds_PrE = torch.bmm(do_PrD, v_PND[:, :e].transpose(1, 2)).sub_(delta_PR1[:, rows]).mul_(p_PrE)
            dq_PrD = torch.bmm(ds_PrE, k_PND[:, :e])
            torch.mul(dq_PrD.view(num_b, num_kv, e - s, group, head_dim).transpose(1, 2), ctx.scale,
                      out=dq_BNKGD[:, s:e])
            dk_PED = torch.bmm(ds_PrE.transpose(1, 2), qs_PrD)
            if dk_PND is None:
                dk_PND = dk_PED
            else:
                dk_PND[:, :e] += dk_PED
        dk_BNKD = dk_PND.view(num_b, num_kv, num_n, head_dim).transpose(1, 2)
        dv_BNKD = dv_PND.view(num_b, num_kv, num_n, head_dim).transpose(1, 2)
        return dq_BNHD, dk_BNKD, dv_BNKD, None, None


def block_causal_attention(q_BNHD: torch.Tensor, k_BNKD: torch.Tensor, v_BNKD: torch.Tensor, *, scale: float,
                           block: int = BLOCK) -> torch.Tensor:
    """Causal attention of B equal-length documents: q [B, N, H, Dh], k/v [B, N, Hkv, Dh] -> o [B, N, H, Dh].

    Query head h uses KV head h // G (as HF's repeat_kv).
    """
    return BlockCausalAttention.apply(q_BNHD, k_BNKD, v_BNKD, scale, block)
