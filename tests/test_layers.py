"""The house has floors, a folder each, and imports only go down (ARCHITECTURE.md):

    {t1config, t1kernels}  <-  t1model  <-  {sandbox, rollout}  <-  t1core  <-  t1cli  <-  bench

sandbox needs neither torch nor the model (nor rollout). t1cli, the `t1` command and the tools off the training path
(planner, simulator, experiments), may import every floor below it; only bench, which measures what the planner
predicts, imports it. Read from the source: every import, function-level ones included, relative ones
(`from . import x`, `from ..t1core import train`) resolved against their package, and `importlib.import_module` /
`__import__` strings. A call with a computed name (`import_module(_EXPORTS[n])`) counts every string in that file
that names a project module. So a cycle or an upward import fails here before anyone has to untangle it.

sandbox has wings of its own, imports again only going down (STYLE.md 18):

    sandbox.tasks  <-  sandbox.images  <-  sandbox.runtime

beside sandbox's shared modules (errors, cli, daemon), which import no wing, and its entry points at the top, which
no wing imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"t1config": 0, "t1kernels": 0, "t1model": 1, "sandbox": 2, "rollout": 2, "t1core": 3, "t1cli": 4, "bench": 5}
"""Folder -> floor: a module may import its own floor's folder and the floors below, never above."""
SIDEWAYS_FORBIDDEN = {"sandbox": {"rollout"}}
"""Same-floor imports that are still refused: sandboxes run where no engine (and no torch) is."""
SANDBOX_WINGS = {"sandbox.tasks": 0, "sandbox.images": 1, "sandbox.runtime": 2}
"""sandbox's wing -> its rank: task formats, then images (a task image is built from a Task), then the runtime (a
sandbox starts from a TaskImage; the verifier runs in one). A wing imports its own rank and the ranks below."""
SANDBOX_SHARED = {"sandbox.errors", "sandbox.cli", "sandbox.daemon"}
"""sandbox's top-level modules that every wing may import; they import only each other. Every other module at the top
is an entry point (`python -m sandbox.X`), which may import any wing and which no wing imports."""


def _floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def _modules(root: Path = ROOT, packages: tuple[str, ...] = tuple(FLOORS)) -> dict[str, Path]:
    out = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _import_names(module: str, path: Path) -> list[str]:
    """Every module name the file imports, absolute: import statements (relative ones resolved), import_module and
    __import__ with a literal name, and, where such a call has a computed name, every string constant."""
    tree = ast.parse(path.read_text())
    names: list[str] = []
    computed = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package_of(module, path).split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names += ([base] if base else []) + [f"{base}.{a.name}" if base else a.name for a in node.names]
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
                if name.startswith("."):  # import_module(".x", package=...): relative to this package
                    level = len(name) - len(name.lstrip("."))
                    parts = _package_of(module, path).split(".")
                    name = ".".join(parts[:len(parts) - (level - 1)] + [name.lstrip(".")]).rstrip(".")
                names.append(name)
            else:
                computed = True
    if computed:
        names += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and n.value.replace(".", "").replace("_", "").isalnum()]
    return names


def _is_import_call(func: ast.expr) -> bool:
    return ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id in ("import_module", "__import__")))


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name resolves to the longest module prefix it names)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {module: {t for t in map(resolve, _import_names(module, path)) if t and t != module}
            for module, path in modules.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets
                  if _floor(t) > _floor(m) or t.split(".")[0] in SIDEWAYS_FORBIDDEN.get(m.split(".")[0], ()))


def _wing(module: str) -> str | None:
    return next((w for w in SANDBOX_WINGS if module == w or module.startswith(w + ".")), None)


