"""Per-step metrics: a JSONL logger, a PNG of the curves, GPU memory/utilisation (the phase stopwatch: t1core.clock).

Keys are flat "group/name" strings; nested dicts are flattened with "/". The plot groups them by name:
reward/* (dense reward), outcome/* (outcome rate), eval/*_{success,resolved,verifier_frac} (held-out success and
benchmark resolved rates; the paired change after RL, eval/*_change*, is on the run's last lines and in its row,
not plotted),
mismatch/{gap,k3,extreme_frac} (train vs rollout log-probs), */loss (losses), time/* (wall seconds per phase,
stacked; cputime/* holds their CPU seconds). `progress_line` turns a row into one line of text for the log.
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from rollout.agent import is_masked
from rollout.trajectory import Trajectory
from t1core.config import RunConfig
from t1core import evaluation
from t1core.evaluation import benchmark_keys
from t1core.tasks import nothing_reason
from t1core.step import solved


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, prefix=f"{name}/"))
        else:
            flat[name] = _to_json(name, value)
    return flat


def _to_json(name: str, value: Any) -> Any:
    """A JSON value; non-finite floats become null (strict JSON has no NaN)."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        size = value.numel() if isinstance(value, torch.Tensor) else np.size(value)
        if size != 1:
            raise TypeError(f"metric {name!r}: expected a scalar, got shape {tuple(value.shape)}")
        value = value.item()  # sync: once per logged scalar
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {name!r}: expected a number, string, bool or None, got {type(value).__name__}")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fidelity_line(rows: list[Mapping[str, Any]], *, bitwise: bool) -> str | None:
    """A closing line on the train-vs-rollout log-prob mismatch over every RL step of `rows` (a metrics file's):
    the largest gap and max |d| seen, and, in algo.bitwise='on', whether both were exactly 0.0 at every step."""
    steps = [r for r in rows if r.get("mismatch/gap") is not None and r.get("mismatch/max_abs") is not None]
    if not steps:
        return None
    gap, worst = max(r["mismatch/gap"] for r in steps), max(r["mismatch/max_abs"] for r in steps)
    drift = sum(r.get("tito/drift_tokens") or 0 for r in steps)
    line = (f"train/rollout log-probs over {len(steps)} RL steps: gap at most {gap:.3g}, max |d| at most {worst:.3g}, "
            f"TITO drift {drift:.0f} tokens")
    segments = sum(r.get("train/segments") or 0 for r in steps)
    if segments:  # each context of a compacted episode trains as a segment: the figures above cover every one
        line += f" in the {segments:.0f} segments trained"
    if bitwise:
        exact = gap == 0.0 and worst == 0.0
        line += " (bitwise: exactly 0.0 at every step)" if exact else " (bitwise: NOT 0.0 at every step)"
    return line


