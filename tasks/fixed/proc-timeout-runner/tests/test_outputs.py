import pathlib
import subprocess
import time

import pytest

RESULTS = pathlib.Path("/app/results.txt")


@pytest.fixture(scope="module")
def run():
    RESULTS.unlink(missing_ok=True)
    t0 = time.time()
    try:
        subprocess.run(["bash", "/app/runjobs.sh"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except subprocess.TimeoutExpired:
        pass
    return time.time() - t0


def results():
    return RESULTS.read_text().splitlines()


def test_finishes_quickly(run):
    assert run < 10 and RESULTS.exists()


def test_one_line_per_executable_job_in_order(run):
    assert [x.split()[0] for x in results()] == ["a_ok.sh", "b_fail.sh", "c_hang.sh", "d_ok.sh"]


def test_statuses(run):
    assert results() == ["a_ok.sh ok", "b_fail.sh failed", "c_hang.sh timeout", "d_ok.sh ok"]


def test_hung_job_not_left_running(run):
    out = subprocess.run(["pgrep", "-f", "c_hang.sh"], capture_output=True, text=True)
    assert RESULTS.exists() and out.stdout.strip() == ""
