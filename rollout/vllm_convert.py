"""Pure conversions between T1's engine boundary and vLLM's request/output format (no vLLM import here).

Legend: n sampled tokens, P prompt tokens, L hidden layers (every decoder layer), L_moe MoE layers, K top-k,
E experts per MoE layer.

What vLLM (0.33) hands back for one request, with `enable_return_routed_experts=True`:
- `CompletionOutput.routed_experts`: numpy [rows, L, K], uint8 when E <= 256 else uint16, one row per position
  from `SamplingParams.routed_experts_prompt_start` to the last position the model *ran*, P + n - 2: the last
  sampled token never went through the model, so it has no row. The layer axis is every hidden layer; a dense
  layer's row is zeros (its MLP has no router).
- `CompletionOutput.logprobs` with `SamplingParams(logprobs=0)`: one `{token_id: Logprob}` per sampled token
  holding the sampled token (a list of dicts, or vLLM's FlatLogprobs, which indexes the same way).

`Completion` wants routing `[n, L_moe, K]` in the model's routing dtype and fp32 log-probs; the functions
below do that conversion and refuse anything malformed (ids outside [0, E), a degenerate all-zero capture,
the wrong number of rows) instead of passing it on to the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rollout.engine import FinishReason, SamplingParams


VLLM_MIN_TEMPERATURE = 0.01
"""vLLM's `_MAX_TEMP` (vllm/sampling_params.py:33): `SamplingParams.__post_init__` (lines 560-568) raises any
temperature in (0, 0.01) to 0.01 with only a log warning, so vLLM would sample and score at 0.01 while the trainer
recomputes log-probs at the configured value (wrong ratios, silently). Such a temperature is refused instead."""


def check_temperature(temperature: float, *, key: str = "temperature") -> None:
    """ValueError for a temperature vLLM would silently change (`VLLM_MIN_TEMPERATURE`); 0 (greedy) is kept."""
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        raise ValueError(f"{key}={temperature}: vLLM raises any temperature in (0, {VLLM_MIN_TEMPERATURE}) to "
                         f"{VLLM_MIN_TEMPERATURE} (vllm/sampling_params.py:560), so its samples and log-probs would "
                         f"not be the ones the trainer scores; use 0 (greedy) or >= {VLLM_MIN_TEMPERATURE}")


def vllm_sampling_kwargs(params: SamplingParams, *, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one T1 request (`output_kind` is added by the caller,
    which holds vLLM's enum).

    Log-probs: `logprobs=0` returns the sampled token's log-prob, under the engine's `logprobs_mode`
    ("processed_logprobs": after temperature, before nothing else since top-k and top-p are off), which is
    `rollout.sampling`'s definition. top_p < 1 is refused: vLLM's processed log-prob is then renormalised
    over the nucleus while T1's is not; so is a temperature in (0, 0.01) (`check_temperature`). Stops: only
    `stop_token_ids` stop a request (`ignore_eos=True`: vLLM would otherwise add the model's EOS ids to the stop
    set), and the stop token is part of `token_ids`.
    """
    if params.top_p < 1:
        raise ValueError(f"params.top_p={params.top_p}: the vLLM engine needs top_p = 1 (its log-prob of a "
                         "top-p sample is renormalised over the nucleus, T1's is not)")
    check_temperature(params.temperature, key="params.temperature")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return {"n": 1, "temperature": float(params.temperature), "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "seed": int(params.seed), "max_tokens": int(max_tokens), "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True, "logprobs": 0, "detokenize": False, "skip_special_tokens": False,
            "routed_experts_prompt_start": int(params.prompt_routing_from)}


def flush_sampling_kwargs(*, routed_from: int) -> dict[str, Any]:
    """The one-token request that yields the routing of a completion's last sampled token (module docstring
    of `rollout.vllm_engine`): greedy, no log-probs, rows from `routed_from` = P + n - 1 only."""
    return {"n": 1, "temperature": 0.0, "max_tokens": 1, "ignore_eos": True, "detokenize": False,
            "skip_special_tokens": False, "routed_experts_prompt_start": int(routed_from)}


