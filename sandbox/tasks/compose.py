"""A Terminal-Bench 1 task's docker-compose.yaml: the agent's service and the services it talks to.

TB1 runs every task through `docker compose`: the agent works in one service (`client`, or the one whose image is
the harness's `${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}`), and some tasks add services beside it (a mock website,
an API and its database, a DNS server) that the agent and the tests reach by service name. T1 reads the parts of
the file that decide what runs and how it is reached, and `sandbox.runtime.services` starts them for every sandbox:

  build / image            what the service runs (a build context inside the task, or an image on the daemon)
  command, entrypoint      its process (a string is split as a shell would, as compose does)
  working_dir, user,
  hostname                 as in compose
  environment              its variables (list or mapping; ${VAR} and ${VAR:-default} interpolated)
  healthcheck              Docker's healthcheck (test, interval, timeout, retries, start_period)
  depends_on               start order and what to wait for: service_started, service_healthy,
                           service_completed_successfully
  networks                 aliases and a fixed ipv4_address; a network's ipam subnet
  dns, extra_hosts         the agent service's resolver settings

All services share one private network per sandbox (compose's networks of one task collapse into it), reachable
by service name; it has no route out unless the sandbox has a network. Host ports (`ports`) are not published
and volumes are not mounted: the harness's only volume is its log directory.
"""

from __future__ import annotations

import dataclasses
import graphlib
import ipaddress
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

from sandbox.errors import TaskFormatError

# The harness's variables the compose files use; TB1 sets them for the agent's container.
HARNESS_VARIABLES = {"T_BENCH_TEST_DIR": "/tests", "T_BENCH_CONTAINER_LOGS_PATH": "/var/log/tbench"}
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
# Compose's healthcheck defaults (the compose specification).
_HEALTH_DEFAULTS = {"interval": 30.0, "timeout": 30.0, "retries": 3, "start_period": 0.0}
_AGENT_IMAGE = "T_BENCH_TASK_DOCKER_CLIENT"
_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_VARIABLE = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"
                       r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)|(?P<dollar>\$))")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")


@dataclasses.dataclass(frozen=True)
class Healthcheck:
    """Docker's healthcheck of a service: `test` in Docker's form, ("CMD", argv...) or ("CMD-SHELL", script)."""

    test: tuple[str, ...]
    interval_s: float = _HEALTH_DEFAULTS["interval"]
    timeout_s: float = _HEALTH_DEFAULTS["timeout"]
    retries: int = int(_HEALTH_DEFAULTS["retries"])
    start_period_s: float = _HEALTH_DEFAULTS["start_period"]

    def docker(self) -> dict[str, Any]:
        """The Engine API's HealthConfig (durations in nanoseconds)."""
        ns = 1_000_000_000
        return {"test": list(self.test), "interval": int(self.interval_s * ns), "timeout": int(self.timeout_s * ns),
                "retries": self.retries, "start_period": int(self.start_period_s * ns)}

    @property
    def patience_s(self) -> float:
        """How long Docker may take to call the service healthy or unhealthy."""
        return self.start_period_s + (self.retries + 1) * (self.interval_s + self.timeout_s)


@dataclasses.dataclass(frozen=True)
class Service:
    """One compose service: what it runs, how it is reached, what it waits for."""

    name: str
    context: Path | None
    """Build context (inside the task directory); None: the service runs `image` as it is."""
    dockerfile: Path | None
    image: str | None
    command: tuple[str, ...] | None = None
    entrypoint: tuple[str, ...] | None = None
    environment: tuple[tuple[str, str], ...] = ()
    healthcheck: Healthcheck | None = None
    depends_on: tuple[tuple[str, str], ...] = ()
    """(service, condition) pairs: what must hold before this service (or the agent) starts."""
    aliases: tuple[str, ...] = ()
    """Names it answers to on the network besides its own."""
    ipv4_address: str | None = None
    working_dir: str | None = None
    user: str | None = None
    hostname: str | None = None


@dataclasses.dataclass(frozen=True)
class Compose:
    """The compose file of a task: the agent's service and the others (dependencies first)."""

    agent: Service
    services: tuple[Service, ...]
    subnet: str | None = None
    dns: tuple[str, ...] = ()
    extra_hosts: tuple[tuple[str, str], ...] = ()

    @property
    def agent_env(self) -> tuple[tuple[str, str], ...]:
        return self.agent.environment


