"""The typed step (t1core.step: seed streams, resumable state) and t1core.advantages' one reward and push rules."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from rollout.sampling import derive_seed
from t1core.config import AlgoSection
from t1core.advantages import flat_groups, push_plan, shaped_reward
from t1core.step import Stream, StepBatch, TrainerState, seed_for, solved


def _traj(passed: int, total: int, *, turns: int = 2, malformed: int = 0, verified: bool = True):
    verifier = {"passed": passed, "total": total, "outcome": passed == total > 0} if verified else None
    return SimpleNamespace(reward=float(passed if verified else 0), verifier=verifier, turns=[None] * turns,
                           metrics={"malformed_tool_calls": malformed}, earlier=[])


def test_the_reward_is_the_dense_count_plus_the_shaping_terms() -> None:
    algo = AlgoSection(outcome_bonus=1.5, turn_penalty=0.25, format_penalty=0.5)
    assert shaped_reward(_traj(3, 3, turns=4, malformed=1), algo) == 3 + 1.5 - 1.0 - 0.5
    assert shaped_reward(_traj(2, 3, turns=1), algo) == 2 - 0.25
    assert shaped_reward(_traj(0, 0, verified=False), algo) == -0.5  # never verified: nothing passed, not solved
    assert not solved(_traj(0, 0)) and solved(_traj(1, 1))


@pytest.mark.parametrize("step,rewards,groups,expect_update,expect_no_push", [
    (0, [1.0, 2.0, 3.0, 3.0], [0, 0, 1, 1], False, [False, False, True, True]),  # critic-only warm start
    (5, [1.0, 2.0, 3.0, 3.0], [0, 0, 1, 1], True, [False, False, True, True]),   # one group still disagrees
    (5, [1.0, 1.0, 3.0, 3.0], [0, 0, 1, 1], False, [True, True, True, True]),     # every group flat
    (5, [2.0, 2.0, 2.0, 2.0], [0, 0, 1, 1], False, [True, True, True, True]),     # a flat step
])
def test_push_plan(step, rewards, groups, expect_update, expect_no_push) -> None:
    plan = push_plan(rewards, groups, step=step, algo=AlgoSection(), group_size=2, critic_steps=2)
    assert plan.update_actor is expect_update and plan.no_push == expect_no_push
    assert plan.metrics["train/flat_group_episode_frac"] == sum(expect_no_push) / len(expect_no_push)
    assert plan.metrics["train/flat_step"] == float(len(set(rewards)) == 1)


@pytest.mark.parametrize("rule", ["center", "whiten", "raw"])
def test_push_rules_without_the_group_baseline_never_skip(rule: str) -> None:
    algo = AlgoSection(actor_push=rule)
    plan = push_plan([2.0, 2.0], [0, 0], step=0, algo=algo, group_size=2, critic_steps=0)
    assert plan.update_actor and plan.no_push is None and plan.metrics == {"train/flat_step": 0.0}
    assert (plan.baseline, plan.negative_scale) == ({"center": "center", "whiten": "whiten", "raw": "none"}[rule], 1.0)


def test_group_push_rules_differ_only_in_negative_advantages() -> None:
    for rule, scale in (("group_positive", 0.0), ("group", 1.0)):
        plan = push_plan([1.0, 2.0], [0, 0], step=5, algo=AlgoSection(actor_push=rule), group_size=2, critic_steps=2)
        assert plan.update_actor and plan.no_push == [False, False]
        assert (plan.baseline, plan.negative_scale) == ("group", scale)
    assert flat_groups([1.0, 1.0], [0, 1]) == [False, False]  # lone episodes are never flat


def test_seed_streams_are_distinct_and_keep_their_historical_values() -> None:
    seeds = [seed_for(7, Stream.UPDATE, 3), seed_for(7, Stream.ROLLOUT, 3), seed_for(7, Stream.SFT),
             seed_for(7, Stream.HELDOUT), seed_for(7, Stream.HELDOUT, 2)]
    assert len(set(seeds)) == len(seeds)
    # The runs made before the streams had names drew from these seeds: the names must not move them.
    assert seeds[:4] == [derive_seed(7, 3), derive_seed(7, 3, 1), derive_seed(7, 1 << 20), derive_seed(7, 1 << 21)]


def test_trainer_state_round_trips_and_keeps_unknown_keys() -> None:
    state = TrainerState(step=4, warm_started=True, evaluated_at=4)
    assert TrainerState.from_dict(state.to_dict()) == state
    old = {"step": 2, "warm_started": True, "instance_stats": {"a": [1.0, 0.0]}}  # a checkpoint of an older version
    loaded = TrainerState.from_dict(old)
    assert (loaded.step, loaded.warm_started, loaded.evaluated_at) == (2, True, None)
    assert loaded.to_dict()["instance_stats"] == {"a": [1.0, 0.0]}


def test_step_batch_fields_are_aligned() -> None:
    with pytest.raises(ValueError, match="2 trajectories, 1 rewards"):
        StepBatch(trajs=[1, 2], rewards=[0.0], group_ids=[0, 0], metrics={})
    assert dataclasses.is_dataclass(StepBatch)


def test_a_compacted_episode_pays_the_turn_penalty_for_every_segment() -> None:
    algo = AlgoSection(outcome_bonus=0.0, turn_penalty=0.5)
    traj = _traj(3, 5, turns=2)
    traj.earlier = [_traj(3, 5, turns=4), _traj(3, 5, turns=4)]
    assert shaped_reward(traj, algo) == 3 - 0.5 * 10
