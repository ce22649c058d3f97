"""Block causal attention (the CPU training path) against a float64 reference written as a plain loop, and the
choice between it and SDPA inside `packed_causal_attention`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from t1model import attention, block_attention
from t1model.block_attention import block_causal_attention


def _reference(q_BNHD: torch.Tensor, k_BNKD: torch.Tensor, v_BNKD: torch.Tensor, scale: float) -> torch.Tensor:
    """Per document and query head, softmax over keys 0..i of each query i; KV head of query head h is h // G."""
    num_b, num_n, num_heads, _ = q_BNHD.shape
    group = num_heads // k_BNKD.shape[2]
    out = torch.zeros_like(q_BNHD)
    for b in range(num_b):
        for h in range(num_heads):
            k_ND, v_ND = k_BNKD[b, :, h // group], v_BNKD[b, :, h // group]
            for i in range(num_n):
                w = torch.softmax(k_ND[:i + 1] @ q_BNHD[b, i, h] * scale, dim=0)
                out[b, i, h] = w @ v_ND[:i + 1]
    return out


def _inputs(num_b: int, num_n: int, num_heads: int, num_kv: int, head_dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_b, num_n, h, head_dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for h in (num_heads, num_kv, num_kv)]


@pytest.mark.parametrize("num_heads,num_kv,num_n,block", [(4, 2, 37, 8), (3, 3, 16, 16), (4, 1, 20, 64)])
def test_matches_a_float64_loop_with_gradients(num_heads: int, num_kv: int, num_n: int, block: int) -> None:
    # Ragged last block (37 = 4 * 8 + 5), one block only, block longer than the documents; GQA groups 2, 1, 4.
    q, k, v = _inputs(3, num_n, num_heads, num_kv, 8, torch.float64, seed=num_n)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = block_causal_attention(q, k, v, scale=0.3, block=block)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    ref = _reference(q, k, v, 0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_fp32_agrees_with_sdpa() -> None:
    q, k, v = _inputs(4, 128, 4, 2, 64, torch.float32, seed=5)
    got = block_causal_attention(q, k, v, scale=0.125)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=0.125, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_saved_bytes_counts_the_kept_probabilities() -> None:
    # Blocks of 8 over 20 positions: query rows 8, 8, 4 see 8, 16, 20 keys.
    assert block_attention.saved_bytes(2, 20, 3, torch.float32, block=8) == 2 * 3 * (8 * 8 + 8 * 16 + 4 * 20) * 4


def test_training_on_cpu_uses_blocks_and_everything_else_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_block, real_sdpa = block_attention.block_causal_attention, F.scaled_dot_product_attention
    monkeypatch.setattr(block_attention, "block_causal_attention",
                        lambda *a, **kw: calls.append("block") or real_block(*a, **kw))
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append("sdpa") or real_sdpa(*a, **kw))
    lens = [17, 40, 5]
    ctx = attention.PackedContext.build(lens, device=torch.device("cpu"))
    q, k, v = (x.reshape(-1, *x.shape[2:]).detach() for x in _inputs(1, sum(lens), 4, 2, 8, torch.float32, seed=2))

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        calls.clear()
        return ctx.attend(0, *tensors, scale=0.35)

    trained = run(*(x.clone().requires_grad_() for x in (q, k, v)))
    assert calls == ["block"] * 3  # one per document: 17, 40, 5 are too uneven to pad
    with torch.no_grad():
        plain = run(q, k, v)
    assert calls == ["sdpa"] * 3
    torch.testing.assert_close(trained, plain, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(attention, "BLOCK_ATTN_MAX_BYTES", 5000)  # 17 tokens keep 4,624 bytes, 40 keep 25,600
    run(*(x.clone().requires_grad_() for x in (q, k, v)))
    assert calls == ["block", "sdpa", "block"]
