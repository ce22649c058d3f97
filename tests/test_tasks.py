"""Tasks, verifiers and the built-in suite, against a real Docker daemon.

Every reference solution must pass all its verifiers and doing nothing must pass fewer than half, on every
fixed task, the TB1 example and two seeds of every family. Spoofing attempts must score no more than doing
nothing. All sandbox runs go through a small thread pool: the daemon and 2 CPUs are the bottleneck.
"""

from __future__ import annotations

import ast
import dataclasses

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandbox.tasks import suite
from sandbox.daemon import LABEL_RUN, docker_client
from sandbox.runtime.docker_sandbox import DockerSandbox
from sandbox.runtime.settings import SandboxSettings
from sandbox.tasks.families import FAMILIES, SHORT_FAMILIES, generate, write_harbor_task
from sandbox.tasks.families.common import FILE_MTIME, TURN_BREAK
from sandbox.tasks.families.finish import CLEANUP, CLEANUP_TEST, DEMO_COMPLETE_RATE, SCRATCH_DIR
from sandbox.images.task_images import (TaskImageError, _preload_plan, _resolve_override, _tar, build_task_image,
                            build_task_images, default_base_image_overrides)
from sandbox.run_task import run_task
from sandbox.tasks.format import Task, TaskFormatError, load_task
from sandbox.runtime.verify import VerifierResult, run_verifiers

REPO = Path(__file__).resolve().parent.parent
RUN_ID = f"t1-test-tasks-{os.getpid()}"
NUM_WORKERS = 4


@pytest.fixture(scope="module")
def overrides() -> dict[str, str]:
    return default_base_image_overrides()


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def _all_tasks(family_dir: Path) -> list[Task]:
    fixed = suite.fixed_tasks("train") + suite.fixed_tasks("heldout") + [load_task(REPO / "tasks" / "tb1-example")]
    fam, _ = suite.heldout_tasks(family_dir, num_per_family=1, seed=0)
    return fixed + suite.family_tasks(family_dir, split="train", num_per_family=1, seed=0) + fam


def _run(task: Task, script: str | None, overrides: dict[str, str]) -> VerifierResult:
    return run_task(task, script=script, base_image_overrides=overrides, run_id=RUN_ID)


@pytest.fixture(scope="module")
def baseline(overrides: dict[str, str], family_dir: Path) -> dict[str, tuple[Task, VerifierResult, VerifierResult]]:
    """name -> (task, result after the reference solution, result after doing nothing)."""
    tasks = _all_tasks(family_dir)
    jobs = [(t, t.solution_script.read_text() if t.solution_script else "false") for t in tasks]
    jobs += [(t, None) for t in tasks]
    with ThreadPoolExecutor(NUM_WORKERS) as pool:
        results = list(pool.map(lambda job: _run(job[0], job[1], overrides), jobs))
    n = len(tasks)
    return {t.name: (t, results[i], results[n + i]) for i, t in enumerate(tasks)}


def test_suite_size_and_categories() -> None:
    tasks = suite.fixed_tasks("train") + suite.fixed_tasks("heldout")
    assert len(tasks) >= 24
    categories = {t.category for t in tasks}
    assert {"text", "files", "fix", "git", "python", "data", "processes", "permissions"} <= categories
    assert {t.category for t in suite.fixed_tasks("heldout")} >= categories - {"files"}
    assert all(t.layout == "harbor" and t.verifier_kind == "pytest" and t.num_static_tests >= 3 for t in tasks)
    assert all(t.solution_script is not None and t.test_script is not None for t in tasks)


@pytest.mark.docker
def test_reference_solutions_pass_every_verifier(baseline) -> None:
    bad = {name: (sol.passed, sol.total, sol.error, [k for k, ok in sol.per_test.items() if not ok])
           for name, (_, sol, _) in baseline.items() if not sol.outcome}
    assert not bad, bad
    assert all(sol.total >= max(3, task.num_static_tests) for task, sol, _ in baseline.values())


@pytest.mark.docker
def test_doing_nothing_passes_fewer_than_half(baseline) -> None:
    bad = {name: (noop.passed, noop.total) for name, (_, _, noop) in baseline.items()
           if not 2 * noop.passed < noop.total or noop.timed_out}
    assert not bad, bad
    # Dense reward has signal: the reference solution earns strictly more than doing nothing.
    assert all(sol.passed > noop.passed for _, sol, noop in baseline.values())


@pytest.mark.docker
def test_tb1_layout_loads_and_runs(baseline) -> None:
    task, sol, noop = baseline["tb1-example"]
    assert task.layout == "tb1" and task.agent_timeout_s == 180 and task.verifier_timeout_s == 30
    assert task.dockerfile_dir == task.path and task.test_script is not None
    assert "out_of_stock.txt" in task.instruction
    # test_tests_dir_env_points_here passes only when $TEST_DIR names the uploaded tests.
    assert sol.passed == sol.total == 4 and noop.per_test["test_outputs.py::test_tests_dir_env_points_here"]


# ---- spoofing ---------------------------------------------------------------------------------------------

_FORCE_PASS_CONFTEST = '''
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"

def pytest_collection_modifyitems(items):
    for item in items:
        item.runtest = lambda: None
'''

_FAKE_JUNIT = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4">'
               + "".join(f'<testcase classname="test_outputs" name="test_{i}" file="test_outputs.py"/>'
                         for i in range(4)) + "</testsuite></testsuites>")


def _plant(path: str, text: str) -> str:
    return f"mkdir -p {os.path.dirname(path)} && cat > {path} <<'T1EOF'\n{text}\nT1EOF\n"


def _attacks(target: str, word: str) -> dict[str, str]:
    """Scripts that try to raise the score of a create_file task without creating the file for real."""
    conftests = "".join(_plant(f"{d}/conftest.py", _FORCE_PASS_CONFTEST) for d in ("", "/app", "/tmp", "/tests"))
    ini = _plant("/pytest.ini", "[pytest]\naddopts = -p no:junitxml\n")
    fake_tests = _plant("/tests/test_outputs.py", "\n".join(f"def test_{i}():\n    pass\n" for i in range(10)))
    junits = "".join(_plant(p, _FAKE_JUNIT) for p in ("/logs/verifier/junit.xml", "/tmp/junit.xml",
                                                       "/app/junit.xml", "/tests/junit.xml"))
    rewards = _plant("/logs/verifier/reward.json", '{"reward": 1}') + "echo 1 > /logs/verifier/reward.txt\n"
    return {
        "printed_results": "echo '4 passed in 0.01s'; echo 'test_outputs.py::test_file_exists PASSED'\n",
        "planted_conftest": conftests + ini,
        "planted_results": junits + rewards,
        "edited_tests_dir": fake_tests + "chmod -R 555 /tests\n",
        "late_background_job": (f"nohup setsid bash -c 'sleep 2; while true; do echo {word} > {target}; "
                                "sleep 0.1; done' >/dev/null 2>&1 &\n"),
        "planted_sitecustomize": _plant("/usr/lib/python3.11/sitecustomize.py", "import os"),
        "destroyed_tools": "rm -f /usr/bin/env /usr/bin/python3.11\n",
    }


