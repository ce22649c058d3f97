"""DockerHost: one Docker daemon as `sandbox.runtime.hosts` places on it (client, health, load, images, lost
containers), and `ensure_image`, which streams an image from the building daemon to a host that lacks it.

Below `sandbox.runtime.docker_sandbox` (a sandbox runs on a DockerHost) and `sandbox.runtime.hosts` (which places
sandboxes).
"""

from __future__ import annotations

import threading

import docker
import docker.errors
import docker.utils
import requests.exceptions

from sandbox.daemon import docker_client, docker_errors
from sandbox.errors import SandboxError
from sandbox.runtime.host_spec import API_VERSION, HostSpec

PING_TIMEOUT_S = 3.0
"""A host that does not answer a ping within this is down."""


def answers(api: docker.APIClient) -> bool:
    """Whether the daemon behind `api` answers a ping (within the client's timeout)."""
    try:
        api.ping()
        return True
    except (docker.errors.DockerException, requests.exceptions.RequestException):
        return False


class DockerHost:
    """One daemon as placement sees it: its client, health, load, the images it holds and containers it lost."""

    def __init__(self, spec: HostSpec, name: str, api: docker.APIClient | None = None) -> None:
        self.spec, self.name = spec, name
        self.api = api or spec.client()
        # Its own client and connections, with a short timeout: a ping must not queue behind a stuck call.
        self._ping_api = spec.client(timeout=PING_TIMEOUT_S) if api is None else docker.APIClient(
            timeout=PING_TIMEOUT_S, version=API_VERSION, **docker.utils.kwargs_from_env())
        self.up = True
        self.live = 0
        self.memory_used = 0
        self.lost: set[str] = set()
        """Containers whose removal failed because the host was down: removed when it answers again."""
        self.lost_networks: set[str] = set()
        """Networks of task services (sandbox.runtime.services) left the same way."""
        self.image_ids: dict[str, str] = {}
        self._image_locks: dict[str, threading.Lock] = {}
        self._cpus: int | None = None

    def ping(self) -> bool:
        return answers(self._ping_api)

    def cpus(self) -> int:
        if self._cpus is None:
            with docker_errors(f"asking host {self.name} for its CPU count"):
                self._cpus = int(self.api.info()["NCPU"])
        return self._cpus

    def room(self, memory: int) -> float | None:
        """Free share of this host once a sandbox of `memory` bytes is added (the tighter of its limits); None
        when it does not fit. A host without limits: 1 / (sandboxes + 1)."""
        shares = []
        if self.spec.max_sandboxes is not None:
            shares.append((self.spec.max_sandboxes - self.live - 1) / self.spec.max_sandboxes)
        if self.spec.memory_mb is not None:
            cap = self.spec.memory_mb << 20
            shares.append((cap - self.memory_used - memory) / cap)
        if not shares:
            return 1.0 / (self.live + 1)
        return None if min(shares) < 0 else min(shares)

    def image_lock(self, ref: str) -> threading.Lock:
        return self._image_locks.setdefault(ref, threading.Lock())


def ensure_image(host: DockerHost, ref: str) -> None:
    """`ref` on `host` with the building daemon's image id: nothing when it is there, else `docker save` from the
    building daemon streamed into `docker load` on `host` (once per host and image, however many ask at once)."""
    source = docker_client()
    if host.api is source:
        return
    with host.image_lock(ref):
        with docker_errors(f"looking up {ref} on the building daemon"):
            want = source.inspect_image(ref)["Id"]
        if host.image_ids.get(ref) == want:
            return
        with docker_errors(f"looking up {ref} on host {host.name}"):
            try:
                have = host.api.inspect_image(ref)["Id"]
            except docker.errors.NotFound:
                have = None
        if have != want:
            _stream_image(source, host, ref)
        host.image_ids[ref] = want


def _stream_image(source: docker.APIClient, host: DockerHost, ref: str) -> None:
    with docker_errors(f"copying image {ref} to host {host.name}"):
        chunks = source.get_image(ref, chunk_size=1 << 20)
        for line in host.api.load_image(chunks, quiet=True):
            if "error" in line or "errorDetail" in line:
                raise SandboxError(f"loading {ref} on host {host.name}: {line.get('error', line)}")
        got = host.api.inspect_image(ref)["Id"]
    if got != source.inspect_image(ref)["Id"]:
        raise SandboxError(f"host {host.name} holds {ref} as {got[:19]} after the load, not the building daemon's")
