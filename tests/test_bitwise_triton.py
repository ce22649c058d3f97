"""`t1kernels.bitwise_triton` in the Triton interpreter: float64 references, and the batch invariance algo.bitwise
needs on a GPU (a row's bits the same alone, in any batch, decoded one token at a time or in the packed forward).

The kernels run in a fresh subprocess of this file (TRITON_INTERPRET must be set before triton is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run_self() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--cases"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cases() -> dict:
    pytest.importorskip("triton")
    return _run_self()


@pytest.mark.interpreter
@pytest.mark.slow
def test_matmul_matches_float64_and_rows_do_not_depend_on_the_batch(cases: dict) -> None:
    assert cases["matmul_err"] < 1e-5
    assert cases["matmul_rows_alone_equal"] and cases["matmul_rows_shuffled_equal"]


@pytest.mark.interpreter
@pytest.mark.slow
def test_attention_decode_prefill_and_packed_forward_give_the_same_bits(cases: dict) -> None:
    assert cases["attn_err"] < 1e-5
    assert cases["attn_decode_equal"]      # one query at a time against its cached prefix
    assert cases["attn_chunks_equal"]      # prefill chunks of 5, 17 and 48 queries after a cached prefix
    # The check can fail: walking the keys in other blocks (another reduction order) moves some query's bits.
    assert cases["attn_other_blocks_differ"]


def _fixed_order_dot() -> None:
    """The interpreter runs `tl.dot` through numpy's matmul, whose BLAS picks its own reduction order per output
    position: on some hosts rows 6-15 of a 16x32 @ 32x32 tile round differently once moved to row 0. That is the
    host's doing, not the kernel's (a GPU's MMA treats every row of a tile alike). Every element here gets one fp32
    multiply-add per k, in ascending k, so the bits this file compares depend only on what the kernel controls: its
    tiles and the order it walks them."""
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ARG001 (the builder's signature)
        acc = d.data.copy()
        for k in range(a.data.shape[-1]):
            acc = acc + a.data[..., :, k:k + 1].astype(acc.dtype) * b.data[..., k:k + 1, :].astype(acc.dtype)
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _cases() -> dict:
    _fixed_order_dot()
    from t1kernels import bitwise_triton as bt

    g = torch.Generator().manual_seed(0)
    out = {}
    x_MK, w_NK = torch.randn(37, 80, generator=g), torch.randn(45, 80, generator=g)
    full = bt.invariant_matmul(x_MK, w_NK)
    out["matmul_err"] = float((full.double() - x_MK.double() @ w_NK.double().T).abs().max())
    out["matmul_rows_alone_equal"] = all(torch.equal(bt.invariant_matmul(x_MK[m:m + 1], w_NK)[0], full[m])
                                         for m in range(0, 37, 6))
    perm = torch.randperm(37, generator=g)
    out["matmul_rows_shuffled_equal"] = torch.equal(bt.invariant_matmul(x_MK[perm], w_NK), full[perm])

    num_s, num_h, num_kv, head_dim = 70, 4, 2, 16
    q, k, v = (torch.randn(num_s, h, head_dim, generator=g) for h in (num_h, num_kv, num_kv))
    pos = torch.arange(num_s)
    scale = head_dim ** -0.5
    packed = bt.invariant_causal_attention(q, k, v, pos, scale=scale)
    ref = bt.invariant_causal_attention_reference(q, k, v, pos, scale=scale)
    out["attn_err"] = float((packed.double() - ref.double()).abs().max())
    out["attn_decode_equal"] = all(
        torch.equal(bt.invariant_causal_attention(q[p:p + 1], k[:p + 1], v[:p + 1], pos[p:p + 1], scale=scale)[0],
                    packed[p]) for p in range(num_s))
    chunks, start = [], 0
    for n in (5, 17, 48):
        end = start + n
        chunks.append(bt.invariant_causal_attention(q[start:end], k[:end], v[:end], pos[start:end], scale=scale))
        start = end
    out["attn_chunks_equal"] = torch.equal(torch.cat(chunks), packed)
    bt.ATTN_BLOCKS["BLOCK_S"] = 16
    out["attn_other_blocks_differ"] = not torch.equal(bt.invariant_causal_attention(q, k, v, pos, scale=scale), packed)
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--cases"]:
        print(json.dumps(_cases()))
