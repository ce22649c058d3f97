"""Task images: `docker build` of a task's environment, cached by a content hash.

No registry is reachable from T1's machines, so every `FROM` must name an image that is present locally.
`base_image_overrides` maps glob patterns on the image name (`debian:*`, `ubuntu:*`, `python:*`) to a local
image; the FROM line is rewritten in a temporary copy of the build context. The image tag is a hash of the
build context's files, the rewritten Dockerfile and the resolved base image ids, so identical environments
(for example many instances of one task family) share one image, and a rebuilt base invalidates its tasks.
A Dockerfile that is only `FROM` (plus LABEL/comments) runs on the base image directly, with no build.

A Dockerfile that is only `FROM` plus WORKDIR and plain `COPY` of build-context files (the usual shape of a task
that ships its input data; every seeded family instance) is not built either: `TaskImage.preload` holds those
files as a tar that `DockerSandbox` places into the container before it starts, with COPY's semantics
(root-owned, modes and mtimes kept, missing directories created 0755). A build costs ~0.2 s and one more image
per instance; a preload costs ~1 ms per container written into its upper directory, or one `put_archive` (~75
ms of daemon CPU) where that is not possible (`sandbox.runtime.preload`). Directories the preload creates carry
the base image's creation time, so what the agent sees does not depend on when the container started. Anything
a preload cannot reproduce exactly (RUN, ENV, flags, wildcards, a .dockerignore, more than PRELOAD_MAX_BYTES of
files) is built.
"""

from __future__ import annotations

import calendar
import dataclasses
import fnmatch
import hashlib
import io
import json
import posixpath
import re
import shlex
import shutil
import tarfile
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import docker.errors

from sandbox.images.docker_build import BuildFailed, docker_build
from sandbox.tasks.compose import Service
from sandbox.images.base_mapping import (SUITE_PATTERNS, image_names, lazy_ref, parse_lazy_ref, rename_packages,
                                  renamed_packages)
from sandbox.images.dockerfile_compat import DockerfileFormError, classic_builder_form
from sandbox.daemon import default_run_id, owner_labels
from sandbox.images.image_cache import (IMAGE_REPO, TaskImage, cache_size, prune_task_images,
                                 task_image_labels as _labels, touch_image)
from sandbox.images.tarball import RootOwned
from sandbox.tasks.format import Task, inherited_workdir
from sandbox.tasks.test_deps import TestDeps
from sandbox.images.protected import is_protected

DirStat = tuple[int, int, int, float]  # mode, uid, gid, mtime
_FROM_RE = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_COPY_FROM_RE = re.compile(r"^\s*COPY\s+(?:--\S+\s+)*?--from=(\S+)", re.IGNORECASE)
_BUILD_LOCKS: dict[str, threading.Lock] = {}
_BUILD_LOCKS_GUARD = threading.Lock()
# Above this, files are baked into an image: a preload is sent once per container, a layer once per run.
PRELOAD_MAX_BYTES = 4 << 20


class TaskImageError(RuntimeError):
    """A task image could not be built: missing base image, bad Dockerfile, failed build step."""


def default_base_image_overrides(*, trust_host_ca: bool | None = None) -> dict[str, str]:
    """debian:*, ubuntu:*, python:* and Terminal-Bench's base images -> the local sandbox base of the same
    release (sandbox.images.base_mapping); `trust_host_ca` (None: $T1_TRUST_HOST_CA): its layer that trusts this host's
    CA bundle. The bookworm base is built here if missing; another release's only when a task's FROM needs it
    (its target is a placeholder that build_task_image resolves)."""
    from sandbox.images.base_image import ensure_base_image, trust_host_ca_default

    trust = trust_host_ca_default() if trust_host_ca is None else trust_host_ca
    base = ensure_base_image(trust_host_ca=trust)
    return {pattern: base if suite == "bookworm" else lazy_ref(suite, trust_host_ca=trust)
            for pattern, suite in SUITE_PATTERNS}


