"""Errors of the sandbox runtime.

A command that fails or times out inside a sandbox is data (a `CommandResult`), not an exception. These are for
the runtime itself failing: the daemon, the image, the container or the shell machinery.
"""

from __future__ import annotations

from pathlib import Path


class SandboxError(RuntimeError):
    """Base class: the sandbox runtime could not do what was asked."""


class DaemonUnreachable(SandboxError):
    """No Docker daemon answers (socket missing, daemon down, DOCKER_HOST wrong)."""


class ImageNotFound(SandboxError):
    """The image is neither present locally nor pullable."""


class ContainerDied(SandboxError):
    """The container stopped under a running sandbox (OOM-killed, killed from outside, crashed)."""

    def __init__(self, message: str, *, oom_killed: bool = False, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.oom_killed = oom_killed
        self.exit_code = exit_code


class CommandTooLong(SandboxError):
    """The command text exceeds the sandbox's `max_command_bytes`."""


class FileTooLarge(SandboxError):
    """A file or directory read from / written to the sandbox exceeds the size cap."""


class ShellUnresponsive(SandboxError):
    """The persistent shell did not answer within its deadline and could not be recovered."""


class TaskFormatError(ValueError):
    """A task directory that cannot be loaded; the message names the file and the field (`sandbox.tasks.format`)."""

    def __init__(self, file: Path, field: str, problem: str):
        super().__init__(f"{file}: field {field!r}: {problem}")
        self.file = file
        self.field = field
