"""Every entry point: `--help` says what it does with an example; bad input is one line naming the problem, exit
status 2, no traceback (tests/test_docs.py runs the README's commands themselves)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# module -> bad command lines, each with a fragment its one-line error must contain
BAD_INPUT = {
    "t1core.train": [(["--run.steps=abc"], "run.steps: expected int, got 'abc'"),
                     (["--rollout.engin=x"], "unknown key rollout.engin"),
                     (["--run.eval_every=3"], "unknown key run.eval_every"),  # retired (issue 59): eval.every
                     (["--model.name=replace"], "model.name: expected a preset"),
                     (["--model.dtype=int8"], "model.dtype: expected one of"),
                     (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file"),
                     (["--resume", "/nonexistent-run"], "no config.toml there")],
    "rollout.collect": [(["--out", "/tmp/t1-cli-test", "--checkpoint", "/nonexistent-ckpt"], "/nonexistent-ckpt"),
                        (["--out", "/tmp/t1-cli-test", "--episodes", "0"], "--episodes must be >= 1"),
                        (["--out", "/tmp/t1-cli-test", "--rollout.engine=vllm"], "collect serves its policy with the "
                         "torch engine")],
    "rollout.report": [(["/nonexistent-trajs"], "no trajectories")],
    "t1cli.experiments.mismatch": [(["--seeds", "a"], "--seeds: expected comma-separated integers")],
    "t1cli.experiments.copy_probe": [(["/nonexistent-ckpt"], "/nonexistent-ckpt"),
                                      (["/nonexistent-ckpt", "--families", "nope"], "--families: unknown")],
    "t1cli.plan": [(["--nodes", "x"], "--nodes: invalid int value"),
                    (["--model.name=nope"], "model.name='nope'"),
                    (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file")],
    "sandbox.run_task": [(["/nonexistent-task"], "/nonexistent-task")],
    "sandbox.check_tasks": [(["/nonexistent-dir"], "/nonexistent-dir: not a directory"),
                            (["/tmp", "--parallel", "0"], "--parallel and --sample must be >= 1")],
    "sandbox.decontaminate": [(["/nonexistent-dir", "--against", "/tmp"], "/nonexistent-dir: not a directory"),
                              (["/tmp"], "the following arguments are required: --against")],
    "sandbox.reap": [(["--keep", "x"], "--keep: invalid int value"),
                     (["--sandbox.hosts=[bogus://x]"], "sandbox.hosts: 'bogus://x': expected a unix://"),
                     (["--host", "x"], "unrecognised arguments ['--host', 'x']")],
    "sandbox.base_image": [(["frobnicate"], "invalid choice: 'frobnicate'")],
}


def _run(module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    main = importlib.import_module(module).main
    try:
        code = main(argv)  # some entry points return their status rather than exit
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("module", sorted(BAD_INPUT))
def test_help_says_what_it_does_with_an_example(module: str, capsys) -> None:
    code, out, _ = _run(module, ["--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: python -m {module}")
    assert f"python -m {module} " in out.split("usage:", 1)[1].split("\n", 1)[1], "no example in --help"


@pytest.mark.parametrize("module,argv,fragment", [(m, a, f) for m, cases in BAD_INPUT.items() for a, f in cases],
                         ids=lambda v: v if isinstance(v, str) and "." in v else None)
def test_bad_input_is_one_line_and_exit_2(module: str, argv: list[str], fragment: str, capsys) -> None:
    code, out, err = _run(module, argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m {module}: error: "), err
    assert fragment in lines[0]


def test_a_real_process_prints_no_traceback() -> None:
    """The same through the interpreter's own entry: nothing but the one line on stderr."""
    proc = subprocess.run([sys.executable, "-m", "t1core.train", "--run.steps=abc"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "python -m t1core.train: error: run.steps: expected int, got 'abc'\n"
    assert "Traceback" not in proc.stdout + proc.stderr


def test_reap_takes_the_hosts_of_a_run(tmp_path) -> None:
    """`t1 reap` reads sandbox.hosts as the trainer does: from the run's TOML file, then --sandbox.hosts."""
    from sandbox.runtime.reap import run_hosts

    run = tmp_path / "run.toml"
    run.write_text('[sandbox]\nhosts = ["unix:///a.sock max=4", "ssh://me@box"]\n[rollout]\nmax_turns = 9\n')
    assert [h.url for h in run_hosts(str(run), [])] == ["unix:///a.sock", "ssh://me@box"]
    assert [h.url for h in run_hosts(str(run), ["--sandbox.hosts=[unix:///b.sock]"])] == ["unix:///b.sock"]
    assert run_hosts(None, []) == []

