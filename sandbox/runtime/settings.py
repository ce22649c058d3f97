"""SandboxSettings: how one sandbox is confined and driven, as one frozen value; and SandboxSection, the run
config's [sandbox] table (the limits every episode's sandbox gets, the pool, the hosts), from which each episode's
SandboxSettings are made (`SandboxSettings.for_task`).

    DockerSandbox(image, SandboxSettings(cpus=2.0, memory="4g"), run_id=run_id)
    SandboxPool(image, size=4, settings=SandboxSettings.for_task(task, network=False))

One value rather than a dozen keyword arguments: a pool hands the same settings to every sandbox it starts,
episodes with equal settings share a pool (the value is hashable), and every limit is checked once, here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandbox.runtime.host_spec import HostSpec  # parsing only: no Docker SDK is loaded
from t1config import check, check_types, knob

if TYPE_CHECKING:
    from sandbox.tasks.format import Task

MIN_PIDS = 16
"""Lowest process limit a sandbox may get: init, the keep-alive and the shell machinery need a few."""
MIN_OUTPUT_CAP = 256
"""Fewest bytes of a command's output that may be shown (its first and last halves)."""


def parse_memory(memory: str | int) -> int:
    """Bytes of a memory limit given as bytes or like '512m', '1g', '2GiB'."""
    if isinstance(memory, int):
        return memory
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)i?b?\s*", memory.lower())
    if m is None:
        raise ValueError(f"memory must be bytes or like '512m'/'1g', got {memory!r}")
    return int(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")


@dataclass(frozen=True, kw_only=True)
class SandboxSettings:
    """Limits and driving knobs of one sandbox. The defaults are a locked-down 1-CPU, 1 GiB box without network."""

    cpus: float = 1.0
    """CPU quota (cores)."""
    memory: str | int = "1g"
    """Memory limit, swap included: bytes or like '512m' / '1g'."""
    pids: int = 256
    """Process limit (a fork bomb stops there)."""
    network: bool = False
    """A network at all (bridge); off unless the task asks for one (`sandbox.tasks.format.sandbox_network`)."""
    workdir: str = "/app"
    """Where the shell starts, and starts again after it exits."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the shell, as (name, value) pairs (a tuple keeps the settings hashable)."""
    output_cap: int = 16 * 1024
    """Bytes of a command's output returned: the first and last halves, the middle cut with a marker."""
    max_command_bytes: int = 1 << 20
    """Longest command text accepted (`sandbox.errors.CommandTooLong` beyond)."""
    max_file_bytes: int = 64 << 20
    """Largest file `write_file` / `read_file` / `upload_dir` move (`sandbox.errors.FileTooLarge` beyond)."""
    interrupt_grace_s: float = 1.0
    """After a timeout: how long the interrupted command gets to stop before its processes are killed."""
    startup_timeout_s: float = 60.0
    """How long the shell may take to answer its first frame."""

    def __post_init__(self) -> None:
        if not self.cpus > 0:
            raise ValueError(f"cpus must be > 0, got {self.cpus}")
        object.__setattr__(self, "memory", parse_memory(self.memory))  # one spelling: bytes
        if self.memory < 16 << 20:
            raise ValueError(f"memory must be >= 16 MiB, got {self.memory} bytes")
        if self.pids < MIN_PIDS:
            raise ValueError(f"pids must be >= {MIN_PIDS} (the shell machinery needs a few), got {self.pids}")
        if self.output_cap < MIN_OUTPUT_CAP:
            raise ValueError(f"output_cap must be >= {MIN_OUTPUT_CAP} bytes, got {self.output_cap}")
        if not self.workdir.startswith("/"):
            raise ValueError(f"workdir must be absolute, got {self.workdir!r}")
        for name in ("max_command_bytes", "max_file_bytes", "interrupt_grace_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if isinstance(self.env, dict):  # accepted for convenience, stored as sorted pairs
            object.__setattr__(self, "env", tuple(sorted(self.env.items())))

    @property
    def memory_bytes(self) -> int:
        return int(self.memory)

    @classmethod
    def for_task(cls, task: Task, *, network: bool, cpus: float | None = None, memory_mb: int | None = None,
                 **rest: object) -> SandboxSettings:
        """The task's own environment ([environment] of its task.toml: CPUs, memory, workdir; a TB1 compose
        file's environment for the agent's service), with `cpus` / `memory_mb` overriding the task's when given;
        `rest` sets the other fields (its `env` added to the task's)."""
        env = dict(task.compose.agent_env if task.compose else ())  # the compose file's environment, then rest's
        env.update(dict(rest.pop("env", ())))  # type: ignore[arg-type]
        return cls(cpus=task.cpus if cpus is None else cpus,
                   memory=(task.memory_mb if memory_mb is None else memory_mb) << 20,
                   network=network, workdir=task.workdir, env=tuple(sorted(env.items())),
                   **rest)  # type: ignore[arg-type]

    @classmethod
    def for_run(cls, task: Task, sandbox: SandboxSection | None = None) -> SandboxSettings:
        """The sandbox of a task's environment under the run's [sandbox] section (its cpus / memory_mb, when set,
        over the task's own; its process limit and output cap), with the network the task asks for."""
        sandbox = sandbox or SandboxSection()
        return cls.for_task(task, network=task.network, cpus=sandbox.cpus, memory_mb=sandbox.memory_mb,
                            pids=sandbox.pids, output_cap=sandbox.output_cap_bytes)


@dataclass(frozen=True, kw_only=True)
class SandboxSection:
    """The run config's [sandbox] table. CPU and memory default to each task's own `[environment]` (Harbor task.toml;
    `sandbox.tasks.format` fills in 1 CPU and 2048 MiB when it says nothing): a value here overrides them for every
    task. The process limit, command timeout and output cap are the run's alone (no task format names them)."""

    cpus: float | None = knob(
        None, "CPU quota of every sandbox container; none = each task's own [environment] cpus (task.toml; 1 when "
        "it sets none; the built-in tasks ask for 1)")
    memory_mb: int | None = knob(
        None, "memory limit of every sandbox container in MiB, swap included; none = each task's own [environment] "
        "memory_mb (2048 when it sets none; the built-in families ask for 512, the fixed tasks for 1024)")
    pids: int = knob(256, "process limit per sandbox container (a fork bomb stops there)")
    command_timeout_s: float = knob(10.0, "wall-clock limit of one agent command; it is killed after that")
    output_cap_bytes: int = knob(
        16384, "bytes of a command's output shown to the agent: its first and last halves, the middle cut")
    pool_size: int = knob(4, "sandboxes kept started ahead of need, per environment (image and limits); never "
                                  "more than the episodes it still has to serve")
    hosts: tuple[str, ...] = knob(
        (), "Docker hosts the sandboxes run on, each 'URL [tls=DIR] [max=N] [memory_mb=M] [name=NAME]' (unix://, "
        "tcp:// with TLS, ssh://; sandbox.runtime.hosts); placed by free room, a host that stops answering is left "
        "out until it answers again; none = the one daemon of DOCKER_HOST")

    def __post_init__(self) -> None:
        check_types(self)
        check(self.cpus is None or self.cpus > 0, "sandbox.cpus", "> 0 or none", self.cpus)
        check(self.memory_mb is None or self.memory_mb >= 16, "sandbox.memory_mb", ">= 16 or none", self.memory_mb)
        check(self.pids >= MIN_PIDS, "sandbox.pids", f">= {MIN_PIDS} (the shell machinery needs a few)", self.pids)
        check(self.command_timeout_s > 0, "sandbox.command_timeout_s", "> 0", self.command_timeout_s)
        check(self.output_cap_bytes >= MIN_OUTPUT_CAP, "sandbox.output_cap_bytes", f">= {MIN_OUTPUT_CAP}",
              self.output_cap_bytes)
        check(self.pool_size >= 1, "sandbox.pool_size", ">= 1", self.pool_size)
        for entry in self.hosts:
            HostSpec.parse(entry)  # ValueError naming the entry and what is wrong
