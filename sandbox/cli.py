"""Command-line plumbing shared by every entry point (`python -m t1core.train`, `rollout.collect`, ..., and the
`t1` command that runs them under its own names, t1cli.main).

Bad input is the user's mistake, not a bug: it gets one line on stderr that names the key or file and what
was expected, and exit status 2 (argparse's convention), never a traceback. Errors raised once the run has
started keep their traceback. This module lives in `sandbox/`, the lowest package with entry points, so
that every package can import it without an upward import.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
from collections.abc import Iterator

INPUT_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
"""What the parsing and validation of a command line raises for bad input (tomllib's TOMLDecodeError and
json's JSONDecodeError are ValueErrors)."""


_RENAMED: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("t1_renamed", default=None)
"""(a tool's own prog, the name it was invoked by) while the `t1` command runs that tool's main."""


@contextlib.contextmanager
def invoked_as(prog: str, name: str) -> Iterator[None]:
    """Inside the block, the tool whose prog is `prog` (`python -m rollout.report`) is named `name` (`t1 report`):
    its usage, `--help` and one-line errors say the command the user typed. Only that exact prog is renamed: a
    subcommand parser argparse derives from it (`PROG build`) follows its parent's name by itself."""
    token = _RENAMED.set((prog, name))
    try:
        yield
    finally:
        _RENAMED.reset(token)


def prog_name(prog: str) -> str:
    """The name the tool whose own prog is `prog` runs under now: `prog`, or what `invoked_as` named it."""
    renamed = _RENAMED.get()
    return renamed[1] if renamed is not None and renamed[0] == prog else prog


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line: 'prog: error: message', exit 2 (no usage dump:
    `--help` shows the usage). `prog` is the tool's own (`python -m MODULE`), renamed inside `invoked_as`."""

    def __init__(self, *args, **kwargs) -> None:
        if isinstance(kwargs.get("prog"), str):
            kwargs["prog"] = prog_name(kwargs["prog"])
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]  (NoReturn in argparse)
        self.exit(2, f"{self.prog}: error: {message}\n")


@contextlib.contextmanager
def bad_input(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Turn an input error raised inside the block (config parsing, a missing file, a malformed task) into
    `parser.error`: one line and exit 2. Wrap only the parsing and validation of the input."""
    try:
        yield
    except INPUT_ERRORS as e:
        parser.error(str(e) or type(e).__name__)
