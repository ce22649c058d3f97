"""`t1model.decode_attention`: the engine's batch-invariant cached attention (CPU), against a float64 reference."""

from __future__ import annotations

import torch

from t1kernels.rows import batch_invariant_mode, mm_rows
from t1model.decode_attention import KEY_BLOCK, decode_attention


def _reference(q_BHND, k_BKSD, v_BKSD, mask_B1NS, scale):
    group = q_BHND.shape[1] // k_BKSD.shape[1]
    k, v = k_BKSD.double().repeat_interleave(group, 1), v_BKSD.double().repeat_interleave(group, 1)
    s = q_BHND.double() @ k.transpose(-1, -2) * scale
    return torch.softmax(s.masked_fill(~mask_B1NS, float("-inf")), dim=-1) @ v


def _case(lens, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    s_max = max(lens)
    q = torch.randn(len(lens), 4, n, 16, generator=g)
    k, v = (torch.randn(len(lens), 2, s_max, 16, generator=g) for _ in range(2))
    mask = torch.zeros(len(lens), 1, n, s_max, dtype=torch.bool)
    for b, length in enumerate(lens):  # the chunk is the last n positions of each slot
        for i in range(n):
            mask[b, 0, i, :length - n + i + 1] = True
    return q, k, v, mask


def test_matches_float64_softmax_attention() -> None:
    q, k, v, mask = _case([7, 130, 300], n=4)
    got = decode_attention(q, k, v, mask_B1NS=mask, scale=0.25)
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask, 0.25), rtol=0, atol=2e-6)


def test_a_slot_gets_the_same_bits_alone_and_padded_beside_longer_ones() -> None:
    q, k, v, mask = _case([9, 2 * KEY_BLOCK + 5, 40], n=3, seed=1)
    together = decode_attention(q, k, v, mask_B1NS=mask, scale=0.25)
    with batch_invariant_mode():
        together_inv = decode_attention(q, k, v, mask_B1NS=mask, scale=0.25)
        alone = decode_attention(q[:1], k[:1, :, :9], v[:1, :, :9], mask_B1NS=mask[:1, :, :, :9], scale=0.25)
        last_row = decode_attention(q[:1, :, 2:], k[:1, :, :9], v[:1, :, :9], mask_B1NS=mask[:1, :, 2:, :9], scale=0.25)
    assert torch.equal(together_inv, together)  # the mode changes products of few rows, not this function's math
    assert torch.equal(alone, together[:1])
    assert torch.equal(last_row, together[:1, :, 2:])


def test_mm_rows_are_row_invariant_in_the_mode_and_follow_weight_updates() -> None:
    g = torch.Generator().manual_seed(2)
    a, w = torch.randn(40, 64, generator=g), torch.randn(96, 64, generator=g)  # w stored [N, K], as nn.Linear's
    with batch_invariant_mode():
        full = mm_rows(a, w)
        # Every count of rows: MKL's small-matrix paths start at other counts on other CPUs and thread counts
        # (t1kernels.rows).
        parts = {(i, m): mm_rows(a[i:i + m], w) for m in range(1, 30) for i in (0, 11)}
        w.mul_(2.0)  # an in-place update (the engine's weight sync) must not reuse the cached transposed copy
        doubled = mm_rows(a, w)
    torch.testing.assert_close(full, a.double().mm(w.double().t() / 2).float(), rtol=1e-5, atol=1e-5)
    assert [k for k, r in parts.items() if not torch.equal(r, full[k[0]:k[0] + k[1]])] == []
    assert torch.equal(doubled, full * 2)


def test_long_prefills_run_in_query_chunks_with_the_same_bits(monkeypatch) -> None:
    import t1model.decode_attention as da

    q, k, v, mask = _case([300, 180], n=40, seed=3)
    whole = decode_attention(q, k, v, mask_B1NS=mask, scale=0.25)
    monkeypatch.setattr(da, "MAX_SCORE_BYTES", 4 * 2**10)  # a few queries per chunk
    assert torch.equal(decode_attention(q, k, v, mask_B1NS=mask, scale=0.25), whole)


def test_bitwise_training_forward_in_query_blocks_is_the_whole_square(monkeypatch) -> None:
    """InvariantCausalAttention runs query blocks against their key prefix (O(N x block) memory): the same bits as
    one call over the whole N x N causal mask."""
    from t1model import attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(300, h, 32, generator=g) for h in (4, 2, 2))
    causal = torch.ones(300, 300, dtype=torch.bool).tril_()[None, None]
    whole = decode_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), mask_B1NS=causal, scale=0.17)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 64)
    blocked = attention.InvariantCausalAttention.apply(q, k, v, 0.17)
    assert torch.equal(blocked, whole[0].transpose(0, 1))
