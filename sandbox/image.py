"""The default sandbox base image: a Debian bookworm root filesystem built offline-friendly, without a registry.

`python -m sandbox.image build` runs `debootstrap --variant=minbase` with the packages below, then imports the
tree with the Docker API (`docker import`). The image carries a content label (hash of the package list, the
suite and this recipe's version); a second call finds it and does nothing. The last line printed is the image
reference, e.g. `t1-sandbox-base:3f2a9c1b7d4e`; `t1-sandbox-base:latest` is tagged too.

`T1_SANDBOX_IMAGE=<ref>` (or `ensure_base_image(override=...)`) points at any other image instead (pulled when
it is not present locally); nothing is built then.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors

from sandbox.errors import ImageNotFound, SandboxError
from sandbox.docker_sandbox import docker_client

REPOSITORY = "t1-sandbox-base"
SUITE = "bookworm"
# Bump when the build steps below change in a way that changes the image.
RECIPE_VERSION = 1
CONTENT_LABEL = "t1.image.content"
ENV_IMAGE = "T1_SANDBOX_IMAGE"
ENV_MIRROR = "T1_DEBIAN_MIRROR"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

# What a terminal task commonly needs, kept near 300 MB: shell + core tools, Python with pytest (verifiers run
# offline), archive and text tools, git, build basics without a compiler.
PACKAGES: tuple[str, ...] = (
    "bash", "bc", "bzip2", "ca-certificates", "coreutils", "curl", "diffutils", "file", "findutils", "gawk",
    "git", "grep", "gzip", "jq", "less", "make", "patch", "procps", "psmisc", "python3", "python3-pip",
    "python3-pytest", "python3-venv", "sed", "sqlite3", "tar", "tree", "unzip", "util-linux", "xz-utils", "zip",
)
# Trimmed after debootstrap: caches and docs nobody in a task reads (apt lists are fetched again by
# `apt-get update` where a task has network).
_TRIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info")
_CHANGES = (
    'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)


def content_hash() -> str:
    """Hash of everything that decides the image's content (not the mirror: it serves the same packages)."""
    recipe = f"v{RECIPE_VERSION}|{SUITE}|minbase|{','.join(sorted(PACKAGES))}|{'|'.join(_TRIM)}|{'|'.join(_CHANGES)}"
    return hashlib.sha256(recipe.encode()).hexdigest()


def base_image_ref() -> str:
    return f"{REPOSITORY}:{content_hash()[:12]}"


def _find_local(client: docker.APIClient, ref: str) -> dict | None:
    try:
        return client.inspect_image(ref)
    except docker.errors.ImageNotFound:
        return None


def _use_override(client: docker.APIClient, ref: str) -> str:
    if _find_local(client, ref) is not None:
        return ref
    try:
        client.pull(ref)
    except docker.errors.APIError as e:
        raise ImageNotFound(f"image {ref!r} (from {ENV_IMAGE} or override) is not present locally and "
                            f"cannot be pulled: {e.explanation or e}") from e
    return ref


def ensure_base_image(*, override: str | None = None, log: bool = False) -> str:
    """Return a usable sandbox image reference, building the default base image only when it is missing.

    `override` (else `$T1_SANDBOX_IMAGE`) names any image instead; it is pulled if absent. Building takes about a
    minute (debootstrap from Debian's mirror) and happens at most once per content hash; concurrent callers on
    this machine wait for one build through a file lock.
    """
    client = docker_client()
    user_ref = override or os.environ.get(ENV_IMAGE, "").strip()
    if user_ref:
        return _use_override(client, user_ref)
    ref = base_image_ref()
    if _find_local(client, ref) is None:
        lock_path = Path(tempfile.gettempdir()) / "t1-sandbox-base-image.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same image right now
            if _find_local(client, ref) is None:
                _build(client, ref, log=log)
    latest = f"{REPOSITORY}:latest"
    if (_find_local(client, latest) or {}).get("Id") != client.inspect_image(ref)["Id"]:
        client.tag(ref, REPOSITORY, "latest")
    return ref


def _say(log: bool, msg: str) -> None:
    if log:
        print(f"sandbox.image: {msg}", file=sys.stderr, flush=True)


def _build(client: docker.APIClient, ref: str, *, log: bool) -> None:
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise SandboxError("building the sandbox base image needs debootstrap (apt-get install debootstrap), "
                           f"or set {ENV_IMAGE} to an existing image")
    if os.geteuid() != 0:
        raise SandboxError(f"debootstrap needs root to build the base image; run as root or set {ENV_IMAGE}")
    mirror = os.environ.get(ENV_MIRROR, DEFAULT_MIRROR)
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "t1" / "debootstrap"
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="t1-rootfs-", dir="/var/tmp"))
    try:
        root = work / "root"
        t0 = time.monotonic()
        _say(log, f"debootstrap {SUITE} from {mirror} into {root} ({len(PACKAGES)} packages)")
        cmd = [debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}",
               f"--cache-dir={cache_dir}", SUITE, str(root), mirror]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise SandboxError(f"debootstrap failed (exit {proc.returncode}); last output:\n"
                               + "\n".join(proc.stdout.splitlines()[-25:]))
        for rel in _TRIM:
            target = root / rel
            if target.is_dir():
                for child in target.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    elif child.name != "lock":
                        child.unlink()
        _say(log, f"debootstrap done in {time.monotonic() - t0:.0f} s; importing")
        _import(client, root, ref)
        _say(log, f"imported {ref} in {time.monotonic() - t0:.0f} s total")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _import(client: docker.APIClient, root: Path, ref: str) -> None:
    repository, tag = ref.rsplit(":", 1)
    changes = [*_CHANGES, f"LABEL {CONTENT_LABEL}={content_hash()}"]
    # GNU tar keeps owners, modes, device nodes and hard links exactly; stream it so memory stays flat.
    tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(root), "-cf", "-", "."], stdout=subprocess.PIPE)

    def chunks() -> Iterator[bytes]:
        assert tar.stdout is not None
        while block := tar.stdout.read(1 << 20):
            yield block

    try:
        client.import_image(src=chunks(), repository=repository, tag=tag, changes=changes, stream_src=True)
    finally:
        rc = tar.wait()
    if rc != 0:
        raise SandboxError(f"tar of the root filesystem failed with exit {rc}")
    if _find_local(client, ref) is None:
        raise SandboxError(f"docker import reported success but {ref} is not present")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.image", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="build the base image if missing; print its reference last")
    build.add_argument("--image", default=None, help=f"use this image instead (default: ${ENV_IMAGE})")
    sub.add_parser("ref", help="print the default base image's reference without building")
    args = parser.parse_args(argv)
    if args.cmd == "ref":
        print(base_image_ref())
        return 0
    print(ensure_base_image(override=args.image, log=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
