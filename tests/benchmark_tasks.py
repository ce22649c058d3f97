"""Small Harbor-format task directories written by the tests: a benchmark whose outcome does not depend on the
policy (one task every attempt resolves, one none does, one half of whose tests pass), so that resolved rates and
their intervals are known in advance even for an untrained model."""

from __future__ import annotations

import textwrap
from pathlib import Path

_TOML = """\
version = "1.0"

[metadata]
category = "test"

[agent]
timeout_sec = {timeout}

[verifier]
timeout_sec = 60

[environment]
cpus = 1
memory_mb = 512
"""

BENCHMARK: dict[str, tuple[str, str]] = {
    "probe-os": ("Tell me which operating system this machine runs.", """
        from pathlib import Path

        def test_os_release_exists():
            assert Path("/etc/os-release").is_file()
        """),
    "probe-flag": ("Write the word ready into /tmp/flag.txt.", """
        from pathlib import Path

        def test_flag():
            assert Path("/tmp/flag.txt").read_text().strip() == "ready"
        """),
    "probe-half": ("Create the directory /tmp/out and leave /etc alone.", """
        from pathlib import Path

        def test_etc_is_there():
            assert Path("/etc").is_dir()

        def test_out_made():
            assert Path("/tmp/out").is_dir()
        """),
}
"""name -> (instruction, tests/test_state.py): resolved 1, 0 and 0 times by any policy that does nothing useful
(probe-half passes one test of two)."""


def write_task(root: Path, name: str, instruction: str, test_py: str, *, timeout_s: float = 60.0) -> Path:
    """One Harbor task directory root/name: task.toml, instruction.md, environment/Dockerfile, tests/."""
    files = {"task.toml": _TOML.format(timeout=timeout_s), "instruction.md": instruction + "\n",
             "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n",
             "tests/test_state.py": textwrap.dedent(test_py).lstrip("\n")}
    for rel, text in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / name


def write_benchmark(root: Path, names: tuple[str, ...] = tuple(BENCHMARK)) -> Path:
    """The BENCHMARK tasks `names` under root (a directory of task directories)."""
    for name in names:
        write_task(root, name, *BENCHMARK[name], timeout_s=30.0 + 10 * len(name))
    return root
