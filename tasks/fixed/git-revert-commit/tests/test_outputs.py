import subprocess


def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True, text=True, timeout=20).stdout



ORIGINAL = ["Add docs", "Change default port", "Add logging", "Initial commit"]


def test_port_restored_in_head():
    assert "port = 8080" in git("show", "HEAD:config.ini")


def test_history_kept_below_new_commit():
    assert git("log", "--format=%s", "HEAD~1").splitlines() == ORIGINAL


def test_exactly_one_new_commit():
    assert git("rev-list", "--count", "HEAD").strip() == "5"


def test_new_commit_touches_only_config():
    assert git("show", "--name-only", "--format=", "HEAD").split() == ["config.ini"]


def test_other_changes_kept():
    files = git("ls-tree", "--name-only", "HEAD").split()
    assert "docs.md" in files and "log.py" in files


def test_working_tree_clean():
    assert git("status", "--porcelain").strip() == ""
