"""Check a task collection before training on it: does every task build, does its reference solution score
full, and does doing nothing score less?

    python -m sandbox.check_tasks DIR [--parallel N] [--json] [--sample K --seed S] [--trust-host-ca]
                                      [--network asked|harness] [--agent-processes kill|keep]
                                      [--pth-files tamper|allow] [--timeout-multiplier K]
                                      [--base-image PATTERN=IMAGE]

DIR holds task directories (Harbor or Terminal-Bench 1 layout), or is one. For each task, with at most N tasks
at a time: build its image, run its reference solution in a fresh sandbox and verify, then verify an untouched
sandbox (the do-nothing agent). Prints a table (task, builds, solution passed/total, nothing passed/total, the
reason for anything short) and the fractions, or with --json one object. Exit code 0 when every task was
checked (whatever the scores), 2 when DIR holds no task; 128+N when ended by signal N (containers and builds
of the run are removed first).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sandbox.images.base_image import tls_advice
from sandbox.images.docker_build import tls_failure
from sandbox.errors import SandboxError
from sandbox.cli import Parser
from sandbox.images.task_images import TaskImageError, build_task_image, default_base_image_overrides, parse_override
from sandbox.run_task import Harness, ScriptRun, run_task_report
from sandbox.runtime.signals import exit_on_signals
from sandbox.tasks.format import TaskFormatError, load_task, reference_solution
from sandbox.runtime.verify import VerifierResult

_REASON_CHARS = 400
# Warnings are process-wide; `check_tasks` routes each to the task its thread is checking (catch_warnings is not
# thread-safe, so it is entered once, around the whole pool).
_SINK = threading.local()


@dataclasses.dataclass(frozen=True)
class TaskCheck:
    """One row of the table."""

    task: str
    """Task directory name."""
    builds: bool
    """The task loaded and its image built."""
    build_s: float = 0.0
    """Wall time of loading and building (a cached image: about zero)."""
    solution: tuple[int, int] | None = None
    """(passed, total) of the reference solution; None when it did not run."""
    solution_exit: int | None = None
    """The solution script's exit status."""
    nothing: tuple[int, int] | None = None
    """(passed, total) of an untouched sandbox."""
    reason: str = ""
    """Why the row is short of: builds, solution full, nothing below full. Empty when it is not."""
    warnings: tuple[str, ...] = ()
    """What loading and building warned about (unknown keys, test dependencies not installed, ...)."""

    @property
    def solution_full(self) -> bool:
        return self.solution is not None and self.solution[1] > 0 and self.solution[0] == self.solution[1]


def find_tasks(root: Path) -> list[Path]:
    """Task directories: `root` itself when it is one, else its subdirectories with task.toml or task.yaml."""
    if (root / "task.toml").is_file() or (root / "task.yaml").is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    return sorted(d for d in root.iterdir() if (d / "task.toml").is_file() or (d / "task.yaml").is_file())


def check_task(path: Path, *, base_image_overrides: Mapping[str, str], run_id: str | None = None,
               harness: Harness = Harness()) -> TaskCheck:
    """Build, run the reference solution, run nothing (each as `harness` says); never raises for a task's own
    failure."""
    t0 = time.monotonic()
    _SINK.messages = caught = []
    try:
        task = load_task(path)  # run_task_report scales its limits as `harness` says; here only the build's
        build_task_image(harness.apply(task), base_image_overrides=base_image_overrides)
    except (TaskFormatError, TaskImageError, SandboxError, OSError, ValueError) as e:
        return TaskCheck(task=path.name, builds=False, build_s=time.monotonic() - t0, reason=_short(str(e)),
                         warnings=_messages(caught))
    finally:
        _SINK.messages = None
    built_s = time.monotonic() - t0
    notes = _messages(caught)
    reasons = []
    sol: VerifierResult | None = None
    ran: ScriptRun | None = None
    try:
        script = reference_solution(task)
        if script is None:
            reasons.append("no reference solution")
        else:
            sol, ran = run_task_report(task, script=script, base_image_overrides=base_image_overrides,
                                       run_id=run_id, upload_solution=True, harness=harness)
        nothing, _ = run_task_report(task, base_image_overrides=base_image_overrides, run_id=run_id,
                                     harness=harness)
    except (TaskFormatError, TaskImageError, SandboxError, OSError, ValueError) as e:
        return TaskCheck(task=task.name, builds=True, build_s=built_s, reason=_short(f"run failed: {e}"),
                         warnings=notes, solution=_score(sol), solution_exit=ran.exit_code if ran else None)
    if sol is not None and not sol.outcome:
        reasons.append(_solution_reason(sol, ran))
    if nothing.outcome:
        reasons.append(f"doing nothing passes all {nothing.total}")
    return TaskCheck(task=task.name, builds=True, build_s=built_s, solution=_score(sol),
                     solution_exit=ran.exit_code if ran else None, nothing=_score(nothing),
                     reason=_short("; ".join(reasons)), warnings=notes)


def _solution_reason(result: VerifierResult, ran: ScriptRun | None) -> str:
    parts = []
    if ran is not None and (ran.exit_code != 0 or ran.timed_out):
        last = [line for line in ran.output.splitlines() if line.strip()][-2:]
        parts.append(f"solution exit {ran.exit_code}{' (timed out)' if ran.timed_out else ''}: "
                     + " / ".join(last))
        tls = tls_failure(ran.output)
        if tls is not None:  # the script fetched over HTTPS in its sandbox
            parts.append(tls_advice(tls, None))
    if result.error:
        parts.append(result.error)
    failed = [name for name, ok in result.per_test.items() if not ok]
    if failed:
        parts.append(f"failed: {', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}")
    return "; ".join(parts) or "solution short"


