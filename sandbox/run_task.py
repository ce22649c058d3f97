"""Run one task end to end: build its image, start a sandbox, act, verify.

    python -m sandbox.run_task TASK_DIR [--solution | --script FILE | --shell] [--base-image PATTERN=IMAGE]
                               [--trust-host-ca] [--network asked|harness] [--agent-processes kill|keep]
                               [--pth-files tamper|allow] [--timeout-multiplier K] [--json]

`--solution` runs the task's reference solution (Harbor: solution/ is uploaded to /solution and solve.sh runs
from there; TB1: solution.sh, or the commands of solution.yaml), `--script FILE` a given bash script, `--shell`
opens an interactive shell in the sandbox (needs the docker CLI; verification runs when it exits); with none
of them the untouched environment is verified (the do-nothing baseline). `--base-image` (repeatable) maps FROM
images by glob onto local images, before the defaults (debian:*, ubuntu:*, python:* and Terminal-Bench's own
base images -> the sandbox base). `--trust-host-ca` uses the base image that trusts this host's CA bundle.
Prints a table of verifiers, or with `--json` one JSON object (also when the run fails: then with "error").
Exit code 0 when the run completed, whatever the score; 2 with a message when it could not run; 128+N when
ended by signal N (its container and builds are removed first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandbox.images.base_image import tls_advice
from sandbox.cli import Parser
from sandbox.images.docker_build import tls_failure
from sandbox.runtime.docker_sandbox import CommandResult, DockerSandbox
from sandbox.errors import SandboxError
from sandbox.runtime.settings import SandboxSettings
from sandbox.images.task_images import TaskImageError, build_task_image, default_base_image_overrides, parse_override
from sandbox.runtime.signals import exit_on_signals
from sandbox.tasks.format import (NETWORK_MODES, NetworkMode, Task, TaskFormatError, load_task, reference_solution,
                           sandbox_network)
from sandbox.runtime.verify import AGENT_PROCESSES, PTH_FILES, VerifierResult, run_verifiers

SOLUTION_DIR = "/solution"  # where Harbor puts a task's solution/ folder


@dataclasses.dataclass(frozen=True)
class Harness:
    """Where a run follows the task's own harness (Terminal-Bench's, Harbor's) instead of T1's stricter defaults.
    The trainer always runs with the defaults; these are for checking and evaluating tasks."""

    network: NetworkMode = "asked"
    """'asked': a network only when the task asks; 'harness': as its harness gives it (`sandbox_network`)."""
    agent_processes: str = "kill"
    """'kill': every process the agent left dies before the tests; 'keep': they run through them, as the harnesses
    leave them (`sandbox.runtime.verify.run_verifiers`: for trusted agents only)."""
    pth_files: str = "tamper"
    """'tamper': a new or changed .pth in site-packages counts as tampering; 'allow': it does not, as in the
    harnesses, which have no tamper check (`sandbox.runtime.verify.run_verifiers`: for trusted agents only)."""
    timeout_multiplier: float = 1.0
    """Scales the task's build, agent and verifier time limits, as Harbor's `timeout_multiplier` does: on a slow or
    loaded machine a task's limits, set on the author's, cut runs that would finish."""

    def __post_init__(self) -> None:
        if self.network not in NETWORK_MODES:
            raise ValueError(f"network: expected one of {NETWORK_MODES}, got {self.network!r}")
        if self.agent_processes not in AGENT_PROCESSES:
            raise ValueError(f"agent_processes: expected one of {AGENT_PROCESSES}, got {self.agent_processes!r}")
        if self.pth_files not in PTH_FILES:
            raise ValueError(f"pth_files: expected one of {PTH_FILES}, got {self.pth_files!r}")
        if not (self.timeout_multiplier > 0 and math.isfinite(self.timeout_multiplier)):
            raise ValueError(f"timeout_multiplier: expected a finite number > 0, got {self.timeout_multiplier}")

    def apply(self, task: Task) -> Task:
        """`task` with its time limits scaled."""
        k = self.timeout_multiplier
        if k == 1.0:
            return task
        return dataclasses.replace(task, agent_timeout_s=task.agent_timeout_s * k,
                                   verifier_timeout_s=task.verifier_timeout_s * k,
                                   build_timeout_s=task.build_timeout_s * k)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--network", choices=NETWORK_MODES, default="asked",
                            help="asked (default): a network only when the task asks; harness: as the task's own "
                                 "harness gives it (TB1 always, Harbor unless allow_internet = false)")
        parser.add_argument("--agent-processes", choices=AGENT_PROCESSES, default="kill",
                            help="kill (default): every process the agent (here the solution) left dies before the "
                                 "tests; keep: they run through the tests, as Terminal-Bench's and Harbor's harnesses "
                                 "leave them (servers the tests talk to); for trusted agents only "
                                 "(sandbox.runtime.verify)")
        parser.add_argument("--pth-files", choices=PTH_FILES, default="tamper",
                            help="tamper (default): a .pth file the agent adds or changes in site-packages counts as "
                                 "tampering (its import lines run in the verifier's interpreter); allow: it does not, "
                                 "for solutions whose package installs add one; for trusted agents only")
        parser.add_argument("--timeout-multiplier", type=float, default=1.0, metavar="K",
                            help="scale every task's build, agent and verifier time limits by K (> 0; as Harbor's "
                                 "timeout_multiplier), for machines slower than the task author's")

    @classmethod
    def from_args(cls, args: argparse.Namespace, parser: argparse.ArgumentParser) -> Harness:
        """The value `add_arguments` parsed; a bad one ends the CLI through `parser.error` (one line, exit 2)."""
        try:
            return cls(network=args.network, agent_processes=args.agent_processes,
                       pth_files=args.pth_files, timeout_multiplier=args.timeout_multiplier)
        except ValueError as e:
            parser.error(str(e))


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    """What the acting script did (a broken solution then reads differently from a wrong one)."""

    exit_code: int
    """Its exit status; 124 when cut at the task's agent timeout."""
    output: str
    """Its output, capped by the sandbox (head and tail)."""
    timed_out: bool
    """It ran into the agent timeout."""
    duration_s: float
    """Wall time."""


