import pathlib
import shutil
import subprocess

import pytest

BACKUPS = pathlib.Path("/app/backups")
FILES = {"report.txt": "quarterly numbers\n", "meeting notes.txt": "agenda: budget\n", "todo.txt": "ship it\n"}


@pytest.fixture(scope="module")
def result():
    shutil.rmtree(BACKUPS, ignore_errors=True)
    return subprocess.run(["bash", "/app/backup.sh"], capture_output=True, text=True, timeout=30)


def test_exit_status_zero(result):
    assert result.returncode == 0


def test_plain_names_backed_up(result):
    assert (BACKUPS / "report.txt.bak").is_file() and (BACKUPS / "todo.txt.bak").is_file()


def test_name_with_spaces_backed_up(result):
    assert (BACKUPS / "meeting notes.txt.bak").is_file()


def test_backup_contents(result):
    assert all((BACKUPS / f"{name}.bak").read_text() == text for name, text in FILES.items())


def test_only_txt_files(result):
    assert sorted(p.name for p in BACKUPS.iterdir()) == sorted(f"{n}.bak" for n in FILES)