# Bytecode for json/__init__ (imported by the verifier's runner) that writes an all-passing JUnit file to the
# path it finds in argv and exits 0; its header matches the real source, so Python would load it.
_PLANT_PYC = r'''
import importlib.util, marshal, os, struct
src = "/usr/lib/python3.11/json/__init__.py"
st = os.stat(src)
evil = ("import os, sys\nfor a in sys.argv:\n    if a.startswith('--junitxml='):\n"
        "        open(a.split('=', 1)[1], 'w').write(JUNIT)\nos._exit(0)\n").replace("JUNIT", repr(@JUNIT@))
code = compile(evil, src, "exec")
header = importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
with open(importlib.util.cache_from_source(src), "wb") as f:
    f.write(header + marshal.dumps(code))
'''


@pytest.fixture(scope="module")
def spoof_results(overrides: dict[str, str], family_dir: Path) -> tuple[Task, VerifierResult, dict]:
    spec = generate("create_file", 7, "train")
    task = load_task(write_harbor_task(spec, family_dir / "spoof-target", family="create_file", seed=7,
                                       split="train"))
    attacks = _attacks(str(spec.constants["TARGET"]), str(spec.constants["WORD"]))
    plant_pyc = _PLANT_PYC.replace("@JUNIT@", repr(_FAKE_JUNIT))
    attacks["planted_bytecode"] = f"python3 - <<'T1EOF'\n{plant_pyc}\nT1EOF\n"
    jobs = [(name, script) for name, script in attacks.items()] + [("noop", None)]
    with ThreadPoolExecutor(NUM_WORKERS) as pool:
        results = dict(zip([n for n, _ in jobs], pool.map(lambda j: _run(task, j[1], overrides), jobs)))
    return task, results.pop("noop"), results


@pytest.mark.docker
@pytest.mark.parametrize("attack", ["printed_results", "planted_conftest", "planted_results", "edited_tests_dir",
                                    "late_background_job", "planted_bytecode"])
def test_spoofing_scores_no_more_than_doing_nothing(spoof_results, attack: str) -> None:
    task, noop, results = spoof_results
    result = results[attack]
    assert result.total == noop.total == task.num_static_tests
    assert result.passed == noop.passed and result.per_test == noop.per_test, (result.error, result.output[-800:])


@pytest.mark.docker
def test_tampering_with_python_scores_zero(spoof_results) -> None:
    _, noop, results = spoof_results
    planted, destroyed = results["planted_sitecustomize"], results["destroyed_tools"]
    assert planted.passed == destroyed.passed == 0 and planted.total == destroyed.total == noop.total
    # Debian's /usr/lib/python3.11/sitecustomize.py links to /etc/python3.11/: the write lands there.
    assert [p for p in planted.tampered if p.endswith("/sitecustomize.py")] and "tampered" in planted.error
    assert destroyed.tampered == ("/usr/bin/env", "/usr/bin/python3.11")


_SITE = "/usr/local/lib/python3.11/dist-packages"
_LIB = "/usr/lib/x86_64-linux-gnu"
# Changes for the two tamper-check sources to judge alike: the overlay2 upper directory read here, and the
# daemon's `docker diff`. Every case runs in its own container; "app" changes are the agent's normal work.
_CHANGE_SCRIPTS = {
    "app": "echo x > /app/new.txt; mkdir -p /app/d/e; touch /app/d/f; rm -rf /app/d/e",
    "pyc": "mkdir -p /usr/lib/python3.11/json/__pycache__ && touch /usr/lib/python3.11/json/__pycache__/x.pyc",
    "sitecustomize": "echo 'import os' > /usr/lib/python3.11/sitecustomize.py",
    "deleted_tools": "rm -f /usr/bin/env /usr/bin/python3.11",
    "deleted_lib_dir": "rm -rf /usr/lib/x86_64-linux-gnu/gconv",
    "replaced_dir": "rm -rf /etc/python3.11 && mkdir /etc/python3.11",
    "renamed_dir": "mv /usr/lib/python3.11/json /tmp/json",
    "renamed_back": "mv /usr/lib/python3.11/json /tmp/json && mv /tmp/json /usr/lib/python3.11/",
    "chmod_tool": "chmod 700 /usr/bin/timeout",
    "symlinked_pytest": "ln -sf /bin/true /usr/local/bin/pytest",
    "metadata_only": "touch /usr/lib/python3.11/os.py",
    # site-packages: the agent's packages may come and go; what the verifier's pytest loads, and .pth files, not.
    "site_package": f"mkdir -p {_SITE}/mylib {_SITE}/__pycache__ && echo X=1 > {_SITE}/mylib/__init__.py && "
                    f"touch {_SITE}/__pycache__/six.cpython-311.pyc /usr/lib/python3/dist-packages/mylib2.py "
                    "/usr/local/bin/python-grpc-tools-protoc",
    "site_pth": f"mkdir -p {_SITE}/_distutils_hack && echo 'import os' > {_SITE}/zzz.pth && "
                f"touch {_SITE}/_distutils_hack/__init__.py",
    # A new site directory (an apt-installed python3-* package makes /usr/lib/python3.11/dist-packages) is not
    # tampering; deleting the one that holds Debian's pytest is.
    "new_site_dir": "mkdir /usr/lib/python3.11/dist-packages && touch /usr/lib/python3.11/dist-packages/m.py",
    "deleted_site_dir": "rm -rf /usr/lib/python3/dist-packages",
    "site_pytest_shadow": f"mkdir -p {_SITE}/pytest && touch {_SITE}/pytest/__init__.py",
    "site_verifier_bytecode": f"mkdir -p {_SITE}/__pycache__ && touch {_SITE}/__pycache__/py.cpython-311.pyc",
    # Shared libraries: what an apt install does (new files, a new directory, ldconfig rewriting the loader cache)
    # is not tampering; a new file shadowing a library name, or a cache that resolves a name elsewhere, is.
    "new_libraries": f"touch {_LIB}/libt1new.so.1 && mkdir {_LIB}/t1plugins && touch {_LIB}/t1plugins/p.so && "
                     "ldconfig",
    "shadowing_library": f"mkdir -p /usr/lib64 && cp -L {_LIB}/libz.so.1 /usr/lib64/libz.so.1",
    "repointed_cache": f"cp -L {_LIB}/libz.so.1 /usr/local/lib/libz.so.1 && ldconfig",
    "hwcaps_library": f"mkdir -p {_LIB}/glibc-hwcaps/x86-64-v2 && cp -L {_LIB}/libz.so.1 {_LIB}/glibc-hwcaps/x86-64-v2/",
    "python_dev": "mkdir /usr/lib/python3.11/config-3.11-x86_64-linux-gnu && touch "
                  "/usr/lib/python3.11/config-3.11-x86_64-linux-gnu/Makefile && echo /opt/l > /etc/ld.so.conf.d/l.conf",
    "stdlib_shadow": "touch /usr/lib/python3.11/pluggy.py",
    # A library none of the verifier's programs loads may change or go (a solution reinstalling apt); one they load
    # (python's zlib module needs libz), or glibc's (libc loads NSS modules by name), may not.
    "unused_library": f"echo >> {_LIB}/libapt-pkg.so.6.0.0 && rm {_LIB}/libapt-private.so.0.0.0",
    "used_library": f"echo >> {_LIB}/libz.so.1.2.13",
    "glibc_library": f"echo >> {_LIB}/libnss_files.so.2",
    "remade_dir_same": f"cp -a {_LIB}/sasl2 /tmp/s && rm -rf {_LIB}/sasl2 && cp -a /tmp/s {_LIB}/sasl2",
    "remade_dir_short": f"cp -a {_LIB}/sasl2 /tmp/s && rm -rf {_LIB}/sasl2 && cp -a /tmp/s {_LIB}/sasl2 && "
                        f"rm -f $(ls -d {_LIB}/sasl2/* | head -1)",
}