class MetricsLogger:
    """Appends one JSON row per step ({"step", "wall_time", ...metrics}) and flushes it at once.

    A fresh run refuses a non-empty existing file; a resumed run passes `resume_step`, and rows logged after
    that step (by the run that died) are dropped so that the resumed run's rows replace them.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and resume_step is None:
            raise ValueError(f"metrics: {self.path} exists; pass resume_step to continue it")
        if exists:
            kept = [row for row in read_metrics(self.path) if row["step"] <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Write one row and return it (as written: flat keys, plain values)."""
        row = {"step": step, "wall_time": time.time(), **_flatten(metrics)}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        return row

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunLog:
    """The run's metrics.jsonl, written by the main rank with one progress line per row for people; on the other
    ranks every call does nothing."""

    def __init__(self, run_dir: Path, *, resume_step: int | None, total_steps: int, is_main: bool) -> None:
        self.run_dir, self.total_steps = run_dir, total_steps
        self.logger = MetricsLogger(run_dir / "metrics.jsonl", resume_step=resume_step) if is_main else None

    def row(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self.logger is not None:  # tqdm.write keeps terminal bars intact
            tqdm.write(progress_line(self.logger.log(step, metrics), total_steps=self.total_steps), file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        """Close the file and draw its curves (metrics.png)."""
        if self.logger is not None:
            self.logger.close()
            plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png")

    def print_closing_lines(self, after: Mapping[str, Any] | None, cfg: RunConfig) -> None:
        """The run's last lines (`closing_lines`), when it evaluated after RL (`after`)."""
        if after is not None and self.logger is not None:
            print("\n".join(closing_lines(self.run_dir / "metrics.jsonl", after, cfg)), flush=True)


_PANELS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("dense reward", lambda k: k.startswith("reward/")),
    ("outcome rate", lambda k: k.startswith("outcome/")),
    ("held-out success, resolved", lambda k: k.startswith("eval/") and k.endswith(("_success", "_resolved",
                                                                                  "_verifier_frac"))),
    ("train/rollout log-prob gap", lambda k: k in ("mismatch/gap", "mismatch/max_abs", "mismatch/k3",
                                                 "mismatch/extreme_frac")),
    ("losses", lambda k: k.endswith("/loss")),
    ("time split (s)", lambda k: k.startswith("time/")),
)


def progress_line(row: Mapping[str, Any], *, total_steps: int) -> str:
    """One line for people reading the log (a file or a terminal): what a metrics row says, in a fixed order.

    Step -1 is the warm start (pretraining, SFT, held-out before RL), step `total_steps` the evaluation after RL,
    the steps between are RL steps. Parts whose keys a row lacks are left out; a null (non-finite) value shows as
    "nan".
    """
    def f(key: str, spec: str) -> str:
        value = row.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "nan"

    parts = []
    if "pretrain/steps" in row:
        parts.append(f"pretrain loss {f('pretrain/loss_first', '.2f')} -> {f('pretrain/loss_last', '.2f')}")
    if "sft/steps" in row:
        parts.append(f"SFT {f('sft/transcripts', '.0f')} transcripts, {f('sft/steps', '.0f')} steps, "
                     f"NLL {f('sft/nll', '.3f')}")
    if "outcome/rate" in row:
        parts.append(f"reward {f('reward/dense_mean', '.2f')}, solved {f('outcome/rate', '.0%')}")
    if "mismatch/gap" in row:
        parts.append(f"gap {f('mismatch/gap', '.1e')} (max {f('mismatch/max_abs', '.1e')}), "
                     f"drift {f('tito/drift_tokens', '.0f')}")
    if "train/actor_updated" in row:
        updated = row["train/actor_updated"]
        parts.append(f"actor+critic, KL to warm start {f('policy/kl_ref', '.2g')}" if updated else "critic only")
    for name in ("family", "family_sampled", "fixed"):
        p = f"{evaluation.PREFIX}/{name}"
        if f"{p}_success" in row:
            count = f" ({f(p + '_solved', '.0f')}/{f(p + '_episodes', '.0f')})" if f"{p}_solved" in row else ""
            parts.append(f"held-out {name.replace('_', ' ')} solved {f(p + '_success', '.1%')}{count}, "
                         f"verifiers {f(p + '_verifier_frac', '.3f')}")
    for kind in evaluation.KINDS:
        key = f"{evaluation.PREFIX}/{kind}_change"
        if key in row:
            parts.append(f"change {kind} {f(key, '+.3f')} [{f(key + '_lo', '+.3f')}, {f(key + '_hi', '+.3f')}]")
    for name, kind in benchmark_keys(row):
        p = f"eval/{name}/{kind}"
        change = f", change {f(p + '_change', '+.3f')}" if f"{p}_change" in row else ""
        parts.append(f"{name} {kind} resolved {f(p + '_resolved', '.1%')} [{f(p + '_resolved_lo', '.1%')}, "
                     f"{f(p + '_resolved_hi', '.1%')}]{change}")
    if row.get("eval/tasks") == 0:
        parts.append("nothing evaluated")
    phases = [v for k, v in row.items() if k.startswith("time/") and not k.startswith("time/episode_")
              and k != "time/step_s" and isinstance(v, (int, float))]
    if phases:
        parts.append(f"{sum(phases):.0f} s")
    step = row["step"]
    label = "warm start" if step < 0 else "after RL" if step >= total_steps else f"rl step {step + 1}/{total_steps}"
    return f"{label}: " + " | ".join(parts)


def plot_metrics(jsonl_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path:
    """Draw the run's curves (one panel per group above, against step) into a PNG; returns its path."""
    from matplotlib.figure import Figure  # lazy: plotting is off the training path; no pyplot global state

    rows = read_metrics(jsonl_path)
    steps = np.array([row["step"] for row in rows], dtype=float)
    fig = Figure(figsize=(15, 8), layout="constrained")
    for ax, (title, wanted) in zip(fig.subplots(2, 3, sharex=True).flat, _PANELS):
        keys = sorted({k for row in rows for k in row if wanted(k) and isinstance(row[k], (int, float))})
        series = {k: np.array([_as_float(row.get(k)) for row in rows]) for k in keys}
        ax.set_title(title)
        ax.set_xlabel("step")
        if not keys:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        elif title.startswith("time"):
            ax.stackplot(steps, *[np.nan_to_num(series[k]) for k in keys], labels=keys)
        else:
            for k in keys:
                seen = ~np.isnan(series[k])  # sparse series (held-out evals) get markers, no gaps
                ax.plot(steps[seen], series[k][seen], marker="o" if seen.sum() < 20 else None, label=k)
        if keys:
            ax.legend(fontsize=7)
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=80)
    return png_path


def _as_float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


@functools.lru_cache(maxsize=1)
def _nvml() -> ModuleType | None:
    """pynvml, initialised; None when it is not installed or finds no driver (CPU machines)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def engine_stat(engine: Any, name: str) -> float | None:
    """A running total the engine keeps (TorchEngine.stats: 'step_s' in batch steps, 'pause_s' paused for weight
    updates), None for an engine that keeps none."""
    stats = getattr(engine, "stats", None)
    return None if not isinstance(stats, dict) else stats.get(name)


class EngineWindow:
    """The engine's running totals (`engine_stat`) from its construction to `metrics(wall)`: one RL step's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.busy0, self.pause0 = engine_stat(engine, "step_s"), engine_stat(engine, "pause_s")

    def metrics(self, wall: float) -> dict[str, float]:
        """Busy and paused seconds over the `wall` seconds since, and the fraction idle; {} for an engine keeping
        none."""
        out = {}
        busy, pause = engine_stat(self.engine, "step_s"), engine_stat(self.engine, "pause_s")
        if busy is not None:  # idle: no batch step running (waiting for sandboxes, for weights, or for work)
            out["rollout/engine_idle_frac"] = max(0.0, 1.0 - (busy - self.busy0) / wall)
            out["rollout/engine_busy_s"] = busy - self.busy0
        if pause is not None:
            out["rollout/engine_pause_s"] = pause - self.pause0
        return out


def gpu_stats(device_index: int = 0) -> dict[str, float]:
    """GPU memory (GiB) and utilisation (%) from NVML, plus torch's peak allocation when CUDA is in use.
    {} without error where there is no GPU or nvidia-ml-py is not installed."""
    nvml = _nvml()
    if nvml is None:
        return {}
    handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    stats = {"gpu/mem_used_gib": mem.used / 2**30, "gpu/mem_total_gib": mem.total / 2**30,
             "gpu/util_pct": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)}
    if torch.cuda.is_initialized():
        stats["gpu/torch_peak_alloc_gib"] = torch.cuda.max_memory_allocated(device_index) / 2**30
    return stats


