"""Task directories: load Terminal-Bench 1 and Harbor (Terminal-Bench 2) layouts into one `Task`.

Harbor layout                          Terminal-Bench 1 layout
  task.toml   [agent] [verifier]         task.yaml   instruction, max_agent_timeout_sec,
              [environment] [metadata]               max_test_timeout_sec, difficulty, category, ...
  instruction.md                         Dockerfile  (build context: the task directory)
  environment/Dockerfile (+ context)     solution.sh
  solution/solve.sh                      run-tests.sh   (not run: it installs pytest from the internet)
  tests/test.sh, tests/test_*.py         tests/test_*.py

How a task is verified (see sandbox.verify): when `tests/` holds `test_*.py` files they are run with pytest
and every test case is one verifier; otherwise (Harbor only) `tests/test.sh` runs and the reward file it
writes is read. A malformed task raises `TaskFormatError` naming the file and the field.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

Layout = Literal["harbor", "tb1"]
VerifierKind = Literal["pytest", "script"]

# Terminal-Bench 1 defaults (its task.yaml schema) and Harbor's usual ones.
_TB1_AGENT_TIMEOUT_S = 360.0
_TB1_TEST_TIMEOUT_S = 60.0
_HARBOR_AGENT_TIMEOUT_S = 600.0
_HARBOR_VERIFIER_TIMEOUT_S = 120.0
_DEFAULT_CPUS = 1.0
_DEFAULT_MEMORY_MB = 2048
_DEFAULT_WORKDIR = "/app"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class TaskFormatError(ValueError):
    """A task directory that cannot be loaded; the message names the file and the field."""

    def __init__(self, file: Path, field: str, problem: str):
        super().__init__(f"{file}: field {field!r}: {problem}")
        self.file = file
        self.field = field


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """One task: what the agent is told, where its environment and verifiers live, and its limits."""

    name: str
    """Directory name; unique within a suite."""
    path: Path
    """The task directory (absolute)."""
    layout: Layout
    """Which public layout the directory uses."""
    instruction: str
    """Text given to the agent."""
    agent_timeout_s: float
    """Wall-clock budget of the agent's episode."""
    verifier_timeout_s: float
    """Wall-clock budget of the verifier run; unfinished tests then count as failed."""
    cpus: float
    """CPU limit of the task's sandbox."""
    memory_mb: int
    """Memory limit of the task's sandbox."""
    network: bool
    """Whether the sandbox gets a network (most tasks: False)."""
    workdir: str
    """Working directory of the agent's shell: the Dockerfile's last WORKDIR, else /app."""
    dockerfile_dir: Path
    """Docker build context (holds the Dockerfile)."""
    dockerfile: Path
    """The Dockerfile inside `dockerfile_dir`."""
    solution_script: Path | None
    """Reference solution (bash), or None when the task ships none."""
    tests_dir: Path
    """Directory copied into the sandbox for verification."""
    test_script: Path | None
    """tests/test.sh (Harbor) or run-tests.sh (TB1); only run for verifier kind 'script'."""
    verifier_kind: VerifierKind
    """'pytest': each test case in tests/test_*.py is a verifier; 'script': test.sh writes a reward file."""
    num_static_tests: int
    """Test functions found by reading tests/test_*.py (a floor for the verifier total)."""
    static_test_ids: tuple[str, ...]
    """Their ids, 'test_file.py::test_x' or 'test_file.py::TestClass::test_x'."""
    category: str = ""
    """Free-form category from the task's metadata."""
    difficulty: str = ""
    """Free-form difficulty from the task's metadata."""

    def __post_init__(self) -> None:
        if self.agent_timeout_s <= 0 or self.verifier_timeout_s <= 0:
            raise ValueError(f"task {self.name}: timeouts must be > 0, got agent={self.agent_timeout_s} "
                             f"verifier={self.verifier_timeout_s}")
        if self.cpus <= 0 or self.memory_mb <= 0:
            raise ValueError(f"task {self.name}: expected cpus > 0 and memory_mb > 0, got {self.cpus}, "
                             f"{self.memory_mb}")


