"""Asynchronous RL (rollout.max_staleness): the collector's staleness rule on hand-built episodes, a partial rollout's
fresh part, the bad inputs, and a tiny real run (sandboxes, model, engine) that must stay within the bound with drift 0.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from rollout.agent import EpisodeSpec
from rollout.trajectory import Trajectory, Turn, load_trajectories
from t1core import train
from t1core.async_collect import AsyncCollector, fresh_part, oldest_version
from tests.async_checks import async_steps
from tests.machine import needs_docker


def _episode(versions: list[int], *, name: str = "t") -> Trajectory:
    """prompt (3 tokens), then per version a 2-token reply sampled by it and a 2-token observation (none after the
    last reply)."""
    ids, mask, logp, turns = [1, 2, 3], [False] * 3, [0.0] * 3, []
    for n, v in enumerate(versions):
        if n:
            ids += [7, 7]
            mask += [False, False]
            logp += [0.0, 0.0]
        turns.append(Turn(start=len(ids), end=len(ids) + 2, finish_reason="stop", text="", policy_version=v))
        ids += [10 + n, 20 + n]
        mask += [True, True]
        logp += [-0.5 - n, -0.25 - n]
    return Trajectory(token_ids=torch.tensor(ids), loss_mask=torch.tensor(mask), rollout_logprobs=torch.tensor(logp),
                      routing=None, prompt_len=3, turns=turns, task_name=name, finish_reason="done",
                      policy_version=min(versions))


def test_fresh_part_keeps_the_ids_and_trains_only_the_newer_replies() -> None:
    traj = _episode([0, 1, 3])
    assert oldest_version(traj) == 0
    assert fresh_part(traj, 0) is traj
    part = fresh_part(traj, 1)
    assert torch.equal(part.token_ids, traj.token_ids)  # the old reply stays as context, never re-tokenized
    assert [t.policy_version for t in part.turns] == [1, 3]
    assert part.loss_mask.tolist() == [False] * 7 + [True] * 2 + [False] * 2 + [True] * 2
    assert part.rollout_logprobs[3:5].tolist() == [0.0, 0.0]
    assert torch.equal(part.rollout_logprobs[7:], traj.rollout_logprobs[7:])
    assert traj.token_versions().tolist() == [-1] * 3 + [0, 0] + [-1] * 2 + [1, 1] + [-1] * 2 + [3, 3]


def test_gap_per_lag_groups_loss_tokens_by_the_versions_behind() -> None:
    from t1core.batch import pack
    from t1core.update import gap_per_lag

    trajs = [_episode([0, 1]), _episode([1])]  # 9 and 5 tokens; replies at 3-4 and 7-8, then at 3-4
    batch = pack(trajs, rewards=[0.0, 0.0], with_routing=False)
    train_T = batch.rollout_logp_T.clone()
    train_T[[2, 3]] += 0.25  # position i scores token i + 1: the reply of version 0
    train_T[[6, 7, 9 + 2, 9 + 3]] -= 0.125  # the replies of version 1
    got = gap_per_lag(trajs, train_T, batch, version=1)
    assert got == {"fidelity/gap_lag1": (0.25, 2), "fidelity/gap_lag0": (0.125, 4)}


@pytest.mark.parametrize("stale", ["drop", "continue"])
def test_a_late_episode_is_dropped_or_trimmed_and_its_slot_refilled(stale: str) -> None:
    """One group per step, N = 1. Step 0's episode is slow: it samples its first reply at version 0, then waits.
    The next groups finish and train at versions 0 and 1; it ends at version 2, when it is two versions old."""
    version, release, started = [0], threading.Event(), []

    def plan(step: int) -> list[list[EpisodeSpec]]:
        return [[EpisodeSpec(task=None, image="", seed=step)]]

    def run_one(spec: EpisodeSpec) -> tuple[Trajectory, int]:
        started.append(spec.seed)
        first = version[0]
        if spec.seed == 0:
            release.wait(10)
            return _episode([first, version[0]], name="slow"), 0  # its second reply under the newest weights
        return _episode([first], name=f"s{spec.seed}"), 0

    c = AsyncCollector(plan=plan, run_one=run_one, version=lambda: version[0], groups_per_step=1, max_staleness=1,
                       stale=stale, concurrency=2, first_step=0, last_step=4)
    try:
        names = []
        for _ in range(2):
            taken = c.take()
            names.append(taken.episodes[0].trained.task_name)
            assert taken.metrics["async/staleness_max"] == 0
            c.retire()
            version[0] += 1  # the weight sync after the update
        assert names == ["s1", "s2"]
        release.set()
        deadline = time.monotonic() + 10
        while len(c._ready) < 2 and time.monotonic() < deadline:  # the slow one and step 3's are both done
            time.sleep(0.01)
        trained, dropped, continued = [], 0, 0
        for _ in range(2):  # steps 2 and 3 (the two finished groups may come in either order)
            taken = c.take()
            assert taken.metrics["async/staleness_max"] <= 1
            trained += [e for e in taken.episodes]
            dropped += taken.metrics["async/dropped_episodes"]
            continued += taken.metrics["async/continued_episodes"]
            c.retire()
            version[0] += 1
        names = [e.sampled.task_name for e in trained]
        if stale == "drop":
            assert (dropped, continued) == (1, 0) and names in (["s3", "s4"], ["s4", "s3"])
            assert started == [0, 1, 2, 3, 4]  # the dropped group's slot went to a new one
        else:
            assert (dropped, continued) == (0, 1) and sorted(names) == ["s3", "slow"]
            slow = trained[names.index("slow")].trained
            assert [t.policy_version for t in slow.turns] == [2]  # its reply of version 0 is context now
    finally:
        release.set()
        c.close()


def test_bad_staleness_settings_are_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    for args, said in ((["--rollout.max_staleness=-1"], "rollout.max_staleness: expected >= 0, got -1"),
                       (["--rollout.max_staleness=1", "--rollout.engine=vllm", "--vllm.placement=colocated"],
                        "rollout.max_staleness: expected 0 with vllm.placement='colocated'"),
                       (["--rollout.max_staleness=1", "--algo.bitwise=on"],
                        "rollout.max_staleness: expected 0 with algo.bitwise='on'")):
        with pytest.raises(SystemExit) as e:
            train.main(["--out", str(tmp_path / "run"), *args])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "run").exists()


docker = pytest.importorskip("docker")


@pytest.mark.slow
@pytest.mark.docker
@needs_docker
def test_tiny_async_run_stays_within_the_bound_with_drift_0(tmp_path: Path) -> None:
    from sandbox.tasks.families import SHORT_FAMILIES
    from sandbox.tasks.suite import family_tasks

    tasks = tmp_path / "tasks"
    family_tasks(tasks, split="train", num_per_family=1, seed=0, families=list(SHORT_FAMILIES)[:2])
    out = tmp_path / "run"
    assert train.main(["--out", str(out), f"--tasks.source={tasks}", "--rollout.episodes_per_step=2",
                       "--rollout.group_size=2", "--rollout.concurrency=2", "--rollout.max_turns=2",
                       "--rollout.max_new_tokens_per_turn=8", "--rollout.max_tokens=640",
                       "--algo.minibatch_tokens=1400",
                       "--warmstart.pretrain_steps=0", "--warmstart.sft_epochs=0", "--warmstart.critic_steps=1",
                       "--run.checkpoint_every=0", "--optim.lr_actor=1e-3", "--algo.actor_push=center",
                       "--run.steps=3", "--rollout.max_staleness=1"]) == 0
    for r in (steps := async_steps(out, 3)):
        assert 0 <= r["rollout/engine_idle_frac"] <= 1 and 0 <= r["train/trainer_idle_frac"] <= 1
        assert any(k.startswith("fidelity/gap_lag") for k in r)
    # Later steps train episodes sampled while the step before them trained, by the weights before its update: the
    # overlap is real (step 1's group starts as soon as step 0's ends and the update takes seconds).
    assert any(r["async/staleness_max"] == 1 for r in steps[1:])
    for step in range(3):  # every sampled reply carries its weight version, within the bound of its step
        for t in load_trajectories(out / "trajectories" / f"step_{step:04d}"):
            assert all(step - 1 <= turn.policy_version <= step for turn in t.turns)


def test_simulator_matches_the_closed_form_of_equal_episodes() -> None:
    """Every episode 100 s, one slot each: a synchronous step is episode + update + sync = 140 s; asynchronous,
    the engine never waits for the update and only stalls for the sync: 110 s per step, nothing stale past N = 1."""
    from t1cli.async_sim import SimInputs, planner_inputs, simulate

    x = SimInputs(episodes_per_step=8, group_size=2, slots=8, min_turns=1, max_turns=1, turn_s=100.0, turn_sigma=0.0,
                  train_s=30.0, sync_s=10.0)
    sync = simulate(x, max_staleness=0, steps=50)
    assert sync.step_s == pytest.approx(140.0) and sync.trainer_idle_frac == pytest.approx(100 / 140)
    one = simulate(x, max_staleness=1, steps=50)
    assert one.step_s == pytest.approx(110.0, rel=0.02) and one.dropped_frac == 0 and one.staleness_mean <= 1
    for preset in ("30b", "122b"):  # the planner's figures load, and overlap never loses
        x, how = planner_inputs(preset)
        assert simulate(x, max_staleness=1, steps=20).step_s < simulate(x, max_staleness=0, steps=20).step_s, how
