"""TB1 compose files (sandbox.tasks.compose) and the services started beside a sandbox (sandbox.runtime.services).

The fixture tasks are written here (never copied from a public collection) in the shapes the public ones use:
a `client` beside a built `server` it waits on to be healthy (a mock website), an agent service found by the
harness's image variable instead of its name, fixed addresses on a fixed subnet. The reference on the daemon is
what Docker itself reports: the containers and networks that exist, the health it judged, the routes a container
has.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from sandbox.tasks.compose import Healthcheck, interpolate, load_compose
from sandbox.tasks.format import TaskFormatError, load_task

RUN_ID = f"t1-test-compose-{os.getpid()}"


def _task(root: Path, compose: str, files: dict[str, str] | None = None) -> Path:
    d = root / "task"
    if not any(rel.startswith("tests/") for rel in files or {}):
        files = {"tests/test_x.py": "def test_a():\n    pass\n", **(files or {})}
    all_files = {"task.yaml": "instruction: Do the thing.\n", "docker-compose.yaml": compose,
                 "Dockerfile": "FROM debian:bookworm\n", **(files or {})}
    for rel, text in all_files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    return d


def test_services_are_read_in_dependency_order_with_their_settings(tmp_path: Path) -> None:
    d = _task(tmp_path, """
        services:
          web:
            build: .
            image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
            environment:
              - TEST_DIR=${T_BENCH_TEST_DIR}
              - API_URL=http://api:8000
              - EMPTY=${NOT_SET}
              - WITH_DEFAULT=${NOT_SET:-fallback}
            depends_on:
              api:
                condition: service_healthy
            dns: [172.30.0.10]
            extra_hosts: ["site.local:172.30.0.30"]
            networks:
              lab:
                ipv4_address: 172.30.0.30
          api:
            build: {context: api}
            command: python3 -m http.server 8000 --bind 0.0.0.0
            depends_on: [db]
            healthcheck:
              test: ["CMD", "true"]
              interval: 1m30s
              timeout: 250ms
              retries: 2
            networks:
              lab:
                aliases: [api.local]
          db:
            image: example/db:1
            environment: {PASSWORD: secret, PRICE: "$$5"}
        networks:
          lab:
            ipam:
              config:
                - subnet: 172.30.0.0/16
        """, {"api/Dockerfile": "FROM debian:bookworm\n"})
    compose = load_task(d).compose
    assert compose is not None and compose.agent.name == "web"  # found by the harness's image variable
    assert [s.name for s in compose.services] == ["db", "api"]  # dependencies first
    db, api = compose.services
    assert db.image == "example/db:1" and db.context is None and db.environment == (("PASSWORD", "secret"),
                                                                                      ("PRICE", "$5"))
    assert api.context == d / "api" and api.dockerfile == d / "api" / "Dockerfile"
    assert api.command == ("python3", "-m", "http.server", "8000", "--bind", "0.0.0.0")
    assert api.depends_on == (("db", "service_started"),) and api.aliases == ("api.local",)
    assert api.healthcheck == Healthcheck(test=("CMD", "true"), interval_s=90.0, timeout_s=0.25, retries=2)
    assert api.healthcheck.docker()["interval"] == 90 * 10**9
    assert compose.agent.depends_on == (("api", "service_healthy"),)
    assert compose.agent_env == (("TEST_DIR", "/tests"), ("API_URL", "http://api:8000"), ("EMPTY", ""),
                                 ("WITH_DEFAULT", "fallback"))
    assert compose.agent.ipv4_address == "172.30.0.30" and compose.subnet == "172.30.0.0/16"
    assert compose.dns == ("172.30.0.10",) and compose.extra_hosts == (("site.local", "172.30.0.30"),)


def test_interpolation_is_composes() -> None:
    assert interpolate("${T_BENCH_TEST_DIR}/x $T_BENCH_TEST_DIR") == "/tests/x /tests"
    assert interpolate("a${UNSET}b ${UNSET-d} ${UNSET:-e} $$HOME") == "ab d e $HOME"


@pytest.mark.parametrize(("compose", "match"), [
    ("services:\n  client:\n    build: .\n    depends_on: [db]\n", r"depends_on'.*no service named 'db'"),
    ("services:\n  client:\n    build: .\n    depends_on: {db: {condition: service_healthy}}\n"
     "  db:\n    image: x\n", "waits for 'db' to be healthy, but 'db' has no healthcheck"),
    ("services:\n  client:\n    build: .\n  a:\n    image: x\n    depends_on: [b]\n  b:\n    image: x\n"
     "    depends_on: [a]\n", "in a cycle"),
    ("services:\n  client:\n    build: .\n  a:\n    image: x\n    healthcheck: {test: [CMD, 'true'], "
     "interval: soon}\n", r"interval'.*duration like '5s'"),
    ("services:\n  client:\n    build: .\n  a:\n    image: x\n    healthcheck: {test: [RUN, 'true']}\n",
     r"healthcheck.test'.*expected \['CMD'"),
    ("services:\n  client:\n    build: .\n    depends_on: {a: {condition: later}}\n  a:\n    image: x\n",
     "condition must be one of"),
    ("services:\n  client:\n    build: .\n  a:\n    command: ['true']\n", "neither a build section nor an image"),
    ("services:\n  client:\n    build: .\n  a:\n    image: x\n    depends_on: [client]\n",
     "depends on the agent's service 'client', which T1 starts last"),
    ("services:\n  client:\n    build: ../elsewhere\n", "missing or outside the task directory"),
    ("services:\n  one:\n    build: .\n  two:\n    build: .\n", "no service named 'client'"),
    ("services:\n  client:\n    build: .\n    networks:\n      n:\n        ipv4_address: 300.1.1.1\n",
     "not an IPv4 address"),
])
def test_malformed_compose_files_name_the_field(tmp_path: Path, compose: str, match: str) -> None:
    with pytest.raises(TaskFormatError, match=match):
        load_compose(_task(tmp_path, compose) / "docker-compose.yaml", tmp_path / "task")


# ---- on the daemon -------------------------------------------------------------------------------------------

_SERVED = "served by the page service\n"
_WEBSITE = {
    "docker-compose.yaml": """
        services:
          client:
            build: .
            image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
            environment:
              - TEST_DIR=${T_BENCH_TEST_DIR}
              - PAGE_URL=http://server:8000/page.txt
            depends_on:
              server:
                condition: service_healthy
          server:
            build:
              context: server
            command: ["python3", "-m", "http.server", "8000"]
            healthcheck:
              test: ["CMD", "python3", "-c",
                     "import urllib.request; urllib.request.urlopen('http://localhost:8000/page.txt')"]
              interval: 1s
              timeout: 5s
              retries: 30
            networks:
              web:
                aliases: [pages.local]
        networks:
          web:
            driver: bridge
        """,
    "Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n",
    "server/Dockerfile": "FROM debian:bookworm\nWORKDIR /srv\nCOPY page.txt .\n",
    "server/page.txt": _SERVED,
    "solution.sh": "python3 -c \"import os, urllib.request; "
                   "open('/app/out.txt', 'wb').write(urllib.request.urlopen(os.environ['PAGE_URL']).read())\"\n",
    "tests/test_outputs.py": """
        import urllib.request
        from pathlib import Path

        def test_copied_the_page():
            assert Path('/app/out.txt').read_text() == 'served by the page service\\n'

        def test_server_still_answers_the_tests():
            page = urllib.request.urlopen('http://pages.local:8000/page.txt').read()
            assert page == Path('/app/out.txt').read_bytes()
        """,
}


@pytest.fixture(scope="module")
def overrides() -> dict[str, str]:
    from sandbox.images.task_images import default_base_image_overrides
    return default_base_image_overrides(trust_host_ca=True)


def _leftovers(run_id: str) -> tuple[list, list]:
    from sandbox.daemon import LABEL_RUN, docker_client
    api = docker_client()
    label = {"label": f"{LABEL_RUN}={run_id}"}
    return api.containers(all=True, filters=label), api.networks(filters=label)


@pytest.mark.docker
def test_a_service_runs_beside_the_sandbox_on_a_private_network(tmp_path: Path, overrides: dict[str, str]) -> None:
    """The agent reaches the server by its name and alias, after Docker judged it healthy; the network has no
    route out (Docker's `Internal`); every container is labelled and limited; nothing is left after close."""
    from sandbox.daemon import LABEL_RUN, docker_client
    from sandbox.runtime.docker_sandbox import DockerSandbox
    from sandbox.runtime.settings import SandboxSettings
    from sandbox.images.task_images import build_task_image

    task = load_task(_task(tmp_path, "", _WEBSITE))
    image = build_task_image(task, base_image_overrides=overrides)
    assert image.compose is task.compose and len(image.service_refs) == 1
    api = docker_client()
    settings = SandboxSettings.for_task(task, network=False, memory_mb=512)
    with DockerSandbox(image, settings, run_id=RUN_ID) as sb:
        assert sb.services is not None
        (server,) = sb.services.containers.values()
        info = api.inspect_container(server)
        assert info["State"]["Health"]["Status"] == "healthy"  # the sandbox started after Docker said so
        assert info["Config"]["Labels"][LABEL_RUN] == RUN_ID and info["HostConfig"]["Init"]
        assert info["HostConfig"]["Memory"] == 512 << 20 and info["HostConfig"]["PidsLimit"] > 0
        assert api.inspect_network(sb.services.network)["Internal"] is True
        assert list(api.inspect_container(sb.id)["NetworkSettings"]["Networks"]) == [sb.services.network]
        r = sb.run("python3 -c \"import os, urllib.request; print(urllib.request.urlopen(os.environ['PAGE_URL'])"
                   ".read().decode(), end='')\"", timeout=30)
        assert (r.exit_code, r.output) == (0, _SERVED)
        r = sb.run("python3 -c \"import urllib.request; print(urllib.request.urlopen("
                   "'http://pages.local:8000/page.txt').read().decode(), end='')\"", timeout=30)
        assert (r.exit_code, r.output) == (0, _SERVED)  # the alias
        r = sb.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\"", timeout=30)
        assert r.exit_code != 0  # no route out of an internal network
    assert _leftovers(RUN_ID) == ([], [])


