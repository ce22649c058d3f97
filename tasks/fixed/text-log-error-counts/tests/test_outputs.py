import pathlib

OUT = pathlib.Path("/app/error_counts.txt")
EXPECTED = ['api.log 3', 'db.log 0', 'web.log 4']


def lines():
    return OUT.read_text().splitlines()


def test_output_exists():
    assert OUT.is_file()


def test_one_line_per_log_file():
    assert [x.split()[0] for x in lines()] == [e.split()[0] for e in EXPECTED]


def test_counts_ignore_error_inside_messages():
    got = dict(x.split() for x in lines())
    assert got["api.log"] == "3" and got["web.log"] == "4"


def test_zero_counts_listed():
    assert "db.log 0" in lines()


def test_exact_output():
    assert lines() == EXPECTED
