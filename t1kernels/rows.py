"""Matrix products whose every row is independent of how many rows there are (batch invariance on the CPU).

The rollout engine batches whichever requests are ready, so a token's forward shares its GEMMs with a set of other
rows that depends on sandbox timing. For the same seed to give the same tokens, each row's result must not depend
on that set. With the CPU wheel's BLAS (MKL) and the weight stored [K, N] row-major ("NN"), a row of `x @ w` is
bitwise the same for every row count from MIN_ROWS up, every column count and every intra-op thread count. Below
that, MKL takes small-matrix paths that sum in another order (about 1 ulp apart); where they start depends on
the CPU (up to 12 rows, and 12 columns, on the machines tried; EXPERIMENTS.md), and a weight passed transposed,
as nn.Linear passes its [N, K] weight, takes other kernels for up to 15 rows. `tests/test_decode_attention.py`
checks the rule on whatever machine runs it. So in batch-invariant mode the products here use a cached row-major
copy of the weight (`t_cached`, made again when the weight changes) and run fewer than MIN_ROWS rows padded to
MIN_ROWS (`pad_rows`): every call then takes the same kernel a large batch does.

It is a CPU mode a thread turns on for itself (`batch_invariant_mode`): `rollout.TorchEngine` with
`EngineConfig.batch_invariant`, and the trainer's policy forward with algo.bitwise (through the same products,
differentiable, and the sampler's `tempered_log_softmax`), so that a trained log-prob is the sampled one's bits.
Outside it these are the plain products. `tests/test_rollout_engine.py` checks that batched and one-at-a-time
generation agree bit for bit, `tests/test_bitwise.py` that the trainer's log-probs equal the engine's.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

_mode = threading.local()
# id(weight) -> (weak reference to it, its version then, the transposed copy); entries leave with their weight.
# (Not a WeakKeyDictionary: tensors compare elementwise, so they cannot be dict keys by equality.)
_t_cache: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

MIN_ROWS = 16
"""Fewest rows (or, for `t1model.decode_attention`, columns) a batch-invariant product runs with (see above)."""


def batch_invariant() -> bool:
    """Whether this thread runs in `batch_invariant_mode`."""
    return getattr(_mode, "on", False)


@contextmanager
def batch_invariant_mode(on: bool = True, *, cache_weights: bool = True) -> Iterator[None]:
    """Within the block, on this thread: the products below are row-invariant, and the CPU engine's cached
    attention sums over fixed key blocks (`t1model.decode_attention`). cache_weights=False makes `t_cached` copy
    afresh on every call: for weights whose storage may be refilled without a version bump (FSDP2 unshards
    into the same parameter object every forward), as the trainer's bitwise forward does."""
    before = batch_invariant(), getattr(_mode, "cache", True)
    _mode.on, _mode.cache = on, cache_weights
    try:
        yield
    finally:
        _mode.on, _mode.cache = before


def t_cached(w_XN: torch.Tensor) -> torch.Tensor:
    """w with its last two dims swapped, contiguous; cached per tensor until it is modified (its version), unless
    the thread's `batch_invariant_mode` says cache_weights=False."""
    cache, key = getattr(_mode, "cache", True), id(w_XN)
    hit = _t_cache.get(key) if cache else None
    if hit is not None and hit[0]() is w_XN and hit[1] == w_XN._version:
        return hit[2]
    w_t = w_XN.detach().transpose(-2, -1).contiguous()
    if cache:
        _t_cache[key] = (weakref.ref(w_XN, lambda _, key=key: _t_cache.pop(key, None)), w_XN._version, w_t)
    return w_t


def pad_rows(a_MX: torch.Tensor) -> torch.Tensor:
    """2-D a with zero rows appended up to MIN_ROWS rows; a itself when it has that many already."""
    short = MIN_ROWS - a_MX.shape[0]
    return a_MX if short <= 0 else F.pad(a_MX, (0, 0, 0, short))


def mm_rows(a_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """`a @ w.T` for 2-D a and a weight w stored [N, K]; row-invariant in batch-invariant mode (differentiable:
    the trainer's bitwise forward, `t1core.update`, runs the engine's products and takes gradients through them)."""
    if not batch_invariant() or a_MK.device.type != "cpu":
        return torch.mm(a_MK, w_NK.t())
    if torch.is_grad_enabled() and (a_MK.requires_grad or w_NK.requires_grad):
        return _RowsMM.apply(a_MK, w_NK)
    return _mm_invariant(a_MK, w_NK)


def _mm_invariant(a_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    return torch.mm(pad_rows(a_MK), t_cached(w_NK))[:a_MK.shape[0]]


class _RowsMM(torch.autograd.Function):
    """The batch-invariant `a @ w.T` with the plain product's gradients (only the forward's bits matter)."""

    @staticmethod
    def forward(ctx, a_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a_MK, w_NK)
        return _mm_invariant(a_MK, w_NK)

    @staticmethod
    def backward(ctx, g_MN: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        a_MK, w_NK = ctx.saved_tensors
        da_MK = g_MN @ w_NK if ctx.needs_input_grad[0] else None
        dw_NK = g_MN.t() @ a_MK if ctx.needs_input_grad[1] else None
        return da_MK, dw_NK


def linear_rows(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; for 2-D x in batch-invariant mode each row independent of the number of rows."""
    if x_MK.dim() != 2 or not batch_invariant() or x_MK.device.type != "cpu":
        return F.linear(x_MK, weight_NK, bias_N)
    y_MN = mm_rows(x_MK, weight_NK)
    return y_MN if bias_N is None else y_MN + bias_N


def tempered_log_softmax(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / temperature) per row, temperature [B] (> 0): the one formula the engine's sampler
    (`rollout.sampling`) and the trainer's bitwise log-probs (`t1core.update`) share, so that both round alike."""
    return torch.log_softmax(logits_BV / temperature_B[:, None], dim=-1)


def token_logprobs_rows(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, *,
                        temperature: float, return_entropy: bool = False
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`t1kernels.logprob.token_logprobs` computed as the engine's sampler computes it: fp32 logits from
    `mm_rows`, then `tempered_log_softmax`. Materialises [N, V] (the bitwise CPU mode's price; the fused kernel
    walks the vocabulary in tiles, another reduction order). Differentiable through autograd."""
    logits_NV = mm_rows(hidden_ND.float(), weight_VD.float())
    temp_N = torch.full((logits_NV.shape[0],), float(temperature), dtype=torch.float32, device=logits_NV.device)
    logp_NV = tempered_log_softmax(logits_NV, temp_N)
    logp_N = logp_NV.gather(1, targets_N.long()[:, None]).squeeze(1)
    if not return_entropy:
        return logp_N
    return logp_N, -(logp_NV.exp() * logp_NV).sum(-1)
