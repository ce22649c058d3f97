"""Every command in the README's ```bash blocks runs, as written, on a fresh tiny run (issue 58).

The rule: each command line of a bash block (continuations joined, `&&` split, comments dropped) must match one
row of COMMANDS, first match wins. A row either runs the command, with the README's example paths replaced by real
ones and only the overrides that make it short appended (the last value of a key wins), and expects exit 0 (or exit
2 with the one-line message the row names); or lists it as not run here, with the reason (GPU-only, an install, the
suite itself). A command no row matches fails `test_every_readme_command_is_classified`, naming it: add a row.

The run directory is made once per session by the README's main job with tiny settings (TINY: one family, one RL
step, one turn per episode) on the default model, whose 4,096 positions are what the tools' defaults must fit.
About 13 min on a 2-core box at load ~15 (other sessions' runs beside it), most of it the three trainer runs (the
fixture's, the `--config` one, a resume: 90-130 s each there, ~15-30 s of CPU each).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_docs import README, _commands

ROOT = Path(__file__).resolve().parents[1]

TINY = ("--tasks.families=create_file", "--tasks.num_per_family=1", "--tasks.num_rl_per_family=1",
        "--tasks.num_heldout_per_family=1", "--warmstart.pretrain_steps=1", "--warmstart.sft_epochs=1",
        "--rollout.episodes_per_step=2", "--rollout.group_size=2", "--rollout.max_turns=1",
        "--rollout.max_new_tokens_per_turn=16", "--rollout.max_tokens=640", "--algo.minibatch_tokens=1400",
        "--warmstart.sft_minibatch_tokens=4096", "--eval.attempts=0", "--run.steps=1")
"""Overrides that make the default run a one-minute one (the model stays the default: D=256, 4,096 positions)."""

EVAL_TASKS = ("data-csv-to-json", "files-rename-extensions")
"""Two fixed tasks stand in for the README's task directories (/data/my-tasks, /data/tb2)."""


@dataclass(frozen=True)
class Row:
    pattern: str
    """Regular expression searched in the command (as one line)."""
    skip: str = ""
    """Why it is not run here; empty: it runs."""
    subs: dict[str, str] = field(default_factory=dict)
    """README example path -> workspace key (RUN: the fixture run, COPY: a copy of it, NEW: a fresh path, TASKS: a
    two-task directory, TASK: one task, CONFIG: the fixture run's config.toml)."""
    extra: tuple[str, ...] = ()
    """Appended arguments: only what makes it short."""
    in_fixture: bool = False
    """With `extra` appended, the command's config is the workspace fixture's (checked): it ran there."""
    exit2: str = ""
    """When set, the command must exit 2 with a one-line message matching this."""


COMMANDS: tuple[Row, ...] = (
    Row(r"^bash scripts/setup\.sh$", skip="installs Docker, the lock and the base image: CI runs it (.ci/run -> "
        "scripts/test.sh -> scripts/setup.sh)"),
    Row(r"^bash scripts/test\.sh$", skip="the test suite itself: CI runs it (.ci/run)"),
    Row(r"^pip install", skip="installs CUDA wheels (GPU machines)"),
    Row(r"^bash bench/gpu_run\.sh", skip="the device check: needs a CUDA GPU"),
    Row(r"^torchrun ", skip="a GPU preset on 8+ CUDA ranks"),
    Row(r"^pytest bench", skip="CI runs the benchmarks (.ci/run: T1_BENCH_QUICK=1 pytest bench)"),
    Row(r"^pytest tests", skip="CI runs every test (scripts/test.sh)"),
    Row(r"t1core\.train .*--config t1core/configs/\S+ .*--tasks\.source", skip="a GPU preset (Qwen3-30B-A3B on 8 "
        "H200s) on a benchmark"),
    Row(r"--rollout\.engine=vllm|--engine vllm", skip="vLLM needs CUDA"),
    Row(r"^python3 -m t1core\.train$", in_fixture=True),
    Row(r"^python3 -m t1core\.train --help$"),
    Row(r"^python3 -m t1core\.train --resume runs/exp1 --run\.steps=\d+$", subs={"runs/exp1": "COPY"},
        extra=("--run.steps=2",)),
    Row(r"^python3 -m t1core\.train --[a-z_]+\.", extra=TINY, in_fixture=True),
    Row(r"^t1 --help$"),
    Row(r"^t1 plan --config t1core/configs/\S+\.toml$"),
    Row(r"^t1 tasks check /data/my-tasks", subs={"/data/my-tasks": "TASKS"}),
    Row(r"^t1 tasks (run|shell) /data/my-tasks/TASK", subs={"/data/my-tasks/TASK": "TASK"}),
    Row(r"^t1 tasks decontaminate runs/r1/tasks --against /data/tb2$",
        subs={"runs/r1/tasks": "RUN/tasks", "/data/tb2": "TASKS"}),
    Row(r"^t1 eval --checkpoint runs/exp1/final --tasks /data/tb2 --out runs/exp1/tb2",
        subs={"runs/exp1/tb2": "NEW", "runs/exp1": "RUN", "/data/tb2": "TASKS"},
        extra=("--rollout.max_turns=1", "--rollout.max_new_tokens_per_turn=16")),
    Row(r"^t1 report runs/exp1/", subs={"runs/exp1": "RUN"}),
    Row(r"^t1 mismatch ", subs={"runs/mismatch.json": "NEW"},
        extra=("--episodes", "1", "--seeds", "0", "--families", "create_file", "--sft-epochs", "0",
               "--rollout.max_turns=1", "--rollout.max_new_tokens_per_turn=32")),
)


