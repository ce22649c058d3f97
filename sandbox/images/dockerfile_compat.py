"""Dockerfile forms BuildKit accepts and the classic builder does not, rewritten for the classic builder.

T1 builds through the daemon's API (docker-py), which is the classic builder; Terminal-Bench's and Harbor's
harnesses build with `docker compose`, which is BuildKit. Two forms in the public task collections build there and
fail here:
- `COPY <<EOT /path` ... `EOT`: a here-document as the source (BuildKit's Dockerfile frontend, syntax 1.4+). The body
  becomes a file of the build context and the line a plain `COPY` of it. The body is copied as written (BuildKit
  expands no variables in a COPY here-document unless the Dockerfile asks for it with a `# syntax` of its own).
- `COPY dir/* /app` where the wildcard matches several files: BuildKit treats /app as a directory; the classic
  builder stops with "the destination must be a directory and end with a /". The `/` is added when the sources
  match more than one entry of the context (with one, both builders copy to a file named /app).
The image hash is taken over the task's own Dockerfile (`sandbox.images.task_images`), so this rewrite only changes how
the image is built, never which image a task names.
"""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path

HEREDOC_PREFIX = ".t1-heredoc-"
_HEREDOC_RE = re.compile(r"^(\s*(?:COPY|ADD)\s+(?:--\S+\s+)*)<<(-?)([\"']?)(\w+)\3\s+(\S+)\s*$", re.IGNORECASE)
_RUN_HEREDOC_RE = re.compile(r"(?<!<)<<(?!<)-?([\"']?)([A-Za-z_]\w*)\1")
_COPY_RE = re.compile(r"^(\s*(?:COPY|ADD)\s+)((?:--\S+\s+)*)(.+?)\s*$", re.IGNORECASE)


class DockerfileFormError(ValueError):
    """A Dockerfile form that neither builder path here can take."""


def classic_builder_form(text: str, context: Path) -> tuple[str, dict[str, bytes]]:
    """(the Dockerfile for the classic builder, files to add to the build context: name -> bytes)."""
    out: list[str] = []
    files: dict[str, bytes] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        here = _HEREDOC_RE.match(line)
        if here is not None:
            head, strip_tabs, _, delim, dest = here.groups()
            body, i = _heredoc_body(lines, i + 1, delim, strip_tabs=bool(strip_tabs))
            name = f"{HEREDOC_PREFIX}{len(files) + 1}"
            files[name] = "".join(f"{b}\n" for b in body).encode()
            out.append(f"{head}{name} {dest}")
            continue
        if _unhandled_heredoc(line, lines[i + 1:]):
            raise DockerfileFormError(f"a here-document in {line.strip()[:60]!r}: only `COPY <<DELIM dest` with one "
                                      "here-document is rewritten for the classic builder")
        out.append(_directory_destination(line, context))
        i += 1
    return "\n".join(out) + "\n", files


def _unhandled_heredoc(line: str, later: list[str]) -> bool:
    """A here-document the rewrite above did not take: any `<<` in a COPY/ADD line; in a RUN line, an opener whose
    delimiter closes on a later line (a RUN's `$((1 << n))` or `<<<` here-string is the shell's, valid as it is)."""
    word = line.lstrip().split(None, 1)[0].upper() if line.strip() else ""
    if word in ("COPY", "ADD"):
        return "<<" in line
    if word != "RUN":
        return False
    opener = _RUN_HEREDOC_RE.search(line)
    return opener is not None and any(other.strip() == opener.group(2) for other in later)


def _heredoc_body(lines: list[str], start: int, delim: str, *, strip_tabs: bool) -> tuple[list[str], int]:
    body = []
    for j in range(start, len(lines)):
        text = lines[j].lstrip("\t") if strip_tabs else lines[j]
        if text == delim:
            return body, j + 1
        body.append(text)
    raise DockerfileFormError(f"here-document {delim!r} has no closing line {delim!r}")


def _directory_destination(line: str, context: Path) -> str:
    """`line` with a `/` after its destination when it is a COPY/ADD whose wildcard sources match several entries."""
    m = _COPY_RE.match(line)
    if m is None or m.group(3).startswith("["):  # not COPY/ADD, or the JSON form (left as written)
        return line
    head, flags, rest = m.groups()
    try:
        words = shlex.split(rest)
    except ValueError:
        return line
    if len(words) < 2 or words[-1].endswith("/") or rest[-1] in "\"'" or not any(ch in w for w in words[:-1] for ch in "*?["):
        return line
    matches = sum(len(glob.glob(w, root_dir=context)) if any(ch in w for ch in "*?[") else 1 for w in words[:-1])
    return f"{head}{flags}{rest}/" if matches > 1 else line
