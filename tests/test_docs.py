"""The README's commands work: the main job runs (with tiny settings appended), every other `python -m` line
parses, the test command is the one CI runs, and the page stays a page (<= 12,000 characters)."""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
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


def test_the_trainer_lines_parse() -> None:
    """Every `t1core.train` line of the README parses into a config; the only errors allowed are the example
    paths that do not exist here (a --config file, a run to resume)."""
    from t1core import train

    runs = [args for module, args in _module_runs() if module == "t1core.train"]
    assert len(runs) >= 5
    for args in runs:
        if "--help" in args:
            continue
        try:
            train.parse_args(args)
        except ValueError as e:
            assert re.search(r"no such file|no config\.toml there", str(e)), (args, e)


@pytest.mark.docker
@pytest.mark.slow
def test_the_main_job_runs(tmp_path: Path) -> None:
    """The README's main job, with settings that make it a one-minute run appended (the last value of a key
    wins), ends with its run directory and the files the README lists."""
    tiny = ["--tasks.families=create_file,append_line", "--tasks.num_per_family=1", "--tasks.num_rl_per_family=1",
            "--tasks.num_heldout_per_family=1", "--warmstart.pretrain_steps=2", "--warmstart.sft_epochs=1",
            "--rollout.episodes_per_step=2", "--rollout.group_size=2", "--rollout.max_turns=2",
            "--rollout.max_new_tokens_per_turn=16", "--rollout.max_tokens=640", "--algo.minibatch_tokens=1400",
            "--warmstart.sft_minibatch_tokens=4096", "--run.steps=1", f"--out={tmp_path / 'run'}"]
    argv = [sys.executable, *shlex.split(MAIN_JOB)[1:], *tiny]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = Path(proc.stdout.strip().splitlines()[-1])
    assert "(bitwise: exactly 0.0 at every step)" in proc.stdout  # the default is bitwise on the CPU
    for name in ("config.toml", "metrics.jsonl", "metrics.png", "trajectories", "checkpoints", "warmstart", "final"):
        assert (run / name).exists(), name
