"""Advantages, one concept in one file: the reward each episode gets (`shaped_reward`), where it lands on the tokens
(`place_terminal_rewards`), GAE over packed trajectories (`gae`), which episodes may push the actor (`PUSH_RULES`,
`push_plan`) and how a step's advantages are baselined and shaped before the update (`shape_advantages`).

Legend: T tokens (trajectories packed back to back), N trajectories. `mask_T` is bool and True exactly on sampled
tokens (the loss region); per-token fields are aligned as in `t1core.losses`. The plain float64 Python loops that
GAE is checked against live in tests/test_losses.py (`_gae_reference`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from t1core.batch import PackedBatch
from t1core.config import ActorPush, AlgoSection
from t1core.losses import _check_mask, _masked
from t1core.step import solved


def shaped_reward(traj: Any, algo: AlgoSection) -> float:
    """The one reward the update sees: the trajectory's dense reward (verifiers passed, `Trajectory.reward`), plus
    the outcome bonus when all pass, minus the optional per-turn and malformed-reply penalties."""
    num_turns = len(traj.turns) + sum(len(s.turns) for s in traj.earlier)  # every context of a compacted episode
    return (traj.reward + algo.outcome_bonus * solved(traj) - algo.turn_penalty * num_turns
            - algo.format_penalty * traj.metrics.get("malformed_tool_calls", 0))


def traj_index_from_cu_seqlens(cu_seqlens_N1: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N+1] boundaries of packed trajectories -> the trajectory index of every token, [T] int64."""
    pos_T = torch.arange(num_tokens, device=cu_seqlens_N1.device)
    return torch.searchsorted(cu_seqlens_N1[1:].to(torch.int64), pos_T, right=True)


def _check_cu_seqlens(cu_seqlens_N1: torch.Tensor, num_tokens: int) -> None:
    bounds = cu_seqlens_N1.tolist()  # sync: N+1 ints, once per batch
    if cu_seqlens_N1.dim() != 1 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_N1: expected 1-D [0, ..., {num_tokens}], got {bounds}")
    if any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens_N1: expected non-decreasing boundaries, got {bounds}")


