"""Sandbox runtime: Docker containers driven through a persistent shell, the base image, task format, verifiers.

No torch imports here: rollout workers use this package alone.
"""

from sandbox.docker_sandbox import CommandResult, DockerSandbox
from sandbox.errors import (CommandTooLong, ContainerDied, DaemonUnreachable, FileTooLarge, ImageNotFound,
                            SandboxError, ShellUnresponsive)
from sandbox.pool import SandboxPool
from sandbox.reap import reap

__all__ = [
    "CommandResult", "CommandTooLong", "ContainerDied", "DaemonUnreachable", "DockerSandbox", "FileTooLarge",
    "ImageNotFound", "SandboxError", "SandboxPool", "ShellUnresponsive", "ensure_base_image", "reap",
]


def __getattr__(name: str):  # noqa: ANN202
    # Lazy, so that `python -m sandbox.image build` does not import its own module twice.
    if name == "ensure_base_image":
        from sandbox.image import ensure_base_image
        return ensure_base_image
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
