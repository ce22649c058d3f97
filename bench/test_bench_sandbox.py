"""Sandbox runtime speed: command round trip, pool acquire vs cold start, aggregate commands/s.

Targets on a 2-core box: median round trip <= 1 ms, pool acquire <= 50 ms, >= 400 commands/s over 16-32
sandboxes (Terminal-Bench's tmux round trip: 138-202 ms). Run: `python -m pytest bench/test_bench_sandbox.py -s`.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

from bench import box_cpu_s
from sandbox import DaemonUnreachable, DockerSandbox, SandboxPool, ensure_base_image
from sandbox.daemon import docker_client, owner_labels
from sandbox.runtime.settings import SandboxSettings

RUN_ID = f"bench-sandbox-{os.getpid()}"


@pytest.fixture(scope="module")
def image() -> str:
    try:
        docker_client()
    except DaemonUnreachable as e:
        pytest.skip(f"no Docker daemon answers: {e}")
    return ensure_base_image()


def _ms(seconds: list[float]) -> str:
    q = statistics.quantiles(seconds, n=20) if len(seconds) > 1 else seconds * 19
    return f"median {statistics.median(seconds) * 1e3:.3f} ms, p95 {q[18] * 1e3:.3f} ms (n={len(seconds)})"


def test_round_trip_true(benchmark, image):
    with DockerSandbox(image, run_id=RUN_ID) as sb:
        assert sb.run("true").exit_code == 0 and sb.run("echo $((6 * 7))").output == "42\n"  # correctness first
        times = []
        for _ in range(2000):
            t0 = time.perf_counter()
            sb.run("true")
            times.append(time.perf_counter() - t0)
        benchmark.pedantic(sb.run, args=("true",), rounds=500, iterations=1)
    print(f"\nround trip of `true`: {_ms(times)}  [target: median <= 1 ms]")


def test_pool_acquire_vs_cold_start(benchmark, image):
    cold = []
    for _ in range(5):
        t0 = time.perf_counter()
        sb = DockerSandbox(image, run_id=RUN_ID)
        cold.append(time.perf_counter() - t0)
        assert sb.run("echo cold").output == "cold\n"
        sb.close()
    warm = []
    with SandboxPool(image, size=4, run_id=RUN_ID) as pool:
        for _ in range(8):
            deadline = time.monotonic() + 60
            while pool.num_idle < 4 and time.monotonic() < deadline:
                time.sleep(0.05)  # measure acquire from a warm pool, not the refill
            t0 = time.perf_counter()
            sb = pool.acquire(timeout=60)
            warm.append(time.perf_counter() - t0)
            assert sb.run("echo warm").output == "warm\n"
            pool.release(sb)
        while pool.num_idle < 4:
            time.sleep(0.05)

        def acquire_release() -> None:
            pool.release(pool.acquire(timeout=60))

        benchmark.pedantic(acquire_release, rounds=1, iterations=1)
    print(f"\ncold start (create + start + shell): {_ms(cold)}\npool acquire: {_ms(warm)}  "
          "[target: <= 50 ms]")


@pytest.mark.parametrize("num_sandboxes", [16, 32])
def test_aggregate_commands_per_second(benchmark, image, num_sandboxes):
    boxes = []
    try:
        for i in range(num_sandboxes):
            boxes.append(DockerSandbox(image, SandboxSettings(memory="256m"), run_id=RUN_ID))
        errors: list[str] = []
        counts = [0] * num_sandboxes
        start = threading.Barrier(num_sandboxes + 1)
        duration_s = 3.0

        def worker(i: int) -> None:
            sb = boxes[i]
            start.wait()
            stop = time.monotonic() + duration_s
            while time.monotonic() < stop:
                r = sb.run(f"echo {i}")
                if r.output != f"{i}\n":
                    errors.append(repr(r))
                counts[i] += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_sandboxes)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        assert not errors, errors[:3]
        benchmark.pedantic(boxes[0].run, args=("true",), rounds=100, iterations=1)
    finally:
        for sb in boxes:
            sb.close()
    print(f"\n{num_sandboxes} sandboxes: {sum(counts) / elapsed:.0f} commands/s in aggregate "
          f"(min per sandbox {min(counts)}, max {max(counts)} in {elapsed:.1f} s)  [target: >= 400/s]")


def _preload_costs(api, image: str, n: int = 20) -> list[tuple[str, float, float]]:
    """Placing a task's files (a directory and three small files) into a created container, both ways
    `sandbox.runtime.preload` knows; creation and removal are outside the timed part."""
    import io
    import tarfile

    from sandbox.runtime import preload

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("app")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
        for i in range(3):
            data = f"line {i}\n".encode() * 50
            info = tarfile.TarInfo(f"app/data_{i}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    rows = []
    for name, place in (("preload: upper dir (sandbox.runtime.preload)", lambda cid: preload.place(api, cid, blob)),
                        ("preload: put_archive", lambda cid: api.put_archive(cid, "/", blob))):
        wall = cpu = 0.0
        for _ in range(n):
            cid = api.create_container(image, entrypoint=["sleep", "infinity"], command=[], working_dir="/app",
                                       labels=owner_labels(RUN_ID), host_config=api.create_host_config(
                                           network_mode="none"))["Id"]
            try:
                cpu0, t0 = box_cpu_s(), time.perf_counter()
                how = place(cid)
                wall, cpu = wall + time.perf_counter() - t0, cpu + box_cpu_s() - cpu0
            finally:
                api.remove_container(cid, force=True)
            if name.startswith("preload: upper") and how != "upper_dir":
                return rows + [(f"{name}: not possible here ({how})", float("nan"), float("nan"))]
        rows.append((name, wall / n, cpu / n))
    return rows


def test_daemon_call_costs(benchmark, image):
    """Wall time and whole-box CPU of each daemon call a verification or an episode makes (the daemon, runc and
    the kernel work for them, not this process alone): what sandbox.runtime.verify avoids, and what every episode
    pays."""
    import io
    import tarfile

    from sandbox.runtime.verify import _upper_dir_changes

    api = docker_client()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"def test_x():\n    assert True\n" * 20
        info = tarfile.TarInfo("bench-tests/test_a.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    def lifecycle() -> None:
        with DockerSandbox(image, run_id=RUN_ID) as s:
            s.run("true")

    with DockerSandbox(image, run_id=RUN_ID) as sb:
        assert sb.run("echo x > /tmp/j.xml").exit_code == 0
        info = api.inspect_container(sb.id)
        upper_available = _upper_dir_changes(info) is not None

        def exec_(cmd: str) -> None:
            exec_id = api.exec_create(sb.id, ["/bin/bash", "-c", cmd])["Id"]
            api.exec_start(exec_id)
            assert api.exec_inspect(exec_id)["ExitCode"] == 0

        calls = {
            "exec `true`": lambda: exec_("true"),
            "exec python3 -c pass": lambda: exec_("python3 -I -B -c pass"),
            "exec python3 -c 'import pytest'": lambda: exec_("python3 -I -B -c 'import pytest'"),
            "put_archive (one small file)": lambda: api.put_archive(sb.id, "/", buf.getvalue()),
            "get_archive (one small file)": lambda: b"".join(api.get_archive(sb.id, "/tmp/j.xml")[0]),
            "docker diff": lambda: api.diff(sb.id),
            "upper-dir walk (sandbox.runtime.verify)": lambda: _upper_dir_changes(info),
            "container create..remove": lifecycle,
        }
        rows = []
        for name, call in calls.items():
            n = 10 if name.startswith("container") else 30
            call()
            cpu0, t0 = box_cpu_s(), time.perf_counter()
            for _ in range(n):
                call()
            rows.append((name, (time.perf_counter() - t0) / n, (box_cpu_s() - cpu0) / n))
        benchmark.pedantic(api.inspect_container, args=(sb.id,), rounds=10, iterations=1)
    rows += _preload_costs(api, image)
    print(f"\ndaemon call costs, one container, idle box (upper-dir walk available: {upper_available})")
    print(f"{'call':36} {'wall ms':>8} {'box CPU ms':>11}")
    for name, wall, cpu in rows:
        print(f"{name:36} {wall * 1e3:>8.1f} {cpu * 1e3:>11.1f}")


def _p(seconds: list[float], q: float) -> float:
    """The q-quantile of `seconds`, in ms (nearest rank)."""
    ranked = sorted(seconds)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))] * 1e3


@pytest.fixture(scope="module")
def three_hosts(image):
    from tests.docker_hosts import ExtraDaemons

    with ExtraDaemons(3, tls=2) as fleet:
        fleet.load_image(image)
        yield fleet


def test_many_sandboxes_across_hosts(benchmark, image, three_hosts):
    """64 sandboxes open at once over three extra daemons (one over TCP+TLS), 100 commands each at once: command
    round trip p50/p99, and acquire latency cold (a start: create + start + shell) vs warm (a pool's idle one).
    T1_BENCH_QUICK: 24 sandboxes, 20 commands each; the correctness gates stay."""
    from concurrent.futures import ThreadPoolExecutor

    from sandbox.runtime.host_spec import HostSpec
    from sandbox.runtime.hosts import DockerHosts

    quick = bool(os.environ.get("T1_BENCH_QUICK"))
    num, commands = (24, 20) if quick else (64, 100)
    provider = DockerHosts([HostSpec.parse(three_hosts.spec(i, f"max={num // 2}")) for i in range(3)])
    settings = SandboxSettings(memory="256m")
    run_id = f"{RUN_ID}-hosts"
    try:
        cold = []
        for _ in range(8):  # cold: one start at a time, nothing else starting
            t0 = time.perf_counter()
            sb = provider.start(image, settings, run_id=run_id)
            cold.append(time.perf_counter() - t0)
            sb.close()
        with SandboxPool(image, size=num, demand=num, max_parallel_starts=8, settings=settings, run_id=run_id,
                         provider=provider) as pool:
            deadline = time.monotonic() + 600
            while pool.num_idle < num and time.monotonic() < deadline:
                time.sleep(0.1)
            boxes = [pool.acquire(timeout=60) for _ in range(num)]
            warm = [s for s, was_warm in pool.acquire_log if was_warm]
            load = provider.load()
            assert len(warm) == num and sum(load.values()) == num and all(n <= num // 2 for n in load.values()), load
            assert all(n >= 1 for n in load.values()), f"a host got no sandbox: {load}"
            errors: list[str] = []
            rtt: list[list[float]] = [[] for _ in boxes]

            def worker(i: int) -> None:
                for k in range(commands):
                    t0 = time.perf_counter()
                    r = boxes[i].run(f"echo {i}.{k}")
                    rtt[i].append(time.perf_counter() - t0)
                    if r.output != f"{i}.{k}\n":
                        errors.append(f"{boxes[i].host_name}: {r!r}")

            t0 = time.perf_counter()
            with ThreadPoolExecutor(num) as ex:
                list(ex.map(worker, range(num)))
            elapsed = time.perf_counter() - t0
            assert not errors, errors[:3]
            benchmark.pedantic(boxes[0].run, args=("true",), rounds=20, iterations=1)
            for sb in boxes:
                pool.release(sb)
    finally:
        provider.close()
    for i in range(3):
        assert not three_hosts.docker(i, "ps", "-aq", "--filter", f"label=t1.run_id={run_id}").split()
    flat = [s for per in rtt for s in per]
    print(f"\n{num} sandboxes over 3 hosts {load}, {commands} commands each at once: "
          f"round trip p50 {_p(flat, 0.5):.2f} ms, p99 {_p(flat, 0.99):.2f} ms, {len(flat) / elapsed:.0f} commands/s"
          f"\nacquire cold (start) p50 {_p(cold, 0.5):.0f} ms, p99 {_p(cold, 0.99):.0f} ms (n={len(cold)}); "
          f"warm (pool) p50 {_p(warm, 0.5):.3f} ms, p99 {_p(warm, 0.99):.3f} ms (n={len(warm)})")
