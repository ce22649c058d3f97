"""Attention of the engine's new chunks to their cached keys, with results independent of the batch (CPU).

Legend: B slots, H query heads, Hkv KV heads, G = H / Hkv, N chunk length (padded), S keys (padded to a multiple
of KEY_BLOCK), n = S / KEY_BLOCK key blocks, P = B * Hkv, R = G * N query rows per (slot, KV head).

Why: the engine batches whichever requests are ready, so a query shares its call with other slots, the key axis is
padded to the longest of them and a prompt runs as one chunk or, after a prefix-cache hit, as a shorter one. SDPA
sums over however many keys the call has, so the same token's attention came out ~1e-7 apart depending on what
ran beside it, and a seeded run at concurrency 8 was not bit for bit. Here every sum over keys has a shape fixed by
the data, not by the batch:
- scores and the weighted values are GEMMs per key block of KEY_BLOCK keys (inner size Dh, resp. KEY_BLOCK: a
  row's result does not depend on the number of rows (padded to `kernels.rows.MIN_ROWS`) or of blocks);
- masked keys (beyond a row's causal end, or padding) get probability exactly 0 and so add exactly 0;
- the blocks are summed in order by a cumulative sum (a scan: its k-th value never sees later blocks);
- the softmax max is a max (exact in any order).
So a row's output depends only on its own query and its own keys. Costs about the same as SDPA's math path at
decode sizes; prefill runs in chunks of rows to bound the [P, n, R, KEY_BLOCK] score tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.rows import MIN_ROWS, pad_rows

KEY_BLOCK = 128
"""Keys per block of the fixed-shape sums."""
MAX_SCORE_BYTES = 32 * 2**20
"""Score tensor per row chunk at most (prefill of long prompts runs in row chunks; rows are independent)."""


def decode_attention(q_BHND: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *,
                     mask_B1NS: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v, [B, H, N, Dh]; `mask_B1NS` True = attend (None: all keys).

    Rows whose keys are all masked (padding rows of a chunk) come out as 0.
    """
    num_b, num_h, num_n, head_dim = q_BHND.shape
    num_kv, num_s = k_BKSD.shape[1], k_BKSD.shape[2]
    group, num_p = num_h // num_kv, num_b * num_kv
    num_blk = max(1, -(-num_s // KEY_BLOCK))
    pad = num_blk * KEY_BLOCK - num_s
    # Keys in blocks: [P, n, Dh, KB] for the scores, [P, n, KB, Dh] for the values; zero keys in the padding.
    k_PSD = F.pad(k_BKSD.reshape(num_p, num_s, head_dim), (0, 0, 0, pad))
    v_PSD = F.pad(v_BKSD.reshape(num_p, num_s, head_dim), (0, 0, 0, pad))
    k_PnDK = k_PSD.view(num_p, num_blk, KEY_BLOCK, head_dim).transpose(2, 3)
    v_PnKD = v_PSD.view(num_p, num_blk, KEY_BLOCK, head_dim)
    # Query rows (g, n) per (slot, KV head), scaled first as the trainer does.
    q_PRD = (q_BHND.reshape(num_p, group * num_n, head_dim) * scale)
    if mask_B1NS is None:
        mask_B1NS = torch.ones(num_b, 1, num_n, num_s, dtype=torch.bool, device=q_BHND.device)
    keep_PRS = F.pad(mask_B1NS.expand(num_b, num_kv * group, num_n, num_s)
                     .reshape(num_p, group * num_n, num_s), (0, pad), value=False)
    rows = group * num_n
    chunk = max(MIN_ROWS, MAX_SCORE_BYTES // max(1, num_p * num_blk * KEY_BLOCK * q_BHND.element_size()))
    outs = [_rows_attention(q_PRD[:, r0:r0 + chunk], k_PnDK, v_PnKD, keep_PRS[:, r0:r0 + chunk])
            for r0 in range(0, rows, chunk)]
    o_PRD = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return o_PRD.reshape(num_b, num_h, num_n, head_dim)


def _rows_attention(q_PRD: torch.Tensor, k_PnDK: torch.Tensor, v_PnKD: torch.Tensor,
                    keep_PRS: torch.Tensor) -> torch.Tensor:
    num_p, rows, head_dim = q_PRD.shape
    if rows < MIN_ROWS:  # few query rows take other BLAS kernels (kernels.rows): pad them
        keep = F.pad(keep_PRS, (0, 0, 0, MIN_ROWS - rows), value=False)
        return _rows_attention(pad_rows(q_PRD), k_PnDK, v_PnKD, keep)[:, :rows]
    num_blk = k_PnDK.shape[1]
    scores_PnRK = torch.matmul(q_PRD.unsqueeze(1), k_PnDK)
    keep_PnRK = keep_PRS.view(num_p, rows, num_blk, KEY_BLOCK).transpose(1, 2)
    scores_PnRK.masked_fill_(~keep_PnRK, float("-inf"))
    max_P1R1 = scores_PnRK.amax(dim=(1, 3), keepdim=True).nan_to_num_(neginf=0.0)  # all-masked rows: p = 0
    p_PnRK = scores_PnRK.sub_(max_P1R1).exp_()
    o_PRD = torch.matmul(p_PnRK, v_PnKD).cumsum(dim=1)[:, -1]
    den_PR1 = p_PnRK.sum(dim=-1, keepdim=True).cumsum(dim=1)[:, -1]
    return o_PRD.div_(den_PR1.clamp_min_(torch.finfo(den_PR1.dtype).tiny))