_PHASE_ORDER = ("pretrain", "sft_transcripts", "sft_update", "collect", "score", "critic_warmup", "update", "sync",
                "eval")


def phase_budget_line(rows: list[Mapping[str, Any]]) -> str | None:
    """The run's time per phase, summed over its metrics rows: wall / CPU seconds of each `Stopwatch` phase, and
    the rollout's split (engine busy time, and the episodes' summed sandbox-command and verifier seconds: summed
    over concurrent episodes, so they may exceed the collect phase's wall time)."""
    def total(key: str) -> float:
        return sum(v for row in rows if isinstance(v := row.get(key), (int, float)) and not isinstance(v, bool))

    names = sorted({k[5:] for row in rows for k in row if k.startswith("time/") and not k.startswith("time/episode_")
                    and k != "time/step_s"}, key=lambda n: (_PHASE_ORDER + (n,)).index(n))
    if not names:
        return None
    parts = [f"{n} {total(f'time/{n}'):.0f}/{total(f'cputime/{n}'):.0f}" for n in names]
    wall, cpu = sum(total(f"time/{n}") for n in names), sum(total(f"cputime/{n}") for n in names)
    split = (f"; rollout: engine busy {total('rollout/engine_busy_s'):.0f} s, episodes' sandbox commands "
             f"{total('time/episode_command_s'):.0f} s, verifiers {total('time/episode_verify_s'):.0f} s")
    return f"time per phase (wall/CPU s): {', '.join(parts)}; total {wall:.0f}/{cpu:.0f}" + split


