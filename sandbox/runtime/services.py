"""The services a TB1 task's compose file runs beside the agent (`sandbox.tasks.compose`), one group per sandbox.

Each group is a private Docker network and one container per service, started dependencies first, each
waited for as its dependants ask (running, healthy, or exited 0). The sandbox joins the network under its
service's name. Without a sandbox network the group's network is `internal`: the agent reaches the services and
nothing else. Every container and the network carry the run's owner labels (`sandbox.runtime.reap` removes what a dead
run left) and limits like the sandbox's; `close()` removes them all. One group per sandbox keeps episodes apart:
what one agent writes into a service's database is not seen by the next.
"""

from __future__ import annotations

import time
from typing import Any

import docker

from sandbox.tasks.compose import Compose, Service
from sandbox.daemon import docker_errors, owner_labels
from sandbox.errors import SandboxError

LABEL_SERVICE = "t1.service"
# Limits of a service container; services are the task's own code, so they keep Docker's default capabilities
# (a database's entrypoint changes users), without new privileges and without the host's devices.
SERVICE_PIDS = 1024
_STARTED_WAIT_S = 30.0
_POLL_S = 0.2


class ServiceFailed(SandboxError):
    """A task's service did not come up as its dependants need (exited, unhealthy, or too slow)."""


class ServiceGroup:
    """The network and service containers of one sandbox. Use `start`; `close()` removes everything (idempotent)."""

    def __init__(self, api: docker.APIClient, compose: Compose, refs: tuple[str, ...], *, run_id: str,
                 name: str, internal: bool, memory_bytes: int, nano_cpus: int) -> None:
        self._api, self.compose, self._refs = api, compose, refs
        self._labels = owner_labels(run_id)
        self.network = f"{name}-net"
        self._name = name
        self._internal = internal
        self._limits = {"mem_limit": memory_bytes, "memswap_limit": memory_bytes, "nano_cpus": nano_cpus,
                        "pids_limit": SERVICE_PIDS}
        self.containers: dict[str, str] = {}  # service -> container id
        self._network_id = ""

    @classmethod
    def start(cls, api: docker.APIClient, compose: Compose, refs: tuple[str, ...], **kw: Any) -> ServiceGroup:
        group = cls(api, compose, refs, **kw)
        try:
            group._start()
        except BaseException:
            group.close()
            raise
        return group

    def _start(self) -> None:
        ipam = None
        if self.compose.subnet:
            ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=self.compose.subnet)])
        with docker_errors(f"creating the services' network {self.network}"
                           + (f" on subnet {self.compose.subnet} (another sandbox of this task may hold it: a "
                              "task that fixes its subnet runs one sandbox per daemon at a time)"
                              if self.compose.subnet else "")):
            self._network_id = self._api.create_network(self.network, driver="bridge", internal=self._internal,
                                                        labels=self._labels, ipam=ipam, check_duplicate=True)["Id"]
        for service, ref in zip(self.compose.services, self._refs):
            self.wait_for(service.depends_on, needed_by=service.name)
            self._run(service, ref)

    def endpoint(self, service: Service) -> dict[str, Any]:
        """The networking config that puts a container on the group's network under its service's names."""
        config = self._api.create_endpoint_config(aliases=[service.name, *service.aliases],
                                                  ipv4_address=service.ipv4_address)
        return self._api.create_networking_config({self.network: config})

    def _run(self, service: Service, ref: str) -> None:
        host_config = self._api.create_host_config(
            init=True, network_mode=self.network, security_opt=["no-new-privileges"], privileged=False,
            **self._limits)
        with docker_errors(f"creating the container of service {service.name!r} from {ref!r}"):
            cid = self._api.create_container(
                ref, command=list(service.command) if service.command is not None else None,
                entrypoint=list(service.entrypoint) if service.entrypoint is not None else None,
                environment=dict(service.environment), working_dir=service.working_dir, user=service.user or "",
                healthcheck=service.healthcheck.docker() if service.healthcheck else None,
                labels={**self._labels, LABEL_SERVICE: service.name}, host_config=host_config,
                networking_config=self.endpoint(service), hostname=service.hostname or service.name,
                name=f"{self._name}-{service.name}"[:120], detach=True)["Id"]
        self.containers[service.name] = cid
        with docker_errors(f"starting service {service.name!r}"):
            self._api.start(cid)

    def wait_for(self, depends_on: tuple[tuple[str, str], ...], *, needed_by: str) -> None:
        """Block until each (service, condition) holds; ServiceFailed naming the service and its last output when
        one cannot (it exited, turned unhealthy, or took longer than its healthcheck allows)."""
        for name, condition in depends_on:
            service = next(s for s in self.compose.services if s.name == name)
            patience = service.healthcheck.patience_s if service.healthcheck else 0.0
            limit = max(_STARTED_WAIT_S, patience + 10.0)
            deadline = time.monotonic() + limit
            while True:
                with docker_errors(f"inspecting service {name!r}"):
                    state = self._api.inspect_container(self.containers[name])["State"]
                health = (state.get("Health") or {}).get("Status")
                done, failed = _judge(condition, state, health)
                if done:
                    break
                if failed or time.monotonic() > deadline:
                    why = failed or f"not {condition.removeprefix('service_')} within {limit:.0f} s"
                    raise ServiceFailed(f"service {name!r}, which {needed_by!r} waits for ({condition}): {why}\n"
                                        f"{self._tail(name, state)}")
                time.sleep(_POLL_S)

    def _tail(self, name: str, state: dict[str, Any]) -> str:
        """The last lines the service printed and its last health probe, for the error."""
        try:
            logs = self._api.logs(self.containers[name], tail=20).decode(errors="replace").rstrip()
        except docker.errors.APIError:
            logs = "(no logs)"
        probes = (state.get("Health") or {}).get("Log") or []
        probe = ""
        if probes:
            last = probes[-1]
            probe = f"\nlast health probe (exit {last.get('ExitCode')}): {last.get('Output', '').strip()[:500]}"
        return f"its output (last 20 lines):\n{logs}{probe}"

    def close(self) -> None:
        """Remove the service containers, then the network. Already-gone ones are fine (reaped, removed by hand)."""
        for cid in self.containers.values():
            _remove(lambda: self._api.remove_container(cid, force=True), f"removing service container {cid[:12]}")
        self.containers = {}
        if self._network_id:
            _remove(lambda: self._api.remove_network(self._network_id), f"removing network {self.network}")
            self._network_id = ""


def _judge(condition: str, state: dict[str, Any], health: str | None) -> tuple[bool, str]:
    """(condition holds, why it never will) for one inspection of a service container."""
    status, code = state.get("Status"), state.get("ExitCode")
    if condition == "service_completed_successfully":
        if status == "exited":
            return code == 0, "" if code == 0 else f"exited with status {code}"
        return False, ""
    if status in ("exited", "dead"):
        return False, f"exited with status {code}" + (" (out of memory)" if state.get("OOMKilled") else "")
    if condition == "service_healthy":
        return health == "healthy", "unhealthy" if health == "unhealthy" else ""
    return status == "running", ""


def _remove(action: Any, what: str) -> None:
    try:
        with docker_errors(what):
            action()
    except SandboxError as e:
        if "No such" not in str(e) and "not found" not in str(e) and "already in progress" not in str(e):
            raise
