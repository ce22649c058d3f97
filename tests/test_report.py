"""rollout.report on trajectories written by `save_trajectory`: family tables and the paired comparison against
plain per-sample loops over the same outcomes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rollout import report
from rollout.trajectory import Trajectory, Turn, save_trajectory


def _episode(task: str, passed: int, total: int) -> Trajectory:
    n = 8
    mask = torch.zeros(n, dtype=torch.bool)
    mask[4:6] = True
    return Trajectory(token_ids=torch.arange(n), loss_mask=mask, rollout_logprobs=torch.where(mask, -0.5, 0.0),
                      routing=None, prompt_len=4, turns=[Turn(start=4, end=6, finish_reason="stop", text="ls")],
                      task_name=task, finish_reason="done", policy_version=0, reward=float(passed),
                      verifier={"passed": passed, "total": total, "outcome": passed == total > 0}, metrics={},
                      system_prompt="s", instruction="i")


def _write(directory: Path, outcomes: list[tuple[str, int, int]]) -> None:
    for i, (task, passed, total) in enumerate(outcomes):
        save_trajectory(_episode(task, passed, total), directory, i)


def _outcomes(seed: int, tasks: list[str], k: int) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    return [(t, rng.choice([0, 1, 3, 4, 4]), 4) for _ in range(k) for t in tasks]


TASKS = [f"{fam}-heldout-{i}" for fam in ("create_file", "sort_file") for i in range(5)] + ["git-find-secret"]


def test_family_table_matches_a_plain_count(tmp_path: Path) -> None:
    outcomes = _outcomes(0, TASKS, k=3)
    _write(tmp_path, outcomes)
    table = report.family_table(report.load_samples(tmp_path))
    assert list(table) == ["create_file", "git-find-secret", "sort_file", "total"]
    for fam in ("create_file", "sort_file", "git-find-secret"):
        mine = [o for o in outcomes if o[0].startswith(fam)]
        solved = [p == t for _, p, t in mine]
        per_task = {name: any(p == t for n2, p, t in mine if n2 == name) for name, _, _ in mine}
        row = table[fam]
        assert row["samples"] == len(mine) and row["solved"] == sum(solved)
        assert row["success_rate"] == pytest.approx(sum(solved) / len(mine))
        assert row["pass_at_k"] == sum(per_task.values()) and row["instances"] == len(per_task)
        assert row["verifier_frac"] == pytest.approx(sum(p / t for _, p, t in mine) / len(mine))
    assert table["total"]["samples"] == len(outcomes) and table["total"]["k_min"] == 3


def test_paired_change_and_its_interval(tmp_path: Path) -> None:
    old, new = _outcomes(1, TASKS, k=4), _outcomes(2, TASKS, k=4)
    _write(tmp_path / "old", old)
    _write(tmp_path / "new", new)
    a, b = report.load_samples(tmp_path / "new"), report.load_samples(tmp_path / "old")
    got = report.paired_change(a, b)

    def rate(outs: list[tuple[str, int, int]], task: str) -> float:
        mine = [p == t for n, p, t in outs if n == task]
        return sum(mine) / len(mine)

    diffs = [rate(new, t) - rate(old, t) for t in TASKS]
    assert got["change"] == pytest.approx(sum(diffs) / len(diffs))
    assert got["up"] == sum(d > 0 for d in diffs) and got["down"] == sum(d < 0 for d in diffs)
    assert got["ci_low"] <= got["change"] <= got["ci_high"] and got["ci_low"] < got["ci_high"]
    same = report.paired_change(b, b)
    assert same["change"] == same["ci_low"] == same["ci_high"] == 0.0


def test_bad_directories_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        report.main([str(tmp_path)])
    assert "no trajectories" in capsys.readouterr().err
    _write(tmp_path / "a", [("x-heldout-0", 1, 1)])
    _write(tmp_path / "b", [("y-heldout-0", 1, 1)])
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "a"), "--baseline", str(tmp_path / "b")])
    assert "no task in common" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "000000.json").write_text("{not json")
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "c")])
    assert "000000.json: not JSON" in capsys.readouterr().err


def test_family_of_strips_the_split_suffix() -> None:
    assert [report.family_of(n) for n in ("create_file-train-100011", "grep_lines-heldout-3", "git-merge-branch")] == \
        ["create_file", "grep_lines", "git-merge-branch"]
