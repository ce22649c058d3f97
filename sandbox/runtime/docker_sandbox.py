"""DockerSandbox: one locked-down container driven through one persistent bash over one exec socket.

    with DockerSandbox(image, SandboxSettings(cpus=1.0, memory="1g", network=False), run_id=run_id) as sb:
        r = sb.run("cd /app && ls -la", timeout=30)

A command costs one write and one read on the exec socket (~0.2 ms), never a `docker exec` (tens of ms, and one
daemon serves few per second: `pytest bench/test_bench_sandbox.py -s` prints the costs on your box). The protocol
lives in `sandbox.runtime.shell`. A failed or timed-out command is a `CommandResult`; only the runtime failing raises
(`sandbox.errors`).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import posixpath
import re
import secrets
import shlex
import tarfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import docker
import docker.errors

from sandbox.errors import (CommandTooLong, ContainerDied, DaemonUnreachable, FileTooLarge, SandboxError,
                            ShellUnresponsive)
from sandbox.runtime.docker_host import DockerHost, answers as host_answers
from sandbox.runtime.failure import FailureOrigin, failure_origin
import sandbox.runtime.preload as preload
from sandbox.daemon import daemon_cpus, default_run_id, docker_client, docker_errors, owner_labels
from sandbox.images.image_cache import IMAGE_REPO, TaskImage, touch_image
from sandbox.images.tarball import RootOwned
from sandbox.runtime.services import ServiceGroup
from sandbox.runtime.settings import SandboxSettings
from sandbox.runtime.shell import (Channel, Discard, exec_stream, OutputCap, ShellExited, control_line, encode_command,
                                   init_script, killer_script)

# What a root shell doing a task needs: own/chmod files, bypass file modes, signal its processes, switch users
# (su, apt's _apt sandbox, postgres), bind low ports, write audit records (sudo/PAM), chroot (sshd's privilege
# separation chroots its pre-auth child to /run/sshd: Terminal-Bench's git-over-ssh tasks log in that way). Dropped
# from Docker's default set: MKNOD, NET_RAW (raw sockets, ping spoofing), SETFCAP, SETPCAP.
CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE",
                "AUDIT_WRITE", "SYS_CHROOT")
SHELL_ENV = {"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", "MANPAGER": "cat", "SYSTEMD_PAGER": "",
             "DEBIAN_FRONTEND": "noninteractive"}
TIMEOUT_EXIT_CODE = 124  # what `timeout(1)` returns; the partial output comes with it

_LIVE: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()
# Set once the process removes its sandboxes (exit, SIGTERM): a worker thread must not start a new one after
# that, or a run that was told to stop goes on with its next task.
_CLOSING = threading.Event()


@dataclass(frozen=True)
class CommandResult:
    """What one command did. A timeout or a failure is data here, not an exception."""

    exit_code: int
    """The command's exit status; 124 when it timed out; 128+N when killed by signal N."""
    output: str
    """stdout and stderr interleaved as the terminal saw them, ANSI sequences stripped, capped (head + tail)."""
    timed_out: bool
    """The deadline passed: the command's processes were interrupted, then killed."""
    truncated: bool
    """Output exceeded the cap; the middle was dropped and a marker states how many bytes."""
    duration_s: float
    """Wall time from sending the command to its result (including the interrupt when it timed out)."""
    oom_killed: bool = False
    """A process of the command was killed by the container's out-of-memory killer."""


def _absolute(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"sandbox paths must be absolute, got {path!r}")
    return posixpath.normpath(path)


def _cpus_on_host(cpus: float, host_cpus: Callable[[], int]) -> float:
    """`cpus`, or the Docker host's CPU count when it has fewer: the daemon refuses a limit above it, and a task's
    [environment] cpus is set on its author's machine (Terminal-Bench 2 asks for 4)."""
    host = host_cpus()
    if cpus <= host:
        return cpus
    warnings.warn(f"a sandbox asks for {cpus:g} CPUs and the Docker host has {host}: limited to {host}", stacklevel=4)
    return float(host)


