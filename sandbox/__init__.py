"""Sandboxes for agents: task formats, the images tasks run in, and the Docker runtime that runs and verifies them.

Three wings, each importing only the ones below it (tests/test_layers.py):
  sandbox.tasks    task directories (Harbor, Terminal-Bench 1) -> Task, the built-in suite and families,
                   decontamination
  sandbox.images   base images, task images (docker build, preload, the cache), what an image's layers hold
  sandbox.runtime  containers driven through a persistent shell, pools, hosts, reaping, the verifier
Here at the top: what every wing may use (errors, cli, daemon) and the command-line entry points (run_task,
check_tasks, tb_report; reap, base_image and decontaminate are the documented `python -m` names of their wings'
modules).

No torch imports here: rollout workers and task checkers use this package alone. The names below load on first
use, so that `python -m sandbox.run_task` does not import its own module twice and a task parser does not load
the Docker SDK. The reaper is `sandbox.runtime.reap.reap`.
"""

import importlib

_EXPORTS = {
    "CommandResult": "sandbox.runtime.docker_sandbox", "DockerSandbox": "sandbox.runtime.docker_sandbox",
    "CommandTooLong": "sandbox.errors", "ContainerDied": "sandbox.errors", "DaemonUnreachable": "sandbox.errors",
    "FileTooLarge": "sandbox.errors", "ImageNotFound": "sandbox.errors", "SandboxError": "sandbox.errors",
    "ShellUnresponsive": "sandbox.errors", "SandboxPool": "sandbox.runtime.pool",
    "SandboxSettings": "sandbox.runtime.settings",
    "ensure_base_image": "sandbox.images.base_image",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # noqa: ANN202
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
