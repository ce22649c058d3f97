"""The step objects `t1core.update.score` and `ppo_update` take, built by hand for tests that call them directly:
shared by tests/test_update.py, tests/test_distributed.py, tests/test_bitwise.py and bench/test_bench_bitwise.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from t1core.advantages import Baseline, PushPlan
from t1core.step import StepBatch
from t1core.update import ActorCritic


def step_batch(trajs: Sequence, rewards: Sequence[float], group_ids: Sequence[int] | None = None) -> StepBatch:
    """A StepBatch of `trajs` (every trajectory its own group unless `group_ids` says otherwise)."""
    groups = list(group_ids) if group_ids is not None else list(range(len(trajs)))
    return StepBatch(list(trajs), list(rewards), groups, {})


def plan(*, baseline: Baseline = "center", negative_scale: float = 1.0, no_push: list[bool] | None = None,
         update_actor: bool = True) -> PushPlan:
    return PushPlan(update_actor=update_actor, no_push=no_push, metrics={}, baseline=baseline,
                    negative_scale=negative_scale)


def actor_critic(policy: torch.nn.Module, critic: torch.nn.Module,
                 ref_policy: torch.nn.Module | None = None) -> ActorCritic:
    """The two models with plain AdamW optimizers (no schedulers)."""
    return ActorCritic(policy=policy, critic=critic,
                       opt_actor=torch.optim.AdamW(policy.parameters(), lr=1e-4, foreach=False),
                       opt_critic=torch.optim.AdamW(critic.parameters(), lr=1e-3, foreach=False),
                       sched_actor=None, sched_critic=None, ref_policy=ref_policy)
