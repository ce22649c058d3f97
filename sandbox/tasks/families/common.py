"""What a task family produces (`TaskSpec`), how it becomes a Harbor task directory, and shared vocabulary.

A family is a function `generate(rng) -> TaskSpec`. Everything random comes from `rng` (a `random.Random`
seeded by the suite with family, split and seed), so one (family, split, seed) always yields the same task.
Training and held-out instances are drawn from one distribution: a held-out instance differs from the training
ones only by its seed, so held-out success measures generalisation to unseen instances, not to unseen kinds of
names (an earlier split by the parity of file-name numbers was a shift a tiny model could not cross: it wrote
`u12` for a held-out `u21`).

Generated tests follow one rule for the tiny learners that train on them: each instance has >= 3 test
functions giving partial credit, and the untouched starting state passes fewer than half of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import re
import textwrap
from pathlib import Path
from typing import Literal

FILE_MTIME = 1_704_067_200  # 2024-01-01 00:00 UTC: the mtime of every file an instance ships

# Separates the turns of a multi-turn reference in solve.sh. Run as a script it is a comment (the whole solution
# runs at once); the SFT transcript makes each part its own tool call, so a later part is written after the
# agent has seen an earlier part's output (see `sandbox.tasks.suite.reference_turns`).
TURN_BREAK = "# t1: next turn"

# An incomplete SFT demonstration is written next to solve.sh; its first comment line names the tests it leaves
# failing (so a check of the demonstrations knows which failures are meant).
DEMONSTRATION_FILE = "demonstration.sh"
DEMO_FAILS_PREFIX = "# t1: leaves failing: "

Split = Literal["train", "heldout"]

WORDS = (
    "apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "peach", "plum", "kiwi",
    "tiger", "zebra", "otter", "eagle", "whale", "panda", "koala", "camel", "horse", "mouse",
    "red", "blue", "green", "amber", "coral", "ivory", "olive", "slate", "teal", "violet",
    "river", "cloud", "stone", "maple", "cedar", "ocean", "storm", "frost", "ember", "delta",
)
STEMS = ("notes", "memo", "todo", "draft", "list", "info", "report", "items", "names", "words")
LETTERS = "abcdefghjkmnpqrstuvwxyz"

# Harbor's test entry point; T1 runs the test_*.py files itself and does not need it (see sandbox.runtime.verify).
TEST_SH = """#!/usr/bin/env bash
# Harbor entry point: run this task's tests and write the reward file Harbor reads.
cd "$(dirname "$0")"
mkdir -p /logs/verifier
if python3 -m pytest -q -p no:cacheprovider test_*.py; then r=1; else r=0; fi
echo "$r" > /logs/verifier/reward.txt
"""

# Helpers every generated test file starts with (stdlib only: the tests run in the task's image).
TEST_PRELUDE = '''import hashlib
import os
import pathlib
import stat
import subprocess


def read(path):
    return pathlib.Path(path).read_text()


def sha(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, **kw)


def unchanged(files):
    return all(pathlib.Path(p).is_file() and sha(p) == h for p, h in files.items())
'''


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One generated task instance, before it is written out as a Harbor directory."""

    instruction: str
    """What the agent is told (short: one or two sentences)."""
    files: dict[str, str]
    """Starting files: absolute path under /app -> text content."""
    solution: str
    """Reference solution: bash, usually one short command (the last turn, after `inspect`)."""
    tests: str
    """Body of tests/test_outputs.py (after TEST_PRELUDE and the constants)."""
    constants: dict[str, object]
    """Names the tests use (rendered with repr)."""
    category: str
    """Suite category (files, text, data, fix, permissions)."""
    modes: dict[str, int] = dataclasses.field(default_factory=dict)
    """File modes to set on starting files (default 0644)."""
    inspect: tuple[str, ...] = ()
    """Read-only commands the reference runs first, one turn each, where the instruction leaves out what the
    solution needs (which column of a CSV file is which, what a script's bug is): `solution` is what their
    output tells. Without them a policy that copies the instruction can only guess. A long task
    (`sandbox.tasks.families.chain`) holds its earlier steps here, each written from the output of the one before."""
    demonstration: tuple[str, ...] | None = None
    """The SFT demonstration's tool calls where they differ from `turns`: an incomplete one that leaves a step
    out (see sandbox.tasks.families.finish); None = the demonstration is the full reference."""
    demonstration_fails: tuple[str, ...] = ()
    """Names of the test functions an incomplete demonstration leaves failing (empty when it is complete)."""
    agent_timeout_s: float = 120.0
    """The agent timeout task.toml states (a long task needs more than a short one's two minutes)."""

    @property
    def turns(self) -> tuple[str, ...]:
        """The reference's tool calls in order: the inspections, then the solution."""
        return (*self.inspect, self.solution)

    def __post_init__(self) -> None:
        bad = [p for p in self.files if not p.startswith("/app/")]
        if bad:
            raise ValueError(f"expected starting files under /app/, got {bad}")
        if len(re.findall(r"^\s*def test_", self.tests, flags=re.MULTILINE)) < 3:
            raise ValueError("expected at least 3 test functions in a generated task")
        if bool(self.demonstration_fails) != (self.demonstration is not None):
            raise ValueError("expected demonstration and demonstration_fails both set (an incomplete "
                             "demonstration names the tests it leaves failing) or both empty")
        missing = [n for n in self.demonstration_fails if not re.search(rf"^\s*def {n}\(", self.tests, re.M)]
        if missing:
            raise ValueError(f"demonstration_fails names tests the task does not have: {missing}")


