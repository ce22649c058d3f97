"""Token drift in the loss region, checked against what the engine actually returned.

`CompletionLog` wraps the rollout engine and keeps the token ids of every completion, keyed by the prompt
that produced it. After a step the trainer asks, for each trajectory turn, whether the ids in
the loss region are exactly what the engine sampled for that turn's prompt. This is independent of the
agent loop's bookkeeping: a bug that altered, re-tokenized or shifted a sampled token shows up as drift.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from rollout.engine import Completion, Engine, SamplingParams, generate_via_submit
from rollout.trajectory import Trajectory


class CompletionLog:
    """An `Engine` that forwards every call to `engine` and records every completion's token ids by prompt."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self.sampled: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def submit(self, prompt: list[int], params: SamplingParams) -> Future[Completion]:
        key, outer = tuple(prompt), Future()

        def record(done: Future[Completion]) -> None:
            # The caller's future resolves only after the record is written: nobody reads a partial record.
            exc = done.exception()
            if exc is not None:
                outer.set_exception(exc)
                return
            comp = done.result()
            with self._lock:
                self.sampled[key].append(list(comp.token_ids))
            outer.set_result(comp)

        self.engine.submit(prompt, params).add_done_callback(record)
        return outer

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_via_submit(self, prompts, params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.engine.update_weights(named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def close(self) -> None:
        self.engine.close()

    def drift(self, traj: Trajectory) -> int:
        """Loss-region tokens of `traj` that differ from the engine's completion for the same prompt
        (a turn whose prompt the engine never saw counts all its tokens)."""
        ids = traj.token_ids.tolist()
        total = 0
        with self._lock:
            for turn in traj.turns:
                got = ids[turn.start:turn.end]
                candidates = self.sampled.get(tuple(ids[:turn.start]), [])
                total += min((sum(a != b for a, b in zip(got, c)) + abs(len(got) - len(c)) for c in candidates),
                             default=len(got))
        return total

    def forget(self, traj: Trajectory) -> None:
        """Drop the records `traj`'s turns were checked against (one per turn), keeping every other episode's: the
        asynchronous loop checks each episode as it ends, while others still sample (t1core.async_collect)."""
        ids = traj.token_ids.tolist()
        with self._lock:
            for turn in traj.turns:
                key = tuple(ids[:turn.start])
                records = self.sampled.get(key, [])
                if ids[turn.start:turn.end] in records:
                    records.remove(ids[turn.start:turn.end])
                if not records:
                    self.sampled.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self.sampled.clear()
