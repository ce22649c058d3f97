"""Score collected trajectories per task family: success rate, pass@k, and a paired comparison of two policies.

    python -m rollout.report DIR [--baseline DIR] [--json]

DIR is what `rollout.collect` (or the trainer) wrote: NNNNNN.json per episode. Episodes of one task are its
samples (`rollout.collect --episodes N` cycles through the tasks, so N = k * tasks gives k samples each). Per
family (the task name without its `-train-N` / `-heldout-N` suffix; fixed tasks are their own family):
instances, samples, solved samples (all verifiers passed), mean verifier fraction, and pass@k (instances with at
least one solved sample). Why pass@k next to the success rate: RL that sharpens a policy can at best lift its
success towards pass@k, so the gap between the two is the headroom an RL run has on that set.

With --baseline, tasks present in both directories are compared pairwise (same task names; with the same
`--seed` the two collections also share their sampling seeds): the change in success rate, how many instances
went up or down, and a 95% bootstrap interval over instances (10,000 resamples, fixed seed).

An episode the infrastructure ended on every try (finish_reason "infra: ...", `rollout.trajectory.is_infra`) says
nothing of the policy: it is unscored, left out of every rate (a task with no scored sample drops out of the table
and the pairing), and counted as `unscored`.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from rollout.trajectory import is_infra
from sandbox.cli import Parser

_SPLIT_SUFFIX = re.compile(r"-(train|heldout)-\d+$")
BOOTSTRAP_RESAMPLES = 10_000


@dataclass(frozen=True)
class Sample:
    task: str
    solved: bool
    verifier_frac: float
    infra: bool = False
    """The infrastructure ended it on every try: unscored (module docstring)."""


def scored(samples: list[Sample]) -> list[Sample]:
    """The samples that are a verdict on the policy (the infrastructure's failures left out)."""
    return [s for s in samples if not s.infra]


def family_of(task_name: str) -> str:
    """`create_file-heldout-3` -> `create_file`; names without a split suffix are their own family."""
    return _SPLIT_SUFFIX.sub("", task_name)


def load_samples(directory: str | Path) -> list[Sample]:
    """One `Sample` per episode JSON in `directory`; an episode without verifier results counts as unsolved."""
    paths = sorted(Path(directory).glob("[0-9]*.json"))
    if not paths:
        raise ValueError(f"no trajectories (NNNNNN.json) in {directory}")
    out = []
    for path in paths:
        try:
            meta = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(meta, dict) or "task_name" not in meta:
            raise ValueError(f"{path}: not a trajectory's metadata (no task_name)")
        v = meta.get("verifier") or {}
        total = v.get("total") or 0
        out.append(Sample(task=meta["task_name"], solved=bool(v.get("outcome")),  # VerifierResult.outcome
                          verifier_frac=(v.get("passed", 0) / total) if total else 0.0,
                          infra=is_infra(str(meta.get("finish_reason", "")))))
    return out


def by_task(samples: list[Sample]) -> dict[str, list[Sample]]:
    tasks: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        tasks[s.task].append(s)
    return dict(tasks)


def family_table(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Per family (and "total"): instances, samples, solved, success_rate, pass_at_k, verifier_frac, k_min over the
    scored samples, and unscored (the infrastructure's failures, left out)."""
    unscored = Counter(family_of(s.task) for s in samples if s.infra)
    all_tasks = by_task(scored(samples))
    if not all_tasks:
        raise ValueError(f"no scored episode: the infrastructure ended all {len(samples)} (finish_reason 'infra')")
    fams: dict[str, dict[str, list[Sample]]] = defaultdict(dict)
    for task, ss in all_tasks.items():
        fams[family_of(task)][task] = ss
    fams["total"] = all_tasks
    table = {}
    for fam, tasks in sorted(fams.items(), key=lambda kv: (kv[0] == "total", kv[0])):
        flat = [s for ss in tasks.values() for s in ss]
        table[fam] = {"instances": len(tasks), "samples": len(flat), "solved": sum(s.solved for s in flat),
                      "success_rate": sum(s.solved for s in flat) / len(flat),
                      "pass_at_k": sum(any(s.solved for s in ss) for ss in tasks.values()),
                      "verifier_frac": sum(s.verifier_frac for s in flat) / len(flat),
                      "k_min": min(len(ss) for ss in tasks.values()),
                      "unscored": sum(unscored.values()) if fam == "total" else unscored[fam]}
    return table


def paired_change(samples: list[Sample], baseline: list[Sample], *, seed: int = 0) -> dict[str, float]:
    """Success-rate change from `baseline` to `samples` over the tasks both hold, with a bootstrap 95% interval.

    Per task the rate is solved / samples; the change is the mean over tasks of (rate - baseline rate), so each
    task weighs the same whatever its sample count. The interval resamples tasks with replacement. Unscored
    samples are left out ("unscored" counts them on both sides); a task with none scored on a side is not compared.
    """
    new, old = by_task(scored(samples)), by_task(scored(baseline))
    common = sorted(set(new) & set(old))
    if not common:
        raise ValueError("no task in common between the two directories")

    def rate(ss: list[Sample]) -> float:
        return sum(s.solved for s in ss) / len(ss)

    diffs = [rate(new[t]) - rate(old[t]) for t in common]
    n = len(diffs)
    lo, hi = bootstrap_interval(diffs, seed=seed)
    return {"tasks": n, "baseline_rate": sum(rate(old[t]) for t in common) / n,
            "rate": sum(rate(new[t]) for t in common) / n, "change": sum(diffs) / n,
            "ci_low": lo, "ci_high": hi, "up": sum(d > 0 for d in diffs), "down": sum(d < 0 for d in diffs),
            "unscored": sum(s.infra for s in samples) + sum(s.infra for s in baseline)}


def bootstrap_interval(values: list[float], *, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of `values` (one per task: tasks are resampled with
    replacement, BOOTSTRAP_RESAMPLES times, from a fixed seed)."""
    if not values:
        raise ValueError("bootstrap_interval: no values")
    rng = random.Random(seed)
    n = len(values)
    boots = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(BOOTSTRAP_RESAMPLES))
    return boots[int(0.025 * BOOTSTRAP_RESAMPLES)], boots[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]


def _format_table(table: dict[str, dict[str, float]]) -> str:
    lines = [f"{'family':28s} {'inst':>5s} {'samples':>8s} {'solved':>7s} {'rate':>6s} {'pass@k':>7s} "
             f"{'verif':>6s}"]
    for fam, r in table.items():
        lines.append(f"{fam:28s} {r['instances']:5d} {r['samples']:8d} {r['solved']:7d} {r['success_rate']:6.3f} "
                     f"{r['pass_at_k']:7d} {r['verifier_frac']:6.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m rollout.report", description=__doc__.split("\n\n")[0],
               epilog="example: python -m rollout.report runs/exp1/heldout_final --baseline runs/exp1/heldout_warmstart")
    p.add_argument("directory", help="trajectories to score (NNNNNN.json files)")
    p.add_argument("--baseline", default=None, help="trajectories of the policy to compare against, same tasks")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    try:
        samples = load_samples(args.directory)
        report: dict[str, object] = {"families": family_table(samples)}
        if args.baseline is not None:
            report["paired"] = paired_change(samples, load_samples(args.baseline))
    except ValueError as e:
        p.error(str(e))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    total = report["families"]["total"]  # type: ignore[index]
    print(_format_table(report["families"]))  # type: ignore[arg-type]
    print(f"k = {total['k_min']} samples per task at least" + (
        f"; {total['unscored']} episodes unscored (the infrastructure ended them on every try)"
        if total["unscored"] else ""))
    if "paired" in report:
        c = report["paired"]
        print(f"vs baseline over {c['tasks']} tasks: success rate {c['baseline_rate']:.3f} -> {c['rate']:.3f} "
              f"({c['change']:+.3f}, 95% bootstrap [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]); "
              f"tasks up {c['up']}, down {c['down']}" + (f"; {c['unscored']} episodes unscored" if c["unscored"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
