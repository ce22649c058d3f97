"""Seeded temperature / top-p sampling whose draws do not depend on batch composition.

Legend: B rows (requests), V vocabulary.

Randomness is counter-based: the uniform number that picks row b's token at decode step n is a pure
function of (the row's seed, n), computed with SplitMix64 on the host. No generator state is carried
between steps or shared between rows, so a request draws the same numbers whether it runs alone, in a
batch of 8, or joins a running batch half-way, and a step can be replayed exactly.

A token is picked by inverse-CDF sampling: walk the (top-p truncated) distribution in a fixed order and
take the first token whose cumulative probability exceeds u * kept_mass. Any fixed order gives the right
distribution; without top-p we walk token-id order and skip the sort.

Log-probabilities reported for a sampled token are those of the full tempered distribution
`log_softmax(logits / temperature)`, WITHOUT top-p renormalisation (vLLM reports the same quantity). This
is what the trainer recomputes from its own logits, so rollout and training log-probs are comparable.
Temperature 0 means greedy; its reported log-prob is under `log_softmax(logits)` (temperature 1).
"""

from __future__ import annotations

import torch

from t1kernels.rows import tempered_log_softmax

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One SplitMix64 output for state x (a well-mixed 64-bit hash of x)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed derived deterministically from `seed` and integer keys (request index, turn, ...)."""
    x = seed & _MASK64
    for k in keys:
        x = splitmix64(x ^ splitmix64(k & _MASK64))
    return x >> 1


def uniform(seed: int, step: int) -> float:
    """The uniform draw in [0, 1) of a request with this seed at decode step `step`."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 11) * (1.0 / (1 << 53))


def sample_tokens(logits_BV: torch.Tensor, *, temperature_B: torch.Tensor, top_p_B: torch.Tensor,
                  uniform_B: torch.Tensor, any_top_p: bool | None = None,
                  any_greedy: bool | None = None, forced_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token_ids_B int64, logprobs_B fp32).

    temperature_B: fp32 [B], 0 means greedy. top_p_B: fp32 [B] in (0, 1]. uniform_B: fp64 [B] in [0, 1),
    one draw per row (from `uniform`). Log-probs follow the module docstring's definition. `any_top_p` /
    `any_greedy`: whether some row has top_p < 1 / temperature 0, when the caller knows it on the host
    (saves a device sync each); None checks the tensors. `forced_B`: int64 [B], a row's token where >= 0 (teacher
    forcing: its log-prob as if it had been drawn), a draw where -1.
    """
    if logits_BV.dim() != 2:
        raise ValueError(f"logits_BV must be [B, V], got shape {tuple(logits_BV.shape)}")
    B = logits_BV.shape[0]
    for name, t in (("temperature_B", temperature_B), ("top_p_B", top_p_B), ("uniform_B", uniform_B)):
        if t.shape != (B,):
            raise ValueError(f"{name} must have shape ({B},), got {tuple(t.shape)}")
    if any_greedy is None:
        any_greedy = bool((temperature_B <= 0).any())  # sync
    if any_top_p is None:
        any_top_p = bool((top_p_B < 1).any())  # sync
    logits_BV = logits_BV.float()
    # Greedy rows get temperature 1 for their reported log-prob (module docstring).
    temp_B = torch.where(temperature_B <= 0, 1.0, temperature_B.float()) if any_greedy else temperature_B.float()
    logp_BV = tempered_log_softmax(logits_BV, temp_B)
    probs_BV = logp_BV.exp()
    order_BV = None
    if any_top_p:
        order_BV = torch.sort(probs_BV, dim=-1, descending=True, stable=True).indices
        probs_BV = probs_BV.gather(1, order_BV)
        before_BV = probs_BV.cumsum(-1) - probs_BV
        # Keep the smallest head whose mass reaches top_p (the first token is always kept).
        probs_BV = torch.where(before_BV < top_p_B[:, None], probs_BV, 0.0)
    cdf_BV = probs_BV.double().cumsum(-1)
    total_B1 = cdf_BV[:, -1:].contiguous()
    pos_B1 = torch.searchsorted(cdf_BV, uniform_B.double()[:, None] * total_B1, right=True)
    # u * total can round up to total: then take the last token with mass (first index reaching total).
    pos_B = torch.minimum(pos_B1, torch.searchsorted(cdf_BV, total_B1)).squeeze(1)
    tokens_B = pos_B if order_BV is None else order_BV.gather(1, pos_B[:, None]).squeeze(1)
    if any_greedy:
        tokens_B = torch.where(temperature_B <= 0, logits_BV.argmax(-1), tokens_B)
    if forced_B is not None:
        tokens_B = torch.where(forced_B >= 0, forced_B, tokens_B)
    return tokens_B, logp_BV.gather(1, tokens_B[:, None]).squeeze(1)
