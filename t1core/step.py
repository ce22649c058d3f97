"""The typed pieces of one RL step: where its random draws come from, what collection hands to the update, which
episodes push the actor, and the trainer's resumable state.

Every random choice of a run derives from (run.seed, a named stream, indices), so a resumed run draws exactly what
a straight one does and two phases never share draws by accident.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rollout.sampling import derive_seed
from rollout.trajectory import Trajectory
from t1core.config import ActorPush, AlgoSection


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


def shaped_reward(traj: Any, algo: AlgoSection) -> float:
    """The one reward the update sees: the trajectory's dense reward (verifiers passed, `Trajectory.reward`), plus
    the outcome bonus when all pass, minus the optional per-turn and malformed-reply penalties."""
    num_turns = len(traj.turns) + sum(len(s.turns) for s in traj.earlier)  # every context of a compacted episode
    return (traj.reward + algo.outcome_bonus * solved(traj) - algo.turn_penalty * num_turns
            - algo.format_penalty * traj.metrics.get("malformed_tool_calls", 0))


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


Baseline = Literal["group", "center", "whiten", "none"]


@dataclass(frozen=True)
class PushRule:
    """What one `algo.actor_push` choice means (see its help)."""

    baseline: Baseline
    """How advantages are normalised over the step (`t1core.update.normalise_advantages`)."""
    negative_scale: float
    """Multiplier of negative advantages after normalisation (1 = plain PPO)."""
    skip_flat_steps: bool
    """No actor update in a step whose episodes all got the same reward."""
    skip_flat_groups: bool
    """Advantage 0 for the episodes of a group (>= 2 episodes) that all got the same reward; no actor step when
    every group is flat."""


PUSH_RULES: dict[ActorPush, PushRule] = {
    "group_positive": PushRule("group", 0.0, skip_flat_steps=True, skip_flat_groups=True),
    "group": PushRule("group", 1.0, skip_flat_steps=True, skip_flat_groups=True),
    "center": PushRule("center", 1.0, skip_flat_steps=False, skip_flat_groups=False),
    "whiten": PushRule("whiten", 1.0, skip_flat_steps=False, skip_flat_groups=False),
    "raw": PushRule("none", 1.0, skip_flat_steps=False, skip_flat_groups=False),
}


@dataclass(frozen=True)
class PushPlan:
    """Which part of a step's batch may move the actor, and how its advantages are shaped."""

    update_actor: bool
    """False in the critic-only steps, in a flat step, and when every group is flat."""
    no_push: list[bool] | None
    """Per trajectory: advantage 0 (its group, >= 2 episodes, all scored alike); None when the rule is off."""
    metrics: dict[str, float]
    baseline: Baseline = "group"
    """The rule's advantage baseline."""
    negative_scale: float = 1.0
    """The rule's multiplier of negative advantages."""


def push_plan(rewards: Sequence[float], group_ids: Sequence[int], *, step: int, algo: AlgoSection,
              group_size: int, critic_steps: int) -> PushPlan:
    """The rules that decide what pushes the actor, in one place (`PUSH_RULES[algo.actor_push]`):
    - critic-only warm start: no actor update before step `critic_steps` (warmstart.critic_steps);
    - skip_flat_steps: a step whose episodes all got one reward holds nothing but the critic's error;
    - skip_flat_groups: the same per task instance (group of >= 2 episodes): its episodes get advantage 0,
      and a step where every group is flat takes no actor step. The critic trains on everything."""
    rule = PUSH_RULES[algo.actor_push]
    flat_step = rule.skip_flat_steps and max(rewards) == min(rewards)
    update_actor = step >= critic_steps and not flat_step
    metrics = {"train/flat_step": float(flat_step)}
    no_push = None
    if rule.skip_flat_groups and group_size >= 2:
        no_push = flat_groups(rewards, group_ids)
        metrics["train/flat_group_episode_frac"] = sum(no_push) / len(no_push)
        update_actor = update_actor and not all(no_push)
    return PushPlan(update_actor=update_actor, no_push=no_push, metrics=metrics, baseline=rule.baseline,
                    negative_scale=rule.negative_scale)


def rewards_by_group(rewards: Sequence[float], group_ids: Sequence[int]) -> dict[int, list[float]]:
    """Group id -> its episodes' rewards, in episode order."""
    by_group: dict[int, list[float]] = {}
    for g, r in zip(group_ids, rewards, strict=True):
        by_group.setdefault(g, []).append(r)
    return by_group


def flat_groups(rewards: Sequence[float], group_ids: Sequence[int]) -> list[bool]:
    """Per trajectory: whether its group (the episodes of one task instance) has >= 2 episodes that all got the
    same reward. Such a group says nothing about which of its actions were better; with the group as baseline
    its advantages are the critic's per-token error alone."""
    flat = {g: len(rs) >= 2 and max(rs) == min(rs) for g, rs in rewards_by_group(rewards, group_ids).items()}
    return [flat[g] for g in group_ids]


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
