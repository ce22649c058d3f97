"""`docker build` with a deadline, labels, a readable error, and no leftovers.

The Engine API's build call has no overall timeout (only a per-read one) and, when it fails, leaves the images
of the steps that succeeded as untagged `<none>` images. So builds run through the docker CLI with the classic
builder (what the daemon here offers: no buildx): killing the CLI at the deadline ends the build on the
daemon's side too, its plain output names each step and the image each step made, and the images a failed
build made are removed again (only those: a step that came from the cache, or a FROM, made nothing).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from sandbox.errors import SandboxError

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[@-Z\\-_]")
_STEP_RE = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
_MADE_RE = re.compile(r"^ ---> ([0-9a-f]{12,64})$")
_OUTPUT_LINES = 25
_ACTIVE: set[subprocess.Popen] = set()  # running builds, killed by `kill_active_builds` (sandbox.runtime.signals)
_ACTIVE_LOCK = threading.Lock()
_STOPPED = threading.Event()  # set by kill_active_builds: no build starts after it


# What pip/requests/urllib, curl, git, OpenSSL, apt, npm/node, Go and rustls (uv) print when a server's
# certificate does not verify: behind a TLS-intercepting proxy, every HTTPS fetch of an image lacking its CA.
_TLS_RE = re.compile(
    r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSL certificate problem|server certificate verification "
    r"failed|self[- ]signed certificate in certificate chain|unable to get local issuer certificate|x509: "
    r"certificate signed by unknown authority|SELF_SIGNED_CERT_IN_CHAIN|UNABLE_TO_GET_ISSUER_CERT_LOCALLY|invalid "
    r"peer certificate|Certificate verification failed", re.IGNORECASE)


class BuildFailed(SandboxError):
    """A `docker build` failed or ran out of time; the message names the step and shows its last output."""

    def __init__(self, message: str, *, tls_line: str | None = None) -> None:
        super().__init__(message)
        self.tls_line = tls_line
        """The first line of the log saying a certificate did not verify, else None."""


def tls_failure(text: str) -> str | None:
    """The first line of `text` (a build log, a script's output) that says a TLS certificate did not verify."""
    return next((line.strip() for line in text.splitlines() if _TLS_RE.search(line)), None)


def clean_text(raw: str) -> str:
    """Terminal output as a person would read it: ANSI sequences removed, each line as its last `\\r` left it."""
    text = _ANSI_RE.sub("", raw)
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


def docker_build(context: Path, *, dockerfile: str, tag: str, labels: dict[str, str], timeout_s: float,
                 what: str) -> None:
    """Build `context` (with `dockerfile` inside it) as `tag`; raise BuildFailed naming `what` on failure.

    The build is cut at `timeout_s`; on SIGTERM/SIGINT of the caller the CLI is killed (its process group),
    which cancels the build in the daemon."""
    docker = shutil.which("docker")
    if docker is None:
        raise SandboxError("building task images needs the docker CLI on PATH (apt-get install docker.io)")
    cmd = [docker, "build", "--rm", "--force-rm", "-f", str(context / dockerfile), "-t", tag]
    for key, value in labels.items():
        cmd += ["--label", f"{key}={value}"]
    cmd.append(str(context))
    env = {**os.environ, "DOCKER_BUILDKIT": "0", "DOCKER_CLI_HINTS": "false", "NO_COLOR": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    with _ACTIVE_LOCK:
        _ACTIVE.add(proc)
    if _STOPPED.is_set():  # after joining _ACTIVE: a kill_active_builds running now may have missed it
        _kill(proc)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(65536), b"")), daemon=True)
    reader.start()
    timed_out = False
    try:
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
            rc = proc.wait()
    except BaseException:  # SIGTERM/SIGINT turned into an exception: stop the build before leaving
        _kill(proc)
        proc.wait()
        raise
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(proc)
    reader.join(timeout=10)
    if rc == 0 and not timed_out:
        return
    log = clean_text(b"".join(chunks).decode("utf-8", errors="replace"))
    removed = _remove_made_images(docker, log)
    raise BuildFailed(_failure_message(log, what=what, timed_out=timed_out, timeout_s=timeout_s, rc=rc,
                                       removed=removed), tls_line=None if timed_out else tls_failure(log))


def kill_active_builds() -> None:
    """Kill every build this process is running (their threads then raise BuildFailed), and any it starts
    later (a process told to stop must not go on building)."""
    _STOPPED.set()
    with _ACTIVE_LOCK:
        procs = list(_ACTIVE)
    for proc in procs:
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _steps(log: str) -> list[tuple[str, list[str], list[str]]]:
    """(step text, output lines, ids of images the step made) for each step of the classic builder's log."""
    steps: list[tuple[str, list[str], list[str]]] = []
    for line in log.splitlines():
        m = _STEP_RE.match(line)
        if m:
            steps.append((m.group(3), [], []))
            continue
        if not steps:
            continue
        made = _MADE_RE.match(line)
        if made:
            steps[-1][2].append(made.group(1))
        elif not line.startswith((" ---> ", "Removing intermediate container")):
            steps[-1][1].append(line)
    return steps


def _remove_made_images(docker: str, log: str) -> int:
    """Remove the untagged images this failed build made (newest first, so each is a leaf); returns how many."""
    ids = []
    for text, out, made in _steps(log):
        if text.upper().startswith("FROM") or any("Using cache" in line for line in out):
            continue  # a base image or a cached step: not ours to remove
        ids.extend(made)
    removed = 0
    for image_id in reversed(ids):
        tags = subprocess.run([docker, "image", "inspect", "-f", "{{len .RepoTags}}", image_id],
                              capture_output=True, text=True)
        if tags.returncode == 0 and tags.stdout.strip() == "0":
            removed += subprocess.run([docker, "rmi", image_id], capture_output=True).returncode == 0
    return removed


def _failure_message(log: str, *, what: str, timed_out: bool, timeout_s: float, rc: int, removed: int) -> str:
    steps = _steps(log)
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("The command ", "ERROR", "Error", "error ", "COPY failed",
                                                         "failed to", "unable to"))]
    head = f"{what}: docker build " + (f"did not finish within {timeout_s:.0f} s" if timed_out
                                       else f"failed (exit {rc})")
    if steps:
        text, out, _ = steps[-1]
        total = next(m.group(2) for m in map(_STEP_RE.match, reversed(log.splitlines())) if m)
        head += f" at step {len(steps)}/{total} ({text if len(text) <= 100 else text[:97] + '...'})"
        tail = [line for line in out if line.strip() and line not in errors][-_OUTPUT_LINES:]
    else:
        tail = lines[-_OUTPUT_LINES:]
    body = "\n".join(f"  | {line}" for line in tail)
    cause = "\n".join(errors[-3:])
    return f"{head}\n{cause}\n{body}".rstrip() + (f"\n({removed} intermediate image(s) removed)" if removed else "")
