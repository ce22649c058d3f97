"""Command-line plumbing shared by every entry point (`python -m t1core.train`, `rollout.collect`, ...).

Bad input is the user's mistake, not a bug: it gets one line on stderr that names the key or file and what
was expected, and exit status 2 (argparse's convention), never a traceback. Errors raised once the run has
started keep their traceback. This module lives in `sandbox/`, the lowest package with entry points, so
that every package can import it without an upward import.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

INPUT_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
"""What the parsing and validation of a command line raises for bad input (tomllib's TOMLDecodeError and
json's JSONDecodeError are ValueErrors)."""


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line: 'prog: error: message', exit 2 (no usage dump:
    `--help` shows the usage)."""

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
