"""From collected episodes to what the update trains on (`step_batch`): compacted episodes as segments, cut episodes
as algo.cut_episodes says, masked episodes left out.

An episode whose history was compacted (`rollout.compaction`) is several contexts, each a trajectory with its own
exact tokens and routing (`Trajectory.segments`). Each segment trains as a trajectory of its own with the episode's
reward on its last sampled token (and its group), so the return every segment learns from is the episode's.

An episode cut by the turn limit, the token budget or the wall clock has no outcome yet. algo.cut_episodes:
'bootstrap' trains it with no reward and its return bootstrapped from the critic's value at the cut (`advantages.gae`),
'terminal' as if it had finished where it stopped (the verifiers scored it there), 'mask' leaves it out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollout.agent import is_masked
from rollout.trajectory import Trajectory
from t1core.metrics import rollout_metrics
from t1core.step import StepBatch

CUT_REASONS = ("max_turns", "token_budget", "wall_clock")
"""Finish reasons of an episode that was stopped, not finished."""
_COMPACTED = "compacted; episode: "


def episode_reason(traj: Any) -> str:
    """Why the episode ended (an earlier segment's finish reason names the episode's after its own)."""
    reason = traj.finish_reason
    return reason[len(_COMPACTED):] if reason.startswith(_COMPACTED) else reason


def is_cut(traj: Any) -> bool:
    return episode_reason(traj).split(";")[0] in CUT_REASONS


def cut_metrics(episodes: Sequence[Any]) -> dict[str, float]:
    """Fraction of episodes cut, per reason, segments per episode and compactions in all."""
    n = max(len(episodes), 1)
    reasons = Counter(episode_reason(t).split(";")[0] for t in episodes)
    out = {f"rollout/cut_frac_{r}": reasons[r] / n for r in CUT_REASONS}
    out["rollout/cut_frac"] = sum(reasons[r] for r in CUT_REASONS) / n
    out["rollout/segments_mean"] = sum(len(t.segments()) for t in episodes) / n
    out["rollout/compactions"] = float(sum(len(t.segments()) - 1 for t in episodes))
    return out


def training_segments(episodes: Sequence[Any], rewards: Sequence[float], group_ids: Sequence[int], *,
                      cut_episodes: str) -> tuple[list[Any], list[float], list[int]]:
    """(segments, reward of each, group of each): every segment with sampled tokens of every episode the update
    keeps, in episode order; a cut episode's reward is 0 under 'bootstrap' (its return comes from the critic)."""
    segs, seg_rewards, seg_groups = [], [], []
    for traj, reward, group in zip(episodes, rewards, group_ids, strict=True):
        cut = is_cut(traj)
        if cut and cut_episodes == "mask":
            continue
        for seg in traj.segments():
            if bool(seg.loss_mask.any()):
                segs.append(seg)
                seg_rewards.append(0.0 if cut and cut_episodes == "bootstrap" else reward)
                seg_groups.append(group)
    return segs, seg_rewards, seg_groups


def bootstrap_flags(trajectories: Sequence[Any], cut_episodes: str) -> list[bool] | None:
    """Per trajectory: whether its return bootstraps from the critic at its end (None when none does)."""
    if cut_episodes != "bootstrap":
        return None
    flags = [is_cut(t) for t in trajectories]
    return flags if any(flags) else None


def step_batch(sampled: list[Trajectory], rewards: list[float], drift: list[int], groups: list[int], *,
               cut_episodes: str, trained: list[Trajectory] | None = None, metrics: dict[str, float] | None = None,
               version: int | None = None) -> StepBatch:
    """A step's episodes as the update takes them: rewarded as whole episodes (`rewards`, of `sampled`: a trimmed one
    keeps its outcome), and the `trained` part of those with sampled tokens (default: all of `sampled`) cut into
    training segments; `drift` and `groups` per episode, `metrics` added to the step's rollout metrics."""
    trained = sampled if trained is None else trained
    metrics = {**rollout_metrics(sampled, rewards), **cut_metrics(sampled), **(metrics or {})}
    # An episode the infrastructure ended on every try is masked: never trained, never a group's 0.
    kept = [i for i, t in enumerate(trained)
            if not is_masked(sampled[i]) and any(bool(s.loss_mask.any()) for s in t.segments())]
    if kept:
        metrics["tito/drift_tokens"] = float(sum(drift[i] for i in kept))
    segments, seg_rewards, seg_groups = training_segments(  # each context of a compacted episode trains alone
        [trained[i] for i in kept], [rewards[i] for i in kept], [groups[i] for i in kept], cut_episodes=cut_episodes)
    metrics["train/segments"] = float(len(segments))  # what the update trains on, one trajectory per context
    return StepBatch(segments, seg_rewards, seg_groups, metrics, version=version)
