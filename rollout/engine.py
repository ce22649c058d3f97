"""The generation-engine boundary: `SamplingParams`, `Completion` and the `Engine` protocol.

Legend: n new (sampled) tokens, P prompt tokens, L_moe MoE layers, K top-k experts.

An engine turns token-ID prompts into token-ID completions (token in, token out: no text crosses this
boundary). Besides the tokens it returns, per sampled token, the log-prob under the sampling distribution
(see `rollout.sampling`) and, when asked, the expert ids every MoE layer chose for every token it ran
(R3 capture), so that the trainer can replay them. `rollout.torch_engine.TorchEngine` is the built-in
implementation; a second one (vLLM, a remote server) only has to satisfy `Engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from rollout.sampling import derive_seed

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request is sampled."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: sample from the smallest set of most likely tokens holding this mass."""
    max_new_tokens: int = 256
    """Upper bound on sampled tokens; reaching it finishes with reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these finishes with reason "stop"; the stop token is part of the completion."""
    seed: int = 0
    """Seed of this request's draws. `Engine.generate` derives one seed per prompt from it
    (`request_seed`); `Engine.submit` uses it as given."""
    return_routing: bool = True
    """Return the expert ids of the sampled tokens and of the prompt from `prompt_routing_from` (R3)."""
    prompt_routing_from: int = 0
    """First prompt position whose routing comes back in `Completion.prompt_routing`. A multi-turn caller
    passes the length it already holds routing for, so routes travel incrementally, never twice."""
    forced_token_ids: tuple[int, ...] = ()
    """Teacher forcing (TorchEngine): the first tokens of the reply are these instead of draws, each with the
    log-prob and routing a draw of it would have had; sampling goes on after them (up to max_new_tokens)."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop_token_ids, tuple):
            raise TypeError(f"stop_token_ids must be a tuple of ints, got {type(self.stop_token_ids).__name__}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not isinstance(self.forced_token_ids, tuple):
            raise TypeError(f"forced_token_ids must be a tuple of ints, got {type(self.forced_token_ids).__name__}")
        if self.prompt_routing_from < 0:
            raise ValueError(f"prompt_routing_from must be >= 0, got {self.prompt_routing_from}")

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def request_seed(seed: int, index: int) -> int:
    """Seed of the `index`-th prompt of a `generate` call: depends on (seed, index) only, not on batching."""
    return derive_seed(seed, index)


@dataclass(frozen=True, kw_only=True)
class Completion:
    """What an engine returns for one prompt."""

    token_ids: list[int]
    """Sampled token ids, in order; ends with the stop token when finish_reason == "stop"."""
    logprobs: torch.Tensor
    """fp32 [n]: log-prob of each sampled token under log_softmax(logits / temperature), without top-p
    renormalisation (temperature 0: under log_softmax(logits))."""
    routing: torch.Tensor | None
    """[n, L_moe, K] expert ids (uint8 when E <= 256, else int16) of the sampled tokens, or None when
    routing was not requested or the engine cannot capture it."""
    finish_reason: FinishReason
    """"stop" (sampled a stop token) or "length" (max_new_tokens or the engine's context limit)."""
    prompt_routing: torch.Tensor | None = None
    """[P - prompt_routing_start, L_moe, K] expert ids the engine used for the prompt tokens from
    `prompt_routing_start` on (tokens served from the prefix cache: the routing recorded when they ran)."""
    prompt_routing_start: int = 0
    """Index in the prompt of the first token covered by `prompt_routing` (= params.prompt_routing_from)."""
    policy_version: int = 0
    """Weight version that produced every token of this completion."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (not recomputed)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Engine-specific timings/counters."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 1:
            raise ValueError("a completion has at least one sampled token, got 0")
        if self.logprobs.shape != (n,) or self.logprobs.dtype != torch.float32:
            raise ValueError(f"logprobs must be fp32 [{n}], got {self.logprobs.dtype} {tuple(self.logprobs.shape)}")
        if self.routing is not None and (self.routing.dim() != 3 or self.routing.shape[0] != n):
            raise ValueError(f"routing must be [{n}, L_moe, K], got {tuple(self.routing.shape)}")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")


@runtime_checkable
class Engine(Protocol):
    """A batched, thread-safe generation engine: every method the trainer calls on one."""

    @property
    def policy_version(self) -> int:
        """Version of the weights new requests are served with (bumped by every weight update)."""
        ...

    def submit(self, prompt: list[int], params: SamplingParams) -> Future[Completion]:
        """Queue one request (callable from any thread); the future resolves when it finishes."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run all prompts (prompt i seeded with `request_seed(params.seed, i)`) and wait for them."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace the policy's weights; returns the new `policy_version`.

        named_tensors: (name, whole unsharded tensor) pairs under the HF Qwen3-MoE names `t1model.hf_io.
        hf_state_dict` uses (per-expert `model.layers.N.mlp.experts.M.{gate,up,down}_proj.weight`), consumed lazily
        so a sharded trainer can produce them one decoder layer at a time and never hold the whole model. Every
        expected name arrives exactly once (missing, unknown or repeated: ValueError), and no request is ever served
        from a half-updated model. Requests finished before the call keep their version; later ones get the new."""
        ...

    def sleep(self) -> None:
        """Give back the accelerator memory this engine shares with the trainer (weights, KV cache) until the next
        `update_weights`, which wakes it; requests are refused meanwhile. The trainer asks only an engine that
        shares its GPUs (a colocated vLLM); an engine that shares nothing (TorchEngine) does nothing."""
        ...

    def close(self) -> None:
        """Stop the engine; requests not finished get a RuntimeError. Idempotent."""
        ...


def check_request(prompt: list[int], params: SamplingParams, *, vocab_size: int) -> None:
    """What every engine refuses at `submit` (ValueError naming the problem): an empty prompt, ids outside
    [0, vocab_size), prompt routing asked from beyond the prompt."""
    if not prompt:
        raise ValueError("prompt must not be empty")
    if params.prompt_routing_from > len(prompt):
        raise ValueError(f"params.prompt_routing_from={params.prompt_routing_from} exceeds the prompt length "
                         f"{len(prompt)}")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt ids must be in [0, {vocab_size}), got min {min(prompt)} max {max(prompt)}")
    forced = params.forced_token_ids
    if forced and (min(forced) < 0 or max(forced) >= vocab_size):
        raise ValueError(f"params.forced_token_ids must be in [0, {vocab_size}), got min {min(forced)} max {max(forced)}")


def generate_via_submit(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
    """`Engine.generate` in terms of `submit`: every prompt gets its own derived seed, then all are awaited."""
    futures = [engine.submit(p, params.replace(seed=request_seed(params.seed, i))) for i, p in enumerate(prompts)]
    return [f.result() for f in futures]
