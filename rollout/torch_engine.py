"""`TorchEngine`: the built-in engine over `t1model.model.MoEModel` with a slotted KV cache.

Legend: B running requests, D model dim, V vocab, L_moe MoE layers, K top-k, S cache length.

One engine thread owns the model and the cache and runs the batch loop; any thread may `submit`. Each loop
step (1) admits queued requests into free cache slots, (2) runs one `extend` over the new prompt tails
(prefill) and one over the decoding requests (one token each), (3) samples the next token of every row that
is still generating, and (4) retires finished requests. Requests join and leave between steps (continuous
batching), so an episode waiting on its sandbox never stalls the others.

Every request ends with one extra "flush" feed of its last sampled token: it yields that token's routing
(so `Completion.routing` covers every sampled token) and leaves the slot holding exactly prompt + reply,
which is what the same episode's next prompt starts with.

Prefix reuse: a slot remembers the token ids it caches, the weight version that produced them and the
routing of those tokens. A new prompt takes the free slot sharing its longest prefix with the same version
(truncating the rest), else the least recently used free slot. Shared prefixes (the same system prompt in
many episodes) are reused too; their routing is served from the slot's history, so a request gets the
prompt routing it asks for (`SamplingParams.prompt_routing_from`) whether or not its prefix was cached.
`update_weights` waits for the running batch to drain, loads the weights (HF-named tensors, streamed), bumps
the version and forgets every slot: nothing computed by older weights is ever reused.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from t1kernels.rows import batch_invariant_mode, mm_rows
from rollout.config import RolloutSection
from rollout.engine import Completion, SamplingParams, check_request, generate_via_submit
from rollout.sampling import sample_tokens, uniform
from t1model.decode_attention import KEY_BLOCK
from t1model.hf_io import hf_parameter_views


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Sizes of the running batch and the KV cache."""

    max_batch: int = 16
    """Requests decoding at once."""
    num_slots: int = 32
    """KV-cache slots (>= max_batch); idle slots keep finished sequences around for prefix reuse."""
    max_seq_len: int = 4096
    """Tokens per slot (prompt + reply); a reply reaching it finishes with reason "length"."""
    max_prefill_tokens: int = 8192
    """Prompt tokens prefilled per step at most (a later request waits a step; one longer prompt still runs)."""
    prefix_reuse: bool = True
    """Reuse cached KV of a slot whose tokens prefix the new prompt (same weight version only)."""
    batch_invariant: bool = False
    """CPU only (no effect on other devices): every token's log-probs, routing and sample independent of what ran
    beside it (`t1kernels.rows`), so a seeded run is bit for bit whatever the batching; costs decode speed
    (bench/test_bench_rollout.py prints both)."""
    cpu_parallel_min_tokens: int = 1024
    """On CPU, an extend of fewer tokens runs on one intra-op thread. A decode step is a few hundred small ops,
    and waking the OpenMP team for each costs more than it saves (t1model.cpu_threads makes idle threads sleep;
    a batch-8 decode step took about twice as long on two threads as on one). Prefill chunks above about 1,000
    tokens gain from the full team."""

    @classmethod
    def for_rollout(cls, rollout: RolloutSection, *, max_seq_len: int) -> EngineConfig:
        """The engine of a run's [rollout] section (the trainer's, `rollout.collect`'s and `rollout.evaluate`'s):
        rollout.concurrency episodes at once, rollout.batch_invariant, slots of `max_seq_len` positions
        (`rollout.budget.engine_slot`)."""
        return cls.for_parallel(rollout.concurrency, max_seq_len=max_seq_len, batch_invariant=rollout.batch_invariant)

    @classmethod
    def for_parallel(cls, parallel: int, *, max_seq_len: int, batch_invariant: bool = False) -> EngineConfig:
        """The engine of `parallel` episodes at once (at least 1): that many decode together, over twice as many
        KV slots. An episode's slot waits idle while its sandbox runs a command, and its next turn's prompt starts
        with everything the slot holds; the spare slots keep finished and waiting episodes cached, so a turn
        prefills only its new tokens instead of evicting a neighbour's whole history."""
        parallel = max(parallel, 1)
        return cls(max_batch=parallel, num_slots=2 * parallel, max_seq_len=max_seq_len, batch_invariant=batch_invariant)

    def __post_init__(self) -> None:
        for name in ("max_batch", "num_slots", "max_seq_len", "max_prefill_tokens", "cpu_parallel_min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_slots < self.max_batch:
            raise ValueError(f"EngineConfig.num_slots must be >= max_batch={self.max_batch}, got {self.num_slots}")


@dataclass
class _Slot:
    tokens: list[int] = field(default_factory=list)  # ids whose KV the slot holds (== cache.lengths[slot])
    version: int = -1
    last_used: int = 0
    busy: bool = False
    routing: torch.Tensor | None = None  # host [max_seq_len, L_moe, K]: routing of tokens[:num_routed]
    num_routed: int = 0  # leading tokens whose routing is recorded (capture may have been off)


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: Future
    slot: int = -1
    feed: list[int] = field(default_factory=list)  # tokens to run in the next step
    prefilling: bool = True
    num_cached: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_routing: torch.Tensor | None = None
    finish_reason: str | None = None  # set once sampling is over; the flush feed follows
    submitted_s: float = 0.0


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by binary search over C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TorchEngine:
    """Continuous-batching engine over an `MoEModel` (see the module docstring). Use as a context manager
    or call `close()`; the engine thread starts on the first request."""

    def __init__(self, model: nn.Module, config: EngineConfig | None = None) -> None:
        self.model = model.eval()
        self.config = cfg = config or EngineConfig()
        positions = model.config.max_positions
        if cfg.max_seq_len > positions:
            raise ValueError(f"EngineConfig.max_seq_len={cfg.max_seq_len}: beyond the model's {positions} positions "
                             "(max_position_embeddings, or more under YaRN rope_scaling)")
        # The batch-invariant attention sums over whole key blocks: a cache of whole blocks lets it read them in place
        # (the positions past max_seq_len stay zeros, as the padded copy it would make has).
        invariant = cfg.batch_invariant and model.lm_head.weight.device.type == "cpu"
        cache_len = -(-cfg.max_seq_len // KEY_BLOCK) * KEY_BLOCK if invariant else cfg.max_seq_len
        self.cache = model.new_kv_cache(num_slots=cfg.num_slots, max_seq_len=cache_len)
        self._slots = [_Slot() for _ in range(cfg.num_slots)]
        self._queue: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._cv = threading.Condition()
        self._version = 0
        self._paused = False
        self._incomplete: str | None = None  # why the model's weights cannot be served (a failed update)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._head_cache: tuple[int, torch.Tensor] | None = None
        self._step = 0
        # The caller's intra-op thread count is the engine's maximum; None off CPU (no thread policy there).
        on_cpu = model.lm_head.weight.device.type == "cpu"
        self._cpu_threads: int | None = torch.get_num_threads() if on_cpu else None
        self._threads_set: int | None = None  # what the engine thread last set (only it calls _set_threads)
        self.stats = {"steps": 0, "prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0, "step_s": 0.0,
                      "model_s": 0.0, "capture_s": 0.0, "pause_s": 0.0}
        """Counters; step_s: wall time inside steps; model_s: the part in model.extend; capture_s: the part
        spent on routing capture (host copy, per-slot history, returned slices); pause_s: wall time admission was
        paused for weight updates (draining the replies in flight, then loading)."""

    # ---- public API ----
    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, prompt: list[int], params: SamplingParams) -> Future[Completion]:
        """Queue one request; thread-safe. ValueError for an empty or too long prompt."""
        check_request(prompt, params, vocab_size=self.model.lm_head.weight.shape[0])
        if len(prompt) >= self.config.max_seq_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the engine's max_seq_len is "
                             f"{self.config.max_seq_len} (a reply needs room for at least one token)")
        fut: Future[Completion] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            if self._incomplete is not None:
                raise RuntimeError(f"engine has no complete weights: {self._incomplete}")
            self._queue.append(_Request(prompt=list(prompt), params=params, future=fut,
                                        submitted_s=time.perf_counter()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="t1-engine", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return fut

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_via_submit(self, prompts, params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load new policy weights between steps; returns the new version (see `rollout.engine.Engine`).

        named_tensors: (HF Qwen3-MoE name, whole tensor) pairs as `t1model.hf_io.hf_state_dict` names them
        (per-expert `model.layers.N.mlp.experts.M.gate_proj.weight`, ...), consumed lazily one at a time and copied
        into place, so the caller may produce them one layer at a time. Every name the model has must arrive
        exactly once: a missing, unknown or repeated name or a wrong shape is a ValueError, after which the engine
        serves nothing (queued requests and new submits fail with RuntimeError) until an update succeeds, so no
        token comes from a half-updated model. Waits until the running batch has drained (queued requests wait and
        are served with the new weights), then invalidates every cached slot."""
        if isinstance(named_tensors, (nn.Module, dict, torch.Tensor)):
            raise TypeError(f"named_tensors: expected an iterable of (HF name, tensor) pairs, got "
                            f"{type(named_tensors).__name__} (e.g. pass t1model.hf_io.hf_state_dict(model).items())")
        with self._cv:
            self._paused = True  # pause: nothing new is admitted; replies in flight end under the weights they began
            paused_at = time.perf_counter()
            self._cv.wait_for(lambda: not self._running)
            try:
                self._incomplete = "a weight update is in progress"
                try:
                    self._load_named(named_tensors)
                except BaseException as e:
                    self._incomplete = f"the last weight update failed ({type(e).__name__}: {e})"
                    for req in self._queue:
                        req.future.set_exception(RuntimeError(f"engine has no complete weights: {self._incomplete}"))
                    self._queue.clear()
                    raise
                self._incomplete = None
                self._version += 1
                self.cache.reset()
                for slot in self._slots:
                    slot.tokens, slot.version, slot.num_routed = [], -1, 0
            finally:
                self._paused = False  # resume: queued requests are admitted under the new version
                self.stats["pause_s"] += time.perf_counter() - paused_at
                self._cv.notify_all()
        return self._version

    @torch.no_grad()
    def _load_named(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        targets = hf_parameter_views(self.model)
        seen: set[str] = set()
        for name, tensor in named_tensors:
            dest = targets.get(name)
            if dest is None:
                raise ValueError(f"update_weights: unknown tensor {name!r} (expected HF Qwen3-MoE names such as "
                                 f"{next(iter(targets))!r})")
            if name in seen:
                raise ValueError(f"update_weights: tensor {name!r} arrived twice")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"update_weights: tensor {name!r} expected shape {list(dest.shape)}, got "
                                 f"{list(tensor.shape)}")
            dest.copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ValueError(f"update_weights: {len(missing)} of {len(targets)} tensors missing, e.g. {missing[:3]}")

    def sleep(self) -> None:
        """Nothing to give back: the engine's copy lives in its own memory, sized once (`Engine.sleep`)."""

    def close(self) -> None:
        """Stop the engine thread; requests not finished get a RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        for req in list(self._queue) + self._running:
            if not req.future.done():
                req.future.set_exception(RuntimeError("engine closed before the request finished"))

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine thread ----
    def _loop(self) -> None:
        # This thread runs every extend and sample. CPU only: GPU kernels have their own reduction orders.
        cpu = self.model.lm_head.weight.device.type == "cpu"
        with batch_invariant_mode(self.config.batch_invariant and cpu):
            self._serve()

    def _serve(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closed or self._running or (self._queue and not self._paused))
                    if self._closed:
                        return
                    if not self._paused:
                        self._admit()
                    running = list(self._running)
                if running:
                    self._run_step(running)
        except BaseException as e:  # re-raised: futures (and update_weights) must not hang on a dead thread
            with self._cv:
                self._closed = True
                for req in list(self._queue) + self._running:
                    if not req.future.done():
                        req.future.set_exception(e)
                self._queue.clear()
                self._running.clear()
                self._cv.notify_all()
            raise

    def _admit(self) -> None:
        budget = self.config.max_prefill_tokens
        while self._queue and len(self._running) < self.config.max_batch:
            req = self._queue[0]
            slot, cached = self._pick_slot(req)
            if slot < 0 or (len(req.prompt) - cached > budget and budget < self.config.max_prefill_tokens):
                return
            self._queue.popleft()
            budget -= len(req.prompt) - cached
            self._step += 1
            s = self._slots[slot]
            s.busy, s.last_used, s.version = True, self._step, self._version
            s.tokens = req.prompt[:cached]
            s.num_routed = min(s.num_routed, cached)
            self.cache.lengths[slot] = cached  # truncation: KV past a slot's length is never read
            req.slot, req.num_cached, req.feed = slot, cached, req.prompt[cached:]
            self.stats["cached_tokens"] += cached
            self._running.append(req)

    def _pick_slot(self, req: _Request) -> tuple[int, int]:
        """(slot, reusable prefix length) for a new request; slot -1 when none is free.

        Each free slot with a usable shared prefix of n tokens would save n tokens of prefill now and discard
        its len(tokens) - n other cached tokens (an episode waiting on its sandbox would recompute those).
        Take the slot with the best net saving n - discarded when positive (the same episode's previous turn
        discards nothing); otherwise evict the least recently used free slot, reusing whatever it shares.
        """
        prompt = req.prompt
        best, best_len, best_net, lru, lru_used = -1, 0, 0, -1, None
        for i, s in enumerate(self._slots):
            if s.busy:
                continue
            if lru_used is None or s.last_used < lru_used:
                lru, lru_used = i, s.last_used
            usable = self._usable_prefix(s, req)
            net = usable - (len(s.tokens) - usable)
            if net > best_net:
                best, best_len, best_net = i, usable, net
        if best < 0 and lru >= 0:
            best, best_len = lru, self._usable_prefix(self._slots[lru], req)
        return best, min(best_len, len(prompt) - 1)  # one prompt token must run to give the first logits

    def _usable_prefix(self, slot: _Slot, req: _Request) -> int:
        if not (self.config.prefix_reuse and slot.version == self._version and slot.tokens):
            return 0
        n = _common_prefix_len(slot.tokens, req.prompt)
        # With routing requested, the cached part's routing must be servable from the slot's history.
        return min(n, slot.num_routed) if req.params.return_routing else n

    def _run_step(self, running: list[_Request]) -> None:
        t0 = time.perf_counter()
        prefill = [r for r in running if r.prefilling]
        decode = [r for r in running if not r.prefilling]
        # Prefills and one-token decodes run as separate extends: mixed chunk lengths would pad every decode
        # row of the attention to the longest prompt tail.
        for group in (prefill, decode):
            if group:
                self._set_threads(sum(len(r.feed) for r in group))
                hidden_TD, rows = self._extend(sorted(group, key=lambda r: r.slot))
                if rows:
                    self._sample(rows, hidden_TD)
        self.stats["steps"] += 1
        self.stats["step_s"] += time.perf_counter() - t0
        done = [r for r in running if r.finish_reason is not None and not r.feed]
        if done:
            with self._cv:
                for r in done:
                    self._finish(r)
                self._cv.notify_all()

    def _set_threads(self, num_tokens: int) -> None:
        """Intra-op threads of the engine thread for the next extend (CPU only). torch's count is per thread once
        a thread has made its first parallel call (or `torch.get_num_threads()`); a thread that has not takes the
        value some thread set last, which would be this one's, 1 or N by the size of its last step (measured with
        the 2.13 CPU wheel). The thread that builds the engine has made such calls by the end of `__init__`, so a
        trainer keeps its count whatever the engine sets here (a test checks it)."""
        if self._cpu_threads is not None:
            small = num_tokens < self.config.cpu_parallel_min_tokens
            want = 1 if small else self._cpu_threads
            if want != self._threads_set:  # setting it costs ~0.2 ms even unchanged (a decode step is a few ms)
                torch.set_num_threads(want)
                self._threads_set = want

    def _extend(self, group: list[_Request]) -> tuple[torch.Tensor, list[tuple[_Request, int]]]:
        """Run each request's pending feed; returns the hidden states and (request, row) of rows to sample."""
        device = self.model.lm_head.weight.device
        lens = [len(r.feed) for r in group]
        ids_T = torch.tensor([t for r in group for t in r.feed], dtype=torch.long, device=device)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        t0 = time.perf_counter()
        # Inference mode (no version counters, no view tracking: ~10% of a small decode step, the same kernels and
        # bits). Its outputs stay inside the engine: routing is copied into the slot's history, hidden states only
        # feed the sampler, and what a Completion carries is made outside it.
        with torch.inference_mode():
            hidden_TD, routing_TLK = self.model.extend(ids_T, cache=self.cache, slot_ids=[r.slot for r in group],
                                                       cu_seqlens=cu)
        self.stats["model_s"] += time.perf_counter() - t0  # on GPU: launch time only (no sync here)
        if any(r.params.return_routing for r in group):
            self._capture(group, cu, routing_TLK)
        rows = []
        for i, r in enumerate(group):
            self._slots[r.slot].tokens += r.feed
            if r.prefilling:
                self.stats["prefill_tokens"] += cu[i + 1] - cu[i]
                r.prefilling = False
            r.feed = []
            if r.finish_reason is None:
                rows.append((r, cu[i + 1] - 1))
        return hidden_TD, rows

    def _capture(self, group: list[_Request], cu: list[int], routing_TLK: torch.Tensor) -> None:
        """Append this extend's routing to each slot's history; hand prefilled requests their prompt routing.
        (Timed on its own: stats["capture_s"] is the whole cost of R3 capture in the engine.)"""
        t0 = time.perf_counter()
        routing_TLK = routing_TLK.cpu()  # sync: one host copy of the step's routing for all rows
        for i, r in enumerate(group):
            slot = self._slots[r.slot]
            start = len(slot.tokens)
            if slot.num_routed == start:
                self._record_routing(slot, start, routing_TLK[cu[i]:cu[i + 1]])
            if r.prefilling and r.params.return_routing:
                r.prompt_routing = slot.routing[r.params.prompt_routing_from:len(r.prompt)].clone()
        self.stats["capture_s"] += time.perf_counter() - t0

    def _record_routing(self, slot: _Slot, start: int, routing_NLK: torch.Tensor) -> None:
        end = start + routing_NLK.shape[0]
        if slot.routing is None:
            slot.routing = torch.empty((self.config.max_seq_len, *routing_NLK.shape[1:]), dtype=routing_NLK.dtype)
        slot.routing[start:end] = routing_NLK
        slot.num_routed = end

    def _sample(self, rows: list[tuple[_Request, int]], hidden_TD: torch.Tensor) -> None:
        weight_VD = self._head_fp32()
        device = weight_VD.device
        reqs = [r for r, _ in rows]
        hidden_BD = hidden_TD.index_select(0, torch.tensor([i for _, i in rows], device=device))
        logits_BV = mm_rows(hidden_BD.float(), weight_VD)  # hidden @ W^T, each row as if sampled alone (t1kernels.rows)
        temps = [r.params.temperature for r in reqs]
        top_ps = [r.params.top_p for r in reqs]
        uniforms = [uniform(r.params.seed, len(r.tokens)) for r in reqs]
        forced = [r.params.forced_token_ids[len(r.tokens)] if len(r.tokens) < len(r.params.forced_token_ids) else -1
                  for r in reqs]
        tokens_B, logp_B = sample_tokens(
            logits_BV, temperature_B=torch.tensor(temps, dtype=torch.float32, device=device),
            top_p_B=torch.tensor(top_ps, dtype=torch.float32, device=device),
            uniform_B=torch.tensor(uniforms, dtype=torch.float64, device=device),
            any_top_p=min(top_ps) < 1, any_greedy=min(temps) <= 0,
            forced_B=torch.tensor(forced, dtype=torch.int64, device=device) if max(forced) >= 0 else None)
        tokens, logps = tokens_B.tolist(), logp_B.tolist()  # sync: the host decides stops and the next feed
        self.stats["decode_tokens"] += len(tokens)
        max_len = self.config.max_seq_len
        for r, tok, lp in zip(reqs, tokens, logps):
            r.tokens.append(tok)
            r.logprobs.append(lp)
            r.feed = [tok]
            if tok in r.params.stop_token_ids:
                r.finish_reason = "stop"
            elif len(r.tokens) >= r.params.max_new_tokens or len(self._slots[r.slot].tokens) + 1 >= max_len:
                r.finish_reason = "length"

    def _head_fp32(self) -> torch.Tensor:
        """The LM head in fp32 (sampling log-probs are fp32, like t1kernels.logprob's accumulators); a half-precision
        head is converted once per weight version, not every step."""
        weight = self.model.lm_head.weight
        if weight.dtype == torch.float32:
            return weight
        if self._head_cache is None or self._head_cache[0] != self._version:
            self._head_cache = (self._version, weight.detach().float())
        return self._head_cache[1]

    def _finish(self, r: _Request) -> None:
        self._running.remove(r)
        slot = self._slots[r.slot]
        slot.busy = False
        self._step += 1
        slot.last_used = self._step
        n_prompt, n_new = len(r.prompt), len(r.tokens)
        routing = None
        if r.params.return_routing:
            t0 = time.perf_counter()
            if slot.num_routed < n_prompt + n_new:
                raise AssertionError(f"slot routing covers {slot.num_routed} tokens, expected {n_prompt + n_new}")
            routing = slot.routing[n_prompt:n_prompt + n_new].clone()
            self.stats["capture_s"] += time.perf_counter() - t0
        comp = Completion(token_ids=r.tokens, logprobs=torch.tensor(r.logprobs, dtype=torch.float32),
                          routing=routing, finish_reason=r.finish_reason, prompt_routing=r.prompt_routing,
                          prompt_routing_start=r.params.prompt_routing_from, policy_version=slot.version,
                          num_cached_tokens=r.num_cached, extra={"latency_s": time.perf_counter() - r.submitted_s})
        r.future.set_result(comp)
