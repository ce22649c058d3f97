"""Who killed the sandbox: the rule that tells an infrastructure failure from one the agent caused.

An episode whose sandbox failed (a `SandboxError` while the agent used it) is either trained as the agent's
failure (reward as it stands) or, when the infrastructure failed, re-run elsewhere and else left out of the
update: a preempted or crashed host must not teach the policy that its actions earn 0 (allenai/open-instruct#1887
saw 5-15% of episodes come back as such zeros). The rule, checked in this order:

1. infra: the daemon or host does not answer (`DaemonUnreachable`, a failed ping), or the image is missing
   (`ImageNotFound`): nothing the agent runs inside a container can stop the daemon that runs it.
2. infra: the container no longer exists: a process inside a container cannot remove its container, so
   someone outside did (an operator, a reaper, a daemon restart that cleaned it up).
3. infra: the daemon's event log holds a `kill`, `stop` or `destroy` of the container since it was created:
   those events come from the API (`docker kill`, `docker stop`, a preempting scheduler), never from a
   process inside it. The rollout's own `close()` comes after this check.
4. agent: anything else. The container is gone on its own while the daemon answers: its processes ended
   (`kill -9 -1` kills the keep-alive and the shell, init then exits: exit 137 with no `kill` event), it hit its
   memory limit (the out-of-memory killer of its own cgroup), its shell stopped answering (a fork bomb holding
   the pids limit), a command or file over the limits.

Known blind spot: a host-wide kernel OOM kill, or a `kill -9` of the container's processes by root on the host
(not through Docker), reads as the agent's doing (rule 4): neither leaves a trace the daemon reports.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable
from typing import Literal

import docker
import docker.errors
import requests.exceptions

from sandbox.errors import DaemonUnreachable, ImageNotFound, SandboxError

FailureOrigin = Literal["infra", "agent"]
EXTERNAL_EVENTS = ("kill", "stop", "destroy")
"""Container events only the Docker API produces (rule 3)."""


def failure_origin(api: docker.APIClient, container_id: str, error: SandboxError, *,
                   host_answers: Callable[[], bool]) -> FailureOrigin:
    """"infra" or "agent" for `error`, raised by the sandbox in container `container_id` (rules in the module
    docstring). `host_answers()`: a health check of the container's host (a short ping)."""
    if isinstance(error, (DaemonUnreachable, ImageNotFound)) or not container_id or not host_answers():
        return "infra"
    try:
        created = api.inspect_container(container_id)["Created"]
        killed = _external_events(api, container_id, since=_unix(created))
    except docker.errors.NotFound:
        return "infra"
    except (docker.errors.APIError, requests.exceptions.RequestException):
        return "infra"  # the daemon answered the ping, then failed: not something the agent can cause
    return "infra" if killed else "agent"


def _external_events(api: docker.APIClient, container_id: str, *, since: int) -> list[str]:
    """The EXTERNAL_EVENTS the daemon logged for the container since `since` (the stream ends at `until`)."""
    until = int(time.time()) + 1
    events = api.events(since=since, until=until, decode=True,
                        filters={"container": [container_id], "event": list(EXTERNAL_EVENTS)})
    return [e.get("Action", e.get("status", "")) for e in events]


def _unix(rfc3339: str) -> int:
    """Seconds since the epoch of a Docker timestamp (2026-12-06T16:09:53.123456789Z), rounded down."""
    return calendar.timegm(time.strptime(rfc3339[:19], "%Y-%m-%dT%H:%M:%S"))