def ident(rng: random.Random) -> str:
    """A short name tag like 'k42': a letter and a number below 100."""
    return f"{rng.choice(LETTERS)}{rng.randrange(100)}"


def distinct_words(rng: random.Random, k: int, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """k different words, none containing (or contained in) an excluded word."""
    pool = [w for w in WORDS if not any(w in e or e in w for e in exclude)]
    return rng.sample(pool, k)


def sha_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_harbor_task(spec: TaskSpec, out_dir: Path, *, family: str, seed: int, split: Split) -> Path:
    """Write `spec` as a Harbor task directory at `out_dir` (created; must not exist) and return it."""
    out_dir.mkdir(parents=True, exist_ok=False)
    (out_dir / "instruction.md").write_text(spec.instruction.strip() + "\n")
    (out_dir / "task.toml").write_text(
        f'version = "1.0"\n\n[metadata]\ncategory = "{spec.category}"\ndifficulty = "easy"\n'
        f'family = "{family}"\nseed = {seed}\nsplit = "{split}"\n\n'
        f"[agent]\ntimeout_sec = {spec.agent_timeout_s}\n\n"
        "[verifier]\ntimeout_sec = 60.0\n\n"
        "[environment]\ncpus = 1\nmemory_mb = 512\nnetwork = false\n")
    env = out_dir / "environment"
    env.mkdir()
    for path, content in spec.files.items():
        dst = env / "app" / Path(path).relative_to("/app")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(content)
        dst.chmod(spec.modes.get(path, 0o644))
        # A fixed mtime: `ls -l` output is part of what the agent sees, and the same seed must show the same
        # bytes whenever and wherever the instance is written (COPY and the preload both keep mtimes).
        os.utime(dst, (FILE_MTIME, FILE_MTIME))
    for sub in sorted((env / "app").rglob("*"), reverse=True) if spec.files else ():  # children before parents
        if sub.is_dir():
            os.utime(sub, (FILE_MTIME, FILE_MTIME))
    # COPY-only: sandbox.images.task_images preloads the files into the base image's container instead of building an
    # image.
    copy = "COPY app/ /app/\n" if spec.files else ""  # WORKDIR creates /app (a preloaded directory entry)
    (env / "Dockerfile").write_text(f"FROM debian:bookworm\n{copy}WORKDIR /app\n")
    (out_dir / "solution").mkdir()
    body = f"\n{TURN_BREAK}\n".join(cmd.strip() for cmd in spec.turns)
    (out_dir / "solution" / "solve.sh").write_text(f"#!/usr/bin/env bash\n{body}\n")
    if spec.demonstration is not None:  # what SFT is shown instead (sandbox.tasks.suite.demonstration_turns)
        demo = f"\n{TURN_BREAK}\n".join(cmd.strip() for cmd in spec.demonstration)
        (out_dir / "solution" / DEMONSTRATION_FILE).write_text(
            f"#!/usr/bin/env bash\n{DEMO_FAILS_PREFIX}{' '.join(spec.demonstration_fails)}\n{demo}\n")
    tests = out_dir / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text(TEST_SH)
    consts = "\n".join(f"{k} = {v!r}" for k, v in spec.constants.items())
    (tests / "test_outputs.py").write_text(f"{TEST_PRELUDE}\n{consts}\n\n\n{textwrap.dedent(spec.tests).strip()}\n")
    return out_dir