def load_compose(path: Path, root: Path) -> Compose:
    """Read `path` (a task's docker-compose.yaml; `root` its task directory). Raises TaskFormatError naming the
    field on anything malformed: an unknown dependency, a cycle, a healthy-wait on a service without a
    healthcheck, a build context outside the task."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
        services = doc.get("services") or {}
    except (yaml.YAMLError, AttributeError) as e:
        raise TaskFormatError(path, "services", f"not a compose file: {e}") from e
    if not isinstance(services, dict) or not all(isinstance(v, dict) for v in services.values()):
        raise TaskFormatError(path, "services", "expected a mapping of service name to its settings")
    for name in services:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise TaskFormatError(path, "services", f"service name {name!r} is not a valid host name")
    agent = _agent_name(path, services)
    parsed = {name: _service(path, root, name, spec, agent=name == agent) for name, spec in services.items()}
    _check_dependencies(path, parsed)
    for s in parsed.values():
        if any(d == agent for d, _ in s.depends_on):
            raise TaskFormatError(path, f"services.{s.name}.depends_on", f"depends on the agent's service {agent!r}, "
                                  "which T1 starts last (its container is the sandbox)")
    order = graphlib.TopologicalSorter({n: [d for d, _ in s.depends_on] for n, s in parsed.items()})
    try:
        names = [n for n in order.static_order() if n != agent]
    except graphlib.CycleError as e:
        raise TaskFormatError(path, "depends_on", f"services depend on each other in a cycle: {e.args[1]}") from None
    spec = services[agent]
    return Compose(agent=parsed[agent], services=tuple(parsed[n] for n in names),
                   subnet=_subnet(path, doc.get("networks")), dns=_strings(path, f"services.{agent}.dns",
                                                                           spec.get("dns")),
                   extra_hosts=_extra_hosts(path, agent, spec.get("extra_hosts")))


def _agent_name(path: Path, services: dict[str, dict]) -> str:
    """`client`, else the service whose image or container is the harness's client, else the only one."""
    if "client" in services:
        return "client"
    named = [n for n, s in services.items()
             if any(_AGENT_IMAGE in str(s.get(k, "")) for k in ("image", "container_name"))]
    if len(named) == 1:
        return named[0]
    if len(services) == 1:
        return next(iter(services))
    raise TaskFormatError(path, "services", f"no service named 'client' among {sorted(services)}, and none runs "
                          f"the harness's ${{{_AGENT_IMAGE}_IMAGE_NAME}}")


def _service(path: Path, root: Path, name: str, spec: dict[str, Any], *, agent: bool) -> Service:
    field = f"services.{name}"
    build, image = spec.get("build"), spec.get("image")
    context = dockerfile = None
    if build is not None:
        if isinstance(build, str):
            build = {"context": build}
        if not isinstance(build, dict):
            raise TaskFormatError(path, f"{field}.build", f"expected a path or a mapping, got {build!r:.60}")
        context = (root / str(build.get("context", "."))).resolve()
        dockerfile = (context / str(build.get("dockerfile", "Dockerfile"))).resolve()
        if not context.is_relative_to(root) or not dockerfile.is_relative_to(context) or not dockerfile.is_file():
            raise TaskFormatError(path, f"{field}.build", f"Dockerfile {dockerfile} is missing or outside the task "
                                  "directory")
    elif not agent and not isinstance(image, str):
        raise TaskFormatError(path, field, "neither a build section nor an image")
    networks = spec.get("networks") or {}
    endpoint = next(iter(networks.values()), None) if isinstance(networks, dict) else None
    if isinstance(networks, dict) and len(networks) > 1:
        warnings.warn(f"{path}: {field} joins networks {sorted(networks)}; T1 puts every service of a task on one "
                      "network", stacklevel=4)
    endpoint = endpoint if isinstance(endpoint, dict) else {}
    ipv4 = endpoint.get("ipv4_address")
    if ipv4 is not None:
        try:
            ipaddress.IPv4Address(str(ipv4))
        except ValueError:
            raise TaskFormatError(path, f"{field}.networks", f"ipv4_address {ipv4!r} is not an IPv4 address") from None
    return Service(
        name=name, context=context, dockerfile=dockerfile, image=image if isinstance(image, str) else None,
        command=_argv(path, f"{field}.command", spec.get("command")),
        entrypoint=_argv(path, f"{field}.entrypoint", spec.get("entrypoint")),
        environment=_environment(path, f"{field}.environment", spec.get("environment")),
        healthcheck=_healthcheck(path, f"{field}.healthcheck", spec.get("healthcheck")),
        depends_on=_depends_on(path, f"{field}.depends_on", spec.get("depends_on")),
        aliases=tuple(_strings(path, f"{field}.networks.aliases", endpoint.get("aliases"))),
        ipv4_address=None if ipv4 is None else str(ipv4),
        working_dir=None if spec.get("working_dir") is None else str(spec["working_dir"]),
        user=None if spec.get("user") is None else str(spec["user"]),
        hostname=None if spec.get("hostname") is None else str(spec["hostname"]))


