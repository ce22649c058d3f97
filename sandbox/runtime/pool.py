"""SandboxPool: warm sandboxes (container started, shell handshaken) ready for the next episode.

Creating a sandbox costs ~0.4 s (container create + start + shell start); `acquire()` from a warm pool costs a
queue pop plus a peek at the shell's stream (a dead container ends it). A released sandbox is destroyed, never handed
to another episode: nothing an episode did can leak into the next.

A pool told how many sandboxes will be asked of it (`demand`) never starts more than that: without the bound it
refills after every acquire, and the last refills were started only to be removed when the pool closed. With one
episode per environment (an evaluation, the SFT transcripts) that was two container lives per episode, and a
container life costs the daemon and the kernel ~0.4 s of CPU.

Sandboxes come from a provider (`sandbox.runtime.environment.EnvironmentProvider`; default:
`sandbox.runtime.hosts.default_provider()`, the run's Docker hosts), which places each on the host with the most room: a
pool's warm sandboxes spread over the hosts. `acquire_log` records each acquire's latency and whether a warm sandbox was
waiting (bench/test_bench_sandbox.py reports p50/p99 of both).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from sandbox.runtime.docker_sandbox import DockerSandbox
from sandbox.runtime.environment import EnvironmentProvider
from sandbox.errors import SandboxError
from sandbox.runtime.settings import SandboxSettings
from sandbox.images.task_images import TaskImage


class SandboxPool:
    """Keeps `size` idle sandboxes of `image` warm, every one a `DockerSandbox(image, settings, run_id=run_id)`.

    `demand`: how many `acquire()`s will come in all (None: no end). Then at most that many minus those already
    handed out are kept warm or starting; a sandbox found dead at acquire does not count, so it is replaced."""

    def __init__(self, image: str | TaskImage, *, size: int, demand: int | None = None, max_parallel_starts: int = 4,
                 retry_after_error_s: float = 2.0, settings: SandboxSettings = SandboxSettings(),
                 run_id: str | None = None, provider: EnvironmentProvider | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if demand is not None and demand < 0:
            raise ValueError(f"demand must be >= 0 or None, got {demand}")
        if max_parallel_starts < 1:
            raise ValueError(f"max_parallel_starts must be >= 1, got {max_parallel_starts}")
        self.image = image
        self.size = size
        self._demand = demand
        self.settings, self.run_id = settings, run_id
        if provider is None:
            from sandbox.runtime.hosts import default_provider
            provider = default_provider()
        self.provider = provider
        self.acquire_log: list[tuple[float, bool]] = []
        """(seconds, warm) per acquire that returned: warm when an idle sandbox was waiting at the call."""
        self._max_parallel = max_parallel_starts
        self._retry_s = retry_after_error_s
        self._cv = threading.Condition()
        self._idle: collections.deque[DockerSandbox] = collections.deque()
        self._lent: set[DockerSandbox] = set()
        self._starting = 0
        self._error: SandboxError | None = None
        self._error_at = 0.0
        self._closed = False
        self._starter = ThreadPoolExecutor(max_workers=max_parallel_starts, thread_name_prefix="t1-pool-start")
        self._filler = threading.Thread(target=self._fill_loop, name="t1-pool-fill", daemon=True)
        self._filler.start()

    def _fill_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._wants_more():
                    self._cv.wait(timeout=max(0.05, self._retry_s))
                if self._closed:
                    return
                self._starting += 1
            self._starter.submit(self._start_one)

    def _wants_more(self) -> bool:
        if self._error is not None and time.monotonic() - self._error_at < self._retry_s:
            return False  # back off: a bad image or a dead daemon would otherwise spin
        wanted = self.size if self._demand is None else min(self.size, self._demand)
        return len(self._idle) + self._starting < wanted and self._starting < self._max_parallel

    def _start_one(self) -> None:
        try:
            sb = self.provider.start(self.image, self.settings, run_id=self.run_id)
        except Exception as e:  # any kind: left in the starter's future, it would keep acquire() waiting forever
            error = e if isinstance(e, SandboxError) else SandboxError(
                f"starting a sandbox of {self.image!r} failed: {type(e).__name__}: {e}")
            with self._cv:
                self._starting -= 1
                self._error, self._error_at = error, time.monotonic()
                self._cv.notify_all()
            return
        with self._cv:
            self._starting -= 1
            if not self._closed:
                self._idle.append(sb)
                self._error = None
                self._cv.notify_all()
                return
        sb.close()  # the pool closed while this one was starting

    def acquire(self, *, timeout: float | None = None) -> DockerSandbox:
        """A warm sandbox (waits for one when none is idle). Raises the start error when starting fails, and
        TimeoutError when `timeout` seconds pass first."""
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        warm = None
        while True:
            with self._cv:
                warm = bool(self._idle) if warm is None else warm  # at the call: a later wait makes it cold
                while not self._idle and self._error is None and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"no warm sandbox within {timeout} s (pool size {self.size})")
                    self._cv.wait(timeout=remaining)
                if self._closed:
                    raise SandboxError("acquire() on a closed SandboxPool")
                if not self._idle:
                    error, self._error = self._error, None
                    assert error is not None
                    raise error
                sb = self._idle.popleft()
                self._lent.add(sb)
                if self._demand is not None:  # counted before the filler wakes: it must not start a spare
                    self._demand = max(0, self._demand - 1)
                self._cv.notify_all()  # the filler refills
            if sb.shell_stream_open():  # a peek, not a round trip: a loaded box makes round trips slow
                self.acquire_log.append((time.monotonic() - t0, bool(warm)))
                return sb
            with self._cv:
                if self._demand is not None:
                    self._demand += 1  # this one did not serve: a replacement is still owed
                    self._cv.notify_all()
            self.release(sb)  # died while idle (reaped, killed from outside): take the next one

    def release(self, sb: DockerSandbox) -> None:
        """Destroy a sandbox obtained from `acquire()` (it is never reused)."""
        with self._cv:
            self._lent.discard(sb)
        sb.close()

    @property
    def num_idle(self) -> int:
        with self._cv:
            return len(self._idle)

    def close(self) -> None:
        """Stop refilling and remove every sandbox of this pool, idle and lent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._filler.join()
        self._starter.shutdown(wait=True)
        with self._cv:
            doomed = list(self._idle) + list(self._lent)
            self._idle.clear()
            self._lent.clear()
        errors: list[SandboxError] = []
        for sb in doomed:
            try:
                sb.close()
            except SandboxError as e:
                errors.append(e)
        if errors:
            raise SandboxError(f"{len(errors)} sandbox(es) could not be removed; first: {errors[0]}")

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
