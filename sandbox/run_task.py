"""Run one task end to end: build its image, start a sandbox, act, verify.

    python -m sandbox.run_task TASK_DIR [--solution | --script FILE | --shell] [--base-image PATTERN=IMAGE] [--json]

`--solution` runs the task's reference solution, `--script FILE` a given bash script, `--shell` opens an
interactive shell in the sandbox (needs the docker CLI; verification runs when it exits); with none of them
the untouched environment is verified (the do-nothing baseline). `--base-image` (repeatable) maps FROM
images by glob onto local images, before the defaults (debian:*, ubuntu:*, python:* -> the sandbox base).
Prints a table of verifiers, or with `--json` one JSON object. Exit code 0 when the run completed, whatever
the score; 2 with a message when it could not run.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from sandbox.docker_sandbox import DockerSandbox
from sandbox.errors import SandboxError
from sandbox.images import TaskImageError, build_task_image, default_base_image_overrides, parse_override
from sandbox.tasks import Task, TaskFormatError, load_task
from sandbox.verify import VerifierResult, run_verifiers


def run_task(task: Task, *, script: str | None = None, base_image_overrides: Mapping[str, str] | None = None,
             run_id: str | None = None, interactive: bool = False) -> VerifierResult:
    """Build `task`'s image, run `script` (bash text; None: do nothing) in a fresh sandbox, then verify.

    `interactive=True` opens `docker exec -it ... bash` for a person instead of running a script.
    The sandbox is removed before returning.
    """
    overrides = default_base_image_overrides() if base_image_overrides is None else base_image_overrides
    image = build_task_image(task, base_image_overrides=overrides)
    with DockerSandbox(image, cpus=task.cpus, memory=task.memory_mb << 20, network=task.network,
                       workdir=task.workdir, run_id=run_id) as sb:
        if interactive:
            subprocess.run(["docker", "exec", "-it", "-w", task.workdir, sb.id, "bash"], check=False)
        elif script is not None:
            run_script(sb, script, timeout_s=task.agent_timeout_s)
        return run_verifiers(sb, task)


def run_script(sb: DockerSandbox, script: str, *, timeout_s: float) -> int:
    """Run bash `script` as a file (so `set -e` and heredocs behave as in solve.sh) and delete it after."""
    path = f"/tmp/t1-script-{secrets.token_hex(8)}.sh"
    sb.write_file(path, script.encode(), mode=0o700)
    result = sb.run(f"bash {path}; __t1_rc=$?; rm -f {path}; (exit $__t1_rc)", timeout=timeout_s)
    return result.exit_code


def format_table(task: Task, result: VerifierResult) -> str:
    lines = [f"task {task.name} ({task.layout}, {task.verifier_kind})", ""]
    lines += [f"  {'PASS' if ok else 'FAIL'}  {name}" for name, ok in result.per_test.items()]
    lines += ["", f"passed {result.passed}/{result.total}  outcome={'resolved' if result.outcome else 'unresolved'}"
              f"  timed_out={result.timed_out}  verify {result.duration_s:.1f} s"]
    if result.error:
        lines.append(f"error: {result.error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.run_task", description=__doc__.split("\n\n")[0])
    parser.add_argument("task_dir", type=Path)
    act = parser.add_mutually_exclusive_group()
    act.add_argument("--solution", action="store_true", help="run the task's reference solution")
    act.add_argument("--script", type=Path, help="run this bash script in the sandbox")
    act.add_argument("--shell", action="store_true", help="open an interactive shell in the sandbox")
    parser.add_argument("--base-image", action="append", default=[], metavar="PATTERN=IMAGE",
                        help="map FROM images matching the glob PATTERN to a local IMAGE (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    try:
        task = load_task(args.task_dir)
        overrides = dict(parse_override(spec) for spec in args.base_image)
        for pattern, image in default_base_image_overrides().items():
            overrides.setdefault(pattern, image)
        script = None
        if args.solution:
            if task.solution_script is None:
                raise ValueError(f"{task.path}: the task has no reference solution")
            script = task.solution_script.read_text()
        elif args.script is not None:
            script = args.script.read_text()
        result = run_task(task, script=script, base_image_overrides=overrides, interactive=args.shell)
    except (TaskFormatError, TaskImageError, SandboxError, ValueError, OSError) as e:
        print(f"run_task: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"task": task.name, **result.to_json()}) if args.json else format_table(task, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
