"""Sandbox runtime: Docker containers driven through a persistent shell, the base image, task format, verifiers.

No torch imports here: rollout workers use this package alone.
"""

from sandbox.docker_sandbox import CommandResult, DockerSandbox
from sandbox.errors import (CommandTooLong, ContainerDied, DaemonUnreachable, FileTooLarge, ImageNotFound,
                            SandboxError, ShellUnresponsive)
from sandbox.image import ensure_base_image
from sandbox.pool import SandboxPool
from sandbox.reap import reap

__all__ = [
    "CommandResult", "CommandTooLong", "ContainerDied", "DaemonUnreachable", "DockerSandbox", "FileTooLarge",
    "ImageNotFound", "SandboxError", "SandboxPool", "ShellUnresponsive", "ensure_base_image", "reap",
]