def _score(result: VerifierResult | None) -> tuple[int, int] | None:
    return None if result is None else (result.passed, result.total)


def _messages(caught: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_short(m) for m in caught))


def _route_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                   line: str | None = None) -> None:
    sink = getattr(_SINK, "messages", None)
    if sink is None:
        _SHOW_WARNING(message, category, filename, lineno, file, line)
    else:
        sink.append(str(message))


_SHOW_WARNING = warnings.showwarning


def _short(text: str) -> str:
    """One line; when long, its head and its tail (a build's real cause is usually its last words)."""
    text = " ".join(text.split())
    half = _REASON_CHARS // 2
    return text if len(text) <= _REASON_CHARS else f"{text[:half - 3]} ... {text[-half + 2:]}"


def check_tasks(paths: list[Path], *, base_image_overrides: Mapping[str, str], parallel: int = 2,
                run_id: str | None = None, harness: Harness = Harness(),
                on_row: Callable[[TaskCheck], None] | None = None) -> list[TaskCheck]:
    """`check_task` over `paths` with `parallel` tasks at a time, in the order of `paths`; `on_row` is called
    with each row as it finishes (a long run shows its failures as they come)."""

    def one(path: Path) -> TaskCheck:
        row = check_task(path, base_image_overrides=base_image_overrides, run_id=run_id, harness=harness)
        if on_row is not None:
            on_row(row)
        return row

    if parallel < 1:
        raise ValueError(f"parallel: expected >= 1, got {parallel}")
    pool = ThreadPoolExecutor(parallel)
    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)  # what loading and building warn about
        warnings.showwarning = _route_warning
        try:
            return list(pool.map(one, paths))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def summary(rows: list[TaskCheck]) -> dict[str, Any]:
    n = len(rows)
    return {"tasks": n, "builds": sum(r.builds for r in rows), "solution_full": sum(r.solution_full for r in rows),
            "nothing_full": sum(r.nothing is not None and r.nothing[0] == r.nothing[1] > 0 for r in rows)}


def _progress_line(row: TaskCheck, k: int, n: int) -> str:
    return (f"[{k}/{n}] {row.task}: builds={'yes' if row.builds else 'NO'} ({row.build_s:.0f} s) "
            f"solution={_frac(row.solution)} nothing={_frac(row.nothing)} {row.reason}")


def _frac(x: tuple[int, int] | None) -> str:
    return "-" if x is None else f"{x[0]}/{x[1]}"


def format_table(rows: list[TaskCheck]) -> str:
    width = max([len(r.task) for r in rows] + [4])
    lines = [f"{'task':<{width}}  builds  solution  nothing  reason"]
    for r in rows:
        build = f"{'yes' if r.builds else 'NO'} {r.build_s:4.0f}s"
        lines.append(f"{r.task:<{width}}  {build:<8}  {_frac(r.solution):>6}  {_frac(r.nothing):>7}  {r.reason}")
        lines += [f"{'':<{width}}  warning: {w}" for w in r.warnings]
    s = summary(rows)
    n = max(s["tasks"], 1)
    lines += ["", f"{s['tasks']} tasks: {s['builds']} build ({s['builds'] / n:.0%}), reference solution full on "
                  f"{s['solution_full']} ({s['solution_full'] / n:.0%}), doing nothing full on {s['nothing_full']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m sandbox.check_tasks", description=__doc__.split("\n\n")[0],
                    epilog="example: python -m sandbox.check_tasks /data/terminal-bench/tasks --parallel 4 --json")
    parser.add_argument("dir", type=Path, help="a directory of tasks (or one task)")
    parser.add_argument("--parallel", type=int, default=2, help="tasks checked at a time (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    Harness.add_arguments(parser)
    parser.add_argument("--sample", type=int, default=None, help="check a random sample of this many tasks")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample")
    parser.add_argument("--base-image", action="append", default=[], metavar="PATTERN=IMAGE",
                        help="map FROM images matching the glob PATTERN to a local IMAGE (repeatable)")
    parser.add_argument("--trust-host-ca", action="store_true",
                        help="map onto the base image that trusts this host's CA bundle (sandbox.images.base_image)")
    args = parser.parse_args(argv)
    if args.parallel < 1 or (args.sample is not None and args.sample < 1):
        parser.error(f"--parallel and --sample must be >= 1, got {args.parallel}, {args.sample}")
    harness = Harness.from_args(args, parser)
    exit_on_signals()
    try:
        paths = find_tasks(args.dir)
        if not paths:
            raise ValueError(f"{args.dir}: no task directories (with task.toml or task.yaml) in it")
        if args.sample is not None and args.sample < len(paths):
            paths = sorted(random.Random(args.seed).sample(paths, args.sample))
        overrides = dict(parse_override(spec) for spec in args.base_image)
        for pattern, image in default_base_image_overrides(trust_host_ca=args.trust_host_ca).items():
            overrides.setdefault(pattern, image)
        done = iter(range(1, len(paths) + 1))
        rows = check_tasks(paths, base_image_overrides=overrides, parallel=args.parallel, harness=harness,
                           on_row=lambda r: print(_progress_line(r, next(done), len(paths)), file=sys.stderr,
                                                  flush=True))
    except (ValueError, SandboxError, OSError) as e:
        if args.json:
            print(json.dumps({"error": str(e)}), flush=True)
        parser.error(str(e))
    if args.json:
        print(json.dumps({"summary": summary(rows), "tasks": [dataclasses.asdict(r) for r in rows]}))
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