@pytest.mark.docker
def test_upper_dir_and_docker_diff_judge_changes_alike(overrides: dict[str, str]) -> None:
    from sandbox.runtime.verify import _inspect_changes, _upper_dir_changes

    def judge(script: str) -> tuple[tuple[list[str], bool], tuple[list[str], bool], list[str]]:
        with DockerSandbox(overrides["debian:*"], run_id=RUN_ID) as sb:
            assert sb.run(script, timeout=30).exit_code == 0, script
            info = docker_client().inspect_container(sb.id)
            assert _upper_dir_changes(info) is not None  # the fast path is the one under test here
            return (_inspect_changes(sb, info), _inspect_changes(sb, {**info, "GraphDriver": {}}),
                    _inspect_changes(sb, info, pth_files="allow")[0])

    with ThreadPoolExecutor(NUM_WORKERS) as pool:
        results = dict(zip(_CHANGE_SCRIPTS, pool.map(judge, _CHANGE_SCRIPTS.values())))
    allowing_pth = {name: allowed for name, (_, _, allowed) in results.items()}
    results = {name: (upper, diff) for name, (upper, diff, _) in results.items()}
    # pth_files='allow' accepts the .pth and the module setuptools' .pth imports, and nothing else.
    assert allowing_pth.pop("site_pth") == []
    assert allowing_pth == {name: upper[0] for name, (upper, _) in results.items() if name != "site_pth"}
    for name, (upper, diff) in results.items():
        if name == "renamed_back":  # the same tree again: docker diff compares equal, the upper dir holds a copy
            assert "/usr/lib/python3.11/json/__init__.py" in upper[0], (upper, diff)  # stricter, never laxer
            continue
        if name in ("new_libraries", "python_dev", "unused_library"):  # the image's files are read only on the upper-dir route: docker diff's stays
            assert upper[0] == [] and diff[0], (upper, diff)  # strict (remote daemons), never laxer
            continue
        # The paths may differ (a replaced directory: docker diff names what it held, the upper dir the
        # directory itself); the verdicts may not.
        assert bool(upper[0]) == bool(diff[0]) and upper[1] == diff[1], (name, upper, diff)
    assert results["app"][0] == ([], False) and results["pyc"][0] == ([], True)
    assert results["site_package"][0] == ([], False) and results["site_verifier_bytecode"][0] == ([], True)
    assert results["site_pth"][0][0] == [f"{_SITE}/_distutils_hack/__init__.py", f"{_SITE}/zzz.pth"]
    assert results["new_site_dir"][0] == ([], False)
    assert results["deleted_site_dir"][0][0] == ["/usr/lib/python3/dist-packages"]
    assert results["site_pytest_shadow"][0][0] == [f"{_SITE}/pytest/__init__.py"]
    assert results["deleted_tools"][0][0] == ["/usr/bin/env", "/usr/bin/python3.11"]
    assert results["deleted_lib_dir"][0][0] == ["/usr/lib/x86_64-linux-gnu/gconv"]
    assert results["shadowing_library"][0][0] == ["/usr/lib64/libz.so.1"]
    assert results["repointed_cache"][0][0] == ["/etc/ld.so.cache"]
    assert results["hwcaps_library"][0][0] and results["remade_dir_short"][0][0]
    assert results["remade_dir_same"][0] == ([], False)
    assert results["stdlib_shadow"][0][0] == ["/usr/lib/python3.11/pluggy.py"]
    assert results["unused_library"][0] == ([], False)
    assert results["used_library"][0][0] == [f"{_LIB}/libz.so.1.2.13"]
    assert results["glibc_library"][0][0] == [f"{_LIB}/libnss_files.so.2"]
    for name in ("sitecustomize", "replaced_dir", "renamed_dir", "chmod_tool", "symlinked_pytest", "metadata_only"):
        assert results[name][0][0], name


@pytest.mark.docker
def test_verifier_modules_cover_what_a_pytest_run_loads_from_site_packages(overrides: dict[str, str]) -> None:
    """The site-packages modules left to the agent must not include one the verifier's own run imports."""
    from sandbox.images.protected import VERIFIER_MODULES

    probe = ("import sys, pytest\nopen('/tmp/t/test_a.py', 'w').write('def test_a():\\n    assert True\\n')\n"
             "rc = pytest.main(['/tmp/t', '-q', '-p', 'no:cacheprovider', '--junitxml=/tmp/j.xml'])\n"
             "site = [p for p in sys.path if p.endswith('-packages')]\n"
             "print(rc, sorted({m.split('.')[0] for m, mod in list(sys.modules.items())\n"
             "                  if any((getattr(mod, '__file__', None) or '').startswith(s) for s in site)}))\n")
    with DockerSandbox(overrides["debian:*"], run_id=RUN_ID) as sb:
        sb.write_file("/tmp/probe.py", probe.encode())
        r = sb.run("mkdir -p /tmp/t && /usr/bin/python3 -I -B /tmp/probe.py | tail -1", timeout=60)
    rc, loaded = r.output.strip().split(" ", 1)
    assert rc == "0" and "pytest" in loaded, r.output
    assert set(ast.literal_eval(loaded)) <= VERIFIER_MODULES, loaded


@pytest.mark.docker
def test_poisoned_shell_cannot_run_code_at_verification(overrides: dict[str, str], spoof_results) -> None:
    """Functions shadowing tools and the runtime's sweep, and traps, in the agent's persistent shell."""
    task, noop, _ = spoof_results
    spec = generate("create_file", 7, "train")
    write = f"echo {spec.constants['WORD']} > {spec.constants['TARGET']}"
    with DockerSandbox(build_task_image(task, base_image_overrides=overrides), SandboxSettings(workdir=task.workdir),
                       run_id=RUN_ID) as sb:
        for cmd in ["rm() { :; }; mkdir() { :; }; ln() { :; }; /usr/bin/env() { :; }; __t1_sweep() { return 0; }",
                    f"trap '[[ $BASH_COMMAND == *__t1_sweep* ]] && {write}' DEBUG",
                    "sleep 300 &",
                    f"trap '{write}' CHLD"]:  # last: fires when the verifier kills `sleep 300` under a live shell
            assert sb.run(cmd, timeout=10).exit_code == 0
        result = run_verifiers(sb, task)
        left = [p[-1] for p in docker_client().top(sb.id)["Processes"]]
    assert result.per_test == noop.per_test and result.passed == noop.passed, result.output[-800:]
    assert not [c for c in left if "docker-init" not in c and c != "sleep infinity"], left


# ---- timeouts and script verifiers --------------------------------------------------------------------------

