"""Task directories: load Terminal-Bench 1 and Harbor (Terminal-Bench 2) layouts into one `Task`.

Harbor layout                          Terminal-Bench 1 layout
  task.toml   [agent] [verifier]         task.yaml   instruction, max_agent_timeout_sec,
              [environment] [metadata]               max_test_timeout_sec, difficulty, category, ...
  instruction.md                         Dockerfile, or docker-compose.yaml whose agent service's
  environment/Dockerfile (+ context)                 build section names the context and Dockerfile (its
                                                     other services run beside the sandbox: sandbox.tasks.compose)
  solution/solve.sh (+ helper files)     solution.sh, or solution.yaml (a list of `command:` entries)
  tests/test.sh, tests/test_*.py         run-tests.sh, tests/test_*.py

The test scripts (run-tests.sh, test.sh) are not run when tests/test_*.py exist: they install pytest from the
internet. The packages they install for the tests are read from them (sandbox.tasks.test_deps) and baked into the
task's image. The working directory is the Dockerfile's last WORKDIR, else the one its FROM image sets
(Terminal-Bench's own base images set /app), else `/`, as in Docker; the verifiers run there too.

How a task is verified (see sandbox.runtime.verify): when `tests/` holds `test_*.py` files they are run with pytest
and every test case is one verifier; otherwise Harbor's `tests/test.sh` runs and the reward file it writes is
read, or TB1's `run-tests.sh` runs and its exit status is the one verifier. A malformed task raises
`TaskFormatError` naming the file and the field.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import posixpath
import re
import tomllib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sandbox.errors import TaskFormatError
from sandbox.tasks.test_deps import TestDeps, parse_test_deps

if TYPE_CHECKING:
    from sandbox.tasks.compose import Compose

Layout = Literal["harbor", "tb1"]
VerifierKind = Literal["pytest", "script"]
NetworkMode = Literal["asked", "harness"]
NETWORK_MODES: tuple[NetworkMode, ...] = ("asked", "harness")

# Terminal-Bench 1 defaults (its task.yaml schema) and Harbor's usual ones.
_TB1_AGENT_TIMEOUT_S = 360.0
_TB1_TEST_TIMEOUT_S = 60.0
_HARBOR_AGENT_TIMEOUT_S = 600.0
_HARBOR_VERIFIER_TIMEOUT_S = 120.0
_HARBOR_BUILD_TIMEOUT_S = 600.0
_DEFAULT_CPUS = 1.0
_DEFAULT_MEMORY_MB = 2048
# Working directories that FROM images set themselves (a Dockerfile without WORKDIR inherits them). Images not
# listed here set none: Docker's default is /.
INHERITED_WORKDIRS = {"ghcr.io/laude-institute/t-bench/*": "/app", "laude-institute/t-bench/*": "/app"}
# Harbor's task.toml keys (schema 1.x, deprecated spellings included); anything else is warned about.
_HARBOR_KEYS = {
    "": {"version", "schema_version", "source", "metadata", "verifier", "agent", "environment", "solution"},
    "verifier": {"timeout_sec", "env"},
    "agent": {"timeout_sec", "env"},
    "solution": {"env"},
    "environment": {"build_timeout_sec", "docker_image", "cpus", "memory", "memory_mb", "storage", "storage_mb",
                    "gpus", "gpu_types", "allow_internet", "network", "env", "mcp_servers"},
}
_MB_PER_UNIT = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 ** 2, "": 1.0}  # a bare number: MiB
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


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
    """Whether the sandbox gets a network: only when the task asks for one (Harbor `allow_internet` or `network`
    = true). Terminal-Bench's harnesses give every container a network unless told otherwise; T1 does not, since
    the agent is untrusted code (a solution that downloads at solve time needs its task to ask)."""
    harness_network: bool = False
    """Whether the format's own harness gives the sandbox a network (`sandbox_network(task, "harness")`):
    Terminal-Bench 1 always does (task.yaml cannot say otherwise); Harbor does unless `allow_internet` (or
    `network`) is false, its default being true."""
    workdir: str
    """Working directory of the agent's shell and the verifiers: the Dockerfile's last WORKDIR, else its FROM
    image's (INHERITED_WORKDIRS), else /."""
    dockerfile_dir: Path
    """Docker build context (holds the Dockerfile)."""
    dockerfile: Path
    """The Dockerfile inside `dockerfile_dir`."""
    solution_script: Path | None
    """Reference solution: solve.sh, solution.sh or solution.yaml (see `reference_solution`); None: none."""
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
    solution_dir: Path | None = None
    """Harbor's solution/ folder, uploaded to /solution before solve.sh runs (it may hold helper files)."""
    storage_mb: int | None = None
    """Disk the task asks for (Harbor `storage`/`storage_mb`); recorded, not enforced (see sandbox.check_tasks)."""
    build_timeout_s: float = _HARBOR_BUILD_TIMEOUT_S
    """Wall-clock limit of the image build."""
    verifier_env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the verifier run (Harbor [verifier] env)."""
    solution_env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the reference solution (Harbor [solution] env)."""
    test_deps: TestDeps = TestDeps()
    """Packages the task's test script installs for the tests; baked into the image at build."""
    family: str = ""
    """The task family a generated instance belongs to ([metadata] family, written by `sandbox.tasks.suite`); a task
    without one is its own family (`family_name`)."""
    category: str = ""
    """Free-form category from the task's metadata."""
    difficulty: str = ""
    """Free-form difficulty from the task's metadata."""
    compose: Compose | None = None
    """A TB1 task's docker-compose.yaml: the agent's service (its environment, resolver settings) and the services
    started beside the sandbox on a private network (`sandbox.runtime.services`)."""

    @property
    def family_name(self) -> str:
        """The family, or the task's own name when it has none."""
        return self.family or self.name

    def __post_init__(self) -> None:
        if self.agent_timeout_s <= 0 or self.verifier_timeout_s <= 0:
            raise ValueError(f"task {self.name}: timeouts must be > 0, got agent={self.agent_timeout_s} "
                             f"verifier={self.verifier_timeout_s}")
        if self.cpus <= 0 or self.memory_mb <= 0:
            raise ValueError(f"task {self.name}: expected cpus > 0 and memory_mb > 0, got {self.cpus}, "
                             f"{self.memory_mb}")
        if self.build_timeout_s <= 0:
            raise ValueError(f"task {self.name}: build_timeout_s must be > 0, got {self.build_timeout_s}")


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