def resolve_base(ref: str) -> str:
    """`ref`, or the base image a sandbox.images.base_mapping placeholder stands for (built now when missing)."""
    lazy = parse_lazy_ref(ref)
    if lazy is None:
        return ref
    from sandbox.images.base_image import ensure_base_image
    from sandbox.errors import SandboxError

    suite, trust = lazy
    try:
        with _lock_for(ref):  # one build per process; the build itself holds a file lock across processes
            return ensure_base_image(suite=suite, trust_host_ca=trust, log=True)
    except (SandboxError, ValueError) as e:
        raise TaskImageError(f"the {suite} base image cannot be built: {str(e).splitlines()[0]}") from None


def parse_override(spec: str) -> tuple[str, str]:
    """'PATTERN=IMAGE' (the CLI's --base-image) -> (pattern, image)."""
    pattern, sep, image = spec.partition("=")
    if not sep or not pattern.strip() or not image.strip():
        raise ValueError(f"--base-image: expected PATTERN=IMAGE (e.g. 'debian:*=t1-base:latest'), got {spec!r}")
    return pattern.strip(), image.strip()


def build_task_image(task: Task, *, base_image_overrides: Mapping[str, str] | None = None,
                     client: docker.DockerClient | None = None, preload: bool = True) -> TaskImage:
    """Build (or reuse) the image of `task`'s environment and return it.

    `base_image_overrides`: glob on the FROM image name -> local image; the first matching pattern wins.
    None means no overrides (pass `default_base_image_overrides()` for the usual mapping).
    `preload=False` builds COPY-only Dockerfiles too instead of preloading their files.
    A TB1 task with compose services also gets each service's image (built the same way, or the image it names,
    which must be on the daemon); the returned TaskImage carries them, and `DockerSandbox` starts them.
    Raises TaskImageError naming the Dockerfile line when a FROM image is not present locally.
    """
    client = client or docker.from_env()
    overrides = dict(base_image_overrides or {})
    services = task.compose.services if task.compose is not None else ()
    # A missing prebuilt image fails the task before anything is built.
    prebuilt = {s.name: _prebuilt_image(client, task, s) for s in services if s.context is None}
    image = _agent_image(client, task, overrides, preload=preload)
    if not services:
        return image
    refs = tuple(prebuilt[s.name] if s.context is None else _built_service_image(client, task, s, overrides)
                 for s in services)
    return dataclasses.replace(image, compose=task.compose, service_refs=refs)


def _agent_image(client: docker.DockerClient, task: Task, overrides: dict[str, str], *, preload: bool) -> TaskImage:
    text = task.dockerfile.read_text()
    rewritten, base_refs, copy_from = _rewrite_from_lines(text, overrides, task.dockerfile)
    base_ids = [_local_image_id(client, ref, task.dockerfile) for ref in base_refs]
    for ref, lineno in copy_from:
        _local_image_id(client, ref, task.dockerfile, copy_from_line=lineno)
    image = _environment_image(client, task, rewritten, base_refs, base_ids, preload=preload and not task.test_deps)
    if task.test_deps:
        return _with_test_deps(client, task, image, _last_user(rewritten))
    return image


def _prebuilt_image(client: docker.DockerClient, task: Task, service: Service) -> str:
    """The image a compose service names, which must be on the daemon (T1 pulls nothing; a Debian base cannot stand
    in for an image whose entrypoint does the work, such as postgres's)."""
    try:
        client.images.get(service.image)
    except docker.errors.ImageNotFound:
        raise TaskImageError(f"{task.path}: service {service.name!r} runs the image {service.image!r}, which "
                             f"is not present locally and no registry is reachable; `docker pull` it on a "
                             f"machine with a registry, then `docker save` / `docker load` it here") from None
    return str(service.image)


def _built_service_image(client: docker.DockerClient, task: Task, service: Service,
                         overrides: dict[str, str]) -> str:
    """The image of a compose service with a build section, its FROM lines mapped as the task's are."""
    alone = dataclasses.replace(task, dockerfile_dir=service.context, dockerfile=service.dockerfile,
                                test_deps=TestDeps(), compose=None)
    return _agent_image(client, alone, overrides, preload=False).ref


