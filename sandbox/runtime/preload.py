"""Place a task image's preload (`TaskImage.preload`, a tar to extract at /) into a container created, not started.

The daemon's archive API (`put_archive`) re-executes dockerd to unpack inside the container: ~75 ms of CPU per
container, as much as the rest of its creation, and every episode's sandbox pays it. When the daemon's overlay2
storage is on this host and we are root (the same condition under which `sandbox.runtime.verify` reads the upper
directory for its tamper check), the files are written straight into the container's empty upper directory
instead, before the container is started and the overlay is mounted; it takes ~1 ms.

That is only the same as `put_archive` for tars whose every path is built from directories of the tar itself:
a parent that is a symlink (in the tar or in the image) would be followed on this host, not in the container.
`direct_plan` checks that of the tar, and `place` that the upper directory holds only directories (the daemon
makes the working directory there); any other tar or container (and a remote daemon, user-namespace remapping,
rootless Docker) goes through the archive API.
"""

from __future__ import annotations

import decimal
import io
import os
import posixpath
import tarfile

import docker

from sandbox.errors import SandboxError


def direct_plan(blob: bytes) -> tuple[tarfile.TarInfo, ...] | None:
    """The tar's members when writing them into an empty directory reproduces what `put_archive` extracts at /,
    else None: every name relative and normal, only files, directories and symlinks, every parent of every
    member a directory entry that comes earlier, and no directory replaced by another kind of entry."""
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        members = tar.getmembers()
    dirs: set[str] = set()
    others: set[str] = set()
    for m in members:
        name = m.name
        if (not name or name.startswith("/") or posixpath.normpath(name) != name or name.split("/")[0] == ".."
                or not (m.isfile() or m.isdir() or m.issym())):
            return None
        parent = posixpath.dirname(name)
        if parent and parent not in dirs:  # missing, or a file / symlink earlier in the tar: not ours to follow
            return None
        if m.isdir():
            if name in others:
                return None
            dirs.add(name)
        elif name in dirs:
            return None
        else:
            others.add(name)
    return tuple(members)


_REMAPPED: dict[str, bool] = {}


def _remapped(api: docker.APIClient) -> bool:
    """Whether the daemon maps container root onto another host user (userns-remap, rootless): then files we
    write as host root would belong to nobody in the container. Asked once per daemon."""
    key = str(api.base_url)
    if key not in _REMAPPED:
        options = api.info().get("SecurityOptions") or []
        _REMAPPED[key] = any("name=userns" in o or "name=rootless" in o for o in options)
    return _REMAPPED[key]


def upper_dir(api: docker.APIClient, container_id: str) -> str | None:
    """The container's overlay2 upper directory when we can write it here, else None."""
    if os.geteuid() != 0 or _remapped(api):
        return None
    driver = api.inspect_container(container_id).get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    if driver.get("Name") != "overlay2" or not upper or not os.path.isdir(upper):
        return None
    return upper


def place(api: docker.APIClient, container_id: str, blob: bytes) -> str:
    """Extract `blob` at / of the created container; returns how: "upper_dir" or "archive"."""
    members = direct_plan(blob)
    upper = upper_dir(api, container_id) if members is not None else None
    if members is None or upper is None or not _only_directories(upper):
        api.put_archive(container_id, "/", blob)
        return "archive"
    try:
        _extract(blob, members, upper)
    except OSError as e:  # a full disk, a daemon that removed the container meanwhile: say where
        raise SandboxError(f"writing the task's files into the upper directory {upper} of container "
                           f"{container_id[:12]} failed: {e}") from e
    return "upper_dir"


def _only_directories(upper: str) -> bool:
    """Whether the upper directory holds nothing but plain directories (the daemon creates the working
    directory there at create time): then no path we write can pass through a symlink or a whiteout."""
    for root, dirs, files in os.walk(upper):
        if files or any(os.path.islink(os.path.join(root, d)) for d in dirs):
            return False
    return True


def _extract(blob: bytes, members: tuple[tarfile.TarInfo, ...], root: str) -> None:
    """Write `members` (checked by `direct_plan`) under `root` (directories only) as the daemon's untar does:
    owners and modes as each entry comes (a directory listed twice ends with its last entry's), the entry's
    mtime, directories' times set after everything else is written. Access times follow the daemon's rule for a
    tar that has none: a file's or symlink's is its mtime, a directory's is 0."""
    dir_times: list[tuple[str, int]] = []
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for m in members:
            path = os.path.join(root, m.name)
            if m.isdir():
                if not os.path.isdir(path):
                    os.mkdir(path, 0o700)
                os.chown(path, m.uid, m.gid)
                os.chmod(path, m.mode)
                dir_times.append((path, _mtime_ns(m)))
            elif m.issym():
                if os.path.lexists(path):
                    os.unlink(path)
                os.symlink(m.linkname, path)
                os.lchown(path, m.uid, m.gid)
                os.utime(path, ns=(_mtime_ns(m),) * 2, follow_symlinks=False)
            else:
                src = tar.extractfile(m)
                assert src is not None
                if os.path.lexists(path):
                    os.unlink(path)  # a later COPY of the same destination replaces the file
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(src.read())
                    os.fchown(fd, m.uid, m.gid)
                    os.fchmod(fd, m.mode)
                os.utime(path, ns=(_mtime_ns(m),) * 2)
    for path, mtime in dir_times:  # in tar order: a directory listed twice keeps its last entry's time
        os.utime(path, ns=(0, mtime))  # the daemon's untar too: a tar without access times gives directories 0


def _mtime_ns(m: tarfile.TarInfo) -> int:
    """The entry's mtime in ns, exact: from the PAX record's decimal text when there is one (a float loses the
    last digits that the daemon keeps)."""
    text = m.pax_headers.get("mtime")
    return int(decimal.Decimal(text) * 10**9) if text else int(m.mtime) * 10**9
