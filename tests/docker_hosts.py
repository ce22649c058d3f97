"""Extra Docker daemons on this box, for the multi-host tests and the benchmark (`sandbox.runtime.hosts`).

Each daemon gets its own data root, exec root, unix socket, pidfile, bridge (a fresh `ip link` bridge with a
private /24 that no interface here uses) and address pool for user networks. One of them also listens on TCP
127.0.0.1 with TLS, its certificates made here with openssl (a CA, a server and a client certificate). Never
`--bridge none`: that makes dockerd delete the main daemon's docker0 as it starts. The main daemon is not
touched: `stop()` checks that docker0 is still there. Their state lives on a tmpfs mounted for them (unmounted at
`stop()`, which takes ~3 s instead of ~50 s of deleting image layers from the disk).

With `ssh=i`, daemon i is also reached over SSH, as a remote box would be: an sshd of the test's own on 127.0.0.1
(its host key, an authorized client key, `SetEnv DOCKER_HOST` pointing its sessions at daemon i), and the client
side the Docker SDK runs (the `ssh` binary, `docker system dial-stdio` on the far end) configured by an ssh_config
file of the test's. ssh reads ~/.ssh/config from the user's passwd entry, not $HOME, so `ssh_bin` holds an `ssh`
that passes `-F` that file: put it first on PATH (what a user's ~/.ssh/config entry for the box would do).

    with ExtraDaemons(3, tls=1, ssh=0) as fleet:  # fleet.spec(i): "unix:///..." or "tcp://127.0.0.1:N tls=DIR";
        fleet.ssh_spec(): "ssh://root@t1-ssh-PID", daemon 0 again
        fleet.kill(0); fleet.restart(0)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.machine import free_port

_START_TIMEOUT_S = 60.0
SSHD = "/usr/sbin/sshd"
"""Debian's openssh-server (sshd wants its absolute path)."""


@dataclass
class Daemon:
    """One extra dockerd: where it keeps its state and how to reach it."""

    index: int
    root: Path
    bridge: str
    subnet_octet: int
    tcp_port: int | None
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def cli_host(self) -> list[str]:
        """`docker` CLI arguments that reach this daemon (over its unix socket)."""
        return ["docker", "-H", self.url]