def place_terminal_rewards(rewards_N: torch.Tensor, mask_T: torch.Tensor,
                           cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """[N] per-trajectory rewards -> [T] rewards on each trajectory's last sampled token (0 elsewhere).

    A non-zero reward for a trajectory without any sampled token has nowhere to go: ValueError.
    """
    _check_mask(mask_T)
    T = mask_T.numel()
    _check_cu_seqlens(cu_seqlens_N1, T)
    if rewards_N.shape != (cu_seqlens_N1.numel() - 1,):
        raise ValueError(f"rewards_N: expected shape ({cu_seqlens_N1.numel() - 1},), got {tuple(rewards_N.shape)}")
    traj_T = traj_index_from_cu_seqlens(cu_seqlens_N1, T)
    pos_T = torch.arange(T, device=mask_T.device)
    last_N = torch.full_like(rewards_N, -1, dtype=torch.int64).scatter_reduce(
        0, traj_T, torch.where(mask_T, pos_T, -1), reduce="amax")
    if bool(((last_N < 0) & (rewards_N != 0)).any()):  # sync: input check
        raise ValueError("rewards_N: a trajectory with no sampled token has a non-zero reward")
    has_last_N = last_N >= 0
    return torch.zeros(T, dtype=rewards_N.dtype, device=rewards_N.device).index_add_(
        0, last_N.clamp(min=0), torch.where(has_last_N, rewards_N, 0))


def gae(rewards_T: torch.Tensor, values_T: torch.Tensor, mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor,
        *, gamma: float, lam: float, bootstrap_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over packed trajectories -> (advantages_T, returns_T), both 0 off the mask.

    The decision steps of a trajectory are its sampled tokens only, in order: observation and glue tokens
    are skipped, not treated as steps with zero reward, so a tool response between two turns costs no
    discount. For sampled tokens s_1..s_n of one trajectory:
        delta_i = r(s_i) + gamma * V(s_{i+1}) - V(s_i)   (V(s_{n+1}) = 0: the episode ends, no bootstrap)
        A_i = delta_i + gamma * lam * A_{i+1},   returns_i = A_i + V(s_i).
    `bootstrap_N` (bool [N], algo.cut_episodes='bootstrap'): trajectory n was cut before its end, so its last
    sampled token bootstraps from the critic's value at the cut, V(s_{n+1}) := V(s_n), instead of ending at 0.
    Rewards must sit on sampled tokens (e.g. via `place_terminal_rewards`); one elsewhere is a ValueError.
    Computed in float64 with a log-depth scan (no Python loop over tokens); results in values_T's dtype.
    """
    if rewards_T.dim() != 1:
        raise ValueError(f"rewards_T: expected a 1-D packed tensor, got shape {tuple(rewards_T.shape)}")
    _check_mask(mask_T, rewards_T=rewards_T, values_T=values_T)
    T = mask_T.numel()
    _check_cu_seqlens(cu_seqlens_N1, T)
    if bool(((rewards_T != 0) & ~mask_T).any()):  # sync: input check
        raise ValueError("rewards_T: non-zero reward on a token outside the mask (not a sampled token)")
    if T == 0:
        return values_T.new_zeros(0), values_T.new_zeros(0)
    r_T = _masked(rewards_T.to(torch.float64), mask_T)
    v_T = _masked(values_T.detach().to(torch.float64), mask_T)
    traj_T = traj_index_from_cu_seqlens(cu_seqlens_N1, T)
    pos_T = torch.arange(T, device=mask_T.device)

    # Position of the next sampled token strictly after t (T if none), and whether it is in t's trajectory.
    first_from_T = torch.where(mask_T, pos_T, T).flip(0).cummin(0).values.flip(0)
    next_T = torch.cat([first_from_T[1:], first_from_T.new_full((1,), T)])
    next_safe_T = next_T.clamp(max=T - 1)
    has_next_T = (next_T < T) & (traj_T[next_safe_T] == traj_T)
    end_value_T = torch.zeros_like(v_T)
    if bootstrap_N is not None:  # the value at the cut stands for the return the episode did not get to
        end_value_T = torch.where(bootstrap_N.to(mask_T.device)[traj_T], v_T, 0.0)
    delta_T = _masked(r_T + gamma * torch.where(has_next_T, v_T[next_safe_T], end_value_T) - v_T, mask_T)

    # A_t = delta_t + c_t * A_{t+1}: c = gamma*lam on sampled tokens, 1 on skipped ones (A passes through
    # to the next sampled token), 0 at each trajectory's last token (episodes do not leak into each other).
    same_traj_next_T = torch.cat([traj_T[1:] == traj_T[:-1], mask_T.new_zeros(1)])
    coef_T = torch.full((T,), gamma * lam, dtype=torch.float64, device=mask_T.device).where(mask_T, 1.0)
    coef_T = coef_T * same_traj_next_T
    adv_T = _reverse_linear_scan(coef_T, delta_T)
    adv_T = _masked(adv_T, mask_T)
    return adv_T.to(values_T.dtype), _masked(adv_T + v_T, mask_T).to(values_T.dtype)


def _reverse_linear_scan(a_T: torch.Tensor, b_T: torch.Tensor) -> torch.Tensor:
    """x_t = b_t + a_t * x_{t+1} (x_T = 0) by recursive doubling: after a round of span s,
    x_t = b_t + a_t * x_{t+s}; substituting x_{t+s} doubles the span. ceil(log2 T) rounds."""
    span = 1
    while span < a_T.numel():
        b_T = b_T + a_T * torch.cat([b_T[span:], b_T.new_zeros(span)])
        a_T = a_T * torch.cat([a_T[span:], a_T.new_zeros(span)])
        span *= 2
    return b_T


Baseline = Literal["group", "center", "whiten", "none"]


@dataclass(frozen=True)
class PushRule:
    """What one `algo.actor_push` choice means (see its help)."""

    baseline: Baseline
    """How advantages are normalised over the step (`normalise_advantages`)."""
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


class HasAdvantages(Protocol):
    """What the baselines need of a scored minibatch (`t1core.update.Scored`): its packed batch, its advantages
    (replaced, not modified in place) and the step index of each trajectory packed in it."""

    batch: PackedBatch
    advantages_T: torch.Tensor
    traj_ids: list[int]


def normalise_advantages(scored: Sequence[HasAdvantages], mode: Baseline,
                         group_ids: Sequence[int] | None = None) -> None:
    """'center': subtract the step's token-mean advantage; 'group': subtract the token mean of the episodes of the
    same task instance; 'whiten': center, then divide by the std; 'none': as is.

    Why centring and not whitening: dense rewards are verifier counts, and in most steps of a hard task set every
    episode scores alike. The advantages of such a step are only the critic's residual noise; dividing by
    their (small) std would blow that noise up to the size of a real learning signal, and the actor would
    take a full step in a random direction. Left in reward units, those steps stay small next to steps that
    hold a success, and Adam's running second moment scales the actor's step across steps instead.

    Why 'group': episodes of one instance share most tokens (the same command with one word wrong). With the
    instance's own mean as baseline, the shared tokens get +a in one episode and -a in the other, and only the
    tokens that differ carry a net push; instance difficulty (which the critic explains little of) drops out."""
    if not scored:
        return
    # Baselines are taken over the loss tokens only, and every other token ends at advantage 0.
    masks = [s.batch.loss_mask_T for s in scored]
    if mode == "group":
        if group_ids is None:
            raise ValueError("baseline 'group' needs the group id (task instance) of every trajectory")
        # Token sums and counts per group, over all minibatches; then each token minus its group's mean.
        gid_T = [torch.as_tensor([group_ids[i] for i in s.traj_ids], dtype=torch.long)[s.batch.traj_index_T]
                 for s in scored]
        num_groups = max(group_ids) + 1
        sums = torch.zeros(num_groups, dtype=torch.float64)
        counts = torch.zeros(num_groups, dtype=torch.float64)
        for s, g_T, m_T in zip(scored, gid_T, masks):
            sums.index_add_(0, g_T[m_T], s.advantages_T[m_T].double())
            counts.index_add_(0, g_T[m_T], torch.ones(int(m_T.sum()), dtype=torch.float64))
        mean_G = (sums / counts.clamp(min=1)).to(scored[0].advantages_T.dtype)
        for s, g_T in zip(scored, gid_T):
            s.advantages_T = s.advantages_T - mean_G[g_T]
    elif mode in ("center", "whiten"):
        adv = torch.cat([s.advantages_T[m] for s, m in zip(scored, masks)])
        if adv.numel() >= 2:
            mean = adv.mean()
            scale = adv.std().clamp(min=1e-6) if mode == "whiten" else torch.ones((), dtype=adv.dtype)
            for s in scored:
                s.advantages_T = (s.advantages_T - mean) / scale
    for s, m_T in zip(scored, masks):
        s.advantages_T = torch.where(m_T, s.advantages_T, 0.0)


def shape_advantages(scored: Sequence[HasAdvantages], plan: PushPlan, group_ids: Sequence[int] | None) -> None:
    """A step's advantages as the update uses them: baselined over the whole step (`plan.baseline`,
    `normalise_advantages`), 0 for the episodes of flat groups (`plan.no_push`), then negative ones scaled by
    `plan.negative_scale`."""
    normalise_advantages(scored, plan.baseline, group_ids)
    no_push = plan.no_push
    if no_push is not None and any(no_push):
        for s in scored:
            keep_B = torch.tensor([not no_push[i] for i in s.traj_ids])
            s.advantages_T = torch.where(keep_B[s.batch.traj_index_T], s.advantages_T, 0.0)
    if plan.negative_scale != 1.0:
        for s in scored:
            s.advantages_T = torch.where(s.advantages_T < 0, s.advantages_T * plan.negative_scale, s.advantages_T)