def _sandbox_wing_violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports inside sandbox that break its wings' order: a wing importing a wing above it or an entry point, a
    shared module importing anything but the shared ones."""
    out = []
    for module, targets in edges.items():
        wing = _wing(module)
        for target in targets:
            if target.split(".")[0] != "sandbox" or target in SANDBOX_SHARED:
                continue
            above = wing is not None and (_wing(target) is None or SANDBOX_WINGS[_wing(target)] > SANDBOX_WINGS[wing])
            if module in SANDBOX_SHARED or above:
                out.append(f"{module} -> {target}")
    return sorted(out)


def test_no_import_cycle_between_project_modules() -> None:
    assert not _cycles(_imports(_modules()))


def test_imports_only_go_down() -> None:
    upward = _upward(_imports(_modules()))
    assert not upward, upward


def test_sandbox_needs_neither_torch_nor_the_model() -> None:
    """Sandboxes run on hosts without torch (a remote Docker box, a task checker)."""
    offenders = [f"{module}: {n}" for module, path in _modules().items() if module.split(".")[0] == "sandbox"
                 for n in _import_names(module, path)
                 if n.split(".")[0] in ("torch", "t1kernels", "t1model", "t1core", "rollout", "t1cli")]
    assert not offenders, offenders


def test_the_config_schema_stands_alone() -> None:
    """t1config is the schema every floor's sections are written in: plain Python, no project or torch import, so the
    sandbox (which has no torch) can define its section with it."""
    offenders = [f"{module}: {n}" for module, path in _modules().items() if module.split(".")[0] == "t1config"
                 for n in _import_names(module, path) if n.split(".")[0] in set(FLOORS) - {"t1config"} | {"torch"}]
    assert not offenders, offenders


def test_sandbox_wings_import_only_down() -> None:
    violations = _sandbox_wing_violations(_imports(_modules()))
    assert not violations, violations


def test_sandbox_top_holds_shared_modules_and_entry_points() -> None:
    """Everything else lives in a wing (a module put at the top would escape the wings' order)."""
    top = {module: path for module, path in _modules(packages=("sandbox",)).items() if module.count(".") == 1}
    strays = sorted(module for module, path in top.items() if _wing(module) is None and module not in SANDBOX_SHARED
                    and 'if __name__ == "__main__":' not in path.read_text())
    assert not strays, strays


def test_the_trainer_package_runs_only_the_trainer() -> None:
    """Tools off the training path (planner, simulator, experiments) live in t1cli, behind the `t1` command: the
    trainer's package has one entry point, the trainer."""
    mains = sorted(module for module, path in _modules().items() if module.split(".")[0] == "t1core"
                   and 'if __name__ == "__main__":' in path.read_text())
    assert mains == ["t1core.train"]


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _sandbox_wing_violations({
        "sandbox.tasks.format": {"sandbox.errors", "sandbox.images.tarball"},
        "sandbox.images.task_images": {"sandbox.tasks.format", "sandbox.daemon", "sandbox.run_task"},
        "sandbox.runtime.pool": {"sandbox.images.image_cache", "sandbox.tasks", "sandbox.runtime.settings"},
        "sandbox.daemon": {"sandbox.errors", "sandbox.runtime.shell"},
        "sandbox.run_task": {"sandbox.runtime.verify", "sandbox.images.task_images"},
    }) == ["sandbox.daemon -> sandbox.runtime.shell", "sandbox.images.task_images -> sandbox.run_task",
           "sandbox.tasks.format -> sandbox.images.tarball"]
    assert _floor("bench.test_bench_ep") > _floor("t1cli.plan") > _floor("t1core.train") > _floor("rollout.agent") \
        > _floor("t1model.model") > _floor("t1kernels.moe")


def test_the_checker_sees_every_form_of_import(tmp_path: Path) -> None:
    """One file per form, each an upward import the checker must report."""
    files = {
        "t1kernels/__init__.py": "",
        "t1kernels/plain.py": "import t1model.model\n",
        "t1kernels/from_.py": "from t1core.train import main\n",
        "t1kernels/in_function.py": "def f():\n    from rollout import agent\n",
        "t1model/__init__.py": "",
        "t1model/model.py": "",
        "t1model/relative.py": "from ..t1core import train\n",
        "t1model/dot.py": "from . import model\n",  # same floor: allowed
        "t1model/literal.py": "import importlib\nimportlib.import_module('t1core.train')\n",
        "t1model/dunder.py": "__import__('rollout.agent')\n",
        "t1model/computed.py": "import importlib\nNAMES = {'a': 't1core.train'}\n"
                               "def get(n):\n    return importlib.import_module(NAMES[n])\n",
        "sandbox/__init__.py": "",
        "sandbox/sideways.py": "from rollout.agent import run\n",
        "rollout/__init__.py": "",
        "rollout/agent.py": "",
        "t1core/__init__.py": "",
        "t1core/train.py": "",
        "bench/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = _imports(_modules(tmp_path))
    assert edges["t1model.dot"] == {"t1model", "t1model.model"}  # the package runs first, then the module
    assert _upward(edges) == sorted([
        "t1kernels.plain -> t1model.model", "t1kernels.from_ -> t1core.train", "t1kernels.in_function -> rollout",
        "t1kernels.in_function -> rollout.agent", "t1model.relative -> t1core", "t1model.relative -> t1core.train",
        "t1model.literal -> t1core.train", "t1model.dunder -> rollout.agent", "t1model.computed -> t1core.train",
        "sandbox.sideways -> rollout.agent"])
