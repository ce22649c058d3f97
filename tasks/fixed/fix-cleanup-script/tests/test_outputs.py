import os
import pathlib
import subprocess
import tempfile
import time

import pytest

OLD = ["a.log", "sub dir/b.log", "sub dir/deeper/c.tmp"]
NEW = ["fresh.log", "sub dir/new.txt"]


@pytest.fixture(scope="module")
def run():
    root = pathlib.Path(tempfile.mkdtemp(prefix="clean ")) / "my files"
    now = time.time()
    for rel, age_days in [(p, 30) for p in OLD] + [(p, 1) for p in NEW]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
        os.utime(path, (now - age_days * 86400, now - age_days * 86400))
    old_dir = root / "sub dir" / "deeper"
    os.utime(old_dir, (now - 40 * 86400, now - 40 * 86400))
    out = subprocess.run(["bash", "/app/cleanup.sh", str(root), "7"], capture_output=True, text=True, timeout=30)
    return root, out


def test_old_top_level_file_deleted(run):
    root, _ = run
    assert not (root / "a.log").exists()


def test_old_nested_files_deleted(run):
    root, _ = run
    assert not any((root / p).exists() for p in OLD)


def test_recent_files_kept(run):
    root, _ = run
    assert all((root / p).is_file() for p in NEW)


def test_directories_kept(run):
    root, _ = run
    assert (root / "sub dir" / "deeper").is_dir()


def test_prints_count(run):
    _, out = run
    assert out.stdout.strip() == "deleted 3"
