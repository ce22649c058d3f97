import subprocess


def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True, text=True, timeout=20).stdout



import pathlib
import re

ANSWER = pathlib.Path("/app/answer.txt")


def expected():
    for commit in git("rev-list", "--reverse", "HEAD").split():
        if "API_KEY" in git("show", f"{commit}:settings.py"):
            return commit
    raise AssertionError("no commit adds API_KEY")


def test_answer_exists():
    assert ANSWER.is_file()


def test_answer_is_full_hash():
    assert re.fullmatch(r"[0-9a-f]{40}", ANSWER.read_text().strip())


def test_answer_is_a_commit():
    assert git("cat-file", "-t", ANSWER.read_text().strip()).strip() == "commit"


def test_answer_is_the_commit_that_added_the_key():
    assert ANSWER.read_text().strip() == expected()


def test_repository_unchanged():
    assert git("rev-list", "--count", "HEAD").strip() == "8" and git("log", "-1", "--format=%s").strip() == "Add changelog"