@pytest.mark.docker
def test_reference_solution_and_do_nothing_agent_through_check_tasks(tmp_path: Path,
                                                                     overrides: dict[str, str]) -> None:
    from sandbox.check_tasks import check_tasks

    d = _task(tmp_path, "", _WEBSITE)
    (row,) = check_tasks([d], base_image_overrides=overrides, parallel=1, run_id=RUN_ID)
    assert row.builds and row.solution == (2, 2) and row.nothing == (0, 2), row
    assert _leftovers(RUN_ID) == ([], [])


@pytest.mark.docker
def test_a_service_that_exits_fails_the_sandbox_with_its_output(tmp_path: Path, overrides: dict[str, str]) -> None:
    from sandbox.runtime.docker_sandbox import DockerSandbox
    from sandbox.runtime.services import ServiceFailed
    from sandbox.runtime.settings import SandboxSettings
    from sandbox.images.task_images import build_task_image

    task = load_task(_task(tmp_path, """
        services:
          client:
            build: .
            depends_on:
              db:
                condition: service_healthy
          db:
            build: .
            command: ["sh", "-c", "echo cannot open the database; exit 3"]
            healthcheck:
              test: ["CMD", "true"]
              interval: 1s
        """))
    image = build_task_image(task, base_image_overrides=overrides)
    with pytest.raises(ServiceFailed, match=r"(?s)service 'db', which 'client' waits for \(service_healthy\): "
                                            r"exited with status 3.*cannot open the database"):
        DockerSandbox(image, SandboxSettings.for_task(task, network=False), run_id=RUN_ID)
    assert _leftovers(RUN_ID) == ([], [])


