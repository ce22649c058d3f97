import grp
import os
import pwd
import stat
import subprocess

SHARED = "/srv/shared"


def test_group_exists():
    assert grp.getgrnam("devs")


def test_users_in_group():
    groups = {u: subprocess.run(["id", "-nG", u], capture_output=True, text=True).stdout.split() for u in ("alice", "bob")}
    assert all("devs" in g for g in groups.values())


def test_users_have_homes():
    assert all(os.path.isdir(pwd.getpwnam(u).pw_dir) for u in ("alice", "bob"))


def test_directory_owner_and_mode():
    st = os.stat(SHARED)
    assert st.st_uid == 0 and grp.getgrgid(st.st_gid).gr_name == "devs" and stat.S_IMODE(st.st_mode) == 0o2770


def test_new_files_belong_to_devs():
    path = f"{SHARED}/from_alice.txt"
    out = subprocess.run(["runuser", "-u", "alice", "--", "touch", path], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and grp.getgrgid(os.stat(path).st_gid).gr_name == "devs"


def test_outsiders_cannot_enter():
    subprocess.run(["useradd", "-M", "t1_outsider"], capture_output=True, timeout=20)
    out = subprocess.run(["runuser", "-u", "t1_outsider", "--", "ls", SHARED], capture_output=True, text=True, timeout=20)
    assert os.path.isdir(SHARED) and out.returncode != 0
