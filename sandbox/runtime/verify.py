"""Run a task's verifiers in its sandbox after the agent's episode and count them.

Dense reward = number of verifiers passed; outcome = all passed (and there is at least one).

Each step closes a way for the agent to influence its own score:
1. Kill every process the agent left, its persistent shell included, from a fresh `docker exec` (that shell
   holds functions and traps the agent wrote; nothing of ours runs in it). `agent_processes='keep'` stops them
   instead (SIGSTOP) and lets them run again (SIGCONT) only once the tests start, as Terminal-Bench's and
   Harbor's harnesses leave them running: tasks whose tests talk to a server the agent started need that. It
   is for trusted agents (reference solutions, evaluation): a process running through the tests could change
   what they read or the results, so training keeps the default.
2. Tamper check, computed outside the container: its changes (read from its overlay2 upper directory on
   this host, else from the daemon's `docker diff`) must not touch the interpreter, the standard library,
   pytest and what it imports, .pth files, the shells and tools the verifier calls, shared libraries or the
   ld.so configuration (other packages in site-packages may change: tasks have the agent install them; so may
   a package install's new libraries and the loader cache it rewrites, as long as every library the image had
   still resolves to the same file, and the image's libraries that the verifier's programs never load:
   `_ImageFiles.installed_alongside`, `sandbox.images.ldcache`, `sandbox.images.verifier_libs`; `pth_files='allow'`
   accepts .pth files, for trusted agents). A
   tampered sandbox scores 0 of the static test count, with the paths reported. Changed .pyc files there do not
   count as tampering: Python then runs with a fresh `pycache_prefix`, so it compiles from source and never
   reads them.
3. Remove /tests and /logs/verifier (anything planted there), write the task's tests into a fresh directory
   with a random 128-bit name, and link /tests to it (tests written for /tests keep working).
4. pytest kind: a fresh `docker exec` runs pytest as root with an empty environment (`env -i` plus the
   container's configured Env, without PYTHON*/LD_* variables), `python3 -I -B`, our own ini file,
   `--rootdir`/`--confcutdir` at the test directory (no conftest.py above it is loaded), no cache
   provider, plugin autoload off, under `timeout -k`, from the container's working directory, which is
   appended to sys.path (`python -m pytest` puts it first; last, nothing there shadows pytest). Results come
   from pytest's JUnit XML at a random path; a small in-process recorder also writes collection and per-test
   outcomes as they happen, so a run cut at its timeout still knows its total and which tests finished (the
   rest count as failed).
   Printed text is never parsed: the XML comes back after the log, cut by its byte count from the end.
   script kind, Harbor: run tests/test.sh the same way, then read
   /logs/verifier/reward.json (every key is one verifier; a value >= 1 passes), else reward.txt (one
   verifier, passes when the number is >= 1); no reward file -> 0 of 1.
   script kind, TB1 (no tests/test_*.py, parser 'pytest'): run-tests.sh the same way; one verifier, passed
   when it exits 0 (such scripts print a pytest-style summary line from their own exit status).
5. Kill every process again before reading results (tests may start agent code that forks).

`total` is never below the number of test functions found statically in tests/test_*.py, so a test module
that fails to import (e.g. the agent deleted something it imports) counts all its tests as failed.
Limit of the threat model: code the tests themselves execute (the agent's programs) runs as root inside the
container during verification. Built-in tests therefore run agent code only in subprocesses with timeouts,
never imported into the pytest process.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import io
import json
import math
import os
import re
import secrets
import shlex
import stat
import tarfile
import time
import xml.etree.ElementTree as ET
from typing import Any

import sandbox.images.ldcache as ldcache
import sandbox.images.verifier_libs as verifier_libs
from sandbox.daemon import docker_errors
from sandbox.runtime.docker_sandbox import DockerSandbox
from sandbox.errors import SandboxError
from sandbox.images.protected import PROTECTED_FILES, PTH_FILES, holds_protected, is_protected, is_site_dir
from sandbox.images.tarball import RootOwned
from sandbox.tasks.format import Task

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_KILL_GRACE_S = 5
_OUTPUT_TAIL = 16_000
# Out-of-band process sweep (bash builtins only): kill everything but init, the container's keepalive (the
# child of docker-init that started first) and the calling script, the agent's persistent shell included
# (its traps would run agent code when its children die). Zombies are skipped: only their parent reaps.
_SWEEP = r'''
keeper() {  # keep=" 1 <keepalive> <this shell> ": the processes none of the functions below touch
  local best= init_comm p st f=() keepalive=
  read -r init_comm < /proc/1/comm
  for p in /proc/[1-9]*; do
    read -r st 2>/dev/null < "$p/stat" || continue  # 2> first: it also silences a failed open (pid gone)
    st=${st##*') '}; f=($st)
    if [[ $init_comm == docker-init && ${f[1]} == 1 ]] && { [[ -z $best ]] || (( f[19] < best )); }; then
      best=${f[19]}; keepalive=${p#/proc/}
    fi
  done
  keep=" 1 $keepalive $$ "
}
stop_pass() {  # SIGSTOP every process but $keep whose state letter is not in $1; their pids into the caller's pids
  local p st pid
  pids=()
  for p in /proc/[1-9]*; do
    pid=${p#/proc/}
    [[ $keep == *" $pid "* ]] && continue
    read -r st 2>/dev/null < "$p/stat" || continue
    st=${st##*') '}
    [[ ${st:0:1} == [$1] ]] && continue
    pids+=("$pid"); kill -STOP "$pid" 2>/dev/null
  done
}
sweep() {
  local pid st pids=() deadline=$((SECONDS + 30))
  keeper
  while (( SECONDS < deadline )); do
    stop_pass ZX  # zombies: only their parent reaps
    (( ${#pids[@]} )) || return 0
    kill -KILL "${pids[@]}" 2>/dev/null
    # A SIGKILLed process stays visible (R or D) until it gets a CPU to run its exit: wait 20 ms between
    # passes, without forking (works while a fork bomb holds the pids limit): a fresh pty master never has data.
    read -r -t 0.02 _ 2>/dev/null <>/dev/ptmx
  done
  echo "sweep: processes still alive after 30 s: ${pids[*]}"
  for pid in "${pids[@]}"; do read -r st 2>/dev/null < "/proc/$pid/stat" && echo "sweep: $st"; done
  return 1
}
freeze() {  # stop (not kill) what sweep would kill, until none of it runs: agent_processes='keep'
  local pids=() deadline=$((SECONDS + 30))
  keeper
  while (( SECONDS < deadline )); do
    stop_pass ZXTt  # T, t: stopped already
    (( ${#pids[@]} )) || return 0
    read -r -t 0.02 _ 2>/dev/null <>/dev/ptmx
  done
  echo "freeze: processes still running after 30 s: ${pids[*]}"
  return 1
}
thaw() {
  local p
  keeper
  for p in /proc/[1-9]*; do [[ $keep == *" ${p#/proc/} "* ]] || kill -CONT "${p#/proc/}" 2>/dev/null; done
}
'''


@dataclasses.dataclass(frozen=True)
class VerifierResult:
    """Outcome of one verifier run. Dense reward = `passed`; outcome = `passed == total > 0`."""

    passed: int
    """Verifiers (test cases) that passed: no failure, error or skip in any phase."""
    failed: int
    """total - passed (failures, errors, skips, unfinished and uncollected tests)."""
    total: int
    """Number of verifiers."""
    per_test: dict[str, bool]
    """Test id ('test_file.py::test_x', or the reward.json key) -> passed."""
    timed_out: bool
    """The verifier run was cut at the task's verifier timeout."""
    error: str | None = None
    """Why the count is not from a normal run (tampering, no results, broken reward file), else None."""
    tampered: tuple[str, ...] = ()
    """Paths the tamper check found changed (non-empty -> everything counted failed)."""
    duration_s: float = 0.0
    """Wall time of the whole verification, kill to last read."""
    output: str = ""
    """Tail of the verifier's console output, for people (never parsed)."""

    def __post_init__(self) -> None:
        if not (0 <= self.passed <= self.total and self.failed == self.total - self.passed):
            raise ValueError(f"expected 0 <= passed <= total and failed = total - passed, got passed="
                             f"{self.passed} failed={self.failed} total={self.total}")

    @property
    def reward(self) -> int:
        """Dense process reward: the absolute number of verifiers passed."""
        return self.passed

    @property
    def outcome(self) -> bool:
        """True when every verifier passed (and there was at least one)."""
        return self.total > 0 and self.passed == self.total

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tampered"] = list(self.tampered)
        d["outcome"] = self.outcome
        return d


