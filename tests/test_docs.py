"""The README's commands work: the main job runs (with tiny settings appended), every other `python -m` line
parses, every `t1` line names a subcommand, the test command is the one CI runs, and the page stays a page (<= 12,000
characters); EXPERIMENTS.md stays a record of figures (<= 30,000 characters)."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAIN_JOB = "python3 -m t1core.train"


def _commands() -> list[list[str]]:
    """Every command of the README's bash blocks (continuation lines joined, comments dropped), as argv."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in line.split("&&"):
                if part.strip() and not part.strip().startswith("#"):
                    out.append(shlex.split(part))
    return out


def _module_runs() -> list[tuple[str, list[str]]]:
    """(module, its arguments) of every `python -m MODULE` / `torchrun ... -m MODULE` command."""
    out = []
    for argv in _commands():
        if "-m" in argv and argv[0] in ("python", "python3", "torchrun"):
            i = argv.index("-m")
            out.append((argv[i + 1], argv[i + 2:]))
    return out


def test_readme_is_a_page_for_users() -> None:
    assert len(README) <= 12_000, f"README.md has {len(README)} characters"
    assert "DEMO_SENTENCE" not in README and "LIFT_ROW" not in README and "DEFAULT_TIME" not in README


def test_experiments_stays_a_record_of_figures() -> None:
    """EXPERIMENTS.md holds the current figures (<= 30,000 characters); lab notes move to docs/, each leaving a
    pointer that must lead somewhere."""
    text = (ROOT / "EXPERIMENTS.md").read_text()
    assert len(text) <= 30_000, f"EXPERIMENTS.md has {len(text)} characters"
    named = set(re.findall(r"\bdocs/[\w./-]+\.md\b", text))
    assert {"docs/lab-notes-terminal-bench.md", "docs/lab-notes-refactor-issue-48.md"} <= named
    assert [p for p in sorted(named) if not (ROOT / p).is_file()] == []


def test_the_two_quick_start_commands_are_the_ones_that_run() -> None:
    quick = README.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert f"bash scripts/setup.sh && {MAIN_JOB}" in quick and "bash scripts/test.sh" in quick
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


@pytest.mark.parametrize("module", sorted({m for m, _ in _module_runs() if m != "pytest"}))
def test_every_module_the_readme_names_has_help(module: str, capsys) -> None:
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and f"python -m {module}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [a for a in _commands() if a[0] == "t1"], ids=shlex.join)
def test_every_t1_command_the_readme_names_has_help(argv: list[str], capsys) -> None:
    """`t1 --help`, `t1 plan ...`, `t1 tasks check ...`: the subcommand exists, with its own help under its name."""
    from t1cli.main import COMMANDS, main

    sub = [] if argv[1] == "--help" else argv[1:3] if isinstance(COMMANDS.get(argv[1]), dict) else argv[1:2]
    assert not sub or sub[0] in COMMANDS, f"README: {shlex.join(argv)}: t1 has no such command"
    try:
        code = main([*sub, "--help"])  # t1's own help returns; a tool's (argparse) exits
    except SystemExit as e:
        code = e.code
    assert code == 0 and capsys.readouterr().out.startswith(f"usage: {' '.join(['t1', *sub])} ")


def test_the_trainer_lines_parse() -> None:
    """Every `t1core.train` line of the README parses into a config; the only errors allowed are the example
    paths that do not exist here (a --config file, a run to resume)."""
    from t1core import cli

    runs = [args for module, args in _module_runs() if module == "t1core.train"]
    assert len(runs) >= 5
    for args in runs:
        if "--help" in args:
            continue
        try:
            cli.parse_args(args)
        except ValueError as e:
            assert re.search(r"no such file|no config\.toml there", str(e)), (args, e)


# The main job itself runs in tests/test_readme_commands.py (its workspace fixture), with every other command.
