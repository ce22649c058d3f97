"""`t1 COMMAND [ARGS ...]`: every tool behind one command, as `vllm serve` or `harbor run` do.

Each subcommand runs an existing tool's `main(argv)`, under the name the user typed: `t1 plan --help` is the
planner's own help with prog `t1 plan`, and its errors start `t1 plan: error:` (sandbox.cli.invoked_as). The
`python -m` forms run the same code. The tool's module is imported only when its subcommand runs, so `t1 --help`
loads no torch. An unknown or missing subcommand is one line naming it and the known ones, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from sandbox.cli import Parser, invoked_as


@dataclass(frozen=True)
class Command:
    module: str
    """The tool whose `main(argv)` runs; its own prog is `python -m MODULE`."""
    summary: str
    """One line for `t1 --help`."""
    argv: tuple[str, ...] = ()
    """Arguments put before the user's (`tasks shell` is `run_task --shell`)."""


Table = dict[str, "Command | dict[str, Command]"]
"""Subcommand -> its tool, or a group of subcommands with their own table (`t1 tasks check`)."""

TASKS: dict[str, Command] = {
    "check": Command("sandbox.check_tasks", "does every task build, its solution pass and doing nothing fail?"),
    "run": Command("sandbox.run_task", "one task end to end: build, sandbox, act (--solution, --script), verify"),
    "shell": Command("sandbox.run_task", "you in one task's sandbox, then its verifiers (sandbox.run_task --shell)",
                     argv=("--shell",)),
    "decontaminate": Command("sandbox.decontaminate", "training tasks that share text or files with evaluation ones"),
}
COMMANDS: Table = {
    "train": Command("t1core.train", "warm start, then PPO on sandboxed episodes (python -m t1core.train)"),
    "plan": Command("t1cli.plan", "memory and bytes per rank of a run's config, before renting the GPUs"),
    "eval": Command("rollout.evaluate", "score a HF checkpoint on task directories: resolved rate, interval"),
    "tasks": TASKS,
    "reap": Command("sandbox.reap", "remove the sandboxes of dead runs (--images: prune idle task images)"),
    "report": Command("rollout.report", "score saved trajectories per task family (--baseline: paired change)"),
    "mismatch": Command("t1cli.experiments.mismatch", "the TITO / R3 ablation: train vs rollout log-prob gap"),
}
"""Every subcommand (issue 59). `tasks shell` is sandbox.run_task's own --shell mode, not a tool of its own."""
DESCRIPTIONS = {"t1": "T1's tools behind one command (each `python -m` form runs the same code).",
                "t1 tasks": "Task collections (Harbor, Terminal-Bench 1 and 2): check them, run or enter one, "
                            "decontaminate."}
"""What a table's --help says above its listing."""


def commands(table: Table = COMMANDS, prefix: str = "") -> list[tuple[str, Command]]:
    """(subcommand, its tool) for every tool under `table`, a group's tools as `group tool` (`tasks check`)."""
    out = []
    for name, entry in table.items():
        out += [(prefix + name, entry)] if isinstance(entry, Command) else commands(entry, f"{prefix}{name} ")
    return out


def _parser(prog: str, table: Table, description: str) -> Parser:
    rows = commands(table)
    width = max(len(name) for name, _ in rows) + 2
    listing = "\n".join(f"  {name:<{width}}{command.summary}" for name, command in rows)
    return Parser(prog=prog, usage=f"{prog} COMMAND [ARGS ...]", formatter_class=argparse.RawDescriptionHelpFormatter,
                  description=description, epilog=f"commands:\n{listing}\n\n`{prog} COMMAND --help` is that "
                                                  "command's own help. train, plan, eval, reap and mismatch read a "
                                                  "run's config the same way: --config FILE, then any knob as "
                                                  "--section.key=value.")


def _dispatch(prog: str, table: Table, argv: list[str]) -> int:
    parser = _parser(prog, table, DESCRIPTIONS[prog])
    if argv and argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    known = ", ".join(table)
    if not argv:
        parser.error(f"missing command; one of {known}")
    name, rest = argv[0], argv[1:]
    if name not in table:
        parser.error(f"unknown command {name!r}; one of {known}")
    entry = table[name]
    if isinstance(entry, dict):
        return _dispatch(f"{prog} {name}", entry, rest)  # a group: its own COMMAND follows
    tool_main = importlib.import_module(entry.module).main
    with invoked_as(f"python -m {entry.module}", f"{prog} {name}"):
        return tool_main([*entry.argv, *rest])


def main(argv: list[str] | None = None) -> int:
    """The `t1` console script (setup.py): dispatch to the subcommand's tool; its exit status is ours."""
    return _dispatch("t1", COMMANDS, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    raise SystemExit(main())