AGENT_PROCESSES = ("kill", "keep")


def run_verifiers(sandbox: DockerSandbox, task: Task, *, agent_processes: str = "kill",
                  pth_files: str = "tamper") -> VerifierResult:
    """Verify the state the agent left in `sandbox` (a DockerSandbox running the task's image).
    `agent_processes`: 'kill' (every process the agent left dies before the checks) or 'keep' (they are frozen
    through the tamper check and run again with the tests; see the module docstring, step 1).
    `pth_files`: 'tamper' (a new or changed .pth in site-packages counts as tampering) or 'allow' (it does not).
    A package install can add one (setuptools' distutils-precedence.pth, an editable install's finder, cmeel.pth),
    and its import lines run at the start of the verifier's interpreter, before pytest: agent code in the pytest
    process. 'allow' is for trusted agents only (reference solutions, evaluation), as 'keep' is.

    Verifier commands run in fresh `docker exec`s, never in the agent's persistent shell (whose functions
    and traps the agent controls: even the runtime's `kill_all_processes` runs there, so it is not used).
    Two execs in all: the sweep before the tamper check, then one that writes the tests (or, when they are
    too large for one argument, after a `put_archive`), runs them and returns the JUnit XML. The agent's
    shell is killed with everything else; the sandbox starts a fresh one if it is used again.
    """
    if agent_processes not in AGENT_PROCESSES:
        raise ValueError(f"agent_processes must be one of {AGENT_PROCESSES}, got {agent_processes!r}")
    if pth_files not in PTH_FILES:
        raise ValueError(f"pth_files must be one of {PTH_FILES}, got {pth_files!r}")
    keep = agent_processes == "keep"
    start = time.monotonic()
    work = f"/.t1-verify-{secrets.token_hex(16)}"
    tests = f"{work}/tests"
    # Kill (or freeze) every process the agent left, then clear planted results.
    prep = f"{'freeze' if keep else 'sweep'} || exit 1; rm -rf /tests /logs/verifier && mkdir -p /logs/verifier && ln -s {tests} /tests"
    code, prep_out = _exec(sandbox, prep, env={"PATH": _PATH})
    # After the sweep: no agent process is left (or, kept, none runs) to change files between this check and
    # the tests.
    with docker_errors("inspecting the sandbox"):
        info = sandbox.api.inspect_container(sandbox.id)
    tampered, pyc_changed = _inspect_changes(sandbox, info, pth_files=pth_files)
    if tampered:  # checked before `code`: deleting bash or env also makes the sweep itself fail
        return _all_failed(task, start, error="tampered: the verifier's interpreter, shells or libraries were "
                           f"modified ({len(tampered)} paths)", tampered=tuple(tampered))
    if code != 0:
        with docker_errors("listing the sandbox's processes"):
            procs = sandbox.api.top(sandbox.id).get("Processes")
        raise SandboxError(f"could not prepare verification in {sandbox!r} (exit {code}): "
                           f"{prep_out[-300:].decode(errors='replace')!r}; "
                           f"processes: {procs}")
    setup = _work_dir_script(task, work)
    if setup is None:  # too large for one bash argument: through the daemon's archive API
        _upload_work_dir(sandbox, task, work)
    env = {**dict(task.verifier_env), **_clean_env(info, tests, work, pyc_changed=pyc_changed)}
    code, out, junit_xml = _run_tests(sandbox, task, work, env, setup=setup or "", pyc_changed=pyc_changed,
                                      thaw=keep)
    timed_out = code in (124, 137)
    error = None
    if task.verifier_kind == "script" and task.layout == "tb1":
        per_test = {task.test_script.name if task.test_script else "run-tests.sh": code == 0}
    elif task.verifier_kind == "script":
        per_test, error = _read_reward(sandbox)
    else:
        if junit_xml is not None and not timed_out:
            per_test = _parse_junit(junit_xml)
        else:
            per_test = _parse_progress(_read_optional(sandbox, f"{work}/out/progress.jsonl") or b"")
            if not per_test:
                error = f"no results (exit code {code}): {out[-300:].strip()}"
        _add_missing_static_ids(per_test, task.static_test_ids)
    if not all(per_test.values()):
        error = _missing_dependency(out) or error
    passed = sum(per_test.values())
    return VerifierResult(passed=passed, failed=len(per_test) - passed, total=len(per_test), per_test=per_test,
                          timed_out=timed_out, error=error, duration_s=time.monotonic() - start, output=out)