class DockerSandbox:
    """A container with one persistent shell. Use as a context manager; `close()` always removes it.

    `host`: the daemon to run on (`sandbox.runtime.hosts`, which places sandboxes; None: the one from DOCKER_HOST);
    `on_close` is called once when it is closed (the host's capacity is given back)."""

    def __init__(self, image: str | TaskImage, settings: SandboxSettings = SandboxSettings(), *,
                 run_id: str | None = None, host: DockerHost | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        if not isinstance(settings, SandboxSettings):
            if on_close is not None:
                on_close()
            raise TypeError(f"settings must be a SandboxSettings, got {type(settings).__name__}")
        self.host, self._on_close = host, on_close
        # A TaskImage may carry files (a COPY-only Dockerfile, not built): placed before the container starts.
        self.image, self._preload = (image.ref, image.preload) if isinstance(image, TaskImage) else (image, b"")
        self._compose_image = image if isinstance(image, TaskImage) and image.compose is not None else None
        self.services: ServiceGroup | None = None
        """The task's compose services running beside this sandbox (`sandbox.runtime.services`); None without any."""
        self.settings = settings
        self.run_id = run_id or default_run_id()
        self._env = {**SHELL_ENV, **dict(settings.env)}
        self._api = host.api if host is not None else docker_client()
        self._lock = threading.Lock()
        self._closed = False
        self._chan: Channel | None = None
        self._exec_id = ""
        self._keep = ""  # pids the sweeps never kill: init and the keepalive
        self._seq = 0
        self._oom_count = -1
        self.id = ""
        self.preloaded_via = ""
        """How the task's files got in: "upper_dir", "archive" (see sandbox.runtime.preload), "" without any."""
        self._create()
        _LIVE.add(self)
        if _CLOSING.is_set():  # checked after joining _LIVE: a close_live_sandboxes running now may have missed it
            self.close()
            raise SandboxError("the process is shutting down: no new sandbox is started")
        try:
            self._spawn_shell()
        except BaseException:
            self.close()
            raise

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def _create(self) -> None:
        limits, labels = self.settings, owner_labels(self.run_id)
        name = f"t1-{re.sub(r'[^a-zA-Z0-9_.-]', '-', self.run_id)[:40]}-{secrets.token_hex(4)}"
        nano_cpus = int(_cpus_on_host(limits.cpus, self.host.cpus if self.host is not None else daemon_cpus) * 1e9)
        network: dict = {"network_mode": "bridge" if limits.network else "none"}
        networking_config = None
        try:
            if self._compose_image is not None:  # the task's services first, on a network the sandbox then joins
                compose = self._compose_image.compose
                self.services = ServiceGroup.start(
                    self._api, compose, self._compose_image.service_refs, run_id=self.run_id, name=name,
                    internal=not limits.network, memory_bytes=limits.memory_bytes, nano_cpus=nano_cpus)
                self.services.wait_for(compose.agent.depends_on, needed_by=compose.agent.name)
                network = {"network_mode": self.services.network, "dns": list(compose.dns) or None,
                           "extra_hosts": dict(compose.extra_hosts) or None}
                networking_config = self.services.endpoint(compose.agent)
            host_config = self._api.create_host_config(
                init=True, mem_limit=limits.memory_bytes, memswap_limit=limits.memory_bytes, nano_cpus=nano_cpus,
                pids_limit=limits.pids, cap_drop=["ALL"], cap_add=list(CAPABILITIES),
                security_opt=["no-new-privileges"], privileged=False, **network)
            if self.image.startswith(f"{IMAGE_REPO}:"):
                touch_image(self.image)  # the image cache evicts the least recently used (sandbox.images.image_cache)
            with docker_errors(f"creating a container from {self.image!r}"):
                self.id = self._api.create_container(
                    self.image, entrypoint=["sleep", "infinity"], command=[], working_dir=self.settings.workdir,
                    labels=labels, host_config=host_config, hostname="sandbox", name=name, detach=True,
                    networking_config=networking_config)["Id"]
            if self._preload:
                with docker_errors(f"placing the task's files into container {name}"):
                    self.preloaded_via = preload.place(self._api, self.id, self._preload)
            with docker_errors(f"starting container {name}"):
                self._api.start(self.id)
        except BaseException:
            self.close()
            raise

    def _spawn_shell(self) -> None:
        """Start the persistent shell (first time, or after the previous one exited) and wait for its frame."""
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        with docker_errors("starting the sandbox shell"):
            self._exec_id = self._api.exec_create(
                self.id, ["bash", "--noprofile", "--norc", "--noediting", "-i"], stdin=True, tty=True,
                environment=self._env, workdir=self.settings.workdir)["Id"]
            sock = self._api.exec_start(self._exec_id, tty=True, socket=True)
        self._sock_owner = sock  # keeps the HTTP response (and so the connection) alive
        self._chan = Channel(exec_stream(sock))
        token = secrets.token_hex(8)
        deadline = time.monotonic() + self.settings.startup_timeout_s
        try:
            sent = self._chan.send(init_script(token, keep=self._keep), deadline)
            payload = self._chan.read_frame(token, deadline, Discard()) if sent else None
        except ShellExited as e:
            self._raise_if_dead("starting the sandbox shell", settle_s=2.0)  # an error path: wait to be sure
            raise SandboxError(f"the sandbox shell exited during start-up ({e}); does {self.image!r} have bash?")
        if payload is None:
            raise ShellUnresponsive(
                f"the sandbox shell did not start within {self.settings.startup_timeout_s:.0f} s")
        _, stty_rc, shell_pid, oom, *keep = payload.decode().split()
        if stty_rc != "0":
            raise SandboxError(f"stty failed in {self.image!r} (exit {stty_rc}): the shell needs coreutils' stty")
        if len(keep) != 2:
            raise SandboxError(f"could not identify the container's keepalive process (found {keep})")
        self.shell_pid = int(shell_pid)
        self._keep = " ".join(keep)
        self._oom_count = int(oom)

    def close(self) -> None:
        """Remove the container (force). Idempotent; never leaves the container behind on the daemon's side."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self._chan is not None:
            self._chan.close()
        try:
            if self.id:
                try:
                    with docker_errors(f"removing container {self.id[:12]}"):
                        self._api.remove_container(self.id, force=True)
                except DaemonUnreachable:
                    if self.host is None:
                        raise
                    self.host.lost.add(self.id)  # removed when the host answers again (sandbox.runtime.hosts)
                except SandboxError as e:
                    # Already gone or going (reaped, removed by hand) is what close() wants; anything else is not.
                    if "No such container" not in str(e) and "already in progress" not in str(e):
                        raise
            if self.services is not None:  # after the sandbox: a network is removed once nothing is on it
                try:
                    self.services.close()
                except DaemonUnreachable:
                    if self.host is None:
                        raise
                    self.host.lost.update(self.services.containers.values())
                    self.host.lost_networks.add(self.services.network)
        finally:
            if self._on_close is not None:
                self._on_close()
                self._on_close = None

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def api(self) -> docker.APIClient:
        """The API client of the daemon this sandbox runs on."""
        return self._api

    @property
    def host_name(self) -> str:
        return self.host.name if self.host is not None else "local"

    def failure_origin(self, error: SandboxError) -> FailureOrigin:
        """"infra" or "agent" for `error`, raised while the agent used this sandbox (the rule:
        sandbox.runtime.failure)."""
        answers = self.host.ping if self.host is not None else (lambda: host_answers(self._api))
        origin = failure_origin(self._api, self.id, error, host_answers=answers)
        if origin == "infra" and self.host is not None and not self.host.ping():
            self.host.up = False  # out of placement until the health thread hears from it again
        return origin

    def shell_stream_open(self) -> bool:
        """Cheap liveness hint (no round trip): the shell's exec stream has not ended. A killed container or an
        exited shell ends it."""
        return not self._closed and self._chan is not None and not self._chan.peer_closed()

    def _state(self) -> dict:
        with docker_errors(f"inspecting container {self.id[:12]}"):
            return self._api.inspect_container(self.id)["State"]

    def _raise_if_dead(self, what: str, *, settle_s: float = 0.0) -> None:
        """Raise ContainerDied if the container is not running. `settle_s`: when something just ended (a
        stream, a shell), keep looking that long: a killed container's state lags its processes' deaths, by
        more than 50 ms on a loaded box."""
        deadline = time.monotonic() + settle_s
        while True:
            try:
                state = self._state()
            except SandboxError as e:
                raise ContainerDied(f"{what}: the container is gone ({e})") from e
            if not state["Running"]:
                break
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)
        oom = bool(state.get("OOMKilled"))
        why = "OOM-killed (memory limit reached)" if oom else f"stopped (exit {state.get('ExitCode')})"
        raise ContainerDied(f"{what}: container {self.id[:12]} {why}", oom_killed=oom,
                            exit_code=state.get("ExitCode"))

    # ---- commands --------------------------------------------------------------------------------------------

    def run(self, command: str, *, timeout: float = 60.0) -> CommandResult:
        """Run `command` in the persistent shell (state persists) and return its exit code and capped output.

        The command's stdin is /dev/null. On timeout its foreground process group gets Ctrl-C, then after
        `interrupt_grace_s` everything it started (background children too) is killed, and the shell serves the
        next command. Raises CommandTooLong, ContainerDied (with `oom_killed`), ShellUnresponsive.
        """
        if not isinstance(command, str):
            raise TypeError(f"command must be str, got {type(command).__name__}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        data = command.encode("utf-8")
        if b"\x00" in data:
            raise ValueError("command contains a NUL byte, which no shell command can hold")
        if len(data) > self.settings.max_command_bytes:
            raise CommandTooLong(f"command is {len(data)} bytes; the limit is {self.settings.max_command_bytes} "
                                 "(write large scripts with write_file and run them)")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("DockerSandbox.run called while another command is running on this sandbox")
        try:
            if self._closed:
                raise SandboxError("run() on a closed sandbox")
            return self._run_locked(data, timeout)
        finally:
            self._lock.release()

    def _run_locked(self, data: bytes, timeout: float) -> CommandResult:
        assert self._chan is not None
        self._seq += 1
        token = secrets.token_hex(8)
        cap = OutputCap(self.settings.output_cap)
        notes: list[str] = []
        t0 = time.monotonic()
        timed_out = False
        try:
            payload = None
            if self._chan.send(encode_command(data, seq=self._seq, token=token), t0 + timeout):
                payload = self._chan.read_frame(token, t0 + timeout, cap)
            if payload is None:
                timed_out = True
                exit_code = TIMEOUT_EXIT_CODE
                notes += self._interrupt(token, cap, t0)
            else:
                exit_code = int(payload)
        except ShellExited:
            exit_code, note = self._after_shell_exit()
            notes.append(note)
        oom = exit_code == 137 and self._oom_since_last()
        if oom:
            mib = self.settings.memory_bytes >> 20
            notes.append(f"[t1: killed by the out-of-memory killer (memory limit {mib} MiB)]")
        output = cap.text()
        if notes:
            output += ("" if not output or output.endswith("\n") else "\n") + "\n".join(notes) + "\n"
        return CommandResult(exit_code=exit_code, output=output, timed_out=timed_out, truncated=cap.dropped > 0,
                             duration_s=time.monotonic() - t0, oom_killed=oom)

    def _control(self, line: str, *, timeout: float, sink: Discard | OutputCap | None = None,
                 payload: str = "$?") -> bytes | None:
        """Run a protocol-internal line in the shell (no marker); return the frame's payload (None: no reply)."""
        assert self._chan is not None
        token = secrets.token_hex(8)
        deadline = time.monotonic() + timeout
        if not self._chan.send(control_line(f"{line}; __t1_frame {token} {payload}"), deadline):
            return None
        return self._chan.read_frame(token, deadline, sink or Discard())

    def _interrupt(self, token: str, cap: OutputCap, t0: float) -> list[str]:
        """Ctrl-C the command; if the shell does not come back, SIGKILL its processes from outside; then sweep its
        background children. Returns notes for the output."""
        assert self._chan is not None
        is_sync = (lambda payload: payload == b"sync")
        # Ctrl-C alone first: the TTY flushes unread input on it, so the sync line must come after.
        self._chan.send(b"\x03", time.monotonic() + 1.0)
        time.sleep(0.02)
        self._chan.send(control_line(f"__t1_frame {token} sync"), time.monotonic() + 1.0)
        if self._chan.read_frame(token, time.monotonic() + self.settings.interrupt_grace_s, cap, is_sync) is None:
            self._exec_killer(want=str(self._seq), maxage_cs=self._age_cs(t0))
            if self._chan.read_frame(token, time.monotonic() + 2.0, cap, is_sync) is None:
                # The shell itself is stuck (e.g. a builtin loop that ignores SIGINT): replace it.
                self._exec_killer(want="shell", maxage_cs=-1)
                self._spawn_shell()
                return ["[t1: the shell did not respond to the interrupt and was replaced: cwd, variables and "
                        "functions were reset]"]
        if self._control(f"__t1_sweep {self._seq} {self._age_cs(t0)}", timeout=30.0, sink=cap) is None:
            raise ShellUnresponsive("the shell did not finish killing the timed-out command's processes in 30 s")
        return []

    @staticmethod
    def _age_cs(t0: float) -> int:
        # Centiseconds since the command started, plus a margin for clock granularity.
        return int((time.monotonic() - t0 + 0.5) * 100)

    def _exec_killer(self, *, want: str, maxage_cs: int) -> None:
        """Out-of-band kill through a short-lived `docker exec` (rare: only when the shell stops answering)."""
        if want == "shell":
            script = f"kill -KILL {self.shell_pid}"
        else:
            script = killer_script(keep=f"{self._keep} {self.shell_pid}", want=want, maxage_cs=maxage_cs)
        for attempt in range(5):  # the exec itself needs a pid: retry while a fork bomb holds the pids limit
            try:
                with docker_errors("killing the timed-out command's processes"):
                    exec_id = self._api.exec_create(self.id, ["bash", "-c", script])["Id"]
                    self._api.exec_start(exec_id)
                return
            except SandboxError:
                self._raise_if_dead("killing the timed-out command's processes")
                if attempt == 4:
                    raise
                time.sleep(0.2)

    def _after_shell_exit(self) -> tuple[int, str]:
        """The exec stream ended mid-command: the container died (raise) or the shell exited (`exit`, `set -e`):
        report its exit code and start a fresh shell."""
        deadline = time.monotonic() + 5.0
        info: dict = {}
        while time.monotonic() < deadline:
            with docker_errors("inspecting the sandbox shell"):
                info = self._api.exec_inspect(self._exec_id)
            if not info.get("Running"):
                break
            time.sleep(0.02)
        self._raise_if_dead("running a command", settle_s=0.25)  # a killed container's state lags the exec's end
        code = info.get("ExitCode")
        code = -1 if code is None else int(code)
        self._spawn_shell()
        return code, (f"[t1: the shell exited (code {code}); a fresh shell was started in {self.settings.workdir}: "
                      "cwd, variables and functions were reset]")

    def _oom_since_last(self) -> bool:
        """Did the cgroup's oom_kill counter grow since the last look? (False where the counter is not visible.)"""
        reply = self._control("__t1_oom", timeout=10.0, payload='"$__t1_n"')
        if reply is None:
            raise ShellUnresponsive("the shell did not answer the OOM-counter query in 10 s")
        count = int(reply)
        grew = count > self._oom_count >= 0
        self._oom_count = count
        return grew

    def kill_all_processes(self) -> None:
        """Kill every process in the container except init, the keepalive and the shell (before verification)."""
        if self._closed:
            raise SandboxError("kill_all_processes() on a closed sandbox")
        with self._lock:
            try:
                reply = self._control("__t1_sweep all -1", timeout=30.0)
            except ShellExited:
                self._raise_if_dead("killing all processes")
                self._spawn_shell()
                reply = self._control("__t1_sweep all -1", timeout=30.0)
            if reply != b"0":
                raise ShellUnresponsive(f"the process sweep did not finish (reply {reply!r})")

    # ---- files -----------------------------------------------------------------------------------------------

    def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write `data` to the absolute `path` (parents created), owned by root."""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        parent, name = posixpath.split(_absolute(path))
        if not name:
            raise ValueError(f"path must name a file, got {path!r}")
        if len(data) > self.settings.max_file_bytes:
            raise FileTooLarge(f"{path}: {len(data)} bytes exceed max_file_bytes={self.settings.max_file_bytes}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(bytes(data)))
        self._put_archive(parent, buf.getvalue())

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Bytes of the file at `path` (symlinks followed). FileNotFoundError, IsADirectoryError, FileTooLarge."""
        cap = max_bytes or self.settings.max_file_bytes
        path = _absolute(path)
        for _ in range(16):
            with docker_errors(f"reading {path}"):
                try:
                    stream, stat = self._api.get_archive(self.id, path, chunk_size=1 << 20)
                except docker.errors.NotFound:
                    self._raise_if_dead(f"reading {path}")
                    raise FileNotFoundError(f"{path}: no such file in the sandbox") from None
                if stat.get("linkTarget"):
                    path = posixpath.normpath(posixpath.join(posixpath.dirname(path), stat["linkTarget"]))
                    continue
                if stat["mode"] & (1 << 31):  # Go's os.ModeDir
                    raise IsADirectoryError(f"{path} is a directory in the sandbox")
                if stat["size"] > cap:
                    raise FileTooLarge(f"{path}: {stat['size']} bytes exceed the cap of {cap}")
                blob = bytearray()
                for chunk in stream:
                    blob += chunk
                    if len(blob) > cap + (1 << 20):  # the tar stream adds headers and padding only
                        raise FileTooLarge(f"{path}: grew past the cap of {cap} bytes while being read")
            with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
                member = tar.next()
                extracted = tar.extractfile(member) if member is not None else None
                if extracted is None:
                    raise SandboxError(f"{path}: the daemon's archive holds no regular file")
                return extracted.read()
        raise SandboxError(f"{path}: more than 16 levels of symlinks")

    def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str) -> None:
        """Copy the contents of `local_dir` into `remote_dir` (created), owned by root."""
        local = Path(local_dir)
        if not local.is_dir():
            raise NotADirectoryError(f"local_dir must be a directory, got {str(local)!r}")
        as_root = RootOwned(self.settings.max_file_bytes, lambda: FileTooLarge(
            f"{local} holds more than max_file_bytes={self.settings.max_file_bytes}"))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for child in sorted(local.iterdir()):
                tar.add(child, arcname=child.name, filter=as_root)
        self._put_archive(_absolute(remote_dir), buf.getvalue())

    def _put_archive(self, remote_dir: str, blob: bytes) -> None:
        with docker_errors(f"writing into {remote_dir}"):
            try:
                self._api.put_archive(self.id, remote_dir, blob)
                return
            except docker.errors.NotFound:
                self._raise_if_dead(f"writing into {remote_dir}")
        self.ensure_dir(remote_dir)  # the target directory did not exist
        with docker_errors(f"writing into {remote_dir}"):
            self._api.put_archive(self.id, remote_dir, blob)

    def ensure_dir(self, path: str) -> None:
        """`mkdir -p path` in the sandbox."""
        r = self.run(f"mkdir -p -- {shlex.quote(_absolute(path))}", timeout=30)
        if r.exit_code != 0:
            raise SandboxError(f"mkdir -p {path!r} failed in the sandbox: {r.output.strip()}")

    def __repr__(self) -> str:
        return f"DockerSandbox(id={self.id[:12]!r}, image={self.image!r}, run_id={self.run_id!r})"


@atexit.register
def close_live_sandboxes() -> None:
    """Remove every sandbox of this process that is still open. At exit: a normally exiting process removes
    its containers (a killed one leaves them to `reap`); sandbox.runtime.signals calls it on SIGTERM/SIGINT. No
    sandbox starts after it."""
    _CLOSING.set()
    for sb in list(_LIVE):
        with contextlib.suppress(SandboxError):
            sb.close()
