"""Held-out results before and after RL: the paired change over instances, and the run's closing lines.

The trainer evaluates the same held-out instances with the same sampling seeds before and after RL, greedily and
(with `eval.attempts` = k > 0) k times each at the rollout temperature, and saves every episode
(`trajectories/eval_{tag}_family[_sampled]`). The change is paired per instance: the mean over instances of
(success rate after - success rate before), each instance's rate over its samples, with a 95% bootstrap interval
that resamples instances (`rollout.report.paired_change`, also what `python -m rollout.report DIR --baseline DIR`
prints). Greedy reads the policy's mode; the sampled rate is what RL optimises. An episode the infrastructure ended
on every try is no verdict on either policy: it is left out and counted (`{kind}_unscored`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
import statistics

from rollout.agent import PROBE_TURNS
from rollout.report import load_samples, paired_change, scored

KINDS = ("greedy", "sampled")
"""The two held-out evaluations of the family instances: their trajectory directories end "" and "_sampled"."""


def eval_dir(run_dir: Path, tag: str, kind: str) -> Path:
    """Where the trainer saves the held-out family episodes of evaluation `tag` ("before", "after", ...)."""
    if kind not in KINDS:
        raise ValueError(f"expected kind in {KINDS}, got {kind!r}")
    return run_dir / "trajectories" / f"eval_{tag}_family{'' if kind == 'greedy' else '_sampled'}"


def change_metrics(run_dir: Path, tag: str) -> dict[str, float]:
    """`heldout_change/{kind}*` for each kind evaluated both before RL and at `tag`: success before and at tag
    (mean over instances), the paired change with its 95% bootstrap interval, instances up and down, and the
    verifier fraction before and at tag. Empty for a kind not evaluated both times."""
    out: dict[str, float] = {}
    for kind in KINDS:
        before_dir, now_dir = eval_dir(run_dir, "before", kind), eval_dir(run_dir, tag, kind)
        if not (before_dir.is_dir() and now_dir.is_dir()):
            continue
        before, now = load_samples(before_dir), load_samples(now_dir)
        c = paired_change(now, before)
        p = f"heldout_change/{kind}"
        out.update({f"{p}_before": c["baseline_rate"], f"{p}_after": c["rate"], p: c["change"],
                    f"{p}_lo": c["ci_low"], f"{p}_hi": c["ci_high"], f"{p}_up": float(c["up"]),
                    f"{p}_down": float(c["down"]), f"{p}_instances": float(c["tasks"]),
                    f"{p}_samples": len(now) / c["tasks"],
                    f"{p}_verifier_before": _verifier_frac(before), f"{p}_verifier_after": _verifier_frac(now),
                    f"{p}_unscored": float(c["unscored"])})
    return out


def _verifier_frac(samples: list[Any]) -> float:
    ss = scored(samples)
    return sum(s.verifier_frac for s in ss) / len(ss)
    return out


def summary_lines(row: Mapping[str, Any], *, temperature: float) -> list[str]:
    """The run's closing lines from the row of the evaluation after RL (the keys of `change_metrics`)."""
    lines = []
    for kind in KINDS:
        p = f"heldout_change/{kind}"
        if p not in row:
            continue
        n, k = int(row[f"{p}_instances"]), row[f"{p}_samples"]
        how = "greedy" if kind == "greedy" else f"sampled (mean of {k:.0f} at T={temperature:g})"
        lines.append(f"held-out success, {how}: {row[f'{p}_before']:.3f} -> {row[f'{p}_after']:.3f}, change "
                     f"{row[p]:+.3f}, 95% bootstrap [{row[f'{p}_lo']:+.3f}, {row[f'{p}_hi']:+.3f}] over {n} "
                     f"instances ({row[f'{p}_up']:.0f} up, {row[f'{p}_down']:.0f} down); verifier fraction "
                     f"{row[f'{p}_verifier_before']:.3f} -> {row[f'{p}_verifier_after']:.3f}"
                     + (f"; {row[f'{p}_unscored']:.0f} episodes unscored (the infrastructure failed on every try)"
                        if row.get(f"{p}_unscored") else ""))
    return lines


def episode_shape(prefix: str, trajs: list[Any]) -> dict[str, float]:
    """How long an evaluation's episodes were: real sandbox commands per episode (median, max), contexts per episode
    (fewest, mean: a compacted episode has several), the share of prompt tokens served from the engine's prefix cache
    and the median wall time of turns 10, 100 and 300 where reached."""
    if not trajs:
        return {}
    commands = sorted(t.metrics.get("commands", 0) for t in trajs)
    segments = [len(t.segments()) for t in trajs]
    out = {f"{prefix}_commands_median": float(statistics.median(commands)), f"{prefix}_commands_max": float(commands[-1]),
           f"{prefix}_segments_min": float(min(segments)), f"{prefix}_segments_mean": sum(segments) / len(segments)}
    cached = sum(t.metrics.get("cached_prompt_tokens", 0) for t in trajs)
    prompts = cached + sum(t.metrics.get("prefilled_prompt_tokens", 0) for t in trajs)
    if prompts:  # prompt tokens the engine served from its prefix cache
        out[f"{prefix}_prefix_cached_frac"] = cached / prompts
    for n in PROBE_TURNS:
        times = [t.metrics[f"turn{n}_s"] for t in trajs if f"turn{n}_s" in t.metrics]
        if times:
            out[f"{prefix}_turn{n}_s"] = statistics.median(times)
    return out


def shape_lines(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Closing lines on the held-out episodes' length before and after RL (the keys of `episode_shape`)."""
    lines = []
    for kind, name in (("greedy", "family"), ("sampled", "family_sampled")):
        p = f"heldout/{name}"
        for tag, row in (("before", before), ("after", after)):
            if f"{p}_commands_median" not in row:
                continue
            turns = ", ".join(f"turn {n} {row[f'{p}_turn{n}_s']:.2f} s" for n in PROBE_TURNS if f"{p}_turn{n}_s" in row)
            lines.append(f"held-out episodes, {kind}, {tag} RL: real sandbox commands per episode median "
                         f"{row[f'{p}_commands_median']:.0f}, max {row[f'{p}_commands_max']:.0f}; contexts per episode "
                         f"at least {row[f'{p}_segments_min']:.0f} (mean {row[f'{p}_segments_mean']:.1f}); TITO drift "
                         f"{row.get(f'{p}_drift_tokens', 0):.0f} tokens" + (f"; median {turns}" if turns else "")
                         + (f"; prompt tokens from the prefix cache {row[f'{p}_prefix_cached_frac']:.1%}"
                            if f"{p}_prefix_cached_frac" in row else ""))
    return lines