def _run_tests(sandbox: DockerSandbox, task: Task, work: str, env: dict[str, str], *, setup: str,
               pyc_changed: bool, thaw: bool = False) -> tuple[int, str, bytes | None]:
    """Run the verifier in one exec: `setup` (bash that writes the work directory, or ""), with `thaw` the
    agent's frozen processes continued, the tests under
    `timeout -k`, then a sweep (tests may have started agent code that forked), then the log tail, a line
    `t1-exit RC N` and, as the last N bytes, the JUnit XML (N = 0: none was written).
    Returns (the tests' exit status, the log tail, the JUnit XML or None).

    The XML comes back in the exec's output instead of a `get_archive` (~50 ms of daemon CPU each); it is
    found by its length counted from the end, so nothing the tests printed can pose as it."""
    tests = f"{work}/tests"
    if task.verifier_kind == "pytest":
        args = [tests, "-c", f"{work}/pytest.ini", "--rootdir", tests, "--confcutdir", tests, "-p",
                "no:cacheprovider", f"--junitxml={work}/out/junit.xml", "-o", "junit_family=xunit1", "-q",
                "--color=no"]
        # Bytecode the agent may have planted is only read when it exists: with a fresh pycache_prefix
        # Python compiles everything from source (~0.4 s CPU more), so take that cost only when needed.
        pyc_flag = f"-X pycache_prefix={work}/pyc " if pyc_changed else ""
        cmd = f"/usr/bin/python3 -I -B {pyc_flag}{work}/runner.py {work}/out/progress.jsonl {shlex.join(args)}"
        if task.test_deps.setup:
            # The test script's own preparation (sandbox.tasks.test_deps.setup_steps), as its harness runs it: first,
            # in a subshell of its own, under the same time limit; its failure is the tests' to find.
            prepare = f"( {task.test_deps.setup}\n) < /dev/null; exec {cmd}"
            cmd = f"/bin/bash -c {shlex.quote(prepare)}"
    else:
        assert task.test_script is not None, "script verifiers need a test script (checked by load_task)"
        # TB1's run-tests.sh sits beside tests/, not in it: it is one of the work directory's files.
        script = f"{work}/{_TB1_SCRIPT}" if task.layout == "tb1" else f"{tests}/{task.test_script.name}"
        cmd = f"/bin/bash {script}"
    # $(< file) is bash reading the file itself (no tool to trust); LC_ALL=C makes ${#j} count bytes.
    # From the container's working directory, as Terminal-Bench and Harbor run them: tests use relative paths.
    run = (f"{'thaw; ' if thaw else ''}cd {shlex.quote(task.workdir)} 2>/dev/null || cd / || exit 1; "
           f"/usr/bin/timeout -k {_KILL_GRACE_S} {math.ceil(task.verifier_timeout_s)} {cmd} "
           f"> {work}/out/log 2>&1 < /dev/null; rc=$?; sweep || exit 1; "
           f"/usr/bin/tail -c {_OUTPUT_TAIL} {work}/out/log; echo; "
           f"exec 2>/dev/null; LC_ALL=C; j=; [[ -f {work}/out/junit.xml ]] && j=$(< {work}/out/junit.xml); "
           f"printf '%s\\n' \"$j\"; echo \"t1-exit $rc ${{#j}}\"")
    # The setup's bash holds the test files in its argv: `exec` a fresh one, so the tests' process listings
    # (pgrep -f, ps) never see their own text in a verifier process.
    script = f"{setup}exec /bin/bash --noprofile --norc -c {shlex.quote(_SWEEP + run)}"
    sweep_code, raw = _exec(sandbox, script, env=env)
    body, _, last = raw.rstrip(b"\n").rpartition(b"\n")
    fields = last.split()
    if (sweep_code != 0 or len(fields) != 3 or fields[0] != b"t1-exit" or not fields[2].isdigit()
            or int(fields[2]) > len(body)):
        raise SandboxError(f"the verifier run in {sandbox!r} did not finish (exit {sweep_code}): "
                           f"{raw[-300:].decode(errors='replace')!r}")
    n = int(fields[2])  # the XML may hold anything the tests printed: it is the last n bytes, nothing else
    junit, log_tail = (body[len(body) - n:] or None), body[:len(body) - n]
    return int(fields[1]), log_tail.rstrip(b"\n").decode("utf-8", errors="replace"), junit


