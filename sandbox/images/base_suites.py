"""The distribution releases T1 can build a sandbox base image of, one recipe each (sandbox.images.base_image
builds them).

bookworm is the default base, exactly as before (its recipe string, hence its image reference, is unchanged).
The others exist so that a task written for another release's image (version pins, Ubuntu-only packages, a
python:3.13 layout) runs on that release: sandbox.images.base_mapping says which FROM image goes where, and a base is
built only when a task needs it. Each is a debootstrap minbase of the release with the same tool set as
bookworm's, plus Python's headers (python3-dev: a C extension built by a verifier needs Python.h; ~53 MB on
trixie, most of it libpython3.13-dev's static library and libc6-dev).

trixie also serves the python:3.13 images, which keep pip, setuptools and wheel in
/usr/local/lib/python3.13/site-packages (TB1's broken-python deletes them there): Debian's python3-pip is left out
and pip is installed from Debian's own wheels into /usr/local, with site-packages as a link to the
dist-packages directory Debian's Python reads. See docs/terminal-bench-bases.md.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
UBUNTU_MIRROR = "http://archive.ubuntu.com/ubuntu"

# What a terminal task commonly needs, kept near 300 MB: shell + core tools, Python with pytest (verifiers run
# offline), archive and text tools, git, build basics without a compiler, and tmux (Terminal-Bench's harness
# drives its agents through tmux, so its images have it and some reference solutions start sessions).
PACKAGES: tuple[str, ...] = (
    "bash", "bc", "bzip2", "ca-certificates", "coreutils", "curl", "diffutils", "file", "findutils", "gawk",
    "git", "grep", "gzip", "jq", "less", "make", "patch", "procps", "psmisc", "python3", "python3-pip",
    "python3-pytest", "python3-venv", "sed", "sqlite3", "tar", "tmux", "tree", "unzip", "util-linux", "xz-utils",
    "zip",
)
# pip, setuptools and wheel as wheels (what ensurepip installs from): installed into /usr/local in place of
# python3-pip on a `python_local` suite.
_LOCAL_PIP_WHEELS = ("python3-pip-whl", "python3-setuptools-whl", "python3-wheel-whl")


@dataclass(frozen=True)
class Suite:
    """One release's recipe. `name` is debootstrap's suite (the codename); `repository` the image's name."""

    name: str
    distro: str  # "debian" or "ubuntu": decides the mirror, the keyring and the debootstrap script
    packages: tuple[str, ...]
    components: tuple[str, ...] = ("main",)
    # The apt sources the image carries (as the release's official image has them; "" keeps debootstrap's). The
    # tree is upgraded from them after debootstrap, as the official image is current with its pockets.
    sources: str = ""
    python_local: bool = False  # pip/setuptools/wheel in /usr/local/lib/python3.X/site-packages (python:* layout)

    @property
    def repository(self) -> str:
        return "t1-sandbox-base" if self.name == DEFAULT_SUITE else f"t1-sandbox-base-{self.name}"

    def recipe_extra(self) -> str:
        """What decides the image beyond bookworm's recipe fields ('' for bookworm, whose hash must not move)."""
        if self.name == DEFAULT_SUITE:
            return ""
        return (f"|{self.distro}|{','.join(self.components)}|{self.sources}|upgraded|"
                f"python_local={self.python_local}")


def _debian_sources(codename: str) -> str:
    return (f"deb {DEBIAN_MIRROR} {codename} main\ndeb {DEBIAN_MIRROR} {codename}-updates main\n"
            f"deb http://deb.debian.org/debian-security {codename}-security main\n")


def _ubuntu_sources(codename: str) -> str:
    parts = "main restricted universe multiverse"
    return "".join(f"deb {UBUNTU_MIRROR} {codename}{pocket} {parts}\n"
                   for pocket in ("", "-updates", "-backports", "-security"))


_WITH_HEADERS = (*PACKAGES, "python3-dev")
SUITES: dict[str, Suite] = {
    "bookworm": Suite("bookworm", "debian", PACKAGES),
    "trixie": Suite("trixie", "debian",
                    tuple(p for p in _WITH_HEADERS if p != "python3-pip") + _LOCAL_PIP_WHEELS,
                    sources=_debian_sources("trixie"), python_local=True),
    "noble": Suite("noble", "ubuntu", _WITH_HEADERS, components=("main", "universe"), sources=_ubuntu_sources("noble")),
    "jammy": Suite("jammy", "ubuntu", _WITH_HEADERS, components=("main", "universe"), sources=_ubuntu_sources("jammy")),
}


def get_suite(name: str) -> Suite:
    """The recipe of `name`; ValueError naming the known suites otherwise."""
    try:
        return SUITES[name]
    except KeyError:
        raise ValueError(f"suite {name!r}: no base image recipe for it (known: {', '.join(SUITES)})") from None