def find_task_dirs(path: str | Path) -> list[Path]:
    """`path` itself when it is a task directory (task.toml / task.yaml), else every task directory directly under
    it, by name (a benchmark's layout); ValueError naming `path` when it holds none."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory of tasks")
    if _is_task_dir(root):
        return [root]
    found = [p for p in sorted(root.iterdir()) if _is_task_dir(p)]
    if not found:
        raise ValueError(f"{root}: no task directories (task.toml / task.yaml) in it")
    return found


def load_task_dirs(path: str | Path) -> list[Task]:
    """The tasks of `find_task_dirs(path)`."""
    return [load_task(p) for p in find_task_dirs(path)]


def _is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "task.yaml").is_file()


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
    _warn_unknown_keys(cfg, toml_path)

    instr_path = root / "instruction.md"
    if not instr_path.is_file():
        raise TaskFormatError(instr_path, "instruction", "instruction.md is missing")
    instruction = instr_path.read_text().strip()
    if not instruction:
        raise TaskFormatError(instr_path, "instruction", "is empty")

    env_dir = root / "environment"
    dockerfile = env_dir / "Dockerfile"
    if not dockerfile.is_file():
        prebuilt = env.get("docker_image")
        raise TaskFormatError(dockerfile, "environment", "environment/Dockerfile is missing" + (
            f"; the task names the prebuilt image {prebuilt!r} instead, which T1 does not pull (no registry): "
            f"write a Dockerfile `FROM {prebuilt}` after `docker load`-ing it" if prebuilt else ""))
    tests_dir = root / "tests"
    test_sh = tests_dir / "test.sh"
    kind, ids = _verifier_kind(tests_dir, test_sh if test_sh.is_file() else None)
    solution = root / "solution" / "solve.sh"
    storage = _size_mb(env, ("storage_mb", "storage"), toml_path)
    network = _bool(env, "allow_internet", _bool(env, "network", False, toml_path, "environment.network"),
                    toml_path, "environment.allow_internet")
    return Task(
        name=_task_name(root),
        path=root,
        layout="harbor",
        instruction=instruction,
        agent_timeout_s=_number(agent, "timeout_sec", _HARBOR_AGENT_TIMEOUT_S, toml_path, "agent.timeout_sec"),
        verifier_timeout_s=_number(verifier, "timeout_sec", _HARBOR_VERIFIER_TIMEOUT_S, toml_path,
                                   "verifier.timeout_sec"),
        cpus=_number(env, "cpus", _DEFAULT_CPUS, toml_path, "environment.cpus"),
        memory_mb=_size_mb(env, ("memory_mb", "memory"), toml_path) or _DEFAULT_MEMORY_MB,
        network=network,
        harness_network=_bool(env, "allow_internet", _bool(env, "network", True, toml_path, "environment.network"),
                              toml_path, "environment.allow_internet"),
        workdir=_workdir(dockerfile),
        dockerfile_dir=env_dir,
        dockerfile=dockerfile,
        solution_script=solution if solution.is_file() else None,
        solution_dir=solution.parent if solution.is_file() else None,
        tests_dir=tests_dir,
        test_script=test_sh if test_sh.is_file() else None,
        verifier_kind=kind,
        num_static_tests=len(ids),
        static_test_ids=ids,
        storage_mb=storage,
        build_timeout_s=_number(env, "build_timeout_sec", _HARBOR_BUILD_TIMEOUT_S, toml_path,
                                "environment.build_timeout_sec"),
        verifier_env=_env_table(verifier, toml_path, "verifier.env"),
        solution_env=_env_table(_table(cfg, "solution", toml_path), toml_path, "solution.env"),
        test_deps=_test_deps(kind, test_sh if test_sh.is_file() else None),
        family=str(meta.get("family", "")),
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
    context, dockerfile, compose = _tb1_build(root)
    tests_dir = root / "tests"
    run_tests = root / "run-tests.sh"
    ids = _test_ids(tests_dir)
    if not ids:
        # Graded by what run-tests.sh prints. With the pytest parser that is pytest's own report of the tests the
        # script runs (the SWE-bench tasks patch a repository's tests in and run them; their tests/ is absent or
        # a placeholder), so the script's exit status is the one verifier. Other parsers read their tool's output.
        parser = cfg.get("parser_name", "pytest")
        if parser != "pytest" or not run_tests.is_file():
            raise TaskFormatError(tests_dir, "tests", f"no test functions in tests/test_*.py: the task is graded by "
                                  f"scraping what run-tests.sh prints (parser {parser!r}), which T1 does not do "
                                  "(its verifiers are pytest's own results, a Harbor reward file, or run-tests.sh's "
                                  "exit status)")
    kind: VerifierKind = "pytest" if ids else "script"
    solution = next((p for p in (root / "solution.sh", root / "solution.yaml") if p.is_file()), None)
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
        network=False,  # task.yaml cannot ask for one; Terminal-Bench's harness gives one, T1 does not
        harness_network=True,
        workdir=_workdir(dockerfile),
        dockerfile_dir=context,
        dockerfile=dockerfile,
        solution_script=solution,
        tests_dir=tests_dir,
        test_script=run_tests if run_tests.is_file() else None,
        verifier_kind=kind,
        num_static_tests=len(ids),
        static_test_ids=ids,
        test_deps=_test_deps(kind, run_tests if run_tests.is_file() else None),
        category=str(cfg.get("category", "")),
        difficulty=str(cfg.get("difficulty", "")),
        compose=compose,
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
    """The working directory of the Dockerfile's last stage, as Docker resolves it: WORKDIR lines (a relative
    one joins the previous), starting from what the FROM image sets (INHERITED_WORKDIRS), else /."""
    workdir = "/"
    for line in dockerfile.read_text().splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) != 2:
            continue
        word, rest = parts[0].upper(), parts[1].strip()
        if word == "FROM":
            image = next((w for w in rest.split() if not w.startswith("--")), "")
            workdir = inherited_workdir(image) or "/"
        elif word == "WORKDIR" and "$" not in rest:
            workdir = posixpath.normpath(posixpath.join(workdir, rest.strip("\"'")))
    return workdir


def inherited_workdir(image: str) -> str | None:
    """The WORKDIR that the image `image` (a FROM reference) sets, when it is one T1 knows of."""
    for pattern, workdir in INHERITED_WORKDIRS.items():
        if fnmatch.fnmatchcase(image, pattern):
            return workdir
    return None


def sandbox_network(task: Task, mode: NetworkMode) -> bool:
    """Whether `task`'s sandbox gets a network. 'asked' (T1's default: the agent is untrusted code): only when
    the task asks for one. 'harness' (faithful to the task's own format): as its harness would give it."""
    if mode not in NETWORK_MODES:
        raise ValueError(f"network mode: expected one of {NETWORK_MODES}, got {mode!r}")
    return task.harness_network if mode == "harness" else task.network


def reference_solution(task: Task) -> str | None:
    """The reference solution as bash text: solve.sh / solution.sh as they are; a TB1 solution.yaml's commands
    in order, one per line (Terminal-Bench types each into one shell and waits for it)."""
    path = task.solution_script
    if path is None:
        return None
    if path.suffix != ".yaml":
        return path.read_text()
    import yaml  # PyYAML: only the TB1 layout needs it

    try:
        entries = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TaskFormatError(path, "yaml", f"invalid YAML: {e}") from e
    if not isinstance(entries, list) or not entries:
        raise TaskFormatError(path, "commands", "expected a non-empty list of {command: ...} entries")
    lines = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("command"), str):
            raise TaskFormatError(path, f"[{i}].command", f"expected a string, got {entry!r:.80}")
        lines.append(entry["command"].rstrip("\n"))
    return "\n".join(lines) + "\n"


