"""The default sandbox base image: a Debian bookworm root filesystem built offline-friendly, without a registry.

`python -m sandbox.base_image build` runs `debootstrap --variant=minbase` with the packages below, then imports the
tree with the Docker API (`docker import`). The image carries a content label (hash of the package list, the
suite and this recipe's version); a second call finds it and does nothing. The last line printed is the image
reference, e.g. `t1-sandbox-base:3f2a9c1b7d4e`; `t1-sandbox-base:latest` is tagged too.

The base has `python` (/usr/local/bin/python, as in the python:* images) and no PEP 668 marker, so the `RUN pip
install ...` of a task's `python:*` Dockerfile works on it. `--trust-host-ca` (or `T1_TRUST_HOST_CA=1`) adds a
thin layer on top that trusts this host's CA bundle (`T1_HOST_CA_BUNDLE`, else $SSL_CERT_FILE, else Debian's
/etc/ssl/certs/ca-certificates.crt): for hosts whose HTTPS goes through an intercepting proxy, where pip and curl
inside a build otherwise fail certificate verification. It is tagged `t1-sandbox-base-ca:<hash>` (hash of the base
and the bundle) and takes seconds; the base stays as it is.

`T1_SANDBOX_IMAGE=<ref>` (or `ensure_base_image(override=...)`) points at any other image instead (pulled when
it is not present locally); nothing is built then.

`--suite trixie|noble|jammy` builds the base of another release instead (sandbox.images.base_suites; tagged
`t1-sandbox-base-<suite>:<hash>` and `:latest`), the same way; sandbox.images.base_mapping builds one when a task's FROM
image needs it.
"""

from __future__ import annotations

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

from sandbox.images.base_suites import DEFAULT_SUITE, PACKAGES, SUITES, Suite, get_suite
from sandbox.errors import ImageNotFound, SandboxError
from sandbox.cli import Parser
from sandbox.daemon import docker_client
from sandbox.images.ubuntu_keyring import ubuntu_keyring

