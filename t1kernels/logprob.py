"""Log-probabilities (and entropy) of exact token IDs under the LM head, with logits memory bounded by a tile.

Legend: N rows (tokens), D model dim, V vocab. Backends: Triton kernels (`logprob_triton`, CUDA or the
interpreter) and torch (`logprob_torch`, CPU); `t1kernels.backend.select_backend` picks one. All run the same
autograd Function over a (forward, backward) pair. Triton and the chunked torch path save only the per-row
log-sum-exp and E_p[z] (O(N)) and recompute the logits block by block in the backward; on the torch backend,
logits that fit one tile (`logprob_torch.fits_one_tile`) instead keep their log-softmax, so nothing is recomputed.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from t1kernels import logprob_torch
from t1kernels.backend import Backend, select_backend

_OP = "token_logprobs"


def _impl(backend: Backend, num_rows: int, vocab: int):
    """(fwd, bwd, drop): fwd returns (logp_N, entropy_N, *state), bwd takes the state after (hidden, weight,
    targets), drop (None: nothing to do) releases the state when no backward will follow."""
    if backend == "torch":
        if logprob_torch.fits_one_tile(num_rows, vocab):
            return logprob_torch.tile_logprob_fwd, logprob_torch.tile_logprob_bwd, logprob_torch.tile_logprob_drop
        return logprob_torch.chunked_logprob_fwd, logprob_torch.chunked_logprob_bwd, None
    from t1kernels import logprob_triton  # imported lazily: importing triton is slow and optional on CPU
    return logprob_triton.triton_logprob_fwd, logprob_triton.triton_logprob_bwd, None


class TokenLogprobsFunction(torch.autograd.Function):
    """(hidden_ND, weight_VD, targets_N) -> (logp_N, entropy_N); gradients reach hidden and weight."""

    @staticmethod
    def forward(ctx, hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                temperature: float, ignore_index: int, with_entropy: bool, backend: Backend, keep: bool):
        fwd, ctx.bwd, drop = _impl(backend, hidden_ND.shape[0], weight_VD.shape[0])
        logp_N, ent_N, *state = fwd(hidden_ND, weight_VD, targets_N, temperature=temperature,
                                    ignore_index=ignore_index, with_entropy=with_entropy)
        if not keep and drop is not None:
            drop(*state)  # no backward can come (no grad mode, or nothing requires grad)
            state = []
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, *state)
        ctx.temperature, ctx.ignore_index, ctx.backward_done = temperature, ignore_index, False
        ctx.set_materialize_grads(False)  # an unused entropy output brings None, and its term is skipped
        if not with_entropy:
            ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp_N: torch.Tensor | None, grad_ent_N: torch.Tensor | None):
        # The single-tile torch backward overwrites its saved log-softmax (a fresh tile would cost page faults),
        # so a second backward through the graph (retain_graph=True) would read garbage: refuse it.
        if ctx.backward_done:
            raise RuntimeError("token_logprobs: a second backward through the same graph is not supported "
                               "(the first one consumes the saved state)")
        ctx.backward_done = True
        hidden_ND, weight_VD, targets_N, *state = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp_N is None and grad_ent_N is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None, None
        d_hidden, d_weight = ctx.bwd(hidden_ND, weight_VD, targets_N, *state,
                                     _contiguous(grad_logp_N), _contiguous(grad_ent_N),
                                     temperature=ctx.temperature, ignore_index=ctx.ignore_index,
                                     need_hidden=need_h, need_weight=need_w)
        return d_hidden, d_weight, None, None, None, None, None, None


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _validate(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
              ignore_index: int) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D tensor [N, D], got {_describe(hidden)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D tensor [V, D], got {_describe(weight)}")
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1:
        raise ValueError(f"targets: expected a 1-D tensor [N], got {_describe(targets)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"weight: expected [V, D] with D = hidden.shape[1] = {hidden.shape[1]}, "
                         f"got shape {tuple(weight.shape)}")
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets: expected [N] with N = hidden.shape[0] = {hidden.shape[0]}, "
                         f"got shape {tuple(targets.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight: expected a non-empty vocabulary, got V = 0")
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden: expected a floating dtype, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: expected dtype {hidden.dtype} (same as hidden), got {weight.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets: expected int64 or int32, got {targets.dtype}")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(f"weight/targets: expected device {hidden.device} (hidden's), got weight on "
                         f"{weight.device}, targets on {targets.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a number > 0, got {temperature!r}")
    V = weight.shape[0]
    bad_N = (targets != ignore_index) & ((targets < 0) | (targets >= V))
    if bool(bad_N.any()):  # sync: bad IDs would read out of bounds in the kernel; checking needs the host
        first = int(bad_N.nonzero()[0, 0])
        raise ValueError(f"targets: expected IDs in [0, {V}) or ignore_index={ignore_index}, got "
                         f"{int(targets[first])} at position {first}")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}"
    return type(x).__name__


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   temperature: float = 1.0, return_entropy: bool = False, ignore_index: int = -100,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token under softmax(hidden @ weight.T / temperature).

    Args:
        hidden: [N, D] floating (fp32/bf16/fp16), the final hidden states.
        weight: [V, D], the LM head, same dtype and device as `hidden`.
        targets: [N] int64/int32 token IDs in [0, V), or `ignore_index`.
        temperature: > 0; logits are divided by it (the sampler's temperature, so logp matches rollout).
        return_entropy: also return the entropy of each row's distribution.
        ignore_index: rows with this target give logp = entropy = 0 and no gradient.

    Returns:
        logp [N] fp32, or (logp [N] fp32, entropy [N] fp32). Differentiable w.r.t. `hidden` and `weight`
        through both outputs, once: a second backward through the same graph raises RuntimeError.

    Memory: never holds more than a fixed number of [block_rows, block_cols] tiles plus O(N * D). The vocabulary
    is walked in blocks with an online max / log-sum-exp in fp32 and the backward recomputes logits blockwise;
    on CPU, logits that fit a single tile (N * V <= 2**23) are held whole from forward to backward instead
    (`t1kernels.logprob_torch`). Deterministic: fixed reduction order, no float atomics.

    Raises:
        ValueError naming the argument: wrong ranks/shapes/dtypes/devices, temperature <= 0, target IDs out
        of [0, V) other than ignore_index. RuntimeError when Triton is required but cannot run.
    """
    _validate(hidden, weight, targets, temperature, ignore_index)
    backend = select_backend(hidden, weight, targets, op=_OP)
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logp_N, ent_N = TokenLogprobsFunction.apply(hidden, weight, targets, float(temperature), int(ignore_index),
                                                bool(return_entropy), backend, keep)
    return (logp_N, ent_N) if return_entropy else logp_N
