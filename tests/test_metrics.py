"""Metrics JSONL, the PNG plot, the GPU reader's CPU behaviour, the stopwatch."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import time

import numpy as np
import pytest
import torch

from t1core.clock import Stopwatch
from t1core.metrics import (EngineWindow, MetricsLogger, RunLog, fidelity_line, gpu_stats,
                            phase_budget_line, plot_metrics, progress_line, read_metrics)


def _fake_run(path, num_steps: int = 6) -> None:
    with MetricsLogger(path) as logger:
        for step in range(num_steps):
            logger.log(step, {
                "reward/mean": torch.tensor(0.5 * step), "outcome/rate": step / 10,
                "mismatch": {"gap": 0.02 - 0.001 * step, "k3": 1e-3, "extreme_frac": 0.0},
                "policy/loss": torch.tensor(-0.1, dtype=torch.float64), "value/loss": np.float32(2.0 / (step + 1)),
                "time/generate": 1.5, "time/update": 0.5, "skipped": None,
                **({"eval/builtin/success": 0.25 * step} if step % 3 == 0 else {}),
            })


def test_logger_rows_are_flat_plain_json(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path) as logger:
        row = logger.log(3, {"a": {"b": torch.tensor(2), "c": np.int64(4)}, "loss": float("nan"),
                             "flag": torch.tensor(True), "reason": "nan loss"})
    assert row["a/b"] == 2 and row["a/c"] == 4 and row["loss"] is None and row["flag"] is True
    text = path.read_text()
    assert "NaN" not in text and text.count("\n") == 1
    (back,) = read_metrics(path)
    assert back == json.loads(text) and back["step"] == 3 and back["reason"] == "nan loss"
    with pytest.raises(TypeError, match="scalar"):
        MetricsLogger(tmp_path / "n.jsonl").log(0, {"x": torch.zeros(2)})
    with pytest.raises(TypeError, match="expected a number"):
        MetricsLogger(tmp_path / "o.jsonl").log(0, {"x": [1, 2]})


def test_logger_resume_drops_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    _fake_run(path, num_steps=5)
    with pytest.raises(ValueError, match="resume_step"):
        MetricsLogger(path)
    with MetricsLogger(path, resume_step=2) as logger:
        logger.log(3, {"reward/mean": 9.0})
    assert [row["step"] for row in read_metrics(path)] == [0, 1, 2, 3]
    assert read_metrics(path)[-1]["reward/mean"] == 9.0


def test_plot_is_a_valid_png(tmp_path):
    jsonl, png = tmp_path / "m.jsonl", tmp_path / "curves.png"
    _fake_run(jsonl)
    assert plot_metrics(jsonl, png) == png
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 640)  # 15x8 inches at 80 dpi
    import matplotlib.image  # an independent decoder reads it back: not blank
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (640, 1200) and pixels.std() > 0.05


def test_plot_with_missing_groups(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    with MetricsLogger(jsonl) as logger:
        logger.log(0, {"reward/mean": 1.0})
    plot_metrics(jsonl, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_stats_is_empty_without_a_gpu():
    stats = gpu_stats()
    if importlib.util.find_spec("pynvml") is None or not torch.cuda.is_available():
        assert stats == {}
    else:
        assert 0 < stats["gpu/mem_used_gib"] <= stats["gpu/mem_total_gib"]
        assert 0 <= stats["gpu/util_pct"] <= 100


def test_stopwatch_accumulates_and_resets():
    sw = Stopwatch()
    for _ in range(2):
        with sw.phase("generate"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with sw.phase("update"):
            raise RuntimeError("counted anyway")
    with sw.phase("spin"):  # CPU time: a busy loop is counted, a sleep is not
        c_end = time.process_time() + 0.05  # by CPU time: on a loaded box 0.05 s of wall clock may get far less
        while time.process_time() < c_end:
            pass
    times = sw.pop()
    assert set(times) == {f"{kind}/{name}" for kind in ("time", "cputime") for name in ("generate", "update", "spin")}
    assert 0.02 <= times["time/generate"] < 1.0 and math.isfinite(times["time/update"])
    assert times["cputime/generate"] < 0.01 and times["cputime/spin"] > 0.02  # CPU time is not wall time
    assert sw.pop() == {}


def test_phase_budget_line_sums_phases_over_rows():
    rows = [{"step": -1, "time/pretrain": 100.0, "cputime/pretrain": 180.0, "time/eval": 10.0, "cputime/eval": 12.0},
            {"step": 0, "time/collect": 20.0, "cputime/collect": 30.0, "time/critic_warmup": 2.0,
             "cputime/critic_warmup": 3.0, "rollout/engine_busy_s": 15.0, "time/episode_command_s": 40.0,
             "time/episode_verify_s": 5.0, "time/step_s": 23.0},
            {"step": 1, "time/collect": 22.0, "cputime/collect": 31.0, "time/update": 4.0, "cputime/update": 7.0,
             "rollout/engine_busy_s": 16.0, "time/episode_command_s": 41.0, "time/episode_verify_s": 6.0}]
    assert phase_budget_line(rows) == (
        "time per phase (wall/CPU s): pretrain 100/180, collect 42/61, critic_warmup 2/3, update 4/7, eval 10/12; "
        "total 158/263; rollout: engine busy 31 s, episodes' sandbox commands 81 s, verifiers 11 s")
    assert phase_budget_line([{"step": 0, "reward/dense_mean": 1.0}]) is None


def test_progress_line_says_what_a_row_says():
    warm = {"step": -1, "pretrain/steps": 300.0, "pretrain/loss_first": 3.25, "pretrain/loss_last": 0.26,
            "eval/builtin/family_success": 0.5, "eval/builtin/family_solved": 56.0, "eval/builtin/family_episodes": 112.0,
            "eval/builtin/family_verifier_frac": 0.71, "time/pretrain": 100.0, "time/sft_update": 20.5}
    assert progress_line(warm, total_steps=24) == ("warm start: pretrain loss 3.25 -> 0.26 | held-out family solved "
                                                   "50.0% (56/112), verifiers 0.710 | 120 s")
    step = {"step": 3, "reward/dense_mean": 2.5, "outcome/rate": 0.625, "mismatch/gap": None,
            "tito/drift_tokens": 0.0, "train/actor_updated": 1.0, "policy/kl_ref": 0.0042,
            "time/collect": 10.0, "time/episode_generate_s": 99.0, "time/step_s": 12.0}
    assert progress_line(step, total_steps=24) == ("rl step 4/24: reward 2.50, solved 62% | "
                                                   "gap nan (max nan), drift 0 | "
                                                   "actor+critic, KL to warm start 0.0042 | 10 s")
    assert progress_line({"step": 24}, total_steps=24) == "after RL: "
    after = {"step": 24, "eval/builtin/family_sampled_success": 0.25, "eval/builtin/family_sampled_solved": 56.0,
             "eval/builtin/family_sampled_episodes": 224.0, "eval/builtin/family_sampled_verifier_frac": 0.8,
             "eval/builtin/greedy_change": 0.125, "eval/builtin/greedy_change_lo": 0.0625, "eval/builtin/greedy_change_hi": 0.1875}
    assert progress_line(after, total_steps=24) == ("after RL: held-out family sampled solved 25.0% (56/224), "
                                                    "verifiers 0.800 | change greedy +0.125 [+0.062, +0.188]")


def test_fidelity_line_reports_the_largest_gap_and_whether_bitwise_held():
    zero = [{"step": i, "mismatch/gap": 0.0, "mismatch/max_abs": 0.0, "tito/drift_tokens": 0} for i in range(3)]
    warm = {"step": -1, "sft/nll": 1.0}  # rows without the metrics do not count as steps
    line = fidelity_line([warm, *zero], bitwise=True)
    assert "over 3 RL steps" in line and "exactly 0.0 at every step" in line and "drift 0 tokens" in line
    moved = [*zero, {"step": 3, "mismatch/gap": 2e-7, "mismatch/max_abs": 5e-7, "tito/drift_tokens": 1}]
    line = fidelity_line(moved, bitwise=True)
    assert "NOT 0.0" in line and "max |d| at most 5e-07" in line and "drift 1 tokens" in line
    assert "bitwise" not in fidelity_line(moved, bitwise=False)
    assert fidelity_line([warm], bitwise=True) is None


def test_engine_window_counts_one_step_of_the_engine() -> None:
    from types import SimpleNamespace

    engine = SimpleNamespace(stats={"step_s": 1.0, "pause_s": 0.5})
    window = EngineWindow(engine)
    engine.stats.update(step_s=3.0, pause_s=1.0)
    assert window.metrics(4.0) == {"rollout/engine_idle_frac": 0.5, "rollout/engine_busy_s": 2.0,
                                   "rollout/engine_pause_s": 0.5}
    assert EngineWindow(None).metrics(1.0) == {}  # a rank without an engine, or one keeping no totals


def test_run_log_writes_and_prints_on_the_main_rank_only(tmp_path, capsys) -> None:
    from t1core.config import RunConfig

    other = RunLog(tmp_path / "other", resume_step=None, total_steps=2, is_main=False)
    other.row(0, {"reward/dense_mean": 1.0})
    other.close()
    other.print_closing_lines({"eval/tasks": 0.0}, RunConfig())
    assert not (tmp_path / "other").exists() and capsys.readouterr().out == ""
    log = RunLog(tmp_path, resume_step=None, total_steps=2, is_main=True)
    log.row(0, {"reward/dense_mean": 1.0})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["reward/dense_mean"] == 1.0
    assert (tmp_path / "metrics.png").is_file() and capsys.readouterr().out.strip()  # one progress line
    log.print_closing_lines(None, RunConfig())  # no evaluation after RL: no closing lines
    assert capsys.readouterr().out == ""
