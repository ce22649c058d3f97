"""Evaluation on benchmark directories (eval.source): resolved rates before, during and after RL.

Each directory of eval.source is a benchmark, named after the directory. At every evaluation (before RL, every
eval.every steps, after RL) each of its tasks gets one greedy attempt (temperature `GREEDY`) and eval.attempts
attempts at rollout.temperature, with the same sampling seeds every time, at the rollout concurrency, each cut
at its own task's agent timeout. A task is resolved by an attempt when all its verifiers pass; the benchmark's
resolved rate is the mean of the task rates with a 95% bootstrap interval over tasks (rollout.scorecard), and
after RL the paired change per task from the evaluation before RL (rollout.report.paired_change). An attempt the
infrastructure ended on every try is recorded with `"infra": true` and left out of both (`_unscored` counts it).

Files: run_dir/eval/{tag}/{benchmark}_{kind}.jsonl (one record per attempt) and .tsv (the per-task table), the
episodes in run_dir/trajectories/eval_{tag}_{benchmark}_{kind}; metrics `eval/{benchmark}/{kind}_*`. The built-in
held-out split ('builtin') keeps its own path (t1core.heldout).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout import scorecard
from rollout.report import paired_change
from rollout.trajectory import Trajectory, save_trajectories
from sandbox.tasks.overlap import check_disjoint
from sandbox.tasks.format import Task, load_task_dirs
from t1core.config import RunConfig

BUILTIN = "builtin"
"""The eval.source item naming the built-in suite's held-out split."""
KINDS = ("greedy", "sampled")
GREEDY = 0.0
"""Sampling temperature of every evaluation's first attempt per task: greedy decoding, pass@1 (the `greedy` kind)."""


def load_benchmarks(cfg: RunConfig, train: list[Task]) -> tuple[dict[str, list[Task]], list[Task]]:
    """eval.source's directories by name (a repeated directory name gets '-2', '-3'), and the training tasks `train`
    to keep: ValueError when a task name repeats across the directories; training tasks that overlap one of them
    (sandbox.tasks.overlap) refuse the run, warn or are dropped, by tasks.decontaminate."""
    out: dict[str, list[Task]] = {}
    for source in cfg.eval.source:
        if source == BUILTIN:
            continue
        base = name = Path(source).resolve().name
        copies = 1
        while name in out:
            copies += 1
            name = f"{base}-{copies}"
        out[name] = load_task_dirs(source)
        train = check_disjoint(train, out[name], train_what=f"tasks.source={cfg.tasks.source!r}",
                               held_out_what=f"eval.source {source!r}", policy=cfg.tasks.decontaminate)
    names = [t.name for ts in out.values() for t in ts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"eval.source: task names {repeated[:3]} appear in more than one directory")
    return out, train


def nothing_reason(cfg: RunConfig) -> str:
    """Why a run evaluates nothing (printed instead of empty lines)."""
    if not cfg.eval.source:
        return "eval.source is empty"
    if cfg.tasks.source != BUILTIN and cfg.eval.source == (BUILTIN,):
        return (f"eval.source='builtin' is the built-in suite's held-out split, and tasks.source={cfg.tasks.source!r} "
                "is a directory: pass --eval.source=DIR (a benchmark the run does not train on)")
    return "the held-out split is empty (tasks.num_heldout_per_family=0 and no held-out fixed task)"


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


def closing_lines(row: Mapping[str, Any], *, temperature: float) -> list[str]:
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
