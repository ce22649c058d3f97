import subprocess


def git(*args):
    return subprocess.run(["git", "-C", "/app/repo", *args], capture_output=True, text=True, timeout=20).stdout



def test_head_is_merge_commit():
    assert len(git("log", "-1", "--format=%P").split()) == 2


def test_feature_merged():
    rc = subprocess.run(["git", "-C", "/app/repo", "merge-base", "--is-ancestor", "feature", "HEAD"], timeout=20).returncode
    assert rc == 0 and git("rev-parse", "HEAD").strip() != git("rev-parse", "feature").strip()


def test_version_from_feature():
    assert git("show", "HEAD:VERSION").strip() == "1.1.0"


def test_both_sides_kept():
    files = git("ls-tree", "--name-only", "HEAD").split()
    assert "feature.txt" in files and "hotfix.txt" in files


def test_on_main():
    assert git("symbolic-ref", "HEAD").strip() == "refs/heads/main"


def test_clean_tree_without_conflict_markers():
    assert git("status", "--porcelain").strip() == "" and "<<<<<<<" not in git("show", "HEAD:VERSION")
