import os
import pathlib
import stat

OUT = pathlib.Path("/app/world_writable.txt")
EXPECTED = ['/app/tree/a.txt', '/app/tree/bin/run.sh', '/app/tree/docs', '/app/tree/docs/c.md']
FINAL_MODES = {'/app/tree/a.txt': 420, '/app/tree/b.txt': 420, '/app/tree/docs/c.md': 436, '/app/tree/docs': 509, '/app/tree/bin/run.sh': 493, '/app/tree/bin/safe.sh': 493, '/app/tree/bin': 493, '/app/tree/data/d.csv': 384, '/app/tree/data': 509}


def test_list_exists():
    assert OUT.is_file()


def test_list_exact_and_sorted():
    assert OUT.read_text().splitlines() == EXPECTED


def test_no_world_writable_left():
    assert not any(os.stat(p).st_mode & stat.S_IWOTH for p in ["/app/tree", *map(str, pathlib.Path("/app/tree").rglob("*"))])


def test_other_bits_unchanged():
    assert all(stat.S_IMODE(os.stat(p).st_mode) & ~0o002 == m for p, m in FINAL_MODES.items())


def test_modes_exact():
    assert all(stat.S_IMODE(os.stat(p).st_mode) == m for p, m in FINAL_MODES.items())