def load_task(path: str | Path) -> Task:
    """Load a task directory in the Harbor or Terminal-Bench 1 layout (detected by task.toml / task.yaml)."""
    root = Path(path).resolve()
    if not root.is_dir():
        raise TaskFormatError(root, "path", "is not a directory")
    if (root / "task.toml").is_file():
        return _load_harbor(root)
    if (root / "task.yaml").is_file():
        return _load_tb1(root)
    raise TaskFormatError(root / "task.toml", "file", "neither task.toml (Harbor) nor task.yaml (TB1) exists")


def _load_harbor(root: Path) -> Task:
    toml_path = root / "task.toml"
    try:
        cfg = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(toml_path, "toml", f"invalid TOML: {e}") from e
    agent = _table(cfg, "agent", toml_path)
    verifier = _table(cfg, "verifier", toml_path)
    env = _table(cfg, "environment", toml_path)
    meta = _table(cfg, "metadata", toml_path)

    instr_path = root / "instruction.md"
    if not instr_path.is_file():
        raise TaskFormatError(instr_path, "instruction", "instruction.md is missing")
    instruction = instr_path.read_text().strip()
    if not instruction:
        raise TaskFormatError(instr_path, "instruction", "is empty")

    env_dir = root / "environment"
    dockerfile = env_dir / "Dockerfile"
    if not dockerfile.is_file():
        raise TaskFormatError(dockerfile, "environment", "environment/Dockerfile is missing")
    tests_dir = root / "tests"
    test_sh = tests_dir / "test.sh"
    kind, ids = _verifier_kind(tests_dir, test_sh if test_sh.is_file() else None)
    solution = root / "solution" / "solve.sh"
    return Task(
        name=_task_name(root),
        path=root,
        layout="harbor",
        instruction=instruction,
        agent_timeout_s=_number(agent, "timeout_sec", _HARBOR_AGENT_TIMEOUT_S, toml_path, "agent.timeout_sec"),
        verifier_timeout_s=_number(verifier, "timeout_sec", _HARBOR_VERIFIER_TIMEOUT_S, toml_path,
                                   "verifier.timeout_sec"),
        cpus=_number(env, "cpus", _DEFAULT_CPUS, toml_path, "environment.cpus"),
        memory_mb=int(_number(env, "memory_mb", _DEFAULT_MEMORY_MB, toml_path, "environment.memory_mb")),
        network=_bool(env, "network", False, toml_path, "environment.network"),
        workdir=_workdir(dockerfile),
        dockerfile_dir=env_dir,
        dockerfile=dockerfile,
        solution_script=solution if solution.is_file() else None,
        tests_dir=tests_dir,
        test_script=test_sh if test_sh.is_file() else None,
        verifier_kind=kind,
        num_static_tests=len(ids),
        static_test_ids=ids,
        category=str(meta.get("category", "")),
        difficulty=str(meta.get("difficulty", "")),
    )


