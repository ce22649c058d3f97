"""Ubuntu's archive keyring, obtained through a verified chain, for debootstrap of an Ubuntu release.

debootstrap checks an Ubuntu archive's Release file against /usr/share/keyrings/ubuntu-archive-keyring.gpg,
which a Debian host does not have. Debian ships that keyring itself (package ubuntu-keyring, in trixie's main):
apt fetches it here from Debian's mirror with its usual checks (the suite's InRelease signed by a key in the
host's debian-archive-keyring, the .deb's hash listed there), in a private apt state directory so the host's
apt lists stay as they are. The keyring is then cached. Signature checks are never turned off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sandbox.errors import SandboxError

KEYRING_NAME = "ubuntu-archive-keyring.gpg"
_DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# The Debian release whose main section carries ubuntu-keyring (bookworm's does not).
_KEYRING_SUITE = "trixie"


def ubuntu_keyring(cache_dir: Path, *, debian_mirror: str) -> Path:
    """Path of Ubuntu's archive keyring: the host's when it has one, else cached, else fetched (see the module)."""
    host = Path("/usr/share/keyrings") / KEYRING_NAME
    if host.is_file():
        return host
    cached = cache_dir / KEYRING_NAME
    if cached.is_file():
        return cached
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise SandboxError(f"building an Ubuntu base needs {host} (or apt-get and dpkg-deb to fetch Debian's "
                           "ubuntu-keyring package)")
    if not Path(_DEBIAN_KEYRING).is_file():
        raise SandboxError(f"fetching Ubuntu's keyring needs {_DEBIAN_KEYRING} (package debian-archive-keyring)")
    with tempfile.TemporaryDirectory(prefix="t1-ubuntu-keyring-") as tmp:
        work = Path(tmp)
        for sub in ("lists/partial", "cache/archives/partial", "parts", "get"):
            (work / sub).mkdir(parents=True)
        (work / "status").write_text("")
        (work / "sources.list").write_text(f"deb [signed-by={_DEBIAN_KEYRING}] {debian_mirror} {_KEYRING_SUITE} main\n")
        opts = ["-o", f"Dir::Etc::SourceList={work / 'sources.list'}", "-o", f"Dir::Etc::SourceParts={work / 'parts'}",
                "-o", f"Dir::State::Lists={work / 'lists'}", "-o", f"Dir::Cache={work / 'cache'}",
                "-o", f"Dir::State::Status={work / 'status'}", "-o", "Debug::NoLocking=1", "-q"]
        _apt(["apt-get", *opts, "update"], cwd=work, what="apt-get update (Debian trixie, for ubuntu-keyring)")
        _apt(["apt-get", *opts, "download", "ubuntu-keyring"], cwd=work / "get", what="apt-get download ubuntu-keyring")
        debs = sorted((work / "get").glob("ubuntu-keyring_*.deb"))
        if not debs:
            raise SandboxError("apt-get download ubuntu-keyring left no .deb")
        _apt(["dpkg-deb", "-x", str(debs[-1]), str(work / "x")], cwd=work, what="dpkg-deb -x ubuntu-keyring")
        got = work / "x/usr/share/keyrings" / KEYRING_NAME
        if not got.is_file():
            raise SandboxError(f"{debs[-1].name} has no usr/share/keyrings/{KEYRING_NAME}")
        cache_dir.mkdir(parents=True, exist_ok=True)
        part = cached.with_suffix(f".{os.getpid()}.part")
        shutil.copyfile(got, part)
        part.replace(cached)  # atomic: a concurrent build sees the whole file or none
    return cached


def _apt(cmd: list[str], *, cwd: Path, what: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        raise SandboxError(f"{what} failed (exit {proc.returncode}): {tail}")
