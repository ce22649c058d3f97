"""SIGTERM and SIGINT for the sandbox's command-line entry points: remove what the run started, then exit.

Python's default SIGTERM ends the process without running `finally` blocks or atexit handlers, so a killed
`run_task` left its container running. `exit_on_signals()` makes both signals kill this process's running
image builds, remove its live sandboxes (from the signal handler itself, so sandboxes that worker threads hold
are gone too) and exit with 128 + the signal number. Further signals during that clean-up are ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from sandbox.images.docker_build import kill_active_builds
from sandbox.runtime.docker_sandbox import close_live_sandboxes

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def exit_on_signals_while() -> Iterator[None]:
    """`exit_on_signals()` inside the block (from the main thread; elsewhere nothing), the previous handlers after
    it: the trainer's `main` runs in test processes that go on afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    exit_on_signals()
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def exit_on_signals() -> None:
    """Install the handlers (main thread only: Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("exit_on_signals() must be called from the main thread")
    for sig in _SIGNALS:
        signal.signal(sig, _handle)


def _handle(signum: int, frame: FrameType | None) -> None:
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        kill_active_builds()
    with contextlib.suppress(Exception):
        close_live_sandboxes()
    raise SystemExit(128 + signum)
