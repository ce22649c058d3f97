"""Test-time dependencies: what a task's test script installs before it runs the tests.

Terminal-Bench 1's `run-tests.sh` and Harbor's `tests/test.sh` install their test dependencies at
verification time from the internet (`uv add pandas`, `uvx -w numpy pytest ...`, `pip install requests`,
`apt-get install -y jq`). T1 runs the tests itself with the image's own Python (sandbox.runtime.verify), offline, so
those packages are read from the script here and installed at image build (sandbox.images.task_images). What the harness
only needed for its own download (uv, curl, pytest and its reporting plugins: the image carries pytest and T1
reads JUnit XML) is left out.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

# Installed by the harness for its own machinery, not by the tests: never baked in.
_HARNESS_PIP = re.compile(r"^(pytest([-_].*)?|uv|pip|setuptools|wheel)([<>=!~\[;].*)?$", re.IGNORECASE)
_HARNESS_APT = frozenset({"curl", "ca-certificates", "wget", "python3-pip", "python3-pytest"})
# Options that take a value (the value is not a package).
_VALUE_OPTS = frozenset({"-p", "--python", "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c",
                         "--constraint", "-t", "--target", "--prefix", "--root", "--group", "--optional",
                         "--package", "--directory", "--project", "-o", "--option", "--default-index", "--index"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TestDeps:
    """Packages a test script installs: Python packages (pip requirement specifiers) and Debian packages."""

    __test__ = False  # not a pytest test class despite the name

    pip: tuple[str, ...] = ()
    """Requirement specifiers, as written ('pandas', 'numpy==2.1.0')."""
    apt: tuple[str, ...] = ()
    """Debian package names."""
    unreadable: tuple[str, ...] = ()
    """Install commands this reader cannot turn into packages (requirement files, editable installs)."""
    setup: str = ""
    """The script's other steps before its test run (copy a fixture into /app, unpack test data), as bash:
    T1 runs them before the tests (`setup_steps`)."""

    def __bool__(self) -> bool:
        return bool(self.pip or self.apt)


def parse_test_deps(script: str) -> TestDeps:
    """The packages `script` (bash text) installs with uv, uvx, pip or apt-get, in order, without repeats."""
    pip: list[str] = []
    apt: list[str] = []
    unreadable: list[str] = []
    variables: dict[str, str] = {}
    for words in _commands(script):
        if not words:
            continue
        if all(_ASSIGNMENT.match(w) for w in words):  # COMMIT=34bb... names a pin used further down
            for word in words:
                name, _, value = word.partition("=")
                variables[name] = _expand(value, variables)
            continue
        words = [_expand(w, variables) for w in words]
        kind, args = _install_args(words)
        if kind == "with":
            for value in _option_values(words, ("-w", "--with")):
                pip.extend(v for v in value.split(",") if v)
            continue
        if kind is None:
            continue
        packages = _positionals(args)
        if kind == "pip" and any(a in ("-r", "--requirement", "-e", "--editable") or
                                 a.startswith(("-r", "--requirement=", "-e", "--editable=")) for a in args):
            unreadable.append(" ".join(words))
            continue
        (apt if kind == "apt" else pip).extend(packages)
    # A word still holding a variable ($PKG, a pin set outside the script) names no package this reader knows.
    unreadable += [p for p in dict.fromkeys(pip + apt) if "$" in p]
    pip = [p for p in dict.fromkeys(pip) if not _HARNESS_PIP.match(p) and "$" not in p and not p.startswith(("/", "."))]
    apt = [p for p in dict.fromkeys(apt) if p not in _HARNESS_APT and "$" not in p]
    return TestDeps(pip=tuple(pip), apt=tuple(apt), unreadable=tuple(unreadable), setup=setup_steps(script))


_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))")


def _expand(word: str, variables: dict[str, str]) -> str:
    """`word` with $NAME and ${NAME} replaced for the names the script assigned (others are left as written)."""
    return _VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), word)


# The harness's own steps: installing (baked in at build), fetching and activating uv, and talking.
_HARNESS_STEP = re.compile(r"^(?:sudo\s+)?(?:apt-get|apt|curl|wget|pip3?|python3?\s+-m\s+pip|uv|uvx|source|\.|"
                           r"echo|printf|exit|set)\b")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_BLOCK_OPEN = re.compile(r"^(?:if|case|for|while|until)\b")
_BLOCK_CLOSE = re.compile(r"(?:^|[;&|]\s*)(?:fi|esac|done|\})\s*$")
_TEST_RUN = re.compile(r"\b(?:pytest|uvx|uv\s+run)\b")


def setup_steps(script: str) -> str:
    """The lines of a test script before its test run (the first line naming pytest, uvx or `uv run`) that
    are not the harness's own steps (installs, uv, messages) nor inside an if/case block (a check of the
    working directory, say); "" when there are none. T1 runs pytest itself and skips the script, so these
    (`cp /tests/test.py /app/`, `tar -xzf /tests/data.tar.gz -C /tests`) would otherwise be lost."""
    steps: list[str] = []
    depth, heredoc, keep = 0, None, False
    for raw in script.replace("\\\n", " ").splitlines():
        if heredoc is not None:  # a here-document's body goes through as it is, up to its delimiter
            if keep:
                steps.append(raw)
            heredoc = None if raw.strip() == heredoc else heredoc
            continue
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if _TEST_RUN.search(line):
            break
        opens = bool(_BLOCK_OPEN.match(line)) or line.endswith(("{", "then", "do"))
        closes = bool(_BLOCK_CLOSE.search(line))
        keep = depth == 0 and not opens and not _HARNESS_STEP.match(line)
        depth = max(0, depth + opens - closes)
        if keep:
            steps.append(line)
        here = _HEREDOC.search(line)
        heredoc = here.group(1) if here else None
    return "\n".join(steps)


def _commands(script: str) -> list[list[str]]:
    """Simple commands of `script`: continuation lines joined, comments dropped, split at ; && || | and
    newlines; each as its words (a segment shlex cannot split is skipped; VAR=value prefixes and sudo dropped,
    a command of assignments alone kept as they are)."""
    text = script.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for segment in re.split(r"\s*(?:;|&&|\|\||\|)\s*", line):
            try:
                words = shlex.split(segment, comments=True)
            except ValueError:
                continue
            if words and all(_ASSIGNMENT.match(w) for w in words):  # assignments alone: kept, they set variables
                out.append(words)
                continue
            while words and ("=" in words[0] and not words[0].startswith("-") or words[0] in ("sudo", "exec")):
                words = words[1:]  # VAR=value prefixes, sudo
            out.append(words)
    return out


def _install_args(words: list[str]) -> tuple[str | None, list[str]]:
    """('pip' | 'apt', the arguments after the install verb), ('with', []) for uv run / uvx, else (None, [])."""
    prog = words[0].rsplit("/", 1)[-1]
    rest = words[1:]
    if prog.startswith("python") and rest[:2] == ["-m", "pip"]:
        prog, rest = "pip", rest[2:]
    if prog in ("pip", "pip3") or re.fullmatch(r"pip3\.\d+", prog):
        return ("pip", rest[1:]) if rest[:1] == ["install"] else (None, [])
    if prog == "uv":
        if rest[:1] == ["add"]:
            return "pip", rest[1:]
        if rest[:2] == ["pip", "install"]:
            return "pip", rest[2:]
        if rest[:1] == ["run"] or rest[:2] == ["tool", "run"]:
            return "with", []
        return None, []
    if prog == "uvx":
        return "with", []
    if prog in ("apt-get", "apt"):
        for i, w in enumerate(rest):
            if w == "install":
                return "apt", rest[i + 1:]
    return None, []


def _positionals(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in _VALUE_OPTS
        else:
            out.append(a)
    return out


def _option_values(words: list[str], names: tuple[str, ...]) -> list[str]:
    values = []
    for i, w in enumerate(words):
        if w in names and i + 1 < len(words):
            values.append(words[i + 1])
        else:
            for n in names:
                if n.startswith("--") and w.startswith(n + "="):
                    values.append(w[len(n) + 1:])
    return values
