"""The typed pieces of one RL step: where its random draws come from, what collection hands to the update, whether
an episode is solved, and the trainer's resumable state (which episodes push the actor: t1core.advantages).

Every random choice of a run derives from (run.seed, a named stream, indices), so a resumed run draws exactly what
a straight one does and two phases never share draws by accident.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.sampling import derive_seed
from rollout.trajectory import Trajectory


class Stream(enum.IntEnum):
    """Named seed streams: `seed_for(run_seed, Stream.X, *indices)`. The values are part of a run's bits (changing
    one changes every draw of that stream), so they stay as they were when they were numbers in the code."""

    UPDATE = 0
    """Per RL step: which instances it practises, and the PPO minibatch order."""
    ROLLOUT = 1
    """Per RL step (index 1 after the step): the sampling seeds of its episodes."""
    SFT = 1 << 20
    """The SFT data order."""
    HELDOUT = 1 << 21
    """Held-out evaluation: the same sampling seeds before and after RL."""


class SeedBlock(enum.IntEnum):
    """Seed blocks of the built-in task splits (block b draws task seeds b*100000, b*100000+1, ...). They are fixed,
    not drawn from run.seed: every seed of an experiment trains and is evaluated on the same instances, so seeds
    compare like with like. TRAIN, RL and PRETRAIN are blocks of the train split and must differ (one block would
    give the RL the SFT instances again, or put RL instructions into the pretraining corpus)."""

    TRAIN = 0
    """The SFT instances."""
    RL = 1
    """The RL instances (unseen by the warm start)."""
    PRETRAIN = 2
    """The base pretraining corpus."""
    HELDOUT = 100_000
    """The held-out instances (held-out split)."""


def seed_for(run_seed: int, stream: Stream, *indices: int) -> int:
    """The seed of one draw. UPDATE and ROLLOUT take the step as their index, as the loop always did:
    UPDATE = derive_seed(run_seed, step), ROLLOUT = derive_seed(run_seed, step, 1)."""
    if stream is Stream.UPDATE:
        (step,) = indices
        return derive_seed(run_seed, step)
    if stream is Stream.ROLLOUT:
        (step,) = indices
        return derive_seed(run_seed, step, 1)
    return derive_seed(run_seed, int(stream), *indices)


def step_draws(run_seed: int, step: int, *, num_tasks: int, num_groups: int) -> tuple[list[int], torch.Generator]:
    """The task instances RL step `step` practises (`num_groups` of `num_tasks`, with replacement), and the generator
    that then orders its PPO minibatches (it continues from these draws)."""
    gen = torch.Generator().manual_seed(seed_for(run_seed, Stream.UPDATE, step))
    return torch.randint(num_tasks, (num_groups,), generator=gen).tolist(), gen


def solved(traj: Any) -> bool:
    """Every verifier passed (the verifier's own `outcome`); an episode never verified is not solved."""
    return bool(traj.verifier and traj.verifier["outcome"])


@dataclass
class StepBatch:
    """What one step's collection hands to the update: the trajectories with sampled tokens, their rewards and the
    task instance (group) each came from, and the step's rollout metrics."""

    trajs: list[Trajectory]
    rewards: list[float]
    group_ids: list[int]
    metrics: dict[str, float]
    version: int | None = None
    """Asynchronous steps: the weight version being updated (the engine's), against which `score` reports the
    log-prob gap per version lag; None in the synchronous loop."""

    def __post_init__(self) -> None:
        if not len(self.trajs) == len(self.rewards) == len(self.group_ids):
            raise ValueError(f"StepBatch: {len(self.trajs)} trajectories, {len(self.rewards)} rewards and "
                             f"{len(self.group_ids)} group ids")


@dataclass
class TrainerState:
    """What a checkpoint keeps of the loop besides weights, optimizers and RNGs."""

    step: int = 0
    """RL steps done."""
    warm_started: bool = False
    """Pretraining, SFT and the evaluation before RL are done."""
    evaluated_at: int | None = None
    """The step count at which the held-out evaluation after RL ran (a resumed run does not repeat it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of older checkpoints this version does not use, kept as they were."""

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        return {**self.extra, **out}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TrainerState:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in state.items() if k in names},
                   extra={k: v for k, v in state.items() if k not in names})