def _tb1_build(root: Path) -> tuple[Path, Path, Compose | None]:
    """(build context, Dockerfile, compose file) of a TB1 task: ./Dockerfile, else the build section of the
    agent's service in docker-compose.yaml (`sandbox.tasks.compose`), whose other services run beside the sandbox."""
    from sandbox.tasks.compose import load_compose

    dockerfile = root / "Dockerfile"
    path = next((p for p in (root / "docker-compose.yaml", root / "docker-compose.yml") if p.is_file()), None)
    if path is None:
        if not dockerfile.is_file():
            raise TaskFormatError(dockerfile, "Dockerfile", "Dockerfile is missing (and no docker-compose.yaml)")
        return root, dockerfile, None
    compose = load_compose(path, root)
    agent = compose.agent
    if agent.context is None or agent.dockerfile is None:
        if not dockerfile.is_file():
            raise TaskFormatError(path, f"services.{agent.name}.build", f"no build section and no Dockerfile; the "
                                  f"service runs the prebuilt image {agent.image!r}, which must be loaded locally")
        return root, dockerfile, compose
    return agent.context, agent.dockerfile, compose


def _test_deps(kind: VerifierKind, script: Path | None) -> TestDeps:
    """What the test script installs, when T1 runs pytest itself instead of the script."""
    return parse_test_deps(script.read_text()) if kind == "pytest" and script is not None else TestDeps()