def _used_octets() -> set[int]:
    """Third octets of the 10.213.x.0/24 subnets some interface here already has."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    return {int(w.split(".")[2]) for w in out.split() if w.startswith("10.213.")}


def _make_certs(d: Path) -> None:
    """CA, server (127.0.0.1) and client certificates, as dockerd and the SDK want them (ca.pem, cert.pem, key.pem
    for the client; server-*.pem for the daemon)."""
    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=t1-test-ca",
         "-keyout", "ca-key.pem", "-out", "ca.pem")
    (d / "server.ext").write_text("subjectAltName = IP:127.0.0.1\nextendedKeyUsage = serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage = clientAuth\n")
    for who, ext in (("server", "server.ext"), ("client", "client.ext")):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", f"{who}-key.pem",
             "-out", f"{who}.csr")
        ossl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
             "-days", "2", "-extfile", ext, "-out", f"{who}-cert.pem")
    shutil.copy(d / "client-cert.pem", d / "cert.pem")
    shutil.copy(d / "client-key.pem", d / "key.pem")


class ExtraDaemons:
    """`num` extra dockerd processes (index `tls` also on TCP+TLS); a context manager that stops them and removes
    their bridges and state."""

    def __init__(self, num: int, *, tls: int | None = None, ssh: int | None = None) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="t1d-", dir="/tmp"))  # short: socket paths must stay < 108 bytes
        self.certs = self.base / "certs"
        self.ssh_index, self.ssh_dir, self.ssh_port = ssh, self.base / "ssh", free_port() if ssh is not None else None
        self.ssh_alias = f"t1-ssh-{os.getpid()}"
        self.sshd: subprocess.Popen | None = None
        used = _used_octets()
        start = 16 + (os.getpid() % 40) * 5
        octets = [o for o in range(start, 250) if o not in used][:num]
        self.daemons = [Daemon(i, self.base / f"d{i}", f"t1h{os.getpid() % 100000}x{i}", octets[i],
                               free_port() if i == tls else None) for i in range(num)]

    def __enter__(self) -> ExtraDaemons:
        try:
            # On a tmpfs: removing three daemons' image layers from the disk took ~50 s on the loaded box.
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g,mode=0700", "t1-test-dockerd", str(self.base)],
                           check=True)
            if any(d.tcp_port for d in self.daemons):
                self.certs.mkdir()
                _make_certs(self.certs)
            for d in self.daemons:
                d.root.mkdir()
                subprocess.run(["ip", "link", "add", d.bridge, "type", "bridge"], check=True)
                subprocess.run(["ip", "addr", "add", f"10.213.{d.subnet_octet}.1/24", "dev", d.bridge], check=True)
                subprocess.run(["ip", "link", "set", d.bridge, "up"], check=True)
                self._launch(d)
            for d in self.daemons:
                self._wait(d)
            if self.ssh_index is not None:
                self._start_sshd(self.daemons[self.ssh_index])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spec(self, i: int, options: str = "") -> str:
        """The `sandbox.hosts` entry of daemon `i` (TCP+TLS for the TLS one), with extra `options`."""
        d = self.daemons[i]
        url = f"tcp://127.0.0.1:{d.tcp_port} tls={self.certs}" if d.tcp_port else d.url
        return f"{url} {options}".strip()

    def ssh_spec(self, options: str = "") -> str:
        """The `sandbox.hosts` entry that reaches daemon `ssh` over SSH (with `ssh_bin` first on PATH)."""
        assert self.ssh_index is not None, "ExtraDaemons(..., ssh=i) reaches daemon i over SSH"
        return f"ssh://root@{self.ssh_alias} {options}".strip()

    @property
    def ssh_bin(self) -> Path:
        """A directory whose `ssh` is the real one with this fleet's ssh_config (module docstring)."""
        return self.ssh_dir / "bin"

    def _start_sshd(self, d: Daemon) -> None:
        """sshd on 127.0.0.1:ssh_port, key login only, its sessions' DOCKER_HOST daemon `d`; the client's config."""
        s = self.ssh_dir
        (s / "bin").mkdir(parents=True)
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(s / key)], check=True)
        shutil.copy(s / "client_key.pub", s / "authorized_keys")
        host_pub = (s / "host_key.pub").read_text().split()
        (s / "known_hosts").write_text(f"[127.0.0.1]:{self.ssh_port} {host_pub[0]} {host_pub[1]}\n")
        (s / "sshd_config").write_text(
            f"Port {self.ssh_port}\nListenAddress 127.0.0.1\nHostKey {s}/host_key\nPidFile {s}/sshd.pid\n"
            f"AuthorizedKeysFile {s}/authorized_keys\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nSetEnv DOCKER_HOST={d.url}\n")
        (s / "ssh_config").write_text(
            f"Host {self.ssh_alias}\n  HostName 127.0.0.1\n  Port {self.ssh_port}\n  IdentityFile {s}/client_key\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {s}/known_hosts\n  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n")
        ssh = s / "bin" / "ssh"
        ssh.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {s}/ssh_config "$@"\n')
        ssh.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        log = open(s / "sshd.log", "ab")
        self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(s / "sshd_config")],
                                     stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while subprocess.run([str(ssh), f"root@{self.ssh_alias}", "docker", "version"],
                             capture_output=True).returncode != 0:
            if self.sshd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not let the test in: {(s / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _launch(self, d: Daemon) -> None:
        args = ["dockerd", "--data-root", str(d.root / "data"), "--exec-root", str(d.root / "x"),
                "--pidfile", str(d.root / "docker.pid"), "-H", d.url, "--bridge", d.bridge, "--iptables=false",
                "--ip-masq=false", "--default-address-pool", f"base=10.{214 + d.index}.{d.subnet_octet}.0/24,size=28",
                "--shutdown-timeout", "3", "--log-level", "warn", "--storage-driver", "overlay2"]
        if d.tcp_port:
            args += ["-H", f"tcp://127.0.0.1:{d.tcp_port}", "--tlsverify", f"--tlscacert={self.certs}/ca.pem",
                     f"--tlscert={self.certs}/server-cert.pem", f"--tlskey={self.certs}/server-key.pem"]
        log = open(d.root / "dockerd.log", "ab")
        d.proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        log.close()

    def _wait(self, d: Daemon) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if d.proc is not None and d.proc.poll() is not None:
                raise RuntimeError(f"dockerd {d.index} exited ({d.proc.returncode}): "
                                   f"{(d.root / 'dockerd.log').read_text()[-2000:]}")
            if subprocess.run([*d.cli_host, "version"], capture_output=True).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"dockerd {d.index} did not answer within {_START_TIMEOUT_S:.0f} s")

    def load_image(self, ref: str) -> None:
        """Copy `ref` from the main daemon to every extra one (`docker save` once, `docker load` per daemon)."""
        tar = self.base / "image.tar"
        subprocess.run(["docker", "save", "-o", str(tar), ref], check=True)
        procs = [subprocess.Popen([*d.cli_host, "load", "-q", "-i", str(tar)], stdout=subprocess.DEVNULL)
                 for d in self.daemons]
        for p in procs:
            assert p.wait() == 0, "docker load failed"
        tar.unlink()

    def kill(self, i: int) -> None:
        """SIGKILL daemon `i` (its containerd and containers live on, as after a crash)."""
        d = self.daemons[i]
        assert d.proc is not None
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()

    def restart(self, i: int) -> None:
        """Start daemon `i` again after `kill`, as its host would come back from a crash: what the crash left
        running (containerd shims and the containers' processes) is stopped and the exec root starts empty
        (/run is a tmpfs on a real host). Data root, images and stopped containers stay. A dockerd restarted
        over its old exec root waited for its containerd in vain here, and one that found its old network state
        deleted the main daemon's docker0 (20.10): both are avoided."""
        d = self.daemons[i]
        _kill_leftovers(d.root)
        _unmount_under(d.root / "x")
        shutil.rmtree(d.root / "x", ignore_errors=True)
        (d.root / "data" / "network" / "files" / "local-kv.db").unlink(missing_ok=True)
        self._launch(d)
        self._wait(d)

    def docker(self, i: int, *args: str) -> str:
        """Output of `docker <args>` against daemon `i`."""
        return subprocess.run([*self.daemons[i].cli_host, *args], capture_output=True, text=True,
                              check=True).stdout

    def stop(self) -> None:
        """Stop every daemon (then its containerd, by the pid it recorded), remove bridges, mounts and state;
        check the main daemon's docker0 is still there."""
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            self.sshd.wait()
        running = [d for d in self.daemons if d.proc is not None and d.proc.poll() is None]
        for d in running:  # all at once: each takes a while to stop its containers and containerd
            d.proc.send_signal(signal.SIGTERM)
        for d in running:
            try:
                d.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
        for d in self.daemons:
            _stop_containerd(d.root / "x" / "containerd" / "containerd.pid", d.root)
            _kill_leftovers(d.root)  # a daemon killed and not restarted left its shims and containers running
            subprocess.run(["ip", "link", "del", d.bridge], capture_output=True)
        _unmount_under(self.base)  # the tmpfs too: what the daemons stored goes with it
        shutil.rmtree(self.base, ignore_errors=True)
        subprocess.run(["ip", "link", "show", "docker0"], check=True, capture_output=True)


def _stop_containerd(pidfile: Path, root: Path) -> None:
    """The containerd our dockerd started outlives a SIGKILLed dockerd: stop it, by its recorded pid, if its
    command line names our state directory."""
    try:
        pid = int(pidfile.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (FileNotFoundError, ValueError):
        return
    if str(root) not in cmdline:
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def _kill_leftovers(root: Path) -> None:
    """SIGKILL the processes a killed daemon under `root` left: its containers' (by their cgroups, named by the
    container ids in its data root) and the containerd shims that name its exec root."""
    ids = [p.name for p in (root / "data" / "containers").glob("*") if p.is_dir()]
    pids = []
    for cid in ids:
        for procs in Path("/sys/fs/cgroup").glob(f"*/docker/{cid}/cgroup.procs"):
            pids += [int(p) for p in procs.read_text().split()]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(root) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    for pid in set(pids) - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for cid in ids:  # their cgroups, once empty (the daemon that would remove them is gone)
        for group in Path("/sys/fs/cgroup").glob(f"*/docker/{cid}"):
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still busy: its processes are exiting
                    time.sleep(0.1)


def _unmount_under(base: Path) -> None:
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(str(base))]
    for point in sorted(points, key=len, reverse=True):  # innermost first, `base` itself last
        subprocess.run(["umount", "-l", point], capture_output=True)