# Empty directories of the verifier's work directory, besides tests/ (the task's); its files are _WORK_FILES.
_WORK_SUBDIRS = ("out", "pyc")

# One `bash -c` argument holds at most 128 KiB (Linux MAX_ARG_STRLEN); larger test directories are uploaded.
_INLINE_MAX_CHARS = 96 * 1024


def _work_dir_script(task: Task, work: str) -> str | None:
    """Bash that writes what `_upload_work_dir` uploads ({work}/ 0700 with tests/, out/, pyc/, runner.py and
    pytest.ini, all root's, file modes kept) using only builtins, mkdir and chmod, or None when it would not
    fit in one argument or the tests hold anything but files and directories.

    Why: `put_archive` costs ~50 ms of daemon CPU per verification (the daemon re-executes itself to unpack
    inside the container), as much as the exec that runs the tests."""
    subdirs = " ".join(f"{work}/{sub}" for sub in _WORK_SUBDIRS)
    lines = [f"mkdir -m 700 {work} && mkdir -m 755 {subdirs} || exit 1",
             *(_write_file(f"{work}/{name}", data, 0o644) for name, data in _work_files(task).items()),
             f"mkdir -m {_tests_dir_mode(task):o} {work}/tests || exit 1"]
    size = sum(map(len, lines))
    for path in sorted(task.tests_dir.rglob("*") if task.tests_dir.is_dir() else ()):
        target = shlex.quote(f"{work}/tests/{path.relative_to(task.tests_dir).as_posix()}")
        st = path.lstat()
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            lines.append(f"mkdir -m {mode & 0o7777:o} {target} || exit 1")
        elif stat.S_ISREG(mode):
            if st.st_size > _INLINE_MAX_CHARS:
                return None
            lines.append(_write_file(target, path.read_bytes(), mode & 0o7777, quoted=True))
        else:
            return None
        size += len(lines[-1])
        if size > _INLINE_MAX_CHARS:
            return None
    return "\n".join(lines) + "\n"


def _tests_dir_mode(task: Task) -> int:
    """The mode of the task's tests/, or 0o755 for one it has none (a TB1 task graded by run-tests.sh alone)."""
    return task.tests_dir.stat().st_mode & 0o7777 if task.tests_dir.is_dir() else 0o755


def _write_file(path: str, data: bytes, mode: int, *, quoted: bool = False) -> str:
    """printf %b of `data` (bytes outside printable ASCII, quotes and backslashes as \\0NNN), then chmod."""
    body = "".join(chr(b) if (32 <= b < 127 and b not in (39, 92)) or b in (9, 10) else f"\\0{b:03o}"
                   for b in data)
    target = path if quoted else shlex.quote(path)
    return f"printf '%b' '{body}' > {target} && chmod {mode:o} {target} || exit 1"