def rollout_metrics(trajs: list[Trajectory], rewards: list[float]) -> dict[str, float]:
    """One RL step's rollout rows: rewards, success, lengths, malformed replies, sandbox errors, episode times."""
    n = len(trajs)
    # Rewards and success over the episodes the update sees: a masked one (infrastructure failure) has none.
    scored = [(t, r) for t, r in zip(trajs, rewards, strict=True) if not is_masked(t)]
    n_scored = max(1, len(scored))
    verified = [t.verifier for t, _ in scored if t.verifier]
    segs = [s for t in trajs for s in t.segments()]  # every context of a compacted episode
    out = {
        "reward/dense_mean": sum(v["passed"] for v in verified) / n_scored,
        "reward/shaped_mean": sum(r for _, r in scored) / n_scored,
        "outcome/rate": sum(solved(t) for t, _ in scored) / n_scored,
        "rollout/turns_mean": sum(len(s.turns) for s in segs) / n,
        "rollout/tokens": float(sum(s.num_tokens for s in segs)),
        "rollout/sampled_tokens": float(sum(int(s.loss_mask.sum()) for s in segs)),
        "rollout/malformed_tool_calls": float(sum(t.metrics.get("malformed_tool_calls", 0) for t in trajs)),
        "rollout/sandbox_errors": float(sum(t.finish_reason.startswith("sandbox_error") for t in trajs)),
        "rollout/infra_masked": float(sum(map(is_masked, trajs))),
        "rollout/infra_retries": float(sum(t.metrics.get("infra/retries", 0.0) for t in trajs)),
        "tito/prefix_checks": float(sum(t.metrics.get("tito_prefix_checks", 0) for t in trajs)),
    }
    for t in trajs:  # per host: episodes (where each last ran), infrastructure failures
        for key, n in t.metrics.items():
            for prefix, row in (("infra/failures/", "rollout/infra_failures/"), ("host/", "rollout/episodes/")):
                if key.startswith(prefix):
                    name = row + key.removeprefix(prefix)
                    out[name] = out.get(name, 0.0) + n
    out["rollout/infra_failures"] = sum(v for k, v in out.items() if k.startswith("rollout/infra_failures/"))
    for key in ("generate_s", "command_s", "verify_s"):
        out[f"time/episode_{key}"] = sum(t.metrics.get(key, 0.0) for t in trajs)
    return out


def closing_lines(metrics_path: Path, after: Mapping[str, Any], cfg: RunConfig) -> list[str]:
    """The run's last lines: the fidelity summary over its steps, and what RL did to held-out success."""
    rows = read_metrics(metrics_path)
    fidelity = fidelity_line(rows, bitwise=cfg.algo.bitwise == "on")
    budget = phase_budget_line(rows)
    lines = evaluation.builtin_lines(after, temperature=cfg.rollout.temperature)
    if cfg.context.compaction != "off":  # long episodes: how long they were, before and after RL
        before = next((r for r in rows if r.get("step") == -1), {})
        lines += evaluation.shape_lines(before, after)
        lines.append(f"peak resident memory of the trainer: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    lines += evaluation.benchmark_lines(after, temperature=cfg.rollout.temperature)
    if not after["eval/tasks"]:
        lines.append(f"evaluation: none ({nothing_reason(cfg)})")
    return ([fidelity] if fidelity else []) + lines + ([budget] if budget else [])
