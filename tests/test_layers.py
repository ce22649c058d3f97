"""The house has floors and imports only go down (ARCHITECTURE.md): kernels -> the model layer -> sandbox and
rollout -> the trainer -> bench. Read from the source (every import, function-level ones included), so a cycle
or an upward import fails here before anyone has to untangle it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "t1core", "rollout", "sandbox")
MODEL_LAYER = {"t1core", "t1core.model", "t1core.attention", "t1core.block_attention", "t1core.decode_attention",
               "t1core.tokenizer", "t1core.hf_io", "t1core.cpu_threads", "t1core.device"}
"""The floor above kernels: the policy's math, its tokenizer and its HF files. The rest of t1core is the trainer."""


def _floor(module: str) -> int:
    top = module.split(".")[0]
    if top == "kernels":
        return 0
    if top == "t1core":
        return 1 if module in MODEL_LAYER else 3
    return 2  # sandbox, rollout


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name resolves to the longest module prefix it names)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets |= {t for t in map(resolve, names) if t and t != module}
        edges[module] = targets
    return edges


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


def test_no_import_cycle_between_project_modules() -> None:
    assert not _cycles(_imports(_modules()))


def test_imports_only_go_down() -> None:
    edges = _imports(_modules())
    upward = sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets
                    if _floor(t) > _floor(m) or (_floor(m) == 2 and m.split(".")[0] == "sandbox"
                                                 and t.split(".")[0] == "rollout"))
    assert not upward, upward


def test_sandbox_needs_neither_torch_nor_the_model() -> None:
    """Sandboxes run on hosts without torch (a remote Docker box, a task checker)."""
    offenders = []
    for module, path in _modules().items():
        if module.split(".")[0] != "sandbox":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in ("torch", "t1core", "rollout")]
    assert not offenders, offenders


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _floor("t1core.train") > _floor("rollout.agent") > _floor("t1core.model") > _floor("kernels.moe")