def _environment_image(client: docker.DockerClient, task: Task, rewritten: str, base_refs: list[str],
                       base_ids: list[str], *, preload: bool) -> TaskImage:
    """The image of the task's Dockerfile alone: the base itself, the base plus preloaded files, or a build."""
    base_dirs: dict[str, DirStat] = {}
    created = 0
    if len(base_refs) == 1 and _preload_shaped(rewritten):
        base_dirs, created = _base_facts(client, base_refs[0], base_ids[0])
    plan = _preload_plan(rewritten, task.dockerfile_dir, base_dirs) if len(base_refs) == 1 else None
    if plan == ([], set()):  # only FROM (and LABEL/comments): the base image itself
        return TaskImage(base_refs[0])
    if plan is not None and preload:
        blob = _tar(*plan, existing_dirs=base_dirs, dir_mtime=created)
        if blob is not None:
            return TaskImage(base_refs[0], blob)
    digest = _context_hash(task.dockerfile_dir, task.dockerfile, rewritten, base_ids)
    ref = f"{IMAGE_REPO}:{digest}"
    with _lock_for(ref):
        if not _image_exists(client, ref):
            _build(client, task, rewritten, ref)
            touch_image(ref)
            prune_task_images(keep=cache_size(), client=client)
    touch_image(ref)
    return TaskImage(ref)


