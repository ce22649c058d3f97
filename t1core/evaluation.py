"""Evaluation, in one place: before RL, every eval.every steps and after RL, on the built-in held-out split and on
eval.source's benchmark directories, with the same tasks and sampling seeds each time. Every metric is under
`eval/`: `eval/builtin/*` for the built-in split, `eval/{benchmark}/*` for each benchmark, `eval/tasks`.

Built-in split ('builtin' in eval.source; its task sets: `t1core.tasks`). The held-out family instances are run
greedily (pass@1, temperature `GREEDY`) and, with eval.attempts = k > 0, k times each at rollout.temperature; the
held-out fixed tasks greedily. Metrics `eval/builtin/{family,fixed,family_sampled}_*`; episodes in
`trajectories/eval_{tag}_family[_sampled]` and `_fixed`. After RL the change is paired per instance: the mean over
instances of (success rate after - success rate before), with a 95% bootstrap interval that resamples instances
(`rollout.report.paired_change`, also what `python -m rollout.report DIR --baseline DIR` prints), as
`eval/builtin/{greedy,sampled}_change*`. Greedy reads the policy's mode; the sampled rate is what RL optimises.

Benchmarks (each directory of eval.source, named after it). Each task gets one greedy attempt and eval.attempts at
rollout.temperature, each cut at its own task's agent timeout. A task is resolved by an attempt when all its
verifiers pass; the benchmark's resolved rate is the mean of the task rates with a 95% bootstrap interval over
tasks (rollout.scorecard), and after RL the paired change per task from the evaluation before RL. Files:
run_dir/eval/{tag}/{benchmark}_{kind}.jsonl (one record per attempt) and .tsv (the per-task table), the episodes in
run_dir/trajectories/eval_{tag}_{benchmark}_{kind}; metrics `eval/{benchmark}/{kind}_*`.

An episode the infrastructure ended on every try is no verdict on either policy: it is left out of every rate and
counted (`*_unscored`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rollout import scorecard
from rollout.agent import PROBE_TURNS
from rollout.report import load_samples, paired_change, scored
from rollout.trajectory import Trajectory, save_trajectories
from sandbox.tasks.format import Task
from t1core.config import RunConfig
from t1core.context import RunContext
from t1core.step import Stream, seed_for, solved
from t1core.tasks import BUILTIN

KINDS = ("greedy", "sampled")
"""The greedy attempt and the sampled ones; the built-in family episodes of the sampled kind are saved under
`eval_{tag}_family_sampled`."""
GREEDY = 0.0
"""Sampling temperature of every evaluation's first attempt per task: greedy decoding, pass@1 (the `greedy` kind)."""
PREFIX = f"eval/{BUILTIN}"
"""The built-in held-out split's metrics."""

Collect = Callable[..., tuple[list[Trajectory], list[int]]]
"""`Trainer.collect(tasks, *, seed, desc, temperature, task_timeouts)`: one episode per task, on every rank."""


