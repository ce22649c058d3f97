"""Sandboxes across several Docker hosts: placement by free capacity, health, images shipped once, clean-up.

    hosts = DockerHosts([HostSpec.parse("unix:///var/run/docker.sock max=32"),
                         HostSpec.parse("tcp://box1:2376 tls=/etc/t1/box1 max=64 memory_mb=65536")])
    sb = hosts.start(image, settings, run_id=run_id)      # on the host with the most room; a sandbox.DockerSandbox

A host entry (`sandbox.hosts` in the run config) is a Docker URL followed by options:
- `tls=DIR`: the client's ca.pem, cert.pem, key.pem (what `docker --tlsverify` reads from DOCKER_CERT_PATH);
  a tcp:// URL needs it (a daemon's plain TCP port is root on that host for anyone who reaches it);
- `max=N`: sandboxes at once on that host; `memory_mb=M`: the sum of their memory limits; `name=NAME`: the
  name in metrics (default host0, host1, ... in the given order).
ssh://user@box goes through the Docker SDK's ssh support with the `ssh` binary (the user's ssh_config, agent and
known_hosts; `sandbox.runtime.host_spec`), and a sandbox's shell stream over it through `sandbox.runtime.shell.SshPipe`.

A host that stops answering is taken out of placement (a sandbox call that finds its daemon gone, or the health
thread's ping every HEALTH_EVERY_S); the thread keeps pinging it, and when it answers again it removes the
containers this process lost there, then places on it again.

Images are built once, on the building daemon (DOCKER_HOST, where `sandbox.images.task_images` builds), and streamed
to a host the first time a sandbox there needs them (`docker save` into `docker load` through the SDK, never a
file); a host that already has the same image id (the content key) gets nothing.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Collection, Sequence

import docker
import docker.errors
import requests.exceptions

from sandbox.daemon import docker_client
from sandbox.runtime.docker_host import DockerHost, ensure_image
from sandbox.runtime.docker_sandbox import DockerSandbox
from sandbox.errors import DaemonUnreachable, SandboxError
from sandbox.runtime.host_spec import HostSpec
from sandbox.images.image_cache import TaskImage
from sandbox.runtime.settings import SandboxSettings

HEALTH_EVERY_S = 1.0
"""How often the health thread pings each host."""
NO_HOST_WAIT_S = 30.0
"""How long a start waits for a host to come back when none answers, before it fails."""
FULL_WAIT_S = 600.0
"""How long a start waits for room on some host when every host is at its limits."""


class DockerHosts:
    """The Docker `EnvironmentProvider` (sandbox.runtime.environment): sandboxes on several daemons, or on the one from
    DOCKER_HOST when no host is given. Thread-safe; `close()` stops the health thread."""

    environment_type = "docker"

    def __init__(self, specs: Sequence[HostSpec] = ()) -> None:
        if specs:
            names = [s.name or f"host{i}" for i, s in enumerate(specs)]
            if len(set(names)) != len(names):
                raise ValueError(f"sandbox.hosts: host names must differ, got {names}")
            self.hosts = [DockerHost(s, n) for s, n in zip(specs, names)]
        else:
            local = HostSpec(url=os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))
            self.hosts = [DockerHost(local, "local", api=docker_client())]
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self._health = threading.Thread(target=self._check_loop, name="t1-host-health", daemon=True)
        self._health.start()

    # ---- placement -------------------------------------------------------------------------------------------

    def start(self, image: str | TaskImage, settings: SandboxSettings = SandboxSettings(), *,
              run_id: str | None = None, avoid: Collection[str] = ()) -> DockerSandbox:
        """A started DockerSandbox on the host with the most room (one not in `avoid` when any has room)."""
        if not isinstance(settings, SandboxSettings):
            raise TypeError(f"settings must be a SandboxSettings, got {type(settings).__name__}")
        host = self._place(settings.memory_bytes, avoid)
        try:
            try:
                self._ship(host, image)
            except BaseException:
                self._release(host, settings.memory_bytes)
                raise
            return DockerSandbox(image, settings, run_id=run_id, host=host,
                                 on_close=lambda: self._release(host, settings.memory_bytes))
        except DaemonUnreachable:  # the sandbox released its reservation when it closed itself
            self.mark_down(host)
            raise

    def _place(self, memory: int, avoid: Collection[str]) -> DockerHost:
        no_host_until = time.monotonic() + NO_HOST_WAIT_S
        full_until = time.monotonic() + FULL_WAIT_S
        with self._cv:
            while True:
                up = [h for h in self.hosts if h.up]
                fits = [(room, h) for h in up if (room := h.room(memory)) is not None]
                preferred = [f for f in fits if f[1].name not in avoid] or fits
                if preferred:
                    _, host = max(preferred, key=lambda f: (f[0], -self.hosts.index(f[1])))
                    host.live += 1
                    host.memory_used += memory
                    return host
                now = time.monotonic()
                if not up and now >= no_host_until:
                    raise DaemonUnreachable(f"no Docker host answers ({', '.join(h.name for h in self.hosts)})")
                if up and now >= full_until:
                    raise SandboxError(f"no host had room for a sandbox of {memory >> 20} MiB in {FULL_WAIT_S:.0f} s")
                self._cv.wait(timeout=0.5)

    def _release(self, host: DockerHost, memory: int) -> None:
        with self._cv:
            host.live -= 1
            host.memory_used -= memory
            self._cv.notify_all()

    def load(self) -> dict[str, int]:
        """Host name -> sandboxes placed on it now."""
        with self._cv:
            return {h.name: h.live for h in self.hosts}

    # ---- health ----------------------------------------------------------------------------------------------

    def mark_down(self, host: DockerHost) -> None:
        """Take `host` out of placement (the health thread brings it back when it answers)."""
        with self._cv:
            host.up = False

    def host_answers(self, host: DockerHost) -> bool:
        """Ping `host` now; a host that does not answer is taken out of placement."""
        if host.ping():
            return True
        self.mark_down(host)
        return False

    def health(self) -> dict[str, bool]:
        with self._cv:
            return {h.name: h.up for h in self.hosts}

    def _check_loop(self) -> None:
        while not self._closed.wait(HEALTH_EVERY_S):
            for host in self.hosts:
                answers = host.ping()
                if answers and not host.up:
                    self._rejoin(host)
                elif not answers and host.up:
                    self.mark_down(host)

    def _rejoin(self, host: DockerHost) -> None:
        """A host answers again: remove what this process lost there, forget what it held, place on it again."""
        removals = ((host.lost, lambda cid: host.api.remove_container(cid, force=True)),
                    (host.lost_networks, host.api.remove_network))  # containers first: a network in use stays
        for lost, remove in removals:
            for item in list(lost):
                try:
                    remove(item)
                except docker.errors.NotFound:
                    pass
                except (docker.errors.APIError, requests.exceptions.RequestException):
                    return  # not ready after all: the next round tries again
                lost.discard(item)
        host.image_ids.clear()  # a host that was rebuilt comes back without them
        with self._cv:
            host.up = True
            self._cv.notify_all()

    # ---- images ----------------------------------------------------------------------------------------------

    def _ship(self, host: DockerHost, image: str | TaskImage) -> None:
        """Every image a sandbox of `image` starts from (the task's, its services'), loaded into `host` from the
        building daemon when `host` lacks that image id."""
        refs = [image.ref, *image.service_refs] if isinstance(image, TaskImage) else [image]
        for ref in refs:
            ensure_image(host, ref)

    def distribute(self, refs: Collection[str]) -> None:
        """Load `refs` into every host that answers now (ahead of the first sandbox), in parallel per host. A host
        that stops answering meanwhile is taken out of placement; it gets the images when a sandbox first needs
        them there (`start` loads what is missing)."""
        def load(host: DockerHost) -> None:
            try:
                for ref in refs:
                    ensure_image(host, ref)
            except DaemonUnreachable:
                self.mark_down(host)

        threads = [threading.Thread(target=load, args=(h,), daemon=True) for h in self.hosts if h.up]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # ---- clean-up --------------------------------------------------------------------------------------------

    def reap(self, run_id: str | None = None) -> int:
        """`sandbox.runtime.reap.reap` on every host that answers (dead owners' containers, and run `run_id`'s)."""
        from sandbox.runtime.reap import reap_api

        return sum(reap_api(h.api, run_id) for h in self.hosts if h.ping())

    def close(self) -> None:
        self._closed.set()
        self._health.join()


def parse_hosts(entries: Sequence[str]) -> list[HostSpec]:
    """`sandbox.hosts` entries as HostSpecs (ValueError naming a bad entry); () is the local daemon."""
    return [HostSpec.parse(e) for e in entries]


_provider_lock = threading.Lock()
_provider: DockerHosts | None = None
_provider_specs: tuple[HostSpec, ...] = ()


def use_hosts(entries: Sequence[str]) -> DockerHosts:
    """Make the hosts of `entries` (sandbox.hosts; () = the local daemon) the process's provider, which every
    `SandboxPool` without its own uses. Returns it; the same entries again return the same provider."""
    global _provider, _provider_specs
    specs = tuple(parse_hosts(entries))
    with _provider_lock:
        if _provider is None or specs != _provider_specs:
            old, _provider, _provider_specs = _provider, DockerHosts(specs), specs
            if old is not None:
                old.close()
        return _provider


def default_provider() -> DockerHosts:
    """The process's provider (`use_hosts`); the local daemon until one is chosen."""
    with _provider_lock:
        if _provider is not None:
            return _provider
    return use_hosts(())