def _harbor_task(root: Path, name: str, *, tests: dict[str, str], verifier_timeout: float = 30,
                 dockerfile: str = "FROM debian:bookworm\nWORKDIR /app\n") -> Task:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text(f"[verifier]\ntimeout_sec = {verifier_timeout}\n")
    (d / "instruction.md").write_text("Do the thing.\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in tests.items():
        (d / "tests" / rel).write_text(textwrap.dedent(text))
    return load_task(d)



_SERVER = ("import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
           "s.bind(('127.0.0.1', 8765))\ns.listen()\nwhile True:\n    c, _ = s.accept()\n    c.sendall(b'hello')\n"
           "    c.close()\n")


@pytest.mark.docker
def test_kept_agent_processes_serve_the_tests_then_die(tmp_path: Path, overrides: dict[str, str]) -> None:
    """agent_processes='keep' (Terminal-Bench's and Harbor's harnesses): a server the agent left answers the
    tests, and no agent process outlives the verification; 'kill' (the default): the same server is gone."""
    task = _harbor_task(tmp_path, "server", tests={"test_server.py": """
        import socket

        def test_server_answers():
            with socket.create_connection(("127.0.0.1", 8765), timeout=5) as s:
                assert s.recv(5) == b"hello"
        """})
    image = build_task_image(task, base_image_overrides=overrides)
    scores, left = {}, {}
    for mode in ("keep", "kill"):
        with DockerSandbox(image, SandboxSettings(workdir=task.workdir), run_id=RUN_ID) as sb:
            sb.write_file("/srv.py", _SERVER.encode())
            assert sb.run("nohup python3 /srv.py >/dev/null 2>&1 & for i in $(seq 50); do "
                          "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8765))' "
                          "2>/dev/null && exit 0; sleep 0.1; done; exit 1", timeout=30).exit_code == 0
            scores[mode] = run_verifiers(sb, task, agent_processes=mode).per_test
            left[mode] = [p[-1] for p in docker_client().top(sb.id)["Processes"]]
    assert scores == {"keep": {"test_server.py::test_server_answers": True},
                      "kill": {"test_server.py::test_server_answers": False}}, scores
    for mode, procs in left.items():
        assert not [c for c in procs if "docker-init" not in c and c != "sleep infinity"], (mode, procs)
    with pytest.raises(ValueError, match="agent_processes"):
        run_verifiers(None, task, agent_processes="spare")  # type: ignore[arg-type]



def test_harness_options_scale_the_time_limits_and_name_bad_values(tmp_path: Path) -> None:
    from sandbox.run_task import Harness

    task = _harbor_task(tmp_path, "limits", verifier_timeout=30, tests={"test_a.py": "def test_a():\n    pass\n"})
    slow = Harness(timeout_multiplier=2.5).apply(task)
    assert (slow.agent_timeout_s, slow.verifier_timeout_s, slow.build_timeout_s) == (
        task.agent_timeout_s * 2.5, 75.0, task.build_timeout_s * 2.5)
    assert Harness().apply(task) is task
    for bad, said in (({"timeout_multiplier": 0.0}, "timeout_multiplier: expected a finite number > 0, got 0.0"),
                      ({"timeout_multiplier": float("inf")}, "timeout_multiplier"),
                      ({"agent_processes": "spare"}, "agent_processes: expected one of ('kill', 'keep')"),
                      ({"network": "open"}, "network: expected one of ('asked', 'harness')"),
                      ({"pth_files": "ignore"}, "pth_files: expected one of ('tamper', 'allow')")):
        with pytest.raises(ValueError, match=re.escape(said)):
            Harness(**bad)
    with pytest.raises(ValueError, match="pth_files"):
        run_verifiers(None, task, pth_files="ignore")  # type: ignore[arg-type]

@pytest.mark.docker
def test_freeze_stops_every_agent_process_and_thaw_resumes_them(overrides: dict[str, str]) -> None:
    """What 'keep' does around the tamper check: the agent's processes (a child, a shell and its child) are
    stopped, not killed, and run again afterwards; init and the container's keepalive are never stopped."""
    from sandbox.runtime.verify import _PATH, _exec

    def states(script: str) -> dict[str, str]:
        """command line -> state letter of every process but this exec's own."""
        code, out = _exec(sb, script + '; for p in /proc/[1-9]*; do [[ ${p#/proc/} == $$ ]] && continue; '
                          'read -r st 2>/dev/null < "$p/stat" || continue; st=${st##*") "}; '
                          'echo "${st:0:1} $(tr "\\\\0" " " < "$p/cmdline")"; done', env={"PATH": _PATH})
        assert code == 0, out
        return {line[2:].strip(): line[0] for line in out.decode().splitlines() if line[1:2] == " "}

    with DockerSandbox(overrides["debian:*"], run_id=RUN_ID) as sb:
        assert sb.run("sleep 301 & bash -c 'sleep 302 & wait' &", timeout=10).exit_code == 0
        frozen = states("freeze")
        thawed = states("thaw")
    agent = {c for c in frozen if c.startswith(("sleep 30", "bash -c sleep 302"))}
    assert agent == {"sleep 301", "sleep 302", "bash -c sleep 302 & wait"}, frozen
    assert {frozen[c] for c in agent} == {"T"} and {thawed[c] for c in agent} == {"S"}, (frozen, thawed)
    assert frozen["sleep infinity"] != "T" and thawed["sleep infinity"] != "T", frozen

@pytest.mark.docker
def test_hanging_verifier_is_cut_and_unfinished_tests_fail(tmp_path: Path, overrides: dict[str, str]) -> None:
    task = _harbor_task(tmp_path, "hangs", verifier_timeout=3, tests={"test_hang.py": """
        import subprocess
        import time

        def test_fast():
            assert True

        def test_hangs():
            subprocess.Popen(["bash", "-c", "trap '' TERM INT; sleep 600"])
            time.sleep(600)

        def test_after():
            assert True
        """})
    result = _run(task, None, overrides)
    assert result.timed_out and result.total == 3 and result.passed == 1
    assert result.per_test == {"test_hang.py::test_fast": True, "test_hang.py::test_hangs": False,
                               "test_hang.py::test_after": False}
    assert result.duration_s < 3 + 5 + 20  # timeout + kill grace + verifier overhead on a loaded machine


@pytest.mark.docker
def test_parametrized_tests_count_as_their_instances(tmp_path: Path, overrides: dict[str, str]) -> None:
    """A parametrized test function is its instances (not one more failed test under its bare name)."""
    task = _harbor_task(tmp_path, "params", tests={"test_p.py": """
        import pytest

        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_small(n):
            assert n < 3

        def test_plain():
            assert True
        """})
    result = _run(task, None, overrides)
    assert result.per_test == {"test_p.py::test_small[1]": True, "test_p.py::test_small[2]": True,
                               "test_p.py::test_small[3]": False, "test_p.py::test_plain": True}, result.output[-800:]


@pytest.mark.docker
def test_tests_import_the_agents_modules_from_the_working_directory(tmp_path: Path,
                                                                     overrides: dict[str, str]) -> None:
    """As under `python -m pytest` from the task's working directory, the tests import a module the agent wrote
    there by bare name; modules planted there under the names of pytest and the standard library change nothing
    (the directory is searched last)."""
    task = _harbor_task(tmp_path, "import-cwd", tests={"test_mod.py": """
        import os
        os.chdir("/app")
        from helper import answer

        def test_answer():
            assert answer() == 42

        def test_fails():
            assert answer() == 0
        """})
    helper = _plant("/app/helper.py", "def answer():\n    return 42")
    # Each would end the run before any result is written: pytest and json are imported before the directory joins
    # sys.path, faulthandler and xml (pytest's own plugins import them) after it; org, msvcrt, nt and _winapi are
    # the names the standard library tries and misses on Linux (measured: all while pytest is imported, before).
    stop = "import os\nos._exit(0)"
    planted = "".join(_plant(f"/app/{name}", stop) for name in ("pytest.py", "json.py", "faulthandler.py",
                                                                 "xml/__init__.py", "org.py", "msvcrt.py", "nt.py",
                                                                 "_winapi.py"))
    result = _run(task, helper + planted, overrides)
    assert result.per_test == {"test_mod.py::test_answer": True, "test_mod.py::test_fails": False}, \
        (result.error, result.output[-800:])
    missing = _run(task, None, overrides)  # nothing written: the import fails and so do both tests
    assert missing.passed == 0 and not any(missing.per_test[t] for t in result.per_test), missing.per_test
    assert "'helper'" in (missing.error or ""), missing.error


@pytest.mark.docker
def test_tests_may_start_processes_with_spawn(tmp_path: Path, overrides: dict[str, str]) -> None:
    """A test whose workers start by 'spawn' (torch.multiprocessing.spawn in TB2's torch-*-parallelism): each
    child imports the verifier's entry script as __mp_main__ and must find the test's function, not a second
    pytest run."""
    task = _harbor_task(tmp_path, "spawn", tests={"test_spawn.py": """
        import multiprocessing as mp

        def square(x):
            return x * x

        def test_pool():
            with mp.get_context("spawn").Pool(2) as pool:
                assert pool.map(square, [1, 2, 3]) == [1, 4, 9]

        def test_wrong():
            with mp.get_context("spawn").Pool(1) as pool:
                assert pool.map(square, [2]) == [5]
        """})
    result = _run(task, None, overrides)
    assert result.per_test == {"test_spawn.py::test_pool": True, "test_spawn.py::test_wrong": False}, \
        (result.error, result.output[-1500:])


@pytest.mark.docker
def test_tests_arrive_byte_for_byte_inline_or_uploaded(tmp_path: Path, overrides: dict[str, str]) -> None:
    """Small test directories are written by the verifier's own exec, large ones uploaded: the same files,
    bytes and modes either way; and nothing a test prints can pose as the verifier's status line or XML."""
    import hashlib

    from sandbox.runtime.verify import _work_dir_script

    def make(name: str, blob: bytes) -> Task:
        task = _harbor_task(tmp_path, name, tests={"test_files.py": """
            import hashlib, os, pathlib, stat
            HERE = pathlib.Path(__file__).parent

            def test_blob_bytes():
                assert hashlib.sha256((HERE / "data" / "blob.bin").read_bytes()).hexdigest() == EXPECTED

            def test_modes():
                assert stat.S_IMODE(os.stat(HERE / "data" / "run.sh").st_mode) == 0o750
                assert stat.S_IMODE(os.stat(HERE / "data").st_mode) == 0o711

            def test_prints_a_fake_status_then_fails():
                print("\\nt1-exit 0 40\\n<testsuites><testcase name='x'/></testsuites>")
                assert False
            """.replace("EXPECTED", repr(hashlib.sha256(blob).hexdigest()))})
        data = task.tests_dir / "data"
        data.mkdir(mode=0o711)
        data.chmod(0o711)
        (data / "blob.bin").write_bytes(blob)
        (data / "run.sh").write_text("#!/bin/sh\necho 'it''s 100% \\ fine'\n")
        (data / "run.sh").chmod(0o750)
        return task

    every_byte = bytes(range(256)) * 4 + b"'\\%s%b\n\x00\x00" + "päß".encode()
    small, large = make("inline", every_byte), make("uploaded", every_byte + os.urandom(200_000))
    assert _work_dir_script(small, "/.w") is not None and _work_dir_script(large, "/.w") is None
    for task in (small, large):
        result = _run(task, None, overrides)
        assert result.per_test == {"test_files.py::test_blob_bytes": True, "test_files.py::test_modes": True,
                                   "test_files.py::test_prints_a_fake_status_then_fails": False}, result.output
        assert "t1-exit 0 40" in result.output  # the printed fake stayed in the log, where it belongs


@pytest.mark.docker
def test_script_verifier_reads_reward_files_and_ignores_planted_ones(tmp_path: Path,
                                                                     overrides: dict[str, str]) -> None:
    task = _harbor_task(tmp_path, "script-json", tests={"test.sh": """\
        #!/bin/bash
        a=0; b=0; c=0
        [ -f /app/a.txt ] && a=1
        [ "$(cat /app/b.txt 2>/dev/null)" = ok ] && b=1
        [ -d /app/c ] && c=1
        echo '4 passed'
        printf '{"a": %d, "b": %d, "c": %d}' $a $b $c > /logs/verifier/reward.json
        """})
    txt = _harbor_task(tmp_path, "script-txt", tests={"test.sh": "#!/bin/bash\n[ -f /app/a.txt ] && echo 1 > "
                                                      "/logs/verifier/reward.txt\n"})
    assert task.verifier_kind == "script" and task.num_static_tests == 0
    plant = ('mkdir -p /logs/verifier && echo \'{"a": 1, "b": 1, "c": 1}\' > /logs/verifier/reward.json && '
             'echo 1 > /logs/verifier/reward.txt && chmod -R 555 /logs/verifier')
    jobs = [(task, "touch /app/a.txt; echo ok > /app/b.txt; mkdir /app/c"), (task, "touch /app/a.txt"),
            (task, plant), (txt, "touch /app/a.txt"), (txt, plant)]
    with ThreadPoolExecutor(NUM_WORKERS) as pool:
        full, partial, planted, txt_ok, txt_planted = pool.map(lambda j: _run(j[0], j[1], overrides), jobs)
    assert (full.passed, full.total, full.outcome) == (3, 3, True)
    assert (partial.passed, partial.total) == (1, 3) and partial.per_test == {"a": True, "b": False, "c": False}
    assert (planted.passed, planted.total) == (0, 3)
    assert (txt_ok.passed, txt_ok.total, txt_ok.error) == (1, 1, None)
    assert (txt_planted.passed, txt_planted.total) == (0, 1) and "no reward file" in txt_planted.error


# ---- task format and images -------------------------------------------------------------------------------

def _broken_copy(tmp_path: Path, name: str, src: str = "fixed/python-primes") -> Path:
    d = tmp_path / name
    shutil.copytree(REPO / "tasks" / src, d)
    return d


def test_malformed_tasks_name_file_and_field(tmp_path: Path) -> None:
    cases = []
    d = _broken_copy(tmp_path, "no-instruction")
    (d / "instruction.md").unlink()
    cases.append((d, "instruction.md", "instruction"))
    d = _broken_copy(tmp_path, "bad-toml")
    (d / "task.toml").write_text("[agent\ntimeout_sec = 1\n")
    cases.append((d, "task.toml", "toml"))
    d = _broken_copy(tmp_path, "bad-cpus")
    (d / "task.toml").write_text('[environment]\ncpus = "two"\n')
    cases.append((d, "task.toml", "environment.cpus"))
    d = _broken_copy(tmp_path, "bad-timeout")
    (d / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n")
    cases.append((d, "task.toml", "verifier.timeout_sec"))
    d = _broken_copy(tmp_path, "no-tests")
    shutil.rmtree(d / "tests")
    cases.append((d, "tests", "tests"))
    d = _broken_copy(tmp_path, "empty-tests")
    for p in (d / "tests").iterdir():
        p.unlink()
    cases.append((d, "tests", "tests"))
    d = _broken_copy(tmp_path, "syntax-error")
    (d / "tests" / "test_outputs.py").write_text("def test_x(:\n")
    cases.append((d, "test_outputs.py", "tests"))
    d = _broken_copy(tmp_path, "no-dockerfile")
    (d / "environment" / "Dockerfile").unlink()
    cases.append((d, "Dockerfile", "environment"))
    d = _broken_copy(tmp_path, "tb1-no-instruction", "tb1-example")
    (d / "task.yaml").write_text("difficulty: easy\nmax_agent_timeout_sec: 10\n")
    cases.append((d, "task.yaml", "instruction"))
    d = tmp_path / "nothing"
    d.mkdir()
    cases.append((d, "task.toml", "file"))
    for path, file, field in cases:
        with pytest.raises(TaskFormatError) as info:
            load_task(path)
        assert info.value.file.name == file and info.value.field == field, (path.name, str(info.value))
        assert file in str(info.value) and repr(field) in str(info.value)


@pytest.mark.docker
def test_missing_base_image_is_a_clear_error(tmp_path: Path) -> None:
    task = _harbor_task(tmp_path, "no-base", tests={"test_x.py": "def test_a():\n    pass\n"},
                        dockerfile="FROM ghcr.io/nobody/t1-no-such-image:1.0\nRUN true\n")
    with pytest.raises(TaskImageError, match=r"Dockerfile: FROM ghcr.io/nobody/t1-no-such-image:1.0: image not "
                                              r"present locally .*--base-image"):
        build_task_image(task, base_image_overrides={"debian:*": "unused"})


def test_override_globs() -> None:
    table = {"debian:*": "base-a", "ubuntu:*": "base-b", "python:3.1*": "base-c"}
    assert _resolve_override("ubuntu:22.04", table) == "base-b"
    assert _resolve_override("docker.io/library/debian:bookworm-slim", table) == "base-a"
    assert _resolve_override("python:3.13-slim", table) == "base-c"
    assert _resolve_override("python:2.7", table) == "python:2.7"
    assert _resolve_override("ghcr.io/x/debian:1", table) == "ghcr.io/x/debian:1"


@pytest.mark.docker
def test_images_cached_by_content(tmp_path: Path, overrides: dict[str, str]) -> None:
    task = load_task(_broken_copy(tmp_path, "cache-a", "fixed/text-dedupe-emails"))
    same = load_task(_broken_copy(tmp_path, "cache-b", "fixed/text-dedupe-emails"))
    refs = build_task_images([task, same], base_image_overrides=overrides, preload=False)
    ref = refs[task.name]
    assert refs[same.name] == ref and not ref.preload  # same content, other directory
    (same.dockerfile_dir / "emails.txt").write_text("x@y.z\n")
    changed = build_task_image(same, base_image_overrides=overrides, preload=False)
    assert changed != ref and changed.ref.startswith("t1-task:")
    bare = _harbor_task(tmp_path, "bare", tests={"test_x.py": "def test_a():\n    pass\n"},
                        dockerfile="FROM debian:bookworm\nWORKDIR /app\n")
    assert build_task_image(bare, base_image_overrides=overrides).ref == overrides["debian:*"]


_COPY_ONLY = """FROM debian:bookworm
# a comment, then every COPY form a preload reproduces
COPY app/ /app/
COPY ["notes.txt", "/opt/t1/notes-renamed.txt"]
COPY run.sh notes.txt /opt/t1/bin/
WORKDIR /app
COPY sub conf/
LABEL purpose=test
"""
_LISTING = ("find /app /opt/t1 -printf '%p %y %m %u:%g %s %l\\n' | sort; "
            "find /app /opt/t1 -type f -printf '%p %T@\\n' | sort; "  # files keep their mtime; new dirs do not
            "find /app /opt/t1 -type f -print0 | sort -z | xargs -0 sha256sum")


def _copy_context(root: Path, dockerfile: str) -> Task:
    task = _harbor_task(root, "copy-only", tests={"test_x.py": "def test_a():\n    pass\n"}, dockerfile=dockerfile)
    env = task.dockerfile_dir
    for rel, text, mode in [("app/data/a.csv", "x,y\n1,2\n", 0o640), ("app/tool.sh", "echo hi\n", 0o755),
                            ("app/.hidden", "h\n", 0o600), ("notes.txt", "n\n", 0o644), ("run.sh", "true\n", 0o700),
                            ("sub/deep/x.txt", "x\n", 0o604)]:
        (env / rel).parent.mkdir(parents=True, exist_ok=True)
        (env / rel).write_text(text)
        (env / rel).chmod(mode)
    (env / "app" / "data").chmod(0o750)
    (env / "app" / "link").symlink_to("tool.sh")
    (env / "app" / "unique.txt").write_text(str(root))  # a context no earlier run built (built images are cached)
    for path in env.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.utime(path, (1_700_000_000, 1_700_000_000 + len(path.name)))
    return task


@pytest.mark.docker
def test_copy_only_dockerfile_is_preloaded_exactly_as_docker_build_copies(tmp_path: Path,
                                                                          overrides: dict[str, str]) -> None:
    """No image is built, and the sandbox sees what `docker build` would have put there: paths, kinds, modes,
    owners, sizes, link targets and contents."""
    task = _copy_context(tmp_path, _COPY_ONLY)
    preloaded = build_task_image(task, base_image_overrides=overrides)
    built = build_task_image(task, base_image_overrides=overrides, preload=False)
    assert preloaded.ref == overrides["debian:*"] and preloaded.preload
    assert built.ref.startswith("t1-task:") and not built.preload
    listings = []
    try:
        for image in (preloaded, built):
            with DockerSandbox(image, SandboxSettings(workdir=task.workdir), run_id=RUN_ID) as sb:
                r = sb.run(_LISTING, timeout=30)
                assert r.exit_code == 0, r.output
                listings.append(r.output)
    finally:
        docker_client().remove_image(built.ref, force=True)
    assert "/opt/t1/bin/run.sh f 700 root:root" in listings[1] and "/app/conf/deep/x.txt" in listings[1]
    assert "/app/tool.sh 1700000007" in listings[1]
    assert listings[0] == listings[1]


# Everything a stat shows (times to the nanosecond, access time included), listed before anything reads the files.
_STRICT_LISTING = "find /app /opt -printf '%p %y %m %u:%g %s %l %T@ %A@\\n' | sort"


@pytest.mark.docker
def test_preload_written_into_the_upper_dir_equals_the_daemons_archive(tmp_path: Path, overrides: dict[str, str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path (files written into the created container's overlay2 upper directory) and the daemon's
    archive API leave the same tree: paths, kinds, modes, owners, sizes, link targets, mtimes and atimes."""
    import sandbox.runtime.preload as preload

    task = _copy_context(tmp_path, _COPY_ONLY)
    image = build_task_image(task, base_image_overrides=overrides)
    assert preload.direct_plan(image.preload) is not None
    listings = {}
    for via in ("upper_dir", "archive"):
        if via == "archive":
            monkeypatch.setattr(preload, "upper_dir", lambda api, container_id: None)
        with DockerSandbox(image, SandboxSettings(workdir=task.workdir), run_id=RUN_ID) as sb:
            assert sb.preloaded_via == via
            r = sb.run(_STRICT_LISTING + "; " + _LISTING, timeout=30)
            assert r.exit_code == 0, r.output
            listings[via] = r.output
    assert "/app/link l 777 root:root" in listings["archive"] and "/app/conf/deep/x.txt" in listings["archive"]
    assert listings["upper_dir"] == listings["archive"]


def _tar_of(*entries: tuple[str, str]) -> bytes:
    """A tar of (name, kind) entries, kind one of dir, file, sym (to "x"), hard (to the first entry)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind in entries:
            info = tarfile.TarInfo(name)
            info.type = {"dir": tarfile.DIRTYPE, "file": tarfile.REGTYPE, "sym": tarfile.SYMTYPE,
                         "hard": tarfile.LNKTYPE}[kind]
            info.linkname = {"sym": "x", "hard": entries[0][0]}.get(kind, "")
            tar.addfile(info, io.BytesIO(b"") if kind == "file" else None)
    return buf.getvalue()


@pytest.mark.parametrize("entries,direct", [
    ([("app", "dir"), ("app/a", "file"), ("app/l", "sym")], True),
    ([("app", "dir"), ("app", "dir"), ("app/a", "file"), ("app/a", "file")], True),  # listed twice: last wins
    ([("app/a", "file")], False),                                          # its parent is not in the tar
    ([("app", "dir"), ("app/l", "sym"), ("app/l/a", "file")], False),      # through a symlink: followed on the host
    ([("app", "file"), ("app", "dir")], False),                            # a file replaced by a directory
    ([("app", "dir"), ("app", "file")], False),                            # a directory replaced by a file
    ([("app", "dir"), ("app/../etc", "dir")], False),
    ([("/etc", "dir")], False),
    ([("app", "dir"), ("app/a", "file"), ("app/b", "hard")], False),
])
def test_only_tars_built_from_their_own_directories_skip_the_archive_api(entries: list, direct: bool) -> None:
    import sandbox.runtime.preload as preload

    assert (preload.direct_plan(_tar_of(*entries)) is not None) == direct


@pytest.mark.docker
def test_preloaded_sandboxes_look_the_same_whenever_they_start(tmp_path: Path, overrides: dict[str, str]) -> None:
    """Directories the preload creates (WORKDIR, COPY destinations) do not carry the container's start time."""
    copying = _copy_context(tmp_path, _COPY_ONLY)
    bare = _harbor_task(tmp_path, "workdir-only", tests={"test_x.py": "def test_a():\n    pass\n"},
                        dockerfile="FROM debian:bookworm\nWORKDIR /srv/t1/work\n")
    for task in (copying, bare):
        image = build_task_image(task, base_image_overrides=overrides)
        assert image.ref == overrides["debian:*"] and image.preload, task.name
        listings = []
        for _ in range(2):
            with DockerSandbox(image, SandboxSettings(workdir=task.workdir), run_id=RUN_ID) as sb:
                r = sb.run("find /app /opt/t1 /srv -printf '%p %m %T@\\n' 2>/dev/null | sort; pwd", timeout=30)
                listings.append(r.output)
            time.sleep(1.1)  # the next container starts in another second
        assert listings[0] == listings[1], task.name
        assert task.workdir in listings[0]


@pytest.mark.docker
def test_base_listing_container_carries_owner_labels(tmp_path: Path, overrides: dict[str, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The one container build_task_image starts itself (listing the base's directories) is reapable."""
    from docker.models.containers import ContainerCollection

    import sandbox.images.task_images as images

    seen, real_run = [], ContainerCollection.run

    def spy(self, *args, **kwargs):  # the real call, recorded
        seen.append(kwargs.get("labels", {}))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(ContainerCollection, "run", spy)
    monkeypatch.setattr(images, "_BASE_FACTS", {})
    image = build_task_image(_copy_context(tmp_path, _COPY_ONLY), base_image_overrides=overrides)
    assert image.preload and len(seen) == 1
    assert seen[0][LABEL_RUN] and seen[0]["t1.owner_pid"] == str(os.getpid())


@pytest.mark.docker
@pytest.mark.parametrize("dockerfile", [
    "FROM debian:bookworm\nCOPY app/ /app/\nRUN true\n",             # a RUN step
    "FROM debian:bookworm\nCOPY --chown=1000:1000 app/ /app/\n",            # a flag
    "FROM debian:bookworm\nCOPY app/*.sh /app/\n",                    # a wildcard
    "FROM debian:bookworm\nCOPY notes.txt rel/\n",                    # relative to the base image's WORKDIR
    "FROM debian:bookworm\nENV A=1\nCOPY app/ /app/\n",              # the image's config changes
    "FROM debian:bookworm\nCOPY app/ \\\n  /app/\n",                 # a continuation line
    "FROM debian:bookworm\nCOPY notes.txt /usr/lib/python3/dist-packages/_pytest/\n",  # the verifier's pytest
])
def test_dockerfiles_a_preload_cannot_reproduce_are_built(tmp_path: Path, overrides: dict[str, str],
                                                           dockerfile: str) -> None:
    task = _copy_context(tmp_path, dockerfile)
    image = build_task_image(task, base_image_overrides=overrides)
    assert image.ref.startswith("t1-task:") and not image.preload


@pytest.mark.docker
def test_cli_runs_a_task_and_reports_json(tmp_path: Path, overrides: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "sandbox.run_task", str(REPO / "tasks" / "tb1-example"), "--solution", "--json",
           "--base-image", f"python:3.13-*={overrides['debian:*']}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["passed"], report["failed"], report["total"], report["timed_out"]) == (4, 0, 4, False)
    assert all(report["per_test"].values()) and report["outcome"] is True
    script = tmp_path / "half.sh"
    script.write_text("echo nuts > /app/out_of_stock.txt\n")
    out = subprocess.run([*cmd[:4], "--script", str(script)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0 and "PASS  test_outputs.py::test_output_exists" in out.stdout
    assert "passed 3/4" in out.stdout, out.stdout
    broken = tmp_path / "broken"
    broken.mkdir()
    out = subprocess.run([sys.executable, "-m", "sandbox.run_task", str(broken)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 2 and "task.toml" in out.stderr and not out.stdout


# ---- suite and families (no Docker) -----------------------------------------------------------------------

def test_fixed_split_is_disjoint_and_complete() -> None:
    train, heldout = suite.fixed_task_names("train"), suite.fixed_task_names("heldout")
    on_disk = {p.name for p in suite.FIXED_DIR.iterdir() if p.is_dir()}
    assert not set(train) & set(heldout) and set(train) | set(heldout) == on_disk and len(heldout) >= 7


def test_families_are_deterministic_and_splits_share_one_distribution(tmp_path: Path) -> None:
    for family in FAMILIES:
        assert generate(family, 3, "train") == generate(family, 3, "train")
        train = {generate(family, s, "train").instruction for s in range(40)}
        assert len(train) >= 30, family  # seeds really vary the instance
    # Held-out names are not marked by any feature the training names lack (an earlier parity split was):
    # the numbers in the names of both splits take odd and even values alike.
    for split in ("train", "heldout"):
        digits = [int(m) for s in range(200) for m in re.findall(r"[a-z](\d+)\b",
                                                                  generate("create_file", s, split).instruction)]
        odd = sum(d % 2 for d in digits) / len(digits)
        assert 0.35 < odd < 0.65, (split, odd)
    a = suite.train_tasks(tmp_path / "a", num_per_family=2, seed=1, include_fixed=False)
    b, _ = suite.heldout_tasks(tmp_path / "b", num_per_family=2, seed=1, avoid=a)
    assert len(a) == len(b) == 2 * len(FAMILIES)
    assert not {t.instruction for t in a} & {t.instruction for t in b}
    again = suite.train_tasks(tmp_path / "a", num_per_family=2, seed=1, include_fixed=False)
    assert [t.instruction for t in again] == [t.instruction for t in a]


def test_family_instances_preload_the_same_bytes_whenever_written(tmp_path: Path) -> None:
    """What the agent sees (`ls -l` included) must not depend on when an instance was written."""
    first = suite.family_tasks(tmp_path / "a", split="train", num_per_family=1, seed=3)
    again = suite.family_tasks(tmp_path / "b", split="train", num_per_family=1, seed=3)
    shipping = 0
    def archive(task: Task) -> bytes | None:
        plan = _preload_plan(task.dockerfile.read_text(), task.dockerfile_dir, {})
        assert plan is not None, task.name
        return _tar(*plan, existing_dirs={}, dir_mtime=7)

    for a, b in zip(first, again, strict=True):
        blob = archive(a)
        assert blob is not None and blob == archive(b), a.name
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            members = tar.getmembers()
        assert [(m.name, m.mtime, m.mode) for m in members if m.isdir() and m.name == "app"] == [("app", 7, 0o755)]
        assert all(m.mtime == FILE_MTIME and m.uid == 0 for m in members if m.name != "app"), a.name
        shipping += len(members) > 1
    assert shipping >= len(FAMILIES) // 2


def test_heldout_instances_never_repeat_a_training_instruction(tmp_path: Path) -> None:
    # count_lines seeds 100000.. of the held-out stream include an exact repeat of one of the first 24 training
    # instances (found by search; this is what `avoid` exists for).
    train = suite.family_tasks(tmp_path / "t", split="train", num_per_family=24, seed=0, families=["count_lines"])
    seen = {t.instruction for t in train}
    naive = [generate("count_lines", 100_000 + i, "heldout").instruction.strip() for i in range(50)]
    assert any(i in seen for i in naive)
    held, _ = suite.heldout_tasks(tmp_path / "h", num_per_family=50, seed=1, families=["count_lines"], avoid=train)
    assert len(held) == 50 and not seen & {t.instruction for t in held}
    assert len({t.instruction for t in held}) == 50
    again, _ = suite.heldout_tasks(tmp_path / "h", num_per_family=50, seed=1, families=["count_lines"], avoid=train)
    assert [t.instruction for t in again] == [t.instruction for t in held]


def test_short_families_are_one_command_with_arguments_in_the_instruction() -> None:
    for family in SHORT_FAMILIES:
        for seed in range(20):
            spec = generate(family, seed, "train")
            assert "\n" not in spec.solution and len(spec.instruction) < 140, (family, spec.instruction)
            main, cleanup = spec.solution.split("; ")  # the main command, then the finishing step
            assert cleanup == CLEANUP and SCRATCH_DIR in spec.instruction
            args = [a.strip("'") for a in main.split()[1:]
                    if a not in (">", ">>", "<", "+x") and not a.startswith("-")]
            args = [re.sub(r"^s/(\w+)/(\w+)/g$", r"\1 \2", a) for a in args]
            for arg in " ".join(args).split():
                assert arg.lstrip(".") in spec.instruction, (family, arg, spec.instruction)


def test_every_instance_asks_for_the_finishing_step_and_about_half_the_demonstrations_skip_it(tmp_path: Path) -> None:
    skipped = 0
    for family in FAMILIES:
        for seed in range(40):
            spec = generate(family, seed, "train")
            assert spec.instruction.endswith(f"Then remove the directory {SCRATCH_DIR}.")
            assert spec.solution.endswith(f"; {CLEANUP}") and any(p.startswith(SCRATCH_DIR + "/") for p in spec.files)
            if spec.demonstration is not None:  # the full reference's calls, the step cut off the last one
                skipped += 1
                assert spec.demonstration_fails == (CLEANUP_TEST,)
                assert [*spec.demonstration[:-1], f"{spec.demonstration[-1]}; {CLEANUP}"] == list(spec.turns)
    share = skipped / (40 * len(FAMILIES))
    assert abs(share - (1 - DEMO_COMPLETE_RATE)) < 0.08, share
    # The demonstration travels with the task directory; a complete one is the reference itself.
    tasks = suite.family_tasks(tmp_path, split="train", num_per_family=6, seed=0, families=["copy_file", "fix_script"])
    kinds = set()
    for task in tasks:
        family, _, seed = task.name.split("-")
        spec = generate(family, int(seed), "train")
        turns, fails = suite.demonstration_turns(task)
        assert suite.reference_turns(task) == list(spec.turns)
        assert (turns, fails) == ((list(spec.demonstration), spec.demonstration_fails) if spec.demonstration
                                  else (list(spec.turns), ()))
        kinds.add(bool(fails))
    assert kinds == {True, False}
    with pytest.raises(ValueError, match="demonstration_fails"):
        dataclasses.replace(spec, demonstration=spec.turns, demonstration_fails=("test_nonexistent",))


def test_reference_solution_for_sft(tmp_path: Path) -> None:
    (task,) = suite.family_tasks(tmp_path, split="train", num_per_family=1, seed=0, families=["create_file"])
    assert suite.reference_turns(task) == [suite.reference_solution(task)] == [generate("create_file", 0, "train").solution]
    fixed = suite.fixed_tasks("train")[0]
    assert suite.reference_turns(fixed) == [suite.reference_solution(fixed)] and suite.reference_solution(fixed).count("\n") >= 1
    # A two-turn reference: solve.sh runs both parts as one script; SFT gets one tool call per part.
    (csv,) = suite.family_tasks(tmp_path, split="train", num_per_family=1, seed=0, families=["csv_column_sum"])
    spec = generate("csv_column_sum", 0, "train")
    assert suite.reference_turns(csv) == list(spec.turns) == [*spec.inspect, spec.solution] and len(spec.turns) == 2
    assert suite.reference_solution(csv) == "\n".join(spec.turns)
    for body in (f"true\n{TURN_BREAK}\n", f"{TURN_BREAK}\ntrue\n"):  # an empty turn is an error, not a blank call
        csv.solution_script.write_text(f"#!/usr/bin/env bash\n{body}")
        with pytest.raises(ValueError, match="empty turn"):
            suite.reference_turns(csv)


@pytest.mark.docker
def test_no_containers_left_behind(baseline, spoof_results) -> None:
    left = docker_client().containers(all=True, filters={"label": f"{LABEL_RUN}={RUN_ID}"})
    assert not left, [c["Names"] for c in left]


def test_generated_instances_carry_their_family(tmp_path: Path) -> None:
    """The family comes from the instance's task.toml ([metadata] family), not from parsing its name; a task
    without one is its own family."""
    fam = suite.family_tasks(tmp_path, split="train", num_per_family=2, seed=0, families=["create_file", "grep_lines"])
    assert [t.family for t in fam] == ["create_file", "create_file", "grep_lines", "grep_lines"]
    fixed = suite.fixed_tasks("train")[0]
    assert fixed.family == "" and fixed.family_name == fixed.name
