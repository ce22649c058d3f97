import pathlib
import subprocess
import time


def once(*cmd, timeout=20):
    return subprocess.run(["bash", "/app/once.sh", *cmd], capture_output=True, text=True, timeout=timeout)


def test_runs_command_and_passes_status():
    assert once("sh", "-c", "exit 4").returncode == 4 and once("echo", "hello").stdout.strip() == "hello"


def test_second_instance_refused_while_first_runs():
    first = subprocess.Popen(["bash", "/app/once.sh", "sleep", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.7)
        t0 = time.time()
        out = once("touch", "/tmp/once_should_not_exist")
        elapsed = time.time() - t0
    finally:
        first.wait(timeout=20)
    assert out.returncode == 75 and elapsed < 2 and not pathlib.Path("/tmp/once_should_not_exist").exists()


def test_runs_again_after_first_finished():
    first = subprocess.Popen(["bash", "/app/once.sh", "sleep", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first.wait(timeout=20)
    assert once("true").returncode == 0


def test_stale_lock_file_does_not_block():
    pathlib.Path("/app/once.lock").write_text("12345\n")
    assert once("echo", "ok").stdout.strip() == "ok"
