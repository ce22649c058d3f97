"""A task's FROM image runs on the base of the same distribution release (sandbox.images.base_mapping), the bookworm
base is the one it always was, and the other releases are built only when a task needs them.

The FROM images below are every one the public Terminal-Bench 1 and 2 collections use (docs/terminal-bench-bases.md),
with the release the real image is (python:* by its Python: 3.13 is trixie's). The Docker test builds the trixie
base (a few minutes the first time; found afterwards) and checks what the python:3.13 tasks rely on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.images.base_image import CA_REPOSITORY, base_image_ref, content_hash, from_images, tls_advice
from sandbox.images.base_mapping import lazy_ref, parse_lazy_ref, suite_for_image
from sandbox.images.base_suites import SUITES, get_suite
from sandbox.images.task_images import _rewrite_from_lines, resolve_base
from tests.machine import needs_docker

ROOT = Path(__file__).resolve().parent.parent

COLLECTION_FROMS = [
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624", "noble"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest", "noble"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest@sha256:656c30e5b1e4f0526d5da9a157e69441a52b68314c1426f5"
     "24fc3389ace9a3ae", "noble"),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "trixie"),
    ("ghcr.io/laude-institute/t-bench/python-3-13:latest", "trixie"),
    ("python:3.13-slim-bookworm", "trixie"),
    ("ubuntu:24.04", "noble"),
    ("ubuntu:22.04", "jammy"),
    ("debian:13.0-slim", "trixie"),
    ("debian:bullseye-slim", "bookworm"),
    ("python:3.8-slim-bookworm", "bookworm"),
    ("python:3.9-slim-bookworm", "bookworm"),
    ("python:3.10-slim-bookworm", "bookworm"),
    ("python:3.10-slim", "bookworm"),
    ("python:3.11-slim", "bookworm"),
    ("python:3.11", "bookworm"),
    ("localstack/localstack:4.3", None),
]
OTHER_FROMS = [
    ("docker.io/library/debian:trixie", "trixie"), ("library/python:3.13", "trixie"), ("python:3.12-trixie", "trixie"),
    ("python:3.12-slim-bookworm", "bookworm"), ("debian:12", "bookworm"), ("debian:bookworm-slim", "bookworm"),
    ("ubuntu:noble-20240605", "noble"), ("ubuntu:jammy", "jammy"), ("ubuntu:20.04", "bookworm"),
    ("ghcr.io/laude-institute/t-bench/python-3-12:1", "bookworm"), ("ghcr.io/x/debian:13", None),
    ("pythonx:3.13", None),
]


@pytest.mark.parametrize("image,suite", COLLECTION_FROMS + OTHER_FROMS, ids=[i for i, _ in COLLECTION_FROMS + OTHER_FROMS])
def test_each_from_image_goes_to_its_release(image: str, suite: str | None) -> None:
    assert suite_for_image(image) == suite


def test_bookworm_base_is_unchanged() -> None:
    # The reference CI builds and every cached task image hangs off: a change here rebuilds them all, so it must be
    # deliberate (bump the literal with RECIPE_VERSION).
    assert base_image_ref() == "t1-sandbox-base:67944a90c32e" == base_image_ref("bookworm")
    refs = {name: base_image_ref(name) for name in SUITES}
    assert len(set(refs.values())) == len(SUITES) and len({content_hash(n) for n in SUITES}) == len(SUITES)
    assert refs["trixie"].startswith("t1-sandbox-base-trixie:")


def test_recipes() -> None:
    trixie, noble = get_suite("trixie"), get_suite("noble")
    assert "python3-dev" in trixie.packages and "python3-dev" in noble.packages
    assert "python3-dev" not in get_suite("bookworm").packages
    # pip lives in /usr/local on the python:3.13 base, so a task that deletes it there really breaks pip.
    assert "python3-pip" not in trixie.packages and trixie.python_local and "python3-pip-whl" in trixie.packages
    assert "universe" in noble.components and " noble-security " in noble.sources
    with pytest.raises(ValueError, match="known: bookworm, trixie"):
        get_suite("sid")


def test_placeholder_is_resolved_only_when_used() -> None:
    ref = lazy_ref("noble", trust_host_ca=True)
    assert parse_lazy_ref(ref) == ("noble", True) and parse_lazy_ref(lazy_ref("trixie", trust_host_ca=False)) == (
        "trixie", False)
    assert parse_lazy_ref("t1-sandbox-base:abc") is None and resolve_base("t1-sandbox-base:abc") == "t1-sandbox-base:abc"
    # A Dockerfile whose FROM maps elsewhere never touches the placeholder (no build, no Docker).
    text, bases, _ = _rewrite_from_lines("FROM python:3.11-slim\nRUN true\n",
                                         {"ubuntu:24.04*": ref, "python:*": "t1-sandbox-base:abc"}, Path("Dockerfile"))
    assert bases == ["t1-sandbox-base:abc"] and text.startswith("FROM t1-sandbox-base:abc\n")


def test_a_bookworm_named_image_on_trixie_installs_the_successors_of_dropped_packages(monkeypatch) -> None:
    """TB2's build-cython-ext and video-processing (python:3.13-slim-bookworm, run on trixie) install
    libgl1-mesa-glx, which trixie dropped: its successors are installed instead, in that stage only, and a pinned
    or longer name is left as written. An image named for trixie, or mapped by the user, keeps its lines."""
    monkeypatch.setattr("sandbox.images.task_images.resolve_base", lambda ref: f"resolved({ref})")  # no base build
    table = {"python:3.13*": lazy_ref("trixie", trust_host_ca=False), "debian:*": "t1-sandbox-base:abc"}
    dockerfile = ("FROM python:3.13-slim-bookworm AS build\n"
                  "RUN apt-get update && apt-get install -y git libgl1-mesa-glx \\\n"
                  "    libgl1-mesa-glx-dev libgl1-mesa-glx=22.3.6 libglib2.0-0\n"
                  "FROM build\nRUN apt-get install -y libgl1-mesa-glx\n"
                  "FROM debian:bookworm\nRUN apt-get install -y libgl1-mesa-glx\n")
    text, _, _ = _rewrite_from_lines(dockerfile, table, Path("Dockerfile"))
    assert text.splitlines()[1:] == [
        "RUN apt-get update && apt-get install -y git libgl1 libglx-mesa0 \\",
        "    libgl1-mesa-glx-dev libgl1-mesa-glx=22.3.6 libglib2.0-0",
        "FROM build", "RUN apt-get install -y libgl1 libglx-mesa0",
        "FROM resolved(t1-sandbox-base:abc)", "RUN apt-get install -y libgl1-mesa-glx"], text
    for image in ("python:3.13-slim-trixie", "python:3.13-slim"):
        text, _, _ = _rewrite_from_lines(f"FROM {image}\nRUN apt-get install -y libgl1-mesa-glx\n", table,
                                         Path("Dockerfile"))
        assert text.endswith("RUN apt-get install -y libgl1-mesa-glx\n"), text
    text, _, _ = _rewrite_from_lines("FROM python:3.13-slim-bookworm\nRUN apt-get install -y libgl1-mesa-glx\n",
                                     {"python:*": "my-own-image:1"}, Path("Dockerfile"))
    assert text.endswith("RUN apt-get install -y libgl1-mesa-glx\n"), text


def test_tls_advice_knows_every_base() -> None:
    advice = tls_advice("x", from_images("FROM t1-sandbox-base-noble:abc\n"))
    assert "rerun with --trust-host-ca" in advice
    assert "although the image trusts" in tls_advice("x", from_images(f"FROM {CA_REPOSITORY}:abc\n"))


def test_cli_rejects_an_unknown_suite() -> None:
    r = subprocess.run([sys.executable, "-m", "sandbox.base_image", "build", "--suite", "sid"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and "invalid choice: 'sid'" in r.stderr


@pytest.mark.docker
@pytest.mark.slow
@needs_docker
def test_trixie_base_has_python_313_headers_and_local_pip() -> None:
    from sandbox.images.base_image import ensure_base_image

    image = ensure_base_image(suite="trixie", trust_host_ca=False)
    script = ("python3 --version; test -f /usr/include/python3.13/Python.h && echo headers; "
              "python -c 'import pip, sys; print(pip.__file__)'; "
              "python -m pip uninstall -y -q pytest pluggy >/dev/null 2>&1; python -c 'import pluggy' 2>&1 | tail -1; "
              "rm -rf /usr/local/lib/python3.13/site-packages/pip; python -m pip --version || echo pip-gone")
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", image, "bash", "-c", script],
                         capture_output=True, text=True, timeout=120).stdout.split("\n")
    assert out[0].startswith("Python 3.13."), out
    assert out[1] == "headers", out
    assert out[2] == "/usr/local/lib/python3.13/dist-packages/pip/__init__.py", out
    # Debian's pytest and pluggy are pip's to replace (their RECORDs, _pip_records): before, pip stopped at "no
    # RECORD file was found for pluggy", and a Dockerfile's `pip install pytest==8.4.1` with it.
    assert out[3] == "ModuleNotFoundError: No module named 'pluggy'", out
    assert out[-2] == "pip-gone", out  # deleting it where python:3.13 keeps it breaks pip, as TB1's broken-python needs


def test_pip_records_list_each_debian_packages_files(tmp_path: Path) -> None:
    """dpkg's file lists -> RECORD / installed-files.txt, read back as pip reads them (a RECORD through
    importlib.metadata; installed-files.txt lines relative to the .egg-info, which 3.11's importlib ignores) against
    the files dpkg says each package owns. test_trixie_base_... has real pip remove them from a base."""
    import importlib.metadata as md
    from sandbox.images.base_image import _DIST_PACKAGES, _pip_records

    site = tmp_path / _DIST_PACKAGES
    owned = {"python3-foo": ["foo/__init__.py", "foo/sub/x.py", "foo-1.0.dist-info/METADATA"],
             "python3-bar": ["bar.py", "bar-2.0.egg-info/PKG-INFO", "bar-2.0.egg-info/top_level.txt"]}
    info = tmp_path / "var/lib/dpkg/info"
    info.mkdir(parents=True)
    for package, files in owned.items():
        dirs = sorted({str(Path(f).parent) for f in files if Path(f).parent != Path(".")})
        (info / f"{package}.list").write_text("".join(f"/{_DIST_PACKAGES}{'/' + d if d else ''}\n"
                                                      for d in ["", *dirs]) + "".join(f"/{_DIST_PACKAGES}/{f}\n"
                                                                                     for f in files))
        for f in files:
            (site / f).parent.mkdir(parents=True, exist_ok=True)
            (site / f).write_text("Name: x\nVersion: 1\n")
    (site / "foo-1.0.dist-info/INSTALLER").write_text("pip\n")  # not dpkg's: pip would leave it (harmless)
    assert _pip_records(tmp_path) == 2
    assert _pip_records(tmp_path) == 0  # written once
    for package, meta in (("python3-foo", "foo-1.0.dist-info"), ("python3-bar", "bar-2.0.egg-info")):
        if meta.endswith(".dist-info"):
            dist = md.Distribution.at(site / meta)
            listed = {Path(dist.locate_file(f)).resolve() for f in dist.files}
        else:
            listed = {(site / meta / line).resolve()
                      for line in (site / meta / "installed-files.txt").read_text().splitlines()}
        want = {(site / f).resolve() for f in owned[package]}
        if meta.endswith(".dist-info"):
            want.add((site / meta / "RECORD").resolve())
        assert listed == want, package