def _warn_unknown_keys(cfg: dict[str, Any], file: Path) -> None:
    unknown = [k for k in cfg if k not in _HARBOR_KEYS[""]]
    for table in ("verifier", "agent", "solution", "environment"):
        if isinstance(cfg.get(table), dict):
            unknown += [f"{table}.{k}" for k in cfg[table] if k not in _HARBOR_KEYS[table]]
    if unknown:
        warnings.warn(f"{file}: unknown keys ignored: {', '.join(unknown)}", stacklevel=3)
    if (cfg.get("environment") or {}).get("mcp_servers"):
        warnings.warn(f"{file}: environment.mcp_servers are not started (T1 runs one container per task)",
                      stacklevel=3)
    gpus = (cfg.get("environment") or {}).get("gpus", 0)
    if isinstance(gpus, int) and gpus > 0:
        warnings.warn(f"{file}: environment.gpus = {gpus}: T1's sandboxes have no GPU", stacklevel=3)


def _size_mb(table: dict[str, Any], keys: tuple[str, str], file: Path) -> int | None:
    """Harbor sizes: `<key>_mb` as a number of MiB, or the deprecated string form ('4G', '512M', '2Gi')."""
    mb_key, str_key = keys
    if mb_key in table:
        return int(_number(table, mb_key, 1, file, f"environment.{mb_key}"))
    if str_key not in table:
        return None
    value = table[str_key]
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise TaskFormatError(file, f"environment.{str_key}", f"expected a size like '4G' or '512M', got {value!r}")
    mb = float(m.group(1)) * _MB_PER_UNIT[m.group(2).upper()]
    if mb < 1:
        raise TaskFormatError(file, f"environment.{str_key}", f"expected at least 1 MiB, got {value!r}")
    return int(mb)


def _env_table(table: dict[str, Any], file: Path, field: str) -> tuple[tuple[str, str], ...]:
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, (str, int, float, bool)) for v in env.values()):
        raise TaskFormatError(file, field, f"expected a table of strings, got {env!r:.80}")
    return tuple((str(k), str(v)) for k, v in env.items())


def _test_ids(tests_dir: Path) -> tuple[str, ...]:
    """The static ids of the test functions in tests_dir's test_*.py files; () when it has none or is absent."""
    files = sorted(p for p in tests_dir.rglob("test_*.py") if p.is_file()) if tests_dir.is_dir() else []
    return tuple(i for f in files for i in static_test_ids(f, tests_dir))


def _verifier_kind(tests_dir: Path, test_sh: Path | None) -> tuple[VerifierKind, tuple[str, ...]]:
    if not tests_dir.is_dir():
        raise TaskFormatError(tests_dir, "tests", "tests/ directory is missing")
    files = sorted(p for p in tests_dir.rglob("test_*.py") if p.is_file())
    if files:
        ids = _test_ids(tests_dir)
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
        if _is_test_function(node):
            ids.append(f"{rel}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            ids.extend(f"{rel}::{node.name}::{m.name}" for m in node.body if _is_test_function(m))
    return ids


def _is_test_function(node: ast.stmt) -> bool:
    """A `def test*` that is not a fixture (`@pytest.fixture def test_data()` is one: pytest collects no test)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.name.startswith("test"):
        return False
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")) == "fixture":
            return False
    return True