def _upload_work_dir(sandbox: DockerSandbox, task: Task, work: str) -> None:
    """One archive into /: {work}/ (0700) with tests/, out/, pyc/, runner.py and pytest.ini, all root's."""
    buf = io.BytesIO()
    name = work.lstrip("/")

    def add_bytes(tar: tarfile.TarFile, path: str, data: bytes) -> None:
        info = tarfile.TarInfo(path)
        info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(data))

    def add_dir(tar: tarfile.TarFile, path: str, mode: int) -> None:
        info = tarfile.TarInfo(path)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, int(time.time())
        tar.addfile(info)

    with tarfile.open(fileobj=buf, mode="w") as tar:
        add_dir(tar, name, 0o700)
        for sub in _WORK_SUBDIRS:
            add_dir(tar, f"{name}/{sub}", 0o755)
        if task.tests_dir.is_dir():
            tar.add(task.tests_dir, arcname=f"{name}/tests", filter=RootOwned())
        else:  # a TB1 task graded by its run-tests.sh alone (sandbox.tasks.format)
            add_dir(tar, f"{name}/tests", _tests_dir_mode(task))
        for file_name, data in _work_files(task).items():
            add_bytes(tar, f"{name}/{file_name}", data)
    with docker_errors(f"uploading the tests of {task.name}"):
        sandbox.api.put_archive(sandbox.id, "/", buf.getvalue())


def tampered_paths(sandbox: DockerSandbox) -> list[str]:
    """Paths under the verifier's machinery that differ from the image."""
    with docker_errors("inspecting the sandbox"):
        info = sandbox.api.inspect_container(sandbox.id)
    return _inspect_changes(sandbox, info)[0]


def _inspect_changes(sandbox: DockerSandbox, info: dict[str, Any], *,
                     pth_files: str = "tamper") -> tuple[list[str], bool]:
    """(tampered paths, whether any .pyc under the protected prefixes changed), judged from the container's
    changes: read from its overlay2 upper directory when the daemon's storage is visible here, else from
    `docker diff`. Both are computed outside the container."""
    changes = _upper_dir_changes(info)
    image = _ImageFiles.of(info) if changes is not None else None
    if changes is None:
        with docker_errors("listing the sandbox's file changes"):
            changes = [(c["Path"], _DIFF_KINDS[c["Kind"]]) for c in sandbox.api.diff(sandbox.id) or []]
    # A directory is listed as modified whenever something below it changed: judge the entries below instead.
    parents = {path.rsplit("/", i)[0] for path, _ in changes for i in range(1, path.count("/"))}
    bad, pyc = set(), False
    for path, kind in changes:
        if kind == "modified" and path in parents:
            continue
        if kind in ("added", "modified") and is_site_dir(path):
            continue  # a site directory made (or its mode changed): what lands in it is judged entry by entry
        protected = (is_protected(path, pth_files=pth_files)
                     or (kind in ("deleted", "replaced") and holds_protected(path)))
        if path.endswith(".pyc") or path.endswith("/__pycache__"):
            pyc = pyc or protected  # harmless only while Python does not read them (see run_verifiers)
        elif protected and not (image is not None and image.installed_alongside(path, kind)):
            bad.add(path)
    return sorted(bad), pyc


# Shared-library directories the loader searches. A package install adds files there and rewrites the loader's
# cache; neither reaches the verifier's interpreter unless a library it already loads is replaced or shadowed.
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
             "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/usr/local/lib", "/lib", "/usr/lib")
_LD_CACHE = "/etc/ld.so.cache"


