"""A benchmark's scorecard: one record per attempt, a per-task table, and the resolved rate with its interval.

A task is resolved by an attempt when every one of its verifiers passes (and it has at least one). Its rate is
resolved attempts / attempts, and the benchmark's resolved rate is the mean of the task rates (pass@1 averaged
over the attempts: every task weighs the same whatever its number of attempts), with a 95% bootstrap interval
that resamples tasks. Shared by `python -m rollout.evaluate` and the trainer's evaluation, so both report alike.
An attempt the infrastructure ended on every try (`"infra": true`) is no verdict on the policy: the table and the
rate leave it out, and `summarize` counts it as unscored (`rollout.report`'s rule).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollout.report import Sample, bootstrap_interval
from rollout.trajectory import Trajectory, is_infra

COLUMNS = ("task", "attempts", "resolved", "rate", "tests_passed", "tests_total", "turns", "tokens", "time_s", "why")
"""The per-task table's columns (tests, turns, tokens and time are means over the task's attempts)."""


def attempt_record(traj: Trajectory, *, attempt: int) -> dict[str, Any]:
    """The JSON record of one attempt at a task."""
    v = traj.verifier or {}
    resolved = bool(v.get("outcome"))
    return {"task": traj.task_name, "attempt": attempt, "resolved": resolved, "passed": int(v.get("passed", 0)),
            "total": int(v.get("total", 0)), "turns": len(traj.turns), "tokens": traj.num_tokens,
            "time_s": round(float(traj.metrics.get("wall_s", 0.0)), 3), "finish": traj.finish_reason,
            "why": "" if resolved else why_failed(traj), "infra": is_infra(traj.finish_reason)}


def scored(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that are a verdict on the policy: the infrastructure's failures left out (records written
    before the "infra" field had none)."""
    return [r for r in records if not r.get("infra")]


def why_failed(traj: Trajectory) -> str:
    """A short reason an unresolved attempt failed: the sandbox, the verifier run, or which tests failed and how
    the agent stopped (done, max_turns, token_budget, wall_clock)."""
    v, finish = traj.verifier, traj.finish_reason
    if finish.startswith("sandbox_error") or is_infra(finish):
        return finish[:160]
    if v is None:
        return f"not verified (agent: {finish})"
    if v.get("error"):
        return f"verifier: {str(v['error'])[:120]}"
    if v.get("timed_out"):
        return f"verifier timed out (agent: {finish})"
    if not v.get("total"):
        return f"no tests found (agent: {finish})"
    failed = [name for name, ok in (v.get("per_test") or {}).items() if not ok]
    names = ", ".join(failed[:2]) + (", ..." if len(failed) > 2 else "")
    return f"{v['total'] - v['passed']}/{v['total']} tests failed ({names}); agent: {finish}"


def _by_task(records: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    tasks: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        tasks.setdefault(r["task"], []).append(r)
    return tasks


def task_table(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per task (by name) with the `COLUMNS`; `why` is the commonest reason among its failed attempts."""
    rows = []
    for task, rs in sorted(_by_task(scored(records)).items()):
        n = len(rs)
        reasons = Counter(r["why"] for r in rs if not r["resolved"])
        rows.append({"task": task, "attempts": n, "resolved": sum(r["resolved"] for r in rs),
                     "rate": sum(r["resolved"] for r in rs) / n,
                     "tests_passed": sum(r["passed"] for r in rs) / n, "tests_total": sum(r["total"] for r in rs) / n,
                     "turns": sum(r["turns"] for r in rs) / n, "tokens": sum(r["tokens"] for r in rs) / n,
                     "time_s": sum(r["time_s"] for r in rs) / n,
                     "why": reasons.most_common(1)[0][0] if reasons else ""})
    return rows


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """tasks, attempts (fewest of any task), resolved_rate with ci_low / ci_high (95% bootstrap over tasks), and
    verifier_frac (mean over tasks of the passed fraction of their tests), over the scored attempts; unscored: the
    attempts the infrastructure ended (left out)."""
    records = list(records)
    kept = scored(records)
    tasks = _by_task(kept)
    if not tasks:
        raise ValueError("summarize: no attempts" if not records else
                         f"summarize: no scored attempt (the infrastructure ended all {len(records)})")
    rates = [sum(r["resolved"] for r in rs) / len(rs) for rs in tasks.values()]
    fracs = [sum(r["passed"] / r["total"] if r["total"] else 0.0 for r in rs) / len(rs) for rs in tasks.values()]
    lo, hi = bootstrap_interval(rates)
    return {"tasks": float(len(tasks)), "attempts": float(min(len(rs) for rs in tasks.values())),
            "resolved_rate": sum(rates) / len(rates), "ci_low": lo, "ci_high": hi,
            "verifier_frac": sum(fracs) / len(fracs), "unscored": float(len(records) - len(kept))}


def samples(records: Iterable[dict[str, Any]]) -> list[Sample]:
    """The records as `rollout.report.Sample`s, for `paired_change`."""
    return [Sample(task=r["task"], solved=r["resolved"], verifier_frac=r["passed"] / r["total"] if r["total"] else 0.0,
                   infra=bool(r.get("infra"))) for r in records]


def format_table(rows: list[dict[str, Any]], *, sep: str | None = None) -> str:
    """The table as text: aligned columns for people, or `sep`-separated (e.g. a tab: a TSV file)."""
    def cell(key: str, value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) and key != "rate" else \
            f"{value:.2f}" if isinstance(value, float) else str(value)

    cells = [list(COLUMNS)] + [[cell(k, row[k]) for k in COLUMNS] for row in rows]
    if sep is not None:
        return "\n".join(sep.join(c.replace(sep, " ") for c in line) for line in cells) + "\n"
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in cells)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The attempt records of a JSON-lines file; a last line cut short by an interruption is dropped."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
    return out


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
