"""Attention of the engine's new chunks to their cached keys, with results independent of the batch (CPU).

Legend: B slots, H query heads, Hkv KV heads, G = H / Hkv, N chunk length (padded), S keys (padded to a multiple
of KEY_BLOCK), n = S / KEY_BLOCK key blocks, KB = KEY_BLOCK, P = B * Hkv, R = G * N query rows per (slot, KV head).

Why: the engine batches whichever requests are ready, so a query shares its call with other slots, the key axis is
padded to the longest of them and a prompt runs as one chunk or, after a prefix-cache hit, as a shorter one. SDPA
sums over however many keys and rows the call has, so the same token's attention came out ~1e-7 apart depending on
what ran beside it. Here every sum has a shape fixed by the data, not by the batch. The work runs transposed, with
queries as columns: MKL's products are column-invariant for a row-major left operand from `t1kernels.rows.MIN_ROWS`
columns up (on the earlier boxes at any count, on AMD AVX2 from 12), and a chunk with fewer query columns is
padded to that:
- per key block, scores^T = K_blk [KB, Dh] @ q^T [Dh, R] and out^T = V_blk^T [Dh, KB] @ p^T [KB, R] (inner sizes
  Dh and KB, whatever R and n are), and the softmax denominator a sum over KB contiguous values;
- masked keys (beyond a query's causal end, or padding) get probability exactly 0 and so add exactly 0;
- the blocks are summed in order by a cumulative sum (a scan: its k-th value never sees later blocks);
- the softmax max is a max (exact in any order).
So a query's output depends only on its own query and its own keys (`tests/test_decode_attention.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from t1kernels.rows import MIN_ROWS

KEY_BLOCK = 128
"""Keys per block of the fixed-shape sums."""
MAX_SCORE_BYTES = 32 * 2**20
"""Score tensor per query chunk at most (a long prefill runs in chunks of queries; queries are independent)."""


def key_bias(mask_B1NS: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask in the layout of the transposed scores: [B, n, KB, N], 0 where a query attends, -inf elsewhere
    (keys padded up to n * KB are masked). Built once per engine step and shared by its layers."""
    num_b, _, num_n, num_s = mask_B1NS.shape
    num_blk = max(1, -(-num_keys // KEY_BLOCK))
    keep_BNS = F.pad(mask_B1NS[:, 0], (0, num_blk * KEY_BLOCK - num_s), value=False)
    keep_BnKN = keep_BNS.view(num_b, num_n, num_blk, KEY_BLOCK).permute(0, 2, 3, 1)
    return torch.zeros(keep_BnKN.shape, dtype=dtype, device=mask_B1NS.device).masked_fill_(~keep_BnKN, float("-inf"))


def scores_bias(bias_BnKN: torch.Tensor, *, num_kv: int, group: int) -> torch.Tensor:
    """`key_bias` laid out as `decode_attention`'s transposed scores of a chunk that runs in one piece,
    [P, n, KB, G * N'] (N' the chunk's columns padded to what `_cols_attention` pads them to): built once per engine
    step, so that every layer adds its mask as one contiguous tensor (a broadcast add costs 20x more at decode)."""
    num_b, num_blk, _, num_n = bias_BnKN.shape
    short = max(0, -(-MIN_ROWS // group) - num_n)
    cols = num_n + short
    bias_BnKN = F.pad(bias_BnKN, (0, short)) if short else bias_BnKN
    return (bias_BnKN.view(num_b, 1, num_blk, KEY_BLOCK, 1, cols)
            .expand(num_b, num_kv, num_blk, KEY_BLOCK, group, cols)
            .reshape(num_b * num_kv, num_blk, KEY_BLOCK, group * cols))


def decode_attention(q_BHND: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *,
                     mask_B1NS: torch.Tensor | None, scale: float,
                     bias_BnKN: torch.Tensor | None = None,
                     scores_bias_PnKR: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v, [B, H, N, Dh]; `mask_B1NS` True = attend (None: all keys), or its
    `key_bias` given as `bias_BnKN` (and optionally also as `scores_bias` of it, `scores_bias_PnKR`).

    Rows whose keys are all masked (padding rows of a chunk) come out as 0.
    """
    num_b, num_h, num_n, head_dim = q_BHND.shape
    num_kv, num_s = k_BKSD.shape[1], k_BKSD.shape[2]
    group, num_p = num_h // num_kv, num_b * num_kv
    num_blk = max(1, -(-num_s // KEY_BLOCK))
    pad = num_blk * KEY_BLOCK - num_s
    # Views of the cache when S is whole blocks (CachedContext gathers whole blocks); a padded copy otherwise.
    k_PSD, v_PSD = (x.reshape(num_p, num_s, head_dim) for x in (k_BKSD, v_BKSD))
    if pad:
        k_PSD, v_PSD = F.pad(k_PSD, (0, 0, 0, pad)), F.pad(v_PSD, (0, 0, 0, pad))
    k_PnKD = k_PSD.view(num_p, num_blk, KEY_BLOCK, head_dim)
    v_PnDK = v_PSD.view(num_p, num_blk, KEY_BLOCK, head_dim).transpose(2, 3)
    # Queries as columns (g, n) per (slot, KV head), scaled first as the trainer does.
    qt_PDR = (q_BHND.reshape(num_p, group * num_n, head_dim) * scale).transpose(1, 2).contiguous()
    if bias_BnKN is None:
        if mask_B1NS is None:
            mask_B1NS = torch.ones(num_b, 1, num_n, num_s, dtype=torch.bool, device=q_BHND.device)
        bias_BnKN = key_bias(mask_B1NS, num_s, q_BHND.dtype)
    # Columns chunked so that a long prefill's scores stay bounded (columns are independent).
    chunk = max(1, MAX_SCORE_BYTES // max(1, num_p * num_blk * KEY_BLOCK * group * q_BHND.element_size()))
    if chunk < num_n:  # `scores_bias_PnKR` holds whole chunks only
        scores_bias_PnKR = None
    outs = [_cols_attention(qt_PDR.view(num_p, head_dim, group, num_n)[..., n0:n0 + chunk], k_PnKD, v_PnDK,
                            bias_BnKN[..., n0:n0 + chunk], num_b, scores_bias_PnKR) for n0 in range(0, num_n, chunk)]
    ot_PDGN = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return ot_PDGN.reshape(num_p, head_dim, group * num_n).transpose(1, 2).reshape(num_b, num_h, num_n, head_dim)


def _cols_attention(qt_PDGN: torch.Tensor, k_PnKD: torch.Tensor, v_PnDK: torch.Tensor, bias_BnKN: torch.Tensor,
                    num_b: int, scores_bias_PnKR: torch.Tensor | None = None) -> torch.Tensor:
    num_p, head_dim, group, num_n = qt_PDGN.shape
    short = -(-MIN_ROWS // group) - num_n
    if short > 0:  # fewer columns would take BLAS's small-matrix paths (t1kernels.rows); padded ones are dropped
        bias_BnKN = bias_BnKN if scores_bias_PnKR is not None else F.pad(bias_BnKN, (0, short))
        return _cols_attention(F.pad(qt_PDGN, (0, short)), k_PnKD, v_PnDK, bias_BnKN, num_b,
                               scores_bias_PnKR)[..., :num_n]
    num_blk, cols = k_PnKD.shape[1], group * num_n
    st_PnKR = torch.matmul(k_PnKD, qt_PDGN.reshape(num_p, 1, head_dim, cols))
    if scores_bias_PnKR is not None:  # the same sums, one contiguous add
        st_PnKR.add_(scores_bias_PnKR)
    else:
        st_PnKR.view(num_b, num_p // num_b, num_blk, KEY_BLOCK, group, num_n).add_(
            bias_BnKN.view(num_b, 1, num_blk, KEY_BLOCK, 1, num_n))
    # The max over each column's keys, taken along contiguous memory (a max is exact in any order; a reduction
    # down the strided key axis costs several times more).
    max_P11R = st_PnKR.transpose(2, 3).contiguous().amax(dim=-1).amax(dim=1).view(num_p, 1, 1, cols)
    max_P11R.nan_to_num_(neginf=0.0)  # all-masked columns: p = 0
    pt_PnKR = st_PnKR.sub_(max_P11R).exp_()
    ot_PDR = _block_total(torch.matmul(v_PnDK, pt_PnKR))
    # Denominator per block: a sum along contiguous memory (a fixed order per row; a sum down the block's column
    # is not, its order follows the number of columns).
    den_P1R = _block_total(pt_PnKR.transpose(2, 3).contiguous().sum(dim=-1)).unsqueeze(1)
    return ot_PDR.div_(den_P1R.clamp_min_(torch.finfo(den_P1R.dtype).tiny)).view(num_p, head_dim, group, num_n)


def _block_total(x_Pn_: torch.Tensor) -> torch.Tensor:
    """The sum over key blocks (dim 1) in block order: the last value of a cumulative sum (a scan, whose k-th value
    never sees later blocks; on the CPU it adds in float64 from 0.0). One block: the value plus 0.0, the same bits
    (-0.0 becomes +0.0 either way) without the scan's cost."""
    return x_Pn_[:, 0] + 0.0 if x_Pn_.shape[1] == 1 else x_Pn_.cumsum(dim=1)[:, -1]