def run_task(task: Task, *, script: str | None = None, base_image_overrides: Mapping[str, str] | None = None,
             run_id: str | None = None, interactive: bool = False, upload_solution: bool = False) -> VerifierResult:
    """Build `task`'s image, run `script` (bash text; None: do nothing) in a fresh sandbox, then verify.

    `interactive=True` opens `docker exec -it ... bash` for a person instead of running a script;
    `upload_solution=True` places the task's solution/ folder at /solution first. The sandbox is removed
    before returning."""
    return run_task_report(task, script=script, base_image_overrides=base_image_overrides, run_id=run_id,
                           interactive=interactive, upload_solution=upload_solution)[0]


def run_task_report(task: Task, *, script: str | None = None, base_image_overrides: Mapping[str, str] | None = None,
                    run_id: str | None = None, interactive: bool = False,
                    upload_solution: bool = False,
                    harness: Harness = Harness()) -> tuple[VerifierResult, ScriptRun | None]:
    """`run_task`, also returning what the script did (None when no script ran), as `harness` says."""
    task = harness.apply(task)
    overrides = default_base_image_overrides() if base_image_overrides is None else base_image_overrides
    image = build_task_image(task, base_image_overrides=overrides)
    ran = None
    with DockerSandbox(image, SandboxSettings.for_task(task, network=sandbox_network(task, harness.network)),
                       run_id=run_id) as sb:
        if upload_solution and task.solution_dir is not None:
            sb.upload_dir(task.solution_dir, SOLUTION_DIR)
        if interactive:
            _interactive_shell(sb, task.workdir)
        elif script is not None:
            t0 = time.monotonic()
            solution = upload_solution and task.solution_dir is not None
            r = run_script_result(sb, script, timeout_s=task.agent_timeout_s,
                                  path=f"{SOLUTION_DIR}/solve.sh" if solution else None,
                                  env=dict(task.solution_env) if solution else None)
            ran = ScriptRun(exit_code=r.exit_code, output=r.output, timed_out=r.timed_out,
                            duration_s=time.monotonic() - t0)
        return run_verifiers(sb, task, agent_processes=harness.agent_processes, pth_files=harness.pth_files), ran


