"""BuildKit-only Dockerfile forms (COPY here-documents, a wildcard COPY into a directory without its `/`) built by
the classic builder: the rewrite itself, and a real build whose files are read back from a sandbox."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox.images.dockerfile_compat import HEREDOC_PREFIX, DockerfileFormError, classic_builder_form
from tests.machine import needs_docker

RUN_ID = f"t1-test-compat-{os.getpid()}"

DOCKERFILE = """FROM debian:bookworm
WORKDIR /app
COPY deps/* /app
COPY deps/one.txt /single
COPY <<EOT /app/logs/auth.log
Jan 1 sshd[1]: Failed password for root
\tindented $HOME stays as written
EOT
COPY <<-"END" /etc/t1.conf
\tkey = value
\tEND
RUN test -f /app/a.c && test -f /app/b.c
"""


def _context(root: Path) -> Path:
    (root / "deps").mkdir(parents=True)
    for name in ("a.c", "b.c", "one.txt"):
        (root / "deps" / name).write_text(name)
    return root


def test_heredocs_become_files_and_a_many_file_wildcard_gets_its_slash(tmp_path: Path) -> None:
    text, files = classic_builder_form(DOCKERFILE, _context(tmp_path))
    lines = text.splitlines()
    assert lines[2] == "COPY deps/* /app/" and lines[3] == "COPY deps/one.txt /single"
    assert lines[4] == f"COPY {HEREDOC_PREFIX}1 /app/logs/auth.log" and lines[5] == f"COPY {HEREDOC_PREFIX}2 /etc/t1.conf"
    assert files == {f"{HEREDOC_PREFIX}1": b"Jan 1 sshd[1]: Failed password for root\n\tindented $HOME stays as written\n",
                     f"{HEREDOC_PREFIX}2": b"key = value\n"}
    # One match: both builders copy to a file of that name, so the line stays.
    (tmp_path / "deps" / "b.c").unlink()
    (tmp_path / "deps" / "one.txt").unlink()
    assert classic_builder_form("COPY deps/* /app\n", tmp_path)[0] == "COPY deps/* /app\n"


def test_forms_it_cannot_rewrite_are_named() -> None:
    with pytest.raises(DockerfileFormError, match="no closing line 'EOT'"):
        classic_builder_form("FROM x\nCOPY <<EOT /a\nbody\n", Path("."))
    with pytest.raises(DockerfileFormError, match="only `COPY <<DELIM dest`"):
        classic_builder_form("FROM x\nRUN <<EOF\necho hi\nEOF\n", Path("."))
    # The shell's own `<<` in a one-line RUN (a shift, a here-string) is not a here-document: left as written.
    shell = "FROM x\nRUN echo $((1 << 3)) && cat <<< hi\nRUN echo $((1<<n))\n"
    assert classic_builder_form(shell, Path(".")) == (shell, {})


@pytest.mark.docker
@needs_docker
def test_the_classic_builder_builds_them_as_buildkit_would(tmp_path: Path) -> None:
    from sandbox.runtime.docker_sandbox import DockerSandbox
    from sandbox.runtime.settings import SandboxSettings
    from sandbox.images.task_images import build_task_image, default_base_image_overrides
    from sandbox.tasks.format import load_task

    task_dir = tmp_path / "compat"
    _context(task_dir / "environment")
    (task_dir / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "test_a.py").write_text("def test_a():\n    assert True\n")
    (task_dir / "task.toml").write_text("[verifier]\ntimeout_sec = 30\n")
    (task_dir / "instruction.md").write_text("Nothing.\n")
    task = load_task(task_dir)
    image = build_task_image(task, base_image_overrides=default_base_image_overrides())
    with DockerSandbox(image, SandboxSettings(workdir="/app"), run_id=RUN_ID) as sb:
        out = sb.run("cat /app/a.c /app/b.c /single /app/logs/auth.log /etc/t1.conf; ls -A1 /app", timeout=30)
    assert out.exit_code == 0, out.output
    assert out.output == ("a.cb.cone.txtJan 1 sshd[1]: Failed password for root\n\tindented $HOME stays as written\n"
                          "key = value\na.c\nb.c\nlogs\none.txt\n"), out.output