def evaluate(run: RunContext, collect: Collect, tag: str) -> dict[str, float]:
    """Held-out success: unseen seeds of the training families, and unseen fixed tasks, separately. The family
    instances are also sampled eval.attempts times each at the rollout temperature; after RL, both are
    compared with the evaluation before, instance by instance (`change_metrics`). Then eval.source's benchmark
    directories, each episode cut at its own task's agent timeout. Same tasks and sampling seeds at every
    evaluation."""
    cfg, tasks, run_dir, dp, clock = run.cfg, run.tasks, run.dir, run.dp, run.clock
    out: dict[str, float] = {}
    builtin: list[tuple[str, list[Task], int, float]] = [
        ("family", tasks.heldout_family, 1, GREEDY),
        ("fixed", tasks.heldout_fixed, 1, GREEDY)]
    if cfg.eval.attempts:
        builtin.append(("family_sampled", tasks.heldout_family, cfg.eval.attempts, cfg.rollout.temperature))
    for i, (name, chosen, k, temperature) in enumerate(builtin):
        if not chosen:
            continue
        # The greedy runs share their seed (as always); the sampled run has its own.
        seed = seed_for(cfg.run.seed, Stream.HELDOUT) if i < 2 else seed_for(cfg.run.seed, Stream.HELDOUT, i)
        with clock.phase("eval"):
            trajs, drift = collect([t for t in chosen for _ in range(k)], seed=seed, desc=f"eval {tag} {name}",
                                   temperature=temperature)
        if dp.is_main:
            save_trajectories(trajs, run_dir / "trajectories" / f"eval_{tag}_{name}")
        passed = [t.verifier["passed"] / t.verifier["total"] if t.verifier and t.verifier["total"] else 0.0
                  for t in trajs]
        num_solved = sum(map(solved, trajs))
        out[f"{PREFIX}/{name}_solved"] = float(num_solved)
        out[f"{PREFIX}/{name}_episodes"] = float(len(trajs))
        out[f"{PREFIX}/{name}_success"] = num_solved / len(trajs)
        out[f"{PREFIX}/{name}_verifier_frac"] = sum(passed) / len(trajs)
        out[f"{PREFIX}/{name}_drift_tokens"] = float(sum(drift))
        out.update(episode_shape(f"{PREFIX}/{name}", trajs))
    if tag != "before" and dp.is_main:
        out.update(change_metrics(run_dir, tag))
    for j, (name, bench) in enumerate(tasks.benchmarks.items()):
        for kind, episodes, temperature, index in runs(cfg, j, bench):
            with clock.phase("eval"):
                trajs, _ = collect(episodes, seed=seed_for(cfg.run.seed, Stream.HELDOUT, index),
                                   desc=f"eval {tag} {name} {kind}", temperature=temperature, task_timeouts=True)
            if dp.is_main:
                out.update(score(run_dir, tag, name, kind, trajs))
    out["eval/tasks"] = float(tasks.num_eval_tasks)
    return out


# ---- the built-in held-out split ----

def eval_dir(run_dir: Path, tag: str, kind: str) -> Path:
    """Where the trainer saves the held-out family episodes of evaluation `tag` ("before", "after", ...)."""
    if kind not in KINDS:
        raise ValueError(f"expected kind in {KINDS}, got {kind!r}")
    return run_dir / "trajectories" / f"eval_{tag}_family{'' if kind == 'greedy' else '_sampled'}"


def change_metrics(run_dir: Path, tag: str) -> dict[str, float]:
    """`eval/builtin/{kind}_change*` for each kind evaluated both before RL and at `tag`: success before and at tag
    (mean over instances), the paired change with its 95% bootstrap interval, instances up and down, and the
    verifier fraction before and at tag. Empty for a kind not evaluated both times."""
    out: dict[str, float] = {}
    for kind in KINDS:
        before_dir, now_dir = eval_dir(run_dir, "before", kind), eval_dir(run_dir, tag, kind)
        if not (before_dir.is_dir() and now_dir.is_dir()):
            continue
        before, now = load_samples(before_dir), load_samples(now_dir)
        c = paired_change(now, before)
        p = f"{PREFIX}/{kind}_change"
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


