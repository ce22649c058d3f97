"""Sandbox runtime: Docker containers driven through a persistent shell, the base image, task format, verifiers.

No torch imports here: rollout workers and task checkers use this package alone. The names below load on first
use, so that `python -m sandbox.reap` (or `.image`, `.run_task`) does not import its own module twice and a task
parser does not load the Docker SDK. The reaper is `sandbox.reap.reap` (a package attribute `reap` would be
the submodule once it is imported).
"""

import importlib

_EXPORTS = {
    "CommandResult": "sandbox.docker_sandbox", "DockerSandbox": "sandbox.docker_sandbox",
    "CommandTooLong": "sandbox.errors", "ContainerDied": "sandbox.errors", "DaemonUnreachable": "sandbox.errors",
    "FileTooLarge": "sandbox.errors", "ImageNotFound": "sandbox.errors", "SandboxError": "sandbox.errors",
    "ShellUnresponsive": "sandbox.errors", "SandboxPool": "sandbox.pool", "SandboxSettings": "sandbox.settings",
    "ensure_base_image": "sandbox.base_image",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # noqa: ANN202
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