REPOSITORY = "t1-sandbox-base"
SUITE = DEFAULT_SUITE
# Bump when the build steps below change in a way that changes the image.
RECIPE_VERSION = 3  # 3: pip RECORDs for Debian's Python packages (_pip_records)
CA_REPOSITORY = "t1-sandbox-base-ca"
ENV_TRUST_HOST_CA = "T1_TRUST_HOST_CA"
ENV_HOST_CA_BUNDLE = "T1_HOST_CA_BUNDLE"
CONTENT_LABEL = "t1.image.content"
ENV_IMAGE = "T1_SANDBOX_IMAGE"
ENV_MIRROR = "T1_DEBIAN_MIRROR"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
ENV_UBUNTU_MIRROR = "T1_UBUNTU_MIRROR"
DEFAULT_UBUNTU_MIRROR = "http://archive.ubuntu.com/ubuntu"
# The packages are sandbox.images.base_suites.PACKAGES (bookworm's; each suite has its list).
# Trimmed after debootstrap: caches and docs nobody in a task reads (apt lists are fetched again by
# `apt-get update` where a task has network).
_TRIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info")
# Debian's PEP 668 marker: with it every `pip install` outside a venv fails, and task Dockerfiles written for
# the python:* images (which have none) install with pip. Removed; apt's own packages stay in /usr/lib.
_PEP668_MARKERS = "usr/lib/python3*/EXTERNALLY-MANAGED"
# `python` as the python:* images have it: /usr/local/bin/python. Not /usr/bin/python (python-is-python3): task
# Dockerfiles written for Ubuntu bases create that link themselves, and `ln -s` onto an existing one fails.
_PYTHON_LINK = ("usr/local/bin/python", "/usr/bin/python3")
# Debian ships its Python packages without pip's RECORD (or installed-files.txt), so pip cannot replace them: a
# Dockerfile's `pip install pytest==8.4.1` stops at "Cannot uninstall pluggy, RECORD file not found". The images a
# base stands in for have no Debian pytest (pip installs over nothing there); the base carries it for the
# verifiers. A RECORD written from dpkg's file list lets pip replace them as it replaces its own installs.
_DIST_PACKAGES = "usr/lib/python3/dist-packages"
_CHANGES = (
    'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)


def content_hash(suite: str = DEFAULT_SUITE) -> str:
    """Hash of everything that decides the image's content (not the mirror: it serves the same packages)."""
    s = get_suite(suite)
    recipe = (f"v{RECIPE_VERSION}|{s.name}|minbase|{','.join(sorted(s.packages))}|{'|'.join(_TRIM)}|"
              f"{_PEP668_MARKERS}|{_PYTHON_LINK}|{'|'.join(_CHANGES)}{s.recipe_extra()}")
    return hashlib.sha256(recipe.encode()).hexdigest()


def base_image_ref(suite: str = DEFAULT_SUITE) -> str:
    return f"{get_suite(suite).repository}:{content_hash(suite)[:12]}"


def base_repositories() -> set[str]:
    """The repositories of every suite's base image (t1-sandbox-base, t1-sandbox-base-trixie, ...)."""
    return {s.repository for s in SUITES.values()}


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


def trust_host_ca_default() -> bool:
    """$T1_TRUST_HOST_CA: '1'/'true' or '0'/'false'/unset."""
    raw = os.environ.get(ENV_TRUST_HOST_CA, "").strip().lower()
    if raw not in ("", "0", "1", "true", "false"):
        raise ValueError(f"${ENV_TRUST_HOST_CA}: expected 1 or 0, got {raw!r}")
    return raw in ("1", "true")


def ensure_base_image(*, override: str | None = None, log: bool = False, trust_host_ca: bool | None = None,
                      suite: str = DEFAULT_SUITE) -> str:
    """Return a usable sandbox image reference, building the default base image only when it is missing.

    `override` (else `$T1_SANDBOX_IMAGE`) names any image instead; it is pulled if absent. Building takes about a
    minute (debootstrap from Debian's mirror) and happens at most once per content hash; concurrent callers on
    this machine wait for one build through a file lock. `trust_host_ca` (None: $T1_TRUST_HOST_CA) returns the
    layer on the base that trusts this host's CA bundle instead (built in seconds when missing). `suite`: the
    release (sandbox.images.base_suites; another than bookworm takes a few minutes to build the first time).
    """
    client = docker_client()
    user_ref = override or os.environ.get(ENV_IMAGE, "").strip()
    if user_ref:
        return _use_override(client, user_ref)
    ref = _ensure_plain_base(client, get_suite(suite), log=log)
    if trust_host_ca if trust_host_ca is not None else trust_host_ca_default():
        return _ensure_ca_layer(client, ref, log=log)
    return ref


def _ensure_plain_base(client: docker.APIClient, suite: Suite, *, log: bool) -> str:
    ref = base_image_ref(suite.name)
    if _find_local(client, ref) is None:
        lock_path = Path(tempfile.gettempdir()) / "t1-sandbox-base-image.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same image right now
            if _find_local(client, ref) is None:
                _build(client, ref, suite, log=log)
    latest = f"{suite.repository}:latest"
    if (_find_local(client, latest) or {}).get("Id") != client.inspect_image(ref)["Id"]:
        client.tag(ref, suite.repository, "latest")
    return ref


def host_ca_bundle() -> Path:
    """The host's CA bundle: $T1_HOST_CA_BUNDLE, else $SSL_CERT_FILE, else Debian's bundle path."""
    path = Path(os.environ.get(ENV_HOST_CA_BUNDLE) or os.environ.get("SSL_CERT_FILE")
                or "/etc/ssl/certs/ca-certificates.crt")
    if not path.is_file():
        raise SandboxError(f"trusting the host's CA bundle: {path} does not exist (set {ENV_HOST_CA_BUNDLE})")
    return path


def tls_advice(failed_line: str, froms: list[str] | None) -> str:
    """What to do about a certificate that did not verify (`failed_line`, from a build log or a script's output)
    in an image built on the images `froms` (None: not known): one sentence, to append to the error."""
    said = f"certificate verification failed ({failed_line[:160]})"
    proxy = "HTTPS from here goes through a TLS-intercepting proxy whose CA the image lacks"
    if froms is None:
        return (f"{said}: {proxy}? Rerun with --trust-host-ca (or {ENV_TRUST_HOST_CA}=1): the base image then trusts "
                f"this host's CA bundle ({ENV_HOST_CA_BUNDLE} names another)")
    if any(f.startswith(f"{CA_REPOSITORY}:") for f in froms):
        return (f"{said} although the image trusts this host's CA bundle: the intercepting proxy's CA is not in "
                f"that bundle (set {ENV_HOST_CA_BUNDLE} to a file that holds it), or the failing tool keeps a "
                "store of its own")
    if any(f.partition(":")[0] in base_repositories() for f in froms):
        return (f"{said}: {proxy}; rerun with --trust-host-ca (or {ENV_TRUST_HOST_CA}=1): the base image then "
                "trusts this host's CA bundle")
    return (f"{said}: {proxy}, and its FROM image ({', '.join(froms)}) is not mapped onto T1's base, so "
            "--trust-host-ca does not reach it: map it there with --base-image, or add the CA to that image")


def from_images(dockerfile_text: str) -> list[str]:
    """The images a Dockerfile's FROM lines name (flags skipped)."""
    return [next((w for w in line.split()[1:] if not w.startswith("--")), "") for line in dockerfile_text.splitlines()
            if line.strip().upper().startswith("FROM ")]


def _ensure_ca_layer(client: docker.APIClient, base_ref: str, *, log: bool) -> str:
    """`base_ref` plus the host's CA certificates (one file per certificate under
    /usr/local/share/ca-certificates, then update-ca-certificates, so a later run of it keeps them)."""
    from sandbox.images.docker_build import BuildFailed, docker_build  # the build helper imports nothing from here

    bundle = host_ca_bundle().read_text(errors="replace")
    certs = [c + "-----END CERTIFICATE-----\n" for c in bundle.split("-----END CERTIFICATE-----")[:-1]
             if "-----BEGIN CERTIFICATE-----" in c]
    if not certs:
        raise SandboxError(f"{host_ca_bundle()}: no PEM certificates in it")
    base_id = client.inspect_image(base_ref)["Id"]
    ref = f"{CA_REPOSITORY}:{hashlib.sha256((base_id + ''.join(certs)).encode()).hexdigest()[:12]}"
    if _find_local(client, ref) is not None:
        return ref
    _say(log, f"adding {len(certs)} host CA certificates to {base_ref} as {ref}")
    with tempfile.TemporaryDirectory(prefix="t1-ca-") as tmp:
        ctx = Path(tmp)
        (ctx / "certs").mkdir()
        for i, cert in enumerate(certs):
            (ctx / "certs" / f"t1-host-{i:03d}.crt").write_text(cert.lstrip())
        (ctx / "Dockerfile").write_text(
            f"FROM {base_ref}\nCOPY certs/ /usr/local/share/ca-certificates/\n"
            "RUN update-ca-certificates >/dev/null\n"
            # Tools with their own store read these: requests, pip (also Debian's), uv, curl, node.
            "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "
            "REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt "
            "PIP_CERT=/etc/ssl/certs/ca-certificates.crt UV_NATIVE_TLS=1 "
            "NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt\n")
        try:
            docker_build(ctx, dockerfile="Dockerfile", tag=ref, labels={"t1.kind": "sandbox-base-ca"},
                         timeout_s=300, what=f"trusting the host's CA bundle in {base_ref}")
        except BuildFailed as e:
            raise SandboxError(str(e)) from None
    return ref


def _say(log: bool, msg: str) -> None:
    if log:
        print(f"sandbox.images.base_image: {msg}", file=sys.stderr, flush=True)


def _build(client: docker.APIClient, ref: str, suite: Suite, *, log: bool) -> None:
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise SandboxError("building the sandbox base image needs debootstrap (apt-get install debootstrap), "
                           f"or set {ENV_IMAGE} to an existing image")
    if os.geteuid() != 0:
        raise SandboxError(f"debootstrap needs root to build the base image; run as root or set {ENV_IMAGE}")
    mirror = os.environ.get(ENV_MIRROR, DEFAULT_MIRROR)
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "t1"
    # One .deb cache per release: Debian's and Ubuntu's archives may hold one file name with different bytes.
    cache_dir = cache_root / ("debootstrap" if suite.name == DEFAULT_SUITE else f"debootstrap-{suite.name}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    extra: list[str] = []
    script: list[str] = []
    if suite.distro == "ubuntu":
        extra.append(f"--keyring={ubuntu_keyring(cache_root / 'keyrings', debian_mirror=mirror)}")
        mirror = os.environ.get(ENV_UBUNTU_MIRROR, DEFAULT_UBUNTU_MIRROR)
        script = _ubuntu_script(debootstrap, suite.name)
    if suite.components != ("main",):
        extra.append(f"--components={','.join(suite.components)}")
    work = Path(tempfile.mkdtemp(prefix="t1-rootfs-", dir="/var/tmp"))
    try:
        root = work / "root"
        t0 = time.monotonic()
        _say(log, f"debootstrap {suite.name} from {mirror} into {root} ({len(suite.packages)} packages)")
        cmd = [debootstrap, "--variant=minbase", *extra, f"--include={','.join(suite.packages)}",
               f"--cache-dir={cache_dir}", suite.name, str(root), mirror, *script]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            lines = proc.stdout.splitlines()
            why = next((ln for ln in reversed(lines) if ln.startswith("E:")), lines[-1] if lines else "no output")
            raise SandboxError(f"debootstrap {suite.name} failed (exit {proc.returncode}): {why}\nlast output:\n"
                               + "\n".join(lines[-25:]))
        for marker in root.glob(_PEP668_MARKERS):
            marker.unlink()
        (root / _PYTHON_LINK[0]).symlink_to(_PYTHON_LINK[1])
        if suite.sources:
            (root / "etc/apt/sources.list").write_text(suite.sources)
            _upgrade(root, log=log)
        if suite.python_local:
            _install_local_pip(root)
        _pip_records(root)
        for rel in _TRIM:
            target = root / rel
            if target.is_dir():
                for child in target.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    elif child.name != "lock":
                        child.unlink()
        _say(log, f"debootstrap done in {time.monotonic() - t0:.0f} s; importing")
        _import(client, root, ref, suite.name)
        _say(log, f"imported {ref} in {time.monotonic() - t0:.0f} s total")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _ubuntu_script(debootstrap: str, codename: str) -> list[str]:
    """debootstrap's script for an Ubuntu release: its own when it knows the codename, else gutsy's (which every
    Ubuntu script since gutsy is a link to: jammy -> gutsy), passed as the SCRIPT argument."""
    scripts = Path(os.environ.get("DEBOOTSTRAP_DIR", "/usr/share/debootstrap")) / "scripts"
    if (scripts / codename).exists():
        return []
    if not (scripts / "gutsy").is_file():
        raise SandboxError(f"debootstrap has no script for {codename} nor gutsy's in {scripts}")
    return [str(scripts / "gutsy")]


def _chroot() -> str:
    return shutil.which("chroot") or "/usr/sbin/chroot"


def _upgrade(root: Path, *, log: bool) -> None:
    """Bring the tree up to date from the -updates and -security pockets its sources name, as the release's
    official image is. debootstrap installs from the release pocket only; a base left there would have a task's
    `apt-get install` (which sees those pockets) upgrade the shared libraries under the verifier's Python, and the
    tamper check (sandbox.runtime.verify) then rejects the run. apt checks the pockets' signatures with the keyring
    debootstrap installed in the tree."""
    t0 = time.monotonic()
    chroot = _chroot()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8"}
    proc_dir = root / "proc"
    mounted = subprocess.run(["mount", "-t", "proc", "proc", str(proc_dir)], capture_output=True).returncode == 0
    try:
        for args in (["apt-get", "-q", "update"],
                     ["apt-get", "-q", "-y", "-o", "Dpkg::Options::=--force-confold", "dist-upgrade"],
                     ["apt-get", "clean"]):
            proc = subprocess.run([chroot, str(root), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env)
            if proc.returncode != 0:
                why = " | ".join(proc.stdout.strip().splitlines()[-3:])
                raise SandboxError(f"{' '.join(args[:3])} in the new tree failed (exit {proc.returncode}): {why}")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(proc_dir)], capture_output=True)
    _say(log, f"upgraded from the -updates/-security pockets in {time.monotonic() - t0:.0f} s")


def _install_local_pip(root: Path) -> None:
    """pip, setuptools and wheel into /usr/local as in the python:* images, from the release's own wheels
    (offline), with /usr/local/lib/python3.X/site-packages a link to the dist-packages where they land."""
    wheels = root / "usr/share/python-wheels"
    pips = sorted(wheels.glob("pip-*.whl"))
    if not pips:
        raise SandboxError(f"{wheels}: no pip wheel (package python3-pip-whl)")
    chroot = _chroot()
    cmd = [chroot, str(root), "/usr/bin/python3", f"/usr/share/python-wheels/{pips[-1].name}/pip", "install",
           "--no-index", "--find-links", "/usr/share/python-wheels", "--no-cache-dir", "--root-user-action=ignore",
           "--disable-pip-version-check", "pip", "setuptools", "wheel"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={"PATH": "/usr/bin:/bin"})
    if proc.returncode != 0:
        raise SandboxError(f"installing pip into /usr/local failed (exit {proc.returncode}): "
                           + " | ".join(proc.stdout.strip().splitlines()[-3:]))
    installed = sorted(root.glob("usr/local/lib/python3.*/dist-packages/pip"))
    if not installed:
        raise SandboxError("pip installed into /usr/local but not under usr/local/lib/python3.*/dist-packages")
    (installed[-1].parent.parent / "site-packages").symlink_to("dist-packages")


def _pip_records(root: Path) -> int:
    """Give every Debian Python package in `root` the file list pip uninstalls by: a RECORD in its .dist-info, an
    installed-files.txt in its .egg-info, from dpkg's list of the package's files. Returns how many it wrote."""
    prefix = f"/{_DIST_PACKAGES}/"
    written = 0
    for listing in sorted((root / "var/lib/dpkg/info").glob("*.list")):
        rels = [line[len(prefix):] for line in listing.read_text().splitlines() if line.startswith(prefix)]
        files = sorted(r for r in rels if (root / _DIST_PACKAGES / r).is_file()
                       or (root / _DIST_PACKAGES / r).is_symlink())
        for meta in sorted({r.split("/")[0] for r in rels if r.split("/")[0].endswith((".dist-info", ".egg-info"))}):
            d = root / _DIST_PACKAGES / meta
            if not d.is_dir() or (d / "RECORD").exists() or (d / "installed-files.txt").exists():
                continue
            if meta.endswith(".dist-info"):  # paths relative to dist-packages, the RECORD itself included
                (d / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{meta}/RECORD"]))
            else:  # paths relative to the .egg-info directory
                (d / "installed-files.txt").write_text("".join(f"../{f}\n" for f in files))
            written += 1
    return written


def _import(client: docker.APIClient, root: Path, ref: str, suite: str) -> None:
    repository, tag = ref.rsplit(":", 1)
    changes = [*_CHANGES, f"LABEL {CONTENT_LABEL}={content_hash(suite)}"]
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
    parser = Parser(prog="python -m sandbox.base_image", description=__doc__.split("\n\n")[0],
                    epilog="example: python -m sandbox.base_image build   (the last line printed is the image reference)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="build the base image if missing; print its reference last")
    build.add_argument("--image", default=None, help=f"use this image instead (default: ${ENV_IMAGE})")
    build.add_argument("--suite", default=DEFAULT_SUITE, choices=sorted(SUITES),
                       help=f"the distribution release (default: {DEFAULT_SUITE}); see sandbox.images.base_suites")
    build.add_argument("--trust-host-ca", action="store_true", default=None,
                       help=f"also build the layer that trusts this host's CA bundle (default: ${ENV_TRUST_HOST_CA})")
    ref = sub.add_parser("ref", help="print the default base image's reference without building")
    ref.add_argument("--suite", default=DEFAULT_SUITE, choices=sorted(SUITES), help="the distribution release")
    args = parser.parse_args(argv)
    if args.cmd == "ref":
        print(base_image_ref(args.suite))
        return 0
    try:
        image = ensure_base_image(override=args.image, log=True, trust_host_ca=args.trust_host_ca, suite=args.suite)
    except SandboxError as e:  # the details (debootstrap's last output) above, the one line that says why last
        detail = str(e).splitlines()
        if len(detail) > 1:
            print("\n".join(detail[1:]), file=sys.stderr)
        parser.error(f"cannot build the {args.suite} base: {detail[0] if detail else type(e).__name__}")
    print(image, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
