"""The provider boundary: what the rollout asks of a sandbox and of whatever starts sandboxes.

Named after Harbor's environment types (harbor.environments: a `BaseEnvironment` per `EnvironmentType`
docker, daytona, e2b, modal, runloop, gke). One `Environment` is one running sandbox; Harbor's `exec` is `run`
here (a persistent shell: state carries from one command to the next), `upload_file` / `download_file` are
`write_file` / `read_file`, `stop(delete=True)` is `close`. An `EnvironmentProvider` starts environments from an
image under limits, reports the health of what it runs on, and removes what a run left.
`sandbox.runtime.hosts.DockerHosts` (one or many Docker daemons, local or remote) is the one implementation; a
Kubernetes, Daytona or Modal provider implements these two Protocols and the rollout (`rollout.agent`,
`sandbox.runtime.pool`) does not change.

`failure_origin` is the rule that keeps infrastructure failures out of the rewards (docs/sandbox-hosts.md):
"infra" when the sandbox died through no action of the agent (its host or daemon stopped answering, the
container was removed or killed from outside), "agent" when the agent's own commands can explain it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from sandbox.runtime.failure import FailureOrigin

if TYPE_CHECKING:
    from sandbox.runtime.docker_sandbox import CommandResult
    from sandbox.errors import SandboxError
    from sandbox.images.image_cache import TaskImage
    from sandbox.runtime.settings import SandboxSettings


class Environment(Protocol):
    """One started sandbox (Harbor: a started `BaseEnvironment`)."""

    id: str
    host_name: str
    """Which host runs it (metrics and retries are per host)."""

    def run(self, command: str, *, timeout: float = 60.0) -> CommandResult: ...

    def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None: ...

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes: ...

    def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str) -> None: ...

    def kill_all_processes(self) -> None: ...

    def shell_stream_open(self) -> bool:
        """Cheap liveness hint without a round trip."""
        ...

    def failure_origin(self, error: SandboxError) -> FailureOrigin:
        """Whether `error`, raised while the agent used this sandbox, is the infrastructure's fault or the agent's."""
        ...

    def close(self) -> None:
        """Stop and delete it (idempotent; a host that no longer answers is cleaned when it comes back)."""
        ...


class EnvironmentProvider(Protocol):
    """Starts environments (Harbor: an `EnvironmentType` and its factory)."""

    environment_type: str

    def start(self, image: str | TaskImage, settings: SandboxSettings, *, run_id: str | None = None,
              avoid: Collection[str] = ()) -> Environment:
        """A started environment of `image` under `settings`, on a host not named in `avoid` when one has room.
        Raises SandboxError (never the agent's fault: no command has run yet)."""
        ...

    def health(self) -> dict[str, bool]:
        """Host name -> whether it answers now."""
        ...

    def reap(self, run_id: str | None = None) -> int:
        """Remove what dead owners (and run `run_id`) left on every host that answers; returns containers removed."""
        ...