def builtin_lines(row: Mapping[str, Any], *, temperature: float) -> list[str]:
    """The run's closing lines from the row of the evaluation after RL (the keys of `change_metrics`)."""
    lines = []
    for kind in KINDS:
        p = f"{PREFIX}/{kind}_change"
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
    out = {f"{prefix}_commands_median": float(statistics.median(commands)),
           f"{prefix}_commands_max": float(commands[-1]),
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
        p = f"{PREFIX}/{name}"
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


# ---- benchmarks (eval.source's directories) ----

def runs(cfg: RunConfig, index: int, tasks: list[Task]) -> list[tuple[str, list[Task], float, int]]:
    """(kind, episodes, temperature, seed index) of benchmark `index`: one greedy attempt per task, then
    eval.attempts per task at rollout.temperature (none when 0). The seed indices are the benchmark's own."""
    out = [("greedy", list(tasks), GREEDY, 1000 + 2 * index)]
    if cfg.eval.attempts:
        out.append(("sampled", [t for t in tasks for _ in range(cfg.eval.attempts)], cfg.rollout.temperature,
                    1001 + 2 * index))
    return out


def _path(run_dir: Path, tag: str, name: str, kind: str) -> Path:
    return run_dir / "eval" / tag / f"{name}_{kind}.jsonl"


def score(run_dir: Path, tag: str, name: str, kind: str, trajs: list[Trajectory]) -> dict[str, float]:
    """Write the attempts' records and table; the metrics of this evaluation, with the paired change from the
    evaluation before RL when `tag` is a later one."""
    seen: dict[str, int] = {}
    records = []
    for t in trajs:
        records.append(scorecard.attempt_record(t, attempt=seen.get(t.task_name, 0)))
        seen[t.task_name] = seen.get(t.task_name, 0) + 1
    save_trajectories(trajs, run_dir / "trajectories" / f"eval_{tag}_{name}_{kind}")  # rollout.report reads these
    path = _path(run_dir, tag, name, kind)
    scorecard.write_records(path, records)
    path.with_suffix(".tsv").write_text(scorecard.format_table(scorecard.task_table(records), sep="\t"))
    s, p = scorecard.summarize(records), f"eval/{name}/{kind}"
    out = {f"{p}_resolved": s["resolved_rate"], f"{p}_resolved_lo": s["ci_low"], f"{p}_resolved_hi": s["ci_high"],
           f"{p}_verifier_frac": s["verifier_frac"], f"{p}_tasks": s["tasks"], f"{p}_attempts": s["attempts"],
           f"{p}_unscored": s["unscored"]}
    before_path = _path(run_dir, "before", name, kind)
    if tag != "before" and before_path.is_file():
        before = scorecard.read_records(before_path)
        b, c = scorecard.summarize(before), paired_change(scorecard.samples(records), scorecard.samples(before))
        out.update({f"{p}_before": b["resolved_rate"], f"{p}_before_lo": b["ci_low"], f"{p}_before_hi": b["ci_high"],
                    f"{p}_verifier_before": b["verifier_frac"], f"{p}_change": c["change"],
                    f"{p}_change_lo": c["ci_low"], f"{p}_change_hi": c["ci_high"], f"{p}_up": float(c["up"]),
                    f"{p}_down": float(c["down"])})
    return out


def benchmark_keys(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(benchmark, kind) pairs a metrics row holds, in order."""
    return sorted({(k.split("/")[1], kind) for k in row if k.startswith("eval/") and k.count("/") == 2
                   for kind in KINDS if k.endswith(f"/{kind}_resolved")})


def benchmark_lines(row: Mapping[str, Any], *, temperature: float) -> list[str]:
    """The run's closing lines for the benchmarks, from the row of the evaluation after RL."""
    lines = []
    for name, kind in benchmark_keys(row):
        p = f"eval/{name}/{kind}"
        how = "greedy" if kind == "greedy" else f"sampled ({row[f'{p}_attempts']:.0f} attempts at T={temperature:g})"
        after = f"{row[f'{p}_resolved']:.3f} [{row[f'{p}_resolved_lo']:.3f}, {row[f'{p}_resolved_hi']:.3f}]"
        head = f"{name} resolved, {how}, over {row[f'{p}_tasks']:.0f} tasks" + (
            f" ({row[f'{p}_unscored']:.0f} attempts unscored: the infrastructure failed on every try): "
            if row.get(f"{p}_unscored") else ": ")
        if f"{p}_change" not in row:
            lines.append(head + f"{after} (95% bootstrap); no evaluation before RL to compare with")
            continue
        lines.append(head + f"{row[f'{p}_before']:.3f} [{row[f'{p}_before_lo']:.3f}, {row[f'{p}_before_hi']:.3f}] -> "
                     f"{after}, change {row[f'{p}_change']:+.3f} [{row[f'{p}_change_lo']:+.3f}, "
                     f"{row[f'{p}_change_hi']:+.3f}] (95% bootstrap; {row[f'{p}_up']:.0f} up, {row[f'{p}_down']:.0f} "
                     f"down); verifier fraction {row[f'{p}_verifier_before']:.3f} -> {row[f'{p}_verifier_frac']:.3f}")
    return lines
