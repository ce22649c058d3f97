import os
import pathlib
import subprocess
import time

import pytest

PIDFILE = pathlib.Path("/app/worker.pid")


def svc(cmd):
    # Output of `start` goes nowhere: a worker that kept the pipe open would otherwise hang the test.
    if cmd == "start":
        return subprocess.run(["bash", "/app/svc.sh", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=20)
    return subprocess.run(["bash", "/app/svc.sh", cmd], capture_output=True, text=True, timeout=20)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return "State:\tZ" not in status


def workers():
    out = subprocess.run(["pgrep", "-f", "worker.sh"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def started():
    svc("start")
    time.sleep(1.0)
    return int(PIDFILE.read_text().strip())


def test_start_writes_pid_of_running_worker(started):
    assert alive(started) and started in workers()


def test_worker_runs_in_background(started):
    size = pathlib.Path("/app/heartbeat.log").stat().st_size
    time.sleep(0.8)
    assert pathlib.Path("/app/heartbeat.log").stat().st_size > size


def test_status_running(started):
    out = svc("status")
    assert out.returncode == 0 and out.stdout.strip() == "running"


def test_second_start_does_not_spawn_another(started):
    svc("start")
    time.sleep(0.5)
    assert len(workers()) == 1


def test_stop_and_status_stopped(started):
    svc("stop")
    deadline = time.time() + 5
    while alive(started) and time.time() < deadline:
        time.sleep(0.1)
    out = svc("status")
    assert not alive(started) and not PIDFILE.exists() and out.returncode == 3 and out.stdout.strip() == "stopped"