def _argv(path: Path, field: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return tuple(str(v) for v in value)
    raise TaskFormatError(path, field, f"expected a string or a list of strings, got {value!r:.60}")


def interpolate(text: str) -> str:
    """Compose's variable interpolation with the harness's variables set and every other one unset (compose then
    substitutes the default, or an empty string)."""
    def sub(m: re.Match) -> str:
        if m["dollar"]:
            return "$"
        name = m["braced"] or m["bare"]
        value = HARNESS_VARIABLES.get(name)
        if m["op"] is not None and (value is None or (m["op"] == ":-" and not value)):
            return m["default"]
        return value or ""
    return _VARIABLE.sub(sub, text)


def _environment(path: Path, field: str, value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = [(str(k), "" if v is None else str(v)) for k, v in value.items()]
    elif isinstance(value, list):
        pairs = [tuple(str(v).partition("=")[::2]) for v in value]  # type: ignore[misc]
    else:
        raise TaskFormatError(path, field, f"expected a list of NAME=value or a mapping, got {value!r:.60}")
    return tuple((k, interpolate(v)) for k, v in pairs if k)


def _seconds(path: Path, field: str, value: Any) -> float:
    """A compose duration: '5s', '1m30s', '250ms', or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    parts = _DURATION.findall(str(value))
    if not parts or "".join(a + b for a, b in parts) != str(value).replace(" ", ""):
        raise TaskFormatError(path, field, f"expected a duration like '5s' or '1m30s', got {value!r}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def _healthcheck(path: Path, field: str, value: Any) -> Healthcheck | None:
    if value is None or (isinstance(value, dict) and value.get("disable")):
        return None
    if not isinstance(value, dict) or "test" not in value:
        raise TaskFormatError(path, field, "expected a mapping with a test")
    test = value["test"]
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    if not (isinstance(test, list) and len(test) >= 2 and test[0] in ("CMD", "CMD-SHELL")):
        raise TaskFormatError(path, f"{field}.test", f"expected ['CMD', ...], ['CMD-SHELL', '...'] or a string, "
                              f"got {test!r:.80}")
    retries = value.get("retries", _HEALTH_DEFAULTS["retries"])
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
        raise TaskFormatError(path, f"{field}.retries", f"expected a positive integer, got {retries!r}")
    return Healthcheck(test=tuple(str(t) for t in test), retries=retries,
                       **{f"{k}_s": _seconds(path, f"{field}.{k}", value.get(k, d))
                          for k, d in _HEALTH_DEFAULTS.items() if k != "retries"})


def _depends_on(path: Path, field: str, value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple((str(v), "service_started") for v in value)
    if not isinstance(value, dict):
        raise TaskFormatError(path, field, f"expected a list or a mapping, got {value!r:.60}")
    out = []
    for name, spec in value.items():
        condition = (spec or {}).get("condition", "service_started") if isinstance(spec, dict) else None
        if condition not in CONDITIONS:
            raise TaskFormatError(path, f"{field}.{name}", f"condition must be one of {CONDITIONS}, got {condition!r}")
        out.append((str(name), condition))
    return tuple(out)


def _check_dependencies(path: Path, services: dict[str, Service]) -> None:
    for s in services.values():
        for name, condition in s.depends_on:
            if name not in services:
                raise TaskFormatError(path, f"services.{s.name}.depends_on", f"no service named {name!r} (there "
                                      f"are {sorted(services)})")
            if condition == "service_healthy" and services[name].healthcheck is None:
                raise TaskFormatError(path, f"services.{s.name}.depends_on", f"waits for {name!r} to be healthy, "
                                      f"but {name!r} has no healthcheck")


def _strings(path: Path, field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TaskFormatError(path, field, f"expected a string or a list of strings, got {value!r:.60}")


def _extra_hosts(path: Path, agent: str, value: Any) -> tuple[tuple[str, str], ...]:
    field = f"services.{agent}.extra_hosts"
    if isinstance(value, dict):
        return tuple((str(k), str(v)) for k, v in value.items())
    out = []
    for entry in _strings(path, field, value):
        host, sep, ip = entry.partition(":") if "=" not in entry else entry.partition("=")
        if not sep or not host or not ip:
            raise TaskFormatError(path, field, f"expected 'host:ip', got {entry!r}")
        out.append((host, ip))
    return tuple(out)


def _subnet(path: Path, networks: Any) -> str | None:
    """The one ipam subnet the task's networks ask for (a task that fixes addresses needs its subnet)."""
    subnets = []
    for name, spec in (networks or {}).items() if isinstance(networks, dict) else ():
        for cfg in ((spec or {}).get("ipam") or {}).get("config") or [] if isinstance(spec, dict) else []:
            if isinstance(cfg, dict) and cfg.get("subnet"):
                try:
                    subnets.append(str(ipaddress.IPv4Network(str(cfg["subnet"]))))
                except ValueError:
                    raise TaskFormatError(path, f"networks.{name}.ipam", f"subnet {cfg['subnet']!r} is not an IPv4 "
                                          "network") from None
    if len(subnets) > 1:
        raise TaskFormatError(path, "networks", f"T1 puts a task's services on one network; they ask for subnets "
                              f"{subnets}")
    return subnets[0] if subnets else None