@pytest.mark.docker
def test_a_service_image_that_is_not_on_the_daemon_is_named(tmp_path: Path, overrides: dict[str, str]) -> None:
    from sandbox.images.task_images import TaskImageError, build_task_image

    task = load_task(_task(tmp_path, "services:\n  client:\n    build: .\n  db:\n    image: t1-absent/postgres:15\n"))
    with pytest.raises(TaskImageError, match=r"service 'db' runs the image 't1-absent/postgres:15', which is not "
                                             "present locally"):
        build_task_image(task, base_image_overrides=overrides)


@pytest.mark.docker
def test_reap_removes_the_services_and_network_of_a_run(tmp_path: Path, overrides: dict[str, str]) -> None:
    """A run killed before close() (its sandbox never closed): `sandbox.runtime.reap` removes its containers, then its
    network."""
    from sandbox.runtime.docker_sandbox import DockerSandbox, _LIVE
    from sandbox.runtime.reap import reap
    from sandbox.runtime.settings import SandboxSettings
    from sandbox.images.task_images import build_task_image

    task = load_task(_task(tmp_path, "", _WEBSITE))
    image = build_task_image(task, base_image_overrides=overrides)
    run_id = f"{RUN_ID}-reap"
    sb = DockerSandbox(image, SandboxSettings.for_task(task, network=False), run_id=run_id)
    _LIVE.discard(sb)  # as if its process died: nothing closes it
    containers, networks = _leftovers(run_id)
    assert len(containers) == 2 and len(networks) == 1
    assert reap(run_id) == 2
    assert _leftovers(run_id) == ([], [])