def _with_test_deps(client: docker.DockerClient, task: Task, image: TaskImage, user: str | None) -> TaskImage:
    """`image` plus the packages the task's test script installs (pip, apt), built once per image and package
    list. When they cannot be installed (no such package, no route to the index) the environment image is
    used as it is, with a warning; the verifier then names the module the tests miss (sandbox.runtime.verify)."""
    assert not image.preload, "test dependencies are installed on built images only (preload=False above)"
    deps: TestDeps = task.test_deps
    base_id = client.images.get(image.ref).id
    digest = hashlib.sha256(f"{base_id}|{deps.pip}|{deps.apt}|{user}".encode()).hexdigest()[:20]
    ref = f"{IMAGE_REPO}:{digest}"
    lines = [f"FROM {image.ref}", "USER root"]
    if deps.apt:
        lines.append("RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                     f"--no-install-recommends {' '.join(deps.apt)} && rm -rf /var/lib/apt/lists/*")
    if deps.pip:
        # PIP_BREAK_SYSTEM_PACKAGES: images with Debian's PEP 668 marker refuse a plain pip install.
        lines.append("RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-cache-dir "
                     + " ".join(shlex.quote(p) for p in deps.pip))
    if user:
        lines.append(f"USER {user}")
    with _lock_for(ref):
        if not _image_exists(client, ref):
            with tempfile.TemporaryDirectory(prefix="t1-deps-") as tmp:
                Path(tmp, "Dockerfile").write_text("\n".join(lines) + "\n")
                try:
                    docker_build(Path(tmp), dockerfile="Dockerfile", tag=ref, labels=_labels(task, "test-deps"),
                                 timeout_s=task.build_timeout_s, what=f"task {task.name}: installing the test "
                                 f"dependencies {' '.join(deps.pip + deps.apt)}")
                except BuildFailed as e:
                    warnings.warn(_with_advice(e, "\n".join(lines)), stacklevel=3)
                    return image
    touch_image(ref)
    return TaskImage(ref)


def _last_user(dockerfile_text: str) -> str | None:
    user = None
    for line in dockerfile_text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == "USER":
            user = parts[1].strip()
        elif parts and parts[0].upper() == "FROM":
            user = None
    return user


def build_task_images(tasks: list[Task], *, base_image_overrides: Mapping[str, str] | None = None,
                      num_workers: int = 4, preload: bool = True) -> dict[str, TaskImage]:
    """Build the images of many tasks with `num_workers` parallel builds; returns task name -> image.

    Identical environments (same content hash) are built once."""
    if num_workers < 1:
        raise ValueError(f"expected num_workers >= 1, got {num_workers}")
    client = docker.from_env()
    with ThreadPoolExecutor(num_workers) as pool:
        refs = pool.map(lambda t: build_task_image(t, base_image_overrides=base_image_overrides, client=client,
                                                   preload=preload), tasks)
        return {t.name: ref for t, ref in zip(tasks, refs)}


def _rewrite_from_lines(text: str, overrides: Mapping[str, str],
                        dockerfile: Path) -> tuple[str, list[str], list[tuple[str, int]]]:
    """Apply overrides to every FROM; return the new text, the external images it builds on, and the external
    images that `COPY --from=` names (with their line numbers).

    A FROM mapped onto another image keeps the working directory the original image sets (INHERITED_WORKDIRS):
    a `WORKDIR` line follows it, so `COPY x ./` and `RUN bash setup.sh` land where they would have. A FROM mapped
    onto a newer release than its name says has the packages that release renamed renamed in the lines after it
    (sandbox.images.base_mapping.renamed_packages)."""
    stages: list[str] = []
    bases: list[str] = []
    copy_from: list[tuple[str, int]] = []
    lines = []
    renames: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        cm = _COPY_FROM_RE.match(line)
        if cm:
            source = cm.group(1).strip("\"'")
            if source.lower() not in stages and not source.isdigit():
                copy_from.append((source, lineno))
        m = _FROM_RE.match(line)
        if not m:
            lines.append(rename_packages(line, renames) if renames else line)
            continue
        head, flags, image, tail = m.groups()
        if "$" in image:
            raise TaskImageError(f"{dockerfile}:{lineno}: FROM {image}: build-arg substitution in FROM is not "
                                 "supported (name the image literally)")
        alias = tail.split()
        stage_name = alias[1].lower() if len(alias) == 2 and alias[0].upper() == "AS" else f"#{len(stages)}"
        if image.lower() in stages:  # FROM an earlier build stage: not an external image (its renames hold)
            lines.append(line)
        else:
            matched = _matching_override(image, overrides)
            lazy = parse_lazy_ref(matched or "")
            renames = renamed_packages(image, lazy[0]) if lazy else {}
            target = image if matched is None else resolve_base(matched)
            bases.append(target)
            lines.append(f"{head}{flags}{target}{tail}")
            workdir = inherited_workdir(image)
            if target != image and workdir:
                lines.append(f"WORKDIR {workdir}")
        stages.append(stage_name)
    if not bases:
        raise TaskImageError(f"{dockerfile}: no FROM line")
    return "\n".join(lines) + "\n", bases, copy_from


def _matching_override(image: str, overrides: Mapping[str, str]) -> str | None:
    """The target of the first pattern of `overrides` that `image` matches (a placeholder left unresolved)."""
    candidates = image_names(image)
    return next((target for pattern, target in overrides.items()
                 if any(fnmatch.fnmatchcase(c, pattern) for c in candidates)), None)


def _resolve_override(image: str, overrides: Mapping[str, str]) -> str:
    target = _matching_override(image, overrides)
    return image if target is None else resolve_base(target)


def _local_image_id(client: docker.DockerClient, ref: str, dockerfile: Path, *,
                    copy_from_line: int | None = None) -> str:
    try:
        return client.images.get(ref).id
    except docker.errors.ImageNotFound:
        if copy_from_line is not None:
            raise TaskImageError(
                f"{dockerfile}:{copy_from_line}: COPY --from={ref} copies files out of the image {ref}, which is "
                f"not present locally and no registry is reachable; it cannot be mapped onto the base image (the "
                f"files it holds are not there): `docker pull {ref}` on a machine with a registry, then "
                f"`docker save` / `docker load` it here") from None
        raise TaskImageError(
            f"{dockerfile}: FROM {ref}: image not present locally and no registry is reachable; load it with "
            f"`docker load`, or map it with --base-image '{_repository(ref)}:*=<local image>'") from None


def _repository(ref: str) -> str:
    """'registry:5000/name:tag' -> 'registry:5000/name' (a colon after the last slash starts the tag)."""
    head, sep, tail = ref.rpartition(":")
    return head if sep and "/" not in tail else ref


def _preload_shaped(dockerfile_text: str) -> bool:
    """Whether the Dockerfile holds nothing but FROM, LABEL, MAINTAINER, WORKDIR and COPY (cheap pre-check)."""
    words = {line.split(None, 1)[0].upper() for line in dockerfile_text.splitlines()
             if line.strip() and not line.lstrip().startswith("#")}
    return words <= {"FROM", "LABEL", "MAINTAINER", "WORKDIR", "COPY"}


def _preload_plan(dockerfile_text: str, context: Path,
                  base_dirs: Mapping[str, DirStat]) -> tuple[list[tuple[Path, str]], set[str]] | None:
    """What a FROM + WORKDIR + COPY Dockerfile adds: ((host path, container path) copies, directories it
    creates), or None when it is not of that shape.

    COPY semantics (Dockerfile reference): a directory source copies its contents; a file source lands at
    `dest` itself unless `dest` ends with `/` (or there are several sources); a relative `dest` is relative
    to the WORKDIR in effect; a file copied onto a path that is a directory (in `base_dirs`, the base image's,
    or made by an earlier line) goes inside it; files keep their mode and mtime and are owned by root. WORKDIR
    and COPY create missing directories (0755, root): the second element names them with every ancestor."""
    workdir, copies, dirs = None, [], set()  # workdir None: the base image's, which this does not know
    for line in dockerfile_text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            return None  # continuation lines: leave the parsing to docker
        word, _, rest = s.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word in ("FROM", "LABEL", "MAINTAINER"):
            continue
        if word == "WORKDIR" and rest and "$" not in rest:
            workdir = posixpath.normpath(posixpath.join(workdir or "/", rest.strip("\"'")))
            dirs.add(workdir)
            continue
        if word != "COPY":
            return None
        args = _copy_args(rest)
        if args is None or len(args) < 2:
            return None
        *sources, dest = args
        if not dest.startswith("/") and workdir is None:
            return None
        dest = posixpath.join(workdir or "/", dest)
        for src in sources:
            path = (context / src).resolve()
            if any(c in src for c in "*?[$") or not path.is_relative_to(context.resolve()) or not path.exists() \
                    or (context / src).is_symlink():
                return None
            if path.is_dir():
                copies.append((path, dest))
                dirs.add(posixpath.normpath(dest))
            else:
                into = dest.endswith("/") or len(sources) > 1 or _is_dir(posixpath.normpath(dest), base_dirs, dirs)
                target = posixpath.join(dest, path.name) if into else dest
                copies.append((path, target))
                dirs.add(posixpath.dirname(posixpath.normpath(target)))
    if copies and (context / ".dockerignore").exists():
        return None  # which files COPY sends is then docker's business
    # Preloaded files are the container's changes, not the image's: under the verifier's machinery they would
    # read as tampering (sandbox.runtime.verify), so such a Dockerfile is built.
    for src, target in copies:
        inside = src.rglob("*") if src.is_dir() else ()
        if any(is_protected(t) for t in [target, *(posixpath.join(target, p.relative_to(src).as_posix())
                                                    for p in inside)]):
            return None
    for d in list(dirs):
        while d not in ("/", ""):
            dirs.add(d)
            d = posixpath.dirname(d)
    dirs.discard("/")
    return copies, dirs


def _is_dir(path: str, base_dirs: Mapping[str, DirStat], made: set[str]) -> bool:
    """Whether `path` is a directory by then: the base image's, or one WORKDIR or a COPY made (or an ancestor)."""
    return path == "/" or path in base_dirs or any(d == path or d.startswith(path + "/") for d in made)


_BASE_FACTS: dict[str, tuple[dict[str, DirStat], int]] = {}
_BASE_FACTS_LOCK = threading.Lock()


def _base_facts(client: docker.DockerClient, ref: str, image_id: str) -> tuple[dict[str, DirStat], int]:
    """(the image's directories with their stat, its creation time as a Unix time), once per image id and
    process; listing them costs one short container (~0.5 s).

    Whatever the preload creates would otherwise carry the moment the container started, and `ls -l` would
    differ from one run to the next: a directory it creates gets the base image's creation time, and an
    existing directory it adds to gets its own stat back."""
    with _BASE_FACTS_LOCK:
        if image_id not in _BASE_FACTS:
            try:  # owner labels: a process killed mid-listing leaves a container that `sandbox.runtime.reap` removes
                out = client.containers.run(ref, ["/", "-xdev", "-type", "d", "-printf", "%m %U %G %T@ %p\\n"],
                                            entrypoint=["find"], remove=True, network_mode="none",
                                            labels={**owner_labels(default_run_id()), "t1.kind": "base-listing"},
                                            user="root")
            except docker.errors.DockerException as e:
                raise TaskImageError(f"listing the directories of {ref} (for preloaded task files) failed: {e}") \
                    from None
            dirs = {}
            for line in out.decode().splitlines():
                mode, uid, gid, mtime, path = line.split(" ", 4)
                dirs[path] = (int(mode, 8), int(uid), int(gid), float(mtime))
            created = client.images.get(image_id).attrs["Created"]  # RFC 3339, e.g. 2026-11-29T08:00:00.12Z
            _BASE_FACTS[image_id] = (dirs, calendar.timegm(time.strptime(created[:19], "%Y-%m-%dT%H:%M:%S")))
        return _BASE_FACTS[image_id]


def _copy_args(rest: str) -> list[str] | None:
    """COPY's arguments in shell form or JSON form; None for flags (--chown, --from, ...) or bad JSON."""
    if rest.startswith("["):
        try:
            args = json.loads(rest)
        except json.JSONDecodeError:
            return None
        return args if isinstance(args, list) and all(isinstance(a, str) for a in args) else None
    args = rest.split()
    return None if any(a.startswith("--") for a in args) else args


def _tar(copies: list[tuple[Path, str]], dirs: set[str], *, existing_dirs: Mapping[str, DirStat],
         dir_mtime: int) -> bytes | None:
    """A tar to extract at /: an entry for each of `dirs` (the image's own stat where it has that directory,
    else 0755, root, `dir_mtime`; parents first), then the copies. None above PRELOAD_MAX_BYTES."""
    as_root = RootOwned()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):  # the daemon applies directory entries' times after extracting everything
            info = tarfile.TarInfo(d.lstrip("/"))
            info.type = tarfile.DIRTYPE
            info.mode, info.uid, info.gid, info.mtime = existing_dirs.get(d, (0o755, 0, 0, dir_mtime))
            tar.addfile(info)
        for src, dest in copies:
            arc = posixpath.normpath(dest).lstrip("/")
            if src.is_dir():
                for child in sorted(src.iterdir()):  # the contents, not the directory (COPY dir/ dest)
                    tar.add(child, arcname=posixpath.join(arc, child.name), filter=as_root)
            else:
                tar.add(src, arcname=arc, filter=as_root)
            if as_root.total > PRELOAD_MAX_BYTES:
                return None
    return buf.getvalue()


def _context_hash(context: Path, dockerfile: Path, dockerfile_text: str, base_ids: list[str]) -> str:
    h = hashlib.sha256()
    h.update(dockerfile_text.encode())
    for base_id in base_ids:
        h.update(base_id.encode())
    for p in sorted(context.rglob("*")):
        rel = p.relative_to(context).as_posix()
        if p == dockerfile:
            continue
        # Mode bits are part of the hash: COPY keeps them, and tasks depend on them (permissions tasks).
        h.update(f"\0{rel}\0{p.lstat().st_mode:o}\0".encode())
        if p.is_symlink():
            h.update(str(p.readlink()).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:20]


def _lock_for(ref: str) -> threading.Lock:
    with _BUILD_LOCKS_GUARD:
        return _BUILD_LOCKS.setdefault(ref, threading.Lock())


def _image_exists(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


def _build(client: docker.DockerClient, task: Task, dockerfile_text: str, ref: str) -> None:
    with tempfile.TemporaryDirectory(prefix="t1-build-") as tmp:
        ctx = Path(tmp) / "ctx"
        shutil.copytree(task.dockerfile_dir, ctx, symlinks=True)
        rel = task.dockerfile.relative_to(task.dockerfile_dir).as_posix()  # compose may name docker/Dockerfile
        try:
            classic, files = classic_builder_form(dockerfile_text, ctx)  # BuildKit forms, as the harnesses build
        except DockerfileFormError as e:
            raise TaskImageError(f"{task.dockerfile}: {e}") from None
        for name, data in files.items():
            (ctx / name).write_bytes(data)
        (ctx / rel).write_text(classic)
        try:
            docker_build(ctx, dockerfile=rel, tag=ref, labels=_labels(task, "task-image"),
                         timeout_s=task.build_timeout_s, what=f"task {task.name} ({task.dockerfile})")
        except BuildFailed as e:
            raise TaskImageError(_with_advice(e, dockerfile_text)) from None


def _with_advice(e: BuildFailed, dockerfile_text: str) -> str:
    """The build's error, and what to do when a certificate did not verify (sandbox.images.base_image.tls_advice)."""
    from sandbox.images.base_image import from_images, tls_advice

    return str(e) if e.tls_line is None else f"{e}\n{tls_advice(e.tls_line, from_images(dockerfile_text))}"
