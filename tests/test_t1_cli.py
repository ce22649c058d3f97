"""The `t1` command (t1cli.main): one command, each subcommand an existing tool's `main(argv)` run under the name
typed. `t1 --help` lists them all, `t1 SUB --help` is the tool's own help with prog `t1 SUB`, a name it does not
know is one line and exit 2, setup.py installs it as a console script, and a real subcommand prints what the
tool's own `python -m` form prints."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.cli import prog_name
from t1cli import main as t1
from tests.test_report import TASKS, _outcomes, _write

ROOT = Path(__file__).resolve().parents[1]

SUBCOMMANDS = {
    "train": "t1core.train", "plan": "t1cli.plan", "eval": "rollout.evaluate", "tasks check": "sandbox.check_tasks",
    "tasks run": "sandbox.run_task", "tasks shell": "sandbox.run_task", "tasks decontaminate": "sandbox.decontaminate",
    "reap": "sandbox.reap", "report": "rollout.report", "mismatch": "t1cli.experiments.mismatch",
}
"""What issue 59 asks for: subcommand -> the tool it runs (`tasks shell` is run_task's --shell mode)."""


def _t1(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = t1.main(argv)  # a tool returns its status, or exits (argparse's --help and errors)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_table_is_the_issues_commands() -> None:
    assert {name: command.module for name, command in t1.commands()} == SUBCOMMANDS
    assert {name: command.argv for name, command in t1.commands() if command.argv} == {"tasks shell": ("--shell",)}


def test_help_lists_every_subcommand_with_one_line(capsys) -> None:
    code, out, err = _t1(["--help"], capsys)
    assert code == 0 and not err and out.startswith("usage: t1 COMMAND [ARGS ...]")
    listing = out.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split("  ")[1].strip() for line in listing] == list(SUBCOMMANDS)
    assert all(len(line.split()) > 3 for line in listing)  # a summary beside each name
    code, out, _ = _t1(["tasks", "--help"], capsys)
    assert code == 0 and out.startswith("usage: t1 tasks COMMAND")
    assert all(f"  {name} " in out for name in ("check", "run", "shell", "decontaminate"))


def test_help_loads_no_tool() -> None:
    """`t1 --help` imports none of the tools (no torch): the listing is the table's own."""
    code = "import sys\nfrom t1cli.main import main\nassert main(['--help']) == 0\nprint(sorted(m for m in " \
           "sys.modules if m.split('.')[0] in ('torch', 't1core', 'rollout', 't1model')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "[]", proc.stderr


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_each_subcommand_help_is_the_tools_own_under_its_t1_name(sub: str, capsys) -> None:
    code, out, err = _t1([*sub.split(), "--help"], capsys)
    assert code == 0 and not err
    assert out.startswith(f"usage: t1 {sub} "), out[:200]
    module = SUBCOMMANDS[sub]
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    own = capsys.readouterr().out
    assert own.startswith(f"usage: python -m {module} ")
    flags = lambda text: {w.strip("[],") for w in text.split() if w.startswith(("--", "[--"))}  # noqa: E731
    assert flags(out) == flags(own)  # the same parser: only the name differs


@pytest.mark.parametrize("sub,argv,fragment", [
    ("plan", ["--nodes", "x"], "--nodes: invalid int value"),
    ("train", ["--run.steps=abc"], "run.steps: expected int, got 'abc'"),
    ("report", ["/nonexistent-trajs"], "no trajectories"),
    ("tasks decontaminate", ["/tmp"], "the following arguments are required: --against"),
    ("reap", ["--keep", "x"], "--keep: invalid int value"),
])
def test_a_tools_bad_input_is_one_line_under_its_t1_name(sub: str, argv: list[str], fragment: str, capsys) -> None:
    code, out, err = _t1([*sub.split(), *argv], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"t1 {sub}: error: ") and fragment in lines[0], err


@pytest.mark.parametrize("argv,line", [
    (["frob"], "t1: error: unknown command 'frob'; one of train, plan, eval, tasks, reap, report, mismatch"),
    ([], "t1: error: missing command; one of train, plan, eval, tasks, reap, report, mismatch"),
    (["tasks", "frob"], "t1 tasks: error: unknown command 'frob'; one of check, run, shell, decontaminate"),
    (["--plan"], "t1: error: unknown command '--plan'; one of train, plan, eval, tasks, reap, report, mismatch"),
])
def test_an_unknown_or_missing_subcommand_is_one_line_and_exit_2(argv: list[str], line: str, capsys) -> None:
    code, out, err = _t1(argv, capsys)
    assert code == 2 and not out and err == line + "\n"


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_each_subcommand_runs_its_tools_main_with_the_users_arguments(sub: str, monkeypatch, capsys) -> None:
    module = importlib.import_module(SUBCOMMANDS[sub])
    seen = []
    monkeypatch.setattr(module, "main", lambda argv: seen.append((argv, prog_name(f"python -m {module.__name__}")))
                        or 7)
    code, _, _ = _t1([*sub.split(), "A", "--b=c"], capsys)
    extra = ["--shell"] if sub == "tasks shell" else []
    assert code == 7 and seen == [([*extra, "A", "--b=c"], f"t1 {sub}")]
    assert prog_name(f"python -m {module.__name__}") == f"python -m {module.__name__}"  # renamed only inside


def test_setup_py_installs_the_console_script_and_the_package() -> None:
    # Not setuptools.find_packages: importing setuptools puts its vendored packaging's dist-info on sys.path, and
    # test_packaging then reads that version as the installed one.
    kw = {k.arg: k.value for n in ast.walk(ast.parse((ROOT / "setup.py").read_text())) if isinstance(n, ast.Call)
          and getattr(n.func, "id", "") == "setup" for k in n.keywords}
    assert ast.literal_eval(kw["entry_points"]) == {"console_scripts": ["t1=t1cli.main:main"]}
    include = ast.literal_eval(kw["packages"].keywords[0].value)
    assert {"t1cli", "t1cli.*"} <= set(include)
    assert all((ROOT / pkg / "__init__.py").is_file() for pkg in ("t1cli", "t1cli/experiments"))
    target, _, func = "t1cli.main:main".partition(":")
    assert getattr(importlib.import_module(target), func) is t1.main


def test_python_dash_m_t1cli_is_the_same_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "t1cli", "frob"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("t1: error: unknown command 'frob'") and not proc.stdout


def test_t1_report_prints_what_python_m_rollout_report_prints(tmp_path: Path) -> None:
    """End to end in real processes, on trajectories written by `save_trajectory`: the same bytes and status."""
    _write(tmp_path / "old", _outcomes(1, TASKS, k=2))
    _write(tmp_path / "new", _outcomes(2, TASKS, k=2))
    args = [str(tmp_path / "new"), "--baseline", str(tmp_path / "old")]
    via_t1 = subprocess.run([sys.executable, "-m", "t1cli", "report", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    direct = subprocess.run([sys.executable, "-m", "rollout.report", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert via_t1.returncode == direct.returncode == 0, via_t1.stderr + direct.stderr
    assert via_t1.stdout == direct.stdout and "create_file" in direct.stdout
    assert via_t1.stderr == direct.stderr


def test_t1_plan_prints_what_the_planner_prints(capsys) -> None:
    from t1cli import plan

    args = ["--model.name=tiny", "--gpu-mem-gib=3"]  # does not fit: exit 1, the fixes listed
    code, out, _ = _t1(["plan", *args], capsys)
    assert code == plan.main(args) == 1
    assert out == capsys.readouterr().out and out.splitlines()[-1].startswith("fits: no (peak ")