def _interactive_shell(sb: DockerSandbox, workdir: str) -> None:
    """`docker exec -it ... bash` for a person. Ctrl-C there reaches this process too (one terminal, one
    foreground group): it is ignored here meanwhile, or it would remove the sandbox under the person's feet."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        subprocess.run(["docker", "exec", "-it", "-w", workdir, sb.id, "bash"], check=False)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def run_script(sb: DockerSandbox, script: str, *, timeout_s: float) -> int:
    """Run bash `script` as a file (so `set -e` and heredocs behave as in solve.sh) and delete it after."""
    return run_script_result(sb, script, timeout_s=timeout_s).exit_code


def run_script_result(sb: DockerSandbox, script: str, *, timeout_s: float, path: str | None = None,
                      env: dict[str, str] | None = None) -> CommandResult:
    """`run_script` returning the CommandResult. `path`: run that file (already in the sandbox) instead of
    writing `script` to a temporary one; `env`: extra environment of that run."""
    if path is not None:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items() if k.isidentifier())
        return sb.run(f"{prefix}bash {path}", timeout=timeout_s)
    tmp = f"/tmp/t1-script-{secrets.token_hex(8)}.sh"
    sb.write_file(tmp, script.encode(), mode=0o700)
    return sb.run(f"bash {tmp}; __t1_rc=$?; rm -f {tmp}; (exit $__t1_rc)", timeout=timeout_s)


def format_table(task: Task, result: VerifierResult, ran: ScriptRun | None = None) -> str:
    lines = [f"task {task.name} ({task.layout}, {task.verifier_kind})", ""]
    if ran is not None:
        lines += [f"script: exit {ran.exit_code}{' (timed out)' if ran.timed_out else ''} in {ran.duration_s:.1f} s",
                  ""]
    lines += [f"  {'PASS' if ok else 'FAIL'}  {name}" for name, ok in result.per_test.items()]
    lines += ["", f"passed {result.passed}/{result.total}  outcome={'resolved' if result.outcome else 'unresolved'}"
              f"  timed_out={result.timed_out}  verify {result.duration_s:.1f} s"]
    if result.error:
        lines.append(f"error: {result.error}")
    tls = tls_failure(ran.output) if ran is not None else None
    if tls is not None:
        lines.append(f"note: {tls_advice(tls, None)}")
    return "\n".join(lines)


def report_json(task_name: str, result: VerifierResult | None, ran: ScriptRun | None,
                error: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"task": task_name}
    if result is not None:
        out.update(result.to_json())
    if ran is not None:
        out["script"] = dataclasses.asdict(ran)
    if error is not None:
        out["error"] = error
        out["run_error"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m sandbox.run_task", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="examples:\n  python -m sandbox.run_task tasks/fixed/git-merge-branch --solution --json\n"
                           "  python -m sandbox.run_task TASK_DIR --shell     # a person in the task's sandbox")
    parser.add_argument("task_dir", type=Path)
    act = parser.add_mutually_exclusive_group()
    act.add_argument("--solution", action="store_true", help="run the task's reference solution")
    act.add_argument("--script", type=Path, help="run this bash script in the sandbox")
    act.add_argument("--shell", action="store_true", help="open an interactive shell in the sandbox")
    parser.add_argument("--base-image", action="append", default=[], metavar="PATTERN=IMAGE",
                        help="map FROM images matching the glob PATTERN to a local IMAGE (repeatable)")
    parser.add_argument("--trust-host-ca", action="store_true",
                        help="map onto the base image that trusts this host's CA bundle (sandbox.images.base_image)")
    Harness.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    harness = Harness.from_args(args, parser)
    exit_on_signals()
    try:
        task = load_task(args.task_dir)
        overrides = dict(parse_override(spec) for spec in args.base_image)
        for pattern, image in default_base_image_overrides(trust_host_ca=args.trust_host_ca).items():
            overrides.setdefault(pattern, image)
        script = None
        if args.solution:
            script = reference_solution(task)
            if script is None:
                raise ValueError(f"{task.path}: the task has no reference solution (solution/solve.sh, "
                                 "solution.sh or solution.yaml)")
        elif args.script is not None:
            script = args.script.read_text()
        result, ran = run_task_report(task, script=script, base_image_overrides=overrides, interactive=args.shell,
                                      upload_solution=args.solution, harness=harness)
    except (TaskFormatError, TaskImageError, SandboxError, ValueError, OSError) as e:
        if args.json:
            print(json.dumps(report_json(args.task_dir.name, None, None, str(e))), flush=True)
        parser.error(str(e))
    print(json.dumps(report_json(task.name, result, ran)) if args.json else format_table(task, result, ran))
    return 0


if __name__ == "__main__":
    sys.exit(main())
