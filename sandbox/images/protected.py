"""The verifier's machinery in an image: the paths whose change counts as tampering (sandbox.runtime.verify).

Its own module because two sides ask: the verifier's tamper check judges a finished sandbox's changes by it, and
sandbox.images.task_images builds a Dockerfile rather than preload files that would land on such a path (preloaded
files are the container's changes, not the image's). Pure path rules: no Docker, no task, so the images wing asks
them without the runtime.
"""

from __future__ import annotations

import re

# `docker diff` paths that mark the sandbox as tampered: the verifier's own machinery. Any path starting with
# one of PROTECTED_PREFIXES, or equal to one of PROTECTED_FILES.
PROTECTED_PREFIXES = (
    "/usr/bin/pytest", "/usr/bin/py.test", "/usr/local/bin/pytest", "/usr/local/bin/py.test", "/usr/lib/python3",
    "/usr/local/lib/python3", "/etc/python3", "/etc/ld.so",
    "/usr/lib/x86_64-linux-gnu/", "/lib/x86_64-linux-gnu/", "/usr/lib/aarch64-linux-gnu/",
    "/lib/aarch64-linux-gnu/", "/lib64/", "/usr/lib64/",
)
PROTECTED_FILES = frozenset(
    f"{d}/{name}" for d in ("/bin", "/usr/bin", "/usr/local/bin", "/sbin", "/usr/sbin", "/usr/local/sbin")
    for name in ("env", "timeout", "tail", "bash", "sh", "dash", "rm", "mkdir", "chmod", "ln")
)


# Inside the Python library directories, site-packages is the agent's as much as the task's: solutions `pip
# install` what the task needs, and code the tests import is agent code anyway (the limit of sandbox.runtime.verify's
# threat model). What the verifier's own pytest run loads from there stays protected: pytest and the packages it
# imports (checked by tests/test_tasks.py against a real run), and whatever runs at interpreter start (.pth,
# *customize).
_SITE_DIR_RE = re.compile(
    r"^/usr(?:/local)?/lib/python3[^/]*/(?:site|dist)-packages(?:/(?:__pycache__/)?([^/]+))?")
VERIFIER_MODULES = frozenset({"pytest", "_pytest", "py", "pluggy", "iniconfig", "attr", "attrs", "packaging",
                              "exceptiongroup", "tomli", "_distutils_hack", "sitecustomize", "usercustomize"})


def is_site_dir(path: str) -> bool:
    """A site-packages or dist-packages directory itself (an apt-installed Python package can create one)."""
    site = _SITE_DIR_RE.match(path)
    return site is not None and site.group(1) is None and site.end() == len(path.rstrip("/"))


# The interpreters themselves (python, python3, python3.11), not every script whose name starts with "python"
# (pip writes /usr/local/bin/python-grpc-tools-protoc).
_INTERPRETER_RE = re.compile(r"^/usr(?:/local)?/bin/python[0-9.]*$")


# What `pth_files='allow'` accepts in site-packages: .pth files and the module setuptools' own .pth imports.
_PTH_MODULES = frozenset({"_distutils_hack"})
PTH_FILES = ("tamper", "allow")


def is_protected(path: str, *, pth_files: str = "tamper") -> bool:
    """Whether a change at `path` (absolute) counts as tampering with the verifier's machinery. `pth_files='allow'`
    lets .pth files in site-packages, and `_PTH_MODULES`, change (see sandbox.runtime.verify.run_verifiers)."""
    if _INTERPRETER_RE.match(path):
        return True
    site = _SITE_DIR_RE.match(path)
    if site is not None and site.group(1) is not None:
        top = site.group(1)
        pth, module = top.endswith(".pth"), top.split(".", 1)[0].split("-", 1)[0]
        if pth_files == "allow" and (pth or module in _PTH_MODULES):
            return False
        return pth or module in VERIFIER_MODULES
    return path in PROTECTED_FILES or path.startswith(PROTECTED_PREFIXES)


def holds_protected(path: str) -> bool:
    """Whether the directory `path` holds protected files (deleting or replacing it changes them)."""
    prefix = path.rstrip("/") + "/"
    return any(p.startswith(prefix) for p in (*PROTECTED_PREFIXES, *PROTECTED_FILES))
