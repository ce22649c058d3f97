"""The run's phase stopwatch: wall and CPU seconds per phase, logged as time/* and cputime/* metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Stopwatch:
    """Wall and CPU time per phase: `with sw.phase("generate"): ...`, then `sw.pop()` -> {"time/generate": wall s,
    "cputime/generate": CPU s, ...}. CPU time is the whole process's (every thread: the engine's, the sandbox
    clients', the trainer's), so it can exceed the wall time. CUDA work is asynchronous: synchronise before a GPU
    phase ends if its time must be attributed to it."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            for key, seconds in ((f"time/{name}", time.perf_counter() - start),
                                 (f"cputime/{name}", time.process_time() - cpu_start)):
                self._totals[key] = self._totals.get(key, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """The accumulated seconds per phase since the last pop, keyed "time/<phase>" (wall) and
        "cputime/<phase>" (CPU); resets."""
        totals, self._totals = self._totals, {}
        return totals
