"""The Docker daemon as T1 talks to it: one process-wide API client, its errors as SandboxErrors, and the
labels that name the run and owner process of every container T1 creates (`sandbox.runtime.reap` judges by them).

The bottom of the sandbox package: it imports nothing of the project but `sandbox.errors`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Iterator

import docker
import docker.errors
import requests.exceptions

from sandbox.errors import DaemonUnreachable, ImageNotFound, SandboxError

LABEL_RUN = "t1.run_id"
LABEL_PID = "t1.owner_pid"
LABEL_HOST = "t1.owner_host"
LABEL_START = "t1.owner_start"
LABEL_CREATED = "t1.created"

_client_lock = threading.Lock()
_client: docker.APIClient | None = None


def docker_client() -> docker.APIClient:
    """The process-wide Docker API client (thread-safe; a large pool for many sandboxes at once)."""
    global _client
    with _client_lock:
        if _client is None:
            try:
                _client = docker.APIClient(max_pool_size=128, timeout=120, **docker.utils.kwargs_from_env())
                _client.ping()
            except docker.errors.DockerException as e:
                raise DaemonUnreachable(f"no Docker daemon answers ({e}); start one (scripts/ensure_docker.sh) "
                                        "or set DOCKER_HOST") from e
        return _client


@functools.cache
def daemon_cpus() -> int:
    """CPUs of the Docker host (its daemon's `NCPU`: a remote daemon's, not this machine's)."""
    with docker_errors("asking the daemon for its CPU count"):
        return int(docker_client().info()["NCPU"])


@contextlib.contextmanager
def docker_errors(what: str) -> Iterator[None]:
    """Translate the SDK's errors into SandboxError subclasses naming what was being done."""
    try:
        yield
    except docker.errors.ImageNotFound as e:
        raise ImageNotFound(f"{what}: {e.explanation or e}") from e
    except requests.exceptions.ConnectionError as e:
        raise DaemonUnreachable(f"{what}: the Docker daemon stopped answering ({e})") from e
    except docker.errors.APIError as e:
        raise SandboxError(f"{what}: {e.explanation or e}") from e


def _own_start_time() -> str:
    # Start time of this process (clock ticks since boot): with the pid it names the owner even after pid reuse.
    with open("/proc/self/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def default_run_id() -> str:
    """$T1_RUN_ID (the trainer sets it for its sandboxes), else one per process."""
    return os.environ.get("T1_RUN_ID") or f"pid{os.getpid()}"


def owner_labels(run_id: str) -> dict[str, str]:
    """Labels of every container T1 creates: its run and owner process, which `sandbox.runtime.reap` judges by."""
    return {LABEL_RUN: run_id, LABEL_PID: str(os.getpid()), LABEL_HOST: socket.gethostname(),
            LABEL_START: _own_start_time(), LABEL_CREATED: f"{time.time():.3f}"}