def _load_tb1(root: Path) -> Task:
    yaml_path = root / "task.yaml"
    try:
        import yaml  # PyYAML: only the TB1 layout needs it
    except ImportError as e:
        raise TaskFormatError(yaml_path, "yaml", "reading TB1 tasks needs PyYAML (pip install pyyaml)") from e
    try:
        cfg = yaml.safe_load(yaml_path.read_text())
    except yaml.YAMLError as e:
        raise TaskFormatError(yaml_path, "yaml", f"invalid YAML: {e}") from e
    if not isinstance(cfg, dict):
        raise TaskFormatError(yaml_path, "yaml", f"expected a mapping at top level, got {type(cfg).__name__}")
    instruction = cfg.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        # Some TB1 tasks carry the instruction as a list of {language, text} descriptions.
        descs = cfg.get("descriptions")
        if isinstance(descs, list) and descs and isinstance(descs[0], dict) and descs[0].get("description"):
            instruction = str(descs[0]["description"])
        else:
            raise TaskFormatError(yaml_path, "instruction", "missing or empty")
    dockerfile = root / "Dockerfile"
    if not dockerfile.is_file():
        raise TaskFormatError(dockerfile, "Dockerfile", "Dockerfile is missing")
    tests_dir = root / "tests"
    run_tests = root / "run-tests.sh"
    kind, ids = _verifier_kind(tests_dir, None)
    solution = root / "solution.sh"
    return Task(
        name=_task_name(root),
        path=root,
        layout="tb1",
        instruction=instruction.strip(),
        agent_timeout_s=_number(cfg, "max_agent_timeout_sec", _TB1_AGENT_TIMEOUT_S, yaml_path,
                                "max_agent_timeout_sec"),
        verifier_timeout_s=_number(cfg, "max_test_timeout_sec", _TB1_TEST_TIMEOUT_S, yaml_path,
                                   "max_test_timeout_sec"),
        cpus=_DEFAULT_CPUS,
        memory_mb=_DEFAULT_MEMORY_MB,
        network=False,
        workdir=_workdir(dockerfile),
        dockerfile_dir=root,
        dockerfile=dockerfile,
        solution_script=solution if solution.is_file() else None,
        tests_dir=tests_dir,
        test_script=run_tests if run_tests.is_file() else None,
        verifier_kind=kind,
        num_static_tests=len(ids),
        static_test_ids=ids,
        category=str(cfg.get("category", "")),
        difficulty=str(cfg.get("difficulty", "")),
    )


def _task_name(root: Path) -> str:
    if not _NAME_RE.match(root.name):
        raise TaskFormatError(root, "name", f"directory name must match {_NAME_RE.pattern}, got {root.name!r}")
    return root.name


def _table(cfg: dict[str, Any], key: str, file: Path) -> dict[str, Any]:
    value = cfg.get(key, {})
    if not isinstance(value, dict):
        raise TaskFormatError(file, key, f"expected a table, got {type(value).__name__}")
    return value


def _number(table: dict[str, Any], key: str, default: float, file: Path, field: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskFormatError(file, field, f"expected a positive number, got {value!r}")
    return float(value)


def _bool(table: dict[str, Any], key: str, default: bool, file: Path, field: str) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise TaskFormatError(file, field, f"expected true or false, got {value!r}")
    return value


def _workdir(dockerfile: Path) -> str:
    """The last WORKDIR of the Dockerfile (the agent starts where the image author expected), else /app."""
    workdir = _DEFAULT_WORKDIR
    for line in dockerfile.read_text().splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == "WORKDIR" and parts[1].startswith("/"):
            workdir = parts[1].strip().strip("\"'")
    return workdir


def _verifier_kind(tests_dir: Path, test_sh: Path | None) -> tuple[VerifierKind, tuple[str, ...]]:
    if not tests_dir.is_dir():
        raise TaskFormatError(tests_dir, "tests", "tests/ directory is missing")
    files = sorted(p for p in tests_dir.rglob("test_*.py") if p.is_file())
    if files:
        ids = tuple(i for f in files for i in static_test_ids(f, tests_dir))
        if not ids:
            raise TaskFormatError(files[0], "tests", "no test functions (def test_*) in tests/test_*.py")
        return "pytest", ids
    if test_sh is None:
        raise TaskFormatError(tests_dir, "tests", "no tests/test_*.py and no tests/test.sh")
    return "script", ()


def static_test_ids(file: Path, tests_dir: Path) -> list[str]:
    """Test ids pytest would collect from `file` without parametrization (read with `ast`, never imported)."""
    rel = file.relative_to(tests_dir).as_posix()
    try:
        tree = ast.parse(file.read_text(), filename=str(file))
    except SyntaxError as e:
        raise TaskFormatError(file, "tests", f"syntax error at line {e.lineno}: {e.msg}") from e
    ids = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            ids.append(f"{rel}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            ids.extend(f"{rel}::{node.name}::{m.name}" for m in node.body
                       if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test"))
    return ids
