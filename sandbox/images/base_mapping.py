"""Which local base image a task's FROM image runs on: the sandbox base of the same distribution release.

No registry here, so a FROM image is replaced by a base T1 builds itself (sandbox.images.base_suites). The first
matching pattern wins; what matches none is left as it is (it must then be loaded). Why each goes where:
- debian:13 / trixie, python:3.13 and python:*-trixie -> trixie. The python:* images are about their Python:
  tasks pin pip packages for it and use its paths (/usr/local/lib/python3.13), and trixie's Python is 3.13, so
  python:3.13-slim-bookworm goes there too (the apt packages those tasks install all exist in trixie but two:
  libgconf-2-4, and libgl1-mesa-glx, renamed to its successors by `renamed_packages`; docs/terminal-bench-bases.md).
  TB1's t-bench/python-3-13 image is python:3.13 plus tmux.
- ubuntu:24.04 / noble and TB1's t-bench/ubuntu-24-04 -> noble; ubuntu:22.04 / jammy -> jammy.
- every other debian:*, ubuntu:*, python:* -> bookworm, as before. python:3.8-3.12 keep bookworm (Python 3.11):
  no Debian release has their Python (bullseye's 3.9 aside), their tags mostly say -bookworm, and trading the
  userland for a Python minor (noble's 3.12 under a Debian image name) breaks more apt lines than it fixes.

A pattern's target is resolved lazily (`lazy_ref`): a base other than bookworm is built, minutes of
debootstrap, only when some task's FROM maps onto it.
"""

from __future__ import annotations

import fnmatch
import re

# (glob on the FROM image without docker.io/library/, suite), most specific first.
SUITE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("debian:13*", "trixie"),
    ("debian:trixie*", "trixie"),
    ("python:3.13*", "trixie"),
    ("python:*-trixie", "trixie"),
    ("ghcr.io/laude-institute/t-bench/python-3-13*", "trixie"),
    ("ubuntu:24.04*", "noble"),
    ("ubuntu:noble*", "noble"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04*", "noble"),
    ("ubuntu:22.04*", "jammy"),
    ("ubuntu:jammy*", "jammy"),
    # Terminal-Bench 1's generic base images (Ubuntu, or Debian with Python; WORKDIR /app) map onto the base as
    # well; its task-specific ones (t-bench/deveval, ...) hold toolchains the base lacks, so they must be loaded.
    ("debian:*", "bookworm"),
    ("ubuntu:*", "bookworm"),
    ("python:*", "bookworm"),
    ("ghcr.io/laude-institute/t-bench/python-3-*", "bookworm"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-*", "bookworm"),
)
# A base named before it exists: '=' cannot appear in a Docker image reference, so this never names a real one.
LAZY_PREFIX = "t1-base-suite="
_LIBRARY_PREFIXES = ("docker.io/library/", "docker.io/", "library/")


def image_names(image: str) -> list[str]:
    """`image` and its short forms (docker.io/library/python:3.13 -> python:3.13), as the patterns are written."""
    return [image, *(image[len(p):] for p in _LIBRARY_PREFIXES if image.startswith(p))]


def suite_for_image(image: str) -> str | None:
    """The suite whose base `image` runs on, or None when no pattern matches."""
    names = image_names(image)
    return next((suite for pattern, suite in SUITE_PATTERNS if any(fnmatch.fnmatchcase(n, pattern) for n in names)),
                None)


def lazy_ref(suite: str, *, trust_host_ca: bool) -> str:
    """The placeholder for suite's base (with the host-CA layer when `trust_host_ca`), built when first used."""
    return f"{LAZY_PREFIX}{suite}{',ca' if trust_host_ca else ''}"


def parse_lazy_ref(ref: str) -> tuple[str, bool] | None:
    """lazy_ref's (suite, trust_host_ca), or None when `ref` is an ordinary image reference."""
    if not ref.startswith(LAZY_PREFIX):
        return None
    suite, _, flag = ref[len(LAZY_PREFIX):].partition(",")
    return suite, flag == "ca"


# Packages that a bookworm-named image's apt lines install and trixie dropped, with what replaced them. Only
# transitional packages whose whole content was their dependencies are here (bookworm's libgl1-mesa-glx depends
# on exactly libgl1 and libglx-mesa0), so the rename installs the same files. libgconf-2-4 (one TB2 task) has no
# successor in trixie and stays as written.
TRIXIE_SUCCESSORS: dict[str, str] = {"libgl1-mesa-glx": "libgl1 libglx-mesa0"}


def renamed_packages(image: str, suite: str) -> dict[str, str]:
    """Package renames for the lines after `FROM image` when it runs on `suite`'s base: TRIXIE_SUCCESSORS for a
    bookworm-named image placed on trixie (python:3.13-slim-bookworm), else none."""
    if suite == "trixie" and any("bookworm" in name for name in image_names(image)):
        return TRIXIE_SUCCESSORS
    return {}


def rename_packages(line: str, renames: dict[str, str]) -> str:
    """`line` with each package of `renames` named as a whole word (not pinned: `pkg=1.2` is left) replaced."""
    for old, new in renames.items():
        line = re.sub(rf"(?<![\w.+:/=-]){re.escape(old)}(?![\w.+:/=-])", new, line)
    return line
