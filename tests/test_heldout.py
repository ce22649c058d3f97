"""t1core.evaluation's built-in held-out split on trajectories written by `save_trajectory`: the before/after change of the held-out
evaluations against plain per-instance loops over the same outcomes, and the run's closing lines."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rollout.trajectory import Trajectory, Turn, save_trajectory
from t1core import evaluation


def _episode(task: str, passed: int, total: int) -> Trajectory:
    mask = torch.zeros(8, dtype=torch.bool)
    mask[4:6] = True
    return Trajectory(token_ids=torch.arange(8), loss_mask=mask, rollout_logprobs=torch.where(mask, -0.5, 0.0),
                      routing=None, prompt_len=4, turns=[Turn(start=4, end=6, finish_reason="stop", text="ls")],
                      task_name=task, finish_reason="done", policy_version=0, reward=float(passed),
                      verifier={"passed": passed, "total": total, "outcome": passed == total > 0}, metrics={},
                      system_prompt="s", instruction="i")


def _write(directory: Path, outcomes: list[tuple[str, int]]) -> None:
    for i, (task, passed) in enumerate(outcomes):
        save_trajectory(_episode(task, passed, 5), directory, i)


TASKS = [f"{fam}-heldout-{i}" for fam in ("create_file", "sort_file") for i in range(6)]


def _outcomes(seed: int, k: int, p_full: float) -> list[tuple[str, int]]:
    """k samples of every task (task order repeated k times, as the trainer lays them out: t0 t0 t1 t1 ...)."""
    rng = random.Random(seed)
    return [(t, 5 if rng.random() < p_full else rng.randrange(5)) for t in TASKS for _ in range(k)]


def test_change_metrics_match_a_plain_per_instance_loop(tmp_path: Path) -> None:
    plan = {("before", "greedy"): _outcomes(0, 1, 0.3), ("after", "greedy"): _outcomes(1, 1, 0.8),
            ("before", "sampled"): _outcomes(2, 3, 0.3), ("after", "sampled"): _outcomes(3, 3, 0.8)}
    for (tag, kind), outcomes in plan.items():
        _write(evaluation.eval_dir(tmp_path, tag, kind), outcomes)
    m = evaluation.change_metrics(tmp_path, "after")
    for kind, k in (("greedy", 1), ("sampled", 3)):
        before, after = plan[("before", kind)], plan[("after", kind)]

        def rate(outcomes: list[tuple[str, int]], task: str) -> float:
            mine = [p for t, p in outcomes if t == task]
            assert len(mine) == k
            return sum(p == 5 for p in mine) / k

        diffs = [rate(after, t) - rate(before, t) for t in TASKS]
        p = f"eval/builtin/{kind}_change"
        assert m[p] == pytest.approx(sum(diffs) / len(TASKS))
        assert m[f"{p}_before"] == pytest.approx(sum(rate(before, t) for t in TASKS) / len(TASKS))
        assert m[f"{p}_after"] == pytest.approx(sum(rate(after, t) for t in TASKS) / len(TASKS))
        assert m[f"{p}_lo"] <= m[p] <= m[f"{p}_hi"] and m[f"{p}_lo"] < m[f"{p}_hi"]
        assert m[f"{p}_lo"] >= min(diffs) and m[f"{p}_hi"] <= max(diffs)
        assert (m[f"{p}_up"], m[f"{p}_down"]) == (sum(d > 0 for d in diffs), sum(d < 0 for d in diffs))
        assert (m[f"{p}_instances"], m[f"{p}_samples"]) == (len(TASKS), k)
        assert m[f"{p}_verifier_before"] == pytest.approx(sum(v / 5 for _, v in before) / len(before))
        assert m[f"{p}_verifier_after"] == pytest.approx(sum(v / 5 for _, v in after) / len(after))

    lines = evaluation.builtin_lines(m, temperature=1.0)
    assert len(lines) == 2 and lines[0].startswith("held-out success, greedy: ")
    assert "sampled (mean of 3 at T=1)" in lines[1] and "95% bootstrap [" in lines[1]
    assert f"over {len(TASKS)} instances" in lines[0] and "verifier fraction" in lines[0]


def test_unchanged_outcomes_give_no_change_and_a_missing_evaluation_no_keys(tmp_path: Path) -> None:
    same = _outcomes(5, 2, 0.5)
    _write(evaluation.eval_dir(tmp_path, "before", "sampled"), same)
    _write(evaluation.eval_dir(tmp_path, "after", "sampled"), same)
    m = evaluation.change_metrics(tmp_path, "after")
    assert not any(k.startswith("eval/builtin/greedy_change") for k in m)  # never evaluated greedily here
    assert m["eval/builtin/sampled_change"] == m["eval/builtin/sampled_change_lo"] == m["eval/builtin/sampled_change_hi"] == 0
    assert evaluation.builtin_lines({}, temperature=1.0) == []
    with pytest.raises(ValueError, match="kind"):
        evaluation.eval_dir(tmp_path, "after", "beam")