@dataclasses.dataclass(frozen=True)
class _ImageFiles:
    """The image's own files (overlay2 lower directories, read on this host) next to the container's (upper)."""

    lowers: tuple[str, ...]
    upper: str

    @classmethod
    def of(cls, info: dict[str, Any]) -> _ImageFiles | None:
        data = (info.get("GraphDriver") or {}).get("Data") or {}
        lowers = tuple(d for d in (data.get("LowerDir") or "").split(":") if d)
        if not lowers or not all(os.path.isdir(d) for d in lowers):
            return None
        return cls(lowers, data["UpperDir"])

    def image_entry(self, path: str) -> str | None:
        """Where the image's `path` lies on this host (the top layer first, as LowerDir lists them), None if absent."""
        return verifier_libs.layer_entry(self.lowers, path)

    def has(self, path: str) -> bool:
        return self.image_entry(path) is not None

    def container_entry(self, path: str) -> str:
        return os.path.join(self.upper, path.lstrip("/"))

    def read(self, path: str, *, upper: bool) -> bytes | None:
        full = self.container_entry(path) if upper else self.image_entry(path)
        if full is None or not os.path.isfile(full) or os.path.islink(full):
            return None
        with open(full, "rb") as f:
            return f.read()

    def is_new_dir(self, path: str) -> bool:
        full = self.container_entry(path)
        return os.path.isdir(full) and not os.path.islink(full)

    def keeps_contents(self, path: str, *, limit: int = 5000) -> bool:
        """Whether a directory made anew (overlay's opaque directory) still holds every file the image's copy held,
        byte for byte (dpkg unpacking a package can remove and recreate a directory)."""
        seen = 0
        for lower in self.lowers:
            top = os.path.join(lower, path.lstrip("/"))
            for root, dirs, files in os.walk(top):
                for name in dirs + files:
                    seen += 1
                    old = os.path.join(root, name)
                    new = os.path.join(self.upper, os.path.relpath(old, lower))
                    if seen > limit or not _same_entry(old, new):
                        return False
        return True

    def unused_library(self, path: str) -> bool:
        """Whether `path` is a file (or link) of the image directly in a library directory that none of the
        verifier's programs loads (sandbox.images.verifier_libs): changing or removing it cannot reach the verifier."""
        lib_dir = _lib_dir_of(path)
        image = self.image_entry(path)
        if lib_dir is None or "/" in path[len(lib_dir) + 1:] or image is None or os.path.isdir(image):
            return False
        name = path.rsplit("/", 1)[1]
        return not verifier_libs.is_glibc(name) and name not in _verifier_library_names(self.lowers)

    def installed_alongside(self, path: str, kind: str) -> bool:
        """Whether a change under the protected prefixes is what a package install does without touching what
        the verifier loads: a library the image did not have, whose name shadows none it had (a shadowing name
        can win the loader's search); a new directory, or a new file in one, outside the directories the loader
        searches or plugins come from; an entry of the image copied up unchanged, or a directory made anew that
        still holds the image's files; a rewritten loader cache in which every library the image's cache resolved
        still resolves to the same file (`sandbox.images.ldcache`), and the ld.so.conf files it is made from (the loader
        itself reads only the cache and ld.so.preload); in Python's own directories, a new entry no import
        statement can name (python3-dev's config-3.11-x86_64-linux-gnu/); a library of the image that the
        verifier's programs do not load, changed or removed (`unused_library`: a solution that reinstalls apt)."""
        if path.startswith(_LD_CONF):
            return True
        stdlib = _STDLIB_RE.match(path)
        if stdlib is not None:
            top = stdlib.group(0)
            return not self.has(top) and not _IMPORTABLE_RE.fullmatch(top.rsplit("/", 1)[1])
        if kind == "deleted":
            return self.unused_library(path)
        if path == _LD_CACHE:
            old, new = self.read(path, upper=False), self.read(path, upper=True)
            if old is None or new is None:
                return False
            try:
                return not ldcache.repointed(old, new)
            except ldcache.CacheFormatError:
                return False
        lib_dir = _lib_dir_of(path)
        if lib_dir is None:
            return False
        rest = path[len(lib_dir) + 1:]
        if rest.split("/", 1)[0] in _LOADER_SUBDIRS:
            return False
        image = self.image_entry(path)
        if image is not None:  # the image's own entry: benign unchanged (copied up), a directory made anew with its
            # files, or a library the verifier does not load
            if kind == "replaced":
                return self.keeps_contents(path)
            return _same_entry(image, self.container_entry(path)) or self.unused_library(path)
        if "/" in rest or self.is_new_dir(path):
            return True
        return not any(self.has(f"{d}/{rest}") for d in _LIB_DIRS)


_LD_CONF = ("/etc/ld.so.conf", "/etc/ld.so.conf.d/")
# An entry of Python's own directories that sit on sys.path (the standard library, lib-dynload): group 0 is the
# entry itself, whatever lies below it. A name an import can reach shadows what the verifier's pytest imports.
_STDLIB_RE = re.compile(r"^/usr(?:/local)?/lib/python3\.\d+/(?!(?:site|dist)-packages(?:/|$))(?:lib-dynload/)?[^/]+")
_IMPORTABLE_RE = re.compile(r"[A-Za-z_]\w*(?:\.py|\.pyc|(?:\.[\w-]+)*\.so)?")


# Subdirectories of a library directory that the loader searches (glibc-hwcaps and the legacy hwcap/platform
# names) or loads plugins from (gconv: iconv's converters): nothing in them may change.
_LOADER_SUBDIRS = frozenset({"glibc-hwcaps", "tls", "x86_64", "haswell", "avx512_1", "i386", "i486", "i586", "i686",
                             "sse2", "gconv"})


def _lib_dir_of(path: str) -> str | None:
    """The library directory (of the multiarch and lib64 ones, `_LIB_DIRS[:6]`) that `path` lies under, or None."""
    return next((d for d in _LIB_DIRS[:6] if path.startswith(d + "/")), None)


@functools.lru_cache(maxsize=64)
def _verifier_library_names(lowers: tuple[str, ...]) -> frozenset[str]:
    """sandbox.images.verifier_libs for one image (its layers never change; read once per process)."""
    return verifier_libs.verifier_library_names(lowers, _LIB_DIRS, PROTECTED_FILES)


def _same_entry(old: str, new: str) -> bool:
    """Two filesystem entries of the same kind with the same content (file bytes, link target)."""
    try:
        a, b = os.lstat(old), os.lstat(new)
    except FileNotFoundError:
        return False
    if stat.S_IFMT(a.st_mode) != stat.S_IFMT(b.st_mode):
        return False
    if stat.S_ISLNK(a.st_mode):
        return os.readlink(old) == os.readlink(new)
    if stat.S_ISREG(a.st_mode):
        if a.st_size != b.st_size:
            return False
        with open(old, "rb") as f, open(new, "rb") as g:
            return f.read() == g.read()
    return True


