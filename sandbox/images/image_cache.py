"""Task images as a bounded cache: labelled at build, stamped at each use, the least recently used pruned.

Every image T1 builds for a task carries `t1.kind` ("task-image", or "test-deps" for the layer with the test
dependencies) and `t1.task`. Each use (a build that found it, a sandbox created from it) touches a stamp file
under ~/.cache/t1/image-use/, so "least recently used" survives the process. After every new build the cache is
cut back to `T1_TASK_IMAGE_CACHE` images (default 200); `python -m sandbox.reap --images` prunes on demand.
An image is only ever removed when it has been idle for a while (default an hour: a trainer that built it at
start-up may create its next container from it any moment) and no container, running or stopped, uses it
(the daemon refuses those; nothing is forced).
"""

from __future__ import annotations

import calendar
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import docker
import docker.errors

if TYPE_CHECKING:
    from sandbox.tasks.compose import Compose
    from sandbox.tasks.format import Task

IMAGE_REPO = "t1-task"
"""The repository of every image T1 builds for a task (tag: a hash of what went into it)."""
LABEL_KIND = "t1.kind"
LABEL_TASK = "t1.task"
TASK_IMAGE_KINDS = ("task-image", "test-deps")
ENV_CACHE_SIZE = "T1_TASK_IMAGE_CACHE"
DEFAULT_CACHE_SIZE = 200
DEFAULT_MIN_IDLE_S = 3600.0


@dataclass(frozen=True)
class TaskImage:
    """What a task's sandbox starts from: an image, plus files to place before the container starts.

    `preload` is a tar to extract at `/` (empty: none). `DockerSandbox(task_image, ...)` accepts this directly."""

    ref: str
    preload: bytes = field(default=b"", repr=False)
    compose: Compose | None = None
    """A TB1 task's compose file when it has services to start beside the sandbox (`sandbox.runtime.services`)."""
    service_refs: tuple[str, ...] = ()
    """The image of each of `compose.services`, in order."""


def task_image_labels(task: Task, kind: str) -> dict[str, str]:
    if kind not in TASK_IMAGE_KINDS:
        raise ValueError(f"kind: expected one of {TASK_IMAGE_KINDS}, got {kind!r}")
    return {LABEL_KIND: kind, LABEL_TASK: task.name}


def _stamp_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "t1" / "image-use"


def _stamp(ref: str) -> Path:
    return _stamp_dir() / ref.replace("/", "_").replace(":", "_")


def touch_image(ref: str) -> None:
    """Record that `ref` was used now (a build found it, or a sandbox started from it)."""
    path = _stamp(ref)
    try:
        path.touch()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def last_used(ref: str, created: float) -> float:
    """When `ref` was last used: its stamp's time, else its creation time."""
    try:
        return max(created, _stamp(ref).stat().st_mtime)
    except FileNotFoundError:
        return created


def cache_size() -> int:
    raw = os.environ.get(ENV_CACHE_SIZE, str(DEFAULT_CACHE_SIZE))
    if not raw.isdigit():
        raise ValueError(f"${ENV_CACHE_SIZE}: expected a number of images, got {raw!r}")
    return int(raw)


def prune_task_images(*, keep: int, min_idle_s: float = DEFAULT_MIN_IDLE_S, task: str | None = None,
                      client: docker.DockerClient | None = None) -> list[str]:
    """Remove T1 task images beyond the `keep` most recently used, among those idle for `min_idle_s`; with
    `task`, only that task's images. Returns the references removed."""
    if keep < 0 or min_idle_s < 0:
        raise ValueError(f"expected keep >= 0 and min_idle_s >= 0, got {keep}, {min_idle_s}")
    client = client or docker.from_env()
    filters = {"label": [f"{LABEL_TASK}={task}"] if task else [LABEL_TASK]}
    images = []
    for image in client.images.list(filters=filters):
        if image.labels.get(LABEL_KIND) not in TASK_IMAGE_KINDS:
            continue
        created = _created(image.attrs.get("Created", ""))
        for ref in image.tags or [image.id]:
            images.append((last_used(ref, created), ref))
    images.sort(reverse=True)
    now = time.time()
    removed = []
    for used, ref in images[keep:]:
        if now - used < min_idle_s:
            continue
        try:
            client.images.remove(ref, noprune=False)
        except docker.errors.APIError:
            continue  # a container uses it, or another process removed it first
        removed.append(ref)
        _stamp(ref).unlink(missing_ok=True)
    return removed


def _created(rfc3339: str) -> float:
    try:
        return float(calendar.timegm(time.strptime(rfc3339[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return 0.0
