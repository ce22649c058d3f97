import pathlib
import signal
import subprocess
import time

import pytest


@pytest.fixture(scope="module")
def scenario():
    for name in ("ticks.log", "shutdown.log"):
        pathlib.Path("/app", name).unlink(missing_ok=True)
    proc = subprocess.Popen(["bash", "/app/graceful.sh"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.6)
    running = proc.poll() is None
    ticks = pathlib.Path("/app/ticks.log").read_text().split() if pathlib.Path("/app/ticks.log").exists() else []
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    return {"running": running, "ticks": ticks, "code": code, "stop_s": time.time() - t0}


def test_keeps_running_and_ticks(scenario):
    assert scenario["running"] and 2 <= len(scenario["ticks"]) <= 5 and set(scenario["ticks"]) == {"tick"}


def test_exits_soon_after_sigterm(scenario):
    assert scenario["code"] is not None and scenario["stop_s"] < 2.0


def test_exit_status_zero(scenario):
    assert scenario["code"] == 0


def test_shutdown_message(scenario):
    assert pathlib.Path("/app/shutdown.log").read_text().strip() == "shutdown complete"