# Kinds of change: docker diff's 0, 1, 2, and "replaced", a directory removed and made again (overlay's opaque
# directory: nothing of the image's copy shows through; docker diff lists what it held as deleted instead).
_DIFF_KINDS = {0: "modified", 1: "added", 2: "deleted"}


def _upper_dir_changes(info: dict[str, Any]) -> list[tuple[str, str]] | None:
    """Every entry of the container's overlay2 upper directory as (path, kind), or None when that directory
    cannot be read here (a remote daemon, another storage driver, no permission).

    Why: on kernels with overlayfs redirect_dir the daemon's `docker diff` compares the whole container tree
    with the image (24k stat + lgetxattr calls, ~0.3 s of daemon CPU per verification, the largest part of
    it); every change the container makes is an entry of its upper directory, so walking that is exact and
    takes ~1 ms. A character device 0:0 is a deleted path (whiteout); a directory with the opaque xattr was
    removed and created again; any other entry was added or changed (copied up). Directories that merely
    hold changed entries are reported as "modified", like docker diff does."""
    driver = info.get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    # Root only: the opaque marker is a trusted.* xattr, which other users cannot read (they would miss it).
    if driver.get("Name") != "overlay2" or not upper or os.geteuid() != 0 or not os.path.isdir(upper):
        return None
    try:
        return _walk_upper(upper)
    except OSError:  # unreadable here after all: the daemon's own diff is the reference
        return None


def _walk_upper(upper: str) -> list[tuple[str, str]]:
    changes: list[tuple[str, str]] = []
    for root, dirs, files in os.walk(upper, onerror=_raise):
        rel = "/" + os.path.relpath(root, upper) if root != upper else ""
        for name in dirs + files:
            full, path = os.path.join(root, name), f"{rel}/{name}"
            st = os.lstat(full)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                changes.append((path, "deleted"))
            elif stat.S_ISDIR(st.st_mode) and _is_opaque(full):
                changes.append((path, "replaced"))
            else:
                changes.append((path, "modified" if stat.S_ISDIR(st.st_mode) else "added"))
    return changes


def _is_opaque(directory: str) -> bool:
    try:
        return os.getxattr(directory, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError as e:
        if e.errno == errno.ENODATA:
            return False
        raise


def _raise(e: OSError) -> None:
    raise e


_MISSING_MODULE_RE = re.compile(r"(?:ModuleNotFoundError|ImportError): No module named '([^']+)'")
_MISSING_HOST_RE = re.compile(r"Could not resolve host: (\S+)|Failed to resolve '([^']+)'|"
                              r"host='([^']+)'.*(?:NameResolutionError|Name or service not known|Temporary failure)")


def _missing_dependency(output: str) -> str | None:
    """'verifier_error: ...' naming the module or host the tests could not reach, read from their
    output (for people: the score is never read from text). None when the output names none."""
    for regex, what in ((_MISSING_MODULE_RE, "the tests import the module {!r}, which the image does not have "
                         "(a test dependency the task's test script installs at verification time, see "
                         "sandbox.tasks.test_deps, or a module the agent was to write in the working directory)"),
                        (_MISSING_HOST_RE, "the tests need the host {!r}, which cannot be reached from the sandbox")):
        m = regex.search(output)
        if m:
            return "verifier_error: " + what.format(next(g for g in m.groups() if g))
    return None


def _clean_env(info: dict[str, Any], tests: str, work: str, *, pyc_changed: bool) -> dict[str, str]:
    """The container's configured Env (set by the image and the host, not by the agent) plus our own."""
    configured = info.get("Config", {}).get("Env") or []
    env: dict[str, str] = {}
    for item in configured:
        key, _, value = item.partition("=")
        if not key.startswith(("PYTHON", "PYTEST", "LD_")) and key not in ("BASH_ENV", "ENV"):
            env[key] = value
    env.update(PATH=_PATH, HOME="/root", LANG="C.UTF-8", TEST_DIR=tests, PYTHONDONTWRITEBYTECODE="1",
               PYTHONNOUSERSITE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if pyc_changed:
        env["PYTHONPYCACHEPREFIX"] = f"{work}/pyc"
    return env


def _exec(sandbox: DockerSandbox, script: str, *, env: dict[str, str]) -> tuple[int, bytes]:
    """Run `script` in a fresh bash (a new `docker exec` as root, environment exactly `env`, the function
    `sweep` defined); return (exit code, output bytes)."""
    argv = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in sorted(env.items())), "/bin/bash", "--noprofile",
            "--norc", "-c", f"{_SWEEP}\n{script}"]
    api = sandbox.api
    with docker_errors("running a verifier command"):
        exec_id = api.exec_create(sandbox.id, argv, user="root", workdir="/")["Id"]
        output = api.exec_start(exec_id)
        code = api.exec_inspect(exec_id).get("ExitCode")
    return (-1 if code is None else int(code)), output


