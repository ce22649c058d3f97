import subprocess


def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True, text=True, timeout=20).stdout



def test_head_message():
    assert git("log", "-1", "--format=%s").strip() == "Fix greeting"


def test_one_new_commit_on_top():
    assert git("rev-list", "--count", "HEAD").strip() == "2" and git("log", "-1", "--format=%s", "HEAD~1").strip() == "Initial commit"


def test_commit_touches_only_app():
    assert git("show", "--name-only", "--format=", "HEAD").split() == ["src/app.py"]


def test_committed_content():
    assert 'f"Hello, {name}!"' in git("show", "HEAD:src/app.py")


def test_other_changes_left_uncommitted():
    status = git("status", "--porcelain").splitlines()
    assert " M README.md" in status and "?? notes.tmp" in status