def moe_routing(rows_RLK: Any, *, moe_layer_ids: Sequence[int], num_hidden_layers: int, top_k: int,
                num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's routed-experts rows over every hidden layer -> T1's `[R, L_moe, K]` over the MoE layers only.

    Dense layers' rows are dropped by `moe_layer_ids` (vLLM writes zeros there). ValueError when the array is
    not `[R, num_hidden_layers, top_k]` of an integer dtype, an id is outside [0, num_experts), or a token's
    ids within one MoE layer repeat (a top-k never picks an expert twice: repeated ids mean a capture that was
    never written, e.g. all zeros).
    """
    rows = np.asarray(rows_RLK)
    if rows.ndim != 3 or rows.shape[1:] != (num_hidden_layers, top_k):
        raise ValueError(f"routed_experts: expected [rows, {num_hidden_layers}, {top_k}] (every hidden layer), "
                         f"got {tuple(rows.shape)}")
    if not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"routed_experts: expected an integer dtype, got {rows.dtype}")
    ids = list(moe_layer_ids)
    if not ids or min(ids) < 0 or max(ids) >= num_hidden_layers:
        raise ValueError(f"moe_layer_ids: expected indices in [0, {num_hidden_layers}), got {ids}")
    moe_RLK = rows[:, ids, :].astype(np.int64)
    if moe_RLK.size:
        low, high = int(moe_RLK.min()), int(moe_RLK.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"routed_experts: expert ids must be in [0, {num_experts}), got min {low} max {high}")
        if top_k > 1:
            ordered = np.sort(moe_RLK, axis=-1)
            repeats = ordered[..., 1:] == ordered[..., :-1]
            if repeats.any():
                r, layer = (int(i) for i in np.argwhere(repeats.any(-1))[0])
                raise ValueError(f"routed_experts: row {r} of MoE layer {ids[layer]} repeats an expert "
                                 f"({moe_RLK[r, layer].tolist()}): a top-{top_k} never does (capture not written?)")
    return torch.from_numpy(moe_RLK).to(dtype)


def split_routing(routing_RLK: torch.Tensor, *, prompt_len: int, routed_from: int, num_new: int,
                  last_row_LK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_routing, routing) of a completion from vLLM's rows `[routed_from, P + n - 1)` plus the row of
    position P + n - 1 (the last sampled token), which vLLM never returns with the request itself and the
    caller obtains separately (required). Returns `[P - routed_from, L_moe, K]` and `[n, L_moe, K]`."""
    expected = prompt_len + num_new - 1 - routed_from
    if routing_RLK.shape[0] != expected:
        raise ValueError(f"routed_experts: expected {expected} rows (positions [{routed_from}, "
                         f"{prompt_len + num_new - 1})), got {routing_RLK.shape[0]}")
    if last_row_LK is None or last_row_LK.shape != routing_RLK.shape[1:]:
        got = None if last_row_LK is None else tuple(last_row_LK.shape)
        raise ValueError(f"the last sampled token's routing row must be {tuple(routing_RLK.shape[1:])}, got {got}")
    cut = prompt_len - routed_from
    full = torch.cat([routing_RLK, last_row_LK.to(routing_RLK.dtype)[None]])
    return full[:cut].clone(), full[cut:].clone()


def sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """fp32 [n] log-probs of the sampled tokens from vLLM's per-position `{token_id: Logprob}` entries."""
    if logprobs is None:
        raise ValueError("vLLM returned no logprobs (the request must set logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} logprob entries for {len(token_ids)} tokens")
    out = []
    for i, tok in enumerate(token_ids):
        entry = logprobs[i]
        if entry is None or tok not in entry:
            raise ValueError(f"vLLM's logprobs at position {i} lack the sampled token {tok}")
        out.append(entry[tok].logprob)
    values = torch.tensor(out, dtype=torch.float64)
    if not torch.isfinite(values).all() or (values > 0).any():
        raise ValueError(f"vLLM returned log-probs that are not finite and <= 0: {out}")
    return values.float()


def finish_reason(reason: str | None, *, request_id: str) -> FinishReason:
    """vLLM's finish reason -> T1's; an aborted or failed request is an error, not a completion."""
    if reason in ("stop", "length"):
        return reason  # type: ignore[return-value]
    raise RuntimeError(f"vLLM request {request_id} ended with finish_reason={reason!r} (expected 'stop' or "
                       "'length')")


def max_new_tokens(*, prompt_len: int, requested: int, max_model_len: int) -> int:
    """Sampled tokens allowed for a prompt: the request's own cap, and room for the flush request, whose prompt
    (P + n tokens) must still leave vLLM one position to sample into (P + n + 1 <= max_model_len)."""
    room = max_model_len - prompt_len - 1
    if room < 1:
        raise ValueError(f"prompt has {prompt_len} tokens; with max_model_len={max_model_len} the vLLM engine "
                         f"needs prompts of at most {max_model_len - 2} tokens (one sampled token plus the "
                         "routing flush)")
    return min(requested, room)
