"""HostSpec: one entry of `sandbox.hosts`, parsed and checked without loading the Docker SDK (the run config
validates its entries with it; `sandbox.runtime.hosts` connects to them).

    HostSpec.parse("tcp://box1:2376 tls=/etc/t1/box1 max=64 memory_mb=65536 name=box1")

ssh://[user@]box[:port] runs the `ssh` binary (the Docker SDK's `use_ssh_client`), so the user's ssh set-up applies:
~/.ssh/config, the agent, known_hosts. One trap is handled here: the SDK puts port 22 in a URL that names none, and
its `-p 22` overrides the Port of the user's ssh_config for that box; the port ssh itself would use (`ssh -G`) is
made explicit instead.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    import docker

API_VERSION = "1.41"
"""Docker API version spoken to every host (Docker 20.10; newer daemons serve it too)."""


@dataclass(frozen=True)
class HostSpec:
    """One Docker host of a run: where it is, how to trust it, how much it may carry."""

    url: str
    tls: str | None = None
    max_sandboxes: int | None = None
    memory_mb: int | None = None
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> HostSpec:
        """'URL [tls=DIR] [max=N] [memory_mb=M] [name=NAME]' (module docstring); ValueError naming the problem."""
        if not isinstance(text, str) or not text.split():
            raise ValueError(f"sandbox.hosts: expected 'URL [tls=DIR] [max=N] [memory_mb=M]', got {text!r}")
        url, *options = text.split()
        fields: dict[str, object] = {}
        for opt in options:
            key, sep, value = opt.partition("=")
            if not sep or key not in ("tls", "max", "memory_mb", "name") or not value:
                raise ValueError(f"sandbox.hosts: {text!r}: unknown option {opt!r} (expected tls=DIR, max=N, "
                                 "memory_mb=M, name=NAME)")
            if key in ("max", "memory_mb"):
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"sandbox.hosts: {text!r}: {key} must be a whole number >= 1, got {value!r}")
                fields["max_sandboxes" if key == "max" else key] = int(value)
            else:
                fields[key] = value
        spec = cls(url=url, **fields)  # type: ignore[arg-type]
        spec.check()
        return spec

    def check(self) -> None:
        scheme = urlparse(self.url).scheme
        if scheme not in ("unix", "tcp", "ssh"):
            raise ValueError(f"sandbox.hosts: {self.url!r}: expected a unix://, tcp:// or ssh:// URL")
        if scheme == "tcp" and self.tls is None:
            raise ValueError(f"sandbox.hosts: {self.url!r}: a tcp:// host needs tls=DIR (ca.pem, cert.pem, "
                             "key.pem): a daemon's plain TCP port gives root on its host to anyone who reaches it")
        if self.tls is not None:
            missing = [f for f in ("ca.pem", "cert.pem", "key.pem") if not (Path(self.tls) / f).is_file()]
            if missing:
                raise ValueError(f"sandbox.hosts: {self.url!r}: tls={self.tls} lacks {', '.join(missing)}")

    def client(self, *, timeout: float = 120.0) -> docker.APIClient:
        """An API client of this host (no round trip yet); `timeout`: seconds per call."""
        import docker
        import docker.tls

        kwargs: dict = {"base_url": self.url, "version": API_VERSION, "timeout": timeout, "max_pool_size": 128}
        if self.tls is not None:
            d = Path(self.tls)
            kwargs["tls"] = docker.tls.TLSConfig(client_cert=(str(d / "cert.pem"), str(d / "key.pem")),
                                                 ca_cert=str(d / "ca.pem"), verify=True)
        if self.url.startswith("ssh://"):
            kwargs.update(base_url=ssh_url_with_port(self.url), use_ssh_client=True)
        api = docker.APIClient(**kwargs)
        # requests lets $REQUESTS_CA_BUNDLE / $CURL_CA_BUNDLE override a session's own CA (psf/requests#3829):
        # the host's CA must win, and no proxy may stand between us and a daemon.
        api.trust_env = False
        return api


def ssh_url_with_port(url: str) -> str:
    """`url` (ssh://[user@]box[:port]) with the port ssh would use for it made explicit (module docstring): ValueError
    naming the entry when `ssh -G` cannot resolve it."""
    parsed = urlparse(url)
    if parsed.port is not None:
        return url
    try:
        out = subprocess.run(["ssh", "-G", parsed.netloc], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"sandbox.hosts: {url!r}: the ssh binary did not answer `ssh -G` ({e})") from None
    ports = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("port ")]
    if out.returncode != 0 or not ports:
        raise ValueError(f"sandbox.hosts: {url!r}: `ssh -G {parsed.netloc}` failed: {out.stderr.strip()[:300]}")
    return f"ssh://{parsed.netloc}:{ports[0]}"
