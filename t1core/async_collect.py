"""Asynchronous collection with a staleness bound (`rollout.max_staleness` = N >= 1): episodes keep running on the
engine while the trainer updates, so neither a slow episode nor the update leaves the engine idle.

Legend: G groups per step (rollout.episodes_per_step / group_size), k episodes per group (one task instance).

Units are groups. Group j of production step b is the j-th instance the synchronous loop would draw for step b, with
the same episode seeds (so the first step's episodes are the synchronous run's). A scheduler thread starts groups in
that order on a pool of rollout.concurrency episode threads, as long as fewer than (N + 1) * G groups are started and
not yet retired (trained, or dropped); a group holds its slot from its start until the update that trains it is done.
This is the buffer rule of the tinker cookbook's AsyncConfig (`sampling_steps_ahead`) and AReaL's
`max_head_offpolicyness` bound (https://inclusionai.github.io/AReaL/algorithms/async.html): while step s trains, the
groups of the next N steps sample.

A step takes the first G groups to finish, in the order they finished (a short episode does not wait for a long one
of its production step). The staleness of an episode is the number of weight versions between the policy being
updated and the weights that sampled its oldest trained token (`Turn.policy_version`). The buffer rule alone does not
bound it: a long episode can finish after later groups and wait. At take time, a group whose oldest token is more than
N versions old is dropped ('drop', counted; its slot goes to a new group), or ('continue', a partial rollout) each of
its episodes keeps only the replies of fresh enough weights as trained turns: the older replies stay in the sequence as
context with loss mask 0, as observations do, and the turns the episode went on with under newer weights train.
Episodes never pause for a weight update: the engine drains only the replies in flight, swaps weights, and serves
every later reply with the new version (`rollout.torch_engine.TorchEngine.update_weights`; a disaggregated
`rollout.vllm_engine.VLLMEngine` the same way, through vLLM's pause_generation / resume_generation).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from rollout.agent import EpisodeSpec, run_episodes
from rollout.sampling import derive_seed
from rollout.trajectory import Trajectory
from t1core.config import RunConfig
from t1core.drift import CompletionLog
from t1core.rollout_ranks import RolloutRanks, agent_config
from t1core.step import Stream, seed_for, step_draws
from t1core.tasks import TaskSets
from t1model.tokenizer import ChatTokenizer

StalePolicy = Literal["drop", "continue"]


def oldest_version(traj: Trajectory) -> int | None:
    """The weight version that sampled the oldest trained token of the episode (every segment); None without one."""
    versions = [t.policy_version for s in traj.segments() for t in s.turns]
    return min(versions, default=None)


def fresh_part(traj: Trajectory, min_version: int) -> Trajectory:
    """The episode with the replies of weights older than `min_version` turned into context: off the loss mask, their
    log-probs 0 (the ids, routing and every other field as they are); each segment alike. `traj` itself if none is."""
    turns = [t for t in traj.turns if t.policy_version >= min_version]
    earlier = [fresh_part(s, min_version) for s in traj.earlier]
    if len(turns) == len(traj.turns) and all(a is b for a, b in zip(earlier, traj.earlier)):
        return traj
    mask_T = torch.zeros(traj.num_tokens, dtype=torch.bool)
    for t in turns:
        mask_T[t.start:t.end] = True
    return dataclasses.replace(traj, loss_mask=mask_T, rollout_logprobs=torch.where(mask_T, traj.rollout_logprobs, 0.0),
                               turns=turns, earlier=earlier)


@dataclass
class Episode:
    """One finished episode as a step takes it."""

    sampled: Trajectory
    """What the agent loop returned (saved, and what the reward is computed from)."""
    trained: Trajectory
    """What the update sees: `sampled`, or its fresh part under 'continue'."""
    drift: int
    """Loss-region tokens that differ from what the engine returned (checked as the episode ended)."""
    group: int
    """Position of its group in the step (the group id of the update's baseline)."""


@dataclass
class _Group:
    step: int
    episodes: list[tuple[Trajectory, int] | None]
    remaining: int


@dataclass
class Taken:
    """A step's episodes and what taking them measured."""

    episodes: list[Episode]
    metrics: dict[str, float] = field(default_factory=dict)


class AsyncCollector:
    """The producer side of the asynchronous loop (module docstring). `plan(step)` gives that step's G groups of k
    episode specs; `run_one(spec)` runs one episode to its end and returns (trajectory, drift) (called from the
    episode threads); `version()` is the engine's current weight version. Call `take` once per step, then `retire`
    after the update and weight sync of that step; `close` at the end."""

    def __init__(self, *, plan: Callable[[int], list[list[EpisodeSpec]]],
                 run_one: Callable[[EpisodeSpec], tuple[Trajectory, int]], version: Callable[[], int],
                 groups_per_step: int, max_staleness: int, stale: StalePolicy, concurrency: int, first_step: int,
                 last_step: int) -> None:
        if max_staleness < 1:
            raise ValueError(f"AsyncCollector: max_staleness must be >= 1 (0 is the synchronous loop), got "
                             f"{max_staleness}")
        self.plan, self.run_one, self.version = plan, run_one, version
        self.G, self.N, self.stale = groups_per_step, max_staleness, stale
        self.needed = (last_step - first_step) * groups_per_step  # groups the run trains from here on
        self._next_step, self._planned = first_step, []
        self._cv = threading.Condition()
        self._ready: list[_Group] = []  # finished groups, in the order they finished
        self._started = self._retired = self._dropped = self._in_step = 0
        self._error: BaseException | None = None
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="t1-async-episode")
        self._thread = threading.Thread(target=self._schedule, name="t1-async-scheduler", daemon=True)
        self._thread.start()

    # ---- producer ----
    def _may_start(self) -> bool:
        in_buffer = self._started - self._retired
        return in_buffer < (self.N + 1) * self.G and self._started - self._dropped < self.needed

    def _schedule(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._may_start())
                if self._closed:
                    return
                self._started += 1
            if not self._planned:
                self._planned = [(self._next_step, g) for g in self.plan(self._next_step)]
                self._next_step += 1
            step, specs = self._planned.pop(0)
            group = _Group(step=step, episodes=[None] * len(specs), remaining=len(specs))
            for i, spec in enumerate(specs):
                self._pool.submit(self._run, group, i, spec)

    def _run(self, group: _Group, i: int, spec: EpisodeSpec) -> None:
        try:
            result = self.run_one(spec)
        except BaseException as e:  # handed to the trainer's next `take`, which raises it
            with self._cv:
                self._error = self._error or e
                self._cv.notify_all()
            raise
        with self._cv:
            group.episodes[i] = result
            group.remaining -= 1
            if group.remaining == 0:
                self._ready.append(group)
                self._cv.notify_all()

    # ---- consumer ----
    def take(self) -> Taken:
        """The next step's G groups (module docstring): waits until enough fresh groups have finished, dropping or
        trimming the stale ones on the way. Metrics: async/staleness_mean and _max (over the trained episodes),
        async/dropped_episodes, async/continued_episodes, async/trainer_wait_s."""
        version, t0 = self.version(), time.perf_counter()
        taken: list[list[Episode]] = []
        dropped = continued = 0
        while len(taken) < self.G:
            with self._cv:
                self._cv.wait_for(lambda: self._ready or self._error is not None)
                if self._error is not None:
                    raise RuntimeError("an asynchronous episode failed") from self._error
                group = self._ready.pop(0)
            episodes, num_continued = self._admit(group, version, position=len(taken))
            if episodes is None:
                dropped += len(group.episodes)
                with self._cv:  # its slot goes to a new group now
                    self._dropped += 1
                    self._retired += 1
                    self._cv.notify_all()
            else:
                taken.append(episodes)
                continued += num_continued
        self._in_step = len(taken)
        eps = [e for group in taken for e in group]
        lags = [version - v for v in (oldest_version(e.trained) for e in eps) if v is not None]
        metrics = {"async/dropped_episodes": float(dropped), "async/continued_episodes": float(continued),
                   "async/trainer_wait_s": time.perf_counter() - t0, "async/policy_version": float(version)}
        if lags:
            metrics.update({"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))})
        return Taken(eps, metrics)

    def _admit(self, group: _Group, version: int, *, position: int) -> tuple[list[Episode] | None, int]:
        """The group's episodes as this step trains them, and how many were trimmed; None: dropped."""
        floor = version - self.N
        olds = [v for v in (oldest_version(t) for t, _ in group.episodes) if v is not None]
        if not olds or min(olds) >= floor:
            return [Episode(t, t, d, position) for t, d in group.episodes], 0
        if self.stale == "drop":
            return None, 0
        trimmed = [(t, fresh_part(t, floor), d) for t, d in group.episodes]
        if not any(bool(s.loss_mask.any()) for _, f, _ in trimmed for s in f.segments()):
            return None, 0  # nothing fresh enough to train
        return [Episode(t, f, d, position) for t, f, d in trimmed], sum(f is not t for t, f, _ in trimmed)

    def retire(self) -> None:
        """The groups of the last `take` are trained and the engine has the new weights: their slots free up."""
        with self._cv:
            self._retired += self._in_step
            self._in_step = 0
            self._cv.notify_all()

    def close(self) -> None:
        """Start nothing more; episodes not started are cancelled, running ones end on their own limits."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)


def for_run(cfg: RunConfig, tasks: TaskSets, log: CompletionLog, tok: ChatTokenizer, *,
            first_step: int, ranks: RolloutRanks) -> AsyncCollector:
    """The collector of a run (rollout.max_staleness >= 1) from `first_step` to its last step: the synchronous loop's
    instances and sampling seeds, each episode run on `log`'s engine and its drift checked against what it returned.
    Under torchrun only one engine serves every rank (`ranks.single_engine`, rank 0's), with the episode threads of
    all ranks (as the synchronous loop runs them there); the trainer broadcasts what each step takes."""
    r, agent = cfg.rollout, agent_config(cfg)
    num_groups = r.episodes_per_step // r.group_size

    def groups_of(step: int) -> list[list[EpisodeSpec]]:
        instances, _ = step_draws(cfg.run.seed, step, num_tasks=len(tasks.rl), num_groups=num_groups)
        seed = seed_for(cfg.run.seed, Stream.ROLLOUT, step)
        return [[EpisodeSpec(task=tasks.rl[i], image=tasks.images[tasks.rl[i].name],
                             seed=derive_seed(seed, j * r.group_size + e)) for e in range(r.group_size)]
                for j, i in enumerate(instances)]

    def run_one(spec: EpisodeSpec) -> tuple[Trajectory, int]:
        (traj,) = run_episodes(log, tok, [spec], config=agent, num_parallel=1, pool_size=1)
        drift = sum(log.drift(s) for s in traj.segments())
        for s in traj.segments():
            log.forget(s)  # the other episodes still running keep their records
        return traj, drift

    return AsyncCollector(plan=groups_of, run_one=run_one, version=lambda: log.policy_version,
                          groups_per_step=num_groups, max_staleness=r.max_staleness, stale=r.stale_episodes,
                          concurrency=ranks.parallel(r.concurrency), first_step=first_step, last_step=cfg.run.steps)