def _read_reward(sandbox: DockerSandbox) -> tuple[dict[str, bool], str | None]:
    """reward.json (dict of numbers: each key one verifier, >= 1 passes), else reward.txt (one verifier)."""
    raw = _read_optional(sandbox, "/logs/verifier/reward.json")
    if raw is not None:
        try:
            data = json.loads(raw)
        except ValueError as e:
            return {"reward": False}, f"reward.json is not JSON: {e}"
        if not isinstance(data, dict) or not data or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in data.values()):
            return {"reward": False}, f"reward.json: expected a non-empty dict of numbers, got {raw[:200]!r}"
        return {str(k): float(v) >= 1.0 for k, v in data.items()}, None
    raw = _read_optional(sandbox, "/logs/verifier/reward.txt")
    if raw is None:
        return {"reward": False}, "no reward file (/logs/verifier/reward.json or reward.txt)"
    try:
        return {"reward": float(raw.decode().strip()) >= 1.0}, None
    except ValueError:
        return {"reward": False}, f"reward.txt: expected one number, got {raw[:100]!r}"


def _read_optional(sandbox: DockerSandbox, path: str) -> bytes | None:
    try:
        return sandbox.read_file(path)
    except (FileNotFoundError, IsADirectoryError):
        return None


def _parse_junit(xml_bytes: bytes) -> dict[str, bool]:
    """JUnit XML (xunit1: file/classname/name) -> {'file.py::Class::name': passed}."""
    root = ET.fromstring(xml_bytes)
    per_test: dict[str, bool] = {}
    for case in root.iter("testcase"):
        file = case.get("file") or ""
        classname = case.get("classname") or ""
        name = case.get("name") or ""
        module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        cls = classname[len(module) + 1:] if module and classname.startswith(module + ".") else ""
        key = "::".join(p for p in (file or classname, cls, name) if p)
        ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
        per_test[key] = per_test.get(key, True) and ok
    return per_test


def _add_missing_static_ids(per_test: dict[str, bool], static_ids: tuple[str, ...]) -> None:
    """Count a test function found statically but absent from the results (its module failed to import) as
    failed. A parametrized one is present as its instances, 'test_x[a]', 'test_x[b]'."""
    instances = {test_id.split("[", 1)[0] for test_id in per_test}
    for test_id in static_ids:
        if test_id not in instances:
            per_test[test_id] = False


def _parse_progress(raw: bytes) -> dict[str, bool]:
    """The recorder's JSON lines: collected ids (all start failed), then each finished test's outcome."""
    per_test: dict[str, bool] = {}
    for line in raw.decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill at timeout
        if "collected" in rec:
            per_test.update({str(i): False for i in rec["collected"]})
        elif "id" in rec:
            per_test[str(rec["id"])] = bool(rec["passed"])
    return per_test


def _all_failed(task: Task, start: float, *, error: str, tampered: tuple[str, ...] = ()) -> VerifierResult:
    ids = task.static_test_ids or ("reward",)
    return VerifierResult(passed=0, failed=len(ids), total=len(ids), per_test={i: False for i in ids},
                          timed_out=False, error=error, tampered=tampered, duration_s=time.monotonic() - start)


# Runs inside the sandbox: pytest.main with a recorder plugin that appends JSON lines as results arrive.
_RUNNER = r'''
import json, os, sys
import pytest

# `python -m pytest`, as the harnesses run it from the task's working directory, puts that directory on sys.path:
# tests import the agent's modules by bare name (`from eigen import ...` with eigen.py in /app). -I leaves it
# out; it goes at the end, so nothing planted there shadows pytest, the standard library or an installed package.
sys.path.append(os.getcwd())

class Recorder:
    def __init__(self, path):
        self.f = open(path, "a", buffering=1)
        self.ok = {}

    def pytest_collection_finish(self, session):
        self.f.write(json.dumps({"collected": [i.nodeid for i in session.items]}) + "\n")

    def pytest_runtest_logreport(self, report):
        ok = self.ok.get(report.nodeid, True) and report.outcome == "passed"
        self.ok[report.nodeid] = ok
        if report.when == "teardown":
            self.f.write(json.dumps({"id": report.nodeid, "passed": ok}) + "\n")

# Guarded: a test that starts processes with the 'spawn' method (torch.multiprocessing.spawn) has each child
# import this file as __mp_main__, which must not run pytest again.
if __name__ == "__main__":
    sys.exit(int(pytest.main(sys.argv[2:], plugins=[Recorder(sys.argv[1])])))
'''

# The verifier's own files in its work directory (written by `_work_dir_script` or `_upload_work_dir`).
_WORK_FILES = {"runner.py": _RUNNER.encode(), "pytest.ini": b"[pytest]\n"}
_TB1_SCRIPT = "run-tests.sh"


def _work_files(task: Task) -> dict[str, bytes]:
    """The work directory's files: ours, plus a TB1 task's run-tests.sh when that is its verifier."""
    if task.verifier_kind == "script" and task.layout == "tb1" and task.test_script is not None:
        return {**_WORK_FILES, _TB1_SCRIPT: task.test_script.read_bytes()}
    return _WORK_FILES
