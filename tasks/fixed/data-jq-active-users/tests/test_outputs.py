import pathlib

OUT = pathlib.Path("/app/active.txt")
EXPECTED = ['abe', 'lena', 'mara']


def names():
    return OUT.read_text().split()


def test_output_exists():
    assert OUT.is_file()


def test_no_inactive_users():
    got = names()
    assert got and "ben" not in got and "carl" not in got


def test_no_users_under_30():
    got = names()
    assert got and "zoe" not in got and "ivy" not in got


def test_exact_sorted_names():
    assert OUT.read_text().splitlines() == EXPECTED