def _lines() -> list[str]:
    return [shlex.join(argv) for argv in _commands()]


def _row(line: str) -> Row | None:
    return next((r for r in COMMANDS if re.search(r.pattern, line)), None)


def test_every_readme_command_is_classified() -> None:
    unknown = [line for line in _lines() if _row(line) is None]
    assert not unknown, f"README commands no row of tests/test_readme_commands.py COMMANDS classifies: {unknown}"


def test_every_row_names_a_readme_command() -> None:
    lines = _lines()
    assert "```bash" in README
    stale = [r.pattern for r in COMMANDS if not r.skip and not any(re.search(r.pattern, x) for x in lines)]
    assert not stale, f"rows that run no README command (remove them): {stale}"


def _train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "t1core.train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The README's main job with TINY appended: a fresh run directory on the default model; and two tasks."""
    root = tmp_path_factory.mktemp("readme")
    proc = _train([*TINY, f"--out={root / 'run'}"], ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = Path(proc.stdout.strip().splitlines()[-1])
    assert "(bitwise: exactly 0.0 at every step)" in proc.stdout  # the default is bitwise on the CPU
    for name in ("config.toml", "metrics.jsonl", "metrics.png", "trajectories", "checkpoints", "warmstart", "final"):
        assert (run / name).exists(), name
    tasks = root / "tasks"
    for name in EVAL_TASKS:
        shutil.copytree(ROOT / "tasks" / "fixed" / name, tasks / name)
    return {"ROOT": root, "RUN": run, "TASKS": tasks, "TASK": tasks / EVAL_TASKS[0], "CONFIG": run / "config.toml"}


def _where(key: str, ws: dict[str, Path], n: int) -> str:
    """The workspace path a row's key names, for the README's n-th command."""
    if key == "NEW":
        return str(ws["ROOT"] / f"new{n}")
    if key == "COPY":
        dst = ws["ROOT"] / f"copy{n}"
        if not dst.exists():
            shutil.copytree(ws["RUN"], dst)
        return str(dst)
    base, _, rest = key.partition("/")
    return str(ws[base] / rest) if rest else str(ws[base])


def _resolve(argv: list[str], row: Row, ws: dict[str, Path], n: int) -> list[str]:
    """argv and the row's extra arguments, README paths replaced (the longest that matches; NEW_OUT: a fresh path)."""
    subs = {**row.subs, "NEW_OUT": "NEW"}
    out = []
    for arg in [*argv, *row.extra]:
        old = next((o for o in sorted(subs, key=len, reverse=True) if o in arg), None)
        out.append(arg if old is None else arg.replace(old, _where(subs[old], ws, n)))
    return out


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("n,line", list(enumerate(_lines())), ids=[f"{i}" for i in range(len(_lines()))])
def test_readme_command(n: int, line: str, workspace: dict[str, Path]) -> None:
    row = _row(line)
    assert row is not None, f"unclassified README command: {line}"
    if row.skip:
        pytest.skip(f"{line}: {row.skip}")
    if row.in_fixture:  # the same config as the fixture's run (TINY's values win): it ran there
        from t1core.cli import parse_args

        out = ["--out", str(workspace["ROOT"] / "unused")]
        assert parse_args([*shlex.split(line)[3:], *TINY, *out])[0] == parse_args([*TINY, *out])[0]
        return
    argv = _resolve(shlex.split(line), row, workspace, n)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv[0] == "t1":  # the console script is `t1cli.main:main` (setup.py): the same, without an install
        argv[0:1] = [sys.executable, "-m", "t1cli"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    said = proc.stdout[-3000:] + proc.stderr[-3000:]
    if row.exit2:
        assert proc.returncode == 2 and re.search(row.exit2, proc.stderr), said
        assert len(proc.stderr.strip().splitlines()) <= 2 and "Traceback" not in proc.stderr, said
    else:
        assert proc.returncode == 0, f"{shlex.join(argv)}\n{said}"
        assert "Traceback" not in proc.stderr, said


@pytest.mark.docker
@pytest.mark.slow
def test_collect_defaults_fit_the_default_model(workspace: dict[str, Path]) -> None:
    """rollout.collect as issue 58 ran it, on the run's checkpoint (its defaults once asked for 4,097 positions)."""
    argv = [sys.executable, "-m", "rollout.collect", "--tasks", "tasks", "--episodes", "3", "--checkpoint",
            str(workspace["RUN"] / "final"), "--rollout.max_turns=1", "--rollout.max_new_tokens_per_turn=16",
            "--out", str(workspace["ROOT"] / "collect")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("module", ["rollout.evaluate", "rollout.collect"])
def test_a_budget_past_the_positions_is_one_line(module: str, tmp_path: Path) -> None:
    """rollout.max_tokens beyond the model's 4,096 positions: exit 2 and one line naming it, before any sandbox."""
    from t1model.hf_io import save_pretrained
    from t1model.model import ModelConfig, MoEModel

    ckpt = tmp_path / "ckpt"
    save_pretrained(MoEModel(ModelConfig.tiny(), seed=0), ckpt)  # the default model's 4,096 positions
    argv = [sys.executable, "-m", module, "--checkpoint", str(ckpt), "--tasks", str(ROOT / "tasks" / "fixed"),
            "--rollout.max_tokens=5000", "--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--rollout.max_tokens=5000: a context would run past the model's 4096 positions; lower it (at most 4096)"), proc.stderr
    assert "Traceback" not in proc.stderr
