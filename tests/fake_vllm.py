"""A stand-in for vLLM 0.33's `AsyncLLM` built on T1's own `MoEModel`, for driving `rollout.vllm_engine` on CPU.

vLLM needs CUDA, so CI cannot run it. This test double reproduces what the adapter depends on, as read from
the vLLM 0.33.0 wheel (vllm/outputs.py, sampling_params.py, v1/engine/async_llm.py,
distributed/aux_output_connector/, model_executor/layers/fused_moe/routed_experts_capturer.py,
distributed/weight_transfer/):
- `generate(prompt, sampling_params, request_id)` is an async iterator of `RequestOutput`; with
  `output_kind=FINAL_ONLY` it yields once, finished. `RequestOutput.outputs[0]` is a `CompletionOutput` with
  `token_ids` (stop token included), `logprobs` (one `{token: Logprob}` per token for logprobs=0),
  `finish_reason` "stop"/"length", `stop_reason`, `weight_versions` spans; `RequestOutput.num_cached_tokens`.
- `routed_experts`: numpy [rows, num_hidden_layers, K], uint8 for E <= 256 else uint16, rows for positions
  `[routed_experts_prompt_start, P + n - 1)` (the last sampled token never ran), dense layers all zeros.
  Prefix-cached tokens report the routing recorded when they ran (cached per full KV block of `BLOCK` tokens,
  at most floor((P - 1) / BLOCK) blocks per prompt, as vLLM's KV manager caps a hit).
- Log-probs are `processed_logprobs`: log_softmax(logits / T) (T = 0: greedy, log_softmax(logits)).
- Only `stop_token_ids` stop when `ignore_eos`; a request may not run past `max_model_len`.
- `pause_generation(mode="wait", clear_cache=True)` waits for running requests and empties the prefix cache;
  while paused, new requests are rejected. `sleep(level=2, mode)` pauses, then discards the weights (here: NaN)
  and the cache; `wake_up(tags)` resumes scheduling once weights and KV cache are both awake. Weight transfer: `init_weight_transfer_engine`, `start_weight_update`, `update_weights`
  (per-expert HF names loaded in place, as vLLM's load_weights does), `finish_weight_update(weight_version)`.
As strict as vLLM 0.33 where the adapter could go wrong (each cites the real code it mirrors; the `vllm_real`
lane, tests/test_vllm_real.py, runs the adapter against the real classes that import on a CPU):
- every control-plane payload must be msgpack-clean (`collective_rpc` encodes it: v1/serial_utils.py:220);
- `start_weight_update` is refused while an update is open (v1/worker/gpu_worker.py:1569), and the model is
  unusable from then until `finish_weight_update` (layerwise reload leaves layers on meta: here NaN);
- a failed `update_weights` closes the update on the worker (gpu_worker.py:1622-1626);
- SamplingParams raises a temperature in (0, 0.01) to 0.01 (sampling_params.py:560-568);
- `FakeTransport` keeps the client of its first send, as vLLM's trainer-side engines do (weight_transfer/base.py:691),
  and carries tensors outside the payload (an in-process stand-in for the IPC handles / NCCL broadcast).
Sampling uses T1's counter-based draws (`rollout.sampling`), and the forward runs in batch-invariant mode, so
the fake's tokens and routing equal `TorchEngine`'s for the same weights and seeds. What is NOT reproduced:
vLLM's kernels and numerics, its scheduler, its own RNG, and the CUDA IPC / NCCL data planes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from t1kernels.rows import batch_invariant_mode, mm_rows
from rollout.sampling import sample_tokens, uniform
from rollout.vllm_api import Line, VllmApi, check_version
from rollout.vllm_weights import wire_fields
from t1model.hf_io import load_pretrained

BLOCK = 4
"""KV block size of the fake's prefix cache (small, so prompts end mid-block)."""


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)
class SamplingParams:
    """vLLM 0.33's `SamplingParams`, the fields the adapter may set (an unknown one is a TypeError, as msgspec
    raises for a renamed field)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    routed_experts_prompt_start: int = 0

    def __post_init__(self) -> None:
        if 0 < self.temperature < 0.01:  # sampling_params.py:560-568: raised to _MAX_TEMP, only a warning logged
            self.temperature = 0.01
        if not 0.0 < self.top_p <= 1.0 or self.temperature < 0 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError(f"invalid SamplingParams {self}")


def TokensPrompt(*, prompt_token_ids: list[int]) -> dict[str, Any]:  # noqa: N802 (vLLM's TypedDict name)
    return {"prompt_token_ids": prompt_token_ids}


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionSpan] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


@dataclass
class WeightTransferInitRequest:
    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    update_info: dict[str, Any] = field(default_factory=dict)


class FakeAsyncLLM:
    """See the module docstring. `calls` records every control call (name, args) in order."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        if engine_args.get("logprobs_mode") != "processed_logprobs" or not engine_args.get("skip_tokenizer_init"):
            raise ValueError(f"the fake reproduces processed_logprobs with token ids only, got {engine_args}")
        self.args = dict(engine_args)
        self.model = load_pretrained(engine_args["model"], dtype=torch.float32).eval().requires_grad_(False)
        self.cfg = self.model.config
        self.max_model_len = int(engine_args["max_model_len"])
        self.capture = bool(engine_args.get("enable_return_routed_experts"))
        self.prefix_caching = bool(engine_args.get("enable_prefix_caching"))
        self.calls: list[tuple[str, Any]] = []
        self.blocks: dict[int, np.ndarray] = {}  # chained block hash -> routing rows recorded when the block ran
        self.version: str | None = None
        self.running = 0
        self.paused = self.updating = self.dead = False
        self.asleep: set[str] = set()
        self.transfer_init: dict[str, Any] | None = None
        self.requests_seen: list[tuple[str, list[int], SamplingParams]] = []
        self._idle = asyncio.Condition()

    # ---- generation ----
    async def generate(self, prompt: dict[str, Any], sampling_params: SamplingParams, request_id: str,
                       **_: Any) -> AsyncIterator[RequestOutput]:
        ids = [int(t) for t in prompt["prompt_token_ids"]]
        sp = sampling_params
        if self.dead:
            raise RuntimeError("EngineDeadError")
        if self.paused or self.updating or self.asleep:
            raise RuntimeError("RetryableRequestError: generation is paused")
        if sp.output_kind is not RequestOutputKind.FINAL_ONLY or sp.n != 1 or sp.logprobs not in (None, 0):
            raise NotImplementedError(f"the fake reproduces n=1, logprobs 0/None, FINAL_ONLY only, got {sp}")
        if not 0 <= sp.routed_experts_prompt_start <= len(ids):
            raise ValueError("routed_experts_prompt_start must be between 0 and the prompt length")
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room below max_model_len={self.max_model_len}")
        self.requests_seen.append((request_id, ids, sp))
        self.running += 1
        try:
            out = await self._run(ids, sp, request_id)
        finally:
            self.running -= 1
            async with self._idle:
                self._idle.notify_all()
        yield out

    async def _run(self, ids: list[int], sp: SamplingParams, rid: str) -> RequestOutput:
        cached = self._cache_hit(ids)
        cache = self.model.new_kv_cache(num_slots=1, max_seq_len=self.max_model_len)
        version = self.version
        with batch_invariant_mode(True):
            hidden_TD, routing_TLK = self._extend(ids, cache)
        rows = [routing_TLK]
        tokens: list[int] = []
        logps: list[Logprob] = []
        stop = set(sp.stop_token_ids or [])
        reason = stop_reason = None
        while reason is None:
            tok, lp, rank = self._sample(hidden_TD[-1:], sp, len(tokens))
            tokens.append(tok)
            logps.append(Logprob(logprob=lp, rank=rank))
            if tok in stop:
                reason, stop_reason = "stop", tok
            elif len(tokens) >= sp.max_tokens or len(ids) + len(tokens) >= self.max_model_len:
                reason = "length"
            else:
                await asyncio.sleep(0)  # let other requests step, as a continuous-batching scheduler does
                with batch_invariant_mode(True):
                    hidden_TD, routing_TLK = self._extend([tok], cache)
                rows.append(routing_TLK)
        assert self.version == version, "the fake's weights changed under a running request"
        ran = self._all_layers(torch.cat(rows).numpy())  # positions [0, P + n - 1)
        if cached:
            ran[:cached] = self._cached_rows(ids, cached)  # cached tokens: the routing recorded when they ran
        self._remember(ids + tokens, ran)
        routed = ran[sp.routed_experts_prompt_start:].astype(self._dtype()) if self.capture else None
        out = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=sum(p.logprob for p in logps),
                               logprobs=[{t: p} for t, p in zip(tokens, logps)] if sp.logprobs == 0 else None,
                               routed_experts=routed, finish_reason=reason, stop_reason=stop_reason,
                               weight_versions=[WeightVersionSpan(str(version), 0, len(tokens))])
        return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=ids, prompt_logprobs=None,
                             outputs=[out], finished=True, num_cached_tokens=cached)

    def _extend(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.extend(torch.tensor(ids, dtype=torch.long), cache=cache, slot_ids=[0],
                                 cu_seqlens=[0, len(ids)])

    def _sample(self, hidden_1D: torch.Tensor, sp: SamplingParams, step: int) -> tuple[int, float, int]:
        with batch_invariant_mode(True):
            logits_1V = mm_rows(hidden_1D.float(), self.model.lm_head.weight.float())
        tok_1, lp_1 = sample_tokens(logits_1V, temperature_B=torch.tensor([sp.temperature], dtype=torch.float32),
                                    top_p_B=torch.tensor([sp.top_p], dtype=torch.float32),
                                    uniform_B=torch.tensor([uniform(sp.seed or 0, step)], dtype=torch.float64))
        temp = sp.temperature if sp.temperature > 0 else 1.0
        logp_V = torch.log_softmax(logits_1V[0] / temp, dim=-1)
        tok, lp = int(tok_1), float(lp_1)
        return tok, lp, int((logp_V > logp_V[tok]).sum()) + 1

    def _all_layers(self, moe_RLK: np.ndarray) -> np.ndarray:
        """[R, L_moe, K] -> [R, num_hidden_layers, K] with dense layers' rows zero (vLLM's layer axis)."""
        out = np.zeros((moe_RLK.shape[0], self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok), np.int64)
        out[:, list(self.cfg.moe_layer_ids)] = moe_RLK
        return out

    def _dtype(self) -> type:
        return np.uint8 if self.cfg.num_experts <= 256 else np.uint16

    # ---- prefix cache (routing per full block, keyed by the chained hash of the tokens up to it) ----
    @staticmethod
    def _hashes(ids: list[int], num_blocks: int) -> list[int]:
        out, h = [], 0
        for b in range(num_blocks):
            h = hash((h, tuple(ids[b * BLOCK:(b + 1) * BLOCK])))
            out.append(h)
        return out

    def _cache_hit(self, ids: list[int]) -> int:
        if not self.prefix_caching:
            return 0
        hit = 0
        for h in self._hashes(ids, (len(ids) - 1) // BLOCK):  # the last prompt token always runs
            if h not in self.blocks:
                break
            hit += BLOCK
        return hit

    def _cached_rows(self, ids: list[int], cached: int) -> np.ndarray:
        return np.concatenate([self.blocks[h] for h in self._hashes(ids, cached // BLOCK)])

    def _remember(self, seq: list[int], ran: np.ndarray) -> None:
        if self.prefix_caching:
            for b, h in enumerate(self._hashes(seq, ran.shape[0] // BLOCK)):
                self.blocks.setdefault(h, ran[b * BLOCK:(b + 1) * BLOCK].copy())

    # ---- control plane ----
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause_generation", {"mode": mode, "clear_cache": clear_cache}))
        if mode != "wait":
            raise NotImplementedError(f"the fake reproduces mode='wait' only, got {mode!r}")
        self.paused = True
        async with self._idle:
            await self._idle.wait_for(lambda: self.running == 0)
        if clear_cache:
            self.blocks.clear()

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", None))
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        self.blocks.clear()
        return True

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pauses scheduling first (clearing the prefix cache), as EngineCore.sleep does."""
        self.calls.append(("sleep", level))
        if not self.args.get("enable_sleep_mode"):
            raise ValueError("sleep mode is not enabled (enable_sleep_mode=False)")
        await self.pause_generation(mode=mode, clear_cache=True)
        if level == 2:  # weights discarded: anything served before new weights arrive is garbage
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(math.nan)
        self.blocks.clear()
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or ("weights", "kv_cache"))
        if not self.asleep:  # EngineCore.wake_up resumes scheduling once all memory is resident again
            self.paused = False
        return not self.asleep

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(("update_weight_version", new_version))
        self.version = new_version

    async def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        self.calls.append(("init_weight_transfer_engine", request.init_info))
        self.transfer_init = dict(rpc_payload(request.init_info))

    async def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", None))
        if self.dead:
            raise RuntimeError("EngineDeadError")
        if self.transfer_init is None:
            raise RuntimeError("weight transfer not initialised: call init_weight_transfer_engine first")
        if self.updating:  # gpu_worker.py:1569
            raise RuntimeError("start_weight_update called while a weight update is already active. Call "
                               "finish_weight_update first.")
        if "weights" in self.asleep or self.running:
            raise RuntimeError("weights are asleep or requests are running")
        self.updating = True
        with torch.no_grad():  # initialize_layerwise_reload: every layer on meta until finalize
            for p in self.model.parameters():
                p.fill_(math.nan)

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        info = rpc_payload(request.update_info)
        self.calls.append(("update_weights", list(info["names"])))
        if not self.updating:  # gpu_worker.py:1608
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            tensors = _WIRE.pop(info["handle"])
            if wire_fields(info["names"], tensors) != {k: info[k] for k in ("names", "dtype_names", "shapes")}:
                raise ValueError("update_info names/dtype_names/shapes disagree with the tensors")
            params = dict(self.model.named_parameters())
            f = self.cfg.moe_intermediate_size
            with torch.no_grad():
                for name, t in zip(info["names"], tensors):
                    self._load(params, name, t, f)
        except BaseException:
            self.updating = False  # gpu_worker.py:1622-1626 (the layers stay where the reload left them)
            raise

    @staticmethod
    def _load(params: dict[str, torch.nn.Parameter], name: str, t: torch.Tensor, f: int) -> None:
        """One HF tensor into our stacked expert layout (what vLLM's load_weights does into its own)."""
        if ".mlp.experts." in name:
            prefix, e, proj, _ = name.rsplit(".", 3)
            e = int(e)
            if proj == "down_proj":
                params[f"{prefix}.w2"][e].copy_(t)
            elif proj == "gate_proj":
                params[f"{prefix}.w13"][e, :f].copy_(t)
            else:
                params[f"{prefix}.w13"][e, f:].copy_(t)
        else:
            params[name].copy_(t)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish_weight_update", weight_version))
        if not self.updating:  # gpu_worker.py:1638
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.updating = False
        if weight_version is not None:
            self.version = weight_version

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append(("shutdown", None))
        self.dead = True


def rpc_payload(payload: Any) -> Any:
    """`payload` after the msgpack round trip of AsyncLLM's `collective_rpc`; TypeError for what vLLM's encoder
    refuses without VLLM_ALLOW_INSECURE_SERIALIZATION (v1/serial_utils.py:220: torch classes, dtypes, tensors
    handed over by reference, any other object)."""
    def refuse(obj: Any) -> Any:
        raise TypeError(f"Object of type {type(obj)} is not serializable (vLLM's collective_rpc is msgpack)")

    return msgspec.msgpack.decode(msgspec.msgpack.encode(payload, enc_hook=refuse))


_WIRE: dict[int, list[torch.Tensor]] = {}
"""The fake's data plane: the tensors of one update chunk, keyed by the handle its msgpack-clean update_info
carries (vLLM: a CUDA IPC handle, or an NCCL broadcast the worker receives)."""
_handles = iter(range(1 << 62))


class FakeTransport:
    """The control flow of vLLM's trainer-side weight engines (init once, then start, update chunks, finish per
    round) in buckets of at most `bucket_bytes`, with tensors on `_WIRE`. Like vLLM's, it keeps the client it was
    first given (base.py:691) until `reset`."""

    bucket_bytes = 1 << 20
    keeps_weights = False  # as vLLM's GPU transfers: the engine restarts from its checkpoint after a failed update

    def __init__(self, *, backend: str, expected: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 nccl_init: dict[str, Any] | None = None) -> None:
        self.backend, self.expected, self.dtype = backend, expected, dtype
        self.client: Any = None

    def reset(self) -> None:
        self.client = None

    def close(self) -> None:
        """Nothing kept."""

    def send(self, stream: Any, client: Any) -> None:
        if self.client is None:
            self.client = client
            client.init_weight_transfer_engine({"packed": True})
        client = self.client
        client.start_weight_update()
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        size = 0
        for name, t in stream:
            names.append(name)
            tensors.append(t)
            size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                self._update(client, names, tensors)
                names, tensors, size = [], [], 0
        if names:
            self._update(client, names, tensors)
        client.finish_weight_update()

    @staticmethod
    def _update(client: Any, names: list[str], tensors: list[torch.Tensor]) -> None:
        handle = next(_handles)
        _WIRE[handle] = tensors
        try:
            client.update_weights({**wire_fields(names, tensors), "handle": handle})
        finally:
            _WIRE.pop(handle, None)


def require() -> Line:
    """`rollout.vllm_api.require_vllm` with the fake in place (monkeypatch it in with `fake_api`)."""
    return check_version("0.33.0")


def fake_api() -> VllmApi:
    """`rollout.vllm_api.load_vllm`'s result with the fake in place of vLLM (monkeypatch it in)."""
    return VllmApi(version="0.33.0", SamplingParams=SamplingParams, TokensPrompt=TokensPrompt,
                   final_only=RequestOutputKind.FINAL_ONLY, WeightTransferInitRequest=WeightTransferInitRequest,
                   WeightTransferUpdateRequest=WeightTransferUpdateRequest, make_llm=FakeAsyncLLM,
                   make_transport=FakeTransport, wire_device="cpu")


def field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)}
