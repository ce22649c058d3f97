"""Terminal-Bench 1 and Harbor task formats as their own harnesses read them, against a real Docker daemon.

Each fixture task is written here (never copied from a public collection) in one real variant: solution.yaml,
a compose build context in a subfolder, WORKDIR inherited from a mapped Terminal-Bench base, tests with
relative paths, `COPY file /existing-dir`, `memory = "4G"`, a solution folder with a helper, `pip install`
in RUN, a test script that installs a package. The reference for each is what Docker or the harness does:
the container's own cgroup limit, the daemon's build, the files the image really holds.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import docker
import pytest

from sandbox.check_tasks import check_tasks, summary
from sandbox.images.docker_build import clean_text
from sandbox.runtime.settings import SandboxSettings
from sandbox.daemon import LABEL_RUN, docker_client
from sandbox.runtime.docker_sandbox import DockerSandbox
from sandbox.images.image_cache import LABEL_KIND, LABEL_TASK, prune_task_images
from sandbox.images.task_images import TaskImageError, _preload_plan, build_task_image, default_base_image_overrides
from sandbox.run_task import run_task_report
from sandbox.tasks.format import TaskFormatError, load_task, reference_solution
from sandbox.tasks.test_deps import parse_test_deps, setup_steps

REPO = Path(__file__).resolve().parent.parent
RUN_ID = f"t1-test-tb-formats-{os.getpid()}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        if rel.endswith(".sh"):
            path.chmod(0o755)
    return root


def _tb1(root: Path, name: str, files: dict[str, str]) -> Path:
    return _write(root / name, {"task.yaml": "instruction: Do the thing.\nmax_test_timeout_sec: 60\n", **files})


def _harbor(root: Path, name: str, toml: str, files: dict[str, str]) -> Path:
    return _write(root / name, {"task.toml": toml, "instruction.md": "Do the thing.\n", **files})


@pytest.fixture(scope="module")
def overrides() -> dict[str, str]:
    # The layer that trusts this host's CA bundle: `pip install` in a build reaches PyPI through it here.
    return default_base_image_overrides(trust_host_ca=True)


@pytest.mark.docker
def test_base_has_python_and_pip_and_the_ca_layer_is_built_once(overrides: dict[str, str]) -> None:
    from sandbox.images.base_image import ensure_base_image, host_ca_bundle

    ca_ref = overrides["debian:*"]
    assert ensure_base_image(trust_host_ca=True) == ca_ref  # found, not rebuilt
    with DockerSandbox(ca_ref, SandboxSettings(network=False), run_id=RUN_ID) as sb:
        # Dockerfiles written for Ubuntu bases link /usr/bin/python themselves: that must still work.
        r = sb.run("python --version && ls /usr/lib/python3*/EXTERNALLY-MANAGED; ln -s /usr/bin/python3 "
                   "/usr/bin/python && echo linked; grep -c 'BEGIN CERTIFICATE' /etc/ssl/certs/ca-certificates.crt",
                   timeout=30)
    lines = r.output.splitlines()
    assert lines[0].startswith("Python 3.") and "No such file" in r.output and "linked" in lines, r.output
    host = host_ca_bundle().read_text().count("BEGIN CERTIFICATE")
    assert int(lines[-1]) >= host, (lines[-1], host)  # every host certificate is in the image's bundle


# ---- formats read without Docker ----------------------------------------------------------------------------

def test_test_dependencies_read_from_uv_uvx_pip_and_apt() -> None:
    deps = parse_test_deps(textwrap.dedent("""
        #!/bin/bash
        apt-get update && apt-get install -y curl jq
        curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
        source $HOME/.local/bin/env
        uv init
        uv add pytest==8.4.1 pandas==2.2.3 requests
        uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 \\
          --with numpy,scipy pytest /tests/test_outputs.py -rA
        python3 -m pip install --no-cache-dir -i https://example.org/simple lxml  # trailing comment
        pip install -r requirements.txt
        """))
    assert deps.pip == ("pandas==2.2.3", "requests", "numpy", "scipy", "lxml")
    assert deps.apt == ("jq",)
    assert deps.unreadable == ("pip install -r requirements.txt",)
    assert not parse_test_deps("pytest $TEST_DIR/test_outputs.py -rA\n")
    # A pin assigned in the script is read into the package (TB2 sam-cell-seg's COMMIT_HASH); one set outside it
    # leaves the package unreadable, never installed under a literal '$' name.
    deps = parse_test_deps("COMMIT='34bb'\nuvx -w 'git+https://example.org/x.git@${COMMIT}' -w pkg==$VER "
                           "pytest /tests\napt-get install -y $EXTRA jq\n")
    assert deps.pip == ("git+https://example.org/x.git@34bb",) and deps.apt == ("jq",)
    assert deps.unreadable == ("pkg==$VER", "$EXTRA")


def test_harbor_resources_sizes_network_and_unknown_keys(tmp_path: Path) -> None:
    base = {"environment/Dockerfile": "FROM debian:bookworm\n", "tests/test_x.py": "def test_a():\n    pass\n"}
    toml = """
        [environment]
        memory = "4G"
        storage = "10G"
        allow_internet = false
        build_timeout_sec = 90
        shiny = 1
        [verifier]
        env = { GREETING = "hi" }
        [sparkles]
        """
    with pytest.warns(UserWarning, match=r"unknown keys ignored: sparkles, environment\.shiny"):
        task = load_task(_harbor(tmp_path, "sizes", toml, base))
    assert (task.memory_mb, task.storage_mb, task.network, task.build_timeout_s) == (4096, 10240, False, 90.0)
    assert task.verifier_env == (("GREETING", "hi"),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task = load_task(_harbor(tmp_path, "mb", "[environment]\nmemory_mb = 3000\nstorage_mb = 512\n", base))
    assert (task.memory_mb, task.storage_mb, task.network) == (3000, 512, False)  # no network unless asked
    assert load_task(_harbor(tmp_path, "half", '[environment]\nmemory = "512M"\n', base)).memory_mb == 512
    assert load_task(_harbor(tmp_path, "net", "[environment]\nallow_internet = true\n", base)).network
    with pytest.raises(TaskFormatError, match=r"environment\.memory.*'lots'"):
        load_task(_harbor(tmp_path, "bad", '[environment]\nmemory = "lots"\n', base))


def test_workdir_is_what_docker_would_use(tmp_path: Path) -> None:
    tests = {"tests/test_x.py": "def test_a():\n    pass\n"}
    cases = {"FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\n": "/app",
             "FROM python:3.13-slim\n": "/",
             "FROM ubuntu:24.04\nWORKDIR /srv\nWORKDIR data\n": "/srv/data",
             "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest AS build\nWORKDIR src\n": "/app/src"}
    for i, (dockerfile, workdir) in enumerate(cases.items()):
        task = load_task(_tb1(tmp_path, f"w{i}", {"Dockerfile": dockerfile, **tests}))
        assert task.workdir == workdir, dockerfile


def test_solution_yaml_becomes_its_commands_in_order(tmp_path: Path) -> None:
    d = _tb1(tmp_path, "yaml-solution", {
        "Dockerfile": "FROM debian:bookworm\n", "tests/test_x.py": "def test_a():\n    pass\n",
        "solution.yaml": """
            - command: "echo one > /tmp/a"
              min_timeout_sec: 0.1
              block: true
              append_enter: true
            - command: |
                cat > /tmp/b <<'EOF'
                two
                EOF
            """})
    task = load_task(d)
    assert task.solution_script == d / "solution.yaml"
    assert reference_solution(task) == "echo one > /tmp/a\ncat > /tmp/b <<'EOF'\ntwo\nEOF\n"
    (d / "solution.yaml").write_text("- shell: ls\n")
    with pytest.raises(TaskFormatError, match=r"\[0\]\.command"):
        reference_solution(load_task(d))


def test_copy_of_a_file_onto_a_directory_goes_inside_it(tmp_path: Path) -> None:
    """Docker's rule: a file COPY'd onto an existing directory (the base's, or one WORKDIR made) lands in it."""
    ctx = _write(tmp_path, {"trunc.db": "x", "notes.txt": "y"})
    plan = _preload_plan("FROM b\nWORKDIR /app\nCOPY trunc.db /app\nCOPY notes.txt /opt\nCOPY notes.txt /new\n",
                         ctx, {"/opt": (0o755, 0, 0, 0.0)})
    assert plan is not None
    assert sorted(dest for _, dest in plan[0]) == ["/app/trunc.db", "/new", "/opt/notes.txt"]


def test_ansi_and_carriage_returns_are_cleaned() -> None:
    assert clean_text("\x1b[31mred\x1b[0m ok\nprogress 10%\rprogress 100%\r\n") == "red ok\nprogress 100%\n"


def test_compose_agent_without_a_build_says_what_it_needs(tmp_path: Path) -> None:
    """(Services beside the agent's: tests/test_compose.py.)"""
    tests = {"tests/test_x.py": "def test_a():\n    pass\n"}
    d = _tb1(tmp_path, "prebuilt", {"docker-compose.yaml": "services:\n  client:\n    image: someorg/thing:1\n",
                                    **tests})
    with pytest.raises(TaskFormatError, match="prebuilt image 'someorg/thing:1'"):
        load_task(d)


# ---- fixture tasks on the daemon ------------------------------------------------------------------------------

@pytest.mark.docker
def test_tb1_compose_context_inherited_workdir_relative_tests_and_solution_yaml(tmp_path: Path,
                                                                              overrides: dict[str, str]) -> None:
    """TB1: the build context is the compose file's subfolder; the Dockerfile never sets WORKDIR, so /app comes
    from Terminal-Bench's base (COPY ./ and RUN bash /app/... must land there); the tests call ./run.sh and
    read result.txt relative to the working directory; the solution is a solution.yaml."""
    d = _tb1(tmp_path, "compose-workdir", {
        "docker-compose.yaml": """
            services:
              client:
                build:
                  context: client
                  dockerfile: Dockerfile
                image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
                command: ["sh", "-c", "sleep infinity"]
            """,
        "client/Dockerfile": """
            FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620
            COPY setup.sh ./
            RUN bash /app/setup.sh
            """,
        "client/setup.sh": "printf '#!/bin/bash\\necho 42 > result.txt\\n' > run.sh && chmod +x run.sh\n",
        "solution.yaml": "- command: ./run.sh\n",
        "tests/test_outputs.py": """
            import os
            import subprocess

            def test_runs_from_the_workdir():
                assert os.getcwd() == "/app"
                subprocess.run(["./run.sh"], check=True)

            def test_result():
                assert open("result.txt").read().strip() == "42"
            """})
    task = load_task(d)
    assert task.dockerfile_dir == d / "client" and task.workdir == "/app"
    result, ran = run_task_report(task, script=reference_solution(task), base_image_overrides=overrides,
                                  run_id=RUN_ID)
    assert ran is not None and ran.exit_code == 0, ran
    assert (result.passed, result.total) == (2, 2), result.output


@pytest.mark.docker
def test_harbor_memory_solution_folder_and_copy_onto_a_directory(tmp_path: Path,
                                                                 overrides: dict[str, str]) -> None:
    """memory = "4G" is the container's cgroup limit; solve.sh uses a helper beside it in /solution and the
    [solution] env; `COPY file /app` (an existing directory) puts the file inside /app, preloaded or built
    alike."""
    toml = '[environment]\nmemory = "4G"\nallow_internet = false\n[solution]\nenv = { SHOUT = "1" }\n'
    d = _harbor(tmp_path, "memory-helper", toml, {
        "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\nCOPY data.txt /app\nCOPY data.txt /opt\n",
        "environment/data.txt": "seven\n",
        "solution/solve.sh": "#!/bin/bash\nset -e\npython3 /solution/helper.py > /app/out.txt\n",
        "solution/helper.py": "import os\n"
                              "print(open('/app/data.txt').read().strip().upper() * int(os.environ['SHOUT']))\n",
        "tests/test_outputs.py": """
            from pathlib import Path

            def test_memory_limit_is_4g():
                v1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
                limit = v1 if v1.exists() else Path("/sys/fs/cgroup/memory.max")
                assert int(limit.read_text()) == 4 << 30

            def test_copied_files_inside_directories():
                assert Path("/app").is_dir() and Path("/opt/data.txt").read_text() == "seven\\n"

            def test_output():
                assert Path("/app/out.txt").read_text() == "SEVEN\\n"
            """})
    task = load_task(d)
    image = build_task_image(task, base_image_overrides=overrides)
    assert image.preload, "a FROM + WORKDIR + COPY Dockerfile is preloaded"
    result, ran = run_task_report(task, script=reference_solution(task), base_image_overrides=overrides,
                                  run_id=RUN_ID, upload_solution=True)
    assert ran is not None and ran.exit_code == 0 and result.outcome, (ran, result.per_test, result.output)
    built = build_task_image(task, base_image_overrides=overrides, preload=False)
    for img in (image, built):
        with DockerSandbox(img, SandboxSettings(workdir=task.workdir), run_id=RUN_ID) as sb:
            r = sb.run("stat -c '%F %n' /app /app/data.txt /opt/data.txt", timeout=30)
        assert r.output.splitlines() == ["directory /app", "regular file /app/data.txt",
                                        "regular file /opt/data.txt"], (img, r.output)


HARBOR_TEST_SH = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
if [ "$PWD" = "/" ]; then
    echo "Error: No working directory set."
    exit 1
fi
if [ -f /app/stale ]; then rm /app/stale; fi
cp /tests/fixture.txt /app/fixture.txt
cat > /app/notes.txt << 'EOF'
  kept as written, pytest and all
EOF
uvx -p 3.13 -w pytest==8.4.1 pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
cp /tests/never.txt /app/
"""


def test_fixtures_named_test_are_not_tests(tmp_path: Path) -> None:
    """TB1 chem-property-targeting has `@pytest.fixture def test_data()`: pytest collects no test from it."""
    from sandbox.tasks.format import static_test_ids

    f = tmp_path / "test_f.py"
    f.write_text("import pytest\nfrom pytest import fixture\n\n@pytest.fixture\ndef test_data():\n    return 1\n\n"
                 "@fixture(scope='module')\ndef test_other():\n    return 2\n\n"
                 "@pytest.mark.slow\ndef test_real(test_data):\n    assert test_data\n\n"
                 "class TestX:\n    @pytest.fixture\n    def test_inner(self):\n        return 3\n\n"
                 "    def test_method(self):\n        pass\n")
    assert static_test_ids(f, tmp_path) == ["test_f.py::test_real", "test_f.py::TestX::test_method"]


def test_setup_steps_are_what_the_test_script_does_besides_the_harness() -> None:
    assert setup_steps(HARBOR_TEST_SH) == ("cp /tests/fixture.txt /app/fixture.txt\n"
                                           "cat > /app/notes.txt << 'EOF'\n  kept as written, pytest and all\nEOF")
    assert setup_steps("#!/bin/bash\nuv run pytest $TEST_DIR/test_outputs.py -rA\n") == ""


@pytest.mark.docker
def test_test_script_setup_runs_before_the_tests(tmp_path: Path, overrides: dict[str, str]) -> None:
    """Harbor's test.sh copies a fixture into /app that the tests read (TB2's cancel-async-tasks does)."""
    d = _harbor(tmp_path, "with-setup", "", {
        "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n", "tests/test.sh": HARBOR_TEST_SH,
        "tests/fixture.txt": "seven\n",
        "tests/test_outputs.py": "from pathlib import Path\n\ndef test_fixture():\n"
                                 "    assert Path('fixture.txt').read_text() == 'seven\\n'\n\n"
                                 "def test_notes():\n"
                                 "    assert 'pytest and all' in Path('/app/notes.txt').read_text()\n"})
    result, _ = run_task_report(load_task(d), base_image_overrides=overrides, run_id=RUN_ID)
    assert result.outcome and result.total == 2, result.output[-800:]


@pytest.mark.docker
def test_pip_in_run_python_command_and_test_dependencies(tmp_path: Path, overrides: dict[str, str]) -> None:
    """A python:* Dockerfile that pip-installs in RUN and calls `python` builds on the base; the package that
    run-tests.sh adds for the tests is baked in; one that cannot be installed is named by the verifier."""
    files = {
        "Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\nRUN pip install --no-cache-dir six==1.16.0 && "
                      "python -c 'import six'\n",
        "run-tests.sh": "#!/bin/bash\ncurl -LsSf https://astral.sh/uv/install.sh | sh\nuv init\n"
                        "uv add pytest==8.4.1 {dep}\nuv run pytest $TEST_DIR/test_outputs.py -rA\n",
        "tests/test_outputs.py": """
            import six
            import {module}

            def test_imports():
                assert six.PY3 and {module}
            """}
    ok = load_task(_tb1(tmp_path, "deps-ok", {k: v.format(dep="termcolor==2.4.0", module="termcolor")
                                             for k, v in files.items()}))
    assert ok.test_deps.pip == ("termcolor==2.4.0",)
    result, _ = run_task_report(ok, base_image_overrides=overrides, run_id=RUN_ID)
    assert result.outcome and result.error is None, result.output
    missing = load_task(_tb1(tmp_path, "deps-missing", {
        k: v.format(dep="t1-no-such-package-e7c1", module="t1_no_such_package_e7c1") for k, v in files.items()}))
    with pytest.warns(UserWarning, match="installing the test dependencies t1-no-such-package-e7c1"):
        result, _ = run_task_report(missing, base_image_overrides=overrides, run_id=RUN_ID)
    assert result.passed == 0 and "module 't1_no_such_package_e7c1'" in (result.error or ""), result


@pytest.mark.docker
def test_tb1_graded_by_run_tests_exit_status(tmp_path: Path, overrides: dict[str, str]) -> None:
    """No tests/test_*.py and the pytest parser: run-tests.sh's exit status is the one verifier (adapters print
    their summary line from it); other parsers are refused with a reason."""
    files = {"Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n", "tests/expected.txt": "ok\n",
             "run-tests.sh": "#!/bin/bash\ncd /app\ncmp out.txt \"$TEST_DIR/expected.txt\" && echo 'PASSED t' || "
                             "{ echo 'FAILED t'; exit 1; }\n",
             "solution.sh": "echo ok > /app/out.txt\n"}
    task = load_task(_tb1(tmp_path, "exit-status", files))
    assert task.verifier_kind == "script"
    solved, _ = run_task_report(task, script=reference_solution(task), base_image_overrides=overrides, run_id=RUN_ID)
    nothing, _ = run_task_report(task, base_image_overrides=overrides, run_id=RUN_ID)
    assert (solved.passed, solved.total, nothing.passed, nothing.total) == (1, 1, 0, 1), (solved, nothing)
    d = _tb1(tmp_path, "swebench", {**files, "task.yaml": "instruction: x\nparser_name: swebench\n"})
    with pytest.raises(TaskFormatError, match="parser 'swebench'"):
        load_task(d)
    # TB1's SWE-bench tasks: run-tests.sh patches a test into the repository and runs pytest on it; their tests/ is
    # absent, or holds a test_outputs.py without test functions.
    repo = {"Dockerfile": "FROM debian:bookworm\nWORKDIR /app\nRUN mkdir -p /app/repo/pkg && "
                          "printf 'def double(x):\\n    return x + x + 1\\n' > /app/repo/pkg/__init__.py\n",
            "run-tests.sh": "#!/bin/bash\ncd /app/repo\nprintf 'from pkg import double\\ndef test_double():\\n"
                            "    assert double(3) == 6\\n' > test_patch.py\npython3 -m pytest -rA test_patch.py\n",
            "solution.sh": "sed -i 's/ + 1$//' /app/repo/pkg/__init__.py\n"}
    for name, extra in (("no-tests-dir", {}), ("placeholder", {"tests/test_outputs.py": "# run by run-tests.sh\npass\n"})):
        task = load_task(_tb1(tmp_path, name, {**repo, **extra}))
        assert task.verifier_kind == "script" and task.static_test_ids == (), name
        solved, _ = run_task_report(task, script=reference_solution(task), base_image_overrides=overrides,
                                    run_id=RUN_ID)
        nothing, _ = run_task_report(task, base_image_overrides=overrides, run_id=RUN_ID)
        assert (solved.passed, solved.total, nothing.passed, nothing.total) == (1, 1, 0, 1), (name, solved, nothing)


@pytest.mark.docker
def test_build_failure_is_clean_and_leaves_no_images(tmp_path: Path, overrides: dict[str, str]) -> None:
    marker = secrets.token_hex(6)
    d = _harbor(tmp_path, "fails", "", {
        "environment/Dockerfile": f"FROM debian:bookworm\nRUN echo {marker} > /m\n"
                                  "RUN printf '\\033[31mthe real cause\\033[0m\\n'; exit 3\n",
        "tests/test_x.py": "def test_a():\n    pass\n"})
    with pytest.raises(TaskImageError) as info:
        build_task_image(load_task(d), base_image_overrides=overrides)
    message = str(info.value)
    assert "\x1b" not in message and "\n  | the real cause\n" in message, message
    assert re.search(r"at step 3/\d+ \(RUN printf", message), message
    assert "returned a non-zero code: 3" in message, message
    client = docker_client()
    leftovers = [i["Id"] for i in client.images(all=True)
                 if marker in json.dumps(client.inspect_image(i["Id"]).get("ContainerConfig") or {})]
    assert not leftovers


@pytest.mark.docker
def test_build_timeout_stops_the_build(tmp_path: Path, overrides: dict[str, str]) -> None:
    marker = secrets.token_hex(6)
    d = _harbor(tmp_path, "slow", "[environment]\nbuild_timeout_sec = 3\n", {
        "environment/Dockerfile": f"FROM debian:bookworm\nRUN sleep 300 # {marker}\n",
        "tests/test_x.py": "def test_a():\n    pass\n"})
    t0 = time.monotonic()
    with pytest.raises(TaskImageError, match="did not finish within 3 s"):
        build_task_image(load_task(d), base_image_overrides=overrides)
    assert time.monotonic() - t0 < 60
    client = docker_client()
    deadline = time.monotonic() + 30  # the daemon stops the build's container once the CLI is gone
    while time.monotonic() < deadline:
        running = [c for c in client.containers() if marker in str(c.get("Command"))]
        if not running:
            break
        time.sleep(0.5)
    assert not running


@pytest.mark.docker
def test_copy_from_a_registry_image_is_explained(tmp_path: Path, overrides: dict[str, str]) -> None:
    d = _harbor(tmp_path, "copy-from", "", {
        "environment/Dockerfile": "FROM debian:bookworm\nCOPY --from=ghcr.io/astral-sh/uv:0.5.0 /uv /bin/\n",
        "tests/test_x.py": "def test_a():\n    pass\n"})
    with pytest.raises(TaskImageError, match=r"Dockerfile:2: COPY --from=ghcr.io/astral-sh/uv:0.5.0 .*docker load"):
        build_task_image(load_task(d), base_image_overrides=overrides)


@pytest.mark.docker
def test_task_images_are_labelled_and_pruned(tmp_path: Path, overrides: dict[str, str]) -> None:
    name = f"labelled-{secrets.token_hex(4)}"
    d = _harbor(tmp_path, name, "", {"environment/Dockerfile": f"FROM debian:bookworm\nRUN echo {name} > /n\n",
                                     "tests/test_x.py": "def test_a():\n    pass\n"})
    image = build_task_image(load_task(d), base_image_overrides=overrides)
    client = docker.from_env()
    labels = client.images.get(image.ref).labels
    assert (labels[LABEL_KIND], labels[LABEL_TASK]) == ("task-image", name)
    assert prune_task_images(keep=0, min_idle_s=3600, task=name, client=client) == []  # just used: kept
    assert prune_task_images(keep=0, min_idle_s=0, task=name, client=client) == [image.ref]
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(image.ref)


@pytest.mark.docker
def test_cli_json_on_failure_and_sigterm_removes_the_container(tmp_path: Path, overrides: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-m", "sandbox.run_task", str(tmp_path), "--json"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and json.loads(out.stdout)["error"] and "task.toml" in out.stderr
    d = _harbor(tmp_path, "sleeper", "", {"environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n",
                                          "tests/test_x.py": "def test_a():\n    pass\n"})
    script = tmp_path / "sleep.sh"
    script.write_text("sleep 600\n")
    run_id = f"{RUN_ID}-sigterm"
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.run_task", str(d), "--script", str(script)], cwd=REPO,
                            env={**os.environ, "T1_RUN_ID": run_id}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = docker_client()
    deadline = time.monotonic() + 120
    while not client.containers(filters={"label": f"{LABEL_RUN}={run_id}"}) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(1.0)  # into the script's sleep
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not client.containers(all=True, filters={"label": f"{LABEL_RUN}={run_id}"})


@pytest.mark.docker
def test_sigterm_stops_check_tasks_before_its_next_task(tmp_path: Path, overrides: dict[str, str]) -> None:
    """Worker threads whose sandboxes the signal removed must not go on to the next task (each sleeps 600 s)."""
    for name in ("s1", "s2", "s3"):
        _harbor(tmp_path, name, "", {"environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n",
                                     "tests/test_x.py": "def test_a():\n    pass\n",
                                     "solution/solve.sh": "sleep 600\n"})
    run_id = f"{RUN_ID}-sigterm-check"
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.check_tasks", str(tmp_path), "--parallel", "2"],
                            cwd=REPO, env={**os.environ, "T1_RUN_ID": run_id}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    client = docker_client()
    deadline = time.monotonic() + 120
    while len(client.containers(filters={"label": f"{LABEL_RUN}={run_id}"})) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.communicate()
    assert not client.containers(all=True, filters={"label": f"{LABEL_RUN}={run_id}"})


@pytest.mark.docker
def test_check_tasks_reports_builds_scores_and_reasons(tmp_path: Path, overrides: dict[str, str]) -> None:
    tests = {"tests/test_outputs.py": "from pathlib import Path\n\ndef test_out():\n"
                                      "    assert Path('/app/out.txt').read_text() == 'ok\\n'\n"}
    dockerfile = {"environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n"}
    _harbor(tmp_path, "good", "", {**dockerfile, **tests, "solution/solve.sh": "echo ok > /app/out.txt\n"})
    _harbor(tmp_path, "broken", "", {**dockerfile, **tests, "solution/solve.sh": "no-such-tool --now\n"})
    _harbor(tmp_path, "unbuildable", "", {"environment/Dockerfile": "FROM t1-absent-image:1\n", **tests})
    rows = {r.task: r for r in check_tasks(sorted(p for p in tmp_path.iterdir()), base_image_overrides=overrides,
                                           parallel=2, run_id=RUN_ID)}
    assert rows["good"].solution == (1, 1) and rows["good"].nothing == (0, 1) and rows["good"].reason == ""
    assert rows["broken"].solution == (0, 1) and rows["broken"].solution_exit == 127
    assert "solution exit 127" in rows["broken"].reason and "no-such-tool" in rows["broken"].reason
    assert not rows["unbuildable"].builds and "t1-absent-image:1" in rows["unbuildable"].reason
    assert summary(list(rows.values())) == {"tasks": 3, "builds": 2, "solution_full": 1, "nothing_full": 0}


@pytest.mark.docker
def test_check_tasks_scales_the_time_limits_once(tmp_path: Path, overrides: dict[str, str]) -> None:
    """--timeout-multiplier 2 on a 1.5 s agent limit: a 4 s solution is cut at 3 s (it passed when check_tasks scaled
    the limits twice, 6 s)."""
    from sandbox.run_task import Harness

    _harbor(tmp_path, "slow", "[agent]\ntimeout_sec = 1.5\n",
            {"environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n",
             "tests/test_outputs.py": "from pathlib import Path\n\ndef test_out():\n    assert Path('/app/out.txt').exists()\n",
             "solution/solve.sh": "sleep 4; echo ok > /app/out.txt\n"})
    (row,) = check_tasks([tmp_path / "slow"], base_image_overrides=overrides, parallel=1, run_id=RUN_ID,
                         harness=Harness(timeout_multiplier=2.0))
    assert row.solution == (0, 1) and "(timed out)" in row.reason, row


@pytest.mark.docker
def test_no_containers_left_behind() -> None:
    left = docker_client().containers(all=True, filters={"label": LABEL_RUN})
    assert not [c for c in left if (c.get("Labels") or {}).get(LABEL_RUN, "").startswith(RUN_ID)]
